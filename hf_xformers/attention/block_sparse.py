"""BigBird attention: block-sparse (ITC) self-attention, its dense masked oracle, and ``original_full``.

Semantics (Zaheer et al., 2020, "ITC" variant, as in transformers' ``BigBirdModel``). The sequence is cut into
blocks of ``b = config.block_size`` tokens. For one example let ``last`` be the block that holds its last real
(non-padding) token, so its blocks are ``0 .. last``:

* query blocks ``0`` and ``last`` are *global*: they attend to every real key;
* key blocks ``0`` and ``last`` are global too: every query attends to them;
* every other query block ``i`` also attends to its window ``i - 1, i, i + 1`` and to ``r =
  config.num_random_blocks`` *random* key blocks, drawn without replacement among ``1 .. last - 1`` minus the
  window (different draws per head and per query block);
* padding keys are never attended to; padding queries give zeros;
* no dropout on the attention probabilities (``attention_probs_dropout_prob`` applies to ``original_full`` only),
  as in the original implementation and transformers' block-sparse kernel; hidden-state dropout is unchanged.

Short inputs: when a row has fewer than ``r`` blocks left to draw from, it takes all of them, so once ``last <= r +
3`` the pattern covers every key and the result IS full attention. Inputs of at most ``r + 4`` blocks therefore go
through one full-attention SDPA call (padding queries zeroed), which is the same result at the speed of full
attention. A little longer (up to 8 blocks at ``r = 3``, see ``dense_is_cheaper``) the pattern is sparse, but
full attention under the pattern as a mask costs no more block products than the blocked path and needs no
gathers: one SDPA call with an additive mask, the same result. The blocked path computes both more slowly, and is
what traced graphs use; ``output_attentions`` uses the dense oracle. (transformers switches to full attention
below ``(5 + 2r) * b`` tokens, where its pattern is *not* yet complete, so its outputs change at that length; ours
do not.)
Defining ``last`` per example (not from the padded batch length) makes outputs independent of how much
padding the batch adds. Lengths need not be a multiple of ``b``: the layer pads internally and cuts back.

Random blocks: ``random_blocks(num_blocks)`` draws from a generator seeded by ``config.random_seed``, the layer
index and the number of blocks, so in eval mode every call, every process and every reload of a checkpoint
gives the same pattern (looked up in ``random_block_table``, drawn once on the CPU: the same on every device). In
training mode they are redrawn at every call from the global RNG of the input's device (:meth:`_drawn_blocks`;
reproducible with ``torch.manual_seed``, and replayed exactly by activation checkpointing, which restores that RNG), unless
``config.fixed_random_blocks`` keeps the seeded eval pattern. (transformers' kernel, in eval mode, points every
random block at block 0 instead; see the model card.)

How the fast path computes it: the middle query blocks go through one batched call of PyTorch's fused
``scaled_dot_product_attention``; each query block gets its ``5 + r`` key blocks (two global, three window, ``r``
random) gathered in one indexing step, with an additive ``0 / -inf`` mask for padding keys and for slots that
repeat a block already present (the window of block 1 contains global block 0). The two global query blocks of
every example take a second, dense SDPA call over all keys. Cost is linear in the length. ``dense_reference``
applies exactly the same pattern as a ``(seq, seq)`` mask to ordinary attention: the test oracle, and the path
used for ``output_attentions``.

Packed batches (``document_ids``, see ``ops/packing.py``): every document gets exactly the pattern of its own forward.
Each one is laid out on whole blocks of its own (:func:`plan_documents`): a document of ``n`` tokens (up to its last
real one) takes ``ceil(n / b)`` blocks, the rest of its last block is a masked gap, and the documents of every row are
laid end to end in one block-aligned sequence. Its first and last blocks are its global blocks, its window blocks stay
inside it, and its random blocks are row ``ceil(n / b)`` of the seeded table (the blocks its own forward draws),
offset to where it starts. The layout's sizes are bounds computed from host ints only (the number of documents, the
longest one, the row's length and ``b``; the collator's ``cu_seq_lens`` + ``max_length`` carry them), never read from
the tensors: no host read, the same operators whatever the documents, and one traced graph for every batch. The fast
path runs on that layout: every query block through one gathered SDPA call over its ``5 + r`` key blocks as above
(the blocks of a document of at most ``r + 4`` blocks take their whole document: its own forward's dense fallback),
and the global blocks of long documents over their whole document in chunks of ``5 + r`` key blocks, the chunks merged
by their softmax normalisers; cost linear in the number of blocks, nothing proportional to (documents x length).
``"flex_attention"`` uses the same layout, one call per layer over all of it, with the block table of its blocks
(``nb x nb``, as a single sequence of that length): the part every layer shares built once per forward by the model,
each layer adding its random blocks. ``"eager"`` and ``output_attentions`` apply the pattern as a ``(seq, seq)`` mask
over the packed row (quadratic, as for a single sequence), which is also the path a traced graph takes for packed
input that does not carry the number of documents and the longest one (``seq_idx`` or ``position_ids`` only).
``original_full`` masks the keys of other documents. Training draws fresh random blocks per document, so only with
``fixed_random_blocks`` (or documents of at most ``r + 4`` blocks) does a training forward equal the document's own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops.attention_switch import (
    EAGER,
    attention_implementation,
    block_mask_from_tables,
    eager_attention,
    flex_applies,
    flex_attention,
)
from ..ops.input_checks import is_tracing, reads_values
from ..ops.kernels import attention
from ..ops.packing import flat_document_index, positions_in_documents, same_document
from ..ops.shapes import ceil_div, cut_to_length, merge_heads, split_heads, unblock
from .base import AttentionOutput
from .full import HfxFullSelfAttention


class BlockPlan(NamedTuple):
    """Where the blocks of a (padded) batch are; built by :meth:`HfxBlockSparseSelfAttention.plan`."""

    key_mask: torch.Tensor
    """``(batch, num_blocks * b)`` bool, True for keys that may be attended to."""
    last_block: torch.Tensor
    """``(batch,)`` long: each example's last (global) block."""
    random: torch.Tensor
    """``(batch, heads, num_blocks, r)`` long: random key blocks of each query block (0 where not valid)."""
    random_valid: torch.Tensor
    """``(batch, num_blocks, r)`` bool: which random slots hold a block."""


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
    s = 5 + r
    batch, length = document_ids.shape
    n, device = batch * length, document_ids.device
    document = flat_document_index(document_ids)
    position = positions_in_documents(document_ids)
    real = torch.ones_like(document_ids, dtype=torch.bool) if attention_mask is None else attention_mask
    doc, pos, real_flat = document.reshape(-1), position.reshape(-1), real.reshape(-1)
    index = torch.arange(n, device=device)
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
    if is_tracing():
        if count is None:
            return tokens
        if longest is None:
            longest = length  # a bound: no document is longer than its row
    elif count is None or longest is None or reads_values(document_ids):
        # Eager only: the one read when the batch did not say, else a check where reading costs no wait.
        actual_count, actual_longest = torch.stack([(is_end & (extent > 0)).sum(), extent.max()]).tolist()
        if count is not None and actual_count != count or longest is not None and actual_longest > longest:
            raise ValueError(
                f"The packed batch says {count} documents of at most {longest} tokens, but its boundaries hold "
                f"{actual_count} of up to {actual_longest}; pass the collator's `cu_seq_lens_q/k` and `max_length_q/k` "
                "unchanged (DataCollatorWithFlattening(return_flash_attn_kwargs=True))."
            )
        count = actual_count if count is None else count
        longest = actual_longest if longest is None else longest
    num_blocks = (n + count * (b - 1)) // b
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

    end_count = torch.where(is_end, blocks_of, 0)  # each document's block count, once
    first = torch.cumsum(end_count, 0) - end_count  # the first block of each token's document
    slots = num_blocks * b
    token_slot = torch.where(inside, first * b + pos, slots)
    # Tokens outside every extent all land on the extra place `slots`, which is cut off.
    slot_token = torch.zeros(slots + 1, dtype=torch.long, device=device).scatter(0, token_slot, index)[:slots]
    slot_real = torch.zeros(slots + 1, dtype=torch.bool, device=device).scatter(0, token_slot, real_flat)[:slots]
    blocks = torch.arange(num_blocks, device=device)
    used = blocks < end_count.sum()  # the documents' blocks come first, the spare ones after
    slot_key = slot_real | ~used[:, None].expand(num_blocks, b).reshape(-1)
    # Every used block starts with a token of its document (a document's blocks end with its extent).
    head = slot_token.view(num_blocks, b)[:, 0]
    block_doc = torch.where(used, doc[head], -1 - blocks)
    block_first = torch.where(used, first[head], blocks)
    block_count = torch.where(used, blocks_of[head], 1)
    local = blocks - block_first
    last = block_first + block_count - 1
    short = block_count <= r + 4
    is_global = ~short & ((local == 0) | (blocks == last))

    slot = torch.arange(s, device=device)
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
    return tokens._replace(
        num_blocks=num_blocks, max_count=max_count, token_slot=token_slot, slot_token=slot_token, slot_key=slot_key,
        block_doc=block_doc, block_first=block_first, block_count=block_count, sparse_slots=sparse_slots,
        sparse_ok=sparse_ok, sparse_random=~short & ~is_global, is_global=is_global, chunk_query=chunk_query,
        chunk_keys=chunk_keys, chunk_key_ok=chunk_key_ok, chunk_target=chunk_target,
    )  # fmt: skip


def document_block_table(layout: DocumentBlocks) -> torch.Tensor:
    """The layer-independent part of the pattern of the aligned layout (:func:`plan_documents`): ``(nb, nb)`` bool, True
    where query block (row) attends to key block (column) in the same document as a global block, a window block, or
    as a row whose pattern is its whole document (global rows, and every row of a short document). Spare blocks see
    themselves. Each layer adds its random blocks (:meth:`HfxBlockSparseSelfAttention._layout_pattern_blocks`)."""
    i = torch.arange(layout.num_blocks, device=layout.block_doc.device)
    first, last = layout.block_first, layout.block_first + layout.block_count - 1
    full_row = ~layout.sparse_random
    j = i[None, :]
    same = layout.block_doc[:, None] == layout.block_doc[None, :]
    near = full_row[:, None] | (j == first[:, None]) | (j == last[:, None]) | ((i[:, None] - j).abs() <= 1)
    return same & near


class HfxBlockSparseSelfAttention(HfxFullSelfAttention):
    """BigBird self-attention of one layer (see the module docstring for the exact pattern).

    ``config.attention_type`` is ``"block_sparse"`` or ``"original_full"`` (plain softmax attention over every
    non-padding key, exactly transformers' ``original_full``). ``attentions`` (with ``output_attentions=True``):
    ``(batch, heads, seq_len, seq_len)`` probabilities, zero outside the pattern.
    """

    supports_global_attention = False

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        self.attention_type = config.attention_type
        self.block_size = config.block_size
        self.num_random_blocks = config.num_random_blocks
        self.fixed_random_blocks = config.fixed_random_blocks
        # One seed per layer, so layers do not share their random pattern.
        self.seed = (int(config.random_seed) * 1_000_003 + layer_idx) % (2**62)
        # The seeded pattern of every block count an input can have (see `seeded_block_table`): looked up with
        # tensor ops, so traced graphs (torch.compile / torch.export) need no per-length Python and no cache.
        self.max_blocks = -(-config.max_position_embeddings // self.block_size)
        self.register_buffer("random_block_table", self.seeded_block_table(), persistent=False)

    # ----- the random pattern ------------------------------------------------------------------------------
    def random_blocks(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The seeded random key blocks for an example with blocks ``0 .. num_blocks - 1``.

        Row ``i`` (a middle block, ``1 <= i <= num_blocks - 2``) draws ``r`` distinct blocks among
        ``1 .. num_blocks - 2`` minus ``i - 1, i, i + 1``; when fewer are left it takes them all and the other
        slots are marked invalid. Rows ``0`` and ``num_blocks - 1`` (global) have no valid slot.

        Drawn from a generator seeded by ``(config.random_seed, layer, num_blocks)``.

        Returns:
            ``(heads, num_blocks, r)`` long block indices (0 in invalid slots) and ``(num_blocks, r)`` bool
            validity, on the CPU.
        """
        r, heads = self.num_random_blocks, self.num_heads
        i = torch.arange(num_blocks)[:, None]
        j = torch.arange(num_blocks)[None, :]
        middle = (i >= 1) & (i <= num_blocks - 2)
        allowed = middle & (j >= 1) & (j <= num_blocks - 2) & ((i - j).abs() > 1)
        valid = torch.arange(r)[None, :] < allowed.sum(-1, keepdim=True)
        if r == 0:
            return torch.zeros(heads, num_blocks, 0, dtype=torch.long), valid
        generator = torch.Generator().manual_seed(self.seed * 65_537 + num_blocks)
        # The r allowed blocks with the smallest uniform scores: a uniform draw without replacement. Float32 whatever the
        # default dtype (a model built in 16 bits): 16-bit scores are other numbers, with ties, so another pattern.
        scores = torch.rand(heads, num_blocks, num_blocks, generator=generator, dtype=torch.float32)
        scores = scores.masked_fill(~allowed, 2.0)
        chosen = scores.topk(min(r, num_blocks), dim=-1, largest=False).indices
        return F.pad(chosen, (0, r - chosen.shape[-1])).masked_fill(~valid, 0), valid

    def seeded_block_table(self) -> torch.Tensor:
        """The seeded pattern of every block count: ``(max_blocks, heads, max_blocks, r)``, row ``c - 1`` holding
        :meth:`random_blocks` ``(c)`` in its first ``c`` block rows and zeros after (int16 where it fits;
        ``max_blocks = ceil(max_position_embeddings / block_size)``). Slot validity depends on the count alone and
        is recomputed from it."""
        n, r = self.max_blocks, self.num_random_blocks
        dtype = torch.int16 if n < 2**15 else torch.int32
        table = torch.zeros(n, self.num_heads, n, r, dtype=dtype)
        if r:
            with torch.inference_mode(False):
                for count in range(1, n + 1):
                    table[count - 1, :, :count] = self.random_blocks(count)[0].to(dtype)
        return table

    def _valid_slots(self, last_block: torch.Tensor, num_blocks) -> torch.Tensor:
        """``(batch, num_blocks, r)`` bool: which random slots hold a block, for examples whose last block is
        ``last_block`` ``(batch,)`` (the rule of :meth:`random_blocks`). A middle block ``i`` may draw from
        ``1 .. last - 1`` minus its window ``i - 1 .. i + 1``: counted in closed form, elementwise (no
        ``(num_blocks, num_blocks)`` tensor, and nothing a tracer has to broadcast over a symbolic square)."""
        i = torch.arange(num_blocks, device=last_block.device)[None, :]
        count = self._slot_count(i, last_block[:, None])  # (batch, num_blocks)
        return torch.arange(self.num_random_blocks, device=last_block.device) < count[..., None]

    @staticmethod
    def _slot_count(i: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """How many blocks query block ``i`` may draw from in an example whose last block is ``last`` (broadcast
        elementwise): ``1 .. last - 1`` minus the window ``i - 1 .. i + 1``; 0 for the global rows."""
        window = torch.minimum(i + 1, last - 1) - torch.maximum(i - 1, torch.ones_like(i)) + 1
        return torch.where((i >= 1) & (i <= last - 1), last - 1 - window, 0)

    def _drawn_blocks(self, last_block: torch.Tensor, num_blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh random blocks from the global RNG of ``last_block``'s device for every example at once (training):
        the distribution of :meth:`random_blocks`, not its stream of numbers."""
        batch, r, device = last_block.shape[0], self.num_random_blocks, last_block.device
        i = torch.arange(num_blocks, device=device)[None, :, None]
        j = torch.arange(num_blocks, device=device)[None, None, :]
        last = last_block[:, None, None]
        allowed = (i >= 1) & (i <= last - 1) & (j >= 1) & (j <= last - 1) & ((i - j).abs() > 1)
        valid = self._valid_slots(last_block, num_blocks)
        # Float32 under any default dtype: 16-bit scores tie often, and topk breaks ties by position (a biased draw).
        scores = torch.rand(batch, self.num_heads, num_blocks, num_blocks, device=device, dtype=torch.float32)
        # r extra columns of "not allowed" so that topk(r) never needs more columns than exist.
        scores = F.pad(scores.masked_fill(~allowed[:, None], 2.0), (0, r), value=2.0)
        chosen = scores.topk(r, dim=-1, largest=False).indices
        return chosen.masked_fill(~valid[:, None], 0), valid

    def plan(self, attention_mask: torch.Tensor) -> BlockPlan:
        """Blocks, global blocks and random blocks of a batch.

        Args:
            attention_mask: ``(batch, seq_len)`` bool, True for real tokens.
        """
        batch, length = attention_mask.shape
        b, r, device = self.block_size, self.num_random_blocks, attention_mask.device
        num_blocks = ceil_div(length, b)
        # An example of pure padding would have no key at all (NaN): let it see everything, its output is zeroed.
        key_mask = attention_mask | ~attention_mask.any(-1, keepdim=True)
        positions = torch.arange(length, device=device)
        last_block = torch.where(key_mask, positions, -1).amax(-1) // b
        key_mask = F.pad(key_mask, (0, num_blocks * b - length), value=False)
        seeded = not self.training or self.fixed_random_blocks
        if r and seeded and not is_tracing() and num_blocks > self.max_blocks:
            raise ValueError(
                f"{length} tokens make {num_blocks} blocks of {b}, but the seeded random-block table covers "
                f"{self.max_blocks} (config.max_position_embeddings={self.max_blocks * b} tokens at most); raise "
                "max_position_embeddings or truncate the input."
            )
        if r and seeded:
            # Row `last + 1` of the table is each example's pattern; its block rows past `num_blocks` are zeros.
            random = self.random_block_table.to(device).long()[last_block]  # (batch, heads, max_blocks, r)
            random = cut_to_length(random, 2, num_blocks)
            return BlockPlan(key_mask, last_block, random, self._valid_slots(last_block, num_blocks))
        if r:
            # Training: fresh blocks for every example at once, drawn on the input's device (nothing read back to the
            # host, which on a GPU would synchronise every layer of every step).
            return BlockPlan(key_mask, last_block, *self._drawn_blocks(last_block, num_blocks))
        random = torch.zeros(batch, self.num_heads, num_blocks, 0, dtype=torch.long, device=device)
        return BlockPlan(
            key_mask, last_block, random, torch.zeros(batch, num_blocks, 0, dtype=torch.bool, device=device)
        )

    # ----- forward ----------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        document_ids: torch.Tensor | None = None,
        document_blocks: DocumentBlocks | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> context ``(batch, seq_len, hidden)``.

        ``document_ids`` ``(batch, seq_len)`` (a packed batch, ``ops/packing.py``): every document gets what its own
        forward gives; ``document_blocks`` is its :func:`plan_documents`, made once per forward by the model
        (computed here when absent).
        """
        if document_ids is not None:
            return self._packed(hidden_states, attention_mask, output_attentions, document_ids, document_blocks)
        if self.attention_type == "original_full":
            return super().forward(hidden_states, attention_mask, None, output_attentions)
        implementation = attention_implementation(self.config)
        # "eager" (and output_attentions) take the dense oracle: the explicit softmax under the pattern mask.
        eager = output_attentions or implementation == EAGER
        flex = not eager and flex_applies(implementation, hidden_states, self.training)
        batch, length, _ = hidden_states.shape
        if not (eager or flex) and not is_tracing() and ceil_div(length, self.block_size) <= self.num_random_blocks + 4:
            # Every example's last block is <= r + 3, so the pattern covers every key (module docstring): the result
            # is full attention, computed at full-attention speed by one SDPA call instead of the blocked path (with
            # no mask at all when nothing is padded).
            context = self.attend(hidden_states, attention_mask, False, 0.0).context
            if attention_mask is None:
                return AttentionOutput(context)
            return AttentionOutput(context.masked_fill(~attention_mask[..., None], 0.0))
        # None means no padding (decided once per forward by the model); the plan needs the mask as a tensor.
        padded = attention_mask is not None
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.bool, device=hidden_states.device)
        plan = self.plan(attention_mask)
        if eager:
            context, probs = self.dense_reference(hidden_states, attention_mask, plan, output_attentions=True)
            return AttentionOutput(context, probs if output_attentions else None)
        if flex:
            return AttentionOutput(self._flex_pattern(hidden_states, attention_mask, plan, padded))
        if not is_tracing() and self.dense_is_cheaper(ceil_div(length, self.block_size)):
            return AttentionOutput(self._dense_pattern(hidden_states, attention_mask, plan, padded))
        return AttentionOutput(self._block_sparse(hidden_states, attention_mask, plan, padded))

    def dense_is_cheaper(self, num_blocks: int) -> bool:
        """Whether full attention under the pattern mask computes no more block products than the blocked path.
        Dense: ``nb`` key blocks for each of ``nb`` query blocks. Blocked: ``5 + r`` for each of the ``nb - 2``
        middle query blocks, and ``nb`` for each of the 2 global ones (up to 8 blocks at ``r = 3``: 512 tokens at
        the default block size). Both give the same result; the dense call also skips the gathers, which copy
        ``5 + r`` key and value blocks per query block."""
        return num_blocks * num_blocks <= (num_blocks - 2) * (5 + self.num_random_blocks) + 2 * num_blocks

    def _project(self, hidden_states: torch.Tensor, padded_length: int) -> tuple[torch.Tensor, ...]:
        """Q, K, V of the input padded to ``padded_length`` rows: each ``(batch, heads, padded_length, dim)``."""
        # Padding the input (not q, k and v) costs one pad instead of three; none when nothing is padded (eager: a
        # traced graph keeps the pad, so that it need not guard on the length being a multiple of the block size).
        if is_tracing() or padded_length != hidden_states.shape[1]:
            hidden_states = F.pad(hidden_states, (0, 0, 0, padded_length - hidden_states.shape[1]))
        return tuple(split_heads(t, self.num_heads) for t in self.fused_qkv(hidden_states))

    def _dense_pattern(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, plan: BlockPlan, padded: bool
    ) -> torch.Tensor:
        """Short inputs: one fused SDPA call over all keys with :meth:`pattern_mask` as an additive mask. Without
        padding (``padded`` False) every example has the same pattern (the same last block, hence the same random
        rows), so one ``(1, heads, L, L)`` mask is broadcast over the batch; otherwise each example gets its own."""
        length = hidden_states.shape[1]
        q, k, v = self._project(hidden_states, length)
        if not padded:
            plan = BlockPlan(*(t[:1] for t in plan))
        allowed = self.pattern_mask(plan, length)
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        context = merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
        return context.masked_fill(~attention_mask[..., None], 0.0) if padded else context

    def _block_sparse(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, plan: BlockPlan, padded: bool = True
    ) -> torch.Tensor:
        """The fast path. Shapes inside: ``nb`` blocks of ``b`` tokens, ``m = nb - 2`` middle query blocks and ``s = 5 +
        r`` key blocks per query block. Block 0 is global in every example, and block ``nb - 1`` is either an
        example's global last block or pure padding, so only blocks ``1 .. nb - 2`` can need the sparse pattern.
        Traced graphs take ``m = nb - 1`` (block ``nb - 1`` too, overwritten below): at three blocks ``nb - 2`` is 1,
        a size that dynamic-shape tracing specializes on, which would cut the exported length range."""
        batch, length, hidden = hidden_states.shape
        heads, dim, b = self.num_heads, self.head_dim, self.block_size
        nb = plan.key_mask.shape[1] // b
        q, k, v = self._project(hidden_states, nb * b)
        qb = q.view(batch, heads, nb, b, dim)
        rows = torch.arange(batch, device=q.device)

        # Global query blocks 0 and `last` of every example: dense attention over all real keys.
        global_q = torch.cat([qb[:, :, 0], qb[rows, :, plan.last_block]], dim=2)  # (batch, heads, 2b, dim)
        traced = is_tracing()
        # Every key is real when nothing is padded, not even to a whole block: no mask (SDPA's fastest kernels).
        key_mask = None if not (padded or traced or nb * b != length) else plan.key_mask[:, None, None, :]
        global_out = F.scaled_dot_product_attention(global_q, k, v, attn_mask=key_mask)
        parts = [global_out[:, :, None, :b]]  # block 0: (batch, heads, 1, b, dim)

        m = nb - 1 if traced else max(nb - 2, 0)
        if m > 0:
            r = self.num_random_blocks
            middle = torch.arange(1, m + 1, device=q.device)
            last = plan.last_block[:, None, None, None]
            # Key blocks of every middle query block: [0, last, i - 1, i, i + 1, random...], (batch, heads, m, s).
            window = middle[:, None] + torch.arange(-1, 2, device=q.device)
            blocks = torch.cat(
                [
                    torch.zeros(batch, heads, m, 1, dtype=torch.long, device=q.device),
                    last.expand(batch, heads, m, 1),
                    window.clamp(max=nb - 1).expand(batch, heads, m, 3),  # (row nb - 1 of traced graphs)
                    plan.random[:, :, 1 : m + 1],
                ],
                dim=-1,
            )
            # A slot counts once: `last` only when it is not block 0, window blocks only strictly between the
            # global blocks (the others are global already, or pure padding), random slots as drawn.
            valid = torch.cat(
                [
                    torch.ones(batch, 1, m, 1, dtype=torch.bool, device=q.device),
                    (last > 0).expand(batch, 1, m, 1),
                    (window > 0) & (window < last),
                    plan.random_valid[:, None, 1 : m + 1],
                ],
                dim=-1,
            )
            head_idx = torch.arange(heads, device=q.device)[None, :, None, None]
            batch_idx = rows[:, None, None, None]
            # One gather each (a copy, as every block-sparse kernel needs): (batch * heads, m, s * b, dim). Keys and
            # values are first made contiguous per head, so that every block is one contiguous (b, dim) slab and
            # index_select copies whole slabs (about 30% faster than advanced indexing into the strided view).
            if traced:
                # Advanced indexing gives the (batch, heads, m, s, b, dim) blocks directly: splitting the flat rows of
                # index_select by the symbolic block count is a view the tracer cannot prove (see `unblock`).
                kb, vb = (
                    t.view(batch, heads, nb, b, dim)[batch_idx, head_idx, blocks].view(batch * heads, m, -1, dim)
                    for t in (k, v)
                )
            else:
                flat = ((batch_idx * heads + head_idx) * nb + blocks).reshape(-1)
                kb = k.contiguous().view(-1, b, dim).index_select(0, flat).view(batch * heads, m, -1, dim)
                vb = v.contiguous().view(-1, b, dim).index_select(0, flat).view(batch * heads, m, -1, dim)
            key_ok = plan.key_mask.view(batch, nb, b)[batch_idx, blocks] & valid[..., None]  # (batch, heads, m, s, b)
            neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
            bias = torch.where(key_ok, 0.0, neg_inf).view(batch * heads, m, 1, (5 + r) * b)
            middle_q = qb[:, :, 1 : m + 1].reshape(batch * heads, m, b, dim)
            middle_out = F.scaled_dot_product_attention(middle_q, kb, vb, attn_mask=bias)
            parts.append(middle_out.view(batch, heads, m, b, dim))
        if not traced and nb > 1:
            parts.append(global_out[:, :, None, b:])  # block nb - 1: global, or padding (zeroed below)
        out = torch.cat(parts, dim=2)
        # Block `last` (possibly 0 again) takes its global result.
        out[rows, :, plan.last_block] = global_out[:, :, b:]
        context = merge_heads(unblock(out, length, dim=2))
        return context.masked_fill(~attention_mask[..., None], 0.0) if padded else context

    def _flex_pattern(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, plan: BlockPlan, padded: bool
    ) -> torch.Tensor:
        """FlexAttention under the block pattern, the ``BlockMask`` made straight from the ``(batch, heads, nb, nb)``
        block table of :meth:`pattern_blocks` (global, window and the seeded random blocks) at BigBird's block size:
        the kernel visits exactly the ``5 + r`` key blocks of each middle query block and evaluates the mask only in
        the key blocks that hold padding."""
        length = hidden_states.shape[1]
        q, k, v = self._project(hidden_states, length)
        context = merge_heads(self._flex_blocks(q, k, v, self.pattern_blocks(plan), plan.key_mask, length))
        return context.masked_fill(~attention_mask[..., None], 0.0) if padded else context

    def _flex_blocks(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, key_mask: torch.Tensor, length
    ) -> torch.Tensor:
        """FlexAttention of ``q, k, v`` ``(batch, heads, length, dim)`` under the block table ``blocks`` ``(batch,
        heads, nb, nb)`` and ``key_mask`` ``(batch, nb * b)``; returns ``(batch, heads, length, dim)``."""
        b = self.block_size
        nb = blocks.shape[-1]
        real_keys = key_mask.view(key_mask.shape[0], nb, b)
        whole = real_keys.all(-1)[:, None, None, :]  # key blocks without padding: no per-score mask
        partial = blocks & ~whole & real_keys.any(-1)[:, None, None, :]
        full = blocks & whole

        # The whole pattern, not only the key mask: the compiled kernel evaluates it in the partial blocks alone, but
        # FlexAttention's eager form applies it to every score and ignores the block lists.
        def in_pattern(batch_idx, head, q_idx, kv_idx):
            return blocks[batch_idx, head, q_idx // b, kv_idx // b] & key_mask[batch_idx, kv_idx]

        block_mask = block_mask_from_tables(partial, full, b, in_pattern, length)
        return flex_attention(q, k, v, block_mask=block_mask)

    # ----- packed batches ---------------------------------------------------------------------------------
    def _packed(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        document_ids: torch.Tensor,
        document_blocks: DocumentBlocks | None,
    ) -> AttentionOutput:
        """Every document of a packed batch as in its own forward (module docstring); shapes as :meth:`forward`."""
        if self.attention_type == "original_full":
            return self._packed_full(hidden_states, attention_mask, output_attentions, document_ids)
        implementation = attention_implementation(self.config)
        if document_blocks is None:
            document_blocks = plan_documents(document_ids, attention_mask, self.block_size, self.num_random_blocks)
        layout = document_blocks
        if output_attentions or implementation == EAGER or layout.num_blocks is None:
            context, probs = self._packed_dense(hidden_states, attention_mask, layout)
            return AttentionOutput(context, probs if output_attentions else None)
        seeded = not self.training or self.fixed_random_blocks
        if self.num_random_blocks and seeded and not is_tracing() and layout.max_count > self.max_blocks:
            raise ValueError(
                f"A document of {layout.max_count} blocks of {self.block_size} tokens is longer than the seeded "
                f"random-block table covers ({self.max_blocks} blocks, config.max_position_embeddings); split it."
            )
        # Each document on whole blocks of its own: the packed tokens gathered into the aligned layout, one sequence.
        aligned = hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, layout.slot_token)[None]
        q, k, v = self._project(aligned, aligned.shape[1])  # each (1, heads, nb * b, dim)
        random, valid = self._layout_random(layout)
        if flex_applies(implementation, hidden_states, self.training):
            blocks = self._layout_pattern_blocks(layout, random, valid)[None]
            context = self._flex_blocks(q, k, v, blocks, layout.slot_key[None], aligned.shape[1])[0]
        else:
            context = self._layout_block_sparse(q[0], k[0], v[0], layout, random, valid)
        # Back to the packed row: places outside every extent read an extra zero row.
        context = merge_heads(context[None])[0]
        context = torch.cat([context, context.new_zeros(1, context.shape[-1])]).index_select(0, layout.token_slot)
        context = context.view(hidden_states.shape)
        return AttentionOutput(
            context if attention_mask is None else context.masked_fill(~attention_mask[..., None], 0.0)
        )

    def _layout_random(self, layout: DocumentBlocks) -> tuple[torch.Tensor, torch.Tensor]:
        """Random key blocks of every query block of the aligned layout: ``(heads, nb, r)`` long block indices (each
        document's seeded row, offset to its first block; in training fresh draws with the distribution of
        :meth:`random_blocks`) and ``(nb, r)`` bool validity. Only the middle blocks of long documents use them."""
        r, heads = self.num_random_blocks, self.num_heads
        first, count = layout.block_first, layout.block_count
        device = first.device
        local = torch.arange(first.shape[0], device=device) - first
        valid = torch.arange(r, device=device) < self._slot_count(local, count - 1)[:, None]
        if r == 0:
            return torch.zeros(heads, local.shape[0], 0, dtype=torch.long, device=device), valid
        if not self.training or self.fixed_random_blocks:
            # Clamped for traced graphs, which cannot check the longest document against the table (eager mode does).
            row, col = (count - 1).clamp(max=self.max_blocks - 1), local.clamp(max=self.max_blocks - 1)
            random = self.random_block_table[row, :, col].long().permute(1, 0, 2)
        else:
            j = torch.arange(layout.max_count, device=device)
            allowed = (j >= 1) & (j <= (count - 2)[:, None]) & ((local[:, None] - j).abs() > 1)
            scores = torch.rand(heads, local.shape[0], layout.max_count, device=device, dtype=torch.float32)
            scores = F.pad(scores.masked_fill(~allowed, 2.0), (0, r), value=2.0)
            random = scores.topk(r, dim=-1, largest=False).indices
        return random.masked_fill(~valid, 0) + first[:, None], valid

    def _layout_block_sparse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: DocumentBlocks,
        random: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """The fast path on the aligned layout: ``q, k, v`` ``(heads, nb * b, dim)`` -> ``(heads, nb * b, dim)``.

        Every query block: one SDPA call over its ``s = 5 + r`` gathered key blocks (first and last block of its
        document, window, random; or a short document's blocks), as :meth:`_block_sparse`. The global blocks of long
        documents, which attend to their whole document, take their rows from :meth:`_layout_global` instead. Fixed
        shapes (``nb`` and the chunk rows are bounds from host ints), so the number of operators does not depend on
        the documents."""
        heads, _, dim = q.shape
        b, nb = self.block_size, layout.num_blocks
        qb = q.view(heads, nb, b, dim)
        k_blocks, v_blocks = (t.contiguous().view(-1, b, dim) for t in (k, v))  # (heads * nb, b, dim), per head
        head_offset = torch.arange(heads, device=q.device)[:, None, None] * nb
        blocks, ok = layout.sparse_slots.expand(heads, nb, -1), layout.sparse_ok
        if self.num_random_blocks:
            use = layout.sparse_random[:, None]
            blocks = torch.cat([blocks[..., :5], torch.where(use, random, blocks[..., 5:])], dim=-1)
            ok = torch.cat([ok[:, :5], torch.where(use, valid, ok[:, 5:])], dim=-1)
        key_ok = layout.slot_key.view(nb, b)[blocks] & ok[..., None]  # (heads, nb, s, b)
        flat = (head_offset + blocks).reshape(-1)
        k_slots = k_blocks.index_select(0, flat).view(heads, nb, -1, dim)
        v_slots = v_blocks.index_select(0, flat).view(heads, nb, -1, dim)
        neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
        bias = torch.where(key_ok, 0.0, neg_inf).view(heads, nb, 1, -1)
        out = F.scaled_dot_product_attention(qb, k_slots, v_slots, attn_mask=bias)  # (heads, nb, b, dim)
        out = torch.where(layout.is_global[:, None, None], self._layout_global(qb, k_blocks, v_blocks, layout), out)
        return out.view(heads, nb * b, dim)

    def _layout_global(
        self, qb: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, layout: DocumentBlocks
    ) -> torch.Tensor:
        """The global query blocks of long documents, each over every key block of its document: ``qb`` ``(heads, nb,
        b, dim)``, ``k_blocks`` / ``v_blocks`` ``(heads * nb, b, dim)`` -> ``(heads, nb, b, dim)`` (meaningful at the
        global blocks only).

        A document's keys come in chunks of ``s`` blocks (:class:`DocumentBlocks`), so the work is linear in the
        blocks whatever the documents' lengths: each chunk row gives its softmax-weighted values and the log of its
        normaliser, and the chunks of one query block are merged by those normalisers (the split softmax of
        FlashAttention), by index over the chunk rows: a fixed number of operators for any number of documents."""
        heads, nb, b, dim = qb.shape
        rows, keys, target = layout.chunk_query, layout.chunk_keys, layout.chunk_target
        p = rows.shape[0]
        head_offset = torch.arange(heads, device=qb.device)[:, None, None] * nb
        flat = (head_offset + keys[None]).reshape(-1)
        k_chunks = k_blocks.index_select(0, flat).view(heads, p, -1, dim)
        v_chunks = v_blocks.index_select(0, flat).view(heads, p, -1, dim)
        scores = torch.matmul(qb.index_select(1, rows), k_chunks.transpose(-1, -2)).float() * self.head_dim**-0.5
        # The float32 minimum, not -inf: a row with no key left (possible only for hand-made document ids with
        # padding inside a document) then gives finite numbers and a zero weight, not NaN.
        scores = scores.masked_fill(~layout.chunk_key_ok[None, :, None, :], torch.finfo(torch.float32).min)
        lse = torch.logsumexp(scores, dim=-1)  # (heads, p, b)
        chunk_out = torch.matmul(torch.exp(scores - lse[..., None]).to(v_chunks.dtype), v_chunks)
        # Merge: weights exp(lse - lse_total), the total over each target's chunks (their maximum subtracted first).
        index = target[None, :, None].expand_as(lse)
        top = lse.new_full((heads, nb + 1, b), torch.finfo(torch.float32).min)
        top = top.scatter_reduce(1, index, lse.detach(), reduce="amax").gather(1, index)
        weight = torch.exp(lse - top)
        total = lse.new_zeros(heads, nb + 1, b).index_add(1, target, weight)
        merged = lse.new_zeros(heads, nb + 1, b, dim).index_add(1, target, weight[..., None] * chunk_out.float())
        # Blocks that are no chunk's target have a zero total: divided by one (they are not used), never by zero.
        total = torch.where(total > 0, total, torch.ones_like(total))
        return (merged / total[..., None])[:, :nb].to(qb.dtype)

    def _layout_pattern_blocks(self, layout: DocumentBlocks, random: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The pattern of the aligned layout per block: ``(heads, nb, nb)`` bool, every document's own pattern on
        its diagonal block (for FlexAttention): the layer's random blocks added to the per-forward
        :func:`document_block_table`."""
        table = layout.block_table if layout.block_table is not None else document_block_table(layout)
        blocks = table.expand(self.num_heads, -1, -1)
        if self.num_random_blocks:
            # Only the middle blocks of long documents take random blocks (the others' rows are whole already).
            hits = torch.zeros(*random.shape[:2], layout.num_blocks, dtype=torch.long, device=blocks.device)
            hits.scatter_add_(-1, random, (valid & layout.sparse_random[:, None]).expand_as(random).long())
            blocks = blocks | (hits > 0)
        return blocks

    def _token_random(self, layout: DocumentBlocks) -> tuple[torch.Tensor, torch.Tensor]:
        """Random key blocks of every token's query block, as block numbers inside its document: ``(batch, heads,
        seq_len, r)`` long and ``(batch, seq_len, r)`` bool validity (the packed dense path)."""
        r, heads, b = self.num_random_blocks, self.num_heads, self.block_size
        local, count = layout.position // b, layout.count
        valid = torch.arange(r, device=local.device) < self._slot_count(local, count - 1)[..., None]
        batch, length = local.shape
        if r == 0:
            return torch.zeros(batch, heads, length, 0, dtype=torch.long, device=local.device), valid
        if not self.training or self.fixed_random_blocks:
            row = (count - 1).clamp(min=0, max=self.max_blocks - 1)
            random = self.random_block_table[row, :, local.clamp(max=self.max_blocks - 1)].long().permute(0, 2, 1, 3)
        else:
            # One draw per query block: the tokens of a block all read the draw made at its first token.
            j = torch.arange(ceil_div(length, b), device=local.device)
            allowed = (j >= 1) & (j <= (count - 2)[..., None]) & ((local[..., None] - j).abs() > 1)
            scores = torch.rand(batch, heads, length, j.shape[0], device=local.device, dtype=torch.float32)
            scores = F.pad(scores.masked_fill(~allowed[:, None], 2.0), (0, r), value=2.0)
            block_start = torch.arange(length, device=local.device) - layout.position % b
            scores = scores.gather(2, block_start[:, None, :, None].expand(-1, heads, -1, scores.shape[-1]))
            random = scores.topk(r, dim=-1, largest=False).indices
        return random.masked_fill(~valid[:, None], 0), valid

    def _packed_dense(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, layout: DocumentBlocks
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pattern of every document as a ``(seq, seq)`` mask over the packed row (``"eager"``,
        ``output_attentions``, traced graphs): context ``(batch, seq_len, hidden)`` and probabilities ``(batch, heads,
        seq_len, seq_len)``, zero between documents."""
        length = hidden_states.shape[1]
        q, k, v = self._project(hidden_states, length)
        local = layout.position // self.block_size
        last = (layout.count - 1)[:, :, None]
        lq, lk = local[:, :, None], local[:, None, :]
        near = (lq == 0) | (lq == last) | (lk == 0) | (lk == last) | ((lq - lk).abs() <= 1)  # (batch, seq, seq)
        random, valid = self._token_random(layout)
        hit = ((random[..., None, :] == lk[:, None, :, :, None]) & valid[:, None, :, None, :]).any(-1)
        keys = same_document(layout.document, layout.document) & layout.inside[:, None, :]
        if attention_mask is not None:
            keys = keys & attention_mask[:, None, :]
        allowed = keys[:, None] & (near[:, None] | hit)
        # Tokens past their document's extent (padding) have no pattern: let them see everything, they give zeros.
        allowed = allowed | ~layout.inside[:, None, :, None]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        if attention_mask is not None:
            probs = probs.masked_fill(~attention_mask[:, None, :, None], 0.0)
        context = merge_heads(torch.matmul(probs, v))
        if attention_mask is not None:
            context = context.masked_fill(~attention_mask[..., None], 0.0)
        return context, probs

    def _packed_full(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, output_attentions: bool,
        document_ids: torch.Tensor,
    ) -> AttentionOutput:  # fmt: skip
        """``original_full`` on a packed batch: full attention with the keys of other documents masked (quadratic in
        the row's length, as full attention is)."""
        q, k, v = (split_heads(t, self.num_heads) for t in self.fused_qkv(hidden_states))
        mask = same_document(document_ids, document_ids)
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, :]
        # A document of pure padding would have no key at all (NaN): let it see everything, as `attend` does.
        mask = (mask | ~mask.any(-1, keepdim=True))[:, None]
        dropout = self.dropout_p if self.training else 0.0
        if not (output_attentions or attention_implementation(self.config) == EAGER):
            return AttentionOutput(merge_heads(attention(q, k, v, mask, dropout)))
        context, probs = eager_attention(q, k, v, mask, dropout)
        return AttentionOutput(merge_heads(context), probs if output_attentions else None)

    # ----- the oracle -------------------------------------------------------------------------------------
    def pattern_blocks(self, plan: BlockPlan) -> torch.Tensor:
        """The pattern per block: ``(batch, heads, nb, nb)`` bool, True where query block (row) may attend to key block
        (column): the global blocks, the window and the random blocks of ``plan``."""
        batch, heads, nb, _ = plan.random.shape
        i = torch.arange(nb, device=plan.key_mask.device)[:, None]
        j = torch.arange(nb, device=plan.key_mask.device)[None, :]
        last = plan.last_block[:, None, None, None]
        blocks = (i == 0) | (i == last) | (j == 0) | (j == last) | ((i - j).abs() <= 1)
        chosen = torch.zeros(batch, heads, nb, nb, dtype=torch.long, device=blocks.device)
        chosen.scatter_add_(-1, plan.random, plan.random_valid[:, None].expand_as(plan.random).long())
        return blocks | (chosen > 0)

    def pattern_mask(self, plan: BlockPlan, length: int) -> torch.Tensor:
        """The attention pattern as a dense mask: ``(batch, heads, length, length)`` bool, True where query
        (row) may attend to key (column). Built from the definition, independently of the fast path."""
        b = self.block_size
        blocks = self.pattern_blocks(plan)
        tokens = blocks.repeat_interleave(b, dim=-1).repeat_interleave(b, dim=-2)
        return (tokens & plan.key_mask[:, None, None, :])[:, :, :length, :length]

    def dense_reference(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        plan: BlockPlan | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ "Simulated sparse" attention: ordinary softmax attention with :meth:`pattern_mask` as the mask.

        Quadratic in memory; the oracle the fast path is tested against and the ``output_attentions`` path.

        Returns:
            context ``(batch, seq_len, hidden)`` and, if ``output_attentions``, probabilities
            ``(batch, heads, seq_len, seq_len)``.
        """
        batch, length, _ = hidden_states.shape
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.bool, device=hidden_states.device)
        plan = self.plan(attention_mask) if plan is None else plan
        q, k, v = self._project(hidden_states, length)
        allowed = self.pattern_mask(plan, length)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        probs = probs.masked_fill(~attention_mask[:, None, :, None], 0.0)
        context = torch.matmul(probs, v)
        context = merge_heads(context).masked_fill(~attention_mask[..., None], 0.0)
        return context, (probs if output_attentions else None)
