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


The files of BigBird's attention: this module (the pattern, its random blocks, the padded paths and the dense
oracle); packed batches in :mod:`~hf_xformers.attention.block_sparse_packed`, on the block-aligned layout of
:mod:`~hf_xformers.attention.block_sparse_layout`; ``"flex_attention"``'s block tables in
:mod:`~hf_xformers.attention.block_sparse_flex`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops.attention_switch import EAGER, flex_applies
from ..ops.input_checks import is_tracing
from ..ops.shapes import ceil_div, cut_to_length, merge_heads, split_heads, unblock
from .base import AttentionOutput, KernelChoice
from .block_sparse_flex import flex_block_attention
from .block_sparse_layout import DocumentBlocks
from .block_sparse_packed import PackedBlockSparse
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


def _draw_allowed(scores: torch.Tensor, allowed: torch.Tensor, r: int) -> torch.Tensor:
    """The ``r`` allowed columns with the smallest uniform ``scores`` along the last dimension (``allowed`` broadcast
    to them): a uniform draw without replacement, ``(..., r)`` long. Where fewer are allowed, the other slots point
    past the columns (the caller masks them as invalid)."""
    # r extra columns of "not allowed" so that topk(r) never needs more columns than exist.
    scores = F.pad(scores.masked_fill(~allowed, 2.0), (0, r), value=2.0)
    return scores.topk(r, dim=-1, largest=False).indices


class HfxBlockSparseSelfAttention(PackedBlockSparse, HfxFullSelfAttention, KernelChoice):
    """BigBird self-attention of one layer (see the module docstring for the exact pattern).

    ``config.attention_type`` is ``"block_sparse"`` or ``"original_full"`` (plain softmax attention over every
    non-padding key, exactly transformers' ``original_full``). ``attentions`` (with ``output_attentions=True``):
    ``(batch, heads, seq_len, seq_len)`` probabilities, zero outside the pattern. Packed batches take the paths of
    :class:`~hf_xformers.attention.block_sparse_packed.PackedBlockSparse`.
    """

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
        scores = torch.rand(batch, self.all_heads, num_blocks, num_blocks, device=device, dtype=torch.float32)
        scores = self.own_heads(scores, 1)
        chosen = _draw_allowed(scores, allowed[:, None], r)
        return chosen.masked_fill(~valid[:, None], 0), valid

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
            scores = torch.rand(self.all_heads, local.shape[0], layout.max_count, device=device, dtype=torch.float32)
            random = _draw_allowed(self.own_heads(scores, 0), allowed, r)
        return random.masked_fill(~valid, 0) + first[:, None], valid

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
            scores = torch.rand(batch, self.all_heads, length, j.shape[0], device=local.device, dtype=torch.float32)
            scores = self.own_heads(scores, 1)
            # (Every token of a block is allowed the same blocks as its first, whose draw it reads.)
            block_start = torch.arange(length, device=local.device) - layout.position % b
            scores = scores.gather(2, block_start[:, None, :, None].expand(-1, heads, -1, scores.shape[-1]))
            random = _draw_allowed(scores, allowed[:, None], r)
        return random.masked_fill(~valid[:, None], 0), valid

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

    def narrow_head_state(self, first: int, count: int) -> None:
        # The seeded random blocks are drawn for every head at once (the same table on every rank); a head shard keeps
        # its heads' rows, so that each head sees the blocks it sees in one process.
        self.random_block_table = self.random_block_table.narrow(1, first, count)

    # ----- forward ----------------------------------------------------------------------------------------
    def attend_tokens(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        document_ids: torch.Tensor | None = None,
        document_blocks: DocumentBlocks | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> context ``(batch, seq_len, hidden)``.

        ``document_ids`` ``(batch, seq_len)`` (a packed batch, ``ops/packing.py``): every document gets what its own
        forward gives; ``document_blocks`` is their layout, made once per forward by the model
        (:meth:`~hf_xformers.attention.block_sparse_packed.PackedBlockSparse.document_layout`; made here when absent).
        """
        implementation = self.kernel_choice(hidden_states)
        if document_ids is not None:
            return self._packed(
                hidden_states, attention_mask, output_attentions, document_ids, document_blocks, implementation
            )
        # "eager" (and output_attentions) take the dense oracle: the explicit softmax under the pattern mask.
        eager = output_attentions or implementation == EAGER
        if self.attention_type == "original_full":
            out = self.attend(hidden_states, attention_mask, eager, self.dropout_p if self.training else 0.0)
            return out if output_attentions else AttentionOutput(out.context)
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
            parts.append(self._middle_blocks(qb, k, v, plan, m))
        if not traced and nb > 1:
            parts.append(global_out[:, :, None, b:])  # block nb - 1: global, or padding (zeroed below)
        out = torch.cat(parts, dim=2)
        # Block `last` (possibly 0 again) takes its global result.
        out[rows, :, plan.last_block] = global_out[:, :, b:]
        context = merge_heads(unblock(out, length, dim=2))
        return context.masked_fill(~attention_mask[..., None], 0.0) if padded else context

    def _middle_blocks(
        self, qb: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, m: int
    ) -> torch.Tensor:
        """Query blocks ``1 .. m`` of ``qb`` ``(batch, heads, nb, b, dim)``, each over its ``s = 5 + r`` key blocks
        of ``k`` / ``v`` ``(batch, heads, nb * b, dim)`` in one SDPA call: ``(batch, heads, m, b, dim)``."""
        batch, heads, nb, b, dim = qb.shape
        r = self.num_random_blocks
        device = qb.device
        rows = torch.arange(batch, device=device)
        middle = torch.arange(1, m + 1, device=device)
        last = plan.last_block[:, None, None, None]
        # Key blocks of every middle query block: [0, last, i - 1, i, i + 1, random...], (batch, heads, m, s).
        window = middle[:, None] + torch.arange(-1, 2, device=device)
        blocks = torch.cat(
            [
                torch.zeros(batch, heads, m, 1, dtype=torch.long, device=device),
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
                torch.ones(batch, 1, m, 1, dtype=torch.bool, device=device),
                (last > 0).expand(batch, 1, m, 1),
                (window > 0) & (window < last),
                plan.random_valid[:, None, 1 : m + 1],
            ],
            dim=-1,
        )
        head_idx = torch.arange(heads, device=device)[None, :, None, None]
        batch_idx = rows[:, None, None, None]
        # One gather each (a copy, as every block-sparse kernel needs): (batch * heads, m, s * b, dim). Keys and
        # values are first made contiguous per head, so that every block is one contiguous (b, dim) slab and
        # index_select copies whole slabs (about 30% faster than advanced indexing into the strided view).
        if is_tracing():
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
        neg_inf = torch.tensor(float("-inf"), dtype=qb.dtype, device=device)
        bias = torch.where(key_ok, 0.0, neg_inf).view(batch * heads, m, 1, (5 + r) * b)
        middle_q = qb[:, :, 1 : m + 1].reshape(batch * heads, m, b, dim)
        middle_out = F.scaled_dot_product_attention(middle_q, kb, vb, attn_mask=bias)
        return middle_out.view(batch, heads, m, b, dim)

    def _flex_pattern(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, plan: BlockPlan, padded: bool
    ) -> torch.Tensor:
        """FlexAttention under the block pattern, the ``BlockMask`` made straight from the ``(batch, heads, nb, nb)``
        block table of :meth:`pattern_blocks` (global, window and the seeded random blocks) at BigBird's block size:
        the kernel visits exactly the ``5 + r`` key blocks of each middle query block and evaluates the mask only in
        the key blocks that hold padding."""
        length = hidden_states.shape[1]
        q, k, v = self._project(hidden_states, length)
        blocks = self.pattern_blocks(plan)
        context = merge_heads(flex_block_attention(q, k, v, blocks, plan.key_mask, self.block_size, length))
        return context.masked_fill(~attention_mask[..., None], 0.0) if padded else context

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
        context, probs = self._pattern_attention(q, k, v, self.pattern_mask(plan, length), attention_mask)
        return context, (probs if output_attentions else None)

    def _pattern_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax attention of ``q, k, v`` ``(batch, heads, seq_len, dim)`` under ``allowed`` ``(batch, heads,
        seq_len, seq_len)`` bool (every row keeps a key), padding rows (``attention_mask`` False) zeroed: context
        ``(batch, seq_len, hidden)`` and probabilities ``(batch, heads, seq_len, seq_len)``."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        if attention_mask is None:
            return merge_heads(torch.matmul(probs, v)), probs
        probs = probs.masked_fill(~attention_mask[:, None, :, None], 0.0)
        context = merge_heads(torch.matmul(probs, v)).masked_fill(~attention_mask[..., None], 0.0)
        return context, probs
