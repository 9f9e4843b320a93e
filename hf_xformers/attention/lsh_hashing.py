"""LSH's hashing (Reformer, Kitaev et al. 2020): which bucket every position falls in, in every round.

Each round maps the shared query-keys ``qk`` through a random rotation ``R`` (``head_dim x n/2``) and takes
``argmax([xR, -xR])`` as the bucket (angular LSH; a pair of bucket factors hashes twice and combines), numerically as
transformers' ``LSHSelfAttention``. The rotations are fixed (drawn from ``hash_seed``, or the layer index) in eval and
in training with a ``hash_seed``, and fresh at every training call otherwise.

Precision: the rotations and the argmax compute in float32 whatever the model's dtype or autocast state, so that a
bfloat16 / float16 model puts positions in the buckets of the float32 model (a bucket flip moves a position to other
keys entirely); the rotations stay float32 when the module is cast.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.precision import float32_autocast_off
from ..ops.shapes import split_heads
from .base import plain_linears


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


# The name of the float32 query-key projection among a sequence-parallel layer's exchanged projections, and of its
# column selector on a head shard (a module of the shard, not an attribute of the class: see `hash_input`).
SEQUENCE_PARALLEL_HASH_INPUT = "hash_query_key"


class LSHHashing:
    """The hashing of :class:`~hf_xformers.attention.lsh.HfxLSHSelfAttention`, which inherits it: its rotations
    (the ``rotations`` buffer, kept float32) and buckets. Reads the layer's ``num_heads``, ``head_dim``,
    ``num_hashes``, ``num_buckets``, ``hash_seed``, ``layer_idx`` and ``query_key`` projection."""

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
        # A sequence-parallel head shard hashes with its heads' rows of the draw for all heads: one process's buckets.
        return self.own_heads(draw_rotations(self.all_heads, self.head_dim, num_hashes, self.num_buckets, seed), 0)

    def narrow_head_state(self, first: int, count: int) -> None:
        self.rotations = self.rotations.narrow(0, first, count)

    def rotations_for(self, num_hashes: int, like: torch.Tensor) -> torch.Tensor:
        """Rotations ``(heads, head_dim, num_hashes, sum(factors) / 2)`` float32 on ``like``'s device."""
        if self.training and self.hash_seed is None:
            # Fresh rotations every training call, drawn on the input's device from its global generator (no CPU draw
            # and copy per layer and step). Only their distribution is specified: the numbers depend on the device's
            # generator. The reversible backward pass restores that generator's state, so the recomputation draws the
            # same numbers.
            shape = (self.all_heads, self.head_dim, num_hashes, sum(bucket_factors(self.num_buckets)) // 2)
            return self.own_heads(torch.randn(shape, device=like.device, dtype=torch.float32), 0)
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
        if SEQUENCE_PARALLEL_HASH_INPUT in self._modules:
            # A sequence-parallel head shard: each rank projected its tokens in float32 before the exchange
            # (`sequence_parallel_projections`), and this selects its heads' columns of what arrived.
            return split_heads(getattr(self, SEQUENCE_PARALLEL_HASH_INPUT)(hidden_states), self.num_heads)
        if not self.hashes_float32_projection(hidden_states.device.type):
            return qk
        return split_heads(self.float32_query_key(hidden_states), self.num_heads)

    def hashes_float32_projection(self, device_type: str) -> bool:
        """Whether :meth:`hash_input` recomputes the query-key projection in float32: under autocast with fixed
        rotations, and only on the plain projection (an adapter, LoRA ..., changes it: hash what it computed)."""
        if not torch.is_autocast_enabled(device_type) or (self.training and self.hash_seed is None):
            return False
        return plain_linears(self.query_key)

    def float32_query_key(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` -> the query-key projection ``(batch, seq, heads * head_dim)`` computed in
        float32 with autocast off (see :meth:`hash_input`)."""
        with float32_autocast_off(hidden_states.device.type):
            return nn.functional.linear(hidden_states.float(), self.query_key.weight.float())

    @property
    def sequence_parallel_projections(self) -> tuple[str, ...]:
        """What each rank projects on its tokens before the exchange (``attention/base.py``): the query-keys and the
        values, and, where :meth:`hash_input` hashes a float32 re-projection, that too. A head shard cannot recompute
        it from the exchanged 16-bit query-keys, and hashing those flips buckets: measured on one LSH layer (2 x 256
        tokens, bfloat16 autocast, seeded rotations, 2 ranks), contexts 38-65 % away from one process's, against 1 %
        between one process's bfloat16 and float32 contexts (tests/sequence_parallel_worker.py)."""
        extra = (SEQUENCE_PARALLEL_HASH_INPUT,) if self.hashes_float32_projection(self.rotations.device.type) else ()
        return ("query_key", "value", *extra)

    def sequence_parallel_project(self, name: str, hidden_states: torch.Tensor) -> torch.Tensor:
        if name == SEQUENCE_PARALLEL_HASH_INPUT:
            return self.float32_query_key(hidden_states)
        return super().sequence_parallel_project(name, hidden_states)


__all__ = ["LSHHashing", "bucket_factors", "draw_rotations", "hash_buckets"]
