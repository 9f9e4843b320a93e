"""Shared layers: pieces every text architecture uses."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from hf_xformers import HfxLongformerConfig
from hf_xformers.layers.encoder import HfxIntermediate


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_new"])
def test_intermediate_inplace_activation_is_exact(act):
    """Without autograd the activation overwrites the dense output; the numbers must be those of act(dense(x)),
    and with autograd the out-of-place path must still give the right gradients. gelu_new runs as PyTorch's fused
    tanh GELU: the same formula, equal to rounding."""
    config = HfxLongformerConfig(hidden_size=16, intermediate_size=64, num_attention_heads=2, hidden_act=act)
    layer = HfxIntermediate(config)
    assert layer.act_inplace is not None
    x = torch.randn(2, 5, 16) * 3
    expected = ACT2FN[act](torch.nn.functional.linear(x, layer.dense.weight, layer.dense.bias))
    atol = 1e-6 if act == "gelu_new" else 0.0
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=atol)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=atol)
    x.requires_grad_()
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (expected_grad,) = torch.autograd.grad(
        ACT2FN[act](torch.nn.functional.linear(x, layer.dense.weight, layer.dense.bias)).sum(), x
    )
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize(
    "ours, theirs, extra",
    # (HfxLongformerConfig follows allenai/longformer-base-4096, not LongformerConfig's BERT-sized defaults.)
    [
        (
            "HfxBigBirdConfig",
            "BigBirdConfig",
            ["attention_type", "block_size", "num_random_blocks", "rescale_embeddings"],
        )
    ],
)
def test_text_config_defaults_follow_transformers(ours, theirs, extra):
    """The configs inherit RoBERTa defaults from HfxTextConfig and override what differs: their defaults must still
    be those of the transformers config whose checkpoints they import."""
    import transformers

    import hf_xformers

    a, b = getattr(hf_xformers, ours)(), getattr(transformers, theirs)()
    shared = [
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
        "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
        "initializer_range", "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
    ]  # fmt: skip
    for name in shared + extra:
        assert getattr(a, name) == getattr(b, name), (name, getattr(a, name), getattr(b, name))


# ----- attention with dropout (hf_xformers/ops/kernels.py) and the dropout mask -------------------------------


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none", "per-head-3d"])
def test_dropout_attention_matches_the_formula_and_its_gradients(mask_kind):
    """The closed-form backward of the dropout kernel against autograd through the explicit formula, with the same
    dropout mask (drawn first from the same seed), in float64."""
    from hf_xformers.ops.fast_dropout import dropout_mask
    from hf_xformers.ops.kernels import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64, requires_grad=True) for n in (7, 9, 9))
    allowed = torch.rand(2, 1, 7, 9) > 0.3
    if mask_kind == "per-head-3d":  # (heads, Lq, Lk): broadcast over the batch, as SDPA does
        allowed = torch.rand(3, 7, 9) > 0.3
    allowed[..., 0] = True
    masks = {"bool": allowed, "additive": torch.where(allowed, 0.0, float("-inf")).double(), "per-head-3d": allowed}
    mask = masks.get(mask_kind)
    torch.manual_seed(5)
    out = attention(q, k, v, mask, 0.25)
    grad = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    torch.manual_seed(5)
    kept = ~dropout_mask((3, 2, 7, 9), 0.25).transpose(0, 1)  # the kernel draws it head-major
    scores = q @ k.transpose(-1, -2) / 8**0.5
    if mask is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    expected = (torch.softmax(scores, -1) * kept / 0.75) @ v
    wanted = (expected, *torch.autograd.grad(expected, (q, k, v), grad))
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert not kept.all() and kept.any()  # the test draws a real mask
    # The closed-form backward is not differentiable again: a clear error, not a silently wrong second derivative.
    first = torch.autograd.grad(attention(q, k, v, mask, 0.25).sum(), q, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate|does not require grad"):
        torch.autograd.grad(first.sum(), k)


def test_attention_without_dropout_is_sdpa():
    from hf_xformers.ops.kernels import attention

    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(
        attention(q, k, v, mask, 0.0), torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    )


def test_dropout_attention_refuses_a_mask_that_requires_grad():
    from hf_xformers.ops.kernels import attention

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    bias = torch.zeros(1, 1, 4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="must not require a gradient"):
        attention(q, k, v, bias, 0.1)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_dropout_mask_rate_and_seeding(p):
    from hf_xformers.ops.fast_dropout import dropout_mask

    torch.manual_seed(3)
    first = dropout_mask((1001, 999), p)  # odd size: the last 64-bit word is partly used
    torch.manual_seed(3)
    assert torch.equal(first, dropout_mask((1001, 999), p))
    assert first.shape == (1001, 999) and first.dtype == torch.bool
    n = first.numel()
    assert abs(first.float().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5 + 1e-9
    if 0 < p < 1:  # neighbouring lanes of one 64-bit word are independent
        pairs = first.view(-1)[: n - 1 : 2].float() * first.view(-1)[1:n:2].float()
        assert abs(pairs.mean().item() - p * p) < 5 * (p * p * (1 - p * p) / (n // 2)) ** 0.5
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dropout_mask((3,), 1.5)


# ----- per-device kernels and precision ------------------------------------------------------------------------------


def test_dropout_attention_under_autocast_computes_in_the_autocast_dtype():
    """Under CPU autocast the kernel takes the dtype SDPA would (bf16), also for inputs of mixed dtypes (a float32
    key next to bfloat16 queries raised "Expected out tensor to have dtype float" from its `bmm(out=...)`), and its
    gradients come back in each input's own dtype."""
    from hf_xformers.ops.kernels import attention

    torch.manual_seed(0)
    q = torch.randn(2, 3, 7, 8, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 3, 9, 8, requires_grad=True) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, None, 0.25)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and k.grad.dtype == torch.float32
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # The numbers: with a single allowed key, every output is that key's value, dropped (0) or scaled by 1 / (1 - p).
    allowed = torch.zeros(1, 1, 7, 9, dtype=torch.bool)
    allowed[..., 0] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        single = attention(q.detach(), k.detach(), v.detach(), allowed, 0.5)
    value = v.detach()[:, :, :1].to(torch.bfloat16).expand_as(single)
    assert torch.all((single == 0) | torch.isclose(single.float(), 2 * value.float(), rtol=1e-2, atol=1e-2))


def test_off_cpu_attention_and_dropout_take_the_fused_torch_ops(monkeypatch):
    """On any device but the CPU, attention with dropout is SDPA (its fused kernels) and hidden dropout is F.dropout;
    the hand-written CPU kernels never run there. Tensors on the `meta` device stand in for an accelerator's."""
    import torch.nn.functional as F

    from hf_xformers.ops.fast_dropout import fast_dropout
    from hf_xformers.ops.kernels import attention

    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **kw: calls.append(("sdpa", kw)) or q)
    monkeypatch.setattr(F, "dropout", lambda x, *a, **kw: calls.append(("dropout", a)) or x)
    q = torch.empty(2, 3, 7, 8, device="meta")
    attention(q, q, q, None, 0.1)
    fast_dropout(torch.empty(4, 5, device="meta"), 0.1, training=True)
    assert [name for name, _ in calls] == ["sdpa", "dropout"]
    assert calls[0][1]["dropout_p"] == 0.1
    calls.clear()
    attention(torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8), None, 0.1)
    fast_dropout(torch.randn(4, 5), 0.1, training=True)
    assert calls == []  # the CPU keeps our kernels


def test_mask_value_fits_every_dtype():
    from hf_xformers.ops.precision import mask_value

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        scores = torch.zeros(3, dtype=dtype).masked_fill(torch.tensor([True, False, False]), mask_value(dtype))
        probs = torch.softmax(scores.float(), -1)
        assert torch.isfinite(scores).all() and probs[0] == 0 and torch.allclose(probs[1:], torch.tensor(0.5))


def test_unpadded_to_none():
    from hf_xformers.ops.input_checks import unpadded_to_none

    full = torch.ones(2, 5, dtype=torch.bool)
    assert unpadded_to_none(full) is None and unpadded_to_none(None) is None
    padded = full.clone()
    padded[0, -1] = False
    assert unpadded_to_none(padded) is padded


def test_float32_autocast_off_turns_autocast_off_where_it_exists():
    from hf_xformers.ops.precision import float32_autocast_off

    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with float32_autocast_off("cpu"):
            assert (a @ a).dtype == torch.float32
        with float32_autocast_off("meta"):  # no autocast on meta: a no-op, not an error
            assert torch.empty(2, 2, device="meta").sum().is_meta
