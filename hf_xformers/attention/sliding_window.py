"""Longformer attention: a sliding window for every token plus global attention for chosen tokens.

Semantics (Beltagy et al., 2020, and transformers' ``LongformerSelfAttention``), with ``w`` the one-sided
window (``attention_window // 2``):

* a non-global query ``i`` attends to the non-global, non-padding keys ``j`` with ``|i - j| <= w`` and to every
  global key (global keys use the ordinary key/value projections here);
* a global query attends to every non-padding key, through the separate ``query_global``, ``key_global`` and
  ``value_global`` projections;
* padding queries produce zeros;
* in a packed batch (``document_ids``, see ``ops/packing.py``) every rule above holds within each document: no query
  sees a key of another document, local or global, and a global query attends to every non-padding key of its own
  document only, so each document gets what its own forward gives.

How it is computed: queries are cut into blocks of ``b`` tokens (``b = w``, or ``w / 4`` for windows of 64 and
more). A block only needs the ``b + 2w`` keys around it, so each block is one small dense attention problem,
and all blocks go through one batched call of PyTorch's fused ``scaled_dot_product_attention`` with an
additive band mask. The key neighbourhoods are overlapping *views* of the key/value tensors (``unfold``), not
copies; there are no overlapping-chunk products and no ``(seq, 2w + 1)`` score tensor in memory. When the
window covers the whole sequence one plain dense call is made instead: the same result (every key is in
every window), and faster. A packed batch adds its document condition in the same layouts: the documents of the
key neighbourhoods are ``unfold`` views of ``document_ids`` like the keys themselves, so the mask stays the size of
the band (no ``(seq_len, seq_len)`` tensor). Global tokens stay within their documents too (:func:`packed_globals_of`):
a query block gets only the global keys of the documents it touches, and the global queries of each document only
that document's keys, so a packed row with global tokens costs what its documents' own forwards cost, not
``seq_len x G``.

What every layer shares (the global slots, their per-document layout, FlexAttention's block masks) is worked out once
per forward by :func:`longformer_layout`, whose sizes cost at most one device-to-host read (none for the documents'
first tokens, whose sizes the batch gives). On CUDA a packed row without padding or global tokens goes through
FlashAttention's variable-length kernel (``torch.nn.attention.varlen.varlen_attn`` with ``window_size=(w, w)``) in one call over the row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..ops.attention_switch import (
    EAGER,
    FLEX,
    SDPA,
    attention_implementation,
    block_mask_from_tables,
    flex_applies,
    flex_attention,
)
from ..ops.input_checks import is_tracing, reads_values
from ..ops.kernels import attention
from ..ops.packing import PackedBatch
from ..ops.precision import autocast_input, is_half_precision
from ..ops.shapes import ceil_div, cut_to_length, merge_heads, split_heads, unblock
from .base import AttentionOutput, QKVProjection


def _neighbourhoods(x: torch.Tensor, span: int, step: int) -> torch.Tensor:
    """Overlapping windows of ``span`` rows every ``step`` rows along dim 1, as a view (no copy).

    Args:
        x: ``(batch, length, *rest)``.
    Returns:
        ``(batch, (length - span) // step + 1, span, *rest)``.
    """
    return x.unfold(1, span, step).movedim(-1, 2)


class _BlockWindows(torch.autograd.Function):
    """The key (or value) neighbourhoods of the query blocks as one contiguous head-major tensor, with optional
    global rows in front of every block's window, for training in half precision.

    The ``unfold`` views serve float32, whose per-head products take any strides; in half precision the products need
    plain operands, so the attention kernel would copy the windows anyway, and autograd's ``unfold_backward`` (the
    gradient of overlapping views, a scatter) cost more than the window products themselves (8 % of a bf16 training
    step at 4k tokens). Here a window of ``s`` whole blocks is copied block by block, and its gradient is ``s``
    block-shifted additions.

    ``x`` ``(batch, (nb + s - 1) * b, heads, dim)``, ``extra`` ``(batch, G, heads, dim)`` or None ->
    ``(batch * nb, heads, G + s * b, dim)``, a view of a contiguous ``(heads, batch * nb, G + s * b, dim)``.
    """

    @staticmethod
    def forward(ctx, x, extra, b, s):  # noqa: D102
        batch, rows, heads, dim = x.shape
        nb, num_extra = rows // b - s + 1, 0 if extra is None else extra.shape[1]
        out = x.new_empty(heads, batch, nb, num_extra + s * b, dim)
        # Head-major first (one transposing copy), so that the s block copies move whole (b, dim) blocks.
        blocks = x.permute(2, 0, 1, 3).contiguous().view(heads, batch, rows // b, b, dim)
        for j in range(s):
            out[:, :, :, num_extra + j * b : num_extra + (j + 1) * b] = blocks[:, :, j : j + nb]
        if num_extra:
            out[:, :, :, :num_extra] = extra.permute(2, 0, 1, 3)[:, :, None]
        ctx.sizes = (batch, rows, heads, dim, nb, num_extra, b, s)
        return out.view(heads, batch * nb, num_extra + s * b, dim).transpose(0, 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        batch, rows, heads, dim, nb, num_extra, b, s = ctx.sizes
        grad = grad.transpose(0, 1).reshape(heads, batch, nb, num_extra + s * b, dim)
        summed = grad.new_zeros(heads, batch, rows // b, b, dim)
        for j in range(s):
            # add_ on the view (``+=`` on an index would also copy the view onto itself)
            summed[:, :, j : j + nb].add_(grad[:, :, :, num_extra + j * b : num_extra + (j + 1) * b])
        grad_x = summed.view(heads, batch, rows, dim).permute(1, 2, 0, 3)
        grad_extra = grad[:, :, :, :num_extra].sum(2).permute(1, 2, 0, 3) if num_extra else None
        return grad_x, grad_extra, None, None


def _globals_in_front(windows: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The global rows in front of every block's window: ``windows`` ``(batch, n, heads, span, dim)``, ``extra``
    ``(batch, G, heads, dim)`` or None -> ``(batch, n, heads, G + span, dim)`` (``windows`` itself for None)."""
    if extra is None:
        return windows
    batch, n, heads, _, dim = windows.shape
    return torch.cat([extra.transpose(1, 2)[:, None].expand(batch, n, heads, extra.shape[1], dim), windows], dim=3)


def _block_windows(x: torch.Tensor, span: int, b: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The ``span``-row key (or value) neighbourhood of every ``b``-query block, ``x`` ``(batch, nb * b + span - b,
    heads, dim)`` -> ``(batch * nb, heads, span, dim)``, with the ``extra`` ``(batch, G, heads, dim)`` global rows in
    front of every block's window (``G + span`` rows) when given.

    Views (:func:`_neighbourhoods`; the global rows are concatenated) in float32, in inference and while tracing;
    :class:`_BlockWindows` when a half-precision gradient is recorded and the window is whole blocks.
    """
    if (
        is_half_precision(x.dtype)
        and torch.is_grad_enabled()
        and x.requires_grad
        and span % b == 0
        and not is_tracing()
    ):
        return _BlockWindows.apply(x, extra, b, span // b)
    return _fold_blocks(_globals_in_front(_neighbourhoods(x, span, b).permute(0, 1, 3, 2, 4), extra))


def _fold_blocks(x: torch.Tensor) -> torch.Tensor:
    """The blocks of every example as one batch dimension: ``(batch, nb, *rest)`` -> ``(batch * nb, *rest)``.

    Eager mode reshapes (a view where the strides allow it; the overlapping key neighbourhoods of several examples are
    copied). While tracing, a reshape that merges a *static* batch size ``B`` with the block count ``nb = ceil(L / b)``
    of a symbolic length makes the tracer decide ``B % (B * nb) != 0`` (true for every ``nb >= 2``, but it cannot
    bound a floor division), which ``torch.export`` rejects as a guard on the length (with a dynamic batch the guard
    is on two symbols, which export does not check). So one static example is selected (a view, as in eager mode),
    and anything else is made contiguous and viewed through one flat dimension: flattening needs no check, and
    splitting the flat dimension only divisibility that the tracer proves. The same numbers either way.
    """
    if not torch.compiler.is_compiling():
        return x.reshape(-1, *x.shape[2:])
    if isinstance(x.shape[0], int) and x.shape[0] == 1:
        return x[0]
    return x.contiguous().view(-1).view(x.shape[0] * x.shape[1], *x.shape[2:])


def _block_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` ``(n, heads, rows, k)`` @ ``b`` ``(n, heads, k, cols)`` -> ``(n, heads, rows, cols)``, ``n = batch * nb``.

    ``torch.matmul`` merges ``n`` with ``heads`` for its batched product, the reshape :func:`_fold_blocks` describes
    (``nb % (heads * nb)`` for one example); while tracing both sides are folded first with its flat view.
    """
    if not torch.compiler.is_compiling():
        return torch.matmul(a, b)
    return torch.bmm(_fold_blocks(a), _fold_blocks(b)).view(*a.shape[:-1], b.shape[-1])


def _project_rows(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear`` applied to ``x`` ``(batch, n, hidden)`` -> ``(batch, n, out)``, where ``n`` is block-rounded.

    A 3-D input makes ``F.linear`` merge ``batch`` with ``n`` for its matrix product; with ``n = nb * b`` that is the
    reshape :func:`_fold_blocks` describes. While tracing the rows are folded to 2-D first, with the guard-free flat
    view; eager mode calls the module on ``x`` as it is (the same kernels, hence the same numbers, as before).
    """
    if not torch.compiler.is_compiling():
        return linear(x)
    return linear(_fold_blocks(x)).view(x.shape[0], x.shape[1], -1)


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


# Queries per chunk of Longformer's banded attention without gradients (:meth:`_chunked_banded_attention`): at base
# width the chunk's float32 scores are ~110 MB, and the chunks are still large enough to keep the products efficient.
LOCAL_CHUNK_TOKENS = 4096

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


# FlashAttention's variable-length kernel (torch >= 2.9; CUDA only): a packed row's documents in one call, each
# attending within itself, with a sliding window through ``window_size``. None where the installed torch lacks it.
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None

# The dtypes and head sizes FlashAttention's kernels take.
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256


def varlen_device(device: torch.device) -> bool:
    """Whether :data:`varlen_attn` exists and runs on ``device`` (a CUDA device)."""
    return varlen_attn is not None and torch.device(device).type == "cuda"


def varlen_boundaries(packed: PackedBatch, device: torch.device) -> tuple[torch.Tensor, int] | None:
    """``(cu_seq_lens, longest)`` for :data:`varlen_attn` when ``packed`` is one unpadded row (it then carries
    ``cu_seq_lens``) on a device where the kernel runs, else None. ``longest`` is the batch's ``max_length`` or, where
    a read is free (:func:`~hf_xformers.ops.input_checks.reads_values`: inference), read once; a training step whose
    batch does not say takes the banded path instead of a read."""
    if packed.cu_seq_lens is None or not varlen_device(device):
        return None
    longest = packed.longest
    if longest is None and reads_values(packed.cu_seq_lens):
        longest = packed.longest_document()
    return None if longest is None else (packed.cu_seq_lens, longest)


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


class HfxSlidingWindowSelfAttention(QKVProjection):
    """Sliding-window + global self-attention of one Longformer layer.

    ``attentions`` (with ``output_attentions=True``): ``(batch, heads, seq_len, G + 2w + 1)``, the first ``G``
    columns are the global keys (``G`` = most global tokens of any example; in a packed batch of several rows with the
    default first-token globals, the batch's number of documents, sized without a read), then relative offsets
    ``-w .. w``; the same layout as transformers' Longformer (rows of global tokens are zero there: their output comes
    from global attention). ``global_attentions``: ``(batch, heads, G, seq_len)``, the transpose of transformers' (rows
    of empty slots, in examples with fewer than ``G`` global tokens, are zero).
    """

    supports_global_attention = True

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads)
        window = config.attention_window
        window = window[layer_idx] if isinstance(window, (list, tuple)) else window
        self.one_sided_window = window // 2
        # Queries go in blocks smaller than the window: a block of b queries needs b + 2w keys, so quarter-window
        # blocks compute 2.25w keys per query instead of 3w (measured ~17% faster at w = 256 on CPU). Small
        # windows keep whole-window blocks, where per-block overhead would dominate.
        self.query_block = self.one_sided_window if self.one_sided_window < 64 else self.one_sided_window // 4
        hidden = config.hidden_size
        self.query_global = nn.Linear(hidden, hidden)
        self.key_global = nn.Linear(hidden, hidden)
        self.value_global = nn.Linear(hidden, hidden)
        self.dropout_p = config.attention_probs_dropout_prob
        # Read at every forward: config._attn_implementation ("eager", "sdpa", "flex_attention") may change.
        self.config = config

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        document_ids: torch.Tensor | None = None,
        layout: LongformerLayout | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> context ``(batch, seq_len, hidden)``.

        ``attention_mask`` None means no padding, ``global_attention_mask`` None no global token. ``document_ids``
        ``(batch, seq_len)`` long: the documents of a packed batch (:mod:`~hf_xformers.ops.packing`), each attended
        to as if alone; None: one document per row. ``layout``: :func:`longformer_layout`, which the model works out
        once per forward for all layers (the global tokens, their per-document layout, FlexAttention's block masks,
        the varlen boundaries); the layer then reads the global tokens from it and ignores
        ``global_attention_mask``. None (the module called on its own): worked out here for this layer.
        """
        implementation = attention_implementation(self.config, hidden_states.device)
        batch, length, hidden = hidden_states.shape
        if layout is None:  # called on its own, not through the model
            is_global = global_attention_mask
            if is_global is not None and attention_mask is not None:
                is_global = is_global & attention_mask
            windows = (self.one_sided_window,) if implementation == FLEX else ()
            layout = longformer_layout(
                attention_mask, is_global, length, hidden_states.device, (self.query_block,), windows, document_ids
            )
        # Up to five projections read the input (local and global query, key, value): cast it once under autocast.
        hidden_states = autocast_input(hidden_states)
        is_global, packed_globals = layout.is_global, layout.packed_globals
        global_idx, global_valid = layout.global_slots if is_global is not None else (None, None)

        # Up to one block's key span (b + 2w) the blocked computation does no less work than one dense call over
        # all keys, so short inputs take the dense call with the band as a mask: the same result at the speed
        # of full attention (no mask at all once the window covers the whole sequence). Traced graphs always
        # take the banded path: the same result, and no branch on the length.
        # "eager" (and output_attentions) take the explicit softmax of the banded path.
        eager = output_attentions or implementation == EAGER
        if not eager and implementation == SDPA and layout.varlen is not None and self._varlen_applies(hidden_states):
            context, probs = self._varlen_attention(hidden_states, *layout.varlen), None
        elif not eager and flex_applies(implementation, hidden_states, self.training, self.dropout_p):
            q, k, v = (split_heads(t, self.num_heads) for t in self.fused_qkv(hidden_states))
            block_mask = layout.flex_masks[self.one_sided_window]
            context, probs = merge_heads(flex_attention(q, k, v, block_mask=block_mask)), None
        elif not eager and not is_tracing() and length <= self.query_block + 2 * self.one_sided_window:
            context, probs = self._dense_attention(hidden_states, attention_mask, is_global, document_ids), None
        else:
            context, probs = self._banded_attention(
                hidden_states, attention_mask, is_global, global_idx, global_valid, eager, document_ids,
                packed_globals, output_attentions,
            )  # fmt: skip
            probs = probs if output_attentions else None
        if attention_mask is not None:
            # Padding queries give zeros, as in the reference implementation.
            context = context.masked_fill(~attention_mask[..., None], 0.0)

        global_probs = None
        if is_global is not None:
            global_context, global_probs = self._global_attention(
                hidden_states, attention_mask, global_idx, global_valid, eager, packed_globals, output_attentions
            )
            global_probs = global_probs if output_attentions else None
            # Written through an extra row that the empty slots point at (no boolean indexing: traceable).
            rows = torch.arange(batch, device=context.device)[:, None].expand_as(global_idx)
            target = torch.where(global_valid, global_idx, length)
            context = cut_to_length(F.pad(context, (0, 0, 0, 1)).index_put((rows, target), global_context), 1, length)
        elif self.training:
            # The global projections get no gradient when no token is global; DistributedDataParallel then
            # fails with "parameters that were not used". A zero-weighted term keeps them in the graph.
            unused = sum(
                p.sum() for m in (self.query_global, self.key_global, self.value_global) for p in m.parameters()
            )
            context = context + 0.0 * unused
        return AttentionOutput(context, probs, global_probs)

    def _varlen_applies(self, hidden_states: torch.Tensor) -> bool:
        """Whether :data:`varlen_attn` takes this layer's attention (the layout says the batch and device allow it):
        a dtype and head size FlashAttention takes, and no attention dropout (the kernel has none)."""
        return (
            hidden_states.dtype in VARLEN_DTYPES
            and self.head_dim % 8 == 0
            and self.head_dim <= VARLEN_MAX_HEAD_DIM
            and not (self.training and self.dropout_p > 0.0)
        )

    def _varlen_attention(self, hidden_states: torch.Tensor, cu_seq_lens: torch.Tensor, longest: int) -> torch.Tensor:
        """A packed row ``(1, seq_len, hidden)`` in one call of FlashAttention's varlen kernel over its documents
        (``cu_seq_lens`` ``(count + 1,)`` int32, ``longest`` the longest document): query ``i`` sees the keys ``j`` of
        its own document with ``|i - j| <= w``, i.e. ``window_size=(w, w)``. Returns ``(1, seq_len, hidden)``."""
        batch, length, hidden = hidden_states.shape
        w = self.one_sided_window
        q, k, v = (t.reshape(batch * length, self.num_heads, self.head_dim) for t in self.fused_qkv(hidden_states))
        out = varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, window_size=(w, w))
        return out.reshape(batch, length, hidden)

    def _dense_attention(self, hidden_states, attention_mask, is_global, document_ids=None) -> torch.Tensor:
        """Short inputs: one attention call over all keys, masked to the window and the global keys.

        A query sees the real keys within ``w`` of it and every global key (through the ordinary projections, as
        in the banded path); when ``w`` covers the whole sequence that is every real key. With ``document_ids``
        ``(batch, seq_len)`` only those of its own document (a ``(batch, seq_len, seq_len)`` mask, no larger than the
        scores of this path, which serves inputs within one block's key span).
        """
        heads, length, w = self.num_heads, hidden_states.shape[1], self.one_sided_window
        q, k, v = (split_heads(t, heads) for t in self.fused_qkv(hidden_states))
        mask = None  # nothing to mask: SDPA's unmasked kernel is the fastest (this path never runs traced)
        if length > w + 1:
            position = torch.arange(length, device=hidden_states.device)
            mask = ((position[None, :] - position[:, None]).abs() <= w)[None, None]
            if is_global is not None:
                mask = mask | is_global[:, None, None, :]
        if document_ids is not None:
            same = (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
            mask = same if mask is None else mask & same
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :] if mask is None else mask & attention_mask[:, None, None, :]
            # A query left with no key (padding far from any real token) sees everything; its output is zeroed later.
            mask = mask | ~mask.any(-1, keepdim=True)
        dropout = self.dropout_p if self.training else 0.0
        return merge_heads(attention(q, k, v, mask, dropout))

    def _banded_attention(
        self, hidden_states, attention_mask, is_global, global_idx, global_valid, output_attentions, document_ids=None,
        packed_globals=None, return_probs=True,
    ):  # fmt: skip
        """Sliding-window attention (plus global keys) computed block by block.

        Shapes inside: ``nb`` blocks of ``b`` queries (``b = self.query_block``); each block sees the
        ``span = b + 2w`` local keys around it and ``G`` global keys. ``document_ids`` ``(batch, seq_len)`` (a packed
        batch) masks every key of another document, in the same block layout; with global tokens
        (``packed_globals``) a block sees only the ``W`` global slots of the documents it touches instead of all
        ``G``. ``output_attentions`` selects the explicit softmax; ``return_probs`` False lets a packed batch with
        global tokens skip the band layout of the probabilities (nobody asked for them).
        """
        batch, length, hidden = hidden_states.shape
        heads, dim, w, b = self.num_heads, self.head_dim, self.one_sided_window, self.query_block
        nb = ceil_div(length, b)
        if is_tracing():
            # A traced graph is specialised on more than one query block: the tracer's contiguity checks of the block
            # views ask whether nb == 1, a guard that torch.export cannot turn into a bound on the length. Asked here
            # first as nb >= 2 (a guard, not a check: torch.compile retraces a single-block input), the bound is
            # what export suggests for a Dim that starts lower (min = b + 1).
            bool(nb >= 2)
        span = b + 2 * w
        # w rows of padding before and w (plus the tail to a whole block) after: every query block then has
        # its full neighbourhood, and the padded keys are masked below. Projecting the padding costs 2w rows,
        # cheaper than padding q, k and v separately.
        padded = F.pad(hidden_states, (0, 0, w, w + nb * b - length))
        k = self.key(padded).view(batch, nb * b + 2 * w, heads, dim)
        v = self.value(padded).view(batch, nb * b + 2 * w, heads, dim)
        q = _project_rows(self.query, padded[:, w : w + nb * b])

        # (batch * nb, heads, b, dim) queries and (batch * nb, heads, span, dim) keys/values: views of q, k and v,
        # except the overlapping key/value neighbourhoods of several examples (no single stride steps over both).
        qb = _fold_blocks(q.view(batch, nb, b, heads, dim).permute(0, 1, 3, 2, 4))
        # Global keys and values come in front of the windows (when there are any and the batch is not packed).
        gk = gv = None
        if is_global is not None and packed_globals is None:
            position = (global_idx + w)[..., None, None].expand(-1, -1, heads, dim)
            gk, gv = k.gather(1, position), v.gather(1, position)  # (batch, G, heads, dim)
        # Inference over more blocks than one chunk: the blocks go through attention a chunk at a time
        # (:meth:`_chunked_banded_attention`), so that neither the windows nor the scores exist for all blocks at once.
        chunked = (
            not output_attentions and packed_globals is None and not is_tracing() and nb > LOCAL_CHUNK_TOKENS // b
            and not (torch.is_grad_enabled() and hidden_states.requires_grad)
        )  # fmt: skip
        if not chunked:
            kb, vb = _block_windows(k, span, b, gk), _block_windows(v, span, b, gv)

        # Additive mask, 0 where a query may look and -inf elsewhere: a band |offset| <= w (key column c of
        # block-local query row r sits at offset c - w - r) and real, non-global local keys (global keys come
        # in through the global slots instead). Built in two broadcast adds: it is rebuilt in every layer and
        # is as large as the score matrix, so every extra pass over it shows in the timings.
        real = (
            attention_mask if attention_mask is not None else torch.ones_like(hidden_states[..., 0], dtype=torch.bool)
        )
        local_key = real if is_global is None else real & ~is_global
        local_key = F.pad(local_key, (w, w + nb * b - length), value=False)
        neg_inf = torch.tensor(float("-inf"), dtype=qb.dtype, device=qb.device)
        key_bias = _fold_blocks(torch.where(_neighbourhoods(local_key, span, b), 0.0, neg_inf)[:, :, None, None])
        offset = torch.arange(span, device=qb.device)[None, :] - w - torch.arange(b, device=qb.device)[:, None]
        bias = key_bias + torch.where(offset.abs() <= w, 0.0, neg_inf)
        query_docs = None
        if document_ids is not None:
            # The key neighbourhoods' documents, unfolded exactly as the keys are: (batch, nb, span) against the
            # (batch, nb, b) queries' (the padding, -1, is masked as padding already).
            docs = F.pad(document_ids, (w, w + nb * b - length), value=-1)
            query_docs = docs[:, w : w + nb * b].view(batch, nb, b)
            same = query_docs[..., None] == _neighbourhoods(docs, span, b)[:, :, None, :]
            bias = bias.masked_fill(~_fold_blocks(same[:, :, None]), float("-inf"))
        # A padding query can be left with no key at all (NaN); let it see its whole neighbourhood instead,
        # its output is zeroed later. A packed batch always does it, whatever its length (one more operator when the
        # length is a multiple of the block), so that its step launches the same kernels for every row length.
        query_pad = _fold_blocks(~F.pad(real, (0, nb * b - length), value=False).view(batch, nb, 1, b, 1))
        if attention_mask is not None or document_ids is not None or is_tracing() or nb * b != length:
            bias.masked_fill_(query_pad, 0.0)

        num_global = 0
        if packed_globals is not None:
            return self._packed_banded_attention(
                qb, kb, vb, bias, query_docs, query_pad, k, v, is_global, global_idx, packed_globals,
                output_attentions, return_probs, length,
            )  # fmt: skip
        global_bias = None  # (batch, nb, 1, b, G): the global columns of the bias
        if is_global is not None:
            num_global = global_idx.shape[1]
            global_bias = torch.where(global_valid, 0.0, neg_inf)[:, None, None, None, :].expand(-1, nb, 1, b, -1)
        if chunked:
            out = self._chunked_banded_attention(q, k, v, bias.view(batch, nb, 1, b, span), gk, gv, global_bias)
            return unblock(out.transpose(2, 3), length).reshape(batch, length, hidden), None
        if global_bias is not None:
            bias = torch.cat([_fold_blocks(global_bias), bias], -1)

        dropout = self.dropout_p if self.training else 0.0
        probs = None
        if not output_attentions:
            out = attention(qb, kb, vb, bias, dropout)
        else:
            scores = _block_matmul(qb, kb.transpose(-1, -2)) * dim**-0.5 + bias
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).masked_fill(query_pad, 0.0).to(q.dtype)
            probs = self._to_band_layout(weights, batch, nb, num_global, length)
            if is_global is not None:
                # A global token's local row is not used (its output comes from global attention): zero it.
                probs = probs.masked_fill(is_global[:, None, :, None], 0.0)
            # The context is computed from the returned band probabilities (so that they are part of the autograd
            # graph): offset o of query t is padded key row t + w + o, i.e. window t .. t + 2w of the padded keys.
            band = F.dropout(probs, dropout, self.training)
            local_v = cut_to_length(v.unfold(1, 2 * w + 1, 1), 1, length)  # (batch, length, heads, dim, 2w + 1)
            out = torch.einsum("bhlj,blhdj->blhd", band[..., num_global:], local_v)
            if num_global:
                global_v = v.gather(1, (global_idx + w)[..., None, None].expand(-1, -1, heads, dim))  # (b, G, h, d)
                out = out + torch.einsum("bhlg,bghd->blhd", band[..., :num_global], global_v)
            return out.reshape(batch, length, hidden), probs
        out = out.view(batch, nb, heads, b, dim).transpose(2, 3)  # (batch, nb, b, heads, dim)
        return unblock(out, length).reshape(batch, length, hidden), probs

    def _chunked_banded_attention(self, q, k, v, bias, gk, gv, global_bias) -> torch.Tensor:
        """:meth:`_banded_attention` without gradients, ``LOCAL_CHUNK_TOKENS`` queries at a time: the key windows
        (with the global keys in front) and the scores of one chunk of blocks exist at once, not of all ``nb``
        (128k tokens at base width: 3.6 GB of float32 scores and 1.8 GB of windows per tensor otherwise). The same
        numbers: every block is its own attention problem. In training mode (a forward under ``no_grad``, e.g. Monte
        Carlo dropout) each chunk drops attention probabilities as the one-pass computation does.

        ``q`` ``(batch, nb * b, heads * dim)``; ``k`` / ``v`` ``(batch, nb * b + 2w, heads, dim)``; ``bias``
        ``(batch, nb, 1, b, span)``; ``gk`` / ``gv`` ``(batch, G, heads, dim)`` and ``global_bias``
        ``(batch, nb, 1, b, G)``, or None. Returns ``(batch, nb, heads, b, dim)``.
        """
        heads, dim, b = self.num_heads, self.head_dim, self.query_block
        batch, nb, span = bias.shape[0], bias.shape[1], bias.shape[-1]
        queries = q.view(batch, nb, b, heads, dim).permute(0, 1, 3, 2, 4)  # (batch, nb, heads, b, dim)
        keys = _neighbourhoods(k, span, b).permute(0, 1, 3, 2, 4)  # (batch, nb, heads, span, dim) views
        values = _neighbourhoods(v, span, b).permute(0, 1, 3, 2, 4)
        out = q.new_empty(batch, nb, heads, b, dim)
        step = max(1, LOCAL_CHUNK_TOKENS // b)
        dropout = self.dropout_p if self.training else 0.0
        for first in range(0, nb, step):
            blocks = slice(first, min(first + step, nb))
            n = blocks.stop - first
            kc, vc = _globals_in_front(keys[:, blocks], gk), _globals_in_front(values[:, blocks], gv)
            bc = bias[:, blocks] if global_bias is None else torch.cat([global_bias[:, blocks], bias[:, blocks]], -1)
            fold = (batch * n, heads)
            context = attention(
                queries[:, blocks].reshape(*fold, b, dim), kc.reshape(*fold, -1, dim), vc.reshape(*fold, -1, dim),
                bc.reshape(batch * n, 1, b, -1), dropout,
            )  # fmt: skip
            out[:, blocks] = context.view(batch, n, heads, b, dim)
        return out

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
        gk = _fold_blocks(k.gather(1, position).view(batch, nb, width, heads, dim).transpose(2, 3))
        gv = _fold_blocks(global_v.transpose(2, 3))
        slot_docs = packed_globals.slot_docs.gather(1, slots).view(batch, nb, 1, width)
        # Padding queries (document -1) see no global key; the local bias has let them see their neighbourhood.
        same = (query_docs[..., None] == slot_docs) & inside[:, :, None, :]  # (batch, nb, b, W)
        global_bias = torch.where(same, 0.0, float("-inf")).to(bias.dtype)
        bias = torch.cat([_fold_blocks(global_bias[:, :, None]), bias], -1)
        kb, vb = torch.cat([gk, kb], dim=2), torch.cat([gv, vb], dim=2)
        dropout = self.dropout_p if self.training else 0.0
        if not explicit:
            out = attention(qb, kb, vb, bias, dropout)
        else:
            scores = _block_matmul(qb, kb.transpose(-1, -2)) * dim**-0.5 + bias
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).masked_fill(query_pad, 0.0).to(qb.dtype)
            if return_probs:
                return self._packed_probs_and_context(
                    weights, v, global_v, is_global, slots, inside, num_global, length
                )
            out = _block_matmul(F.dropout(weights, dropout, self.training), vb)
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

    def _to_band_layout(self, weights, batch, nb, num_global, length) -> torch.Tensor:
        """``(batch * nb, heads, b, G + span)`` block weights -> ``(batch, heads, length, G + 2w + 1)``."""
        w, b, heads = self.one_sided_window, self.query_block, self.num_heads
        # Row r keeps local columns r .. r + 2w, i.e. offsets -w .. w.
        cols = torch.arange(b, device=weights.device)[:, None] + torch.arange(2 * w + 1, device=weights.device)
        band = weights[..., num_global:].gather(-1, cols.expand(batch * nb, heads, b, 2 * w + 1))
        both = torch.cat([weights[..., :num_global], band], dim=-1)
        return unblock(both.view(batch, nb, heads, b, -1).transpose(2, 3), length).transpose(1, 2)

    def _global_attention(
        self, hidden_states, attention_mask, global_idx, global_valid, output_attentions, packed_globals=None,
        return_probs=True,
    ):  # fmt: skip
        """Global queries attend to every real token (of their own document, given ``packed_globals``) through the
        global projections.

        Returns ``(batch, G, hidden)`` contexts and, if asked, ``(batch, heads, G, seq_len)`` probabilities
        (``output_attentions`` selects the explicit softmax; ``return_probs`` False lets a packed batch skip the
        ``(G, seq_len)`` layout).
        """
        picked = hidden_states.gather(1, global_idx[..., None].expand(-1, -1, hidden_states.shape[-1]))
        if packed_globals is not None:
            return self._packed_global_attention(
                hidden_states, attention_mask, picked, global_valid, output_attentions, packed_globals, return_probs
            )
        q = split_heads(self.query_global(picked), self.num_heads)
        k = split_heads(self.key_global(hidden_states), self.num_heads)
        v = split_heads(self.value_global(hidden_states), self.num_heads)
        mask = None  # no padding: every slot sees every key
        if attention_mask is not None:
            # Empty slots (examples with fewer globals) may look at everything; their output is dropped.
            mask = (attention_mask[:, None, :] | ~global_valid[:, :, None])[:, None]
        dropout = self.dropout_p if self.training else 0.0
        if not output_attentions:
            return merge_heads(attention(q, k, v, mask, dropout)), None
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = probs.masked_fill(~global_valid[:, None, :, None], 0.0)
        out = torch.matmul(F.dropout(probs, dropout, self.training), v)
        return merge_heads(out), probs

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
        batch, length, hidden = hidden_states.shape
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
