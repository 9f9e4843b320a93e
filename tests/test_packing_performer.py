"""hfx-performer on packed (padding-free) batches (issue 34): every document of a row built by transformers'
``DataCollatorWithFlattening`` gets what its own forward gives, bidirectional and causal, both kernels; the key-value
sums, the causal prefix sums and the key stabilisers (global and running max) are per document, which documents of
very different key magnitudes prove; a packed batch with a decoding cache is refused.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import DataCollatorWithFlattening  # noqa: E402

from hf_xformers import HfxPerformerConfig, HfxPerformerModel  # noqa: E402
from hf_xformers.attention import favor  # noqa: E402
from hf_xformers.attention.base import split_heads  # noqa: E402
from hf_xformers.attention.favor import HfxFavorSelfAttention, favor_attention  # noqa: E402
from hf_xformers.attention.favor_features import softmax_key_logits  # noqa: E402
from hf_xformers.attention.favor_linear import CAUSAL_CHUNK_SIZE  # noqa: E402
from hf_xformers.attention.favor_packed import FavorDocuments  # noqa: E402
from hf_xformers.ops.compat import CACHE_NAME  # noqa: E402
from hf_xformers.ops.input_checks import as_if_on_accelerator  # noqa: E402

ATOL = 1e-5
TINY = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=37,
    num_random_features=16,
    max_position_embeddings=200,
    type_vocab_size=1,
    pad_token_id=1,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
# (10, 23, 7): short documents inside one causal chunk (64) and across its first boundary; 150: a document that
# holds a whole chunk and runs over two boundaries; 5 and 1: a short one after it and a single token.
LENGTHS = (10, 23, 7, 150, 5, 1)
FORMS = ["seq_idx", "cu_seq_lens"]  # the forms that mark documents
# How a packed row runs: each document on its own (the CPU in eager mode: FavorDocuments.spans), or the segmented sums
# over the whole row (accelerators and traced graphs), which a CPU test reaches as if on an accelerator.
LAYOUTS = {"per_document": contextlib.nullcontext, "segmented": as_if_on_accelerator}
assert max(LENGTHS) > 2 * CAUSAL_CHUNK_SIZE


def build(causal: bool, kernel: str = "softmax") -> HfxPerformerModel:
    torch.manual_seed(0)
    model = HfxPerformerModel(HfxPerformerConfig(**TINY, is_decoder=causal, favor_kernel=kernel))
    with torch.no_grad():  # default inits leave biases at 0: make every parameter matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def documents(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


def pack(docs: list[list[int]], form: str) -> dict:
    """The collator's batch in one of the forms that mark documents, without position ids, so that the model builds
    the restarting positions itself."""
    options = {
        "seq_idx": dict(return_seq_idx=True, return_position_ids=False),
        "cu_seq_lens": dict(return_flash_attn_kwargs=True, return_position_ids=False),
    }[form]
    batch = DataCollatorWithFlattening(position_ids_start=2, **options)([{"input_ids": d} for d in docs])
    batch.pop("labels")
    return batch


def spans(lengths):
    start = 0
    for n in lengths:
        yield slice(start, start + n)
        start += n


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_packed_documents_equal_solo_forwards(form, causal, training, layout):
    model = build(causal).train(training)
    docs = documents()
    batch = pack(docs, form)
    with torch.no_grad():
        with LAYOUTS[layout]():
            packed = model(**batch)
        solos = [model(input_ids=torch.tensor([d])) for d in docs]
    assert packed.last_hidden_state.shape == (1, sum(LENGTHS), TINY["hidden_size"])
    for span, solo in zip(spans(LENGTHS), solos):
        torch.testing.assert_close(packed.last_hidden_state[:, span], solo.last_hidden_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(packed.pooler_output, torch.cat([s.pooler_output for s in solos]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_relu_kernel_and_attention_maps_per_document(causal):
    """The generalized kernel, and the quadratic path of ``output_attentions``: each document's block of the map
    is its own forward's map, and no probability crosses a document boundary."""
    for kernel in ("relu", "softmax"):
        model = build(causal, kernel).eval()
        docs = documents((10, 23, 70), seed=1)
        with torch.no_grad():
            packed = model(**pack(docs, "seq_idx"), output_attentions=True)
            solos = [model(input_ids=torch.tensor([d]), output_attentions=True) for d in docs]
        for span, solo in zip(spans((10, 23, 70)), solos):
            torch.testing.assert_close(packed.last_hidden_state[:, span], solo.last_hidden_state, atol=ATOL, rtol=0)
            for maps, solo_maps in zip(packed.attentions, solo.attentions):
                torch.testing.assert_close(maps[..., span, span], solo_maps, atol=ATOL, rtol=0)
                row_sums = maps[..., span, span].sum(-1)
                torch.testing.assert_close(row_sums, torch.ones_like(row_sums), atol=ATOL, rtol=0)


def test_several_packed_rows():
    """``seq_idx`` packs several rows: the documents are numbered per row and each row's are kept apart."""
    lengths = ((10, 23), (7, 26))
    docs = documents((10, 23, 7, 26), seed=2)
    ids = torch.tensor([docs[0] + docs[1], docs[2] + docs[3]])
    seq_idx = torch.tensor([[0] * 10 + [1] * 23, [5] * 7 + [6] * 26])
    for causal in (False, True):
        model = build(causal).eval()
        with torch.no_grad():
            packed = model(input_ids=ids, seq_idx=seq_idx).last_hidden_state
            solos = [model(input_ids=torch.tensor([d])).last_hidden_state for d in docs]
        row_spans = [(row, span) for row, row_lengths in enumerate(lengths) for span in spans(row_lengths)]
        for (row, span), solo in zip(row_spans, solos):
            torch.testing.assert_close(packed[row : row + 1, span], solo, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("output_attentions", [False, True], ids=["linear", "quadratic"])
def test_stabiliser_is_per_document(causal, output_attentions):
    """Documents whose keys differ by orders of magnitude: a key stabiliser shared by the row would underflow the
    features of every document but the one with the largest logits (float32 ``exp`` of -100 and below is 0 or
    subnormal). Each document's own stabiliser gives its solo output to 1e-5 relative error."""
    config = HfxPerformerConfig(**TINY, is_decoder=causal)
    torch.manual_seed(0)
    attention = HfxFavorSelfAttention(config).eval()
    lengths, scales = (10, 23, 7, 150, 5), (1.0, 30.0, 0.05, 10.0, 3.0)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.cat([s * torch.randn(1, n, 32, generator=generator) for n, s in zip(lengths, scales)], dim=1)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]

    # The documents' largest key logits lie far apart: one shared stabiliser could not serve them all.
    with torch.no_grad():
        key = split_heads(attention.key(hidden), attention.num_heads)
        logits = softmax_key_logits(key, attention.projection_matrix).amax(dim=(1, 3))[0]  # (seq,)
        highest = torch.stack([logits[span].max() for span in spans(lengths)])
        assert float(highest.max() - highest.min()) > 200
        packed = attention(hidden, document_ids=document_ids, output_attentions=output_attentions).context
        for span in spans(lengths):
            solo = attention(hidden[:, span], output_attentions=output_attentions).context
            error = (packed[:, span] - solo).abs().max() / solo.abs().max()
            assert error < 1e-5, f"document {span}: relative error {float(error):.2e}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_packed_gradients_are_the_sum_of_solo_gradients(causal, layout):
    """Training on a packed row: the loss of the row is the sum of the documents' losses, and so are its gradients
    (no gradient flows between documents, through the features or the stabilisers)."""
    model = build(causal).train()
    lengths = (10, 23, 70)
    docs = documents(lengths, seed=4)
    weights = torch.randn(sum(lengths), TINY["hidden_size"], generator=torch.Generator().manual_seed(5))
    model.zero_grad()
    with LAYOUTS[layout]():
        (model(**pack(docs, "cu_seq_lens")).last_hidden_state[0] * weights).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for span, doc in zip(spans(lengths), docs):
        (model(input_ids=torch.tensor([doc])).last_hidden_state[0] * weights[span]).sum().backward()
    for name, p in model.named_parameters():
        if name in packed:
            torch.testing.assert_close(packed[name], p.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_function_level_equals_solo_for_every_kernel_and_chunk_alignment():
    """:func:`favor_attention` itself, with a chunk of 4 so that documents start and end at, before and after chunk
    boundaries, lie inside one chunk, fill one exactly and span several; two rows with different documents."""
    rows = ((4, 1, 3, 8, 13, 2, 9), (2, 7, 4, 4, 1, 12, 10))
    chunk = 4
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, sum(rows[0]), 8, generator=generator) for _ in range(3))
    projection = torch.randn(12, 8, generator=generator)
    document_ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in rows])
    for causal in (False, True):
        for kernel in ("softmax", "relu"):
            for output_attentions in (False, True):
                packed, _ = favor_attention(
                    q, k, v, projection, None, causal, kernel, output_attentions, chunk, document_ids
                )
                for b, row in enumerate(rows):
                    for span in spans(row):
                        parts = (t[b : b + 1, :, span] for t in (q, k, v))
                        solo, _ = favor_attention(*parts, projection, None, causal, kernel, output_attentions, chunk)
                        torch.testing.assert_close(packed[b : b + 1, :, span], solo, atol=ATOL, rtol=0)


def test_packed_batch_with_a_cache_is_refused():
    model = build(causal=True).eval()
    docs = documents((10, 23, 7))
    for form in FORMS:
        batch = pack(docs, form)
        with pytest.raises(ValueError, match="use_cache=False"):
            model(**batch, use_cache=True)
    cache = getattr(model(input_ids=torch.tensor([docs[0]]), use_cache=True), CACHE_NAME)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(**pack(docs, "seq_idx"), past_key_values=cache)
    with pytest.raises(ValueError, match="use_cache=False"):
        HfxFavorSelfAttention(model.config)(
            torch.randn(1, 5, 32), cache=cache, document_ids=torch.tensor([[0, 0, 1, 1, 1]])
        )


def test_left_padded_prompt_with_a_cache_is_not_a_packed_batch():
    """generate() numbers a left-padded prompt's padding with ``padding_idx``, so its positions restart where the
    real tokens begin: padding, not a second document, and cached decoding goes on."""
    model = build(causal=True).eval()
    prompt = torch.tensor([[1, 1, 1] + documents((9,))[0]])
    mask = (prompt != 1).long()
    position_ids = mask.cumsum(-1) * mask + 1
    with torch.no_grad():
        cached = model(input_ids=prompt, attention_mask=mask, position_ids=position_ids, use_cache=True)
        alone = model(input_ids=prompt[:, 3:])
    torch.testing.assert_close(cached.last_hidden_state[:, 3:], alone.last_hidden_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_packed_row_is_one_vectorised_favor_per_layer(causal, monkeypatch):
    """A packed row runs one FAVOR+ per layer over the whole row, on a layout of its documents worked out once per
    forward (the same :class:`FavorDocuments` in every layer), never one call per document."""
    from hf_xformers.attention import favor
    from hf_xformers.models.performer import modeling_performer

    calls, layouts = [], []
    real_attention, real_documents = favor.favor_attention, modeling_performer.favor_documents

    def recording(query, *args, **kwargs):
        calls.append((query.shape[2], kwargs.get("document_ids")))
        return real_attention(query, *args, **kwargs)

    def counting(*args, **kwargs):
        layouts.append(real_documents(*args, **kwargs))
        return layouts[-1]

    monkeypatch.setattr(favor, "favor_attention", recording)
    monkeypatch.setattr(modeling_performer, "favor_documents", counting)
    model = build(causal).eval()
    docs = documents()
    with torch.no_grad():
        packed = model(**pack(docs, "cu_seq_lens")).last_hidden_state
    assert len(layouts) == 1 and layouts[0].causal == causal
    assert [n for n, _ in calls] == [sum(LENGTHS)] * model.config.num_hidden_layers
    assert all(documents is layouts[0] for _, documents in calls)
    with torch.no_grad():
        for span, doc in zip(spans(LENGTHS), docs):
            solo = model(input_ids=torch.tensor([doc])).last_hidden_state
            torch.testing.assert_close(packed[:, span], solo, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_packed_training_step_operators_do_not_depend_on_documents_or_length(causal):
    """Forward and backward of a packed row dispatch the same operators for 3 documents in one chunk as for 14
    documents over several chunks (one of them 150 tokens long), and read nothing back from the device."""
    from hf_xformers.ops.input_checks import as_if_on_accelerator

    from .host_reads import HostReadCounter

    model = build(causal).train()
    ops = {}
    for lengths in ((10, 23, 7), (10, 5, 8, 6, 4, 9, 3, 5, 12, 8, 6, 7, 150, 1)):
        batch = pack(documents(lengths), "cu_seq_lens")
        for _ in range(2):  # the second step is counted: the first builds what is built once
            model.zero_grad()
            with as_if_on_accelerator(), HostReadCounter() as counter:
                model(**batch).last_hidden_state.pow(2).sum().backward()
        assert counter.total_reads == 0, dict(counter.reads)
        ops[len(lengths)] = counter.ops
    assert ops[3] == ops[14], ops


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_padded_packed_rows_equal_solo_forwards(causal):
    """``seq_idx`` rows with right and left padding: padded keys add nothing to any document's sums or stabilisers
    (their features are 0), and every document gets its own forward's output."""
    lengths = ((10, 23), (7, 70))
    docs = documents((10, 23, 7, 70), seed=7)
    width = 80
    ids = torch.full((2, width), TINY["pad_token_id"])
    mask = torch.zeros(2, width, dtype=torch.long)
    seq_idx = torch.zeros(2, width, dtype=torch.long)
    ids[0, :33], mask[0, :33] = torch.tensor(docs[0] + docs[1]), 1  # right padding
    seq_idx[0, 10:] = 1
    ids[1, 3:], mask[1, 3:] = torch.tensor(docs[2] + docs[3]), 1  # left padding, sharing document 0's label
    seq_idx[1, 10:] = 1
    starts = {(0, 0): 0, (0, 1): 10, (1, 0): 3, (1, 1): 10}
    model = build(causal).eval()
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=mask, seq_idx=seq_idx).last_hidden_state
        for number, (row, doc) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
            n = lengths[row][doc]
            solo = model(input_ids=torch.tensor([docs[number]])).last_hidden_state
            start = starts[(row, doc)]
            torch.testing.assert_close(packed[row : row + 1, start : start + n], solo, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_cpu_eager_runs_each_document_on_its_own(causal, monkeypatch):
    """On the CPU in eager mode a packed row runs each document's own FAVOR+ (the least work there: about 3x the
    segmented form's speed at the packing benchmark's sizes); on an accelerator the segmented sums, one call per layer
    over the row."""
    calls = []  # per call of the linear forms: whether it was given the row's document layout

    def spy(real):
        def call(*args, **kwargs):
            calls.append(any(isinstance(x, FavorDocuments) for x in (*args, *kwargs.values())))
            return real(*args, **kwargs)

        return call

    for name in ("packed_linear_attention", "causal_linear_attention"):
        monkeypatch.setattr(favor, name, spy(getattr(favor, name)))
    model = build(causal)
    batch = pack(documents(), "cu_seq_lens")
    with torch.no_grad():
        model(**batch)
        assert not any(calls), calls
        calls.clear()
        with as_if_on_accelerator():
            model(**batch)
    assert calls == [True] * TINY["num_hidden_layers"], calls
