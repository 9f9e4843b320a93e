"""Full (quadratic) bidirectional self-attention through PyTorch's fused SDPA kernel.

The reference every efficient variant is compared with, and the ``original_full`` mode of
architectures that offer one.
"""

from __future__ import annotations

import torch

from ..ops.attention_switch import EAGER, eager_attention
from ..ops.kernels import attention
from ..ops.shapes import merge_heads, split_heads
from .base import AttentionOutput, HfxSelfAttention, QKVProjection


class HfxFullSelfAttention(HfxSelfAttention, QKVProjection):
    """Softmax attention over every non-padding key.

    ``attentions`` (with ``output_attentions=True``): ``(batch, heads, seq_len, seq_len)``.
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads)
        self.dropout_p = config.attention_probs_dropout_prob
        self.config = config  # for kernel_choice: the choice is read at every forward

    def attend_tokens(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, output_attentions: bool
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> context ``(batch, seq_len, hidden)``."""
        dropout = self.dropout_p if self.training else 0.0
        eager = output_attentions or self.kernel_choice(hidden_states) == EAGER
        out = self.attend(hidden_states, attention_mask, eager, dropout)
        return out if output_attentions else AttentionOutput(out.context)

    def attend(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, output_attentions: bool, dropout: float
    ) -> AttentionOutput:
        """Full attention with ``dropout`` on the probabilities (0 for none)."""
        q, k, v = (split_heads(t, self.num_heads) for t in self.fused_qkv(hidden_states))
        mask = None
        if attention_mask is not None:
            # None means "nothing padded" (the model decides that once per forward): SDPA then gets no mask, the
            # condition for its flash kernel. A row of pure padding would have no key at all (NaN); let it see
            # everything, it is ignored anyway.
            mask = (attention_mask | ~attention_mask.any(-1, keepdim=True))[:, None, None, :]
        if not output_attentions:
            context = attention(q, k, v, mask, dropout)
            return AttentionOutput(merge_heads(context))
        context, probs = eager_attention(q, k, v, mask, dropout)
        return AttentionOutput(merge_heads(context), probs)
