"""Checks shared by the text and vision conformance suites: mixed-precision tolerances, a counter of device-to-host
reads, a recorder of tensors made on the default device, the deviation measure, and for models built or loaded in
another dtype a default-dtype context and a comparison of buffers with the float32 model's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype(dtype)`` inside the ``with`` block, the previous default restored after it (also when
    the block raises, so a failing test does not leave every later test in ``dtype``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def buffer_mismatches(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Names of ``model``'s buffers that are not ``reference``'s (a float32 model of the same config) as ``model``
    holds them: floating buffers must be the reference's numbers rounded to their own dtype (seeded random tables,
    features and rotations are drawn in float32 and cast afterwards, never drawn in 16 bits, which gives other
    numbers), and every buffer must be float32 or of the model's dtype; integer buffers must be equal."""
    expected = dict(reference.named_buffers())
    bad = []
    for name, buffer in model.named_buffers():
        ref = expected[name].to(buffer.device)
        if buffer.is_floating_point():
            if buffer.dtype not in (torch.float32, model.dtype) or not torch.equal(buffer, ref.to(buffer.dtype)):
                bad.append(f"{name} ({buffer.dtype})")
        elif buffer.dtype != ref.dtype or not torch.equal(buffer, ref):
            bad.append(f"{name} ({buffer.dtype})")
    return bad


def check_auto_dtype_load(auto_name: str, cls: type, loaded, saved_model, again: torch.Tensor, saved: torch.Tensor):
    """A bfloat16 checkpoint loaded with ``dtype="auto"``: the registered class, every parameter in bfloat16, the
    saved model's buffers, and eval outputs ``again`` bit-identical to the saved model's ``saved``."""
    assert type(loaded) is cls and loaded.dtype == torch.bfloat16, (auto_name, type(loaded), loaded.dtype)
    wrong = [n for n, p in loaded.named_parameters() if p.dtype != torch.bfloat16]
    assert not wrong, f"{auto_name}: parameters not in bfloat16: {wrong[:5]}"
    bad = buffer_mismatches(loaded, saved_model)
    assert not bad, f"{auto_name}: buffers that differ from the saved model's: {bad[:5]}"
    assert torch.equal(again, saved), f"{auto_name}: {deviation(again, saved):.2e} from the saved model"


def build_under_bfloat16_default(auto_name: str, cls: type, config, reference: torch.nn.Module) -> torch.nn.Module:
    """``cls(config)`` built under ``torch.set_default_dtype(torch.bfloat16)``: the default is float32 again after it,
    and its buffers are ``reference``'s (the float32 model of the same config), rounded."""
    with default_dtype(torch.bfloat16):
        torch.manual_seed(0)
        model = cls(config)
    assert torch.get_default_dtype() == torch.float32
    bad = buffer_mismatches(model, reference)
    assert not bad, f"{auto_name}: buffers that are not the float32 model's (rounded): {bad[:5]}"
    return model


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
