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
    and with autograd the out-of-place path must still give the right gradients."""
    config = HfxLongformerConfig(hidden_size=16, intermediate_size=64, num_attention_heads=2, hidden_act=act)
    layer = HfxIntermediate(config)
    x = torch.randn(2, 5, 16)
    expected = ACT2FN[act](torch.nn.functional.linear(x, layer.dense.weight, layer.dense.bias))
    with torch.no_grad():
        assert torch.equal(layer(x), expected)
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
    x.requires_grad_()
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (expected_grad,) = torch.autograd.grad(
        ACT2FN[act](torch.nn.functional.linear(x, layer.dense.weight, layer.dense.bias)).sum(), x
    )
    torch.testing.assert_close(grad, expected_grad)
