"""Packed (padding-free) batches for the Universal Transformer, and their refusal by Transformer-XL.

transformers' ``DataCollatorWithFlattening`` packs documents of mixed lengths into one row in three forms (restarting
``position_ids``, ``seq_idx``, ``cu_seq_lens_q/k``); every document of the packed row must get what its own solo forward
gives (batch 1, no padding): the encoder and the causal decoder, ACT and fixed steps, the feed-forward and the
separable-convolution transitions, sinusoidal and learned positions, eval and train mode (dropout 0), the three
attention implementations. The Universal Transformer counts positions from 0 (``position_ids_start=0``, the collator's
default). Transformer-XL, whose memories and relative positions run across a stream, refuses packed rows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_xformers import (
    HfxTransfoXLForCausalLM,
    HfxTransfoXLForSequenceClassification,
    HfxTransfoXLModel,
    HfxUniversalConfig,
    HfxUniversalForCausalLM,
    HfxUniversalForSeq2SeqLM,
    HfxUniversalModel,
)
from hf_xformers.models.universal.recurrent_block import HfxSeparableConv1d
from hf_xformers.ops import attention_switch as switch
from hf_xformers.ops import varlen
from hf_xformers.ops.input_checks import as_if_on_accelerator

from .conformance import VOCAB
from .host_reads import HostReadCounter
from .test_transfo_xl import tiny as tiny_transfo_xl

ATOL = 1e-5
# A row longer than max_position_embeddings (25 > 16), each document within it; a one-token document too.
LENGTHS = (9, 3, 12, 1)
# The collator's forms that mark documents (position_ids alone are positions: tests/test_packing_boundaries.py).
FORMS = ("seq_idx", "cu_seq_lens", "all")
VARIANTS = {
    "act-ffn": dict(use_act=True),
    "fixed-sepconv": dict(use_act=False, transition="sepconv"),
    "act-sepconv-absolute": dict(use_act=True, transition="sepconv", position_embedding_type="absolute"),
}


def universal_config(**overrides) -> HfxUniversalConfig:
    tiny = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, act_max_steps=4,
        act_halting_bias_init=-0.5,
    )  # fmt: skip
    return HfxUniversalConfig(**{**tiny, **overrides})


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every tensor made to matter (the default init leaves biases at 0 and LayerNorms at 1), so that positions halt
    after different numbers of ACT steps (1 to the cap of 4 here)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.4 if "halting_unit" in name else 0.1) * torch.randn_like(p))
    return model


def documents(lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB, (n,), generator=g) for n in lengths]


def collate(docs: list[torch.Tensor], form: str) -> tuple[dict, torch.Tensor]:
    """The packed row in one of the collator's forms: ``(model inputs, labels)``."""
    options = {
        "seq_idx": dict(return_position_ids=False, return_seq_idx=True),
        "cu_seq_lens": dict(return_position_ids=False, return_flash_attn_kwargs=True),
        "all": dict(return_seq_idx=True, return_flash_attn_kwargs=True),
    }[form]
    batch = DataCollatorWithFlattening(return_tensors="pt", position_ids_start=0, **options)(
        [{"input_ids": d.tolist()} for d in docs]
    )
    return batch, batch.pop("labels")


def spans(lengths=LENGTHS):
    start = 0
    for n in lengths:
        yield slice(start, start + n)
        start += n


def build(model_class, mode: str, implementation: str = "sdpa", **overrides):
    torch.manual_seed(0)
    model = perturbed(model_class(universal_config(**overrides)))
    model.set_attn_implementation(implementation)
    return model.train() if mode == "train" else model.eval()


def assert_encoder_matches_solo(model, docs, form):
    batch, _ = collate(docs, form)
    with torch.no_grad():
        packed = model(**batch)
        solos = [model(input_ids=d[None]) for d in docs]
    for span, solo in zip(spans([len(d) for d in docs]), solos):
        torch.testing.assert_close(packed.last_hidden_state[0, span], solo.last_hidden_state[0], atol=ATOL, rtol=0)
        assert torch.equal(packed.ponder_steps[0, span], solo.ponder_steps[0])
    torch.testing.assert_close(packed.pooler_output, torch.cat([s.pooler_output for s in solos]), atol=ATOL, rtol=0)
    return packed, solos


# ----- the encoder -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", FORMS)
def test_encoder_packed_documents_match_solo_forwards(form, variant, mode):
    model = build(HfxUniversalModel, mode, **VARIANTS[variant])
    docs = documents()
    packed, solos = assert_encoder_matches_solo(model, docs, form)
    if model.config.use_act:
        # The ponder loss is the mean over the real tokens of the row: the solo losses weighted by their lengths,
        # as a padded batch of the same documents gives it.
        weighted = sum(len(d) * s.ponder_loss for d, s in zip(docs, solos)) / sum(len(d) for d in docs)
        torch.testing.assert_close(packed.ponder_loss, weighted, atol=1e-6, rtol=0)
        steps = packed.ponder_steps[0]
        assert steps.min() < steps.max(), "the test should see positions halt at different steps"
    else:
        assert packed.ponder_loss is None


@pytest.mark.parametrize("implementation", ["eager", "flex_attention"])
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_every_attention_implementation_stays_inside_documents(implementation, decoder, monkeypatch):
    # The eager form of FlexAttention applies the mask_mod to every score (the compiled kernel would compile per
    # length on the CPU); the block mask it builds is the same either way.
    monkeypatch.setattr(switch, "FLEX_COMPILE", False)
    model = build(HfxUniversalModel, "eval", implementation, is_decoder=decoder, transition="sepconv")
    assert_encoder_matches_solo(model, documents(), "seq_idx")


def test_flex_attention_builds_the_document_mask_once(monkeypatch):
    """Under flex_attention a packed forward builds one BlockMask from the document ids (no dense (seq, seq) mask) and
    every recurrent step reuses it."""
    monkeypatch.setattr(switch, "FLEX_COMPILE", False)
    built, calls = [], []
    real_mask, real_flex = varlen.make_block_mask, varlen.flex_attention

    def recording_mask(mask_mod, *args, **kwargs):
        built.append(mask_mod.__code__.co_freevars)
        return real_mask(mask_mod, *args, **kwargs)

    def recording_flex(*args, **kwargs):
        calls.append(kwargs["block_mask"])
        return real_flex(*args, **kwargs)

    monkeypatch.setattr(varlen, "make_block_mask", recording_mask)
    monkeypatch.setattr(varlen, "flex_attention", recording_flex)
    model = build(HfxUniversalModel, "eval", "flex_attention", is_decoder=True, use_act=False, num_hidden_layers=3)
    batch, _ = collate(documents(), "cu_seq_lens")
    with torch.no_grad():
        model(**batch)
    assert len(built) == 1 and "document_ids" in built[0]
    assert len(calls) == 3 and all(mask is calls[0] for mask in calls)


def test_packed_attention_maps_are_block_diagonal():
    model = build(HfxUniversalModel, "eval", is_decoder=True)
    docs = documents()
    batch, _ = collate(docs, "seq_idx")
    with torch.no_grad():
        packed = model(**batch, output_attentions=True)
        solos = [model(input_ids=d[None], output_attentions=True) for d in docs]
    for step, probs in enumerate(packed.attentions):
        for span, solo in zip(spans(), solos):
            block = probs[0, :, span, span]
            torch.testing.assert_close(block, solo.attentions[step][0], atol=ATOL, rtol=0)
            torch.testing.assert_close(block.sum(-1), torch.ones_like(block.sum(-1)), atol=ATOL, rtol=0)


def test_packed_gradients_are_the_sum_of_solo_gradients():
    """Training on a packed row is training on its documents: the gradient of the summed outputs equals the sum of
    the solo gradients (separable convolutions, ACT halting and attention included)."""
    model = build(HfxUniversalModel, "train", transition="sepconv")
    docs = documents()
    batch, _ = collate(docs, "seq_idx")
    model.zero_grad()
    out = model(**batch)
    (out.last_hidden_state.square().sum() + out.pooler_output.sum()).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for d in docs:
        solo = model(input_ids=d[None])
        (solo.last_hidden_state.square().sum() + solo.pooler_output.sum()).backward()
    for name, p in model.named_parameters():
        if name in packed:
            torch.testing.assert_close(packed[name], p.grad, atol=1e-4, rtol=1e-4, msg=name)


# ----- the causal decoder ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", FORMS)
def test_causal_lm_packed_documents_match_solo_forwards(form, variant, mode):
    model = build(HfxUniversalForCausalLM, mode, **VARIANTS[variant])
    docs = documents(seed=1)
    batch, labels = collate(docs, form)
    with torch.no_grad():
        base = model.universal(**batch)
        logits = model.lm_head(base.last_hidden_state)
        solos = [model(input_ids=d[None], labels=d[None]) for d in docs]
    for span, solo in zip(spans(), solos):
        torch.testing.assert_close(logits[0, span], solo.logits[0], atol=ATOL, rtol=0)
    if form != "all":
        return
    # The head itself: the collator's labels (-100 at every document's first token) give the next-token loss of
    # each document, averaged over all scored tokens, plus the ponder loss over all tokens.
    with torch.no_grad():
        packed = model(**batch, labels=labels)
    torch.testing.assert_close(packed.logits, logits, atol=ATOL, rtol=0)
    ponder = [s.ponder_loss if s.ponder_loss is not None else torch.tensor(0.0) for s in solos]
    task = sum((len(d) - 1) * (s.loss - p) for d, s, p in zip(docs, solos, ponder)) / sum(len(d) - 1 for d in docs)
    packed_ponder = packed.ponder_loss if packed.ponder_loss is not None else 0.0
    torch.testing.assert_close(packed.loss - packed_ponder, task, atol=ATOL, rtol=0)


def test_causal_lm_refuses_a_packed_batch_with_a_cache():
    model = build(HfxUniversalForCausalLM, "eval")
    batch, _ = collate(documents(), "seq_idx")
    with pytest.raises(ValueError, match="packed .*use_cache=False"):
        model.universal(**batch, use_cache=True)
    batch, _ = collate(documents(), "cu_seq_lens")
    with pytest.raises(ValueError, match="cannot take a packed"):
        model(**batch, use_cache=True)


def test_generation_positions_are_no_documents():
    """generate() makes position_ids that restart at left padding: with the attention mask they are positions only
    (the base model's rule), not documents that a cache would have to refuse."""
    model = build(HfxUniversalForCausalLM, "eval")
    prompt = torch.tensor([[1, 1, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    positions = torch.tensor([[0, 0, 0, 1, 2]])
    with torch.no_grad():
        padded = model.universal(input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True)
        alone = model.universal(input_ids=prompt[:, 2:], use_cache=True)
    torch.testing.assert_close(padded.last_hidden_state[:, 2:], alone.last_hidden_state, atol=ATOL, rtol=0)


def test_generate_from_a_left_padded_prompt():
    model = build(HfxUniversalForCausalLM, "eval")
    prompt = torch.tensor([[1, 1, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    out = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1)
    alone = model.generate(input_ids=prompt[:, 2:], max_new_tokens=3, do_sample=False, pad_token_id=1)
    assert torch.equal(out[:, 2:], alone)


def test_positions_must_start_at_zero():
    model = build(HfxUniversalModel, "eval")
    docs = documents()
    batch = DataCollatorWithFlattening(return_tensors="pt", return_seq_idx=True, position_ids_start=2)(
        [{"input_ids": d.tolist()} for d in docs]
    )
    batch.pop("labels")
    with pytest.raises(ValueError, match="position_ids_start=0"):
        model(**batch)


def test_a_packed_document_longer_than_the_positions_is_refused():
    model = build(HfxUniversalModel, "eval")
    batch, _ = collate(documents((5, 17)), "seq_idx")
    with pytest.raises(ValueError, match="17 tokens exceeds config.max_position_embeddings=16"):
        model(**batch)


def test_the_batch_says_how_long_its_longest_document_is():
    """A training step on an accelerator reads nothing back, so the longest document comes from the batch: the
    collator's ``max_length_q`` is checked against the position table without a read (and without it, nothing is
    checked there rather than read)."""
    model = build(HfxUniversalModel, "train")
    batch, _ = collate(documents((5, 17)), "cu_seq_lens")
    counter = HostReadCounter()
    with as_if_on_accelerator(), counter:
        with pytest.raises(ValueError, match="17 tokens exceeds config.max_position_embeddings=16"):
            model(**batch)
    assert counter.total_reads == 0, dict(counter.reads)
    batch, _ = collate(documents((5, 11)), "cu_seq_lens")
    batch["max_length_q"] = batch["max_length_k"] = 17  # the batch's word is taken as it is
    with pytest.raises(ValueError, match="17 tokens exceeds"):
        model(**batch)


def test_an_ordinary_batch_with_plain_positions_is_not_packed():
    model = build(HfxUniversalModel, "eval")
    ids = documents((12,))[0][None]
    with torch.no_grad():
        plain = model(input_ids=ids)
        positioned = model(input_ids=ids, position_ids=torch.arange(12)[None])
    assert torch.equal(plain.last_hidden_state, positioned.last_hidden_state)


@pytest.mark.parametrize("causal", [False, True])
def test_separable_convolution_of_one_document_is_the_convolution(causal):
    torch.manual_seed(0)
    conv = HfxSeparableConv1d(6, 4, 5, causal)
    x = torch.randn(2, 11, 6)
    expected, _ = conv(x)
    got, _ = conv(x, document_ids=torch.zeros(2, 11, dtype=torch.long))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_seq2seq_refuses_packing():
    torch.manual_seed(0)
    model = HfxUniversalForSeq2SeqLM(universal_config()).eval()
    batch, labels = collate(documents(), "all")
    with pytest.raises(ValueError, match="HfxUniversalForSeq2SeqLM cannot take a packed"):
        model(**batch, labels=labels)


# ----- Transformer-XL refuses -------------------------------------------------------------------------------------

TRANSFO_XL = [HfxTransfoXLModel, HfxTransfoXLForCausalLM, HfxTransfoXLForSequenceClassification]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("model_class", TRANSFO_XL, ids=lambda c: c.__name__)
def test_transfo_xl_refuses_packed_batches(model_class, form):
    torch.manual_seed(0)
    model = model_class(tiny_transfo_xl()).eval()
    batch, _ = collate(documents(), form)
    with pytest.raises(ValueError, match="cannot take a packed .*memories carry hidden states .*examples/run_clm.py"):
        model(**batch)


@pytest.mark.parametrize("model_class", TRANSFO_XL, ids=lambda c: c.__name__)
def test_transfo_xl_takes_an_ordinary_batch_with_positions(model_class):
    """One document per row (plain positions), or positions that restart at padding, are no packed batch."""
    torch.manual_seed(0)
    model = model_class(tiny_transfo_xl()).eval()
    ids = documents((10,))[0][None]
    with torch.no_grad():
        plain = model(input_ids=ids)
        positioned = model(input_ids=ids, position_ids=torch.arange(10)[None])
        mask = torch.ones_like(ids)
        mask[:, :3] = 0
        padded_positions = (mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=padded_positions)
    assert torch.equal(plain[0], positioned[0])


def test_transfo_xl_generates_from_a_left_padded_prompt():
    """generate() now passes position_ids (forward accepts them), restarting at left padding: no packed batch."""
    torch.manual_seed(0)
    model = HfxTransfoXLForCausalLM(tiny_transfo_xl(mem_len=16)).eval()
    prompt = torch.tensor([[1, 1, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    out = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1)
    alone = model.generate(input_ids=prompt[:, 2:], max_new_tokens=3, do_sample=False, pad_token_id=1)
    assert torch.equal(out[:, 2:], alone)


# ----- one attention call per step over the whole row (ops/varlen.py) ---------------------------------------------


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_sdpa_attends_to_the_whole_row_once_per_step(decoder, monkeypatch):
    """On an accelerator under SDPA a packed row makes one attention call per recurrent step, over the whole row, with
    a block-diagonal mask (causal inside each document for a decoder): the number of calls does not depend on the
    documents."""
    calls = []
    real_sdpa = varlen.F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[2], attn_mask))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    model = build(HfxUniversalModel, "eval", is_decoder=decoder, use_act=False, num_hidden_layers=3)
    inputs, _ = collate(documents(), "seq_idx")
    monkeypatch.setattr(varlen.F, "scaled_dot_product_attention", recording_sdpa)
    with torch.no_grad(), as_if_on_accelerator():
        model(**inputs)
    total = sum(LENGTHS)
    assert [length for length, _ in calls] == [total] * 3
    ends = torch.tensor(LENGTHS).cumsum(0)
    document = torch.bucketize(torch.arange(total), ends, right=True)
    expected = document[:, None] == document[None, :]
    if decoder:
        expected &= torch.ones(total, total, dtype=torch.bool).tril()
    assert all(mask is calls[0][1] for _, mask in calls)  # built once per forward
    assert torch.equal(calls[0][1][0, 0], expected)


@pytest.mark.parametrize("form", ["seq_idx", "cu_seq_lens"])
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_cpu_attends_document_by_document(decoder, form, monkeypatch):
    """On the CPU in eager mode (reads free, launches cheap) each document is its own SDPA call per step, with no
    mask (causal through is_causal): the work is the documents' sum of squared lengths, not the row's square."""
    calls = []
    real_sdpa = varlen.F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((q.shape[2], attn_mask, is_causal))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    model = build(HfxUniversalModel, "eval", is_decoder=decoder, use_act=False, num_hidden_layers=3)
    inputs, _ = collate(documents(), form)
    monkeypatch.setattr(varlen.F, "scaled_dot_product_attention", recording_sdpa)
    with torch.no_grad():
        model(**inputs)
    assert [length for length, _, _ in calls] == list(LENGTHS) * 3
    assert all(mask is None and causal == decoder for _, mask, causal in calls)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """What ``varlen_attn`` computes, spelled out per document: ``(tokens, heads, d)`` inputs, each document of
    ``cu_seq_q`` its own softmax attention (``window_size=(-1, 0)``: causal)."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    bounds = cu_seq_q.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) <= max_q
    outputs = []
    for a, b in zip(bounds, bounds[1:]):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if tuple(window_size) == (-1, 0):
            scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_varlen_kernel_dispatch(decoder, mode, monkeypatch):
    """Where ``varlen_attn`` runs (CUDA, 16-bit; stood in for here by a reference kernel on the CPU), a packed row of
    the collator's flash form makes one call per step over the whole row, with the batch's ``cu_seq_lens`` and
    ``max_length_q`` and the causal window for a decoder, and gives what the SDPA path gives, gradients included."""
    model = build(HfxUniversalModel, mode, is_decoder=decoder, transition="sepconv")
    docs = documents()
    batch, _ = collate(docs, "cu_seq_lens")

    def step():
        model.zero_grad()
        out = model(**batch)
        out.last_hidden_state.square().sum().backward()
        return out.last_hidden_state, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected, expected_grads = step()
    calls = []

    def recording_kernel(*args, **kwargs):
        calls.append((args[3], args[5], kwargs["window_size"]))
        return reference_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(varlen, "_flash_device", lambda device, dtype: True)
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: recording_kernel)
    got, grads = step()
    steps = model.config.act_max_steps
    assert len(calls) == steps
    for cu, longest, window in calls:
        assert torch.equal(cu, batch["cu_seq_lens_q"].int()) and longest == batch["max_length_q"] == max(LENGTHS)
        assert window == ((-1, 0) if decoder else (-1, -1))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kernel_of_torch_2_10(causal, monkeypatch):
    """torch 2.10's ``varlen_attn`` takes ``is_causal`` and no ``scale`` (later releases: ``window_size``): the call
    is spelled for the kernel installed, and a scale is folded into the queries."""
    calls = []

    def kernel_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        calls.append(is_causal)
        return reference_varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0) if is_causal else (-1, -1)
        )

    monkeypatch.setattr(varlen, "_flash_device", lambda device, dtype: True)
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: kernel_2_10)
    monkeypatch.setattr(varlen, "_VARLEN_PARAMETERS", frozenset(["query", "is_causal"]))
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, sum(LENGTHS), 8).unbind(0)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).int()
    ids = torch.bucketize(torch.arange(sum(LENGTHS)), cu[1:], right=True)[None]
    layout = varlen.document_layout(ids, causal, cu_seq_lens=cu, max_length=max(LENGTHS), varlen=True)
    got = varlen.document_attention(q, k, v, layout, scale=0.2)
    mask = varlen.document_mask(ids, causal)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)
    assert calls == [causal]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_varlen_is_not_used_where_it_cannot_run(monkeypatch):
    """The varlen kernel has no dropout and takes one unpadded row only: with attention dropout in training, or with
    padding, the SDPA path runs (the kernel is never called)."""
    model = build(HfxUniversalModel, "eval", attention_probs_dropout_prob=0.1)
    batch, _ = collate(documents(), "seq_idx")
    length = batch["input_ids"].shape[1]
    padded = {
        "input_ids": torch.cat([batch["input_ids"], torch.ones(1, 3, dtype=torch.long)], dim=1),
        "seq_idx": torch.cat([batch["seq_idx"], batch["seq_idx"][:, -1:].expand(1, 3)], dim=1),
        "attention_mask": (torch.arange(length + 3) < length).long()[None],
    }
    with torch.no_grad():
        alone = model(**batch)

    def refuse(*args, **kwargs):
        raise AssertionError("varlen_attn called where it cannot run")

    monkeypatch.setattr(varlen, "_flash_device", lambda device, dtype: True)
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: refuse)
    with torch.no_grad():
        out = model(**padded)
    torch.testing.assert_close(out.last_hidden_state[:, :length], alone.last_hidden_state, atol=ATOL, rtol=0)
    model.train()
    model(**collate(documents(), "cu_seq_lens")[0]).last_hidden_state.sum().backward()


@pytest.mark.parametrize("model_class", [HfxUniversalModel, HfxUniversalForCausalLM], ids=lambda c: c.__name__)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_training_step_reads_nothing_and_costs_the_same_for_any_document_count(model_class, variant):
    """A packed training step in the collator's flash form (``cu_seq_lens`` + ``max_length_q``) on an accelerator
    makes no device->host read (counted on the CPU, as if on one) and dispatches as many operators for 4 documents
    as for 16: attention, separable convolutions and ACT do not loop over documents."""
    model = build(model_class, "train", max_position_embeddings=64, **VARIANTS[variant])
    ops = {}
    for count in (4, 16):
        docs = documents(((9, 3, 12, 1) * 4)[:count], seed=count)
        batch, labels = collate(docs, "cu_seq_lens")
        if model_class is HfxUniversalForCausalLM:
            batch["labels"] = labels
        counter = HostReadCounter()
        with as_if_on_accelerator():
            with counter:
                out = model(**batch)
                loss = out.loss if model_class is HfxUniversalForCausalLM else out.last_hidden_state.square().mean()
                loss.backward()
        assert counter.total_reads == 0, f"{count} documents: host reads {dict(counter.reads)}"
        ops[count] = counter.ops
    assert ops[4] == ops[16], f"operators per step grow with the number of documents: {ops}"
