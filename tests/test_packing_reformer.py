"""Packed (padding-free) batches on hfx-reformer: every document of a packed row gets what its own forward gives.

The Reformer model lays the documents out in an internal row, each padded to the chunk multiple as its own forward
pads it, so that local chunks and LSH's sorted chunks never hold two documents and wrap around within each one
(``modeling_reformer.lay_out_documents``, ``chunked_local.DocumentLayout``). Documents here are shorter and longer
than the chunks (local 4, LSH 8, chunk multiple 8) and of lengths that are no multiple of either.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

from hf_xformers import (  # noqa: E402
    HfxReformerConfig,
    HfxReformerForCausalLM,
    HfxReformerForMaskedLM,
    HfxReformerModel,
)
from hf_xformers.models.reformer.modeling_reformer import lay_out_documents  # noqa: E402
from hf_xformers.ops.input_checks import as_if_on_accelerator  # noqa: E402
from hf_xformers.ops.packing import resolve_packed_batch  # noqa: E402
from tests.host_reads import HostReadCounter  # noqa: E402

ATOL = 1e-5
TINY = dict(
    vocab_size=99, hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37,
    attn_layers=["local", "lsh"], local_attn_chunk_length=4, lsh_attn_chunk_length=8, num_buckets=4,
    axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16], max_position_embeddings=64, pad_token_id=1,
    eos_token_id=None, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
    lsh_attention_probs_dropout_prob=0.0,
)  # fmt: skip
# Shorter than a local chunk, between the chunks, one LSH chunk exactly, longer than several; no multiple of 8 but one.
LENGTHS = (10, 23, 3, 1, 8, 13, 6)
# The collator's forms that mark documents (position_ids alone are positions: tests/test_packing_boundaries.py).
FORMS = {
    "seq_idx": dict(return_seq_idx=True),
    "cu_seq_lens": dict(return_flash_attn_kwargs=True),
}
VARIANTS = {
    "encoder": dict(),
    "encoder-2-rounds-chunks-after": dict(num_hashes=2, local_num_chunks_after=1, lsh_num_chunks_after=1),
    "wide-windows": dict(local_num_chunks_before=3, lsh_num_chunks_before=2, num_hashes=2),
    "decoder": dict(is_decoder=True),
    "decoder-3-rounds": dict(is_decoder=True, num_hashes=3),
    "default-buckets-factorised": dict(num_buckets=None, max_position_embeddings=64, lsh_attn_chunk_length=4),
}


def make_model(model_class=HfxReformerModel, train: bool = False, **overrides):
    torch.manual_seed(0)
    model = model_class(HfxReformerConfig(**{**TINY, **overrides}))
    return model.train(train)


def documents(lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TINY["vocab_size"], (n,), generator=g) for n in lengths]


def pack(docs: list[torch.Tensor], form: str, keep_positions: bool = False) -> dict:
    """The collator's packed row (positions from 0, Reformer's first position); the positions are dropped unless
    ``keep_positions``, so that the boundaries alone place the documents."""
    batch = DataCollatorWithFlattening(position_ids_start=0, **FORMS[form])([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    if not keep_positions:
        batch.pop("position_ids")
    return batch


def spans(docs):
    start = 0
    for d in docs:
        yield slice(start, start + d.numel())
        start += d.numel()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", FORMS)
def test_packed_documents_match_their_own_forwards(form, variant):
    model = make_model(**VARIANTS[variant])
    docs = documents()
    with torch.no_grad():
        packed = model(**pack(docs, form)).last_hidden_state
        assert packed.shape == (1, sum(LENGTHS), 2 * TINY["hidden_size"])
        for span, doc in zip(spans(docs), docs):
            torch.testing.assert_close(packed[0, span], model(doc[None]).last_hidden_state[0], atol=ATOL, rtol=0)


def test_a_packed_layout_that_ignores_documents_would_differ():
    """The comparison above has teeth: the same tokens as one unpacked row give other outputs in every document but
    the first (and the first gets what it gets alone only because nothing before it exists)."""
    model = make_model(num_hashes=2)
    docs = documents()
    with torch.no_grad():
        whole = model(torch.cat(docs)[None]).last_hidden_state
        for span, doc in list(zip(spans(docs), docs))[1:]:
            if doc.numel() > 1:
                assert (whole[0, span] - model(doc[None]).last_hidden_state[0]).abs().max() > 1e-3


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("hash_seed", [None, 5])
def test_packed_training_forward_matches_solo(form, hash_seed):
    """Train mode with every dropout 0. Training without a hash_seed draws fresh rotations per layer and call; their
    shape does not depend on the input, so the same generator state gives a packed row the rotations each solo
    call gets (one draw per LSH layer either way)."""
    model = make_model(train=True, hash_seed=hash_seed, num_hashes=2)
    docs = documents()
    torch.manual_seed(11)
    packed = model(**pack(docs, form)).last_hidden_state
    for span, doc in zip(spans(docs), docs):
        torch.manual_seed(11)
        torch.testing.assert_close(packed[0, span], model(doc[None]).last_hidden_state[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_packed_reversible_gradients_match_the_sum_of_solo_gradients(is_decoder):
    """The reversible backward pass recomputes each layer on the internal row with the forward's buckets: the
    gradients of a packed loss equal those of the same loss summed over the solo forwards."""
    model = make_model(train=True, hash_seed=5, num_hashes=2, is_decoder=is_decoder)
    assert model.config.reversible
    docs = documents()
    weights = torch.randn(sum(LENGTHS), 2 * TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    (model(**pack(docs, "seq_idx")).last_hidden_state[0] * weights).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for span, doc in zip(spans(docs), docs):
        (model(doc[None]).last_hidden_state[0] * weights[span]).sum().backward()
    assert packed
    for name, p in model.named_parameters():
        if name in packed:
            torch.testing.assert_close(packed[name], p.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_packed_rows_of_a_batch_via_seq_idx():
    """Two packed rows of different document counts (seq_idx (2, len)) whose internal rows differ in length."""
    model = make_model(num_hashes=2)
    rows = [documents((17, 5), seed=1), documents((1, 19, 2), seed=2)]
    ids = torch.stack([torch.cat(r) for r in rows])
    seq_idx = torch.stack([torch.cat([torch.full((d.numel(),), i) for i, d in enumerate(r)]) for r in rows])
    with torch.no_grad():
        packed = model(ids, seq_idx=seq_idx).last_hidden_state
        for b, row in enumerate(rows):
            for span, doc in zip(spans(row), row):
                solo = model(doc[None]).last_hidden_state[0]
                torch.testing.assert_close(packed[b, span], solo, atol=ATOL, rtol=0)


def test_masked_tokens_of_a_packed_row_are_padding_between_documents():
    """An attention mask on a packed row marks padding, which is never part of a document (``ops.packing``, as every
    architecture reads a packed batch): a masked span splits a document in two, and each unmasked run of tokens gets
    what its own forward gives (positions restart in each, as the batch gives none). Masked spans at a document's
    start, inside it and at its end, of one token and of many; runs shorter than a chunk and longer."""
    model = make_model(num_hashes=2)
    docs = documents()
    mask = torch.ones(sum(LENGTHS), dtype=torch.long)
    mask[[4, 9, *range(15, 33), 37, 38, 39, *range(50, 58)]] = 0
    with torch.no_grad():
        packed = model(**pack(docs, "cu_seq_lens"), attention_mask=mask[None]).last_hidden_state
        ids = torch.cat(docs)
        runs = 0
        for span in spans(docs):
            where = torch.arange(span.start, span.stop)
            real = where[mask[span].bool()]
            # maximal unmasked runs of this document
            for run in torch.tensor_split(real, (torch.nonzero(real.diff() != 1)[:, 0] + 1).tolist()):
                if run.numel():
                    runs += 1
                    solo = model(ids[run][None]).last_hidden_state[0]
                    torch.testing.assert_close(packed[0, run], solo, atol=ATOL, rtol=0)
    assert runs == 8  # the first document split in two; the others cut short or whole


def test_packed_hidden_states_and_attentions():
    """Per-layer hidden states come back on the packed row (on the autograd path of the output); attention maps are
    (heads, total, total) with each document's block equal to its own and nothing across documents."""
    model = make_model(num_hashes=2)
    docs = documents()
    out = model(**pack(docs, "seq_idx"), output_hidden_states=True, output_attentions=True)
    assert all(h.shape == (1, sum(LENGTHS), TINY["hidden_size"]) for h in out.hidden_states)
    for h in out.hidden_states:
        h.retain_grad()
    out.last_hidden_state.sum().backward()
    assert all(h.grad is not None and h.grad.abs().sum() > 0 for h in out.hidden_states)
    inside = torch.zeros(sum(LENGTHS), sum(LENGTHS), dtype=torch.bool)
    with torch.no_grad():
        for span, doc in zip(spans(docs), docs):
            inside[span, span] = True
            solo = model(doc[None], output_hidden_states=True, output_attentions=True)
            for packed_h, solo_h in zip(out.hidden_states, solo.hidden_states):
                torch.testing.assert_close(packed_h[0, span], solo_h[0], atol=ATOL, rtol=0)
            for packed_a, solo_a in zip(out.attentions, solo.attentions):
                torch.testing.assert_close(packed_a[0][:, span, span], solo_a[0], atol=ATOL, rtol=0)
    for a in out.attentions:
        assert a.shape == (1, TINY["num_attention_heads"], sum(LENGTHS), sum(LENGTHS))
        assert float(a.detach()[0][:, ~inside].abs().max()) == 0.0


@pytest.mark.parametrize("num_hashes", [1, 2])
def test_packed_flex_attention_matches_solo(num_hashes):
    """Under "flex_attention" the chunk windows of every document become the BlockMask (on the CPU, LSH with
    several rounds keeps the chunked kernel, which needs FlexAttention's log-normalisers)."""
    model = make_model(num_hashes=num_hashes)
    docs = documents()
    model.set_attn_implementation("flex_attention")
    with torch.no_grad():
        packed = model(**pack(docs, "cu_seq_lens")).last_hidden_state
        model.set_attn_implementation("sdpa")
        for span, doc in zip(spans(docs), docs):
            torch.testing.assert_close(packed[0, span], model(doc[None]).last_hidden_state[0], atol=ATOL, rtol=0)


def test_packed_flex_local_layers_share_one_document_mask(monkeypatch):
    """Every local layer of a packed forward runs FlexAttention over the whole internal row with one document
    BlockMask, built by the first local layer and reused by the others (same chunks, windows and key mask)."""
    from hf_xformers.attention import chunked_local

    built = []
    make = chunked_local.make_block_mask
    monkeypatch.setattr(chunked_local, "make_block_mask", lambda *a, **k: built.append(1) or make(*a, **k))
    model = make_model(is_decoder=True, attn_layers=["local", "lsh", "local", "local"])
    model.set_attn_implementation("flex_attention")
    docs = documents()
    with torch.no_grad():
        packed = model(**pack(docs, "cu_seq_lens")).last_hidden_state
        assert len(built) == 1
        model(**pack(docs, "cu_seq_lens"))
        assert len(built) == 2  # once per forward: nothing outlives it
        model.set_attn_implementation("sdpa")
        for span, doc in zip(spans(docs), docs):
            torch.testing.assert_close(packed[0, span], model(doc[None]).last_hidden_state[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("form", FORMS)
def test_packed_causal_lm_logits_and_loss(form):
    """HfxReformerForCausalLM: logits of each document as alone; the loss is the mean over every document's
    next-token predictions, and no document's last token is scored against the next one's first."""
    model = make_model(HfxReformerForCausalLM)
    docs = documents()
    labels = torch.cat(docs)[None]
    with torch.no_grad():
        packed = model(**pack(docs, form), labels=labels)
        solos = [model(doc[None], labels=doc[None]) for doc in docs]
    for span, solo in zip(spans(docs), solos):
        torch.testing.assert_close(packed.logits[0, span], solo.logits[0], atol=ATOL, rtol=0)
    scored = [d.numel() - 1 for d in docs]
    expected = sum(s.loss * n for s, n in zip(solos, scored) if n) / sum(scored)
    torch.testing.assert_close(packed.loss, expected, atol=ATOL, rtol=1e-5)
    assert packed.past_buckets_states is None


def test_packed_masked_lm_logits():
    model = make_model(HfxReformerForMaskedLM)
    docs = documents()
    with torch.no_grad():
        packed = model(**pack(docs, "seq_idx")).logits
        for span, doc in zip(spans(docs), docs):
            torch.testing.assert_close(packed[0, span], model(doc[None]).logits[0], atol=ATOL, rtol=0)


def test_packed_row_longer_than_the_position_table():
    """Positions restart per document: the row may exceed max_position_embeddings, a document may not."""
    model = make_model()
    docs = documents((40, 30, 20))
    with torch.no_grad():
        packed = model(**pack(docs, "seq_idx")).last_hidden_state
        for span, doc in zip(spans(docs), docs):
            torch.testing.assert_close(packed[0, span], model(doc[None]).last_hidden_state[0], atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match="max_position_embeddings"):
            model(**pack(documents((65, 3)), "seq_idx"))


def test_packing_refuses_a_cache_and_shifted_positions():
    model = make_model(HfxReformerForCausalLM)
    docs = documents()
    with torch.no_grad():
        with pytest.raises(ValueError, match="decoding cache"):
            model(**pack(docs, "seq_idx"), use_cache=True)
        cache = model(docs[0][None], use_cache=True).past_buckets_states
        with pytest.raises(ValueError, match="decoding cache"):
            model(**pack(docs, "seq_idx"), past_buckets_states=cache)
        shifted = pack(docs, "seq_idx", keep_positions=True)
        shifted["position_ids"] = shifted["position_ids"] + 2
        with pytest.raises(ValueError, match="position_ids_start=0"):
            model(**shifted)


def test_ordinary_inputs_are_not_packed():
    """position_ids counting 0, 1, ... (one document) and a single-document seq_idx give the unpacked output, bit
    for bit."""
    model = make_model(num_hashes=2)
    ids = torch.cat(documents())[None]
    with torch.no_grad():
        plain = model(ids).last_hidden_state
        counted = model(ids, position_ids=torch.arange(ids.shape[1])[None]).last_hidden_state
        single = model(ids, seq_idx=torch.zeros_like(ids)).last_hidden_state
    assert torch.equal(plain, counted) and torch.equal(plain, single)


def test_layout_costs_the_tokens_plus_less_than_a_chunk_multiple_per_document():
    """Every document starts at a multiple of the chunk multiple (8) and occupies its length rounded up to it. Where
    values may be read (here: no gradients) the row is as long as its regions; where they may not (a training step
    on an accelerator, a traced graph) it is the bound ``tokens + documents * 7`` rounded up to 8, from host numbers
    only: the same slots and regions, and a longer empty tail."""
    docs = documents()
    batch = pack(docs, "cu_seq_lens")
    packed = resolve_packed_batch(
        tuple(batch["input_ids"].shape), torch.device("cpu"), cu_seq_lens_q=batch["cu_seq_lens_q"]
    )
    regions = [(n + 7) // 8 * 8 for n in LENGTHS]
    starts = torch.tensor([0, *regions]).cumsum(0)[:-1]
    solo = [n if n <= 4 else (n + 7) // 8 * 8 for n in LENGTHS]
    with torch.no_grad():
        exact = lay_out_documents(packed, 8, 4)
    with as_if_on_accelerator(), HostReadCounter() as counter:
        bound = lay_out_documents(packed, 8, 4)
    assert counter.total_reads == 0, dict(counter.reads)
    assert exact[2] == sum(regions) < sum(LENGTHS) + 8 * len(LENGTHS)
    assert bound[2] == (sum(LENGTHS) + 7 * len(LENGTHS) + 7) // 8 * 8 > exact[2]
    for layout, slots, length in (exact, bound):
        assert torch.equal(slots, exact[1])
        for start, span in zip(starts, spans(docs)):
            assert torch.equal(slots[0, span], start + torch.arange(span.stop - span.start))
            assert int(layout.region_start[0, start]) == int(start)
        assert layout.solo_length[0, starts].tolist() == solo
        tail = torch.arange(length) >= sum(regions)  # one region holding no document
        assert torch.equal(layout.region_start[0, tail], torch.full((int(tail.sum()),), sum(regions)))
        assert not layout.solo_length[0, tail].any()


def test_layout_of_an_unknown_number_of_documents_names_cu_seq_lens():
    """A traced graph given only ``seq_idx`` cannot know how many documents there are (eager mode reads it): the
    layout, whose length depends on it, refuses with the fix."""
    packed = resolve_packed_batch((1, 12), torch.device("cpu"), seq_idx=torch.tensor([[0, 0, 0, 1, 1] + [2] * 7]))
    unknown = dataclasses.replace(packed, count=None)
    with pytest.raises(ValueError, match="cu_seq_lens_q/k"):
        lay_out_documents(unknown, 8, 4)


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("model_class", [HfxReformerModel, HfxReformerForCausalLM])
def test_left_padded_row_with_generate_positions_is_not_packed(model_class, use_cache):
    """A left-padded single row with generate()-style positions (counted over the mask, padding at 1: they restart)
    is an ordinary padded row, not documents: its outputs are those of the same row in a batch of two (never read as
    packed from positions), with or without a cache."""
    model = make_model(model_class, is_decoder=True)
    ids = torch.cat(documents((19, 19), seed=4))[None].view(2, 19)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        alone = model(ids[:1], attention_mask=mask[:1], position_ids=positions[:1], use_cache=use_cache)
        pair = model(ids, attention_mask=mask, position_ids=positions, use_cache=use_cache)
    name = "last_hidden_state" if model_class is HfxReformerModel else "logits"
    torch.testing.assert_close(getattr(alone, name), getattr(pair, name)[:1], atol=ATOL, rtol=0)
    assert (alone.past_buckets_states is not None) == use_cache
    # Reading the positions as documents would give the real tokens what they get alone (their chunks then start at
    # their first token): other numbers, so the comparison above can fail.
    with torch.no_grad():
        real_alone = getattr(model(ids[:1, 5:]), name)
    assert not torch.allclose(real_alone[0], getattr(alone, name)[0, 5:], atol=1e-3)
