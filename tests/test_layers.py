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
