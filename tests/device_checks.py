"""Checks shared by the text and vision conformance suites: mixed-precision tolerances, a counter of device-to-host
reads, a recorder of tensors made on the default device, and the deviation measure."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Largest deviation from float32 allowed for an output, relative to its scale (see `deviation`): a few rounding steps of
# the dtype (bfloat16 keeps 8 significant bits, float16 11) through two layers and a head. Measured on the CPU with the
# suites' tiny configs, autocast and half-precision weights: at most 9.3e-3 (bf16) and 1.6e-3 (fp16) for Longformer,
# BigBird, Linformer and Swin.
MIXED_PRECISION_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
HALF_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
# fp16 training scales the loss (what GradScaler does) so that small gradients do not flush to zero.
FP16_LOSS_SCALE = 1024.0

# Ops that read a device value back to the host (a synchronisation on a GPU): `bool(t)`, `int(t)`, `.item()` all end
# in `_local_scalar_dense`; ops whose output size depends on values must do the same. (`.tolist()` does not dispatch
# an op on the CPU, so this counter cannot see it.)
HOST_READ_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
}
# Indexing with a boolean mask (`x[mask]`, `x[mask] = y`) runs `nonzero` inside the kernel, out of the dispatcher's
# sight: these ops count when one of their indices is boolean.
INDEX_OPS = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


class HostReadCounter(TorchDispatchMode):
    """Counts the ops of :data:`HOST_READ_OPS`, and boolean-mask indexing, run inside the ``with`` block
    (``.count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_OPS:
            self.count += 1
        elif func in INDEX_OPS and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self.count += 1
        return func(*args, **(kwargs or {}))


def deviation(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref|`` over the scale of ``ref`` (its largest magnitude, at least 1): a relative error that does
    not blow up on outputs near zero."""
    ref = ref.float()
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


class DefaultDeviceRecorder(TorchDispatchMode):
    """Use inside ``with torch.device("meta")`` around a forward on real tensors: a tensor that some op makes on the
    *default* device (a factory call without ``device=``, which on a GPU run would be a CPU tensor) comes out on
    ``meta``; the names of the ops that made one are collected in ``.ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in results):
            self.ops.append(str(func))
        return out
