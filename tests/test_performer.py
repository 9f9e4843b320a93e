"""hfx-performer: the conformance suite, FAVOR+ against exact softmax attention, the stabiliser and padding rules,
causal prefix sums against their quadratic form, the projection buffer's life cycle, and the causal LM head."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_xformers import (
    HfxPerformerConfig,
    HfxPerformerForCausalLM,
    HfxPerformerForMaskedLM,
    HfxPerformerForMultipleChoice,
    HfxPerformerForQuestionAnswering,
    HfxPerformerForSequenceClassification,
    HfxPerformerForTokenClassification,
    HfxPerformerModel,
)
from hf_xformers.attention import favor as favor_module
from hf_xformers.attention.base import merge_heads, split_heads
from hf_xformers.attention.favor import HfxFavorSelfAttention, dense_kernel_attention, favor_attention
from hf_xformers.attention.favor_causal import causal_linear_attention, running_max
from hf_xformers.attention.favor_decoding import favor_attention_with_state
from hf_xformers.attention.favor_features import (
    default_num_features,
    draw_key,
    draw_random_features,
    seeded_random_features,
    softmax_kernel_features,
)
from hf_xformers.attention.favor_linear import blocked_softmax_attention

from .conformance import SEQ_LEN, VOCAB, HostReadCounter, TextModelConformance


class TestPerformerConformance(TextModelConformance):
    config_class = HfxPerformerConfig
    base_config = dict(num_random_features=32, type_vocab_size=1)
    heads = {
        "AutoModel": HfxPerformerModel,
        "AutoModelForMaskedLM": HfxPerformerForMaskedLM,
        "AutoModelForSequenceClassification": HfxPerformerForSequenceClassification,
        "AutoModelForMultipleChoice": HfxPerformerForMultipleChoice,
        "AutoModelForQuestionAnswering": HfxPerformerForQuestionAnswering,
        "AutoModelForTokenClassification": HfxPerformerForTokenClassification,
        "AutoModelForCausalLM": HfxPerformerForCausalLM,
    }
    bad_configs = [
        (dict(num_random_features=0), "num_random_features"),
        (dict(favor_kernel="cosine"), "favor_kernel"),
        (dict(feature_redraw_interval=0), "feature_redraw_interval"),
        (dict(random_feature_seed=-1), "random_feature_seed"),
        (dict(random_feature_seed=2**64), "random_feature_seed"),
        (dict(max_position_embeddings=2), "max_position_embeddings"),
    ]

    def depth_config(self, num_layers: int) -> dict:
        # Redraw before every training call after the first, so that the host-read count covers the redraw too.
        return {"num_hidden_layers": num_layers, "feature_redraw_interval": 1}

    def inputs_for(self, auto_name: str, batch: int = 2, length: int = SEQ_LEN) -> dict:
        inputs = super().inputs_for(auto_name, batch, length)
        if auto_name == "AutoModelForCausalLM":
            inputs["labels"] = inputs["input_ids"].clone()
        return inputs

    def expected_shape(self, auto_name: str, batch: int, length: int) -> tuple:
        if auto_name == "AutoModelForCausalLM":
            return (batch, length, VOCAB)
        return super().expected_shape(auto_name, batch, length)


TINY = dict(
    vocab_size=120,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=130,
    type_vocab_size=1,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_random_features=32,
)


def qkv(batch: int = 2, heads: int = 2, length: int = 128, dim: int = 16, scale: float = 0.5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, length, dim, generator=g) * scale for _ in range(2))
    return q, k, torch.randn(batch, heads, length, dim, generator=g)


def exact_softmax_attention(q, k, v, mask=None, causal=False):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


def mean_error(q, k, v, num_features: int, orthogonal: bool, seeds=range(20)) -> float:
    exact = exact_softmax_attention(q, k, v)
    errors = []
    for seed in seeds:
        projection = draw_random_features(num_features, q.shape[-1], torch.Generator().manual_seed(seed), orthogonal)
        errors.append(relative_error(favor_attention(q, k, v, projection)[0], exact))
    return sum(errors) / len(errors)


# --- FAVOR+ against exact softmax attention -----------------------------------------------------------------------


def test_error_falls_as_features_grow():
    q, k, v = qkv()
    errors = {m: mean_error(q, k, v, m, orthogonal=True, seeds=range(10)) for m in (16, 256, 1024)}
    # Measured: about 0.42, 0.15, 0.07 (Monte Carlo: error ~ 1 / sqrt(m)).
    assert errors[16] > errors[256] > errors[1024], errors
    assert errors[1024] < 0.25 * errors[16] and errors[1024] < 0.12, errors


def test_orthogonal_features_beat_iid_features():
    # The attention output, averaged over draws, on two data sets and two feature counts.
    for data_seed in (0, 1):
        q, k, v = qkv(batch=1, seed=data_seed)
        for m in (64, 1024):
            orthogonal, iid = mean_error(q, k, v, m, True), mean_error(q, k, v, m, False)
            assert orthogonal < iid, (data_seed, m, orthogonal, iid)
    # The kernel estimate exp(x_hat . y_hat) itself, what the theory is about: median squared error over draws
    # (the mean is dominated by rare huge draws: exp of a Gaussian is heavy-tailed).
    x, y = (t[0, 0] * 16**-0.25 for t in qkv(batch=1, heads=1, length=64, seed=2)[:2])
    exact = torch.exp(x @ y.T)

    def median_squared_error(m: int, orthogonal: bool) -> float:
        errors = []
        for seed in range(300):
            w = draw_random_features(m, 16, torch.Generator().manual_seed(seed), orthogonal)
            fx = torch.exp(x @ w.T - 0.5 * x.pow(2).sum(-1, keepdim=True))
            fy = torch.exp(y @ w.T - 0.5 * y.pow(2).sum(-1, keepdim=True))
            errors.append((fx @ fy.T / m - exact).pow(2).mean())
        return torch.stack(errors).median().item()

    for m in (16, 64):
        assert median_squared_error(m, True) < median_squared_error(m, False), m


def test_orthogonal_draw_has_orthogonal_blocks_and_gaussian_norms():
    w = draw_random_features(40, 16, torch.Generator().manual_seed(0))
    assert w.shape == (40, 16)
    for block in (w[:16], w[16:32]):
        gram = block @ block.T
        torch.testing.assert_close(gram - torch.diag(gram.diag()), torch.zeros(16, 16), atol=1e-4, rtol=0)
    assert 8 < w.norm(dim=1).pow(2).mean() < 24  # chi^2 with 16 degrees of freedom has mean 16
    assert default_num_features(64) == 266


def test_feature_map_formula():
    """phi(x) = m^-1/2 exp(w.x_hat - |x_hat|^2/2), up to factors that cancel in the attention: per query row (its
    stabiliser, m^-1/2 and exp(-|q_hat|^2/2)) and, for keys, one per (batch, head)."""
    x = torch.randn(2, 3, 5, 8)
    w = torch.randn(6, 8)
    x_hat = x * 8**-0.25
    phi = 6**-0.5 * torch.exp(x_hat @ w.T - 0.5 * x_hat.pow(2).sum(-1, keepdim=True))
    keys = softmax_kernel_features(x, w, is_query=False)
    torch.testing.assert_close(keys, phi / phi.amax(dim=(-2, -1), keepdim=True))
    queries = softmax_kernel_features(x, w, is_query=True)
    torch.testing.assert_close(queries, phi / phi.amax(-1, keepdim=True))
    # The attention built on them is the formula's, to rounding.
    v = torch.randn(2, 3, 5, 4)
    expected = (phi @ phi.transpose(-1, -2)) @ v / (phi @ phi.transpose(-1, -2)).sum(-1, keepdim=True)
    torch.testing.assert_close(favor_attention(x, x, v, w)[0], expected, atol=1e-5, rtol=1e-4)


# --- stabiliser and padding rules --------------------------------------------------------------------------------


def test_batch_invariance_with_very_different_examples():
    """One example's keys 30x larger: its stabiliser sits ~100 below the other's. A stabiliser shared across the
    batch (the max over everything, as in the original JAX code) would flush its features to zero."""
    q, k, v = qkv(batch=2)
    k = k.clone()
    k[1] *= 30.0
    projection = draw_random_features(64, 16, torch.Generator().manual_seed(0))
    x_hat = k * 16**-0.25
    exponent = x_hat @ projection.T - 0.5 * x_hat.pow(2).sum(-1, keepdim=True)
    assert exponent[0].amax() - exponent[1].amax() > 90  # exp(-90) underflows in float32
    both = favor_attention(q, k, v, projection)[0]
    assert torch.isfinite(both).all()
    for i in range(2):
        alone = favor_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], projection)[0]
        torch.testing.assert_close(both[i : i + 1], alone, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_padded_keys_contribute_nothing(causal, kernel):
    q, k, v = qkv(batch=2, length=40)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 25:] = False
    k, v = k.clone(), v.clone()
    k[1, :, 25:] = 50.0  # huge padded keys: they would dominate the stabiliser and the sums if they leaked
    v[1, :, 25:] = 1e4
    projection = draw_random_features(32, 16, torch.Generator().manual_seed(1))
    padded = favor_attention(q, k, v, projection, mask, causal=causal, kernel=kernel)[0]
    alone = favor_attention(q[1:, :, :25], k[1:, :, :25], v[1:, :, :25], projection, causal=causal, kernel=kernel)[0]
    torch.testing.assert_close(padded[1:, :, :25], alone, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()


def test_all_padding_example_gives_zeros_not_nan():
    q, k, v = qkv(batch=2, length=10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1] = False
    projection = draw_random_features(32, 16, torch.Generator().manual_seed(1))
    for causal in (False, True):
        out = favor_attention(q, k, v, projection, mask, causal=causal)[0]
        assert torch.isfinite(out).all() and torch.all(out[1] == 0)


@pytest.mark.parametrize("block_size", [7, 32, 512])
def test_blocked_attention_equals_the_unblocked_form(block_size):
    """Blocks of keys with a running stabiliser (rescaling the state when it rises) give the global-max result, values
    and gradients, also when whole blocks, or a whole example, are padding."""
    q, k, v = (t.requires_grad_() for t in qkv(batch=3, length=100))
    mask = torch.ones(3, 100, dtype=torch.bool)
    mask[1, :40] = False  # left padding: the first blocks hold no real key
    mask[1, 90:] = False
    mask[2] = False
    projection = draw_random_features(32, 16, torch.Generator().manual_seed(5))
    qf = softmax_kernel_features(q, projection, is_query=True)
    kf = softmax_kernel_features(k, projection, is_query=False, key_mask=mask)
    from hf_xformers.attention.favor_linear import linear_attention

    expected = linear_attention(qf, kf, v, query_eps=1e-6)
    got = blocked_softmax_attention(q, k, v, projection, mask, block_size=block_size)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert torch.all(got[2] == 0)
    grad = torch.randn_like(got)
    expected_grads = torch.autograd.grad((expected * grad).sum(), (q, k, v))
    got_grads = torch.autograd.grad((got * grad).sum(), (q, k, v))
    for a, b in zip(expected_grads, got_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# --- causal prefix sums ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_causal_prefix_sums_equal_quadratic_masked_form(length, device):
    q, k, v = (t.to(device) for t in qkv(length=length))
    mask = torch.ones(2, length, dtype=torch.bool, device=device)
    mask[1, length // 2 + 1 :] = False
    projection = draw_random_features(48, 16, torch.Generator().manual_seed(2)).to(device)
    qf = softmax_kernel_features(q, projection, is_query=True)
    kf = softmax_kernel_features(k, projection, is_query=False, key_mask=mask)
    fast = causal_linear_attention(qf, kf, v, chunk_size=64, query_eps=1e-6)
    dense, probs = dense_kernel_attention(qf, kf, v, causal=True, query_eps=1e-6)
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=1e-4)
    assert torch.all(probs.triu(1) == 0)
    # Other chunk sizes, and a larger eps (to see that it enters both forms alike), give the same result.
    torch.testing.assert_close(causal_linear_attention(qf, kf, v, 7, 1e-6), dense, atol=1e-5, rtol=1e-4)
    dense_eps = dense_kernel_attention(qf, kf, v, causal=True, query_eps=0.1)[0]
    torch.testing.assert_close(causal_linear_attention(qf, kf, v, 16, 0.1), dense_eps, atol=1e-5, rtol=1e-4)
    assert length == 1 or (dense_eps - dense).abs().max() > 1e-3
    # And the wrapper's causal path is this one.
    out, wrapped_probs = favor_attention(q, k, v, projection, mask, causal=True, output_attentions=True)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(wrapped_probs, probs)


def test_causal_output_does_not_see_the_future():
    q, k, v = qkv(length=100)
    projection = draw_random_features(64, 16, torch.Generator().manual_seed(3))
    out = favor_attention(q, k, v, projection, causal=True)[0]
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 70:] *= 4.0  # raises the key stabiliser: it must cancel for the past positions
    v2[:, :, 70:] = torch.randn_like(v2[:, :, 70:])
    changed = favor_attention(q, k2, v2, projection, causal=True)[0]
    torch.testing.assert_close(out[:, :, :70], changed[:, :, :70], atol=1e-6, rtol=1e-5)
    assert (out[:, :, 70:] - changed[:, :, 70:]).abs().max() > 1e-2


def test_causal_approximates_exact_causal_softmax():
    q, k, v = qkv(length=96)
    projection = draw_random_features(1024, 16, torch.Generator().manual_seed(4))
    approx = favor_attention(q, k, v, projection, causal=True)[0]
    assert relative_error(approx, exact_softmax_attention(q, k, v, causal=True)) < 0.15


# --- the projection buffer ---------------------------------------------------------------------------------------


def test_projection_is_a_seeded_buffer_saved_with_the_checkpoint(tmp_path):
    config = HfxPerformerConfig(**TINY, random_feature_seed=7)
    a, b = HfxPerformerModel(config), HfxPerformerModel(config)
    layers_a = [layer.attention.self for layer in a.encoder.layer]
    for x, y in zip(layers_a, (layer.attention.self for layer in b.encoder.layer)):
        assert torch.equal(x.projection_matrix, y.projection_matrix)  # same config -> same features
    assert not torch.equal(layers_a[0].projection_matrix, layers_a[1].projection_matrix)  # layers differ
    other = HfxPerformerModel(HfxPerformerConfig(**TINY, random_feature_seed=8))
    assert not torch.equal(other.encoder.layer[0].attention.self.projection_matrix, layers_a[0].projection_matrix)
    assert layers_a[0].projection_matrix.shape == (32, 8)

    a.redraw_projections()  # a checkpoint must carry the current draw, not the seed's first one
    a.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(stored["encoder.layer.0.attention.self.projection_matrix"], layers_a[0].projection_matrix)
    reloaded = HfxPerformerModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(5, 120, (2, 30))
    with torch.no_grad():
        assert torch.equal(a.eval()(ids).last_hidden_state, reloaded(ids).last_hidden_state)
    assert int(reloaded.encoder.layer[0].attention.self.num_redraws) == 1


def test_missing_projection_is_drawn_from_the_seed(tmp_path):
    config = HfxPerformerConfig(**TINY, random_feature_seed=3)
    model = HfxPerformerModel(config)
    state = {k: v for k, v in model.state_dict().items() if "projection_matrix" not in k and "num_redraws" not in k}
    model.save_pretrained(tmp_path, state_dict=state)
    loaded = HfxPerformerModel.from_pretrained(tmp_path)
    for x, y in zip(model.encoder.layer, loaded.encoder.layer):
        assert torch.equal(x.attention.self.projection_matrix, y.attention.self.projection_matrix)


def test_projection_changes_only_when_asked():
    config = HfxPerformerConfig(**TINY)
    model = HfxPerformerForMaskedLM(config)
    ids = torch.randint(5, 120, (2, 30))
    before = model.performer.encoder.layer[0].attention.self.projection_matrix.clone()
    # Training forwards without an interval, and eval forwards, leave it alone.
    model.train()
    for _ in range(3):
        model(ids)
    model.eval()
    with torch.no_grad():
        first, second = model(ids).logits, model(ids).logits
    assert torch.equal(first, second)
    assert torch.equal(model.performer.encoder.layer[0].attention.self.projection_matrix, before)
    model.redraw_projections()
    assert not torch.equal(model.performer.encoder.layer[0].attention.self.projection_matrix, before)
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, first)


def test_feature_redraw_interval_counts_training_calls_only():
    model = HfxPerformerForSequenceClassification(HfxPerformerConfig(**TINY, feature_redraw_interval=2))
    attention = model.performer.encoder.layer[1].attention.self
    ids = torch.randint(5, 120, (2, 20))
    draws = []
    model.eval()
    with torch.no_grad():
        for _ in range(5):
            model(ids)
    assert int(attention.num_redraws) == 0
    model.train()
    for _ in range(5):
        model(ids)
        draws.append(int(attention.num_redraws))
    assert draws == [0, 0, 1, 1, 2]  # redrawn before training calls 2 and 4
    assert torch.equal(attention.projection_matrix, attention.draw_projection_matrix(2))


def test_redraw_with_gradient_checkpointing_keeps_gradients_exact():
    """The redraw happens before the encoder, so a checkpointed layer's recomputation uses the same features."""

    def grads(checkpointing: bool):
        torch.manual_seed(0)
        model = HfxPerformerForMaskedLM(HfxPerformerConfig(**TINY, feature_redraw_interval=1)).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        ids = torch.randint(5, 120, (2, 20), generator=torch.Generator().manual_seed(0))
        model(ids)  # call 0
        out = model(ids, labels=ids)  # call 1: redraw first
        out.loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name], atol=1e-6, rtol=1e-5, msg=name)


# --- the model -----------------------------------------------------------------------------------------------------


def test_many_features_approach_full_attention_roberta():
    """With the same weights, more features bring the encoder closer to RoBERTa (exact softmax attention)."""
    from transformers import RobertaConfig, RobertaModel

    kw = {k: v for k, v in TINY.items() if k != "num_random_features"}
    torch.manual_seed(0)
    ref = RobertaModel(RobertaConfig(**kw), add_pooling_layer=False).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger Q/K weights than the 0.02 init, so that attention is far from uniform
        for name, param in ref.named_parameters():
            if "attention.self" in name and name.endswith("weight"):
                param.add_(torch.randn(param.shape, generator=g) * 0.1)
    ids = torch.randint(5, 120, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).last_hidden_state
    errors = []
    for m in (8, 128, 2048):
        ours = HfxPerformerModel(HfxPerformerConfig(**kw, num_random_features=m), add_pooling_layer=False).eval()
        ours.load_state_dict(ref.state_dict(), strict=False)
        with torch.no_grad():
            got = ours(ids, attention_mask=mask).last_hidden_state
        errors.append((got - expected)[mask.bool()].abs().max().item())
    # Measured with the Philox feature draws: 0.028, 0.036, 0.0038 (hidden states of magnitude ~4); one draw at 8 and
    # 128 features can tie on the largest error, so only the most features must be clearly the closest.
    assert errors[2] < min(errors[:2]) and errors[2] < 0.02, errors


def test_relu_kernel_model_and_output_attentions():
    model = HfxPerformerModel(HfxPerformerConfig(**TINY, favor_kernel="relu")).eval()
    ids = torch.randint(5, 120, (2, 30))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        plain = model(ids).last_hidden_state
    torch.testing.assert_close(out.last_hidden_state, plain, atol=1e-5, rtol=0)
    for probs in out.attentions:
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 30))


def test_bfloat16_forward_is_finite():
    model = HfxPerformerForMaskedLM(HfxPerformerConfig(**TINY)).eval()
    ids = torch.randint(5, 120, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        half = model.to(torch.bfloat16)(ids).logits.float()
    assert torch.isfinite(half).all() and (half - full).abs().max() < 0.1 * full.abs().max()


# --- causal LM -----------------------------------------------------------------------------------------------------


def test_causal_lm_head(tmp_path):
    config = HfxPerformerConfig(**TINY)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert type(model) is HfxPerformerForCausalLM and model.config.is_decoder and not config.is_decoder
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.randint(5, 120, (2, 33), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100
    out = model(ids, labels=labels)
    assert out.logits.shape == (2, 33, 120)
    expected = ForCausalLMLoss(out.logits, labels, vocab_size=120)
    manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 120), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.loss, manual)
    out.loss.backward()

    # Causal: a changed token moves the logits at and after its position only.
    changed = ids.clone()
    changed[:, 20] = (ids[:, 20] + 1 - 5) % 115 + 5
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :20], b[:, :20], atol=1e-5, rtol=1e-5)
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-3

    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HfxPerformerForCausalLM
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, a)
    # The same checkpoint read as a masked LM keeps the causal attention (is_decoder is in its config).
    mlm = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert mlm.performer.encoder.layer[0].attention.self.causal


def test_causal_lm_left_padding():
    """Left-padded prompts: the real tokens get the logits they get unpadded (padded keys are masked)."""
    model = HfxPerformerForCausalLM(HfxPerformerConfig(**TINY)).eval()
    short = torch.randint(5, 120, (1, 12))
    padded = torch.cat([torch.full((1, 6), 1), short], dim=1)
    mask = (padded != 1).long()
    with torch.no_grad():
        alone = model(short).logits
        left = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(left[:, 6:], alone, atol=1e-5, rtol=1e-5)


def test_attention_module_standalone():
    config = HfxPerformerConfig(**TINY)
    attention = HfxFavorSelfAttention(config, layer_idx=0)
    hidden = torch.randn(2, 10, 32)
    out = attention(hidden)
    assert out.context.shape == (2, 10, 32) and out.attentions is None


@pytest.mark.parametrize("causal", [False, True])
def test_all_padding_example_has_finite_gradients(causal):
    """A batch row made only of padding (e.g. a padded-out choice) must not turn the gradients into NaN."""
    model = HfxPerformerForMaskedLM(HfxPerformerConfig(**TINY, is_decoder=causal)).train()
    ids = torch.randint(5, 120, (2, 20))
    mask = torch.ones_like(ids)
    mask[1] = 0
    ids[1] = 1
    model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- mixed precision and devices -------------------------------------------------------------------------------------

HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def representable(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` and back: float32 values that the half-precision computation sees exactly."""
    return t.to(dtype).float()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    "causal, kernel, output_attentions",
    [(False, "softmax", False), (True, "softmax", False), (False, "softmax", True), (True, "relu", False)],
)
def test_favor_computes_in_float32_under_autocast(dtype, causal, kernel, output_attentions):
    """Under autocast, the feature maps, (prefix) sums and normaliser still compute in float32: on inputs that the
    half dtype represents exactly, the result is the float32 one. (Before, autocast ran the matmuls in half precision:
    measured under bf16, 1.4e-2 relative deviation bidirectional and 0.9e-2 causal.)"""
    q, k, v = (representable(t, dtype) for t in qkv(length=200, scale=1.0))
    projection = representable(draw_random_features(64, 16, torch.Generator().manual_seed(1)), dtype)
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[1, 150:] = False
    args = (q, k, v, projection, mask, causal, kernel, output_attentions)
    expected_context, expected_probs = favor_attention(*args)
    with torch.autocast("cpu", dtype=dtype):
        context, probs = favor_attention(*args)
    assert context.dtype == torch.float32  # the values' dtype
    torch.testing.assert_close(context, expected_context, atol=1e-6, rtol=1e-6)
    if output_attentions:
        torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-6)


def _bf16_representable_attention(causal: bool) -> HfxFavorSelfAttention:
    config = HfxPerformerConfig(**{**TINY, "hidden_size": 64}, is_decoder=causal)
    torch.manual_seed(0)
    attention = HfxFavorSelfAttention(config).eval()
    with torch.no_grad():
        for tensor in list(attention.parameters()) + [attention.projection_matrix]:
            tensor.copy_(representable(tensor, torch.bfloat16))
    return attention


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
def test_attention_module_under_bf16_equals_float32_features(causal, mode):
    """The attention module under bf16 autocast (or with bf16 weights): its q/k/v projections run in bf16, everything
    after them in float32, so the output is the float32 FAVOR+ result on those q/k/v, rounded once to bf16.
    (Before: the bidirectional output deviated 3.8e-3 in norm from that, the causal one 4.2e-3, against 1.6e-3 for
    the rounding alone; now the deviation is the rounding alone.)"""
    attention = _bf16_representable_attention(causal)
    hidden = representable(torch.randn(2, 200, 64, generator=torch.Generator().manual_seed(2)), torch.bfloat16)
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[1, 150:] = False
    with torch.no_grad():
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = attention(hidden, mask).context
                q, k, v = attention.fused_qkv(hidden)
        else:
            attention.to(torch.bfloat16)
            hidden = hidden.bfloat16()
            out = attention(hidden, mask).context
            q, k, v = attention.fused_qkv(hidden)
        assert out.dtype == torch.bfloat16
        q, k, v = (split_heads(t.float(), attention.num_heads) for t in (q, k, v))
        projection = attention.projection_matrix.float()
        expected = merge_heads(favor_attention(q, k, v, projection, mask, causal)[0])
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), atol=1e-6, rtol=0)


class MetaTensorRecorder(TorchDispatchMode):
    """Names of the ops, run inside the ``with`` block, that return a tensor on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outputs):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize(
    "causal, kernel, output_attentions, padded",
    [(False, "softmax", False, True), (False, "softmax", False, False), (True, "softmax", False, True),
     (True, "softmax", False, False), (False, "softmax", True, True), (False, "relu", False, True)],
)  # fmt: skip
def test_forward_creates_tensors_on_the_inputs_device_only(causal, kernel, output_attentions, padded):
    """Every tensor the forward and backward create is made on the inputs' device, never on the default one (which
    would be the CPU for inputs on a GPU: `torch.tensor(...)`, `torch.arange(n)` without `device=`, a draw from a
    CPU generator). Checked by making the default device "meta" around a CPU forward: anything created without an
    explicit device then lands on meta."""
    config = HfxPerformerConfig(**TINY, is_decoder=causal, favor_kernel=kernel)
    attention = HfxFavorSelfAttention(config)
    hidden = torch.randn(2, 70, 32, requires_grad=True)
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, 60:] = False
    with torch.device("meta"), MetaTensorRecorder() as recorder:
        out = attention(hidden, mask if padded else None, output_attentions=output_attentions)
        out.context.sum().backward()
    assert out.context.device.type == "cpu" and hidden.grad is not None
    assert recorder.ops == []


def test_training_forward_with_redraws_creates_nothing_on_the_default_device():
    """A training forward that redraws the projections draws them on the CPU explicitly (not on the default device,
    which a user may have set to a GPU) and copies them to the buffers' device: with the default device "meta",
    nothing lands there."""
    model = HfxPerformerForMaskedLM(HfxPerformerConfig(**TINY, feature_redraw_interval=1)).train()
    ids = torch.randint(5, 120, (2, 20))
    model(ids)  # call 0 keeps draw 0; call 1 redraws
    with torch.device("meta"), MetaTensorRecorder() as recorder:
        model(ids, labels=ids).loss.backward()
    assert recorder.ops == []
    attention = model.performer.encoder.layer[1].attention.self
    assert int(attention.num_redraws) == 1
    assert torch.equal(attention.projection_matrix, attention.draw_projection_matrix(1))


def test_projection_is_drawn_on_the_cpu_from_its_seed():
    """The projection is drawn once on the CPU from its seed and kept as a buffer that moves with the model (the same
    numbers on every device); redraws are CPU draws from (seed, layer, draw) too, copied into the buffer in its
    device and dtype."""
    model = HfxPerformerModel(HfxPerformerConfig(**TINY, random_feature_seed=5))
    attention = model.encoder.layer[1].attention.self

    def seeded(draw: int) -> torch.Tensor:
        return seeded_random_features(32, 8, draw_key(5, 1, draw)[None])[0]

    assert torch.equal(attention.projection_matrix, seeded(0))
    model.to(torch.bfloat16).redraw_projections()
    assert attention.projection_matrix.dtype == torch.bfloat16
    assert torch.equal(attention.projection_matrix, seeded(1).bfloat16())


def test_redraw_reads_no_scalar_per_layer():
    """Redrawing reads every layer's draw counter in one transfer (not `int(counter)` per layer, a host
    synchronisation each on an accelerator), and redraws the right draw in each layer."""
    counts = {}
    for depth in (1, 3):
        model = HfxPerformerModel(HfxPerformerConfig(**{**TINY, "num_hidden_layers": depth}))
        model.encoder.layer[0].attention.self.redraw_projection()  # one layer ahead of the others
        with HostReadCounter() as counter:
            model.redraw_projections()
        counts[depth] = counter.count
        layers = [layer.attention.self for layer in model.encoder.layer]
        assert [int(a.num_redraws) for a in layers] == [2] + [1] * (depth - 1)
        for a in layers:
            assert torch.equal(a.projection_matrix, a.draw_projection_matrix(int(a.num_redraws)))
    assert counts[1] == counts[3], counts


@pytest.mark.parametrize("dtype", HALF)
def test_causal_lm_long_sequence_under_autocast(dtype):
    """The causal LM over a long sequence (prefix sums across 16 chunks) under autocast: finite, and as close to the
    float32 logits as the half-precision projections allow; training step finite (fp16 with a scaled loss)."""
    config = HfxPerformerConfig(**{**TINY, "max_position_embeddings": 1030, "hidden_dropout_prob": 0.1})
    torch.manual_seed(0)
    model = HfxPerformerForCausalLM(config)
    ids = torch.randint(5, 120, (2, 1024), generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.autocast("cpu", dtype=dtype):
        loss = model(ids, labels=ids).loss
    assert torch.isfinite(loss)
    (loss * (1024.0 if dtype is torch.float16 else 1.0)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        ref = model(ids).logits
        with torch.autocast("cpu", dtype=dtype):
            low = model(ids).logits.float()
    deviation = ((low - ref).abs().max() / ref.abs().max()).item()
    assert deviation < {torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype], deviation


# --- causal stabiliser and cached decoding (the recurrent form) ----------------------------------------------------


def test_causal_key_stabiliser_uses_no_later_key():
    """Early keys of large norm (exponents near -120) followed by small ones (near 0): with one key stabiliser over
    the whole sequence, the early keys' features underflowed to 0 and the early outputs were garbage; the running
    stabiliser gives each prefix exactly what it gives that prefix alone."""
    q, k, v = qkv(batch=1, heads=2, length=40)
    k[:, :, :12] = k[:, :, :12] / k[:, :, :12].norm(dim=-1, keepdim=True) * 62.0  # |k_hat|^2 / 2 = 120
    projection = draw_random_features(64, 16, torch.Generator().manual_seed(3))
    for output_attentions in (False, True):
        whole = favor_attention(q, k, v, projection, causal=True, output_attentions=output_attentions)[0]
        prefix = favor_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], projection, causal=True)[0]
        assert prefix.abs().max() > 0.1
        torch.testing.assert_close(whole[:, :, :12], prefix, atol=1e-5, rtol=1e-4)
    # The chunked prefix sums (chunks of 5: the stabiliser also rises across chunks) agree with the dense form.
    wrapped = favor_module._favor_attention_float32(q, k, v, projection, None, True, "softmax", False, 5)[0]
    dense = favor_attention(q, k, v, projection, causal=True, output_attentions=True)[0]
    torch.testing.assert_close(wrapped, dense, atol=1e-5, rtol=1e-4)


def test_running_max_matches_cummax():
    x = torch.randn(2, 3, 37)
    x[0, 0, :9] = float("-inf")
    for chunk in (1, 4, 64):
        torch.testing.assert_close(running_max(x, chunk), x.cummax(-1).values)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_state_recurrence_equals_causal_forward(kernel):
    """Prompt through the chunked prefix sums, then one token at a time and a block of three through the state: the
    outputs are the full causal forward's (left padding included) to 1e-5, and the state does not grow."""
    q, k, v = qkv(length=90, scale=1.5)
    k[:, :, 50:] *= 3.0  # the stabiliser rises in the middle of the decoding
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[1, :7] = False
    projection = draw_random_features(32, 16, torch.Generator().manual_seed(5))
    full = favor_attention(q, k, v, projection, mask, causal=True, kernel=kernel, chunk_size=16)[0]
    outs, state = [], None
    for start, stop in ((0, 40), *((t, t + 1) for t in range(40, 87)), (87, 90)):
        piece = slice(start, stop)
        out, state = favor_attention_with_state(
            q[:, :, piece], k[:, :, piece], v[:, :, piece], projection, mask[:, piece], kernel, state, chunk_size=16
        )
        outs.append(out)
        assert state[0].shape == (2, 2, 32, 17)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)


def _causal_lm(kernel: str = "softmax") -> HfxPerformerForCausalLM:
    torch.manual_seed(0)
    return HfxPerformerForCausalLM(HfxPerformerConfig(**TINY, favor_kernel=kernel)).eval()


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_cached_forward_equals_uncached(kernel):
    model = _causal_lm(kernel)
    ids = torch.randint(3, VOCAB, (2, 60), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = model.config.pad_token_id
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :35], attention_mask=mask[:, :35], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(35, 60):  # generate()'s way: the mask of every token so far, positions from the cache
            logits.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(logits, dim=1)[mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 60 and len(cache) == 2
    # Attentions of a cached step: its row of the uncached forward's probabilities, from a cache that kept its inputs.
    with torch.no_grad():
        prefix = model(ids[:, :35], attention_mask=mask[:, :35], use_cache=True, output_attentions=True)
        step = model(ids[:, 35:36], attention_mask=mask[:, :36], past_key_values=prefix.past_key_values,
                     output_attentions=True)  # fmt: skip
        reference = model(ids[:, :36], attention_mask=mask[:, :36], output_attentions=True).attentions
    assert [tuple(a.shape) for a in step.attentions] == [(2, 4, 1, 36)] * 2
    for got, want in zip(step.attentions, reference):
        torch.testing.assert_close(got, want[:, :, -1:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="output_attentions=True"):
        model(ids[:, 3:4], past_key_values=model(ids[:, :3], use_cache=True).past_key_values, output_attentions=True)
    with pytest.raises(ValueError, match="is_decoder"):
        HfxPerformerModel(HfxPerformerConfig(**TINY)).eval()(ids[:, :3], use_cache=True)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_generate_cached_equals_uncached(kernel):
    """Greedy, sampled (fixed seed) and beam-search tokens with the recurrent cache equal uncached generation, and
    greedy equals the argmax loop over full forwards; left-padded prompts included."""
    model = _causal_lm(kernel)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = model.config.pad_token_id
    common = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=model.config.pad_token_id, eos_token_id=None)
    greedy = model.generate(ids, do_sample=False, **common)
    assert torch.equal(greedy, model.generate(ids, do_sample=False, use_cache=False, **common))
    loop, loop_mask = ids, mask
    with torch.no_grad():
        for _ in range(12):
            positions = loop_mask.cumsum(-1) * loop_mask + model.config.pad_token_id
            step = model(loop, attention_mask=loop_mask, position_ids=positions).logits[:, -1].argmax(-1, keepdim=True)
            loop, loop_mask = torch.cat([loop, step], 1), torch.cat([loop_mask, torch.ones_like(step)], 1)
    assert torch.equal(greedy, loop)
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        sampled.append(model.generate(ids, do_sample=True, top_k=0, use_cache=use_cache, **common))
    assert torch.equal(*sampled)
    beams = [model.generate(ids, num_beams=3, do_sample=False, use_cache=c, **common) for c in (True, False)]
    assert torch.equal(*beams)
