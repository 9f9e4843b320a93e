"""Dense multi-head attention with a decoding cache: the Universal Transformer's attention.

Self-attention (bidirectional, or causal and extended by the keys and values of earlier tokens) and, with
``key_value_states``, attention to an encoder's states. The cache is the model's (``HfxUniversalCache`` in
``models/universal/recurrent_block.py``); this module calls only its ``update(step, keys, values)`` and reads and sets
its ``cross_key_value``, so any object with those serves.

Unlike the other modules of ``attention/``, this one is not built as ``(config, layer_idx)``: the Universal
Transformer has one block shared by every step, so the attention is built once, as ``(config)``, and told the step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..ops.attention_switch import (
    EAGER,
    eager_attention,
    flex_applies,
    flex_attention,
    make_block_mask,
)
from ..ops.shapes import merge_heads, split_heads
from ..ops.varlen import DocumentLayout, document_attention, document_mask
from .base import AttentionOutput, KernelChoice, QKVProjection


def attention_groups(document_ids: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """``(batch, seq_len)`` long: the document of every real token of a packed batch, -1 at padding.

    Queries attend to the keys of their own group: a real token to its document's real tokens, padding only to
    padding (those rows are never read, but every row keeps a key, so none is NaN).
    """
    return document_ids if key_mask is None else document_ids.masked_fill(~key_mask, -1)


def attention_mask_4d(
    key_mask: torch.Tensor | None,
    query_len: int,
    past_len: int,
    causal: bool,
    device: torch.device,
    groups: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean mask ``(batch or 1, 1, query_len, past_len + query_len)``, True where a query may attend.

    Args:
        key_mask: ``(batch, past_len + query_len)`` bool, False for padding keys, or None (no padding).
        causal: query ``i`` (absolute position ``past_len + i``) sees keys up to its own position only.
        groups: ``(batch, query_len)`` long, a packed batch's :func:`attention_groups` (``past_len`` 0; ``key_mask``
            is folded into them): a query sees only the keys of its own group, a block-diagonal mask.
    A query with no allowed key at all would produce NaN, so a bidirectional padding row sees every key and a causal
    one always sees itself; those rows are padding and never read.
    """
    if groups is not None:
        return document_mask(groups, causal)
    if not causal:
        if key_mask is None:
            return None
        return (key_mask | ~key_mask.any(-1, keepdim=True))[:, None, None, :]
    keys = torch.arange(past_len + query_len, device=device)
    queries = torch.arange(past_len, past_len + query_len, device=device)
    allowed = keys[None, :] <= queries[:, None]
    if key_mask is None:
        return allowed[None, None]
    own = keys[None, :] == queries[:, None]
    return allowed & (key_mask[:, None, None, :] | own)


class HfxUniversalAttention(KernelChoice, QKVProjection):
    """Multi-head attention of the shared block: self-attention (bidirectional or causal, extended by the cache) or,
    with ``key_value_states``, attention to the encoder states. ``attentions``: ``(batch, heads, query, keys)``.

    Masks reach SDPA only where something is masked: an unpadded bidirectional pass gets none, and an uncached
    unpadded causal pass ``is_causal=True`` instead of a ``(query, keys)`` mask, so that SDPA can pick its fused
    (flash) kernels, which take no explicit mask. Scores and probabilities are in the inputs' dtype (the autocast
    dtype under autocast); the eager ``output_attentions`` path takes its softmax in float32.
    """

    def __init__(self, config) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads)
        self.dropout_p = config.attention_probs_dropout_prob
        self.config = config  # for kernel_choice: the choice is read at every forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        step: int = 0,
        cache: Any = None,
        output_attentions: bool = False,
        is_causal: bool = False,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, query, hidden)``; ``attention_mask`` bool ``(batch or 1, 1, query, keys)``, a
        :class:`~hf_xformers.ops.varlen.DocumentLayout` (a packed batch's documents, prepared once per forward for
        one kernel call over the whole row: varlen, FlexAttention or SDPA with a block-diagonal mask), or None;
        ``is_causal``: causal self-attention with ``attention_mask`` None and no earlier tokens (query ``i`` sees keys
        ``0..i``). Returns an
        :class:`~hf_xformers.attention.base.AttentionOutput`: the ``context`` ``(batch, query, hidden)`` (before the
        output projection) and the probabilities ``attentions`` or None."""
        if key_value_states is None:
            q, k, v = (split_heads(t, self.num_heads) for t in self.fused_qkv(hidden_states))
            if cache is not None:
                k, v = cache.update(step, k, v)
        else:
            q = split_heads(self.query(hidden_states), self.num_heads)
            if cache is not None and cache.cross_key_value is not None:
                k, v = cache.cross_key_value
            else:
                k = split_heads(self.key(key_value_states), self.num_heads)
                v = split_heads(self.value(key_value_states), self.num_heads)
                if cache is not None:
                    cache.cross_key_value = (k, v)
        dropout = self.dropout_p if self.training else 0.0
        implementation = self.kernel_choice(hidden_states)
        if isinstance(attention_mask, DocumentLayout):  # the model chose its kernel with the same kernel_choice
            return AttentionOutput(merge_heads(document_attention(q, k, v, attention_mask, dropout)))
        # Cached decoding (one new query against a growing cache) keeps SDPA: the compiled kernel is static in the key
        # length, so FlexAttention would compile anew at every generated token.
        if not output_attentions and cache is None and flex_applies(implementation, q, self.training, self.dropout_p):
            return AttentionOutput(merge_heads(self._flex(q, k, v, attention_mask, is_causal)))
        if not output_attentions and implementation != EAGER:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal
            )
            return AttentionOutput(merge_heads(context))
        if is_causal:
            attention_mask = attention_mask_4d(None, q.shape[2], k.shape[2] - q.shape[2], True, q.device)
        # attention_mask_4d leaves every row at least one key: no NaN rows under eager_attention's -inf.
        context, probs = eager_attention(q, k, v, attention_mask, dropout)
        return AttentionOutput(merge_heads(context), probs if output_attentions else None)

    @staticmethod
    def _flex(q, k, v, attention_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        """FlexAttention with the causal pattern as a ``BlockMask`` (the kernel skips the blocks above the diagonal),
        or the given ``(batch or 1, 1, query, keys)`` mask read per score; no mask: dense."""
        query_len, key_len = q.shape[2], k.shape[2]
        if is_causal:

            def keep(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx

            block_mask = make_block_mask(keep, None, None, query_len, key_len, q.device)
        elif attention_mask is not None:
            mask = attention_mask.expand(q.shape[0], 1, query_len, key_len)

            def keep(b, h, q_idx, kv_idx):
                return mask[b, 0, q_idx, kv_idx]

            block_mask = make_block_mask(keep, q.shape[0], None, query_len, key_len, q.device)
        else:
            block_mask = None
        return flex_attention(q, k, v, block_mask=block_mask)
