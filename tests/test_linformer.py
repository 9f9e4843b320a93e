"""hfx-linformer: the conformance suite, the full-attention limit (k = n, identity projections) against transformers'
RoBERTa and our SDPA attention, a per-head reference for every sharing mode, and the length and padding rules."""

from __future__ import annotations

import pytest
import torch
from transformers import RobertaConfig, RobertaModel

from hf_xformers import (
    HfxLinformerConfig,
    HfxLinformerForMaskedLM,
    HfxLinformerForMultipleChoice,
    HfxLinformerForQuestionAnswering,
    HfxLinformerForSequenceClassification,
    HfxLinformerForTokenClassification,
    HfxLinformerModel,
)
from hf_xformers.attention.full import HfxFullSelfAttention
from hf_xformers.attention.low_rank import HfxLowRankSelfAttention, HfxSequenceProjection

from .conformance import TextModelConformance


class TestLinformerConformance(TextModelConformance):
    packing_refusal = "cannot take a packed"
    config_class = HfxLinformerConfig
    base_config = dict(linformer_k=16, type_vocab_size=1)
    heads = {
        "AutoModel": HfxLinformerModel,
        "AutoModelForMaskedLM": HfxLinformerForMaskedLM,
        "AutoModelForSequenceClassification": HfxLinformerForSequenceClassification,
        "AutoModelForMultipleChoice": HfxLinformerForMultipleChoice,
        "AutoModelForQuestionAnswering": HfxLinformerForQuestionAnswering,
        "AutoModelForTokenClassification": HfxLinformerForTokenClassification,
    }
    bad_configs = [
        (dict(linformer_k=0), "linformer_k"),
        (dict(linformer_k=2.5), "linformer_k"),
        (dict(linformer_sharing="per-layer"), "linformer_sharing"),
        (dict(max_position_embeddings=2), "max_position_embeddings"),
    ]
    padding_needs_sdpa_mask = False  # padding is zeroed before the projection along the sequence

    def full_attention_config(self):
        return {}  # every projected position draws on the input: nothing to mask


class TestLinformerLayerwiseConformance(TestLinformerConformance):
    """The same suite with one projection shared by all layers (a module owned by the base model)."""

    base_config = dict(linformer_k=16, type_vocab_size=1, linformer_sharing="layerwise")


TINY = dict(
    vocab_size=120,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=42,  # n = 40 tokens
    type_vocab_size=1,
    layer_norm_eps=1e-5,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
N = 40
MODES = ("none", "headwise", "kv", "layerwise")


def set_identity_projections_(model: HfxLinformerModel) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, HfxSequenceProjection):
                module.weight.copy_(torch.eye(module.weight.shape[1]).expand_as(module.weight))


def padded_ids(length: int, seed: int = 0):
    ids = torch.randint(5, TINY["vocab_size"], (3, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, length - 7 :] = 0
    mask[2, 5:] = 0
    ids[mask == 0] = 1
    return ids, mask


# --- the full-attention limit --------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [N, 23])
@pytest.mark.parametrize("sharing", MODES)
def test_identity_projections_equal_roberta(length, sharing, device, device_atol):
    """k = n and E = F = I: every key is its own projected key, so Linformer is full attention (padded batch)."""
    torch.manual_seed(0)
    ref = RobertaModel(RobertaConfig(**TINY), add_pooling_layer=False).eval()
    ours = HfxLinformerModel(
        HfxLinformerConfig(**TINY, linformer_k=N, linformer_sharing=sharing), add_pooling_layer=False
    ).eval()
    result = ours.load_state_dict(ref.state_dict(), strict=False)
    assert all("projection" in key for key in result.missing_keys) and not result.unexpected_keys
    set_identity_projections_(ours)
    ref, ours = ref.to(device), ours.to(device)
    ids, mask = (t.to(device) for t in padded_ids(length))
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).last_hidden_state
        fused = ours(ids, attention_mask=mask).last_hidden_state
        eager = ours(ids, attention_mask=mask, output_attentions=True).last_hidden_state
    real = mask.bool()
    assert (expected - fused)[real].abs().max() <= device_atol
    assert (expected - eager)[real].abs().max() <= device_atol


def test_identity_projections_equal_full_attention_module():
    torch.manual_seed(1)
    config = HfxLinformerConfig(**TINY, linformer_k=N, linformer_sharing="none")
    low_rank = HfxLowRankSelfAttention(config)
    full = HfxFullSelfAttention(config)
    full.load_state_dict(low_rank.state_dict(), strict=False)
    with torch.no_grad():
        low_rank.key_projection.weight.copy_(torch.eye(N).expand(4, N, N))
        low_rank.value_projection.weight.copy_(torch.eye(N).expand(4, N, N))
    hidden = torch.randn(2, N, 32)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, 30:] = False
    a = full(hidden, mask, output_attentions=True)
    b = low_rank(hidden, mask, output_attentions=True)
    torch.testing.assert_close(a.context[mask], b.context[mask], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a.attentions, b.attentions, atol=1e-6, rtol=1e-5)  # (batch, heads, n, k = n)


# --- the general case against a per-head reference -------------------------------------------------------------------


def reference_linformer(attention: HfxLowRankSelfAttention, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Loops over examples and heads, straight from the paper's formula (padding zeroed, leading rows of E, F)."""
    heads, d = attention.num_heads, attention.head_dim
    E, F = attention.projections()
    out = torch.zeros_like(hidden)
    for b in range(hidden.shape[0]):
        length = int(mask[b].sum())  # right padding: the real tokens are the first `length`
        x = hidden[b, :length]
        q, k, v = attention.query(x), attention.key(x), attention.value(x)
        for h in range(heads):
            cols = slice(h * d, (h + 1) * d)
            e = E[h if E.shape[0] > 1 else 0, :length]
            f = F[h if F.shape[0] > 1 else 0, :length]
            scores = q[:, cols] @ (e.T @ k[:, cols]).T / d**0.5
            out[b, :length, cols] = torch.softmax(scores, -1) @ (f.T @ v[:, cols])
    return out


@pytest.mark.parametrize("sharing", MODES)
def test_matches_reference_with_padding_and_short_inputs(sharing):
    torch.manual_seed(2)
    model = HfxLinformerModel(HfxLinformerConfig(**TINY, linformer_k=8, linformer_sharing=sharing)).eval()
    attention = model.encoder.layer[1].attention.self
    hidden = torch.randn(3, 29, 32)  # shorter than n = 40
    mask = torch.ones(3, 29, dtype=torch.bool)
    mask[1, 20:] = False
    mask[2, 3:] = False
    with torch.no_grad():
        expected = reference_linformer(attention, hidden, mask)
        got = attention(hidden, mask).context
        eager = attention(hidden, mask, output_attentions=True)
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(eager.context[mask], expected[mask], atol=1e-6, rtol=1e-5)
    assert eager.attentions.shape == (3, 4, 29, 8)


def test_shorter_inputs_use_the_leading_rows():
    torch.manual_seed(3)
    attention = HfxLowRankSelfAttention(HfxLinformerConfig(**TINY, linformer_k=8)).eval()
    hidden = torch.randn(2, 25, 32)
    with torch.no_grad():
        before = attention(hidden).context
        attention.key_projection.weight[:, 25:] += 1.0  # rows past the input: unused
        attention.value_projection.weight[:, 25:] -= 1.0
        assert torch.equal(attention(hidden).context, before)
        attention.key_projection.weight[:, 24] += 1.0  # the last used row
        assert not torch.allclose(attention(hidden).context, before)


def test_padded_positions_are_zeroed_before_the_projection():
    torch.manual_seed(4)
    attention = HfxLowRankSelfAttention(HfxLinformerConfig(**TINY, linformer_k=8, linformer_sharing="none")).eval()
    hidden = torch.randn(2, 30, 32)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[:, 21:] = False
    noisy = hidden.clone()
    noisy[:, 21:] = 100 * torch.randn(2, 9, 32)  # anything may sit at padded positions
    with torch.no_grad():
        a = attention(hidden, mask).context
        b = attention(noisy, mask).context
    torch.testing.assert_close(a[:, :21], b[:, :21], atol=1e-6, rtol=1e-5)


def test_projected_positions_without_real_tokens_are_masked():
    """A pooling-style E whose last blocks lie past a short input gives zero keys there: they are ignored rather
    than soaking up attention (as if the input held only its real blocks)."""
    torch.manual_seed(5)
    config = HfxLinformerConfig(**TINY, linformer_k=10, linformer_sharing="kv")
    attention = HfxLowRankSelfAttention(config).eval()
    pooling = torch.zeros(N, 10)
    for r in range(10):
        pooling[4 * r : 4 * r + 4, r] = 0.25  # block means of 4 positions
    with torch.no_grad():
        attention.kv_projection.weight.copy_(pooling[None])
    hidden = torch.randn(1, 12, 32)  # feeds blocks 0-2 only
    with torch.no_grad():
        out = attention(hidden, output_attentions=True)
    assert torch.all(out.attentions[..., 3:] == 0)
    torch.testing.assert_close(out.attentions.sum(-1), torch.ones(1, 4, 12))
    # The support is cached per weight version: an in-place change to E is seen at once.
    with torch.no_grad():
        attention.kv_projection.weight[:, :, 1] = 0.0
        out = attention(hidden, output_attentions=True)
    assert torch.all(out.attentions[..., 1] == 0) and torch.all(out.attentions[..., [0, 2]] > 0)
    # With padding the support is taken over the real tokens of each example.
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 4:] = False  # example 1 feeds block 0 only
    with torch.no_grad():
        out = attention(hidden.expand(2, -1, -1), mask, output_attentions=True)
    assert torch.all(out.attentions[1, ..., 1:] == 0) and torch.all(out.attentions[0, ..., 2] > 0)


# --- sharing -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sharing, matrices", [("none", 2 * 2 * 4), ("headwise", 2 * 2), ("kv", 2), ("layerwise", 1)]
)
def test_sharing_modes_own_the_right_number_of_matrices(sharing, matrices, tmp_path):
    model = HfxLinformerForMaskedLM(HfxLinformerConfig(**TINY, linformer_k=8, linformer_sharing=sharing))
    projections = [p for n, p in model.named_parameters() if "projection" in n]
    assert sum(p.shape[0] for p in projections) == matrices
    assert all(p.shape[1:] == (N, 8) for p in projections)
    ids = torch.randint(5, 120, (2, 30))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in projections)
    if sharing == "layerwise":
        shared = model.linformer.shared_kv_projection
        for layer in model.linformer.encoder.layer:
            E, F = layer.attention.self.projections()
            assert E is shared.weight and F is shared.weight
        model.save_pretrained(tmp_path)
        loaded = HfxLinformerForMaskedLM.from_pretrained(tmp_path)
        assert [n for n, _ in loaded.named_parameters() if "projection" in n] == ["linformer.shared_kv_projection.weight"]
        assert all(layer.attention.self.projections()[0] is loaded.linformer.shared_kv_projection.weight
                   for layer in loaded.linformer.encoder.layer)


def test_layerwise_attention_needs_the_shared_projection():
    config = HfxLinformerConfig(**TINY, linformer_sharing="layerwise")
    with pytest.raises(ValueError, match="shared_projection"):
        HfxLowRankSelfAttention(config)
    shared = HfxSequenceProjection(N, config.linformer_k)
    attention = HfxLowRankSelfAttention(config, shared_projection=shared)
    assert "projection" not in " ".join(n for n, _ in attention.named_parameters())  # referenced, not owned


# --- lengths -------------------------------------------------------------------------------------------------------


def test_input_longer_than_the_projections_raises():
    config = HfxLinformerConfig(**TINY, linformer_k=8)
    assert config.linformer_max_length == N
    attention = HfxLowRankSelfAttention(config)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        attention(torch.randn(1, N + 1, 32))
    model = HfxLinformerModel(config)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(inputs_embeds=torch.randn(1, N + 1, 32))
    assert model(torch.randint(5, 120, (1, N))).last_hidden_state.shape == (1, N, 32)


@pytest.mark.parametrize("sharing", ["none", "layerwise"])
def test_all_padding_example_has_finite_outputs_and_gradients(sharing):
    model = HfxLinformerForMaskedLM(HfxLinformerConfig(**TINY, linformer_k=8, linformer_sharing=sharing)).train()
    ids = torch.randint(5, 120, (2, 20))
    mask = torch.ones_like(ids)
    mask[1] = 0
    ids[1] = 1
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_attention_dropout_runs_through_the_dropout_kernel(monkeypatch):
    """Training with attention dropout uses kernels.attention (not SDPA's CPU math path) with the configured rate,
    eval passes 0; the dropped attention is unbiased: its mean over many draws is the eval output."""
    import hf_xformers.attention.low_rank as low_rank

    rates = []
    real = low_rank.attention
    monkeypatch.setattr(low_rank, "attention", lambda q, k, v, mask, p: rates.append(p) or real(q, k, v, mask, p))
    torch.manual_seed(0)
    config = HfxLinformerConfig(**{**TINY, "attention_probs_dropout_prob": 0.5}, linformer_k=8)
    attention = HfxLinformerModel(config).encoder.layer[0].attention.self
    hidden = torch.randn(2, 29, 32, requires_grad=True)
    mask = torch.ones(2, 29, dtype=torch.bool)
    mask[1, 17:] = False
    with torch.no_grad():
        expected = attention.eval()(hidden, mask).context
    assert rates == [0.0]
    attention.train()
    draws = torch.stack([attention(hidden, mask).context.detach() for _ in range(400)])
    assert rates[1:] == [0.5] * 400
    assert (draws[0] - expected)[mask].abs().max() > 0.05  # dropout is applied ...
    torch.testing.assert_close(draws.mean(0)[mask], expected[mask], atol=0.03, rtol=0)  # ... and unbiased
    attention(hidden, mask).context.pow(2).sum().backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0
