"""Where the documents of a packed batch meet BigBird's blocks: the block-aligned layout packed block-sparse
attention runs on (:mod:`~hf_xformers.attention.block_sparse_packed`).

Every document gets exactly the pattern of its own forward. Each one is laid out on whole blocks of its own
(:func:`plan_documents`): a document of ``n`` tokens (up to its last real one) takes ``ceil(n / b)`` blocks, the rest
of its last block is a masked gap, and the documents of every row are laid end to end in one block-aligned sequence.
Its first and last blocks are its global blocks, its window blocks stay inside it, and its random blocks are row
``ceil(n / b)`` of the seeded table (the blocks its own forward draws), offset to where it starts. The layout's sizes
are bounds computed from host ints only (the number of documents, the longest one, the row's length and ``b``; the
collator's ``cu_seq_lens`` + ``max_length`` carry them), never read from the tensors: no host read, the same
operators whatever the documents, and one traced graph for every batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops.input_checks import is_tracing, reads_values
from ..ops.packing import flat_document_index, positions_in_documents
from ..ops.shapes import ceil_div


class DocumentBlocks(NamedTuple):
    """Where the documents of a packed batch meet the blocks; built once per forward by :func:`plan_documents`.

    A document's extent is its tokens up to its last real (non-padding) one, its own forward's length; padding after
    it lies in no block. The token fields always exist; the block-aligned layout (``num_blocks`` and after) exists
    when the number of documents and the longest one are known as host ints (the batch carries them: ``cu_seq_lens``
    + ``max_length``; in eager mode they are read once otherwise), None in a traced graph that lacks them.

    Every size of the layout is a function of those host ints alone, never of the tensors' values: ``nb`` is the most
    blocks ``count`` documents can take in ``batch * seq_len`` tokens (``ceil(n / b)`` each, so at most ``(batch *
    seq_len + count * (b - 1)) // b``); blocks past the ones the documents take are *spare*: each one attends to its
    own block only and its results are dropped. So the layout costs no host read, and a traced graph with symbolic
    lengths and counts keeps one graph for every batch.
    """

    document: torch.Tensor
    """``(batch, seq_len)`` long: each token's document, numbered across the batch."""
    position: torch.Tensor
    """``(batch, seq_len)`` long: each token's position inside its document."""
    count: torch.Tensor
    """``(batch, seq_len)`` long: the number of blocks of each token's document (``ceil(extent / b)``)."""
    inside: torch.Tensor
    """``(batch, seq_len)`` bool: the token lies within its document's extent."""
    num_blocks: int | None = None
    """``nb``: blocks of the aligned layout, every document of every row end to end, then the spare blocks."""
    max_count: int | None = None
    """``ceil(longest / b)``: the most blocks of any document (a bound: the batch's ``max_length``)."""
    token_slot: torch.Tensor | None = None
    """``(batch * seq_len,)`` long: each token's place in the aligned layout; ``nb * b`` (no place) outside extents."""
    slot_token: torch.Tensor | None = None
    """``(nb * b,)`` long: the token at each place of the layout (0 in the gaps and spare blocks, which are masked
    or dropped)."""
    slot_key: torch.Tensor | None = None
    """``(nb * b,)`` bool: places that may be attended to: real tokens, and every place of a spare block (so that no
    query row is left without a key; only spare blocks see spare blocks)."""
    block_doc: torch.Tensor | None = None
    """``(nb,)`` long: the document of each block (spare blocks: ``-1 - block``, a document of their own)."""
    block_first: torch.Tensor | None = None
    """``(nb,)`` long: the first block of each block's document (spare blocks: themselves)."""
    block_count: torch.Tensor | None = None
    """``(nb,)`` long: the number of blocks of each block's document (spare blocks: 1)."""
    sparse_slots: torch.Tensor | None = None
    """``(nb, s)`` long, ``s = 5 + r``: each query block's key blocks, ``[first, last, i - 1, i, i + 1, (random)]``
    for the blocks of long documents (more than ``r + 4`` blocks; the random slots are filled per layer), the
    document's blocks in order for short ones (whose pattern is complete: their whole document)."""
    sparse_ok: torch.Tensor | None = None
    """``(nb, s)`` bool: which of those slots count (each block once)."""
    sparse_random: torch.Tensor | None = None
    """``(nb,)`` bool: rows whose last ``r`` slots take random blocks (middle blocks of long documents)."""
    is_global: torch.Tensor | None = None
    """``(nb,)`` bool: the global query blocks of long documents (first and last), which attend to their whole
    document: their rows come from the chunks below, not from ``sparse_slots``."""
    chunk_query: torch.Tensor | None = None
    """``(p,)`` long: the global query block of each chunk row. A long document of ``c`` blocks has ``ceil(c / s)``
    chunks of ``s`` key blocks, each attended by both its global blocks (``2 ceil(c / s)`` rows); the rows of all
    documents lie end to end, ``p`` a bound from the host ints (``<= 4 nb / s + 2``)."""
    chunk_keys: torch.Tensor | None = None
    """``(p, s)`` long: the key blocks of each chunk row (clamped to the layout)."""
    chunk_key_ok: torch.Tensor | None = None
    """``(p, s * b)`` bool: keys of each chunk row that may be attended to (inside the document and real)."""
    chunk_target: torch.Tensor | None = None
    """``(p,)`` long: where each chunk row's result goes: its global query block, ``nb`` (dropped) for unused rows."""
    block_table: torch.Tensor | None = None
    """``(nb, nb)`` bool: the pattern's blocks that every layer shares (same document, and global or window), for
    FlexAttention; built once per forward by the model (:func:`document_block_table`), each layer adds its random
    blocks."""
    spans: tuple[tuple[int, int], ...] | None = None
    """The ``(start, end)`` of every document of a single unpadded row in host memory
    (:meth:`~hf_xformers.ops.packing.PackedBatch.host_spans`), or None. Given (then alone: the CPU in eager mode,
    the ``"sdpa"`` choice), each document runs through the layer's own unpacked forward: on the CPU the aligned layout's
    gathers and chunk merges cost about 1.6x the documents' own forwards (the packing benchmark's sizes), and a loop
    launches nothing."""


def check_batch_sizes(count: int | None, longest: int | None, actual_count: int, actual_longest: int) -> None:
    """Raise a ``ValueError`` where the batch's ``count`` documents of at most ``longest`` tokens (None: not said)
    disagree with what its boundaries hold."""
    if count is not None and actual_count != count or longest is not None and actual_longest > longest:
        raise ValueError(
            f"The packed batch says {count} documents of at most {longest} tokens, but its boundaries hold "
            f"{actual_count} of up to {actual_longest}; pass the collator's `cu_seq_lens_q/k` and `max_length_q/k` "
            "unchanged (DataCollatorWithFlattening(return_flash_attn_kwargs=True))."
        )


def plan_documents(
    document_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    block_size: int,
    num_random_blocks: int,
    count: int | None = None,
    longest: int | None = None,
) -> DocumentBlocks:
    """The block layout of a packed batch (see :class:`DocumentBlocks`): scans, scatters and gathers over the tokens
    and blocks, no atomics on the tokens (a scatter-reduce by document would serialise on long documents), a number of
    operators independent of the number of documents, and no host read when ``count`` and ``longest`` are given.

    Args:
        document_ids: ``(batch, seq_len)`` long, documents numbered from 0 in each row (``ops/packing.py``).
        attention_mask: ``(batch, seq_len)`` bool, True for real tokens, or None (nothing padded).
        block_size, num_random_blocks: the layer's ``b`` and ``r``.
        count: the number of real documents (runs with a real token), or None: read once in eager mode (a traced
            graph then gets the token fields only).
        longest: the longest document's length in tokens (at least the longest extent), or None: read as ``count``.

    Raises:
        ValueError: ``count`` or ``longest`` that disagree with the documents (checked where the read is free,
            :func:`~hf_xformers.ops.input_checks.reads_values`).
    """
    b, r = block_size, num_random_blocks
    tokens, extents = _document_extents(document_ids, attention_mask, b)
    sizes = _layout_sizes(document_ids, extents, b, r, count, longest)
    if sizes is None:
        return tokens
    num_blocks, max_count, num_starts = sizes
    token_slot, slot_token, slot_key, block_doc, block_first, block_count = _block_placement(extents, num_blocks, b)
    blocks = torch.arange(num_blocks, device=document_ids.device)
    local = blocks - block_first
    last = block_first + block_count - 1
    short = block_count <= r + 4
    is_global = ~short & ((local == 0) | (blocks == last))
    sparse_slots, sparse_ok = _key_block_slots(blocks, block_first, block_count, short, r)
    chunk_query, chunk_keys, chunk_key_ok, chunk_target = _global_chunk_rows(
        blocks, block_first, block_count, short, slot_key, num_starts, b, r
    )
    return tokens._replace(
        num_blocks=num_blocks, max_count=max_count, token_slot=token_slot, slot_token=slot_token, slot_key=slot_key,
        block_doc=block_doc, block_first=block_first, block_count=block_count, sparse_slots=sparse_slots,
        sparse_ok=sparse_ok, sparse_random=~short & ~is_global, is_global=is_global, chunk_query=chunk_query,
        chunk_keys=chunk_keys, chunk_key_ok=chunk_key_ok, chunk_target=chunk_target,
    )  # fmt: skip


class _Extents(NamedTuple):
    """Every token of a packed batch, flattened to ``(batch * seq_len,)``."""

    document: torch.Tensor
    """long: the token's document, numbered across the batch."""
    position: torch.Tensor
    """long: its position inside its document."""
    real: torch.Tensor
    """bool: not padding."""
    is_end: torch.Tensor
    """bool: the last token of its document."""
    extent: torch.Tensor
    """long: its document's extent (tokens up to the last real one)."""
    blocks: torch.Tensor
    """long: its document's number of blocks, ``ceil(extent / b)``."""


def _document_extents(
    document_ids: torch.Tensor, attention_mask: torch.Tensor | None, b: int
) -> tuple[DocumentBlocks, _Extents]:
    """The token fields of :class:`DocumentBlocks`, and the flat :class:`_Extents` the layout is built from."""
    batch, length = document_ids.shape
    n = batch * length
    document = flat_document_index(document_ids)
    position = positions_in_documents(document_ids)
    real = torch.ones_like(document_ids, dtype=torch.bool) if attention_mask is None else attention_mask
    doc, pos, real_flat = document.reshape(-1), position.reshape(-1), real.reshape(-1)
    index = torch.arange(n, device=document_ids.device)
    is_end = torch.ones_like(real_flat)
    is_end[:-1] = doc[1:] != doc[:-1]
    # Each token's document end, the last real token up to there, and so the document's extent.
    end = torch.where(is_end, index, n).flip(0).cummin(0).values.flip(0)
    last_real = torch.where(real_flat, index, -1).cummax(0).values[end]
    seen = last_real.clamp(min=0)
    extent = torch.where((last_real >= 0) & (doc[seen] == doc), pos[seen] + 1, 0)
    blocks_of = ceil_div(extent, b)
    inside = pos < extent
    tokens = DocumentBlocks(document, position, blocks_of.view(batch, length), inside.view(batch, length))
    return tokens, _Extents(doc, pos, real_flat, is_end, extent, blocks_of)


def _layout_sizes(
    document_ids: torch.Tensor, extents: _Extents, b: int, r: int, count: int | None, longest: int | None
) -> tuple[int, int, int] | None:
    """The host-int sizes of the layout, ``(num_blocks, max_count, num_starts)`` (``num_starts``: chunk starts of the
    global rows, :func:`_global_chunk_rows`), from ``count`` and ``longest`` (read once in eager mode where missing
    or where reading is free, to check them); None in a traced graph that lacks ``count``."""
    s = 5 + r
    batch, length = document_ids.shape
    if is_tracing():
        if count is None:
            return None
        if longest is None:
            longest = length  # a bound: no document is longer than its row
    elif count is None or longest is None or reads_values(document_ids):
        # Eager only: the one read when the batch did not say, else a check where reading costs no wait.
        actual_count, actual_longest = torch.stack(
            [(extents.is_end & (extents.extent > 0)).sum(), extents.extent.max()]
        ).tolist()
        check_batch_sizes(count, longest, actual_count, actual_longest)
        count = actual_count if count is None else count
        longest = actual_longest if longest is None else longest
    num_blocks = (batch * length + count * (b - 1)) // b
    max_count = ceil_div(longest, b)
    # Chunk starts: a long document (at least s blocks, so at most nb // s of them) of c blocks has ceil(c / s) <= c / s
    # + 1 of them, and at most ceil(max_count / s); the sum over documents is at most nb // s + (number of long
    # documents) <= 2 (nb // s). Two more, so that the chunk rows are never empty and never one (a traced graph would
    # specialise on a size of 1: batches without long documents would compile a graph of their own).
    if not is_tracing():
        # Concrete sizes (eager mode): the tighter bound, none at all when no document can be long.
        long_docs = min(count, num_blocks // s) if max_count >= s else 0
        num_starts = min(num_blocks // s + long_docs, long_docs * ceil_div(max_count, s)) + 2
    else:
        # Traced graphs (symbolic sizes): plain arithmetic. A minimum of them, or a branch on them, would pin the graph
        # to the longest document's block count (guards, also in the compiled-graph cache: a recompile for others).
        num_starts = 2 * (num_blocks // s) + 2
    return num_blocks, max_count, num_starts


def _block_placement(
    extents: _Extents, num_blocks: int, b: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every document on whole blocks of its own: ``token_slot``, ``slot_token``, ``slot_key``, ``block_doc``,
    ``block_first`` and ``block_count`` of :class:`DocumentBlocks`."""
    device = extents.document.device
    index = torch.arange(extents.document.shape[0], device=device)
    end_count = torch.where(extents.is_end, extents.blocks, 0)  # each document's block count, once
    first = torch.cumsum(end_count, 0) - end_count  # the first block of each token's document
    slots = num_blocks * b
    token_slot = torch.where(extents.position < extents.extent, first * b + extents.position, slots)
    # Tokens outside every extent all land on the extra place `slots`, which is cut off.
    slot_token = torch.zeros(slots + 1, dtype=torch.long, device=device).scatter(0, token_slot, index)[:slots]
    slot_real = torch.zeros(slots + 1, dtype=torch.bool, device=device).scatter(0, token_slot, extents.real)[:slots]
    blocks = torch.arange(num_blocks, device=device)
    used = blocks < end_count.sum()  # the documents' blocks come first, the spare ones after
    slot_key = slot_real | ~used[:, None].expand(num_blocks, b).reshape(-1)
    # Every used block starts with a token of its document (a document's blocks end with its extent).
    head = slot_token.view(num_blocks, b)[:, 0]
    block_doc = torch.where(used, extents.document[head], -1 - blocks)
    block_first = torch.where(used, first[head], blocks)
    block_count = torch.where(used, extents.blocks[head], 1)
    return token_slot, slot_token, slot_key, block_doc, block_first, block_count


def _key_block_slots(
    blocks: torch.Tensor, block_first: torch.Tensor, block_count: torch.Tensor, short: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_slots`` and ``sparse_ok`` of :class:`DocumentBlocks`, ``(nb, 5 + r)`` each, for the blocks ``blocks``
    ``(nb,)`` of documents starting at ``block_first`` with ``block_count`` blocks (``short``: at most ``r + 4``)."""
    device = blocks.device
    num_blocks = blocks.shape[0]
    local = blocks - block_first
    last = block_first + block_count - 1
    slot = torch.arange(5 + r, device=device)
    window = local[:, None] + torch.arange(-1, 2, device=device)
    middle_slots = torch.cat(
        [
            torch.stack([block_first, last], -1),
            block_first[:, None] + window,
            block_first[:, None].expand(-1, r),
        ],
        dim=-1,
    )
    # A slot counts once: the window only strictly between the document's global blocks.
    middle_ok = torch.cat(
        [
            torch.ones(num_blocks, 2, dtype=torch.bool, device=device),
            (window > 0) & (window < (block_count - 1)[:, None]),
            torch.zeros(num_blocks, r, dtype=torch.bool, device=device),
        ],
        dim=-1,
    )
    sparse_slots = torch.where(short[:, None], block_first[:, None] + slot, middle_slots)
    sparse_slots = torch.minimum(sparse_slots.clamp(min=0), blocks[-1:])  # the global rows' window may leave the layout
    sparse_ok = torch.where(short[:, None], slot < block_count[:, None], middle_ok)
    return sparse_slots, sparse_ok


def _global_chunk_rows(
    blocks: torch.Tensor,
    block_first: torch.Tensor,
    block_count: torch.Tensor,
    short: torch.Tensor,
    slot_key: torch.Tensor,
    num_starts: int,
    b: int,
    r: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk_query``, ``chunk_keys``, ``chunk_key_ok`` and ``chunk_target`` of :class:`DocumentBlocks`: the rows in
    which the global blocks of long documents attend to their whole document, ``s = 5 + r`` key blocks at a time."""
    s = 5 + r
    num_blocks, device = blocks.shape[0], blocks.device
    local = blocks - block_first
    slot = torch.arange(s, device=device)
    # Chunk rows of the global blocks: the chunk starts compacted by a prefix sum (no host read), unused rows after.
    is_start = ~short & (local % s == 0)
    where_to = torch.where(is_start, torch.cumsum(is_start, 0) - 1, num_starts)
    start = torch.full((num_starts + 1,), -1, dtype=torch.long, device=device).scatter(0, where_to, blocks)
    start = start[:num_starts]
    valid = start >= 0
    start = start.clamp(min=0)
    doc_first = block_first[start]
    doc_last = doc_first + block_count[start] - 1
    keys = start[:, None] + slot  # (starts, s)
    in_document = valid[:, None] & (keys <= doc_last[:, None])
    keys = torch.minimum(keys, blocks[-1:])
    key_ok = in_document[..., None] & slot_key.view(num_blocks, b)[keys]  # (starts, s, b)
    # Unused rows see every key of their (clamped) blocks: finite numbers, all dropped.
    key_ok = key_ok | ~valid[:, None, None]
    chunk_query = torch.stack([doc_first, doc_last], -1).reshape(-1)
    chunk_target = torch.where(valid[:, None], torch.stack([doc_first, doc_last], -1), num_blocks).reshape(-1)
    # Stacked (a copy whatever the sizes: the same operators for every batch), each start's two rows side by side.
    chunk_keys = torch.stack([keys, keys], 1).view(2 * num_starts, s)
    chunk_key_ok = torch.stack([key_ok, key_ok], 1).view(2 * num_starts, s * b)
    return chunk_query, chunk_keys, chunk_key_ok, chunk_target
