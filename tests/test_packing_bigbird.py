"""hfx-bigbird on packed (padding-free) batches: every document of a packed row gets exactly what its own forward gives
(the dense fallback of short documents, the dense pattern path, the block-sparse path with its seeded random blocks),
under ``"sdpa"``, ``"eager"`` and ``"flex_attention"``, in the three forms of transformers'
``DataCollatorWithFlattening``, in eval and training mode, with padding, gradients and attention maps."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DataCollatorWithFlattening

import hf_xformers.ops.attention_switch as switch
from hf_xformers import HfxBigBirdConfig, HfxBigBirdModel
from hf_xformers.attention import block_sparse_flex, block_sparse_packed
from hf_xformers.attention.block_sparse import HfxBlockSparseSelfAttention
from hf_xformers.attention.block_sparse_layout import plan_documents
from hf_xformers.ops.input_checks import as_if_on_accelerator
from hf_xformers.ops.packing import document_ids_from_inputs

from .device_checks import HostReadCounter
from .host_reads import HostReadCounter as OperatorCounter

TINY = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    sep_token_id=2,
    block_size=4,
    num_random_blocks=2,
)
# At b = 4, r = 2 a document of at most r + 4 = 6 blocks (24 tokens) takes the dense fallback on its own, one of 7
# blocks (25 to 28 tokens) the dense pattern path (`dense_is_cheaper`), longer ones the block-sparse path with random
# blocks; 45, 27, 13, 6 and 1 are no multiple of the block size.
LENGTHS = (13, 27, 45, 1, 70, 6, 32)
# The collator's forms that mark documents (position_ids alone are positions: tests/test_packing_boundaries.py).
FORMS = {
    "seq_idx": dict(return_seq_idx=True),
    "cu_seq_lens": dict(return_flash_attn_kwargs=True),
}
ATOL = 1e-5
# How a packed row runs under "sdpa": each document through the layer's own forward (the CPU in eager mode:
# DocumentBlocks.spans), or the block-aligned layout over the whole row (accelerators and traced graphs), which a CPU
# test reaches as if on an accelerator.
LAYOUTS = {"per_document": contextlib.nullcontext, "aligned": as_if_on_accelerator}


def build(**overrides) -> HfxBigBirdModel:
    """A tiny model, weights perturbed so that attention is far from uniform (every key block matters)."""
    torch.manual_seed(0)
    model = HfxBigBirdModel(HfxBigBirdConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def documents(lengths=LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, TINY["vocab_size"], (n,), generator=g) for n in lengths]


def pack(docs: list[torch.Tensor], form: str) -> dict:
    batch = DataCollatorWithFlattening(position_ids_start=0, **FORMS[form])([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    return batch


def spans(docs):
    start = 0
    for d in docs:
        yield slice(start, start + d.numel())
        start += d.numel()


def assert_documents_match(packed: torch.Tensor, model, docs, row: int = 0, starts=None) -> None:
    """``packed`` ``(batch, seq, hidden)``: each document's span equals its own forward."""
    for i, (span, d) in enumerate(zip(spans(docs), docs)):
        if starts is not None:
            span = slice(starts[i], starts[i] + d.numel())
        solo = model(input_ids=d[None]).last_hidden_state[0]
        torch.testing.assert_close(packed[row, span], solo, atol=ATOL, rtol=0, msg=f"document {i} ({d.numel()} tokens)")


@pytest.fixture
def flex_calls(monkeypatch) -> list:
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return switch.flex_attention(*args, **kwargs)

    monkeypatch.setattr(block_sparse_flex, "flex_attention", counted)
    return calls


def test_the_documents_take_every_path_of_their_own_forwards():
    layer = build().encoder.layer[0].attention.self
    blocks = [-(-n // layer.block_size) for n in LENGTHS]
    assert any(c <= layer.num_random_blocks + 4 for c in blocks)  # dense fallback
    assert any(c > layer.num_random_blocks + 4 and layer.dense_is_cheaper(c) for c in blocks)  # dense pattern
    assert any(not layer.dense_is_cheaper(c) for c in blocks)  # block-sparse
    # The long documents really depend on their random blocks: another seed gives other outputs.
    long_doc = documents()[4][None]
    with torch.no_grad():
        other = build(random_seed=5)(input_ids=long_doc).last_hidden_state
        assert (build()(input_ids=long_doc).last_hidden_state - other).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize(
    "implementation, layout", [("sdpa", "per_document"), ("sdpa", "aligned"), ("eager", "per_document")]
)
def test_packed_documents_match_their_own_forwards(implementation, layout, form, mode):
    """Training uses the seeded blocks (``fixed_random_blocks``): freshly drawn ones differ between any two forwards."""
    model = build(fixed_random_blocks=True)
    model.set_attn_implementation(implementation)
    model.train(mode == "train")
    docs = documents()
    with torch.no_grad():
        with LAYOUTS[layout]():
            packed = model(**pack(docs, form))
        assert_documents_match(packed.last_hidden_state, model, docs)
        solo_pooled = torch.cat([model(input_ids=d[None]).pooler_output for d in docs])
    torch.testing.assert_close(packed.pooler_output, solo_pooled, atol=ATOL, rtol=0)


@pytest.mark.parametrize("form", ["seq_idx", "cu_seq_lens"])
def test_packed_documents_under_flex_attention(form, flex_calls, monkeypatch):
    """FlexAttention's eager form (quick for tiny inputs) on the block-aligned layout."""
    monkeypatch.setattr(switch, "FLEX_COMPILE", False)
    model = build()
    docs = documents()
    with torch.no_grad():
        model.set_attn_implementation("flex_attention")
        packed = model(**pack(docs, form)).last_hidden_state
        assert len(flex_calls) == TINY["num_hidden_layers"]
        model.set_attn_implementation("sdpa")
        assert_documents_match(packed, model, docs)


def test_packed_documents_under_compiled_flex_attention(flex_calls):
    """The compiled kernel, the default form of ``"flex_attention"`` (inference on the CPU)."""
    assert switch.FLEX_COMPILE
    model = build()
    docs = documents((9, 45, 30))
    with torch.no_grad():
        model.set_attn_implementation("flex_attention")
        packed = model(**pack(docs, "seq_idx")).last_hidden_state
        assert flex_calls
        model.set_attn_implementation("sdpa")
        assert_documents_match(packed, model, docs)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_training_draws_stay_inside_their_documents(implementation):
    """Fresh random blocks in training: a document's outputs do not depend on the other documents, and documents
    whose pattern is complete (at most r + 4 blocks) equal their own forward whatever was drawn."""
    model = build().train()
    model.set_attn_implementation(implementation)
    docs = documents()
    changed = [d.clone() for d in docs]
    changed[2] = torch.flip(changed[2], [0])  # the same lengths, so the same layout and draws
    with torch.no_grad():
        torch.manual_seed(3)
        first = model(**pack(docs, "seq_idx")).last_hidden_state
        torch.manual_seed(3)
        second = model(**pack(changed, "seq_idx")).last_hidden_state
        for i, span in enumerate(spans(docs)):
            if i != 2:
                torch.testing.assert_close(first[0, span], second[0, span], atol=ATOL, rtol=0)
            if -(-docs[i].numel() // TINY["block_size"]) <= TINY["num_random_blocks"] + 4:
                torch.testing.assert_close(first[0, span], model(input_ids=docs[i][None]).last_hidden_state[0])
        # The long documents were drawn afresh (not the seeded eval pattern).
        long_span = list(spans(docs))[4]
        seeded = model.eval()(**pack(docs, "seq_idx")).last_hidden_state
        assert (first[0, long_span] - seeded[0, long_span]).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_padded_rows_of_packed_documents(implementation):
    """Several packed rows (``seq_idx``) padded to one length: padding is in no document's blocks, whether it carries
    the last document's label or one of its own; padding outputs are zero."""
    model = build()
    model.set_attn_implementation(implementation)
    docs = documents()
    rows = [docs[:3], docs[3:]]
    length = max(sum(d.numel() for d in row) for row in rows) + 5
    ids = torch.full((2, length), TINY["pad_token_id"])
    seq_idx = torch.zeros(2, length, dtype=torch.long)
    positions = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    starts = []
    for r, row in enumerate(rows):
        at, row_starts = 0, []
        for i, d in enumerate(row):
            ids[r, at : at + d.numel()] = d
            seq_idx[r, at : at + d.numel()] = i
            positions[r, at : at + d.numel()] = torch.arange(d.numel())
            mask[r, at : at + d.numel()] = 1
            row_starts.append(at)
            at += d.numel()
        # Row 0's padding carries its last document's label, row 1's a label of its own.
        seq_idx[r, at:] = len(row) - 1 if r == 0 else len(row)
        starts.append(row_starts)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, seq_idx=seq_idx, position_ids=positions).last_hidden_state
        for r, row in enumerate(rows):
            assert_documents_match(out, model, row, row=r, starts=starts[r])
        layer = model.encoder.layer[0].attention.self
        hidden = torch.randn(2, length, TINY["hidden_size"])
        context = layer(
            hidden, mask.bool(), document_ids=document_ids_from_inputs((2, length), ids.device, seq_idx=seq_idx)
        ).context
    assert (context[~mask.bool()] == 0).all()


@pytest.mark.parametrize(
    "implementation, layout", [("sdpa", "per_document"), ("sdpa", "aligned"), ("eager", "per_document")]
)
def test_packed_gradients_are_the_sum_of_their_own(implementation, layout):
    """Backward through the packed layout (gathers, segment softmax) gives each document's own gradients."""
    model = build(fixed_random_blocks=True).train()
    model.set_attn_implementation(implementation)
    docs = documents()
    weights = torch.randn(sum(d.numel() for d in docs), TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    with LAYOUTS[layout]():
        (model(**pack(docs, "cu_seq_lens")).last_hidden_state[0] * weights).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for span, d in zip(spans(docs), docs):
        (model(input_ids=d[None]).last_hidden_state[0] * weights[span]).sum().backward()
    assert packed.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed[name], p.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_packed_attention_maps_are_each_documents_own():
    """``output_attentions``: ``(1, heads, total, total)``, each document's own map on the diagonal, zero elsewhere."""
    model = build()
    docs = documents()
    with torch.no_grad():
        packed = model(**pack(docs, "seq_idx"), output_attentions=True).attentions
        for layer, probs in enumerate(packed):
            inside = torch.zeros_like(probs, dtype=torch.bool)
            for span, d in zip(spans(docs), docs):
                solo = model(input_ids=d[None], output_attentions=True).attentions[layer]
                torch.testing.assert_close(probs[:, :, span, span], solo, atol=ATOL, rtol=0)
                inside[:, :, span, span] = True
            assert (probs[~inside] == 0).all()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_original_full(implementation):
    model = build(attention_type="original_full")
    model.set_attn_implementation(implementation)
    docs = documents()
    with torch.no_grad():
        assert_documents_match(model(**pack(docs, "cu_seq_lens")).last_hidden_state, model, docs)


def test_attention_alone_plans_its_documents():
    """Called without the model's per-forward ``document_blocks``, the attention works them out itself."""
    model = build()
    layer = model.encoder.layer[1].attention.self
    docs = documents()
    document_ids = torch.cat([torch.full((d.numel(),), i) for i, d in enumerate(docs)])[None]
    hidden = torch.randn(1, document_ids.shape[1], TINY["hidden_size"])
    with torch.no_grad():
        planned = layer(hidden, document_ids=document_ids, document_blocks=plan_documents(document_ids, None, 4, 2))
        alone = layer(hidden, document_ids=document_ids)
        for span in spans(docs):
            torch.testing.assert_close(alone.context[:, span], layer(hidden[:, span]).context, atol=ATOL, rtol=0)
    torch.testing.assert_close(planned.context, alone.context, atol=0, rtol=0)


def test_packed_host_reads_do_not_grow_with_depth():
    """On the CPU (where reading costs no wait) the layout's sizes are checked against the batch once per forward,
    not once per layer."""
    counts = {}
    docs = documents()
    for depth in (1, 3):
        model = build(num_hidden_layers=depth, fixed_random_blocks=False)
        for training in (False, True):
            model.train(training)
            with torch.no_grad(), HostReadCounter() as counter:
                model(**pack(docs, "cu_seq_lens"))
            counts[depth, training] = counter.count
    assert counts[1, False] == counts[3, False] and counts[1, True] == counts[3, True], counts


def test_packed_batch_traces_through_the_dense_pattern():
    """A traced graph cannot read the layout's sizes: packed input takes the pattern as a mask, the same numbers."""
    torch._dynamo.reset()
    model = build()
    docs = documents((13, 45, 30))
    batch = pack(docs, "seq_idx")
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, dynamic=False)(**batch).last_hidden_state
        assert_documents_match(compiled, model, docs)


@pytest.mark.parametrize("fixed", [True, False], ids=["seeded", "drawn"])
def test_packed_training_step_reads_nothing(fixed):
    """A training step (forward and backward) on documents long enough for the block-sparse layout, its chunked global
    rows and its random blocks, whose batch carries the count and the longest document (``cu_seq_lens`` +
    ``max_length``): no device-to-host read, as on a GPU, and the same operators for 7 documents as for 4 others."""
    model = build(fixed_random_blocks=fixed).train()
    ops = {}
    for lengths in (LENGTHS, (40, 9, 100, 2)):
        batch = pack(documents(lengths), "cu_seq_lens")
        model(**batch).last_hidden_state.sum().backward()  # warm-up: lazily built state
        with as_if_on_accelerator(), OperatorCounter() as counter:
            model(**batch).last_hidden_state.sum().backward()
        assert counter.total_reads == 0, f"{lengths}: host reads {dict(counter.reads)}"
        ops[lengths] = counter.ops
    assert len(set(ops.values())) == 1, ops


def test_packed_batch_whose_longest_is_too_short_raises():
    """The layout is sized by ``max_length_q``; one shorter than a document is refused where the check is free."""
    model = build()
    batch = pack(documents(), "cu_seq_lens")
    batch["max_length_q"] = batch["max_length_k"] = 50  # the longest document has 70 tokens
    with torch.no_grad(), pytest.raises(ValueError, match="max_length"):
        model(**batch)


def test_compiled_packed_training_takes_the_block_layout(monkeypatch):
    """``torch.compile(fullgraph=True, dynamic=True)`` trains packed rows (``cu_seq_lens`` form) on the block layout,
    not the quadratic dense mask: outputs and gradients equal eager mode's, each document's rows its own forward's,
    and a second batch with other counts and lengths runs in the same graph."""

    def quadratic(*args, **kwargs):
        raise AssertionError("the packed (seq, seq) mask was traced")

    torch._dynamo.reset()
    model = build(num_hidden_layers=1, fixed_random_blocks=True).train()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    graphs = []
    for lengths in ((13, 45, 70, 6), (30, 9, 66, 27, 33)):
        docs = documents(lengths)
        batch = pack(docs, "cu_seq_lens")
        weights = torch.randn(sum(lengths), TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
        results = []
        for run in (model, compiled):
            model.zero_grad()
            with monkeypatch.context() as patch:
                if run is compiled:
                    patch.setattr(HfxBlockSparseSelfAttention, "_packed_dense", quadratic)
                out = run(**batch).last_hidden_state
            (out[0] * weights).sum().backward()
            # A parameter the loss does not reach (the pooler) has no gradient in eager mode and a zero one compiled.
            grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            results.append((out.detach(), grads))
        (eager, eager_grads), (traced, traced_grads) = results
        torch.testing.assert_close(traced, eager, atol=ATOL, rtol=0)
        assert any(g.abs().sum() > 0 for g in eager_grads.values())
        for name, grad in traced_grads.items():
            torch.testing.assert_close(grad, eager_grads[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        with torch.no_grad():
            assert_documents_match(traced, model, docs)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0], f"the second packed batch recompiled: {graphs}"


def test_flex_block_table_is_built_once_per_forward(flex_calls, monkeypatch):
    """``"flex_attention"`` on a packed row: the part of the block pattern that every layer shares is built once per
    forward by the model (each layer adds its own random blocks), one FlexAttention call per layer over the whole row,
    and the result equals the ``"sdpa"`` packed path (FlexAttention's eager form, quick at these sizes)."""
    monkeypatch.setattr(switch, "FLEX_COMPILE", False)
    built = []

    def counted(layout):
        built.append(layout.num_blocks)
        return block_sparse_flex.document_block_table(layout)

    monkeypatch.setattr(block_sparse_packed, "document_block_table", counted)
    model = build(num_hidden_layers=3)
    batch = pack(documents(), "cu_seq_lens")
    with torch.no_grad():
        model.set_attn_implementation("flex_attention")
        flex = model(**batch).last_hidden_state
        assert len(built) == 1 and len(flex_calls) == 3, (built, flex_calls)
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(flex, model(**batch).last_hidden_state, atol=ATOL, rtol=0)
    assert len(flex_calls) == 3  # the sdpa path makes no FlexAttention call


def test_cpu_eager_runs_each_document_through_the_layer(monkeypatch):
    """Under "sdpa" on the CPU in eager mode a packed row runs each document through the layer's own forward (the
    least work there: about 1.4x the aligned layout's speed at the packing benchmark's sizes); on an accelerator the
    aligned layout, one call per layer over the row."""
    from hf_xformers.attention.block_sparse_packed import PackedBlockSparse

    calls = []
    real = PackedBlockSparse._layout_block_sparse
    monkeypatch.setattr(PackedBlockSparse, "_layout_block_sparse", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = build(fixed_random_blocks=True)
    batch = pack(documents(), "cu_seq_lens")
    with torch.no_grad():
        model(**batch)
        assert calls == []
        with as_if_on_accelerator():
            model(**batch)
    assert len(calls) == TINY["num_hidden_layers"]
