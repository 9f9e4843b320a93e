"""Reversible residual layers (RevNet; Gomez et al. 2017, used by Reformer).

A block maps ``(x1, x2)`` to ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``. Its inputs can be rebuilt from its outputs
(``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``), so :func:`reversible_sequence` keeps no activations in the forward pass
and recomputes each block in the backward pass, last block first: training memory no longer grows with depth.

The recomputation must reproduce the forward pass exactly, so the random generator state (CPU, and the device's for
accelerators) is recorded before each ``f`` and ``g`` and restored when they run again; the forward's autocast state
(enabled and dtype, for the inputs' device type and the CPU) is replayed around the recomputation, which otherwise
runs where autograd calls it, outside any autocast region, and would differentiate a float32 function instead of the
16-bit one the forward computed (and rebuild the inputs from outputs it did not produce); and ``f`` may hand back an
``extra`` value (Reformer: the LSH buckets) that the recomputation receives instead of deriving it again from inputs
that are only equal up to rounding.

A block is any module with

- ``f(x2, extra=None, **kwargs) -> (f(x2), extra)`` and ``g(y1) -> g(y1)`` (tensors of the shape of ``x1``),
- ``f_parameters()`` and ``g_parameters()``: the parameters each of them uses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import nn


def _rng_state(device: torch.device):
    """The CPU generator's state and, for an accelerator (``cuda``, ``xpu``, ``mps``, ...), that device's."""
    if device.type == "cpu":
        return torch.get_rng_state(), None
    return torch.get_rng_state(), torch.get_device_module(device.type).get_rng_state(device)


@contextmanager
def _restored_rng(state, device: torch.device) -> Iterator[None]:
    accelerator = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type):
        torch.set_rng_state(state[0])
        if accelerator:
            torch.get_device_module(device.type).set_rng_state(state[1], device)
        yield


def _autocast_state(device: torch.device) -> tuple[tuple[str, bool, torch.dtype], ...]:
    """``(device_type, enabled, dtype)`` of autocast for ``device``'s type and the CPU (ops of a block may run on
    either)."""
    types = dict.fromkeys([device.type, "cpu"])
    return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)


@contextmanager
def _replayed_autocast(state) -> Iterator[None]:
    with ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield


def _f_value(block: nn.Module, extra, kwargs: dict, x: torch.Tensor) -> torch.Tensor:
    return block.f(x, extra=extra, **kwargs)[0]


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, blocks, kwargs, *params):
        records = []
        ctx.autocast = _autocast_state(x2.device)
        with torch.no_grad():
            for block in blocks:
                f_state = _rng_state(x2.device)
                fx, extra = block.f(x2, **kwargs)
                x1 = x1 + fx
                g_state = _rng_state(x1.device)
                x2 = x2 + block.g(x1)
                records.append((f_state, g_state, extra))
        ctx.blocks, ctx.kwargs, ctx.records, ctx.params_list = blocks, kwargs, records, params
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        grads: dict[int, torch.Tensor] = {}

        def run(fn, x, grad_out, params, rng_state):
            """Recompute ``fn(x)`` with the forward's random and autocast state; return its value, the gradient of
            ``x``, and accumulate parameter gradients."""
            with torch.enable_grad():
                x = x.detach().requires_grad_(True)
                with _restored_rng(rng_state, x.device), _replayed_autocast(ctx.autocast):
                    out = fn(x)
                trainable = [p for p in params if p.requires_grad]
                # Under autocast `out` may be 16-bit while the residual stream (and its gradient) is float32: the
                # forward's `x + out` handed `out` its gradient in `out`'s dtype, and so does this.
                result = torch.autograd.grad(out, [x, *trainable], grad_out.to(out.dtype), allow_unused=True)
            for p, g in zip(trainable, result[1:]):
                if g is not None:
                    grads[id(p)] = g if id(p) not in grads else grads[id(p)] + g
            return out.detach(), result[0]

        for block, (f_state, g_state, extra) in zip(reversed(ctx.blocks), reversed(ctx.records)):
            gy1, dy1_from_g = run(block.g, y1, dy2, list(block.g_parameters()), g_state)
            x2 = y2 - gy1
            dy1 = dy1 + dy1_from_g
            f_only = functools.partial(_f_value, block, extra, ctx.kwargs)
            fx2, dx2_from_f = run(f_only, x2, dy1, list(block.f_parameters()), f_state)
            x1 = y1 - fx2
            dy2 = dy2 + dx2_from_f
            y1, y2 = x1, x2
        param_grads = tuple(grads.get(id(p)) for p in ctx.params_list)
        return (dy1, dy2, None, None, *param_grads)


def reversible_sequence(
    blocks: Sequence[nn.Module], x1: torch.Tensor, x2: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``blocks`` reversibly: ``(x1, x2)`` ``(batch, seq, hidden)`` each -> ``(y1, y2)``, storing no activations.

    ``kwargs`` go to every ``f`` (masks, options). Gradients reach ``x1``, ``x2`` and every block parameter as
    through ordinary autograd.
    """
    params = [p for block in blocks for p in block.parameters()]
    return _ReversibleFunction.apply(x1, x2, list(blocks), kwargs, *params)


__all__ = ["reversible_sequence"]
