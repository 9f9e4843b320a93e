"""Numerics shared by every architecture under mixed precision (autocast) and half-precision weights.

* :func:`mask_value`: a "masked" logit that exists in the scores' dtype. ``-1e9`` does not fit float16 (its largest
  magnitude is 65504): ``masked_fill`` refuses it, and a sum of such values overflows to ``-inf``.
* :func:`float32_autocast_off`: a region where autocast is off, for the parts the papers and references compute in
  float32 whatever the rest of the model does (random-feature maps and prefix sums, hashing, halting sums, the
  adaptive softmax). Cast the region's inputs with ``.float()`` inside it.
* :func:`autocast_input`: the cast autocast would make, made once. Under autocast the residual stream stays float32
  and every ``nn.Linear`` casts its input anew: an attention layer that projects one input four or five times (query,
  key, value, global projections) would cast it four or five times, and sum as many float32 gradients.
"""

from __future__ import annotations

import contextlib

import torch


def mask_value(dtype: torch.dtype) -> float:
    """The most negative finite value of ``dtype``: a logit that softmax turns into an exact 0 next to any real one,
    and that (unlike ``-inf``) keeps a fully masked row finite."""
    return torch.finfo(dtype).min


def float32_autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, enabled=False)``: ops inside run in their inputs' dtype (cast them to float32).

    Args:
        device_type: ``tensor.device.type`` of the inputs (``"cpu"``, ``"cuda"``, ...). A device type without autocast
            (``"meta"``) gets a no-op context: there is nothing to turn off.
    """
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def is_half_precision(dtype: torch.dtype) -> bool:
    """bfloat16 and float16: the dtypes whose CPU matrix products (oneDNN, AMX tiles) need plain row-major operands."""
    return dtype in (torch.bfloat16, torch.float16)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast to the autocast dtype when autocast is on for its device and ``x`` is float32, else ``x`` itself:
    what each matrix product under autocast would cast it to (the same numbers), once for all its consumers."""
    device_type = x.device.type
    if x.dtype != torch.float32 or not torch.amp.is_autocast_available(device_type):
        return x
    if not torch.is_autocast_enabled(device_type):
        return x
    return x.to(torch.get_autocast_dtype(device_type))


__all__ = ["autocast_input", "float32_autocast_off", "is_half_precision", "mask_value"]
