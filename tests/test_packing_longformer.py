"""hfx-longformer on packed (padding-free) batches (issue 34): every document of a row built by transformers'
``DataCollatorWithFlattening`` gets what its own forward gives, under each ``attn_implementation``, with and without
global tokens; the band, the global rows and columns and FlexAttention's block lists stop at document boundaries, and
the global rows and columns cost per document (not the row's length times its global tokens); the tasks' default
global tokens are chosen per document.

FlexAttention runs in its eager (reference) form except in one test of the compiled kernel (inference on the CPU).
"""

from __future__ import annotations

import os
from math import ceil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import DataCollatorWithFlattening  # noqa: E402

import hf_xformers.ops.attention_switch as switch  # noqa: E402
from hf_xformers import HfxLongformerConfig, HfxLongformerModel  # noqa: E402
from hf_xformers.attention import (  # noqa: E402
    sliding_window,
    sliding_window_banded,
    sliding_window_layout,
    sliding_window_packed,
)
from hf_xformers.ops.input_checks import as_if_on_accelerator  # noqa: E402
from hf_xformers.ops.packing import document_ids_from_inputs  # noqa: E402

ATOL = 1e-5
TINY = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    attention_window=[8, 4],  # one-sided windows 4 and 2
    max_position_embeddings=80,
    type_vocab_size=1,
    pad_token_id=1,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
# (10, 23, 7): the brief's three documents; (3, 41, 2, 12): documents shorter than a window and one of many windows;
# (5, 6): a row short enough for the dense path of the first layer (one block's key span, 12 tokens).
LENGTHS = [(10, 23, 7), (3, 41, 2, 12), (5, 6)]
FORMS = ["seq_idx", "cu_seq_lens"]  # the forms that mark documents


@pytest.fixture
def eager_flex(monkeypatch):
    monkeypatch.setattr(switch, "FLEX_COMPILE", False)


def build(**overrides) -> HfxLongformerModel:
    """The tiny model, weights perturbed so that biases and LayerNorms matter, in eval mode."""
    torch.manual_seed(0)
    model = HfxLongformerModel(HfxLongformerConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def documents(lengths, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=g) for n in lengths]


def global_masks(docs) -> list[torch.Tensor]:
    """Global tokens in several documents: the first token of every third, two tokens of the next, none in the rest."""
    masks = []
    for i, doc in enumerate(docs):
        mask = torch.zeros(len(doc), dtype=torch.bool)
        if i % 3 == 0:
            mask[0] = True
        elif i % 3 == 1:
            mask[len(doc) // 2] = mask[-1] = True
        masks.append(mask)
    return masks


def packed(docs, form: str) -> dict:
    """The collator's row in one of the forms that mark documents (the boundaries only there: no position ids)."""
    options = {
        "seq_idx": dict(return_seq_idx=True, return_position_ids=False),
        "cu_seq_lens": dict(return_flash_attn_kwargs=True, return_position_ids=False),
    }[form]
    collator = DataCollatorWithFlattening(position_ids_start=2, return_tensors="pt", **options)
    batch = collator([{"input_ids": doc.tolist()} for doc in docs])
    batch.pop("labels")
    return batch


def spans(docs) -> list[slice]:
    ends = torch.tensor([len(d) for d in docs]).cumsum(0).tolist()
    return [slice(end - len(d), end) for d, end in zip(docs, ends)]


def solo(model, doc: torch.Tensor, glob: torch.Tensor | None, **kwargs):
    extra = {} if glob is None or not glob.any() else {"global_attention_mask": glob[None]}
    return model(input_ids=doc[None], **extra, **kwargs)


@pytest.mark.parametrize("use_globals", [False, True], ids=["local", "globals"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda lengths: "-".join(map(str, lengths)))
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_packed_documents_match_their_solo_forward(implementation, lengths, form, use_globals, eager_flex):
    model = build()
    model.set_attn_implementation(implementation)
    docs = documents(lengths)
    globs = global_masks(docs) if use_globals else [None] * len(docs)
    inputs = packed(docs, form)
    if use_globals:
        inputs["global_attention_mask"] = torch.cat(globs)[None]
    with torch.no_grad():
        out = model(**inputs)
        for doc, glob, span in zip(docs, globs, spans(docs)):
            reference = solo(model, doc, glob)
            assert (out.last_hidden_state[0, span] - reference.last_hidden_state[0]).abs().max() < ATOL


def test_packed_documents_in_train_mode_without_dropout():
    """Train mode (dropout probabilities 0) takes the training branches (the global projections' zero term, the CPU
    kernel's training path): still each document's own result, gradients flowing."""
    model = build().train()
    docs = documents((10, 23, 7), seed=1)
    globs = global_masks(docs)
    inputs = packed(docs, "seq_idx")
    out = model(**inputs, global_attention_mask=torch.cat(globs)[None])
    for doc, glob, span in zip(docs, globs, spans(docs)):
        reference = solo(model, doc, glob)
        assert (out.last_hidden_state[0, span] - reference.last_hidden_state[0]).abs().max() < ATOL
    out.last_hidden_state.sum().backward()
    assert model.encoder.layer[0].attention.self.query_global.weight.grad is not None


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_several_packed_rows_with_padding(implementation, eager_flex):
    """Two packed rows described by ``seq_idx``, the second right-padded (its padding a run of its own): padding,
    documents and global tokens combine."""
    model = build()
    model.set_attn_implementation(implementation)
    docs = documents((10, 23, 7, 12), seed=2)
    globs = global_masks(docs)
    length = 33
    ids = torch.full((2, length), TINY["pad_token_id"])
    ids[0] = torch.cat(docs[:2])
    ids[1, :19] = torch.cat(docs[2:])
    seq_idx = torch.tensor([[0] * 10 + [1] * 23, [0] * 7 + [1] * 12 + [2] * 14])
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, 19:] = 0
    glob = torch.zeros(2, length, dtype=torch.long)
    glob[0] = torch.cat(globs[:2])
    glob[1, :19] = torch.cat(globs[2:])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, global_attention_mask=glob, seq_idx=seq_idx).last_hidden_state
        places = [(0, slice(0, 10)), (0, slice(10, 33)), (1, slice(0, 7)), (1, slice(7, 19))]
        for doc, g, (row, span) in zip(docs, globs, places):
            reference = solo(model, doc, g).last_hidden_state[0]
            assert (out[row, span] - reference).abs().max() < ATOL


@pytest.mark.parametrize("use_globals", [False, True], ids=["local", "globals"])
def test_packed_attention_maps_are_each_documents_own(use_globals):
    """``output_attentions=True`` on a packed row: the band probabilities of each document are its solo forward's
    (offsets into another document are 0, as offsets past the ends of a lone document), its global columns are those
    of its own global tokens (other documents' are 0), and the global tokens' rows see their own document only."""
    model = build()
    docs = documents((10, 23, 3, 7), seed=3)
    globs = global_masks(docs) if use_globals else [torch.zeros(len(d), dtype=torch.bool) for d in docs]
    inputs = packed(docs, "seq_idx")
    if use_globals:
        inputs["global_attention_mask"] = torch.cat(globs)[None]
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
        first_slot = 0
        for doc, glob, span in zip(docs, globs, spans(docs)):
            reference = solo(model, doc, glob, output_attentions=True)
            count = int(glob.sum())
            for layer, (probs, ref) in enumerate(zip(out.attentions, reference.attentions)):
                total = probs.shape[-1] - ref.shape[-1] + count  # global slots of the packed row
                rows = probs[0, :, span]
                assert (rows[..., total:] - ref[0, ..., count:]).abs().max() < ATOL, layer
                own = slice(first_slot, first_slot + count)
                if count:
                    assert (rows[..., own] - ref[0, ..., :count]).abs().max() < ATOL, layer
                others = torch.ones(total, dtype=torch.bool)
                others[own] = False
                assert (rows[..., :total][..., others] == 0).all(), layer
                if count:
                    glob_probs = out.global_attentions[layer][0, :, own]
                    assert (glob_probs[..., span] - reference.global_attentions[layer][0]).abs().max() < ATOL
                    outside = torch.ones(glob_probs.shape[-1], dtype=torch.bool)
                    outside[span] = False
                    assert (glob_probs[..., outside] == 0).all()
            first_slot += count


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_attention_module_stops_at_document_boundaries(implementation, eager_flex):
    """The attention module on its own (it then finds the global slots and block mask itself): ``document_ids`` make a
    packed row's contexts those of each document alone, and without ``document_ids`` the row is one sequence."""
    config = HfxLongformerConfig(**TINY)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    attention = sliding_window.HfxSlidingWindowSelfAttention(config, layer_idx=0).eval()
    lengths = (9, 30, 4, 17)
    hidden = torch.randn(1, sum(lengths), TINY["hidden_size"])
    document_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    is_global = torch.zeros(1, sum(lengths), dtype=torch.bool)
    is_global[0, [0, 12, 38, 42]] = True  # documents 0, 1 (twice), 2
    with torch.no_grad():
        out = attention(hidden, None, is_global, document_ids=document_ids).context
        unpacked = attention(hidden, None, is_global).context
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            glob = is_global[:, part] if is_global[:, part].any() else None
            reference = attention(hidden[:, part], None, glob).context
            assert (out[:, part] - reference).abs().max() < ATOL
            start += n
    assert (out - unpacked).abs().max() > 1e-3  # the documents do change the result


def blocks_visited_and_full(block_mask, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    visited = block_mask.to_dense().expand(batch, -1, -1, -1).bool()
    full = torch.zeros_like(visited)
    counts = block_mask.full_kv_num_blocks.expand(batch, -1, -1)
    indices = block_mask.full_kv_indices.expand(batch, -1, -1, -1)
    for b, h, qb in torch.nonzero(counts >= 0).tolist():
        full[b, h, qb, indices[b, h, qb, : counts[b, h, qb]].long()] = True
    return visited, full


@pytest.mark.parametrize(("length", "window", "boundaries", "with_globals", "padded"), [
    (700, 256, (300, 560), True, False),  # full blocks inside documents, partial where a boundary crosses
    (300, 16, (100, 128, 250), False, False),  # a boundary on a block edge
    (513, 256, (128, 384), True, True),
    (640, 128, (256,), True, False),
])  # fmt: skip
def test_band_block_lists_with_documents_match_an_evaluated_mask(length, window, boundaries, with_globals, padded):
    """The block lists (block arithmetic) against ``create_block_mask``'s evaluation of every score: no block with an
    allowed score is skipped, no block is full unless every score in it is allowed (a block crossed by a document
    boundary is partial), and a global token's block is visited by the query blocks of its own document only."""
    from torch.nn.attention.flex_attention import create_block_mask

    size = sliding_window_layout.FLEX_BLOCK
    document_ids = torch.zeros(2, length, dtype=torch.long)
    for boundary in boundaries:
        document_ids[:, boundary:] += 1
    document_ids[1] = (torch.arange(length) >= length // 3).long()  # the second row: two documents
    mask = torch.ones(2, length, dtype=torch.bool)
    if padded:
        mask[1, length - 40 :] = False
    is_global = None
    if with_globals:
        is_global = torch.zeros(2, length, dtype=torch.bool)
        is_global[:, 0] = True
        is_global[0, boundaries[0] + 3] = True
        is_global &= mask
    ours = sliding_window_layout.band_block_mask(
        mask if padded else None, is_global, window, length, torch.device("cpu"), document_ids
    )
    evaluated = create_block_mask(ours.mask_mod, 2, None, length, length, BLOCK_SIZE=size)
    visited, ours_full = blocks_visited_and_full(ours, 2)
    evaluated_visited, evaluated_full = blocks_visited_and_full(evaluated, 2)
    assert not (evaluated_visited & ~visited).any(), "a block with an allowed score is skipped"
    whole_rows = length // size  # query blocks inside the sequence (the last may reach past it)
    assert not (ours_full & ~evaluated_full)[:, :, :whole_rows].any(), "a block marked full holds a masked score"
    assert ours_full[:, :, :whole_rows].any() == evaluated_full[:, :, :whole_rows].any()
    if with_globals:
        # block 0 holds a global token of document 0 only: query blocks wholly inside later documents skip it
        later = (document_ids[0].view(-1)[: whole_rows * size].view(whole_rows, size) > 0).all(-1)
        assert not visited[0, 0, :whole_rows][later, 0].any()


def test_compiled_flex_kernel_on_packed_documents(monkeypatch):
    """The compiled FlexAttention kernel over block lists with full, partial and skipped blocks of three documents:
    the "sdpa" path's contexts, and each document's own."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return switch.flex_attention(*args, **kwargs)

    monkeypatch.setattr(sliding_window, "flex_attention", counted)
    assert switch.FLEX_COMPILE
    config = HfxLongformerConfig(
        **{**TINY, "num_hidden_layers": 1, "attention_window": 512, "max_position_embeddings": 800}
    )
    torch.manual_seed(0)
    attention = sliding_window.HfxSlidingWindowSelfAttention(config).eval()
    lengths = (300, 260, 140)
    hidden = torch.randn(1, sum(lengths), TINY["hidden_size"])
    document_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    is_global = torch.zeros(1, sum(lengths), dtype=torch.bool)
    is_global[0, [0, 310, 650]] = True
    with torch.no_grad():
        reference = attention(hidden, None, is_global, document_ids=document_ids).context
        config._attn_implementation = "flex_attention"
        out = attention(hidden, None, is_global, document_ids=document_ids).context
        config._attn_implementation = "sdpa"
        alone = attention(hidden[:, 300:560], None, is_global[:, 300:560]).context
    assert calls
    assert (out - reference).abs().max() < ATOL
    assert (out[:, 300:560] - alone).abs().max() < ATOL


SEP = 2  # RoBERTa's </s>, the config's sep_token_id


def task_documents() -> list[torch.Tensor]:
    """Text pairs as the tokenizer encodes them: <s> A </s></s> B </s>, of several lengths."""
    g = torch.Generator().manual_seed(4)
    pairs = [(3, 5), (1, 8), (6, 2), (4, 4)]
    return [
        torch.cat([torch.tensor([0]), torch.randint(3, 100, (a,), generator=g), torch.tensor([SEP, SEP]),
                   torch.randint(3, 100, (b,), generator=g), torch.tensor([SEP])])
        for a, b in pairs
    ]  # fmt: skip


@pytest.mark.parametrize("task", ["sequence_classification", "question_answering", "multiple_choice"])
def test_default_global_tokens_are_chosen_per_document(task):
    model = build()
    docs = task_documents()
    ids = torch.cat(docs)[None]
    document_ids = document_ids_from_inputs(ids.shape, ids.device, seq_idx=packed(docs, "seq_idx")["seq_idx"])
    ours = model.default_global_attention_mask(task, ids, None, document_ids=document_ids)
    expected = torch.cat([model.default_global_attention_mask(task, doc[None], None)[0] for doc in docs])
    assert ours.dtype == torch.bool and torch.equal(ours[0], expected)
    for name in ("masked_lm", "token_classification"):
        assert model.default_global_attention_mask(name, ids, None, document_ids=document_ids) is None


@pytest.mark.parametrize("task", ["question_answering", "multiple_choice"])
def test_default_global_tokens_need_a_separator_in_every_document(task):
    model = build()
    docs = task_documents()
    docs[2] = docs[2][docs[2] != SEP]  # the third document has no separator; the others have several
    ids = torch.cat(docs)[None]
    document_ids = document_ids_from_inputs(ids.shape, ids.device, seq_idx=packed(docs, "seq_idx")["seq_idx"])
    with pytest.raises(ValueError, match="separator"):
        model.default_global_attention_mask(task, ids, None, document_ids=document_ids)


def many_documents(count: int = 20, seed: int = 5) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``count`` documents of 6 to 29 tokens, most with several global tokens (the first and up to four others)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 30, (count,), generator=g).tolist()
    docs = documents(lengths, seed)
    globs = []
    for i, n in enumerate(lengths):
        glob = torch.zeros(n, dtype=torch.bool)
        if i % 7 != 3:  # a few documents without global tokens
            glob[0] = True
            glob[torch.randint(0, n, (int(torch.randint(0, 5, (), generator=g)),), generator=g)] = True
        globs.append(glob)
    return docs, globs


@pytest.mark.parametrize("output_attentions", [False, True], ids=["context", "attentions"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_many_packed_documents_with_global_tokens(implementation, output_attentions, eager_flex):
    """Twenty documents with up to five global tokens each in one row: every query block sees the global slots of its
    own few documents and every document's global tokens attend to that document's keys, each document getting its
    own forward's result (also through the explicit probabilities of ``output_attentions``)."""
    model = build()
    model.set_attn_implementation(implementation)
    docs, globs = many_documents()
    inputs = packed(docs, "seq_idx")
    with torch.no_grad():
        out = model(**inputs, global_attention_mask=torch.cat(globs)[None], output_attentions=output_attentions)
        for doc, glob, span in zip(docs, globs, spans(docs)):
            reference = solo(model, doc, glob)
            assert (out.last_hidden_state[0, span] - reference.last_hidden_state[0]).abs().max() < ATOL


def test_packed_attention_maps_stay_on_the_autograd_path():
    """The band and global probabilities returned for a packed row with global tokens are what the context was
    computed from: gradients reach them (as unpacked, where ``retain_grad`` on them works)."""
    model = build().train()
    docs, globs = many_documents(count=6, seed=6)
    out = model(**packed(docs, "seq_idx"), global_attention_mask=torch.cat(globs)[None], output_attentions=True)
    for probs in (*out.attentions, *out.global_attentions):
        probs.retain_grad()
    out.last_hidden_state.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (*out.attentions, *out.global_attentions))


def test_packed_rows_with_and_without_global_tokens():
    """Two packed rows, the second padded and without any global token (all its slots empty)."""
    model = build()
    docs, globs = many_documents(count=8, seed=7)
    rows = [docs[:5], docs[5:]]
    lengths = [sum(len(d) for d in row) for row in rows]
    length = max(lengths)
    ids = torch.full((2, length), TINY["pad_token_id"])
    mask = torch.zeros(2, length, dtype=torch.long)
    glob = torch.zeros(2, length, dtype=torch.bool)
    seq_idx = torch.full((2, length), 99)
    for r, row in enumerate(rows):
        ids[r, : lengths[r]] = torch.cat(row)
        mask[r, : lengths[r]] = 1
        seq_idx[r, : lengths[r]] = torch.repeat_interleave(torch.arange(len(row)), torch.tensor([len(d) for d in row]))
    glob[0, : lengths[0]] = torch.cat(globs[:5])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, global_attention_mask=glob, seq_idx=seq_idx).last_hidden_state
        for r, row in enumerate(rows):
            for i, (doc, span) in enumerate(zip(row, spans(row))):
                reference = solo(model, doc, globs[i] if r == 0 else None).last_hidden_state[0]
                assert (out[r, span] - reference).abs().max() < ATOL


def test_packed_global_cost_does_not_grow_with_the_number_of_documents(monkeypatch):
    """The attention problems of a packed row with global tokens, recorded at the kernel: each query block's global
    keys are those of the documents it touches (here at most two documents of three global tokens: 6 keys, not the
    row's 3 per document), and the global rows are one problem per document over that document's keys. So the score
    elements per token are the same for 5 and for 40 documents (the whole row's global keys would grow with them)."""
    config = HfxLongformerConfig(**{**TINY, "attention_window": 8, "max_position_embeddings": 800})
    torch.manual_seed(0)
    layer = sliding_window.HfxSlidingWindowSelfAttention(config).eval()
    w, b = layer.one_sided_window, layer.query_block
    calls = []

    def recorded(q, k, v, mask=None, dropout_p=0.0):
        calls.append((q.shape, k.shape))
        return switch_attention(q, k, v, mask, dropout_p)

    switch_attention = sliding_window_packed.attention
    monkeypatch.setattr(sliding_window_packed, "attention", recorded)
    per_token = []
    for count in (5, 40):
        length, per_document = 18, 3  # 18 tokens: query blocks of 4 straddle document boundaries
        document_ids = torch.arange(count).repeat_interleave(length)[None]
        is_global = (torch.arange(count * length) % length < per_document)[None]
        hidden = torch.randn(1, count * length, TINY["hidden_size"])
        calls.clear()
        with torch.no_grad():
            out = layer(hidden, None, is_global, document_ids=document_ids).context
        (band_q, band_k), (rows_q, rows_k) = calls
        assert band_q[0] == ceil(count * length / b) and band_k[2] == 2 * per_document + b + 2 * w
        assert rows_q[0] == count and rows_q[2] == per_document and rows_k[2] == length
        per_token.append(sum(q.numel() // q[-1] * k[2] for q, k in calls) / (count * length))
        # still each document's own result
        second = slice(length, 2 * length)
        with torch.no_grad():
            alone = layer(hidden[:, second], None, is_global[:, second]).context
        assert (out[:, second] - alone).abs().max() < ATOL
    assert per_token[0] == pytest.approx(per_token[1], rel=0.05)


def test_model_lays_out_packed_global_tokens_once_per_forward(monkeypatch):
    """The model works out the per-document layout of the global tokens once, for the block sizes of all its layers
    (windows 8 and 4 here), and hands it to every layer: no layer computes it again."""
    model = build()
    docs, globs = many_documents(count=6, seed=8)
    inputs = packed(docs, "seq_idx")
    calls, original = [], sliding_window_layout.packed_globals_of

    def counted(document_ids, global_slots, query_blocks, sizes=None):
        calls.append(sorted(set(query_blocks)))
        return original(document_ids, global_slots, query_blocks, sizes)

    monkeypatch.setattr(sliding_window_layout, "packed_globals_of", counted)
    with torch.no_grad():
        model(**inputs, global_attention_mask=torch.cat(globs)[None])
    blocks = sorted({layer.attention.self.query_block for layer in model.encoder.layer})
    assert len(blocks) == 2 and calls == [blocks]


@pytest.mark.parametrize("output_attentions", [False, True], ids=["context", "attentions"])
def test_traced_layout_of_packed_global_tokens(output_attentions, monkeypatch):
    """A traced graph cannot size tensors by values: there every query block sees every global slot and all global
    tokens form one group over the whole row, masked by document. Forced here in eager mode, the same results."""
    config = HfxLongformerConfig(**TINY)
    torch.manual_seed(0)
    layer = sliding_window.HfxSlidingWindowSelfAttention(config).eval()
    docs, globs = many_documents(count=6, seed=9)
    lengths = [len(d) for d in docs]
    document_ids = torch.arange(len(docs)).repeat_interleave(torch.tensor(lengths))[None]
    hidden = torch.randn(1, sum(lengths), TINY["hidden_size"])
    is_global = torch.cat(globs)[None]
    with torch.no_grad():
        references = [
            layer(hidden[:, span], None, g[None] if g.any() else None).context for g, span in zip(globs, spans(docs))
        ]
        for module in (sliding_window, sliding_window_banded, sliding_window_layout):
            monkeypatch.setattr(module, "is_tracing", lambda: True)
        layout = sliding_window_layout.packed_globals_of(
            document_ids, sliding_window_layout.global_slots_of(is_global), (layer.query_block,)
        )
        assert layout.columns[layer.query_block][1] == is_global.shape[1]  # every slot for every block
        out = layer(hidden, None, is_global, output_attentions=output_attentions, document_ids=document_ids).context
    for reference, span in zip(references, spans(docs)):
        assert (out[:, span] - reference).abs().max() < ATOL


def banded_varlen_reference(calls):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` written out: every document of ``cu_seq_q`` on its
    own, query ``i`` attending to keys ``j`` with ``-left <= j - i <= right`` (``window_size=(left, right)``)."""

    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), scale=None, **kwargs):
        assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32 and not kwargs
        bounds = cu_seq_q.tolist()
        assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
        calls.append(window_size)
        left, right = window_size
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out = []
        for a, b in zip(bounds, bounds[1:]):
            q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))  # (heads, n, dim)
            offset = torch.arange(b - a)[None, :] - torch.arange(b - a)[:, None]  # key minus query position
            allowed = (offset >= -left) & (offset <= right)
            scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
            out.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
        return torch.cat(out)

    return varlen


@pytest.fixture
def reference_varlen(monkeypatch):
    """The varlen dispatch on the CPU: the kernel replaced by :func:`banded_varlen_reference`, the CUDA test by True and
    float32 allowed; returns the list of the windows it was called with."""
    calls = []
    monkeypatch.setattr(sliding_window, "varlen_attn", banded_varlen_reference(calls))
    monkeypatch.setattr(sliding_window, "varlen_device", lambda device: True)
    monkeypatch.setattr(sliding_window, "VARLEN_DTYPES", (torch.float32,))
    return calls


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_packed_row_goes_through_the_varlen_kernel(reference_varlen, mode):
    """A packed row (``cu_seq_lens``, no padding, no global token) under "sdpa" on a device with
    ``varlen_attn`` is one kernel call per layer over the whole row, with ``window_size=(w, w)`` over the row's
    boundaries and longest document: the same contexts (and gradients) as the banded path."""
    docs = documents((10, 23, 7, 30), seed=11)
    inputs = packed(docs, "cu_seq_lens")
    model = build().train(mode == "train")  # attention dropout 0: training takes the kernel too
    torch.manual_seed(0)
    out = model(**inputs).last_hidden_state
    windows = [(layer.attention.self.one_sided_window,) * 2 for layer in model.encoder.layer]
    assert reference_varlen == windows
    out.pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    sliding_window.varlen_device, restore = (lambda device: False), sliding_window.varlen_device
    try:
        torch.manual_seed(0)
        banded = model(**inputs).last_hidden_state
    finally:
        sliding_window.varlen_device = restore
    assert reference_varlen == windows  # not called again
    assert (out - banded).abs().max() < ATOL
    banded.pow(2).sum().backward()
    for a, b in zip(grads, [p.grad for p in model.parameters() if p.grad is not None]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_varlen_kernel_only_where_the_pattern_maps(reference_varlen):
    """The banded path (no varlen call) for what the kernel cannot do: global tokens, attention dropout in training,
    a padded row (no ``cu_seq_lens``), the "eager" and "flex_attention" choices, attention maps,
    a dtype the kernel does not take; and where the batch does not say its longest document, a training step reads
    nothing to find it (inference reads it once)."""
    docs = documents((10, 23, 7), seed=12)
    inputs = packed(docs, "cu_seq_lens")
    globs = torch.cat(global_masks(docs))[None]
    with torch.no_grad():
        build()(**inputs, global_attention_mask=globs)
        build(attention_probs_dropout_prob=0.1).train()(**inputs)
        padded = packed(docs, "seq_idx")  # one row, padded at its end: no cu_seq_lens
        padded["input_ids"] = torch.cat([padded["input_ids"], torch.ones(1, 3, dtype=torch.long)], -1)
        padded["seq_idx"] = torch.cat([padded["seq_idx"], torch.full((1, 3), 3)], -1)
        padded["attention_mask"] = (padded["input_ids"] != 1).long()
        padded["attention_mask"][:, :-3] = 1
        build()(**padded)
        build()(**inputs, output_attentions=True)
        for implementation in ("eager", "flex_attention"):
            model = build()
            model.set_attn_implementation(implementation)
            model(**inputs)
        sliding_window.VARLEN_DTYPES = (torch.bfloat16,)
        try:
            build()(**inputs)
        finally:
            sliding_window.VARLEN_DTYPES = (torch.float32,)
    assert reference_varlen == []
    without_longest = {k: v for k, v in inputs.items() if k not in ("max_length_q", "max_length_k")}
    with as_if_on_accelerator():  # a training step on a GPU: no read for the longest document, no varlen
        build().train()(**without_longest)
    assert reference_varlen == []
    with torch.no_grad():
        build()(**without_longest)
    assert len(reference_varlen) == TINY["num_hidden_layers"]


def test_packed_flex_masks_are_built_once_per_forward_from_the_batch(monkeypatch, eager_flex):
    """Under "flex_attention" a packed row's document-aware band masks are built once per forward, one per window
    size (two here), from the batch's documents, and every layer uses its window's mask."""
    built, original = [], sliding_window_layout.band_block_mask
    used, flex = [], sliding_window.flex_attention

    def counted(attention_mask, is_global, window, length, device, document_ids=None):
        mask = original(attention_mask, is_global, window, length, device, document_ids)
        built.append((window, document_ids, mask))
        return mask

    def recorded(q, k, v, block_mask=None, **kwargs):
        used.append(block_mask)
        return flex(q, k, v, block_mask=block_mask, **kwargs)

    monkeypatch.setattr(sliding_window_layout, "band_block_mask", counted)
    monkeypatch.setattr(sliding_window, "flex_attention", recorded)
    model = build()
    model.set_attn_implementation("flex_attention")
    docs = documents((10, 23, 7), seed=13)
    inputs = packed(docs, "cu_seq_lens")
    with torch.no_grad():
        out = model(**inputs).last_hidden_state
    windows = [layer.attention.self.one_sided_window for layer in model.encoder.layer]
    assert sorted(w for w, _, _ in built) == sorted(set(windows)) and len(built) == 2
    expected = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 23, 7]))[None]
    assert all(torch.equal(ids, expected) for _, ids, _ in built)
    by_window = {w: mask for w, _, mask in built}
    assert [id(m) for m in used] == [id(by_window[w]) for w in windows]
    for doc, span in zip(docs, spans(docs)):
        with torch.no_grad():
            assert (out[0, span] - solo(model, doc, None).last_hidden_state[0]).abs().max() < ATOL
