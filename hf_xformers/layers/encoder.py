"""The post-LayerNorm Transformer encoder (BERT/RoBERTa layout) with a pluggable self-attention module.

Only ``attention.self`` differs between architectures; the output projection, feed-forward block, residuals
and LayerNorms are shared. Parameter names match BERT/RoBERTa/Longformer checkpoints
(``attention.self.query``, ``attention.output.dense``, ``intermediate.dense``, ``output.LayerNorm`` ...).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..ops.fast_dropout import HfxDropout
from ..ops.input_checks import is_tracing
from ..ops.packing import PackedBatch


@dataclass
class HfxModelOutput(BaseModelOutputWithPooling):
    """``BaseModelOutputWithPooling`` plus ``global_attentions``: one tensor per layer for attention
    variants with global tokens (``(batch, heads, num_global, seq_len)`` for Longformer), else None."""

    global_attentions: tuple[torch.Tensor, ...] | None = None


class HfxDenseResidual(nn.Module):
    """``LayerNorm(x + dropout(dense(h)))``: the second half of both attention and feed-forward blocks."""

    def __init__(self, in_features: int, config) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = HfxDropout(config.hidden_dropout_prob)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class HfxAttentionBlock(nn.Module):
    """Self-attention variant (``self``) followed by the shared output projection (``output``)."""

    def __init__(self, config, attention: nn.Module) -> None:
        super().__init__()
        self.self = attention
        self.output = HfxDenseResidual(config.hidden_size, config)

    def forward(self, hidden_states, *attention_args, **attention_kwargs):
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> (the block's output, same shape, and the variant's
        :class:`AttentionOutput`); the variant gets the rest of the arguments as they came (the attention interface:
        ``attention_mask``, ``global_attention_mask``, ``output_attentions``, the model's extras)."""
        out = self.self(hidden_states, *attention_args, **attention_kwargs)
        return self.output(out.context, hidden_states), out


# Tokens per chunk of the feed-forward block without gradients (HfxEncoderLayer.feed_forward).
FFN_CHUNK_TOKENS = 16384

# Activations with an in-place ATen form, used when no gradient is recorded (exact same numbers).
INPLACE_ACTIVATIONS = {
    "gelu": torch.ops.aten.gelu_,
    "relu": torch.relu_,
    "gelu_pytorch_tanh": functools.partial(torch.ops.aten.gelu_, approximate="tanh"),
}
# transformers' "gelu_new" (BigBird's default) is GELU's tanh approximation written as five elementwise ops; PyTorch's
# fused tanh GELU evaluates the same formula in one pass (max |diff| 5e-7 on N(0, 9) inputs), about 2.5x faster on CPU.
_FUSED_ACTIVATIONS = {"gelu_new": "gelu_pytorch_tanh"}


class HfxIntermediate(nn.Module):
    """``act(dense(x))``: ``(batch, seq_len, hidden)`` -> ``(batch, seq_len, intermediate)``.

    Sizes default to ``config.hidden_size`` / ``config.intermediate_size``; Swin passes each stage's own.
    """

    def __init__(self, config, hidden_size: int | None = None, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size or config.hidden_size, intermediate_size or config.intermediate_size)
        name = config.hidden_act
        name = _FUSED_ACTIVATIONS.get(name, name) if isinstance(name, str) else name
        self.act = ACT2FN[name]
        self.act_inplace = INPLACE_ACTIVATIONS.get(name) if isinstance(name, str) else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = self.dense(hidden_states)
        if self.act_inplace is not None and not (torch.is_grad_enabled() and hidden.requires_grad):
            # Inference: overwrite the largest activation of the layer instead of allocating a second one. On CPU
            # each fresh tensor of this size is new pages from the OS (page faults): measured 10-15 % of a forward.
            return self.act_inplace(hidden)
        return self.act(hidden)


class HfxEncoderLayer(GradientCheckpointingLayer):
    """One post-LN Transformer layer: attention block, then feed-forward block."""

    def __init__(self, config, attention: nn.Module) -> None:
        super().__init__()
        self.attention = HfxAttentionBlock(config, attention)
        self.intermediate = HfxIntermediate(config)
        self.output = HfxDenseResidual(config.intermediate_size, config)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        global_attention_mask=None,
        output_attentions=False,
        **attention_kwargs,
    ):
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> (same shape, :class:`AttentionOutput`).

        ``attention_kwargs`` go to the attention variant (what its model prepared once per forward, see
        ``HfxTextModel.prepare_attention_inputs``)."""
        attended, attention_out = self.attention(
            hidden_states, attention_mask, global_attention_mask, output_attentions, **attention_kwargs
        )
        return self.feed_forward(attended), attention_out

    def feed_forward(self, attended: torch.Tensor) -> torch.Tensor:
        """``LayerNorm(x + FFN(x))``, ``(batch, seq_len, hidden)``; without gradients ``FFN_CHUNK_TOKENS`` tokens at
        a time (the feed-forward is per token: the same numbers), so that the ``intermediate_size``-wide activation
        of a long input never exists whole (128k tokens at base width: 1.5 GB in float32)."""
        batch, length = attended.shape[:2]
        step = max(1, FFN_CHUNK_TOKENS // batch)
        if length <= step or is_tracing() or (torch.is_grad_enabled() and attended.requires_grad):
            return self.output(self.intermediate(attended), attended)
        out = torch.empty_like(attended)
        for first in range(0, length, step):
            chunk = attended[:, first : first + step]
            out[:, first : first + step] = self.output(self.intermediate(chunk), chunk)
        return out


class HfxEncoder(nn.Module):
    """A stack of :class:`HfxEncoderLayer`, the attention of layer ``i`` built as ``attention_class(config, i)``."""

    def __init__(self, config, attention_class: type[nn.Module]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            HfxEncoderLayer(config, attention_class(config, i)) for i in range(config.num_hidden_layers)
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        attention_kwargs: dict | None = None,
    ) -> HfxModelOutput:
        """``attention_kwargs``: extra keyword arguments for every layer's attention (None: none)."""
        attention_kwargs = attention_kwargs or {}
        all_hidden = (hidden_states,) if output_hidden_states else None
        all_attn = () if output_attentions else None
        all_global = () if output_attentions else None
        for layer in self.layer:
            hidden_states, attn = layer(
                hidden_states, attention_mask, global_attention_mask, output_attentions, **attention_kwargs
            )
            if output_hidden_states:
                all_hidden += (hidden_states,)
            if output_attentions:
                all_attn += (attn.attentions,)
                all_global += (attn.global_attentions,)
        if all_global is not None and all(g is None for g in all_global):
            all_global = None
        return HfxModelOutput(
            last_hidden_state=hidden_states, hidden_states=all_hidden, attentions=all_attn, global_attentions=all_global
        )


class HfxPooler(nn.Module):
    """``tanh(dense(h[:, 0]))``: the BERT/RoBERTa pooler over the first token (of every document, in a packed batch)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor, packed: PackedBatch | None = None) -> torch.Tensor:
        """``(batch, seq_len, hidden)`` -> ``(batch, hidden)``; for a packed batch
        (:class:`~hf_xformers.ops.packing.PackedBatch`) ``(num_documents, hidden)``, no boolean index (a host read)."""
        if packed is None:
            first = hidden_states[:, 0]
        else:
            first = packed.first_tokens(hidden_states)
        return self.activation(self.dense(first))
