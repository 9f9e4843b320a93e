"""Performer's random features are drawn from a proper normal distribution, and FAVOR+ stays unbiased on them.

The projection rows come from counter-based normals (Philox-4x32-10 and Box-Muller,
:func:`~hf_xformers.attention.favor_features.counter_normals`) keyed by ``(random_feature_seed, layer, draw)``.
FAVOR+'s estimate is a mean of ``exp(w . x)``, so it lives on the tails of ``w``: these tests check the tails
themselves, not only the mean and variance. The draws are deterministic, so each test gives the same answer on every
run; the tolerances are set so that a true normal generator would fail them with the small probability stated in
each test (its false-failure probability).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hf_xformers.attention.favor_features import (
    counter_normals,
    default_num_features,
    draw_key,
    philox4x32,
    seeded_random_features,
)
from hf_xformers.models.performer.configuration_performer import HfxPerformerConfig

# Random123's known-answer vectors (kat_vectors): counter, key -> output.
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]
SEEDS = (0, 1, 1234)  # 0 is the config's default
LAYERS = range(4)
# One draw of the default model's features at head size 64: 5 blocks of 64 x 64 and 266 norm rows of 64.
DRAW_SIZE = (5 * 64 + default_num_features(64)) * 64
DRAWS = 80  # 3,000,320 normals per (seed, layer)
TAIL_ALPHA = 1e-6  # per side of each tail count's Poisson bounds


def normal_tail(threshold: float) -> float:
    """``P(|z| > threshold)`` for a standard normal ``z``."""
    return math.erfc(threshold / math.sqrt(2))


def poisson_bounds(mean: float, alpha: float) -> tuple[int, int]:
    """``(low, high)`` with ``P(X < low) <= alpha`` and ``P(X > high) <= alpha`` for ``X ~ Poisson(mean)``."""
    cdf, k, low = 0.0, 0, 0
    while True:
        pmf = math.exp(k * math.log(mean) - mean - math.lgamma(k + 1))
        if cdf + pmf <= alpha:
            low = k + 1
        cdf += pmf
        if 1.0 - cdf <= alpha:
            return low, k
        k += 1


def tail_count_range(mean: float) -> tuple[float, float]:
    """The counts accepted for an expected ``mean``: within 1.4x of it, widened to the Poisson bounds where the
    expectation is too small for 1.4x to hold by chance (beyond 4.5 and 5 sigma in 3M draws: 20 and 1.7 expected)."""
    low, high = poisson_bounds(mean, TAIL_ALPHA)
    return min(mean / 1.4, low), max(1.4 * mean, high)


def model_draws(seed: int, layer: int, draws: int = DRAWS) -> torch.Tensor:
    """``(draws, DRAW_SIZE)`` normals: draws ``0 .. draws - 1`` of ``layer`` under ``seed``, as the model keys them
    (8 draws a call: the integer work stays in the CPU's cache, twice as fast as one call for all)."""
    keys = torch.stack([draw_key(seed, layer, draw) for draw in range(draws)])
    return torch.cat([counter_normals(chunk, (DRAW_SIZE,)) for chunk in keys.split(8)])


def test_philox_matches_random123_known_answers():
    for counter, key, expected in PHILOX_KNOWN_ANSWERS:
        assert philox4x32(counter, key) == expected
        words = philox4x32(tuple(map(torch.tensor, counter)), tuple(map(torch.tensor, key)))
        assert tuple(int(word) for word in words) == expected  # the int64 tensor form, as the model runs it


def test_every_seed_and_layer_draws_normals_with_normal_tails():
    """Per (seed, layer), 3.0M normals (80 draws of the default model's size at head size 64):

    * counts beyond 4, 4.5 and 5 sigma within 1.4x of a normal's expectation (190, 20.4, 1.7), or within the
      Poisson bounds at 1e-6 per side where those are wider: [128, 266], [3, 45] and [0, 11];
    * the fourth moment within 3 +- 6 standard errors (+-0.034);
    * ``E[exp(w)]`` within 1 % of ``e^0.5`` (13 standard errors) and ``E[exp(2w)]`` within 5 standard errors (2.1 %)
      of ``e^2``, and within 1 % over all 12 (seed, layer) pairs (36M normals, 8 standard errors);
    * no value repeated at the same place in consecutive draws beyond float32 coincidences (0.05 expected).

    False-failure probability for a true normal generator (the Poisson bounds exact, the rest by the central limit
    theorem allowing for the skew of exp(2w)): below 1e-3 for the whole test. On 479aea5 the default seed's layer 0
    put a 5.9-sigma radius at element t of draw t: about 30 values beyond 5 sigma in its 3M draws (11 allowed).
    """
    sums = torch.zeros(2, dtype=torch.float64)
    for seed, layer in itertools.product(SEEDS, LAYERS):
        draws = model_draws(seed, layer)
        z = draws.flatten().double()
        n = z.numel()
        for threshold in (4.0, 4.5, 5.0):
            low, high = tail_count_range(n * normal_tail(threshold))
            count = int((z.abs() > threshold).sum())
            assert low <= count <= high, (seed, layer, threshold, count, (low, high))
        fourth = float(z.pow(4).mean())
        assert abs(fourth - 3) < 6 * math.sqrt(96 / n), (seed, layer, fourth)
        exp_w, exp_2w = float(z.exp().mean()), float((2 * z).exp().mean())
        assert abs(exp_w / math.exp(0.5) - 1) < 0.01, (seed, layer, exp_w)
        standard_error = math.sqrt((math.exp(8) - math.exp(4)) / n)
        assert abs(exp_2w - math.exp(2)) < 5 * standard_error, (seed, layer, exp_2w / math.exp(2) - 1)
        sums += torch.tensor([float((2 * z).exp().sum()), n], dtype=torch.float64)
        repeats = int((draws[1:] == draws[:-1]).sum())
        assert repeats <= 2, (seed, layer, repeats)
    pooled = float(sums[0] / sums[1])
    assert abs(pooled / math.exp(2) - 1) < 0.01, pooled / math.exp(2) - 1


def test_draws_differ_between_seeds_layers_and_draws():
    """Each (seed, layer, draw) has its own numbers: no two of these draws agree anywhere beyond float32
    coincidences (each pair of places agrees with probability about 2e-8)."""
    keys = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (2**32, 0, 0), (0, 0, 2**32)]
    draws = torch.stack([counter_normals(draw_key(*key)[None], (DRAW_SIZE,))[0] for key in keys])
    for i, j in itertools.combinations(range(len(keys)), 2):
        assert int((draws[i] == draws[j]).sum()) <= 2, (keys[i], keys[j])
    assert HfxPerformerConfig().random_feature_seed == 0  # the seed tested above as the default


@pytest.mark.parametrize("seed, layer", [(0, 0), (1, 2), (1234, 3)])
def test_kernel_estimate_is_unbiased_on_the_models_orthogonal_features(seed: int, layer: int):
    """FAVOR+'s positive-feature estimate of ``exp(q_hat . k_hat)`` averaged over 1,400 draws of the orthogonal
    features the model uses (head size 16, 44 features) equals the exact kernel within 5 standard errors, for 32
    (query, key) pairs (4 of them a query with itself) with ``|x_hat|`` from 0.5 to 1.1.

    False-failure probability: about 1e-3 for the three runs (400 runs on ``torch.randn`` features: 12,800 z-scores,
    P(|z| > 4) = 1.6e-4, the largest 4.53; the estimate is skewed, so its z-scores are heavier-tailed than normal).
    """
    head_dim, draws = 16, 1400
    num_features = default_num_features(head_dim)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, head_dim, generator=generator, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True) * torch.tensor([0.5, 0.7, 0.9, 1.1] * 2, dtype=torch.float64)[:, None]
    query, key = x[:4], x
    keys = torch.stack([draw_key(seed, layer, draw) for draw in range(draws)])
    rows = seeded_random_features(num_features, head_dim, keys).double()  # (draws, m, d)
    assert torch.equal(rows[5].float(), seeded_random_features(num_features, head_dim, keys[5:6])[0])

    def features(v: torch.Tensor) -> torch.Tensor:  # phi(v) * sqrt(m), (draws, m, n)
        return torch.exp(rows @ v.T - v.pow(2).sum(-1) / 2)

    estimates = torch.einsum("tmi,tmj->tij", features(query), features(key)) / num_features
    z = (estimates.mean(0) - torch.exp(query @ key.T)) / (estimates.std(0) / math.sqrt(draws))
    assert float(z.abs().max()) < 5, z
