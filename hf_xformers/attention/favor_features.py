"""FAVOR+'s random features: the projection rows and the feature maps ``phi`` (Choromanski et al., 2021).

``phi(x)_r = m^-1/2 * exp(w_r . x_hat - |x_hat|^2 / 2)`` with ``x_hat = x * d^-1/4`` and ``w_r`` the rows of a
random projection ``(m, d)`` (:mod:`~hf_xformers.attention.favor` for the attention they serve). The rows are
*orthogonal random features*: blocks of ``d`` exactly orthogonal Gaussian directions (QR of a Gaussian matrix), each
row rescaled to the length of a Gaussian vector, which lowers the variance of the estimate compared with i.i.d.
Gaussian rows.

Numerics, and why each choice:

* Stabilisers. ``exp`` overflows for large logits, so a constant is subtracted inside the exponential: per
  query row (the max over that row's features), and for keys one constant per (batch element, head), the
  max over that example's real keys and features. Either constant cancels between numerator and denominator,
  so the result does not depend on it; a constant shared across the batch would (through under/overflow)
  make an example's output depend on its batch-mates, which is why there is none. (Causal attention takes a
  running max instead: :mod:`~hf_xformers.attention.favor_causal`.)
* ``eps`` (:data:`QUERY_EPS`, 1e-6 of a row's largest feature) is added to the *query* features only: it keeps every
  denominator positive (at least one key feature is 1 after stabilising) while the key stabiliser still cancels
  exactly.
* Constant factors (``m^-1/2``; for a query row ``exp(-|q_hat|^2 / 2)``) cancel the same way and are not computed.
* Padding: padded keys get features of exactly zero (their logits are set to ``-inf`` before the exponential
  and before the key stabiliser is taken), so they contribute nothing and do not move the stabiliser. ``-inf`` is
  safe here because those logits are always float32 (:func:`~hf_xformers.attention.favor.favor_attention` casts)
  and an example with no real key is handled explicitly; ``key_mask=None`` means nothing is padded.

The generalized kernel option (``kernel="relu"``) uses ``phi(x) = relu(W x_hat) + 1e-3`` instead: a different
(not softmax) attention kernel from the same paper, cheaper and without exponentials.
"""

from __future__ import annotations

import math

import torch

from ..configs.choices import FAVOR_KERNELS

KERNELS = FAVOR_KERNELS
QUERY_EPS = 1e-6
RELU_EPS = 1e-3


def default_num_features(head_dim: int) -> int:
    """``int(d * ln d)`` random features for head size ``d`` (the paper's choice; 266 for ``d = 64``)."""
    return max(1, int(head_dim * math.log(head_dim)))


def draw_random_features(
    num_features: int, head_dim: int, generator: torch.Generator, orthogonal: bool = True
) -> torch.Tensor:
    """Random projection rows ``w_r`` for FAVOR+, from a seeded CPU generator.

    Args:
        num_features: ``m``, rows to draw.
        head_dim: ``d``.
        generator: CPU generator the draw comes from (the caller seeds it).
        orthogonal: blocks of ``d`` mutually orthogonal rows (:func:`features_from_gaussians`); False: plain i.i.d.
            ``N(0, 1)`` rows.

    Returns:
        ``(num_features, head_dim)`` float32 tensor on CPU (whatever the default device and default dtype: the draw is
        the generator's, the same numbers wherever and in whatever dtype the model then runs; a model in 16 bits
        rounds them. Drawn in 16 bits they would be other numbers, and the CPU has no 16-bit QR).
    """
    cpu32 = dict(generator=generator, device="cpu", dtype=torch.float32)
    if not orthogonal:
        return torch.randn(num_features, head_dim, **cpu32)
    blocks = torch.stack([torch.randn(head_dim, head_dim, **cpu32) for _ in range(-(-num_features // head_dim))])
    return features_from_gaussians(blocks, torch.randn(num_features, head_dim, **cpu32), num_features)


def features_from_gaussians(blocks: torch.Tensor, norm_gaussians: torch.Tensor, num_features: int) -> torch.Tensor:
    """Orthogonal random features from Gaussian draws: blocks of ``d`` mutually orthogonal rows (QR of Gaussian
    matrices, signs fixed so that each block is Haar-distributed), rows rescaled to the norms of independent Gaussian
    vectors (chi-distributed, so each row on its own is still a Gaussian vector).

    Args:
        blocks: ``(..., num_blocks, d, d)`` i.i.d. ``N(0, 1)``, ``num_blocks * d >= num_features``.
        norm_gaussians: ``(..., num_features, d)`` i.i.d. ``N(0, 1)``, whose row norms become the rows' lengths.
        num_features: ``m``.
    Returns:
        ``(..., num_features, d)``.
    """
    q, r = torch.linalg.qr(blocks)
    # QR alone is not uniformly distributed over rotations; fixing the signs by diag(R) makes it so.
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]
    rows = q.transpose(-1, -2).flatten(-3, -2)[..., :num_features, :]
    return rows * norm_gaussians.norm(dim=-1, keepdim=True)


_MASK32 = 0xFFFFFFFF
MAX_SEED = 2**64 - 1
# Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), as in the reference
# implementation Random123: the round multipliers and the Weyl increments of the key schedule.
_PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10


def _mulhilo32(x, factor: int):
    """The high and the low 32 bits of ``x * factor`` for ``x`` and ``factor`` in ``[0, 2**32)`` (an int, or an int64
    tensor elementwise), from two products of ``x``'s 16-bit halves: no int64 product overflows (a wrapping product
    would be undefined behaviour in compiled kernels), so every backend gives the same integers."""
    low = (x & 0xFFFF) * factor
    high = (x >> 16) * factor
    return (high + (low >> 16)) >> 16, (((high & 0xFFFF) << 16) + low) & _MASK32


def philox4x32(counter, key):
    """Philox-4x32-10: four 32-bit words of ``counter`` under the two 32-bit words of ``key`` -> four 32-bit words.

    Each word is an int in ``[0, 2**32)`` or an int64 tensor of such (tensors broadcast, elementwise). A bijection of
    the counter for each key whose outputs pass TestU01's BigCrush as a stream over consecutive counters (the paper),
    and the same integers on every device: integer arithmetic only, so it traces (``torch.compile(fullgraph=True)``,
    ``torch.export``). Checked against Random123's known-answer vectors in the tests."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0, k1 = (k0 + _PHILOX_KEY_STEPS[0]) & _MASK32, (k1 + _PHILOX_KEY_STEPS[1]) & _MASK32
        hi0, lo0 = _mulhilo32(c0, _PHILOX_MULTIPLIERS[0])
        hi1, lo1 = _mulhilo32(c2, _PHILOX_MULTIPLIERS[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def draw_key(seed: int, layer_idx: int, draw: int | torch.Tensor) -> torch.Tensor:
    """The key of draw number ``draw`` of layer ``layer_idx``'s features under ``config.random_feature_seed``
    ``seed``: the int64 words ``(seed low, seed high, layer, draw low, draw high)`` ``(5,)``, each 32 bits.

    ``draw``: an int (a CPU key), or a 0-dim int64 tensor (the draw counter of a traced graph: the key is made on its
    device, with no host read). :func:`counter_normals` makes the seed Philox's key and ``(layer, draw)`` part of its
    counter, so every (seed, layer, draw) has its own numbers, and the sequence of redraws is the same on every run
    and every process (so DDP ranks stay in step)."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"random_feature_seed must be in [0, 2**64), got {seed}.")
    fixed = [seed & _MASK32, seed >> 32, layer_idx & _MASK32]
    if isinstance(draw, torch.Tensor):
        draw = draw.long().reshape(1)
        return torch.cat([torch.tensor(fixed, device=draw.device), draw & _MASK32, (draw >> 32) & _MASK32])
    return torch.tensor([*fixed, draw & _MASK32, (draw >> 32) & _MASK32], dtype=torch.long, device="cpu")


def _open_unit_interval(words: torch.Tensor) -> torch.Tensor:
    """32-bit words -> float32 uniforms ``(k + 1/2) / 2**32`` in ``(0, 1]``: never 0, so ``log`` stays finite, and
    with 32 bits the smallest is 1.2e-10, so Box-Muller's radius reaches 6.8 (a normal passes 6.8 with probability
    1e-11: the tails are a normal's wherever a test can see them; 24 bits would stop at 5.9)."""
    return (words.to(torch.float32) + 0.5) * 2.0**-32


def counter_normals(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """I.i.d. ``N(0, 1)`` float32 numbers ``(len(keys), *shape)``, a function of the ``keys`` ``(n, 5)``
    (:func:`draw_key`) alone.

    Element ``4j .. 4j + 3`` of a key comes from Philox-4x32-10 (:func:`philox4x32`) of the counter
    ``(j, layer, draw low, draw high)`` under the key's seed: two pairs of 32-bit uniforms, each pair two normals by
    Box-Muller (``r cos``, ``r sin``, ``r = sqrt(-2 log u1)``). Unlike a ``torch.Generator`` this traces
    (``torch.compile(fullgraph=True)`` makes no generator object) and needs no host read of a key held on an
    accelerator; made on ``keys``' device (the integers exactly the same everywhere, the float32 ``log`` / ``cos``
    within rounding)."""
    count = math.prod(shape)
    blocks = torch.arange(-(-count // 4), device=keys.device).expand(keys.shape[0], -1)
    seed_low, seed_high, layer, draw_low, draw_high = keys.long()[:, :, None].unbind(1)
    words = philox4x32((blocks, layer, draw_low, draw_high), (seed_low, seed_high))
    normals = []
    for radius_word, angle_word in (words[:2], words[2:]):
        radius = torch.sqrt(-2.0 * torch.log(_open_unit_interval(radius_word)))
        angle = (2.0 * math.pi) * _open_unit_interval(angle_word)
        normals += [radius * torch.cos(angle), radius * torch.sin(angle)]
    return torch.stack(normals, dim=-1).flatten(1)[:, :count].reshape(keys.shape[0], *shape)


def seeded_random_features(
    num_features: int, head_dim: int, keys: torch.Tensor, orthogonal: bool = True
) -> torch.Tensor:
    """Random projection rows ``(len(keys), num_features, head_dim)`` float32, one draw per key of ``keys``
    ``(n, 5)`` (:func:`draw_key`), on ``keys``' device: traceable, no generator, no host read
    (:func:`counter_normals`; :func:`features_from_gaussians` for the orthogonal rows)."""
    if not orthogonal:
        return counter_normals(keys, (num_features, head_dim))
    num_blocks = -(-num_features // head_dim)
    normals = counter_normals(keys, (num_blocks * head_dim + num_features, head_dim))
    blocks = normals[:, : num_blocks * head_dim].reshape(-1, num_blocks, head_dim, head_dim)
    return features_from_gaussians(blocks, normals[:, num_blocks * head_dim :], num_features)


def document_max(x: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """Every position's document maximum: ``out[b, h, i] = max of x[b, h, j]`` over ``j`` in ``i``'s document.

    A segment max by ``scatter_reduce`` into one slot per document (document ids are below ``seq``, so ``seq`` slots
    per row suffice and no host read sizes the buffer), gathered back per position: linear in ``seq``.

    Args:
        x: ``(batch, heads, seq)``, may hold ``-inf``.
        document_ids: ``(batch, seq)`` long, documents numbered from 0 in each row.

    Returns:
        ``(batch, heads, seq)``.
    """
    index = document_ids[:, None, :].expand_as(x)
    slots = torch.full_like(x, float("-inf")).scatter_reduce(-1, index, x, reduce="amax", include_self=True)
    return slots.gather(-1, index)


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``-inf`` (no real key seen yet) -> 0: any finite stabiliser will do where every feature is 0."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def softmax_key_logits(
    key: torch.Tensor, projection: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The exponents of the key features, ``w_r . k_hat - |k_hat|^2 / 2`` (``-inf`` for padded keys).

    Args:
        key: ``(batch, heads, seq, d)`` (float32); projection: ``(m, d)``; key_mask: ``(batch, seq)`` bool or None.

    Returns:
        ``(batch, heads, seq, m)``.
    """
    head_dim = key.shape[-1]
    logits = torch.matmul(key, projection.T * head_dim**-0.25)
    logits.sub_((0.5 * head_dim**-0.5) * key.pow(2).sum(-1, keepdim=True))
    if key_mask is not None:
        # -inf before the max and the exponential: padded keys neither move the stabiliser nor count.
        logits.masked_fill_(~key_mask[:, None, :, None], float("-inf"))
    return logits


def softmax_kernel_features(
    x: torch.Tensor,
    projection: torch.Tensor,
    is_query: bool,
    key_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positive random features ``phi(x)`` of FAVOR+ (module docstring), stabilised, up to constant factors.

    Factors that are the same for every feature of a query row (``m^-1/2``, ``exp(-|q_hat|^2/2)``, the row's
    stabiliser), or for every key of an example and head (``m^-1/2``, the key stabiliser), cancel between the
    numerator and the denominator of the attention, so they are left out:

    * queries: ``exp(w_r . q_hat - max_r' w_r' . q_hat)`` (the largest feature of each row is 1);
    * keys: ``exp(w_r . k_hat - |k_hat|^2 / 2 - s)`` with ``s`` the max of the exponent over the example's real keys
      and all features (per batch element and head; per document of a packed row, the max the document's own
      forward takes); padded keys get exactly 0.

    Computed in place on one ``(batch, heads, seq, m)`` buffer (every step is autograd-safe in place), which matters
    on CPU where each fresh tensor of that size costs page faults.

    Args:
        x: ``(batch, heads, seq, d)`` queries or keys (float32).
        projection: ``(m, d)`` random rows.
        is_query: which of the two stabilisers to use.
        key_mask: ``(batch, seq)`` bool, True for real tokens (keys only), or None when nothing is padded.
        document_ids: ``(batch, seq)`` long, the document of every token of a packed batch (keys only), or None.

    Returns:
        ``(batch, heads, seq, m)``, in ``x``'s dtype (float32 as :func:`~hf_xformers.attention.favor.favor_attention`
        calls it).
    """
    if is_query:
        logits = torch.matmul(x, projection.T * x.shape[-1] ** -0.25)  # w_r . x_hat
        # Detached: the stabiliser cancels in the normalisation, so it carries no gradient either way.
        return logits.sub_(logits.detach().amax(-1, keepdim=True)).exp_()
    logits = softmax_key_logits(x, projection, key_mask)
    if document_ids is None:
        stabiliser = logits.detach().amax(dim=(-2, -1), keepdim=True)
    else:
        stabiliser = document_max(logits.detach().amax(-1), document_ids).unsqueeze(-1)
    # An example made only of padding has no real key: any finite stabiliser will do (its features are all 0).
    return logits.sub_(finite_or_zero(stabiliser)).exp_()


def relu_kernel_features(
    x: torch.Tensor, projection: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Generalized-kernel features ``relu(W x_hat) + 1e-3`` (zero for padded keys).

    Args:
        x: ``(batch, heads, seq, d)``; projection: ``(m, d)``; key_mask: ``(batch, seq)`` bool or None.

    Returns:
        ``(batch, heads, seq, m)``.
    """
    features = torch.relu(torch.matmul(x, projection.T * x.shape[-1] ** -0.25)) + RELU_EPS
    if key_mask is not None:
        features = features * key_mask[:, None, :, None].to(features.dtype)
    return features
