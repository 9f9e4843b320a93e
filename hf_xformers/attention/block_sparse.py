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
offset to where it starts. The fast path runs on that layout: every query block with at most ``5 + r`` key blocks
(the middle blocks of long documents, and every block of a document of at most ``r + 4`` blocks, whose pattern is
complete: its own forward's dense fallback) through one gathered SDPA call as above, and the global blocks of long
documents through one SDPA call per group of documents of similar block count (powers of two) over their document's
key blocks, padded to the group's longest; cost linear in the number of blocks (the global blocks' keys at most
doubled), nothing proportional to (documents x length). ``"flex_attention"`` uses the same layout and the block
table of all its blocks (``nb x nb``, as a single sequence of that length). ``"eager"`` and ``output_attentions``
apply the pattern as a ``(seq, seq)`` mask over the packed row (quadratic, as for a single sequence), which is also
the path a traced graph takes for packed input (the layout's sizes are read from the tensors). ``original_full``
masks the keys of other documents. Training draws fresh random blocks per document, so only with
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
from ..ops.input_checks import is_tracing
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


# Long documents' global rows are grouped by the power of two above their block count, so that padding each group to
# its longest document at most doubles their key blocks (a bounded number of SDPA calls, none per document).
_GROUPS = 17


class GlobalRows(NamedTuple):
    """The global query blocks of the long documents (more than ``r + 4`` blocks) whose block count lies in one
    power-of-two range, each attending to every block of its document."""

    rows: torch.Tensor
    """``(g,)`` long: the query blocks (in the aligned layout)."""
    keys: torch.Tensor
    """``(g, k)`` long: their documents' blocks, padded to the group's longest document ``k`` (clamped)."""
    key_ok: torch.Tensor
    """``(g, k * b)`` bool: keys that may be attended to (inside the document and real)."""


class DocumentBlocks(NamedTuple):
    """Where the documents of a packed batch meet the blocks; built once per forward by :func:`plan_documents`.

    A document's extent is its tokens up to its last real (non-padding) one, its own forward's length; padding after
    it lies in no block. The token fields always exist; the block-aligned layout (``num_blocks`` and after) only in
    eager mode (its sizes are read from the tensors), None while tracing.
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
    """``nb``: blocks of the aligned layout, every document of every row end to end."""
    token_slot: torch.Tensor | None = None
    """``(batch * seq_len,)`` long: each token's place in the aligned layout; ``nb * b`` (no place) outside extents."""
    slot_token: torch.Tensor | None = None
    """``(nb * b,)`` long: the token at each place of the layout (0 in the gaps, which are masked)."""
    slot_real: torch.Tensor | None = None
    """``(nb * b,)`` bool: places that hold a real token (the keys that may be attended to)."""
    block_doc: torch.Tensor | None = None
    """``(nb,)`` long: the document of each block."""
    block_first: torch.Tensor | None = None
    """``(nb,)`` long: the first block of each block's document."""
    block_count: torch.Tensor | None = None
    """``(nb,)`` long: the number of blocks of each block's document."""
    sparse: torch.Tensor | None = None
    """``(m,)`` long: query blocks with at most ``s = 5 + r`` key blocks: the middle blocks of long documents, and
    every block of a document of at most ``r + 4`` blocks (whose pattern is complete: its whole document)."""
    sparse_slots: torch.Tensor | None = None
    """``(m, s)`` long: their key blocks, ``[first, last, i - 1, i, i + 1, (random)]`` for middle blocks (the random
    slots are filled per layer), the document's blocks in order for short documents."""
    sparse_ok: torch.Tensor | None = None
    """``(m, s)`` bool: which of those slots count (each block once)."""
    sparse_random: torch.Tensor | None = None
    """``(m,)`` bool: rows whose last ``r`` slots take random blocks (middle blocks of long documents)."""
    global_rows: tuple[GlobalRows, ...] | None = None
    """The global query blocks of the long documents, by group."""
    order: torch.Tensor | None = None
    """``(nb,)`` long: where each block's result lies in ``[sparse results, group results...]``."""
    max_count: int | None = None
    """The most blocks of any document."""


def plan_documents(
    document_ids: torch.Tensor, attention_mask: torch.Tensor | None, block_size: int, num_random_blocks: int
) -> DocumentBlocks:
    """The block layout of a packed batch (see :class:`DocumentBlocks`): in eager mode one host read; scans and
    gathers over the tokens, no atomics (a scatter-reduce by document would serialise on long documents).

    Args:
        document_ids: ``(batch, seq_len)`` long, documents numbered from 0 in each row (``ops/packing.py``).
        attention_mask: ``(batch, seq_len)`` bool, True for real tokens, or None (nothing padded).
        block_size, num_random_blocks: the layer's ``b`` and ``r``.
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
    count = ceil_div(extent, b)
    inside = pos < extent
    tokens = DocumentBlocks(document, position, count.view(batch, length), inside.view(batch, length))
    if is_tracing():
        return tokens
    end_count = torch.where(is_end, count, 0)  # each document's block count, once
    first = torch.cumsum(end_count, 0) - end_count  # the first block of each token's document
    long_doc = is_end & (count > r + 4)
    group = torch.log2((count - 1).clamp(min=1).float()).floor().long() + 1  # ceil(log2(count)) for count >= 2
    group = group.clamp(max=_GROUPS - 1)
    in_group = long_doc[:, None] & (group[:, None] == torch.arange(_GROUPS, device=device))  # (n, groups)
    sizes = torch.cat(
        [
            end_count.sum()[None],
            (2 * in_group).sum(0),
            torch.where(in_group, count[:, None], 0).amax(0),
            count.max()[None],
        ]
    )
    sizes = sizes.tolist()  # the one host read
    num_blocks, max_count = sizes[0], sizes[-1]
    group_rows, group_keys = sizes[1 : _GROUPS + 1], sizes[_GROUPS + 1 : 2 * _GROUPS + 1]
    slots = num_blocks * b
    token_slot = torch.where(inside, first * b + pos, slots)
    # Tokens outside every extent all land on the extra place `slots`, which is cut off.
    slot_token = torch.zeros(slots + 1, dtype=torch.long, device=device).scatter(0, token_slot, index)[:slots]
    slot_real = torch.zeros(slots + 1, dtype=torch.bool, device=device).scatter(0, token_slot, real_flat)[:slots]
    # Every block starts with a token of its document (a document's blocks end with its extent).
    head = slot_token[::b]
    block_doc, block_first, block_count = doc[head], first[head], count[head]
    blocks = torch.arange(num_blocks, device=device)
    local = blocks - block_first
    last = block_first + block_count - 1
    short = block_count <= r + 4
    is_global = ~short & ((local == 0) | (blocks == last))
    ranked = torch.argsort(torch.where(is_global, group[head], -1), stable=True)  # sparse rows, then each group
    order = torch.empty_like(ranked).scatter_(0, ranked, blocks)
    m = num_blocks - sum(group_rows)
    sparse = ranked[:m]
    first_s, local_s, count_s = block_first[sparse], local[sparse], block_count[sparse]
    slot = torch.arange(s, device=device)
    window = local_s[:, None] + torch.arange(-1, 2, device=device)
    middle_slots = torch.cat(
        [torch.stack([first_s, first_s + count_s - 1], -1), first_s[:, None] + window, first_s[:, None].expand(-1, r)],
        dim=-1,
    )
    # A slot counts once: the window only strictly between the document's global blocks.
    middle_ok = torch.cat(
        [
            torch.ones(m, 2, dtype=torch.bool, device=device),
            (window > 0) & (window < (count_s - 1)[:, None]),
            torch.zeros(m, r, dtype=torch.bool, device=device),
        ],
        dim=-1,
    )
    short_s = short[sparse][:, None]
    sparse_slots = torch.where(short_s, (first_s[:, None] + slot).clamp(max=num_blocks - 1), middle_slots)
    sparse_ok = torch.where(short_s, slot < count_s[:, None], middle_ok)
    global_rows, at = [], m
    for rows_in_group, k in zip(group_rows, group_keys):
        if rows_in_group:
            rows = ranked[at : at + rows_in_group]
            keys = block_first[rows][:, None] + torch.arange(k, device=device)
            in_document = keys <= last[rows][:, None]
            keys = keys.clamp(max=num_blocks - 1)
            key_ok = in_document[..., None] & slot_real.view(num_blocks, b)[keys]
            global_rows.append(GlobalRows(rows, keys, key_ok.view(rows_in_group, k * b)))
            at += rows_in_group
    return tokens._replace(
        num_blocks=num_blocks, token_slot=token_slot, slot_token=slot_token, slot_real=slot_real, block_doc=block_doc,
        block_first=block_first, block_count=block_count, sparse=sparse, sparse_slots=sparse_slots,
        sparse_ok=sparse_ok, sparse_random=~short[sparse], global_rows=tuple(global_rows), order=order,
        max_count=max_count,
    )  # fmt: skip


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
        if self.num_random_blocks and seeded and layout.max_count > self.max_blocks:
            raise ValueError(
                f"A document of {layout.max_count} blocks of {self.block_size} tokens is longer than the seeded "
                f"random-block table covers ({self.max_blocks} blocks, config.max_position_embeddings); split it."
            )
        if layout.num_blocks == 0:  # nothing but padding
            return AttentionOutput(torch.zeros_like(hidden_states))
        # Each document on whole blocks of its own: the packed tokens gathered into the aligned layout, one sequence.
        aligned = hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, layout.slot_token)[None]
        q, k, v = self._project(aligned, aligned.shape[1])  # each (1, heads, nb * b, dim)
        random, valid = self._layout_random(layout)
        if flex_applies(implementation, hidden_states, self.training):
            blocks = self._layout_pattern_blocks(layout, random, valid)[None]
            context = self._flex_blocks(q, k, v, blocks, layout.slot_real[None], aligned.shape[1])[0]
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
        """Random key blocks of the sparse query blocks of the aligned layout: ``(heads, m, r)`` long block indices
        (each document's seeded row, offset to its first block; in training fresh draws with the distribution of
        :meth:`random_blocks`) and ``(m, r)`` bool validity. Only the middle blocks of long documents use them."""
        r, heads, rows = self.num_random_blocks, self.num_heads, layout.sparse
        first, count = layout.block_first[rows], layout.block_count[rows]
        local = rows - first
        device = first.device
        valid = torch.arange(r, device=device) < self._slot_count(local, count - 1)[:, None]
        if r == 0:
            return torch.zeros(heads, local.shape[0], 0, dtype=torch.long, device=device), valid
        if not self.training or self.fixed_random_blocks:
            random = self.random_block_table[count - 1, :, local].long().permute(1, 0, 2)
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

        Sparse query blocks: one SDPA call over their ``s = 5 + r`` gathered key blocks (first and last block of
        their document, window, random; or a short document's blocks), as :meth:`_block_sparse`. Global blocks of
        long documents: one SDPA call per group of documents of similar length, over their document's key blocks
        padded to the group's longest (at most twice the blocks they need)."""
        heads, _, dim = q.shape
        b, nb = self.block_size, layout.num_blocks
        r = self.num_random_blocks
        qb = q.view(heads, nb, b, dim)
        k_blocks, v_blocks = (t.contiguous().view(-1, b, dim) for t in (k, v))  # (heads * nb, b, dim), per head
        head_offset = torch.arange(heads, device=q.device)[:, None, None] * nb
        neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)

        def attend(rows: torch.Tensor, blocks: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
            # rows (g,), blocks (heads or 1, g, t) key blocks, key_ok (heads or 1, g, t * b) -> (heads, g, b, dim).
            g = rows.shape[0]
            flat = (head_offset + blocks).reshape(-1)
            k_slots = k_blocks.index_select(0, flat).view(heads, g, -1, dim)
            v_slots = v_blocks.index_select(0, flat).view(heads, g, -1, dim)
            bias = torch.where(key_ok, 0.0, neg_inf)[:, :, None, :]
            return F.scaled_dot_product_attention(qb.index_select(1, rows), k_slots, v_slots, attn_mask=bias)

        parts = []
        rows = layout.sparse
        if rows.shape[0]:
            m = rows.shape[0]
            blocks, ok = layout.sparse_slots.expand(heads, m, -1), layout.sparse_ok
            if r:
                use = layout.sparse_random[:, None]
                blocks = torch.cat([blocks[..., :5], torch.where(use, random, blocks[..., 5:])], dim=-1)
                ok = torch.cat([ok[:, :5], torch.where(use, valid, ok[:, 5:])], dim=-1)
            key_ok = layout.slot_real.view(nb, b)[blocks] & ok[..., None]  # (heads, m, s, b)
            parts.append(attend(rows, blocks, key_ok.view(heads, m, -1)))
        for group in layout.global_rows:
            parts.append(attend(group.rows, group.keys[None], group.key_ok[None]))
        out = torch.cat(parts, dim=1).index_select(1, layout.order)  # (heads, nb, b, dim), blocks in layout order
        return out.view(heads, nb * b, dim)

    def _layout_pattern_blocks(self, layout: DocumentBlocks, random: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The pattern of the aligned layout per block: ``(heads, nb, nb)`` bool, every document's own pattern on
        its diagonal block (for FlexAttention)."""
        nb, r = layout.num_blocks, self.num_random_blocks
        i = torch.arange(nb, device=layout.block_doc.device)
        first, last = layout.block_first, layout.block_first + layout.block_count - 1
        full_row = (i == first) | (i == last) | (layout.block_count <= r + 4)
        j = i[None, :]
        same = layout.block_doc[:, None] == layout.block_doc[None, :]
        near = full_row[:, None] | (j == first[:, None]) | (j == last[:, None]) | ((i[:, None] - j).abs() <= 1)
        blocks = (same & near).expand(self.num_heads, nb, nb).clone()
        if layout.sparse.shape[0] and r:
            # Short documents' rows are whole already; their table rows are inside the document all the same.
            hits = torch.zeros(*random.shape[:2], nb, dtype=torch.long, device=blocks.device)
            hits.scatter_add_(-1, random, valid.expand_as(random).long())
            blocks[:, layout.sparse] |= hits > 0
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
