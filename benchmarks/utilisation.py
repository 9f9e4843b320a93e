"""How close a measured step comes to the device's limit: model FLOPs per step, the rate a plain matrix product reaches
on the same device in the same run, and their ratio (model FLOPs utilisation, MFU).

Model FLOPs of one training step (forward + backward) over ``T`` tokens (batch x length, every position of the
padded batch: these benchmarks pad nothing)::

    6 * N * T  +  3 * sum over layers of (4 * T * K * W)

* ``N``: the parameters that take part in matrix products: every parameter except embedding tables (lookups, not
  products) and projections the inputs leave idle (Longformer's global projections without global tokens); biases
  and norms are in, a fraction of a percent. ``6 N T`` is ``2 N T`` for the forward (one
  multiply-add per parameter and token) and ``4 N T`` for the backward (gradients of the inputs and of the weights).
* Attention: per layer ``4 T K W`` in the forward, ``2 T K W`` for the scores ``q k^T`` and ``2 T K W`` for the
  weighted sum of the values, with ``K`` the keys each query attends to under the architecture's pattern (the full
  length for full attention; Longformer's window + 1; BigBird's window, global and random blocks; ...) and ``W`` the
  attention width (heads x head size, the hidden size for most). The backward costs twice the forward: ``x 3`` in
  all.

These are the *model's* FLOPs, the work the architecture needs: an implementation that computes more (padding to
blocks, masked scores, recomputation in a reversible or checkpointed backward) gets no credit for it, so two
implementations of one model compare by time at equal FLOPs. A forward alone (inference) is ``2 N T + sum 4 T K W``.

MFU = (model FLOPs / step time) / (rate of a ``size x size x size`` matrix product in the step's dtype, measured by
:func:`matmul_tflops` in the same process): a ratio to what this device reaches in this run, not to a datasheet peak
(the wave-6 H200 run measured about 790 TFLOP/s in bfloat16 at 8192, against about 989 on paper). Float32 products
are measured as torch runs them by default (TF32 off on CUDA).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch is imported where it is used: the long-context benchmark's parent process renders tables without it.

# The matrix product's size per device: large enough to reach the device's rate (8192: about 1.1 TFLOP per product,
# a millisecond or two on an H100 in bfloat16), small enough to take well under a second on the CPU (where bfloat16
# products without AMX are slow).
MATMUL_SIZE = {"cuda": 8192, "cpu": 512}


def matmul_parameters(model: nn.Module) -> int:
    """``N`` of the formula: the model's parameters less its embedding tables (``nn.Embedding`` weights)."""
    from torch import nn

    total = sum(p.numel() for p in model.parameters())
    tables = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)}
    return total - sum(tables.values())


def global_projection_parameters(model: nn.Module) -> int:
    """Longformer's global query / key / value projections (``query_global``, ``key_global``, ``value_global`` in ours
    and in transformers'): no work without global tokens, so not in ``N`` for inputs that have none."""
    return sum(p.numel() for name, p in model.named_parameters() if "_global." in name)


def step_flops(
    parameters: int, tokens: int, layers: int, keys_per_query: float, attention_width: int, training: bool = True
) -> float:
    """Model FLOPs of one step over ``tokens`` tokens (the module docstring's formula): ``6 N T + 3 L 4 T K W`` for a
    training step, ``2 N T + L 4 T K W`` for a forward alone."""
    attention = layers * 4.0 * tokens * keys_per_query * attention_width
    if training:
        return 6.0 * parameters * tokens + 3.0 * attention
    return 2.0 * parameters * tokens + attention


def matmul_tflops(
    device: str, dtype: torch.dtype, size: int | None = None, repeats: int = 10, warmup: int = 2
) -> float:
    """TFLOP/s of a ``size x size x size`` product in ``dtype`` on ``device`` (median of ``repeats`` after ``warmup``
    products; ``2 size**3`` FLOPs each). ``size`` None: :data:`MATMUL_SIZE` of the device."""
    import torch

    size = size or MATMUL_SIZE["cuda" if device.startswith("cuda") else "cpu"]
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(warmup):
        torch.mm(a, b)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - start)
    del a, b
    return 2.0 * size**3 / statistics.median(times) / 1e12


def tflops(flops: float | None, seconds: float | None) -> float | None:
    """TFLOP/s of ``flops`` done in ``seconds`` (None when either is unknown)."""
    if not flops or not seconds or seconds <= 0:
        return None
    return flops / seconds / 1e12


def utilisation(flops: float | None, seconds: float | None, peak_tflops: float | None) -> float | None:
    """MFU: the step's model TFLOP/s over the measured product rate (None when anything is unknown)."""
    rate = tflops(flops, seconds)
    return rate / peak_tflops if rate is not None and peak_tflops else None


def format_tflops(value: float | None) -> str:
    return "-" if value is None else (f"{value:.1f}" if value >= 1 else f"{value:.3f}")


def format_mfu(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def keys_full(length: int) -> float:
    """Full attention: every query sees every key."""
    return float(length)


def keys_longformer(attention_window: int, length: int) -> float:
    """Longformer's band: ``attention_window`` (both sides together) + 1 keys, capped by the length (no globals)."""
    return float(min(length, attention_window + 1))


def keys_bigbird(block: int, random_blocks: int, length: int) -> float:
    """BigBird's block-sparse pattern averaged over the queries: the two global query blocks see every key, the others
    3 window + 2 global + ``random_blocks`` blocks; short inputs (up to ``5 + 2 r`` blocks) are full attention."""
    if length <= (5 + 2 * random_blocks) * block:
        return float(length)
    middle = min(length, (5 + random_blocks) * block)
    return (2 * block * length + (length - 2 * block) * middle) / length


__all__ = [
    "MATMUL_SIZE",
    "format_mfu",
    "format_tflops",
    "global_projection_parameters",
    "keys_bigbird",
    "keys_full",
    "keys_longformer",
    "matmul_parameters",
    "matmul_tflops",
    "step_flops",
    "tflops",
    "utilisation",
]
