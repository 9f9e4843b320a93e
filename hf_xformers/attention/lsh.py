"""LSH self-attention (Reformer, Kitaev et al. 2020), numerically as in transformers' ``LSHSelfAttention``.

Per head, one projection gives shared query-keys ``qk``; keys are ``qk`` normalised to unit RMS and scaled by
``1/sqrt(head_dim)``. Each round of hashing puts every position in a bucket (:mod:`~hf_xformers.attention.lsh_hashing`).
Positions are sorted by (round, bucket, position), cut into chunks of ``lsh_attn_chunk_length``, and each chunk attends
to itself and ``lsh_num_chunks_before/after`` neighbouring chunks (circularly). A query never attends to its own
position (logit :func:`self_mask_value`) unless nothing else is allowed; masked keys get ``mask_value(dtype)``. The
rounds are combined by the softmax of their log-normalisers, which equals one attention over the union of the rounds'
windows.

Precision: the rounds' log-normalisers and weights compute in float32 whatever the model's dtype or autocast state
(hashing too: ``lsh_hashing.py``). Scores, softmax and the weighted values compute in the dtype of the projections
(autocast's or the weights').

Padding: within an example's own extent (``padded_lengths``, see ``chunked_local.py``) padded positions take an extra
last bucket in every round, exactly as transformers does; positions beyond it are sorted after every round, so the
result does not depend on how far the batch is padded. An example no longer than a chunk attends to all of its
positions, as it would alone (transformers' "standard" path).

Packed documents (``documents``, a :class:`~hf_xformers.attention.chunked_local.DocumentLayout` of the internal row
the Reformer model lays them out in): positions are sorted by (document, round, bucket, position), so the rounds of
one document fill the sorted places of its region (``num_hashes`` times its length, chunk-aligned) in the order its
own forward sorts them, and its chunks wrap around among themselves as they do alone. A document no longer than a
chunk keeps each round's positions in one chunk that sees only itself: all of its positions in every round, the
attention it gets alone. No chunk holds two documents, so buckets never mix them.

Cached decoding (:meth:`HfxLSHSelfAttention.decode_step`) gives one new position the last row of that full forward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.attention_switch import flex_applies, flex_attention, flex_returns_lse, make_block_mask
from ..ops.precision import float32_autocast_off, mask_value
from ..ops.shapes import merge_heads, split_heads
from .base import AttentionOutput, plain_linears
from .chunked_local import (
    ChunkedSelfAttention,
    DocumentLayout,
    corner_on_graph,
    decode_window_slots,
    dense_probabilities,
    expand_keep,
    gather_chunks,
    neighbour_chunks,
    real_chunk_count,
    segment_neighbour_chunks,
    window_repeats,
)
from .lsh_hashing import LSHHashing, bucket_factors

# Logit of a query's own position in float32 and float64: transformers' value (parity).
SELF_MASK_VALUE = -1e5


def self_mask_value(dtype: torch.dtype) -> float:
    """Logit of a query's own position in scores of ``dtype``: below any real key, above masked keys
    (``mask_value(dtype)``), so a query attends to itself only when nothing else is allowed.

    float32 / float64: -1e5, transformers' value. 16-bit dtypes: half of ``mask_value(dtype)`` (-32752 in float16,
    about -1.7e38 in bfloat16), half-way between the masked logit and 0 in the dtype's own range. (transformers uses
    -1e3 in float16, which a real logit of a large query, ``|qk| > 1e3``, could pass; in bfloat16 it keeps -1e5,
    which bfloat16 rounds to -99840.) Both choices give the same probabilities wherever a real key exists: exp of the
    difference is 0 in either.
    """
    if torch.finfo(dtype).bits >= 32:
        return SELF_MASK_VALUE
    return mask_value(dtype) / 2


def unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class HfxLSHSelfAttention(LSHHashing, ChunkedSelfAttention):
    """LSH attention with a shared query-key projection ``query_key`` and ``value`` (no biases; transformers' names).

    ``forward`` takes the inputs of ``attention/base.py`` plus ``padded_lengths`` ``(batch,)``, ``num_hashes`` (None:
    the config's) and ``buckets`` ``(batch, heads, rounds, seq)`` (reuse the buckets of an earlier call: the
    reversible backward pass recomputes the layer with the forward's buckets). Returns the context and, as
    ``extra``, the buckets used (None on the full-attention path). ``output_attentions`` gives the effective dense
    probabilities ``(batch, heads, seq, seq)`` (rounds combined). Hashing: :class:`LSHHashing`.
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(
            config, layer_idx, config.lsh_attn_chunk_length, config.lsh_num_chunks_before,
            config.lsh_num_chunks_after, config.lsh_attention_probs_dropout_prob,
        )  # fmt: skip
        self.num_hashes = config.num_hashes
        self.num_buckets = config.num_buckets
        self.hash_seed = config.hash_seed
        inner = self.num_heads * self.head_dim
        self.query_key = nn.Linear(config.hidden_size, inner, bias=False)
        self.value = nn.Linear(config.hidden_size, inner, bias=False)
        # Fixed rotations (hash_seed, or the layer index when there is none): eval, and training with a hash_seed.
        # Drawn once on the CPU from the seed, so every device hashes with the same numbers; a buffer, so the model's
        # `.to(device)` keeps a copy on its device (float32 always: see `_apply`).
        self.register_buffer("rotations", self.fixed_rotations(self.num_hashes), persistent=False)

    # ----- attention -----------------------------------------------------------------------------------------
    def _scores(self, q, k, q_pos, k_pos, key_real, keep):
        """Masked logits: ``q`` ``(..., n, d)``, ``k`` ``(..., m, d)``; positions/real flags broadcast to the keys."""
        scores = torch.matmul(q, k.transpose(-1, -2))
        mask = keep
        if key_real is not None:
            mask = key_real[..., None, :] if mask is None else mask & key_real[..., None, :]
        if self.is_decoder:
            causal = q_pos[..., :, None] >= k_pos[..., None, :]
            mask = causal if mask is None else mask & causal
        # In place: the product is a fresh tensor that its backward does not need (a copy here cost ~5 % of a forward).
        if mask is not None:
            scores.masked_fill_(~mask, mask_value(scores.dtype))
        return scores.masked_fill_(q_pos[..., :, None] == k_pos[..., None, :], self_mask_value(scores.dtype))

    def _full(self, qk, v, attention_mask, output_attentions, output_length=None):
        """Every position attends to every other (inputs no longer than a chunk). Returns context, probabilities."""
        seq_len = qk.shape[2]
        pos = torch.arange(seq_len, device=qk.device)
        key_real = None if attention_mask is None else attention_mask[:, None, :]
        scores = self._scores(qk, unit_rms(qk) / math.sqrt(self.head_dim), pos, pos, key_real, None)
        probs = torch.softmax(scores, dim=-1)
        if not output_attentions:
            return torch.matmul(self.dropout(probs), v), None
        probs, rebuilt = corner_on_graph(probs, output_length)
        return torch.matmul(self.dropout(rebuilt), v), probs

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared query-keys and the values of ``(batch, seq, hidden)``: each ``(batch, heads, seq, head_dim)``."""
        if plain_linears(self.query_key, self.value):
            weight = torch.cat([self.query_key.weight, self.value.weight])
            qk, v = nn.functional.linear(hidden_states, weight).chunk(2, dim=-1)
        else:
            qk, v = self.query_key(hidden_states), self.value(hidden_states)
        return split_heads(qk, self.num_heads), split_heads(v, self.num_heads)

    def attend_tokens(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        padded_lengths: torch.Tensor | None = None,
        num_hashes: int | None = None,
        buckets: torch.Tensor | None = None,
        output_length: int | None = None,
        documents: DocumentLayout | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> context ``(batch, seq_len, heads * head_dim)``.

        ``output_length``: the model's real length when it padded the input (see ``HfxLocalSelfAttention``).
        ``documents``: the layout of a packed batch's documents in the input (its padding slots masked by
        ``attention_mask``); buckets and chunks then stay within each document (module docstring)."""
        implementation = self.kernel_choice(hidden_states)
        num_hashes = self.num_hashes if num_hashes is None else num_hashes
        seq_len = hidden_states.shape[1]
        qk, v = self._project(hidden_states)
        chunk = self.chunk_length
        if seq_len <= chunk and documents is None:
            context, attentions = self._full(qk, v, attention_mask, output_attentions, output_length)
            return AttentionOutput(merge_heads(context), attentions, None)
        if seq_len % chunk:
            raise ValueError(
                f"LSH attention got {seq_len} positions, not a multiple of lsh_attn_chunk_length ({chunk}); the "
                "Reformer model pads its inputs, call the model rather than the layer."
            )
        if buckets is None:
            buckets = self.bucket(self.hash_input(hidden_states, qk), num_hashes)
        elif self.training and self.hash_seed is None:
            # The caller's buckets may come from a different rotation draw (the reversible recomputation): draw
            # anyway, so that the random generator advances exactly as in the call that made them.
            self.rotations_for(num_hashes, qk)
        order = self._sort_order(buckets, attention_mask, padded_lengths, documents)
        flex = not output_attentions and flex_applies(implementation, qk, self.training, self.dropout.p)
        context, attentions = self._sorted_attention(
            qk, v, order, attention_mask, padded_lengths, documents, output_attentions, flex
        )
        if padded_lengths is not None and num_hashes > 1:
            context, attentions = self._whole_short_examples(
                qk, v, attention_mask, padded_lengths, context, attentions, output_attentions
            )
        if output_attentions:
            # The context comes from the returned dense probabilities (rounds combined; the same numbers to rounding),
            # so that they are part of the autograd graph (`retain_grad()` on them gets a gradient).
            attentions, rebuilt = corner_on_graph(attentions, output_length)
            context = torch.matmul(self.dropout(rebuilt), v)
        return AttentionOutput(merge_heads(context), attentions, buckets)

    def _sort_order(
        self,
        buckets: torch.Tensor,
        attention_mask: torch.Tensor | None,
        padded_lengths: torch.Tensor | None,
        documents: DocumentLayout | None,
    ) -> torch.Tensor:
        """The positions of every round in sorted order: ``buckets`` ``(batch, heads, rounds, seq)`` -> ``(batch,
        heads, rounds * seq)`` slot indices ``round * seq + position``, sorted by (document, round, bucket,
        position), padding in an extra last bucket and what lies beyond an example's (or document's) extent after
        every round."""
        num_hashes, seq_len = buckets.shape[2], buckets.shape[3]
        device = buckets.device
        extra_bucket = math.prod(bucket_factors(self.num_buckets))
        rounds = torch.arange(num_hashes, device=device).view(1, 1, -1, 1)
        key = (
            buckets if attention_mask is None else buckets.masked_fill(~attention_mask[:, None, None, :], extra_bucket)
        )
        key = key + rounds * (extra_bucket + 1)
        if padded_lengths is not None:
            beyond = torch.arange(seq_len, device=device) >= padded_lengths[:, None]  # (batch, seq)
            key = key.masked_fill(beyond[:, None, None, :], num_hashes * (extra_bucket + 1))
        if documents is not None:
            # A document longer than a chunk sorts what lies beyond its solo length after all of its rounds, as
            # `padded_lengths` does for an example; one no longer than a chunk keeps each round in place (its real
            # positions then fill the first chunk of the round).
            solo = documents.solo_length
            inside = torch.arange(seq_len, device=device) - documents.region_start
            beyond = (solo > self.chunk_length) & (inside >= solo)
            key = key.masked_fill(beyond[:, None, None, :], num_hashes * (extra_bucket + 1))
            # Documents first: each one's sorted places are its region's, `num_hashes` times over.
            key = key + documents.region_start[:, None, None, :] * (num_hashes * (extra_bucket + 1) + 1)
        # Sort by (round, bucket); ties keep (round, position) order, as transformers' stable argsort.
        if torch.compiler.is_compiling():
            # ONNX has no stable sort: traced graphs make every key distinct (slot index as the last digit), which
            # gives a plain sort the same order.
            # (The rounds are concatenated rather than flattened: merging the static round count with a symbolic
            # length is a reshape the tracer cannot prove.)
            flat_key = torch.cat(key.unbind(2), dim=-1)
            slots = torch.arange(flat_key.shape[-1], device=device)
            return torch.argsort(flat_key * flat_key.shape[-1] + slots, dim=-1)
        return torch.argsort(key.flatten(2), dim=-1, stable=True)  # (batch, heads, rounds * seq)

    def _sorted_attention(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        order: torch.Tensor,
        attention_mask: torch.Tensor | None,
        padded_lengths: torch.Tensor | None,
        documents: DocumentLayout | None,
        output_attentions: bool,
        flex: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every sorted chunk over its window, the sort undone and the rounds combined: ``qk``, ``v`` ``(batch, heads,
        seq, d)`` and ``order`` from :meth:`_sort_order` -> context ``(batch, heads, seq, d)`` and, with
        ``output_attentions``, the dense probabilities ``(batch, heads, seq, seq)``. ``flex``: FlexAttention runs
        it (where it can return the log-normalisers that several rounds need)."""
        batch, heads, seq_len, _ = qk.shape
        chunk = self.chunk_length
        num_hashes = order.shape[-1] // seq_len
        # Position of every sorted slot, order % seq_len, as a lookup (a modulo by a symbolic length does not convert
        # to ONNX).
        token = torch.arange(seq_len, device=qk.device).repeat(num_hashes)[order]
        total = num_hashes * seq_len
        num_chunks = total // chunk

        # Row numbers of (batch, head, position) in a flattened (batch * heads * seq, d) view: sorting and unsorting
        # are then single index_select calls, which read the index once instead of once per feature.
        head_rows = torch.arange(batch * heads, device=qk.device).view(batch, heads, 1) * seq_len

        def chunked(x):
            rows = x.reshape(-1, x.shape[-1]).index_select(0, (token + head_rows).flatten())
            return rows.view(batch, heads, num_chunks, chunk, x.shape[-1])

        if documents is None:
            real = None if padded_lengths is None else num_hashes * padded_lengths
            index, keep = neighbour_chunks(
                num_chunks, self.num_chunks_before, self.num_chunks_after,
                real_chunk_count(real, chunk, total), qk.device,
            )  # fmt: skip
        else:
            first, count = documents.chunk_segments(chunk, num_chunks, num_hashes)
            index, keep = segment_neighbour_chunks(first, count, self.num_chunks_before, self.num_chunks_after)
        q = chunked(qk)
        q_pos = token.view(batch, heads, num_chunks, chunk)
        # Combining rounds needs each row's log-normaliser, which compiled FlexAttention returns on CUDA but not (torch
        # 2.13) on the CPU, where several rounds keep the chunked kernel below (the same numbers).
        if flex and (num_hashes == 1 or flex_returns_lse(qk.device)):
            context, log_norm = self._flex_sorted(q.flatten(2, 3), chunked(v).flatten(2, 3), token, index, keep,
                                                  attention_mask, chunk, num_chunks, num_hashes > 1)  # fmt: skip
            context, probs, k_pos = context.reshape(-1, self.head_dim), None, None
        else:
            context, probs, k_pos, log_norm = self._chunked_sorted(
                q, chunked(v), q_pos, index, keep, attention_mask, num_hashes > 1
            )
        # Undo the sort: sorted slot s holds round order[s] // seq_len of position order[s] % seq_len.
        undo = torch.argsort(order, dim=-1)
        undo_rows = (undo + head_rows * num_hashes).flatten()
        context = context.index_select(0, undo_rows).view(batch, heads, num_hashes, seq_len, self.head_dim)
        weights = None
        if num_hashes > 1:
            # Each round's softmax is normalised over its own window; weighting the rounds by the softmax of their
            # log-normalisers gives one softmax over the union of the windows. Statistics in float32: in 16 bits a
            # log-normaliser of a few units is off by ~1e-2, and so is every round weight.
            with float32_autocast_off(qk.device.type):
                log_norm = log_norm.float().flatten().index_select(0, undo_rows)
                weights = torch.softmax(log_norm.view(batch, heads, num_hashes, seq_len), dim=2)
            weights = weights.to(context.dtype)
            context = (context * weights[..., None]).sum(2)
        else:
            context = context.squeeze(2)
        if not output_attentions:
            return context, None
        if weights is not None:
            probs = probs * weights.flatten(2).gather(2, order).view(q_pos.shape)[..., None]
        return context, dense_probabilities(probs, q_pos, k_pos, seq_len)

    def _chunked_sorted(
        self,
        q: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        index: torch.Tensor,
        keep: torch.Tensor,
        attention_mask: torch.Tensor | None,
        need_log_norm: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The sorted chunks, each over the chunks of its window (``index``, ``keep`` ``(batch or 1, C, window)``):
        ``q`` / ``v`` ``(batch, heads, C, c, d)`` in bucket order at positions ``q_pos`` ``(batch, heads, C, c)``.
        Returns the context ``(batch * heads * C * c, d)``, the probabilities ``(batch, heads, C, c, window * c)``,
        the key positions ``(batch, heads, C, window * c)`` and, with ``need_log_norm`` (several rounds), the
        log-normaliser of every row ``(batch, heads, C, c)`` in float32 (else None)."""
        batch, chunk = q.shape[0], q.shape[3]
        k = gather_chunks(unit_rms(q) / math.sqrt(self.head_dim), index)
        v_sorted = gather_chunks(v, index)
        k_pos = gather_chunks(q_pos, index)
        key_real = None
        if attention_mask is not None:
            key_real = attention_mask[torch.arange(batch, device=q.device)[:, None, None, None], k_pos]
        scores = self._scores(q, k, q_pos, k_pos, key_real, expand_keep(keep, chunk))
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(self.dropout(probs), v_sorted).view(-1, self.head_dim)
        log_norm = None
        if need_log_norm:
            with float32_autocast_off(q.device.type):  # round statistics in float32 (see `_sorted_attention`)
                log_norm = torch.logsumexp(scores.float(), dim=-1)
        return context, probs, k_pos, log_norm

    def _whole_short_examples(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        padded_lengths: torch.Tensor,
        context: torch.Tensor,
        attentions: torch.Tensor | None,
        output_attentions: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``context`` ``(batch, heads, seq, d)`` (and ``attentions``) with the examples no longer than a chunk
        replaced by full attention over their positions, as they get alone. (With one round the sorted path already
        does: such an example fills one chunk, whose repeated neighbours are dropped.)"""
        seq_len, chunk = qk.shape[2], self.chunk_length
        short = padded_lengths <= chunk  # (batch,)
        mask_head = None if attention_mask is None else attention_mask[:, :chunk]
        head_context, head_probs = self._full(qk[:, :, :chunk], v[:, :, :chunk], mask_head, output_attentions)
        padded_head = nn.functional.pad(head_context, (0, 0, 0, seq_len - chunk))
        context = torch.where(short[:, None, None, None], padded_head, context)
        if output_attentions:
            padded_probs = nn.functional.pad(head_probs, (0, seq_len - chunk, 0, seq_len - chunk))
            attentions = torch.where(short[:, None, None, None], padded_probs, attentions)
        return context, attentions

    def _flex_sorted(self, q, v, token, index, keep, attention_mask, chunk, num_chunks, need_log_norm):
        """The sorted chunks under FlexAttention: ``q`` / ``v`` ``(batch, heads, rounds * seq_len, dim)`` in bucket
        order, ``token`` ``(batch, heads, rounds * seq_len)`` their positions. Returns the context in the same order
        and the log-normaliser of every row (``(batch, heads, rounds * seq_len)``, for combining the rounds).

        The ``BlockMask`` holds each chunk's window (a chunk repeated in a window counts as often, through ``log n``
        in the ``score_mod``); the mask asks for real keys and, in decoders, earlier positions, and a query's own
        position always stays with the logit :func:`self_mask_value` (the ``score_mod`` replaces its score), as
        in the chunked computation. The log-normalisers are None unless ``need_log_norm``."""
        batch, heads, total, _ = q.shape
        keys = unit_rms(q) / math.sqrt(self.head_dim)
        counts, log_counts = window_repeats(index, keep, num_chunks, batch)
        causal, own_logit = self.is_decoder, self_mask_value(q.dtype)

        def allowed(b, h, i, j):
            key_ok = attention_mask[b, token[b, h, j]] if attention_mask is not None else token[b, h, j] >= 0
            if causal:
                key_ok = key_ok & (token[b, h, i] >= token[b, h, j])
            return (counts[b, i // chunk, j // chunk] > 0) & (key_ok | (token[b, h, i] == token[b, h, j]))

        def own_position_and_repeats(score, b, h, i, j):
            score = torch.where(token[b, h, i] == token[b, h, j], own_logit, score)
            return score + log_counts[b, i // chunk, j // chunk]

        block_mask = make_block_mask(allowed, batch, heads, total, total, q.device)
        if not need_log_norm:
            context = flex_attention(q, keys, v, block_mask=block_mask, score_mod=own_position_and_repeats, scale=1.0)
            return context, None
        return flex_attention(
            q, keys, v, block_mask=block_mask, score_mod=own_position_and_repeats, scale=1.0, return_lse=True
        )

    # ----- cached decoding -----------------------------------------------------------------------------------
    def decode_step(
        self,
        hidden_states: torch.Tensor,
        past_states: torch.Tensor,
        past_buckets: torch.Tensor | None = None,
        num_hashes: int | None = None,
        output_attentions: bool = False,
        key_mask: torch.Tensor | None = None,
        padded_length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One new position ``hidden_states`` ``(batch, 1, hidden)`` (normalised) against the cached normalised
        inputs ``past_states`` ``(batch, past_len, hidden)`` and their buckets ``(batch, heads, rounds, past_len)``
        (None until they are first needed): the last row of a causal full forward over all ``past_len + 1``
        positions, which the model pads to ``padded_length`` (None: no padding).

        As that forward does, every round sorts the positions by bucket (padded keys, ``key_mask`` False, in an
        extra last bucket, the internal padding after them), the rounds lie end to end, and the new query attends
        to the chunks of sorted slots around its own (circularly over all rounds, a chunk repeated as often as it
        appears); keys and values are recomputed from the cached states of the positions found there. A full
        forward no longer than a chunk attends to every position instead. The new position is taken as real.

        Returns the context ``(batch, 1, heads * head_dim)``, the buckets of all ``past_len + 1`` positions (None
        while the full forward hashes nothing) and, with ``output_attentions``, the probabilities over every
        position so far ``(batch, heads, 1, past_len + 1)`` (rounds combined with their weights; 0 elsewhere)."""
        num_hashes = self.num_hashes if num_hashes is None else num_hashes
        states = torch.cat([past_states, hidden_states], dim=1)
        length = states.shape[1]
        padded = length if padded_length is None else padded_length
        q = split_heads(self.query_key(hidden_states), self.num_heads)  # (batch, heads, 1, d)
        if padded <= self.chunk_length:
            context, probs = self._decode_whole(q, states, key_mask)
            return context, None, (probs if output_attentions else None)
        buckets = self._decode_buckets(states, q, past_buckets, num_hashes)  # (batch, heads, rounds, length)
        token, real = self._decode_window(buckets, key_mask, padded)
        qk, v = self._decode_keys(states, token)
        scores = torch.matmul(q[:, :, None], (unit_rms(qk) / math.sqrt(self.head_dim)).transpose(-1, -2))
        scores = scores.masked_fill(~real[..., None, :], mask_value(scores.dtype))
        own = (token == length - 1) & real
        scores = scores.masked_fill(own[..., None, :], self_mask_value(scores.dtype))  # (b, h, rounds, 1, window)
        with float32_autocast_off(states.device.type):  # softmax statistics in float32, as in `forward`
            log_norm = torch.logsumexp(scores.float(), dim=-1, keepdim=True)
            probs = torch.exp(scores.float() - log_norm)
            weights = torch.softmax(log_norm, dim=2)
        context = torch.matmul(probs.to(v.dtype), v)  # (batch, heads, rounds, 1, d)
        context = (context * weights.to(context.dtype)).sum(2)
        attentions = None
        if output_attentions:
            # A position may sit in the window more than once (the window wraps around): its weights add up; masked
            # slots carry an exact 0.
            weighted = (probs * weights).squeeze(-2).to(v.dtype)  # (batch, heads, rounds, window)
            attentions = weighted.new_zeros(*weighted.shape[:2], length)
            attentions = attentions.scatter_add(-1, token.flatten(2), weighted.flatten(2))[:, :, None]
        return merge_heads(context), buckets, attentions

    def _decode_whole(
        self, q: torch.Tensor, states: torch.Tensor, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A full forward no longer than a chunk: the new query ``q`` ``(batch, heads, 1, d)`` over every position of
        ``states`` ``(batch, length, hidden)``. Returns the context ``(batch, 1, heads * d)`` and the probabilities
        ``(batch, heads, 1, length)``."""
        qk = split_heads(self.query_key(states), self.num_heads)
        v = split_heads(self.value(states), self.num_heads)
        scores = torch.matmul(q, (unit_rms(qk) / math.sqrt(self.head_dim)).transpose(-1, -2))
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], mask_value(scores.dtype))
        scores[..., -1] = self_mask_value(scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        return merge_heads(torch.matmul(probs, v)), probs

    def _decode_window(
        self, buckets: torch.Tensor, key_mask: torch.Tensor | None, padded: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions the new (last) query attends to in every round, as the full forward over ``padded`` slots
        sorts them: ``buckets`` ``(batch, heads, rounds, length)`` -> positions ``(batch, heads, rounds, window)``
        (clamped into the sequence) and whether each is a real key."""
        batch, heads, num_hashes, length = buckets.shape
        extra_bucket = math.prod(bucket_factors(self.num_buckets))
        key = buckets if key_mask is None else buckets.masked_fill(~key_mask[:, None, None, :], extra_bucket)
        # The full forward's internal padding: masked, sorted after every real position of each round.
        key = nn.functional.pad(key, (0, padded - length), value=extra_bucket)
        order = torch.argsort(key, dim=-1, stable=True).flatten(2)  # (batch, heads, rounds * padded) positions
        slot = (order == length - 1).to(torch.int64).view(batch, heads, num_hashes, padded).argmax(-1)
        slot = slot + torch.arange(num_hashes, device=buckets.device) * padded  # (batch, heads, rounds)
        window = decode_window_slots(slot, num_hashes * padded, self.chunk_length, self.num_chunks_before,
                                     self.num_chunks_after)  # fmt: skip
        token = order.gather(-1, window.flatten(2)).view(*window.shape)  # (batch, heads, rounds, window)
        real = token < length
        if key_mask is not None:
            real = real & key_mask.gather(1, token.clamp(max=length - 1).flatten(1)).view(token.shape)
        return token.clamp(max=length - 1), real  # internal padding (masked) reads any cached state

    def _decode_keys(self, states: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Query-keys and values recomputed from the cached ``states`` ``(batch, length, hidden)`` at ``token``
        ``(batch, heads, rounds, window)``, each head's from its own projection: ``(batch, heads, rounds, window,
        d)`` each."""
        batch, hidden = states.shape[0], states.shape[2]
        picked = states[torch.arange(batch, device=states.device).view(-1, 1), token.flatten(1)]
        picked = picked.view(*token.shape, hidden)
        if plain_linears(self.query_key, self.value):
            per_head = (self.num_heads, self.head_dim, hidden)
            qk = torch.einsum("bhnkx,hdx->bhnkd", picked, self.query_key.weight.view(per_head))
            v = torch.einsum("bhnkx,hdx->bhnkd", picked, self.value.weight.view(per_head))
            return qk, v
        # An adapter (LoRA ...) changes the projections: call them, keep each head's own slice.
        heads = torch.arange(self.num_heads, device=states.device)
        qk, v = (
            linear(picked)
            .view(*picked.shape[:-1], self.num_heads, self.head_dim)[:, heads, :, :, heads]
            .transpose(0, 1)
            for linear in (self.query_key, self.value)
        )
        return qk, v

    def _decode_buckets(
        self, states: torch.Tensor, query: torch.Tensor, past_buckets: torch.Tensor | None, num_hashes: int
    ) -> torch.Tensor:
        """Buckets of all positions ``(batch, heads, rounds, length)``: the cached ones and the new query's
        (``query`` ``(batch, heads, 1, d)``), or all of them hashed from ``states`` when none are cached yet."""
        length = states.shape[1]
        if past_buckets is not None and past_buckets.shape[-1] == length - 1 and past_buckets.shape[2] == num_hashes:
            return torch.cat([past_buckets, self.bucket(self.hash_input(states[:, -1:], query), num_hashes)], dim=-1)
        qk = split_heads(self.query_key(states), self.num_heads)
        return self.bucket(self.hash_input(states, qk), num_hashes)


__all__ = ["HfxLSHSelfAttention", "SELF_MASK_VALUE", "self_mask_value", "unit_rms"]
