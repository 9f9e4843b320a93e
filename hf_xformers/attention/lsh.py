"""LSH self-attention (Reformer, Kitaev et al. 2020), numerically as in transformers' ``LSHSelfAttention``.

Per head, one projection gives shared query-keys ``qk``; keys are ``qk`` normalised to unit RMS and scaled by
``1/sqrt(head_dim)``. Each round of hashing maps ``qk`` through a random rotation ``R`` (``head_dim x n/2``) and takes
``argmax([xR, -xR])`` as the bucket (angular LSH; a pair of bucket factors hashes twice and combines). Positions are
sorted by (round, bucket, position), cut into chunks of ``lsh_attn_chunk_length``, and each chunk attends to itself and
``lsh_num_chunks_before/after`` neighbouring chunks (circularly). A query never attends to its own position
(logit :func:`self_mask_value`) unless nothing else is allowed; masked keys get ``mask_value(dtype)``. The rounds are
combined by the softmax of their log-normalisers, which equals one attention over the union of the rounds' windows.

Precision: hashing (rotations and argmax) and the rounds' log-normalisers and weights compute in float32 whatever the
model's dtype or autocast state, so that a bfloat16 / float16 model puts positions in the buckets of the float32 model
(a bucket flip moves a position to other keys entirely); the rotations stay float32 when the module is cast. Scores,
softmax and the weighted values compute in the dtype of the projections (autocast's or the weights').

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
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.attention_switch import (
    attention_implementation,
    flex_applies,
    flex_attention,
    flex_returns_lse,
    make_block_mask,
)
from ..ops.fast_dropout import HfxDropout
from ..ops.precision import float32_autocast_off, mask_value
from ..ops.shapes import merge_heads, split_heads
from .base import AttentionOutput, plain_linears
from .chunked_local import (
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


def bucket_factors(num_buckets: int | list[int]) -> list[int]:
    return [num_buckets] if isinstance(num_buckets, int) else list(num_buckets)


def draw_rotations(
    num_heads: int, head_dim: int, num_hashes: int, num_buckets: int | list[int], seed: int | None = None
) -> torch.Tensor:
    """Random rotations ``(heads, head_dim, num_hashes, sum(factors) / 2)`` float32, from ``seed`` (the same numbers as
    ``torch.manual_seed(seed); torch.randn(...)``, which transformers uses) or from the global generator.

    Float32 whatever the default dtype (a model built under a 16-bit default, as ``from_pretrained(dtype=...)`` builds
    it): a 16-bit draw gives other numbers, and other buckets than the float32 model's."""
    shape = (num_heads, head_dim, num_hashes, sum(bucket_factors(num_buckets)) // 2)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def hash_buckets(qk: torch.Tensor, rotations: torch.Tensor, num_buckets: int | list[int]) -> torch.Tensor:
    """Bucket of every position in every round: ``qk`` ``(batch, heads, seq, head_dim)`` -> ``(batch, heads, rounds,
    seq)`` long, in ``[0, prod(factors))``.

    Computes in float32 (``qk`` and ``rotations`` are cast, autocast is off): in 16 bits the rotated coordinates of
    nearby directions round to ties or swap, and positions land in other buckets than the float32 model's."""
    with float32_autocast_off(qk.device.type):
        rotated = torch.einsum("bhtd,hdnr->bhntr", qk.detach().float(), rotations.float())
    buckets, start, scale = None, 0, 1
    for factor in bucket_factors(num_buckets):
        part = rotated[..., start : start + factor // 2]
        bucket = torch.argmax(torch.cat([part, -part], dim=-1), dim=-1)
        buckets = bucket if buckets is None else buckets + scale * bucket
        start, scale = start + factor // 2, scale * factor
    return buckets


def unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class HfxLSHSelfAttention(nn.Module):
    """LSH attention with a shared query-key projection ``query_key`` and ``value`` (no biases; transformers' names).

    ``forward`` takes the inputs of ``attention/base.py`` plus ``padded_lengths`` ``(batch,)``, ``num_hashes`` (None:
    the config's) and ``buckets`` ``(batch, heads, rounds, seq)`` (reuse the buckets of an earlier call: the
    reversible backward pass recomputes the layer with the forward's buckets). Returns the context and, as
    ``extra``, the buckets used (None on the full-attention path). ``output_attentions`` gives the effective dense
    probabilities ``(batch, heads, seq, seq)`` (rounds combined).
    """

    supports_global_attention = False

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.attention_head_size
        self.chunk_length = config.lsh_attn_chunk_length
        self.num_chunks_before = config.lsh_num_chunks_before
        self.num_chunks_after = config.lsh_num_chunks_after
        self.num_hashes = config.num_hashes
        self.num_buckets = config.num_buckets
        self.hash_seed = config.hash_seed
        self.is_decoder = config.is_decoder
        inner = self.num_heads * self.head_dim
        self.query_key = nn.Linear(config.hidden_size, inner, bias=False)
        self.value = nn.Linear(config.hidden_size, inner, bias=False)
        self.dropout = HfxDropout(config.lsh_attention_probs_dropout_prob)
        # Read at every forward: config._attn_implementation ("eager", "sdpa", "flex_attention") may change.
        self.config = config
        # Fixed rotations (hash_seed, or the layer index when there is none): eval, and training with a hash_seed.
        # Drawn once on the CPU from the seed, so every device hashes with the same numbers; a buffer, so the model's
        # `.to(device)` keeps a copy on its device (float32 always: see `_apply`).
        self.register_buffer("rotations", self.fixed_rotations(self.num_hashes), persistent=False)

    def _apply(self, fn, recurse=True):
        # `.half()` / `.to(torch.bfloat16)` would round the rotations, and the cast model would hash into other buckets
        # than the float32 one: keep them float32 on whatever device `fn` moved them to.
        exact = self.rotations
        result = super()._apply(fn, recurse)
        moved = self.rotations
        if moved.dtype != torch.float32:
            self.rotations = (moved if exact.is_meta else exact).to(device=moved.device, dtype=torch.float32)
        return result

    # ----- hashing -------------------------------------------------------------------------------------------
    def fixed_rotations(self, num_hashes: int) -> torch.Tensor:
        seed = self.layer_idx if self.hash_seed is None else self.hash_seed
        return draw_rotations(self.num_heads, self.head_dim, num_hashes, self.num_buckets, seed)

    def rotations_for(self, num_hashes: int, like: torch.Tensor) -> torch.Tensor:
        """Rotations ``(heads, head_dim, num_hashes, sum(factors) / 2)`` float32 on ``like``'s device."""
        if self.training and self.hash_seed is None:
            # Fresh rotations every training call, drawn on the input's device from its global generator (no CPU draw
            # and copy per layer and step). Only their distribution is specified: the numbers depend on the device's
            # generator. The reversible backward pass restores that generator's state, so the recomputation draws the
            # same numbers.
            shape = (self.num_heads, self.head_dim, num_hashes, sum(bucket_factors(self.num_buckets)) // 2)
            return torch.randn(shape, device=like.device, dtype=torch.float32)
        if num_hashes == self.num_hashes:
            return self.rotations.to(device=like.device, dtype=torch.float32)  # the buffer itself: no copy
        # A `num_hashes` other than the config's (an evaluation option): seeded rotations of that shape, drawn on the
        # CPU for the same numbers on every device (a few KB per call and layer; not kept, as nothing keyed by call
        # arguments is).
        return self.fixed_rotations(num_hashes).to(like.device)

    def bucket(self, qk: torch.Tensor, num_hashes: int) -> torch.Tensor:
        """``(batch, heads, seq, head_dim)`` -> buckets ``(batch, heads, num_hashes, seq)``."""
        return hash_buckets(qk, self.rotations_for(num_hashes, qk), self.num_buckets)

    def hash_input(self, hidden_states: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """The query-keys to hash: ``qk`` ``(batch, heads, seq, head_dim)`` itself, or under autocast with fixed
        rotations (eval, or a ``hash_seed``) the projection of ``hidden_states`` ``(batch, seq, hidden)`` recomputed in
        float32.

        Why: hashing float32 rotations of a 16-bit ``qk`` still flips ~0.4 % of the buckets (the projection's
        rounding decides near-ties of the argmax), and one flip re-sorts whole chunks: measured on one LSH layer
        (4 x 256 tokens, 1 and 4 rounds), a relative deviation of the context from float32 of 11-24 % under bfloat16
        autocast and 2-14 % under float16, against 0.6-1.2 % and 0.07-0.15 % with the float32 model's buckets. With
        the projection in float32 (and a float32 layer input, as autocast's LayerNorm gives) the buckets are the float32
        model's, for one more float32 matmul of the size of the ``qk`` projection. Training with fresh rotations per
        call skips it (the hash is random there anyway), and so do half-precision weights (their rounded weights give
        other buckets than the float32 model's however the projection computes)."""
        device_type = hidden_states.device.type
        if not torch.is_autocast_enabled(device_type) or (self.training and self.hash_seed is None):
            return qk
        if not plain_linears(self.query_key):
            return qk  # an adapter (LoRA ...) changes the projection: hash what it computed
        with float32_autocast_off(device_type):
            projected = nn.functional.linear(hidden_states.float(), self.query_key.weight.float())
        return split_heads(projected, self.num_heads)

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

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
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
        num_hashes = self.num_hashes if num_hashes is None else num_hashes
        batch, seq_len, _ = hidden_states.shape
        if plain_linears(self.query_key, self.value):
            weight = torch.cat([self.query_key.weight, self.value.weight])
            qk, v = nn.functional.linear(hidden_states, weight).chunk(2, dim=-1)
        else:
            qk, v = self.query_key(hidden_states), self.value(hidden_states)
        qk, v = split_heads(qk, self.num_heads), split_heads(v, self.num_heads)
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
        else:
            # The caller's buckets may come from a different rotation draw (the reversible recomputation): draw
            # anyway, so that the random generator advances exactly as in the call that made them.
            if self.training and self.hash_seed is None:
                self.rotations_for(num_hashes, qk)
        extra_bucket = math.prod(bucket_factors(self.num_buckets))
        rounds = torch.arange(num_hashes, device=qk.device).view(1, 1, -1, 1)
        key = (
            buckets if attention_mask is None else buckets.masked_fill(~attention_mask[:, None, None, :], extra_bucket)
        )
        key = key + rounds * (extra_bucket + 1)
        if padded_lengths is not None:
            beyond = torch.arange(seq_len, device=qk.device) >= padded_lengths[:, None]  # (batch, seq)
            key = key.masked_fill(beyond[:, None, None, :], num_hashes * (extra_bucket + 1))
        if documents is not None:
            # A document longer than a chunk sorts what lies beyond its solo length after all of its rounds, as
            # `padded_lengths` does for an example; one no longer than a chunk keeps each round in place (its real
            # positions then fill the first chunk of the round).
            solo = documents.solo_length
            inside = torch.arange(seq_len, device=qk.device) - documents.region_start
            beyond = (solo > chunk) & (inside >= solo)
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
            slots = torch.arange(flat_key.shape[-1], device=qk.device)
            order = torch.argsort(flat_key * flat_key.shape[-1] + slots, dim=-1)
        else:
            order = torch.argsort(key.flatten(2), dim=-1, stable=True)  # (batch, heads, rounds * seq)
        # Position of every sorted slot, order % seq_len, as a lookup (a modulo by a symbolic length does not convert
        # to ONNX).
        token = torch.arange(seq_len, device=qk.device).repeat(num_hashes)[order]
        total = num_hashes * seq_len
        num_chunks = total // chunk

        # Row numbers of (batch, head, position) in a flattened (batch * heads * seq, d) view: sorting and unsorting
        # are then single index_select calls, which read the index once instead of once per feature.
        head_rows = torch.arange(batch * self.num_heads, device=qk.device).view(batch, self.num_heads, 1) * seq_len

        def chunked(x):
            rows = x.reshape(-1, x.shape[-1]).index_select(0, (token + head_rows).flatten())
            return rows.view(batch, self.num_heads, num_chunks, chunk, x.shape[-1])

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
        q_pos = token.view(batch, self.num_heads, num_chunks, chunk)
        # Combining rounds needs each row's log-normaliser, which compiled FlexAttention returns on CUDA but not (torch
        # 2.13) on the CPU, where several rounds keep the chunked kernel below (the same numbers).
        lse_ok = num_hashes == 1 or flex_returns_lse(qk.device)
        if (
            not output_attentions
            and lse_ok
            and flex_applies(attention_implementation(self.config), qk, self.training, self.dropout.p)
        ):
            context, log_norm = self._flex_sorted(q.flatten(2, 3), chunked(v).flatten(2, 3), token, index, keep,
                                                  attention_mask, chunk, num_chunks, num_hashes > 1)  # fmt: skip
            context = context.reshape(-1, self.head_dim)
        else:
            k = gather_chunks(unit_rms(q) / math.sqrt(self.head_dim), index)
            v_sorted = gather_chunks(chunked(v), index)
            k_pos = gather_chunks(q_pos, index)
            key_real = None
            if attention_mask is not None:
                key_real = attention_mask[torch.arange(batch, device=qk.device)[:, None, None, None], k_pos]
            scores = self._scores(q, k, q_pos, k_pos, key_real, expand_keep(keep, chunk))
            probs = torch.softmax(scores, dim=-1)
            context = torch.matmul(self.dropout(probs), v_sorted).view(-1, self.head_dim)
            log_norm = None
        # Undo the sort: sorted slot s holds round order[s] // seq_len of position order[s] % seq_len.
        undo = torch.argsort(order, dim=-1)
        undo_rows = (undo + head_rows * num_hashes).flatten()
        context = context.index_select(0, undo_rows).view(batch, self.num_heads, num_hashes, seq_len, self.head_dim)
        weights = None
        if num_hashes > 1:
            # Each round's softmax is normalised over its own window; weighting the rounds by the softmax of their
            # log-normalisers gives one softmax over the union of the windows. Statistics in float32: in 16 bits a
            # log-normaliser of a few units is off by ~1e-2, and so is every round weight.
            with float32_autocast_off(qk.device.type):
                if log_norm is None:
                    log_norm = torch.logsumexp(scores.float(), dim=-1)
                log_norm = log_norm.float().flatten().index_select(0, undo_rows)
                weights = torch.softmax(log_norm.view(batch, self.num_heads, num_hashes, seq_len), dim=2)
            weights = weights.to(context.dtype)
            context = (context * weights[..., None]).sum(2)
        else:
            context = context.squeeze(2)
        attentions = None
        if output_attentions:
            slot_probs = probs
            if weights is not None:
                slot_probs = probs * weights.flatten(2).gather(2, order).view(q_pos.shape)[..., None]
            attentions = dense_probabilities(slot_probs, q_pos, k_pos, seq_len)

        if padded_lengths is not None and num_hashes > 1:
            # Examples no longer than a chunk attend to all of their positions, as they would alone. (With one round
            # the sorted path already does: such an example fills one chunk, whose repeated neighbours are dropped.)
            short = padded_lengths <= chunk  # (batch,)
            mask_head = None if attention_mask is None else attention_mask[:, :chunk]
            head_context, head_probs = self._full(qk[:, :, :chunk], v[:, :, :chunk], mask_head, output_attentions)
            padded_head = nn.functional.pad(head_context, (0, 0, 0, seq_len - chunk))
            context = torch.where(short[:, None, None, None], padded_head, context)
            if output_attentions:
                padded_probs = nn.functional.pad(head_probs, (0, seq_len - chunk, 0, seq_len - chunk))
                attentions = torch.where(short[:, None, None, None], padded_probs, attentions)
        if output_attentions:
            # The context comes from the returned dense probabilities (rounds combined; the same numbers to rounding),
            # so that they are part of the autograd graph (`retain_grad()` on them gets a gradient).
            attentions, rebuilt = corner_on_graph(attentions, output_length)
            context = torch.matmul(self.dropout(rebuilt), v)
        return AttentionOutput(merge_heads(context), attentions, buckets)

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
        past_buckets: torch.Tensor | None,
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
        batch, length, hidden = states.shape
        padded = length if padded_length is None else padded_length
        q = split_heads(self.query_key(hidden_states), self.num_heads)  # (batch, heads, 1, d)
        if padded <= self.chunk_length:
            qk = split_heads(self.query_key(states), self.num_heads)
            v = split_heads(self.value(states), self.num_heads)
            scores = torch.matmul(q, (unit_rms(qk) / math.sqrt(self.head_dim)).transpose(-1, -2))
            if key_mask is not None:
                scores = scores.masked_fill(~key_mask[:, None, None, :], mask_value(scores.dtype))
            scores[..., -1] = self_mask_value(scores.dtype)
            probs = torch.softmax(scores, dim=-1)
            return merge_heads(torch.matmul(probs, v)), None, (probs if output_attentions else None)
        buckets = self._decode_buckets(states, q, past_buckets, num_hashes)  # (batch, heads, rounds, length)
        extra_bucket = math.prod(bucket_factors(self.num_buckets))
        key = buckets if key_mask is None else buckets.masked_fill(~key_mask[:, None, None, :], extra_bucket)
        # The full forward's internal padding: masked, sorted after every real position of each round.
        key = nn.functional.pad(key, (0, padded - length), value=extra_bucket)
        order = torch.argsort(key, dim=-1, stable=True).flatten(2)  # (batch, heads, rounds * padded) positions
        slot = (order == length - 1).to(torch.int64).view(batch, self.num_heads, num_hashes, padded).argmax(-1)
        slot = slot + torch.arange(num_hashes, device=states.device) * padded  # (batch, heads, rounds)
        window = decode_window_slots(slot, num_hashes * padded, self.chunk_length, self.num_chunks_before,
                                     self.num_chunks_after)  # fmt: skip
        token = order.gather(-1, window.flatten(2)).view(*window.shape)  # (batch, heads, rounds, window)
        real = token < length
        if key_mask is not None:
            real = real & key_mask.gather(1, token.clamp(max=length - 1).flatten(1)).view(token.shape)
        token = token.clamp(max=length - 1)  # internal padding (masked) reads any cached state
        picked = states[torch.arange(batch, device=states.device).view(-1, 1), token.flatten(1)]
        picked = picked.view(*token.shape, hidden)
        if plain_linears(self.query_key, self.value):
            per_head = (self.num_heads, self.head_dim, hidden)
            qk = torch.einsum("bhnkx,hdx->bhnkd", picked, self.query_key.weight.view(per_head))
            v = torch.einsum("bhnkx,hdx->bhnkd", picked, self.value.weight.view(per_head))
        else:  # an adapter (LoRA ...) changes the projections: call them, keep each head's own slice
            heads = torch.arange(self.num_heads, device=states.device)
            qk, v = (
                linear(picked)
                .view(*picked.shape[:-1], self.num_heads, self.head_dim)[:, heads, :, :, heads]
                .transpose(0, 1)
                for linear in (self.query_key, self.value)
            )
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
            attentions = weighted.new_zeros(batch, self.num_heads, length)
            attentions = attentions.scatter_add(-1, token.flatten(2), weighted.flatten(2))[:, :, None]
        return merge_heads(context), buckets, attentions

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


__all__ = ["HfxLSHSelfAttention", "draw_rotations", "hash_buckets", "SELF_MASK_VALUE", "self_mask_value"]
