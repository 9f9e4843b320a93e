"""Chunked local self-attention (Reformer) and the chunk helpers that LSH attention shares.

The sequence is cut into chunks of ``chunk_length``; each query attends to the keys of its own chunk and of
``num_chunks_before`` / ``num_chunks_after`` neighbouring chunks. As in trax and transformers the neighbours are
taken *circularly*: the first chunk's "previous" chunk is the last one (a causal mask hides it again in decoders).

Padding. Where transformers wraps around the chunks of the whole padded batch, we wrap around the chunks an example
would have on its own: ``padded_lengths`` (per example: its real extent rounded up to the model's chunk multiple, the
length it would be padded to if it were alone) says how many chunks take part. An example's output therefore does
not depend on how far its batch is padded, and it equals transformers' whenever the batch is not padded beyond that
length. An example with a single chunk attends to it once (the full attention it gets alone); with more chunks than
one, a window wider than the chunk count repeats chunks as transformers does.

Packed documents (a padding-free batch). The Reformer model lays every document of a packed row out in a region of
an internal row that is padded to the model's chunk multiple, as the document's own forward pads it (see
:class:`DocumentLayout`): chunks never straddle two documents, and the chunks of each document wrap around among
themselves exactly as they do when it is alone (:func:`segment_neighbour_chunks`), so no chunk ever sees another
document's and each document gets the windows, and the repeated chunks, of its own forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..ops.attention_switch import flex_applies, flex_attention, make_block_mask
from ..ops.fast_dropout import HfxDropout
from ..ops.precision import mask_value
from ..ops.shapes import ceil_div, merge_heads, split_heads, unblock
from .base import AttentionOutput, HfxSelfAttention, plain_linears

# Masked keys get `mask_value(scores.dtype)`, the most negative finite value of the scores' dtype: finite (as
# transformers' -1e9 in float32 and -1e4 in float16), so a row with every key masked stays finite, and representable
# in float16 (where -1e9 overflows). Next to a real key it gives an exact 0, as -1e9 does: float32 results are the same.


def neighbour_chunks(
    num_chunks: int, before: int, after: int, real_chunks: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which chunks each chunk attends to.

    Args:
        num_chunks: chunks in the (padded) batch.
        before, after: neighbours on each side.
        real_chunks: ``(batch,)`` chunks that take part in the wrap-around per example, or None (all).
    Returns:
        ``index`` ``(batch or 1, num_chunks, window)`` chunk ids, ``window = before + 1 + after`` in the order
        ``-before ... 0 ... after``; ``keep`` of the same shape, False for the repeats of an example's only chunk.
        Chunks past ``real_chunks`` (padding only) attend to themselves.
    """
    chunk = torch.arange(num_chunks, device=device).view(1, -1, 1)
    offset = torch.arange(-before, after + 1, device=device).view(1, 1, -1)
    count = torch.full((1, 1, 1), num_chunks, device=device) if real_chunks is None else real_chunks.view(-1, 1, 1)
    index = torch.where(chunk < count, torch.remainder(chunk + offset, count), chunk)
    # A single chunk is every key already: its copies in the other window slots are dropped (the input alone would
    # take the full-attention path). With two or more chunks a window wider than the chunk count repeats chunks, and
    # transformers counts them as often as they appear: so do we.
    keep = (offset == -before) | (count > 1)
    return index, keep.expand(index.shape)


@dataclass(frozen=True)
class DocumentLayout:
    """Where the documents of a packed batch lie in the internal row a chunked attention runs on.

    Every document fills a *region* of the row that starts at a multiple of the model's chunk multiple (the least
    common multiple of the chunk lengths in use) and is its length rounded up to that multiple; the tail of a row after
    its last region is a region of its own that holds no document. A document's own forward (batch 1, no padding)
    computes on its *solo length*: its length rounded up to the chunk multiple when it exceeds the shortest chunk, its
    length otherwise (the model pads only inputs longer than that); with an attention mask, the extent of its real
    tokens takes the place of its length, as ``padded_lengths`` does for a padded batch.

    Attributes:
        region_start: ``(batch, length)`` long: the first slot of the region each slot lies in.
        solo_length: ``(batch, length)`` long: the solo length of the document of that region (0 in a row's tail).
        flex_masks: what the layers of one forward share, filled as they run: FlexAttention's document ``BlockMask``
            of the local layers (with its repeat counts), built by the first local layer and reused by the others and
            by the reversible recomputation. A layout lives for one forward, so nothing outlives its inputs.
    """

    region_start: torch.Tensor
    solo_length: torch.Tensor
    flex_masks: dict = field(default_factory=dict, compare=False, repr=False)

    def chunk_segments(self, chunk: int, num_chunks: int, scale: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks each chunk wraps around among, for a row of ``scale`` copies of every region laid end to end
        in each region's place (LSH's hashing rounds, sorted by document first: region ``[s, s + P)`` becomes
        ``[scale * s, scale * (s + P))``) cut into ``num_chunks`` chunks of ``chunk`` (a divisor of every region's
        length).

        A document longer than a chunk wraps around the chunks of its solo length (``scale`` times it): its own
        forward's chunks, in its own forward's order. A document no longer than a chunk, which attends to all of
        its positions alone, and every chunk outside a document's solo length (padding only), see only themselves.

        Returns:
            ``(first, count)``, each ``(batch, num_chunks)`` long: chunk ``j`` wraps around chunks
            ``first[j] ... first[j] + count[j] - 1``.
        """
        index = torch.arange(num_chunks, device=self.region_start.device)
        slots = index * chunk // scale  # the slot of the region holding each chunk's first (sorted) slot
        start = self.region_start[:, slots]
        solo = self.solo_length[:, slots]
        first = start * scale // chunk
        count = (solo * scale + chunk - 1) // chunk
        inside = (solo > chunk) & (index - first < count)
        return torch.where(inside, first, index), torch.where(inside, count, torch.ones_like(count))


def segment_neighbour_chunks(
    first: torch.Tensor, count: torch.Tensor, before: int, after: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`neighbour_chunks` within segments: chunk ``j`` of segment ``first[j] ... first[j] + count[j] - 1``
    (``(batch, num_chunks)`` long each, from :meth:`DocumentLayout.chunk_segments`) attends to the chunks
    ``first + (j - first + offset) mod count``, with the same repeats and the same single-chunk rule as a whole
    example's chunks. Returns ``index`` and ``keep``, ``(batch, num_chunks, window)``."""
    chunk = torch.arange(first.shape[1], device=first.device).view(1, -1, 1)
    offset = torch.arange(-before, after + 1, device=first.device).view(1, 1, -1)
    first, count = first[..., None], count[..., None]
    index = first + torch.remainder(chunk - first + offset, count)
    keep = (offset == -before) | (count > 1)
    return index, keep.expand(index.shape)


def decode_window_slots(query_slot: torch.Tensor, length: int, chunk: int, before: int, after: int) -> torch.Tensor:
    """The slots a query at ``query_slot`` (a long tensor of any shape ``(...)``) attends to in a full forward over a
    row of ``length`` slots cut into chunks of ``chunk`` (``length`` a multiple of it): its chunk and ``before`` /
    ``after`` neighbours, circularly, a chunk repeated as often as it appears in the window, the single chunk of a
    one-chunk row once (:func:`neighbour_chunks` with every chunk taking part). Returns ``(..., window * chunk)``
    slot indices in window order; cached decoding (one new query) gathers its keys with them."""
    num_chunks = length // chunk
    offsets = [offset for offset in range(-before, after + 1) if offset == -before or num_chunks > 1]
    offsets = torch.tensor(offsets, device=query_slot.device)
    chunks = torch.remainder(torch.div(query_slot, chunk, rounding_mode="floor")[..., None] + offsets, num_chunks)
    return (chunks[..., None] * chunk + torch.arange(chunk, device=query_slot.device)).flatten(-2)


def decode_padded_length(length: int, multiple: int, min_chunk_length: int) -> int:
    """The length the Reformer model pads an input of ``length`` positions to (a multiple of ``multiple``, the chunk
    multiple, once it is longer than ``min_chunk_length``): the row a full forward over the sequence so far chunks,
    which a cached step must reproduce."""
    if length <= min_chunk_length:
        return length
    return ceil_div(length, multiple) * multiple


def window_repeats(
    index: torch.Tensor, keep: torch.Tensor, num_chunks: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each key chunk appears in each query chunk's window (:func:`neighbour_chunks`' ``index`` and
    ``keep``), as ``(batch, num_chunks, num_chunks)`` counts and their logs (0 where absent): FlexAttention's paths
    weigh a chunk repeated ``n`` times with ``+log n`` on its scores, the same softmax as ``n`` copies of the key."""
    counts = torch.zeros(index.shape[0], num_chunks, num_chunks, dtype=torch.long, device=index.device)
    counts = counts.scatter_add_(-1, index, keep.long()).expand(batch, -1, -1)
    return counts, counts.clamp(min=1).to(torch.float32).log()


def gather_chunks(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` ``(batch, heads, num_chunks, chunk, *rest)`` and ``index`` ``(batch or 1, num_chunks, window)`` ->
    ``(batch, heads, num_chunks, window * chunk, *rest)``: each chunk followed by its neighbours' rows.

    One ``index_select`` over the flattened ``(batch * heads * num_chunks)`` chunks, with the chunk ids offset per
    example and head: the index is read once per chunk (not per element, as ``gather`` does) and the result is
    contiguous.
    """
    batch, heads, num_chunks, chunk = x.shape[:4]
    rest = x.shape[4:]
    window = index.shape[-1]
    if torch.compiler.is_compiling():
        # Advanced indexing gives (batch, heads, num_chunks, window, chunk, *rest) directly: flattening the symbolic
        # chunk count with the window (and splitting it back) is a reshape the tracer cannot prove (see `unblock`).
        rows = torch.arange(batch, device=x.device)[:, None, None, None]
        head_rows = torch.arange(heads, device=x.device)[None, :, None, None]
        out = x[rows, head_rows, index[:, None]]
        return out.view(batch, heads, num_chunks, window * chunk, *rest)
    offsets = torch.arange(batch * heads, device=x.device).view(batch, heads, 1) * num_chunks
    flat = (index.reshape(index.shape[0], 1, num_chunks * window) + offsets).reshape(-1)
    out = x.reshape(batch * heads * num_chunks, chunk, *rest).index_select(0, flat)
    return out.view(batch, heads, num_chunks, window * chunk, *rest)


def expand_keep(keep: torch.Tensor, chunk: int) -> torch.Tensor:
    """``(b, num_chunks, window)`` -> ``(b, 1, num_chunks, 1, window * chunk)``: the window mask per key row."""
    b, num_chunks, window = keep.shape
    return keep[..., None].expand(b, num_chunks, window, chunk).reshape(b, 1, num_chunks, 1, window * chunk)


def dense_probabilities(
    probs: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, length: int
) -> torch.Tensor:
    """Scatter chunked probabilities ``(batch, heads, C, c, K)`` whose queries sit at ``query_pos``
    ``(batch or 1, heads or 1, C, c)`` and keys at ``key_pos`` ``(batch or 1, heads or 1, C, K)`` into a dense
    ``(batch, heads, length, length)`` matrix (summing where a key appears more than once)."""
    batch, heads = probs.shape[:2]
    flat = (query_pos[..., :, None] * length + key_pos[..., None, :]).expand(probs.shape)
    dense = probs.new_zeros(batch, heads, length * length)
    dense.scatter_add_(2, flat.reshape(batch, heads, -1), probs.reshape(batch, heads, -1))
    return dense.view(batch, heads, length, length)


def corner_on_graph(attentions: torch.Tensor, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(corner, rebuilt)``: the ``(..., length, length)`` corner of ``attentions`` ``(..., P, P)`` (what the model
    returns when it padded the input to ``P``) and ``attentions`` rebuilt from that corner and the rest.

    ``rebuilt`` has the same values; computing the context from it puts the returned corner on the autograd path of
    the outputs (``retain_grad()`` on it gets a gradient), which a slice taken afterwards would not be.
    """
    full = attentions.shape[-1]
    if length is None or length >= full:
        return attentions, attentions
    corner = attentions[..., :length, :length]
    rest = attentions.clone()
    rest[..., :length, :length] = 0.0
    return corner, rest + nn.functional.pad(corner, (0, full - length, 0, full - length))


def real_chunk_count(padded_lengths: torch.Tensor | None, chunk: int, seq_len: int) -> torch.Tensor | None:
    """Chunks an example would have alone: ``ceil(padded_length / chunk)`` (at least 1); None when every example
    fills the batch (``padded_lengths`` None)."""
    if padded_lengths is None:
        return None
    return torch.clamp((padded_lengths.clamp(max=seq_len) + chunk - 1) // chunk, min=1)


class ChunkedSelfAttention(HfxSelfAttention, nn.Module):
    """What Reformer's two attentions share (:class:`HfxLocalSelfAttention`, and LSH's in ``lsh.py``): heads, chunks
    of ``chunk_length`` that attend to ``num_chunks_before`` / ``num_chunks_after`` neighbours, dropout on the
    probabilities, causality (``config.is_decoder``), and the ``config`` the kernel choice is read from at every
    forward."""

    def __init__(
        self, config, layer_idx: int, chunk_length: int, num_chunks_before: int, num_chunks_after: int, dropout: float
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.attention_head_size
        self.chunk_length = chunk_length
        self.num_chunks_before = num_chunks_before
        self.num_chunks_after = num_chunks_after
        self.is_decoder = config.is_decoder
        self.dropout = HfxDropout(dropout)
        # Read at every forward (kernel_choice): config._attn_implementation ("eager", "sdpa", ...) may change.
        self.config = config


class HfxLocalSelfAttention(ChunkedSelfAttention):
    """Reformer's chunked local attention with its own query, key and value projections (no biases).

    Called as in ``attention/base.py``; ``padded_lengths`` ``(batch,)`` is given by the Reformer model (see the
    module docstring). ``output_attentions`` returns dense probabilities ``(batch, heads, seq_len, seq_len)``.
    Inputs no longer than a chunk attend to the whole input (transformers' "standard" path, the same numbers).
    Scores, softmax and context compute in the projections' dtype (autocast's or the weights'), with masked keys at
    ``mask_value`` of that dtype.
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(
            config, layer_idx, config.local_attn_chunk_length, config.local_num_chunks_before,
            config.local_num_chunks_after, config.local_attention_probs_dropout_prob,
        )  # fmt: skip
        inner = self.num_heads * self.head_dim
        self.query = nn.Linear(config.hidden_size, inner, bias=False)
        self.key = nn.Linear(config.hidden_size, inner, bias=False)
        self.value = nn.Linear(config.hidden_size, inner, bias=False)

    def _qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if plain_linears(self.query, self.key, self.value):
            weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
            q, k, v = nn.functional.linear(hidden_states, weight).chunk(3, dim=-1)
        else:
            q, k, v = self.query(hidden_states), self.key(hidden_states), self.value(hidden_states)
        return split_heads(q, self.num_heads), split_heads(k, self.num_heads), split_heads(v, self.num_heads)

    def attend_tokens(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        padded_lengths: torch.Tensor | None = None,
        output_length: int | None = None,
        documents: DocumentLayout | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> context ``(batch, seq_len, heads * head_dim)``.

        ``output_length``: the model's real length when it padded the input; the returned attentions are then the
        ``(output_length, output_length)`` corner, on the autograd path of the context. ``documents``: the layout of
        a packed batch's documents in the input (its padding slots masked by ``attention_mask``); chunks then wrap
        around within each document (module docstring)."""
        implementation = self.kernel_choice(hidden_states)
        batch, seq_len, _ = hidden_states.shape
        q, k, v = self._qkv(hidden_states)
        k = k / math.sqrt(self.head_dim)
        keys = k
        # A branch rather than min(): on a symbolic length it becomes a guard (static per traced graph) instead of a
        # Min(...) expression that every later size inherits and the tracer cannot simplify.
        chunk = self.chunk_length if seq_len >= self.chunk_length else seq_len
        num_chunks = seq_len // chunk
        if num_chunks * chunk != seq_len:
            raise ValueError(
                f"Local attention got {seq_len} positions, not a multiple of local_attn_chunk_length "
                f"({self.chunk_length}); the Reformer model pads its inputs, call the model rather than the layer."
            )
        if documents is None:
            index, keep = neighbour_chunks(
                num_chunks, self.num_chunks_before, self.num_chunks_after,
                real_chunk_count(padded_lengths, chunk, seq_len), hidden_states.device,
            )  # fmt: skip
        else:
            first, count = documents.chunk_segments(chunk, num_chunks)
            index, keep = segment_neighbour_chunks(first, count, self.num_chunks_before, self.num_chunks_after)
        q = q.reshape(batch, self.num_heads, num_chunks, chunk, self.head_dim)
        k = gather_chunks(k.reshape(batch, self.num_heads, num_chunks, chunk, self.head_dim), index)
        values = v
        v = gather_chunks(v.reshape(batch, self.num_heads, num_chunks, chunk, self.head_dim), index)
        positions = torch.arange(seq_len, device=hidden_states.device).view(1, 1, num_chunks, chunk)
        # Key positions of every chunk's window, from the chunk ids (gathering an expanded position tensor would make
        # a traced graph decide whether the batch is 1).
        offsets = torch.arange(chunk, device=hidden_states.device)
        key_pos = (index[:, None, :, :, None] * chunk + offsets).flatten(-2)  # (b, 1, C, K)

        mask = expand_keep(keep, chunk)  # (b, 1, C, 1, K)
        if attention_mask is not None:
            key_real = gather_chunks(attention_mask.view(batch, 1, num_chunks, chunk), index)  # (batch, 1, C, K)
            mask = mask & key_real[:, :, :, None, :]
        if not output_attentions and flex_applies(implementation, hidden_states, self.training, self.dropout.p):
            context = self._flex_attention(
                q.flatten(2, 3), keys, values, index, keep, attention_mask, chunk, num_chunks, seq_len, documents
            )  # fmt: skip
            return AttentionOutput(merge_heads(context), None)
        if self.is_decoder:
            mask = mask & (positions[..., :, None] >= key_pos[..., None, :])
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores.masked_fill_(~mask, mask_value(scores.dtype))  # fresh: no copy needed
        probs = torch.softmax(scores, dim=-1)
        if output_attentions:
            # The context comes from the returned dense probabilities (the same numbers to rounding), so that they
            # are part of the autograd graph (`retain_grad()` on them gets a gradient).
            attentions, rebuilt = corner_on_graph(
                dense_probabilities(probs, positions, key_pos, seq_len), output_length
            )
            return AttentionOutput(merge_heads(torch.matmul(self.dropout(rebuilt), values)), attentions)
        context = unblock(torch.matmul(self.dropout(probs), v), seq_len, dim=2)  # (batch, heads, seq_len, head_dim)
        return AttentionOutput(merge_heads(context), None)

    def _flex_attention(self, q, k, v, index, keep, attention_mask, chunk, num_chunks, seq_len,
                        documents=None) -> torch.Tensor:  # fmt: skip
        """The chunk windows as FlexAttention's ``BlockMask`` over the whole sequence: ``q`` ``(batch, heads, seq_len,
        dim)``, ``k`` (already scaled by ``dim ** -0.5``) and ``v`` ``(batch, heads, seq_len, dim)`` -> the context
        ``(batch, heads, seq_len, dim)``.

        A key chunk that appears ``n`` times in a query chunk's window (a window wider than the chunk count, as in
        transformers) counts ``n`` times in the softmax: its scores get ``log n`` (``score_mod``), the same weights as
        ``n`` copies of the key. A packed row's mask (``documents``, every document's windows in one kernel over the
        internal row) is built once per forward and shared by every local layer: they all have the same chunks,
        windows, key mask and layout."""
        shared = None if documents is None else ("local", chunk, self.num_chunks_before, self.num_chunks_after,
                                                 self.is_decoder)  # fmt: skip
        if shared is not None and shared in documents.flex_masks:
            block_mask, repeats = documents.flex_masks[shared]
            return flex_attention(q, k, v, block_mask=block_mask, score_mod=repeats, scale=1.0)
        batch = q.shape[0]
        counts, log_counts = window_repeats(index, keep, num_chunks, batch)
        causal = self.is_decoder

        def in_window(b, h, q_idx, kv_idx):
            allowed = counts[b, q_idx // chunk, kv_idx // chunk] > 0
            if attention_mask is not None:
                allowed = allowed & attention_mask[b, kv_idx]
            if causal:
                allowed = allowed & (q_idx >= kv_idx)
            return allowed

        def repeats(score, b, h, q_idx, kv_idx):
            return score + log_counts[b, q_idx // chunk, kv_idx // chunk]

        block_mask = make_block_mask(in_window, batch, None, seq_len, seq_len, q.device)
        if shared is not None:
            documents.flex_masks[shared] = (block_mask, repeats)
        return flex_attention(q, k, v, block_mask=block_mask, score_mod=repeats, scale=1.0)

    def decode_step(
        self,
        hidden_states: torch.Tensor,
        past_states: torch.Tensor,
        past_buckets: torch.Tensor | None = None,
        num_hashes: int | None = None,
        output_attentions: bool = False,
        key_mask: torch.Tensor | None = None,
        padded_length: int | None = None,
    ) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        """One new position ``hidden_states`` ``(batch, 1, hidden)`` (normalised) against the cached normalised inputs
        ``past_states`` ``(batch, past_len, hidden)``: the same keys, with the same multiplicities and masks, as the
        last row of a causal full forward over all ``past_len + 1`` positions.

        ``key_mask`` ``(batch, past_len + 1)`` bool (True = real; None = nothing padded) masks padded keys, as the
        full forward's ``attention_mask``; ``padded_length`` is the length the model pads that full forward to
        (:func:`decode_padded_length`; None: ``past_len + 1``), whose chunks the new query's window follows. The new
        position is taken as real (``generate()`` always appends one). ``past_buckets`` and ``num_hashes`` are LSH's
        (:meth:`~hf_xformers.attention.lsh.HfxLSHSelfAttention.decode_step`, the same call) and unused here.

        Returns the context ``(batch, 1, heads * head_dim)``, None (no buckets) and, with ``output_attentions``, the
        probabilities over every position so far ``(batch, heads, 1, past_len + 1)`` (0 outside the window; a
        repeated chunk's keys add up, as in the full forward)."""
        length = past_states.shape[1] + 1
        padded = length if padded_length is None else padded_length
        chunk = self.chunk_length if padded >= self.chunk_length else padded
        query = torch.full((), length - 1, dtype=torch.long, device=hidden_states.device)
        slots = decode_window_slots(query, padded, chunk, self.num_chunks_before, self.num_chunks_after)  # (window,)
        # Slots past the sequence (the full forward's internal padding) or after the query: masked, as there.
        allowed = (slots < length)[None, :]
        if key_mask is not None:
            allowed = allowed & key_mask[:, slots.clamp(max=length - 1)]
        states = torch.cat([past_states, hidden_states], dim=1)[:, slots.clamp(max=length - 1)]
        q = split_heads(self.query(hidden_states), self.num_heads)
        k = split_heads(self.key(states), self.num_heads) / math.sqrt(self.head_dim)
        v = split_heads(self.value(states), self.num_heads)
        scores = torch.matmul(q, k.transpose(-1, -2))  # (batch, heads, 1, window)
        scores = scores.masked_fill(~allowed[:, None, None, :], mask_value(scores.dtype))
        probs = torch.softmax(scores, dim=-1)
        attentions = None
        if output_attentions:
            # Masked slots (clamped onto the query's own place) carry an exact 0.
            index = slots.clamp(max=length - 1).expand(probs.shape)
            attentions = probs.new_zeros(*probs.shape[:3], length).scatter_add(-1, index, probs)
        return merge_heads(torch.matmul(probs, v)), None, attentions


__all__ = [
    "ChunkedSelfAttention",
    "DocumentLayout",
    "HfxLocalSelfAttention",
    "decode_padded_length",
    "decode_window_slots",
    "dense_probabilities",
    "gather_chunks",
    "neighbour_chunks",
    "real_chunk_count",
    "segment_neighbour_chunks",
]
