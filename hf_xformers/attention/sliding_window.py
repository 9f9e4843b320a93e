"""Longformer attention: a sliding window for every token plus global attention for chosen tokens.

Semantics (Beltagy et al., 2020, and transformers' ``LongformerSelfAttention``), with ``w`` the one-sided
window (``attention_window // 2``):

* a non-global query ``i`` attends to the non-global, non-padding keys ``j`` with ``|i - j| <= w`` and to every
  global key (global keys use the ordinary key/value projections here);
* a global query attends to every non-padding key, through the separate ``query_global``, ``key_global`` and
  ``value_global`` projections;
* padding queries produce zeros.

How it is computed: the sequence is cut into blocks of ``w`` tokens. Block ``b`` of queries needs keys from
blocks ``b - 1, b, b + 1`` only, so each block becomes one small dense attention problem of ``w`` queries
against ``3w`` (+ global) keys, and all blocks go through one batched call of PyTorch's fused
``scaled_dot_product_attention`` with a boolean band mask. That costs ``3w`` keys per query against the ideal
``2w + 1``, but needs no overlapping-chunk products, no ``as_strided`` and no ``(seq, 2w + 1)`` score tensor
in memory. When the window covers the whole sequence one plain dense call is made instead: it is the same
result (every key is in every window) and faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import AttentionOutput, QKVProjection, merge_heads, split_heads


def _blocks_with_neighbours(x: torch.Tensor, block: int, fill: float | bool = 0) -> torch.Tensor:
    """Gather, for every block of ``x``, the block before, itself and the block after.

    Args:
        x: ``(batch, num_blocks * block, *rest)``.
    Returns:
        ``(batch, num_blocks, 3 * block, *rest)``; out-of-range neighbours are filled with ``fill``.
    """
    batch, length = x.shape[:2]
    rest = x.shape[2:]
    pad = [0, 0] * len(rest) + [block, block]
    padded = F.pad(x, pad, value=fill).view(batch, length // block + 2, block, *rest)
    return torch.cat([padded[:, :-2], padded[:, 1:-1], padded[:, 2:]], dim=2)


class HfxSlidingWindowSelfAttention(QKVProjection):
    """Sliding-window + global self-attention of one Longformer layer.

    ``attentions`` (with ``output_attentions=True``): ``(batch, heads, seq_len, G + 2w + 1)``, the first ``G``
    columns are the global keys (``G`` = most global tokens of any example), then relative offsets ``-w .. w``;
    the same layout as transformers' Longformer (rows of global tokens are zero there: their output comes from
    global attention). ``global_attentions``: ``(batch, heads, G, seq_len)``, the transpose of transformers' (rows of empty
    slots, in examples with fewer than ``G`` global tokens, are zero).
    """

    supports_global_attention = True

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads)
        window = config.attention_window
        window = window[layer_idx] if isinstance(window, (list, tuple)) else window
        self.one_sided_window = window // 2
        hidden = config.hidden_size
        self.query_global = nn.Linear(hidden, hidden)
        self.key_global = nn.Linear(hidden, hidden)
        self.value_global = nn.Linear(hidden, hidden)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> AttentionOutput:
        batch, length, hidden = hidden_states.shape
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.bool, device=hidden_states.device)
        is_global = None
        if global_attention_mask is not None:
            is_global = global_attention_mask & attention_mask
            if not bool(is_global.any()):
                is_global = None

        q, k, v = self.query(hidden_states), self.key(hidden_states), self.value(hidden_states)

        # Global keys/values seen by every query: gathered into G slots per example (G = most globals).
        global_idx = global_valid = None
        if is_global is not None:
            counts = is_global.sum(-1)
            num_global = int(counts.max())
            # A stable sort puts each example's global positions first, in order.
            global_idx = torch.argsort((~is_global).to(torch.int8), dim=-1, stable=True)[:, :num_global]
            global_valid = torch.arange(num_global, device=q.device)[None, :] < counts[:, None]

        dense = not output_attentions and length <= self.one_sided_window + 1
        if dense:
            context = self._dense_attention(q, k, v, attention_mask)
            probs = None
        else:
            context, probs = self._banded_attention(
                q, k, v, attention_mask, is_global, global_idx, global_valid, output_attentions
            )
        # Padding queries give zeros, as in the reference implementation.
        context = context.masked_fill(~attention_mask[..., None], 0.0)

        global_probs = None
        if is_global is not None:
            global_context, global_probs = self._global_attention(
                hidden_states, attention_mask, global_idx, global_valid, output_attentions
            )
            rows = torch.arange(batch, device=q.device)[:, None].expand_as(global_idx)[global_valid]
            context = context.index_put((rows, global_idx[global_valid]), global_context[global_valid])
            if probs is not None:
                # A global token's local row is not used (its output comes from global attention): zero it.
                probs = probs.masked_fill(is_global[:, None, :, None], 0.0)
        elif self.training:
            # The global projections get no gradient when no token is global; DistributedDataParallel then
            # fails with "parameters that were not used". A zero-weighted term keeps them in the graph.
            unused = sum(p.sum() for m in (self.query_global, self.key_global, self.value_global) for p in m.parameters())
            context = context + 0.0 * unused
        return AttentionOutput(context, probs, global_probs)

    def _dense_attention(self, q, k, v, attention_mask) -> torch.Tensor:
        """The window covers the sequence: one full attention over the non-padding keys."""
        heads = self.num_heads
        mask = (attention_mask | ~attention_mask.any(-1, keepdim=True))[:, None, None, :]
        dropout = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(
            split_heads(q, heads), split_heads(k, heads), split_heads(v, heads), attn_mask=mask, dropout_p=dropout
        )
        return merge_heads(out)

    def _banded_attention(self, q, k, v, attention_mask, is_global, global_idx, global_valid, output_attentions):
        """Sliding-window attention (plus global keys) computed block by block.

        Shapes inside: ``nb`` blocks of ``w`` tokens; each query block sees ``3w`` local keys and ``G`` global ones.
        """
        batch, length, hidden = q.shape
        heads, dim, w = self.num_heads, self.head_dim, self.one_sided_window
        nb = -(-length // w)
        pad = nb * w - length
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            attention_mask = F.pad(attention_mask, (0, pad), value=False)
            if is_global is not None:
                is_global = F.pad(is_global, (0, pad), value=False)

        # (batch * nb, heads, w, dim) queries and (batch * nb, heads, 3w, dim) keys/values.
        qb = q.view(batch, nb, w, heads, dim).permute(0, 1, 3, 2, 4).reshape(batch * nb, heads, w, dim)
        kb = _blocks_with_neighbours(k.view(batch, nb * w, heads, dim), w)
        vb = _blocks_with_neighbours(v.view(batch, nb * w, heads, dim), w)
        kb = kb.permute(0, 1, 3, 2, 4).reshape(batch * nb, heads, 3 * w, dim)
        vb = vb.permute(0, 1, 3, 2, 4).reshape(batch * nb, heads, 3 * w, dim)

        # Local keys: real tokens that are not global (global ones come in through the global slots instead).
        local_key = attention_mask if is_global is None else attention_mask & ~is_global
        key_ok = _blocks_with_neighbours(local_key, w, fill=False).view(batch * nb, 1, 1, 3 * w)
        # Block-local key column c of query row r sits at relative offset c - w - r.
        offset = torch.arange(3 * w, device=q.device)[None, :] - w - torch.arange(w, device=q.device)[:, None]
        mask = key_ok & (offset.abs() <= w)
        # A padding query can be left with no key at all; give it itself (its output is zeroed later).
        query_pad = ~attention_mask.view(batch * nb, 1, w, 1)
        mask = mask | (query_pad & (offset == 0))

        num_global = 0
        if is_global is not None:
            num_global = global_idx.shape[1]
            gk = self._gather_heads(k, global_idx)  # (batch, heads, G, dim)
            gv = self._gather_heads(v, global_idx)
            expand = (batch, nb, heads, num_global, dim)
            gk = gk[:, None].expand(expand).reshape(batch * nb, heads, num_global, dim)
            gv = gv[:, None].expand(expand).reshape(batch * nb, heads, num_global, dim)
            kb, vb = torch.cat([gk, kb], dim=2), torch.cat([gv, vb], dim=2)
            gmask = global_valid[:, None, None, None, :].expand(batch, nb, 1, w, num_global)
            mask = torch.cat([gmask.reshape(batch * nb, 1, w, num_global), mask.expand(batch * nb, 1, w, 3 * w)], -1)

        dropout = self.dropout_p if self.training else 0.0
        probs = None
        if not output_attentions:
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=dropout)
        else:
            scores = torch.matmul(qb, kb.transpose(-1, -2)) * dim**-0.5
            weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
            weights = weights.masked_fill(query_pad, 0.0).to(q.dtype)
            out = torch.matmul(F.dropout(weights, dropout, self.training), vb)
            probs = self._to_band_layout(weights, batch, nb, num_global)[:, :, :length]
        out = out.view(batch, nb, heads, w, dim).permute(0, 1, 3, 2, 4).reshape(batch, nb * w, hidden)
        return out[:, :length], probs

    def _to_band_layout(self, weights, batch, nb, num_global) -> torch.Tensor:
        """``(batch * nb, heads, w, G + 3w)`` block weights -> ``(batch, heads, nb * w, G + 2w + 1)``."""
        w, heads = self.one_sided_window, self.num_heads
        # Row r keeps block-local columns r .. r + 2w, i.e. offsets -w .. w.
        cols = torch.arange(w, device=weights.device)[:, None] + torch.arange(2 * w + 1, device=weights.device)
        band = weights[..., num_global:].gather(-1, cols.expand(batch * nb, heads, w, 2 * w + 1))
        both = torch.cat([weights[..., :num_global], band], dim=-1)
        return both.view(batch, nb, heads, w, -1).permute(0, 2, 1, 3, 4).reshape(batch, heads, nb * w, -1)

    def _gather_heads(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``x`` ``(batch, seq, hidden)`` at positions ``idx`` ``(batch, G)`` -> ``(batch, heads, G, dim)``."""
        picked = x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
        return split_heads(picked, self.num_heads)

    def _global_attention(self, hidden_states, attention_mask, global_idx, global_valid, output_attentions):
        """Global queries attend to every real token through the global projections.

        Returns ``(batch, G, hidden)`` contexts and, if asked, ``(batch, heads, G, seq_len)`` probabilities.
        """
        picked = hidden_states.gather(1, global_idx[..., None].expand(-1, -1, hidden_states.shape[-1]))
        q = split_heads(self.query_global(picked), self.num_heads)
        k = split_heads(self.key_global(hidden_states), self.num_heads)
        v = split_heads(self.value_global(hidden_states), self.num_heads)
        # Empty slots (examples with fewer globals) may look at everything; their output is dropped.
        mask = (attention_mask[:, None, :] | ~global_valid[:, :, None])[:, None]
        dropout = self.dropout_p if self.training else 0.0
        if not output_attentions:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
            return merge_heads(out), None
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        probs = probs.masked_fill(~global_valid[:, None, :, None], 0.0)
        out = torch.matmul(F.dropout(probs, dropout, self.training), v)
        return merge_heads(out), probs
