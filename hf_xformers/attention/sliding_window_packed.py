"""Longformer's global tokens in a packed batch: every layer meets only the global tokens of its own documents.

In a packed batch (``document_ids``, ``ops/packing.py``) a global query attends to the non-padding keys of its own
document only, and a query block to the global keys of the documents it touches. Laid out per document once per
forward (:class:`~hf_xformers.attention.sliding_window_layout.PackedGlobals`), a packed row with global tokens then
costs what its documents' own forwards cost, not ``seq_len x G`` for the global columns and rows each:

* the global columns (:meth:`PackedGlobalAttention._packed_banded_attention`): each query block gets the ``W`` global
  slots of the documents it touches in front of its local window;
* the global rows (:meth:`PackedGlobalAttention._packed_global_attention`): the global queries of each document attend
  to that document's keys, one small problem per document.

Only where the probabilities are asked for (``output_attentions``) do the ``(seq_len, G)`` and ``(G, seq_len)``
layouts of an unpacked batch exist (the ``_packed_*_layout`` / ``_packed_probs_and_context`` methods).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.kernels import attention
from ..ops.shapes import cut_to_length, unblock
from .sliding_window_banded import block_matmul, fold_blocks


class PackedGlobalAttention:
    """The packed-batch global paths of :class:`~hf_xformers.attention.sliding_window.HfxSlidingWindowSelfAttention`,
    a mixin of that module: its methods read the module's global projections (``query_global``, ``key_global``,
    ``value_global``), ``num_heads``, ``head_dim``, ``one_sided_window`` (``w``), ``query_block`` (``b``),
    ``dropout_p``, ``training`` and the band layout of
    :class:`~hf_xformers.attention.sliding_window_banded.BandedAttention` (``_to_band_layout``)."""

    def _packed_banded_attention(
        self, qb, kb, vb, bias, query_docs, query_pad, k, v, is_global, global_idx, packed_globals, explicit,
        return_probs, length,
    ):  # fmt: skip
        """The banded attention of a packed batch with global tokens: each query block gets the ``W`` global slots
        ``first .. first + W`` of ``packed_globals.columns[b]`` (those of the documents it touches, then slots of
        later documents or past the end, masked by document), not all ``G``.

        ``qb`` ``(batch * nb, heads, b, dim)``, ``kb`` / ``vb`` ``(batch * nb, heads, span, dim)`` and ``bias``
        ``(batch * nb, 1, b, span)``: the local problem; ``query_docs`` ``(batch, nb, b)``; ``query_pad`` the padding
        queries in the bias layout; ``k`` / ``v`` ``(batch, nb * b + 2w, heads, dim)`` the padded keys and values.
        ``explicit``: the explicit softmax; ``return_probs``: also the ``(batch, heads, seq_len, G + 2w + 1)`` band
        layout (global columns by slot, as unpacked). Returns the context ``(batch, seq_len, hidden)`` and the
        probabilities or None.
        """
        batch, nb, b = query_docs.shape
        heads, dim, w = self.num_heads, self.head_dim, self.one_sided_window
        num_global = global_idx.shape[1]
        first, width = packed_globals.columns[b]
        slots = first[..., None] + torch.arange(width, device=first.device)  # (batch, nb, W)
        inside = slots < num_global  # past the last slot: clamped onto it below, a duplicate to mask
        slots = slots.clamp(max=num_global - 1).view(batch, nb * width)
        position = (global_idx.gather(1, slots) + w)[..., None, None].expand(-1, -1, heads, dim)
        global_v = v.gather(1, position).view(batch, nb, width, heads, dim)
        gk = fold_blocks(k.gather(1, position).view(batch, nb, width, heads, dim).transpose(2, 3))
        gv = fold_blocks(global_v.transpose(2, 3))
        slot_docs = packed_globals.slot_docs.gather(1, slots).view(batch, nb, 1, width)
        # Padding queries (document -1) see no global key; the local bias has let them see their neighbourhood.
        same = (query_docs[..., None] == slot_docs) & inside[:, :, None, :]  # (batch, nb, b, W)
        global_bias = torch.where(same, 0.0, float("-inf")).to(bias.dtype)
        bias = torch.cat([fold_blocks(global_bias[:, :, None]), bias], -1)
        kb, vb = torch.cat([gk, kb], dim=2), torch.cat([gv, vb], dim=2)
        dropout = self.dropout_p if self.training else 0.0
        if not explicit:
            out = attention(qb, kb, vb, bias, dropout)
        else:
            scores = block_matmul(qb, kb.transpose(-1, -2)) * dim**-0.5 + bias
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).masked_fill(query_pad, 0.0).to(qb.dtype)
            if return_probs:
                return self._packed_probs_and_context(
                    weights, v, global_v, is_global, slots, inside, num_global, length
                )
            out = block_matmul(F.dropout(weights, dropout, self.training), vb)
        out = out.view(batch, nb, heads, b, dim).transpose(2, 3)  # (batch, nb, b, heads, dim)
        return unblock(out, length).reshape(batch, length, heads * dim), None

    def _packed_probs_and_context(self, weights, v, global_v, is_global, slots, inside, num_global, length):
        """:meth:`_packed_banded_attention`'s probabilities in the band layout (``G`` global columns by slot, then
        offsets ``-w .. w``) and the context computed from them, so that they are on the autograd path as unpacked.

        ``weights`` ``(batch * nb, heads, b, W + span)``; ``v`` the padded values; ``global_v``
        ``(batch, nb, W, heads, dim)`` each block's global values; ``slots`` ``(batch, nb * W)`` each block's slots
        (clamped), ``inside`` ``(batch, nb, W)`` those that are not clamped duplicates. Only here, because they are
        asked for, do the ``(seq_len, G)`` global columns exist.
        """
        heads, dim, w, b = self.num_heads, self.head_dim, self.one_sided_window, self.query_block
        batch, nb, width = inside.shape
        band = self._to_band_layout(weights[..., width:], batch, nb, 0, length)  # (batch, heads, length, 2w + 1)
        # Each block's weights into its slots' columns; clamped duplicates go to an extra column, cut off.
        target = torch.where(inside, slots.view(batch, nb, width), num_global)[:, :, None, None, :]
        target = target.expand(batch, nb, heads, b, width)
        columns = weights[..., :width].reshape(batch, nb, heads, b, width)
        columns = columns.new_zeros(batch, nb, heads, b, num_global + 1).scatter(-1, target, columns)
        columns = unblock(columns[..., :num_global].transpose(2, 3), length).transpose(1, 2)
        probs = torch.cat([columns, band], dim=-1).masked_fill(is_global[:, None, :, None], 0.0)
        dropped = F.dropout(probs, self.dropout_p if self.training else 0.0, self.training)
        local_v = cut_to_length(v.unfold(1, 2 * w + 1, 1), 1, length)  # (batch, length, heads, dim, 2w + 1)
        out = torch.einsum("bhlj,blhdj->blhd", dropped[..., num_global:], local_v)
        # The global columns back to each block's slots, duplicates zeroed.
        back = F.pad(dropped[..., :num_global], (0, 0, 0, nb * b - length)).view(batch, heads, nb, b, num_global)
        back = back.gather(-1, slots.view(batch, 1, nb, 1, width).expand(batch, heads, nb, b, width))
        back = back.masked_fill(~inside[:, None, :, None, :], 0.0)
        out_global = torch.einsum("bhnrc,bnchd->bnrhd", back, global_v).reshape(batch, nb * b, heads, dim)
        return (out + out_global[:, :length]).reshape(batch, length, heads * dim), probs

    def _packed_global_attention(
        self, hidden_states, attention_mask, picked, global_valid, explicit, packed_globals, return_probs
    ):  # fmt: skip
        """The global rows of a packed batch, document by document: the ``Gd`` global queries of each of ``D``
        documents (``packed_globals.members``) attend to the ``K`` keys from the document's first token
        (``packed_globals.key_positions``), masked to the document: cost ``D x Gd x K``, not ``G x seq_len``.

        ``picked`` ``(batch, G, hidden)``: the global tokens' hidden states; ``explicit``: the explicit softmax.
        Returns ``(batch, G, hidden)`` contexts and, if ``return_probs``, ``(batch, heads, G, seq_len)``
        probabilities (zeros outside the document).
        """
        batch, length = hidden_states.shape[:2]
        hidden = self.num_heads * self.head_dim  # the context's width (a sequence-parallel input is wider)
        heads, dim = self.num_heads, self.head_dim
        members, positions, place = packed_globals.members, packed_globals.key_positions, packed_globals.place
        groups, group_size, width = members.shape[1], members.shape[2], positions.shape[2]

        def by_group(x: torch.Tensor, rows: int) -> torch.Tensor:
            """``(batch, groups * rows, hidden)`` -> ``(batch * groups, heads, rows, dim)``."""
            return x.view(batch, groups, rows, heads, dim).transpose(2, 3).reshape(batch * groups, heads, rows, dim)

        def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            """Rows ``index`` ``(batch, n)`` of ``x`` ``(batch, m, hidden)``."""
            return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))

        # The whole row is projected once (as unpacked), then each document's keys are gathered.
        q = by_group(gather_rows(self.query_global(picked), members.view(batch, -1)), group_size)
        k = by_group(gather_rows(self.key_global(hidden_states), positions.view(batch, -1)), width)
        v = by_group(gather_rows(self.value_global(hidden_states), positions.view(batch, -1)), width)
        key_docs = packed_globals.key_docs
        if attention_mask is not None:
            key_docs = key_docs.masked_fill(~attention_mask.gather(1, positions.view(batch, -1)).view_as(key_docs), -1)
        mask = packed_globals.member_docs[..., None] == key_docs[:, :, None, :]  # (batch, D, Gd, K)
        # Unused places (and empty slots) see every gathered key: no NaN, and their output is dropped.
        mask = (mask | ~mask.any(-1, keepdim=True)).view(batch * groups, 1, group_size, width)
        dropout = self.dropout_p if self.training else 0.0

        def to_slots(out: torch.Tensor) -> torch.Tensor:
            """``(batch * D, heads, Gd, dim)`` -> ``(batch, G, hidden)`` (empty slots read an extra zero row)."""
            out = out.view(batch, groups, heads, group_size, dim).transpose(2, 3).reshape(batch, -1, hidden)
            return gather_rows(F.pad(out, (0, 0, 0, 1)), place)

        if not explicit:
            return to_slots(attention(q, k, v, mask, dropout)), None
        scores = torch.matmul(q, k.transpose(-1, -2)) * dim**-0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        if not return_probs:
            return to_slots(torch.matmul(F.dropout(probs, dropout, self.training), v)), None
        full, dropped = self._packed_global_layout(probs, packed_globals, global_valid, length)
        return to_slots(torch.matmul(dropped, v)), full

    def _packed_global_layout(self, probs, packed_globals, global_valid, length):
        """:meth:`_packed_global_attention`'s probabilities ``(batch * D, heads, Gd, K)`` in the returned layout
        ``(batch, heads, G, seq_len)`` (zeros outside each slot's document), and back from it with dropout, in the
        member layout: the context is computed from the returned probabilities, which so stay on the autograd path
        as unpacked. Only here, because they are asked for, do the ``(G, seq_len)`` rows exist.
        """
        heads = self.num_heads
        members, positions, place = packed_globals.members, packed_globals.key_positions, packed_globals.place
        (batch, groups, group_size), width, num_global = members.shape, positions.shape[2], place.shape[1]
        size = groups * group_size
        # Every slot's row of its document's keys (empty slots: the extra zero row) and the columns they belong in
        # (the row's length, an extra column cut off, for keys of other documents and clamped duplicates).
        by_slot = probs.view(batch, groups, heads, group_size, width).transpose(2, 3).reshape(batch, size, heads, -1)
        by_slot = F.pad(by_slot, (0, 0, 0, 0, 0, 1)).gather(1, place[..., None, None].expand(-1, -1, heads, width))
        group = torch.div(place, group_size, rounding_mode="floor").clamp(max=groups - 1)[..., None]
        own = packed_globals.key_docs.gather(1, group.expand(-1, -1, width)) == packed_globals.slot_docs[..., None]
        column = torch.where(own, positions.gather(1, group.expand(-1, -1, width)), length)  # (batch, G, K)
        full = by_slot.new_zeros(batch, num_global, heads, length + 1)
        full = full.scatter(-1, column[:, :, None, :].expand(-1, -1, heads, -1), by_slot)[..., :length]
        full = full.transpose(1, 2).masked_fill(~global_valid[:, None, :, None], 0.0)
        dropped = F.dropout(full, self.dropout_p if self.training else 0.0, self.training).transpose(1, 2)
        dropped = dropped.gather(-1, column.clamp(max=length - 1)[:, :, None, :].expand(-1, -1, heads, -1))
        dropped = dropped.masked_fill(~own[:, :, None, :], 0.0)  # (batch, G, heads, K)
        index = place[..., None, None].expand(-1, -1, heads, width)
        dropped = dropped.new_zeros(batch, size + 1, heads, width).scatter(1, index, dropped)[:, :size]
        dropped = dropped.view(batch, groups, group_size, heads, width).transpose(2, 3)
        return full, dropped.reshape(batch * groups, heads, group_size, width)
