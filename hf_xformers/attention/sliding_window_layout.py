"""What every Longformer layer of one forward shares, worked out once (:func:`longformer_layout`).

The global tokens (:func:`global_slots_of`: each row's global positions as ``G`` slots), their per-document layout in
a packed batch (:func:`packed_globals_of`: the global keys a query block meets, the global rows grouped by
document), their sizes (:class:`GlobalSizes`: one device-to-host read for all of them, or none where the batch says
them, :func:`first_token_sizes`) and FlexAttention's block masks of the band (:func:`band_block_mask`). The attention
module (``attention/sliding_window.py``) builds a :class:`LongformerLayout` through
:meth:`~hf_xformers.attention.sliding_window.HfxSlidingWindowSelfAttention.shared_layout`, which the model calls once
per forward for all its layers and a module called on its own calls for itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops.attention_switch import block_mask_from_tables
from ..ops.input_checks import is_tracing
from ..ops.shapes import ceil_div


def global_slots_of(is_global: torch.Tensor, num_global: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the global tokens are: ``is_global`` ``(batch, seq_len)`` bool -> ``(batch, G)`` positions (each
    example's global positions first, in order) and ``(batch, G)`` bool validity.

    ``G`` is ``num_global`` when the caller knows it (any bound on the most globals of an example: the unused slots
    are invalid), else the most globals of any example, which eager mode reads (a device-to-host synchronisation:
    :func:`longformer_layout` does it once per forward for all layers, with its other sizes). A traced graph cannot
    size a tensor by a value, so there an unknown ``G`` is the sequence length (every position a slot): the same
    result, at a cost quadratic in the length for inputs with global tokens.
    """
    counts = is_global.sum(-1)
    if num_global is None:
        num_global = is_global.shape[1] if is_tracing() else int(counts.max())
    # A stable sort puts each example's global positions first, in order.
    global_idx = torch.argsort((~is_global).to(torch.int8), dim=-1, stable=True)[:, :num_global]
    global_valid = torch.arange(num_global, device=is_global.device)[None, :] < counts[:, None]
    return global_idx, global_valid


class GlobalSizes(NamedTuple):
    """The host sizes of the global-token layouts of one forward (bounds: every one may exceed what it bounds, the
    extra places are masked). ``num_global``: ``G``, the global slots per row; the rest only for a packed batch
    (:class:`PackedGlobals`): ``num_groups`` ``D``, the documents with global tokens in a row; ``group_size``
    ``Gd``, the global tokens of one document; ``key_width`` ``K``, the longest document with global tokens;
    ``widths``: by query block size ``b``, ``W``, the global slots of the documents one query block touches."""

    num_global: int
    num_groups: int | None = None
    group_size: int | None = None
    key_width: int | None = None
    widths: dict[int, int] | None = None


def global_sizes(
    is_global: torch.Tensor, document_ids: torch.Tensor | None, query_blocks: Iterable[int]
) -> GlobalSizes:
    """The exact :class:`GlobalSizes` of an arbitrary ``is_global`` ``(batch, seq_len)`` bool (padding excluded), in a
    packed batch given ``document_ids`` ``(batch, seq_len)`` (contiguous runs numbered upwards): one device-to-host
    read for all of them (eager mode only; a traced graph takes the whole-row layouts instead)."""
    counts = is_global.sum(-1)
    if document_ids is None:
        return GlobalSizes(int(counts.max()))
    batch, length = is_global.shape
    docs = document_ids.contiguous()
    # Per document of each row (run numbers are below the length): its global tokens and its length.
    per_doc = torch.zeros_like(docs).scatter_add(1, docs, is_global.long())
    doc_length = torch.zeros_like(docs).scatter_add(1, docs, torch.ones_like(docs))
    has = per_doc > 0
    running = per_doc.cumsum(-1)
    blocks = sorted(set(query_blocks))
    widths = []
    for b in blocks:
        first_query = torch.arange(ceil_div(length, b), device=docs.device) * b
        first, last = docs[:, first_query], docs[:, (first_query + b).clamp(max=length) - 1]
        # the global tokens of documents first .. last
        widths.append((running.gather(1, last) - running.gather(1, first) + per_doc.gather(1, first)).max())
    values = torch.stack([
        counts.max(), has.sum(-1).max(), per_doc.max(), torch.where(has, doc_length, 0).max(), *widths,
    ]).tolist()  # fmt: skip
    return GlobalSizes(*values[:4], dict(zip(blocks, values[4:])))


def first_token_sizes(count, longest, length, query_blocks: Iterable[int]) -> GlobalSizes:
    """The :class:`GlobalSizes` of a packed batch whose global tokens are the first token of every document (the
    sequence-classification default), known without a read: at most ``count`` (the batch's documents) per row, one per
    document, a document's keys at most ``longest`` (the longest document; None: the row), and a query block of ``b``
    tokens touches at most ``b`` documents. ``count`` / ``longest`` may be symbolic (``torch.compile``)."""
    per_row = torch.sym_min(count, length)  # several rows share the count: a row holds at most its length
    key_width = length if longest is None else torch.sym_min(longest, length)
    widths = {b: torch.sym_min(b, per_row) for b in set(query_blocks)}
    return GlobalSizes(per_row, per_row, 1, key_width, widths)


class PackedGlobals(NamedTuple):
    """Where the global tokens of a packed batch meet their documents (:func:`packed_globals_of`), the same for every
    layer. ``G`` is the number of global slots (:func:`global_slots_of`), ``nb`` a layer's number of query blocks.

    * ``slot_docs`` ``(batch, G)``: the document of every global slot (the row's length for empty slots, past any
      document, so that the row stays sorted).
    * ``columns``: by query block size ``b``, ``(first, width)``: ``first`` ``(batch, nb)`` the first global slot of
      the documents that a query block touches, ``width`` the most slots such a range holds in any block.
    * ``members`` ``(batch, D, Gd)``: the global slots of every document that has some (``D`` the most such documents
      in a row, ``Gd`` the most global tokens of one document; unused places point at slot 0), ``member_docs``
      ``(batch, D, Gd)`` their documents (the row's length for unused places).
    * ``place`` ``(batch, G)``: every slot's place in the flattened ``(D * Gd)`` members (``D * Gd`` for empty slots).
    * ``key_positions`` ``(batch, D, K)``: the ``K`` tokens from the first of every such document, ``K`` the
      longest of them (clamped to the row), and ``key_docs`` ``(batch, D, K)`` their documents (-1 for tokens past the
      row's end, clamped duplicates).
    """

    slot_docs: torch.Tensor
    columns: dict[int, tuple[torch.Tensor, int]]
    members: torch.Tensor
    member_docs: torch.Tensor
    place: torch.Tensor
    key_positions: torch.Tensor
    key_docs: torch.Tensor


def packed_globals_of(
    document_ids: torch.Tensor,
    global_slots: tuple[torch.Tensor, torch.Tensor],
    query_blocks: Iterable[int],
    sizes: GlobalSizes | None = None,
) -> PackedGlobals:
    """The per-document layout of the global tokens of a packed batch, so that a layer's global keys and global
    queries meet only their own documents: cost ``blocks x b x width`` for the global columns and
    ``D x Gd x K`` for the global rows, where the whole row would cost ``seq_len x G`` for each.

    Documents are contiguous runs numbered upwards and the global slots are in row order, so the slots of the
    documents that a query block touches are one contiguous range (found by binary search), and so are the slots of
    one document. ``document_ids``: ``(batch, seq_len)`` long; ``global_slots``: :func:`global_slots_of`;
    ``query_blocks``: the query block sizes of the layers; ``sizes``: the widths ``D``, ``Gd``, ``K`` and ``W`` when
    the caller knows them (:func:`global_sizes`, :func:`first_token_sizes`; bounds suffice, the extra places are
    masked). Without them eager mode reads them here (one device-to-host read), and a traced graph, which cannot size
    tensors by values, takes the whole row instead (every block sees every slot, and all slots form one group over
    all keys): the same result, at the cost of the unpacked layout.
    """
    global_idx, global_valid = global_slots
    (batch, length), num_global = document_ids.shape, global_idx.shape[1]
    device = document_ids.device
    docs = document_ids.contiguous()
    slot = torch.arange(num_global, device=device)
    slot_docs = torch.where(global_valid, docs.gather(1, global_idx), length)
    starts = {}
    for b in sorted(set(query_blocks)):
        first_query = torch.arange(ceil_div(length, b), device=device) * b
        last_query = (first_query + b).clamp(max=length) - 1
        first = torch.searchsorted(slot_docs, docs[:, first_query])
        starts[b] = (first, torch.searchsorted(slot_docs, docs[:, last_query], right=True) - first)
    if sizes is None and is_tracing():
        columns = {b: (torch.zeros_like(first), num_global) for b, (first, _) in starts.items()}
        members, member_docs = slot.expand(batch, 1, num_global), slot_docs[:, None]
        place = slot.expand(batch, num_global)
        key_positions = torch.arange(length, device=device).expand(batch, 1, length)
        return PackedGlobals(slot_docs, columns, members, member_docs, place, key_positions, docs[:, None])
    first_key = torch.searchsorted(docs, slot_docs)
    new_group = global_valid.clone()
    new_group[:, 1:] &= slot_docs[:, 1:] != slot_docs[:, :-1]
    rank = slot - torch.where(new_group, slot, 0).cummax(-1).values
    if sizes is None:
        doc_length = torch.searchsorted(docs, slot_docs, right=True) - first_key  # 0 for empty slots
        widths = torch.stack([
            new_group.sum(-1).max(), rank.masked_fill(~global_valid, 0).max() + 1, doc_length.max(),
            *(count.max() for _, count in starts.values()),
        ]).tolist()  # fmt: skip
        sizes = GlobalSizes(num_global, *widths[:3], dict(zip(starts, widths[3:])))
    num_groups, group_size, key_width = sizes.num_groups, sizes.group_size, sizes.key_width
    columns = {b: (first, sizes.widths[b]) for b, (first, _) in starts.items()}
    size = num_groups * group_size
    place = torch.where(global_valid, (new_group.long().cumsum(-1) - 1) * group_size + rank, size)
    # Empty slots all land on the extra place ``size``, cut off.
    members = torch.zeros(batch, size + 1, dtype=torch.long, device=device).scatter(1, place, slot.expand(batch, -1))
    member_docs = torch.full_like(members, length).scatter(1, place, slot_docs)
    members = members[:, :size].view(batch, num_groups, group_size)
    member_docs = member_docs[:, :size].view(batch, num_groups, group_size)
    key_positions = first_key.gather(1, members[..., 0])[..., None] + torch.arange(key_width, device=device)
    inside = key_positions < length
    key_positions = key_positions.clamp(max=length - 1)
    key_docs = torch.where(inside, docs.gather(1, key_positions.view(batch, -1)).view_as(inside), -1)
    return PackedGlobals(slot_docs, columns, members, member_docs, place, key_positions, key_docs)


# Query and key block size of Longformer's FlexAttention BlockMask (FlexAttention's default).
FLEX_BLOCK = 128


def band_block_mask(
    attention_mask: torch.Tensor | None, is_global: torch.Tensor | None, one_sided_window: int, length: int,
    device: torch.device, document_ids: torch.Tensor | None = None,
):  # fmt: skip
    """FlexAttention's ``BlockMask`` of Longformer's local attention: query ``i`` sees key ``j`` when ``|i - j| <= w``
    or ``j`` is global, and ``j`` is a real token (of the same document as ``i`` in a packed batch).
    ``attention_mask`` / ``is_global``: ``(batch, length)`` bool or None; ``document_ids``: ``(batch, length)`` long
    (contiguous runs numbered upwards, :mod:`~hf_xformers.ops.packing`) or None.

    Built from block arithmetic, not by evaluating the mask on every (query, key) pair: key blocks wholly inside the
    band and wholly real are full (no per-score mask); blocks the band touches, blocks with a global token and blocks
    with padding are partial (the mask below decides per score there); the rest are skipped. With documents a block
    pair stays full only when both blocks lie inside one and the same document, becomes partial where a boundary
    crosses it, and is skipped when the two blocks share no document (global columns of other documents included).
    The mask states the whole pattern: FlexAttention's eager form applies it to every score and ignores the block
    lists. The cost is linear in the length (``create_block_mask`` would evaluate ``length**2`` pairs)."""

    def local(b, h, q, kv):
        keep = (q - kv).abs() <= one_sided_window
        if is_global is not None:
            keep = keep | is_global[b, kv]
        if attention_mask is not None:
            keep = keep & attention_mask[b, kv]
        if document_ids is not None:
            keep = keep & (document_ids[b, q] == document_ids[b, kv])
        return keep

    size, nb = FLEX_BLOCK, ceil_div(length, FLEX_BLOCK)
    block = torch.arange(nb, device=device)
    distance = (block[:, None] - block[None, :]).abs() * size  # between block starts
    touches = (distance - (size - 1) <= one_sided_window)[None]  # some pair within the window
    inside = (distance + (size - 1) <= one_sided_window)[None]  # every pair within the window
    real = attention_mask if attention_mask is not None else torch.ones(1, length, dtype=torch.bool, device=device)
    real = F.pad(real, (0, nb * size - length), value=False).view(-1, nb, size)
    whole, some = real.all(-1)[:, None, :], real.any(-1)[:, None, :]
    reach = touches
    if is_global is not None:
        reach = touches | F.pad(is_global, (0, nb * size - length), value=False).view(-1, nb, size).any(-1)[:, None, :]
    full = inside & whole
    partial = reach & some & ~full
    if document_ids is not None:
        # Documents are contiguous runs numbered upwards, so a block's documents are the range from its first token's
        # to its last's (the tail past the length repeats the last document).
        tail = document_ids[:, -1:].expand(-1, nb * size - length)
        ends = torch.cat([document_ids, tail], dim=1).view(-1, nb, size)
        first, last = ends[..., 0], ends[..., -1]  # (batch, nb)
        one_document = (first[:, :, None] == last[:, None, :]) & (last[:, :, None] == first[:, None, :])
        share = (last[:, :, None] >= first[:, None, :]) & (first[:, :, None] <= last[:, None, :])
        partial = (partial | (full & ~one_document)) & share
        full = full & one_document

    batch = max(t.shape[0] for t in (real, is_global, document_ids) if t is not None)
    # one head dimension: the pattern is the same for every head
    full, partial = full.expand(batch, nb, nb)[:, None], partial.expand(batch, nb, nb)[:, None]
    return block_mask_from_tables(partial, full, size, local, length)


class LongformerLayout(NamedTuple):
    """What every layer of one forward shares, worked out once (:func:`longformer_layout`).

    * ``is_global`` ``(batch, seq_len)`` bool, padding excluded, or None when no token is global.
    * ``global_slots``: :func:`global_slots_of`, or None without global tokens.
    * ``packed_globals``: :func:`packed_globals_of` for a packed batch with global tokens, else None.
    * ``flex_masks``: FlexAttention's block masks by one-sided window (:func:`band_block_mask`), for the windows
      asked for (``attn_implementation="flex_attention"``).
    * ``varlen``: ``(cu_seq_lens, longest)`` of a packed row without padding or global tokens on a device where
      :data:`varlen_attn` runs: ``(count + 1,)`` int32 boundaries and the longest document's length, else None.
    """

    is_global: torch.Tensor | None = None
    global_slots: tuple[torch.Tensor, torch.Tensor] | None = None
    packed_globals: PackedGlobals | None = None
    flex_masks: dict | None = None
    varlen: tuple[torch.Tensor, int] | None = None


def longformer_layout(
    attention_mask: torch.Tensor | None, is_global: torch.Tensor | None, length: int, device: torch.device,
    query_blocks: Iterable[int], windows: Iterable[int] = (), document_ids: torch.Tensor | None = None,
    sizes: GlobalSizes | None = None, varlen: tuple[torch.Tensor, int] | None = None,
) -> LongformerLayout:  # fmt: skip
    """The :class:`LongformerLayout` of one forward, for layers of query block sizes ``query_blocks`` and one-sided
    windows ``windows`` (a FlexAttention block mask for each; empty: none).

    ``attention_mask`` ``(batch, seq_len)`` bool or None (no padding); ``is_global`` ``(batch, seq_len)`` bool with
    padding excluded, or None; ``document_ids`` ``(batch, seq_len)`` long, the runs of a packed batch, or None.
    ``sizes``: the :class:`GlobalSizes` when the caller knows them without a read (:func:`first_token_sizes`);
    otherwise eager mode reads them here, all in one device-to-host read (an ``is_global`` without a global token then
    becomes None), and a traced graph takes the whole-row layouts. ``varlen``: kept when there is no global token.
    """
    if is_global is not None and sizes is None and not is_tracing():
        sizes = global_sizes(is_global, document_ids, query_blocks)
        if sizes.num_global == 0:
            is_global = None
    slots = packed = None
    if is_global is not None:
        slots = global_slots_of(is_global, None if sizes is None else sizes.num_global)
        if document_ids is not None:
            packed = packed_globals_of(document_ids, slots, query_blocks, sizes)
    flex_masks = {
        w: band_block_mask(attention_mask, is_global, w, length, device, document_ids) for w in sorted(set(windows))
    }
    return LongformerLayout(is_global, slots, packed, flex_masks, varlen if is_global is None else None)
