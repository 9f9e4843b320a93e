"""The precision and device of a benchmark run, the same in every benchmark here.

``--dtype`` is the dtype of the weights and the compute of inference (the forward mode: ``model.to(dtype)``, float
inputs cast). ``--autocast`` changes the training mode to what ``Trainer(bf16=True)`` runs: weights stay float32 and
the forward runs under ``torch.autocast(device_type, dtype=--dtype)``, the backward outside it. Without
``--autocast`` a training mode under a 16-bit ``--dtype`` trains the 16-bit weights themselves ("pure" 16-bit).
``--device cuda`` times with ``torch.cuda.synchronize()`` and measures memory with ``torch.cuda.max_memory_allocated``.

Results of a run that is not float32 on the CPU go to files with a suffix (``_bf16``, ``_bf16_autocast``,
``_cuda``), so the float32 tables stay; a results file without these fields (older runs) is float32 on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# The help texts of the flags. Every benchmark spells out its own add_argument("--dtype", ...) calls (scripts/
# gpu_check.py looks for them in the module's source before it runs a step).
DTYPE_HELP = "weights and compute of inference (and of training without --autocast)"
AUTOCAST_HELP = "training as Trainer(bf16=True) runs it: float32 weights, the forward under torch.autocast(--dtype)"
DEVICE_HELP = "cuda: time with torch.cuda.synchronize(), memory by torch.cuda.max_memory_allocated"


@dataclass(frozen=True)
class Precision:
    """How a run's models are cast and called; ``autocast`` concerns the training mode only."""

    dtype: str = "float32"
    autocast: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.autocast and self.dtype == "float32":
            raise ValueError("--autocast needs a 16-bit --dtype (bfloat16 or float16): the dtype autocast computes in")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Precision:
        return cls(args.dtype, getattr(args, "autocast", False), getattr(args, "device", "cpu"))

    @classmethod
    def from_record(cls, record: dict) -> Precision:
        """From a results file's metadata; older files without the fields are float32 on the CPU."""
        return cls(record.get("dtype", "float32"), record.get("autocast", False), record.get("device", "cpu"))

    def record(self) -> dict:
        """The fields a results file keeps (read back by :meth:`from_record`)."""
        return {"dtype": self.dtype, "autocast": self.autocast, "device": self.device}

    @property
    def short(self) -> str:
        return SHORT_NAMES[self.dtype]

    def suffix(self) -> str:
        """The file-name suffix of this run's results: empty for float32 on the CPU (the committed tables)."""
        out = "" if self.dtype == "float32" else f"_{self.short}"
        out += "_autocast" if self.autocast else ""
        return out + ("_cuda" if self.device == "cuda" else "")

    def label(self, training: bool) -> str:
        """A short name of what one mode runs: ``fp32``, ``bf16`` or ``bf16 autocast``."""
        return f"{self.short} autocast" if training and self.autocast else self.short

    def describe(self, forward: bool = True, training: bool = True) -> str:
        """The table-header line, e.g. ``dtype: bfloat16 weights (forward); autocast bfloat16, fp32 weights
        (training)``."""
        parts = []
        if forward:
            parts.append(f"{self.dtype} weights (forward)")
        if training:
            if self.autocast:
                parts.append(f"autocast {self.dtype}, fp32 weights (training)")
            elif self.dtype == "float32":
                parts.append("float32 weights (training)")
            else:
                parts.append(f"pure {self.dtype}: {self.dtype} weights, no autocast (training)")
        return "dtype: " + "; ".join(parts)

    def memory_method(self) -> str:
        return "torch.cuda.max_memory_allocated" if self.device == "cuda" else "peak RSS"

    # The parts that need torch.

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def prepare(self, model, training: bool):
        """``model`` on the device, in ``dtype`` unless it trains under autocast (float32 weights then)."""
        if training and self.autocast:
            return model.to(self.device)
        return model.to(self.device, self.torch_dtype())

    def cast(self, tensor, training: bool):
        """An input on the device; a float input in the weights' dtype (autocast casts it itself)."""
        tensor = tensor.to(self.device)
        if tensor.is_floating_point() and not (training and self.autocast):
            tensor = tensor.to(self.torch_dtype())
        return tensor

    def context(self, training: bool):
        """Around a training forward: ``torch.autocast`` with ``--autocast``, nothing otherwise."""
        if training and self.autocast:
            import torch

            return torch.autocast(self.device, dtype=self.torch_dtype())
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for the device (timings on a GPU must include the queued kernels)."""
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def check_available(self) -> None:
        """Raise ``ValueError`` when ``--device cuda`` is asked for on a machine without CUDA."""
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda: torch sees no CUDA device here; run with --device cpu")


class DeviceMemory:
    """Peak memory growth from a point on: the process's peak RSS on the CPU (:class:`PeakRSS`),
    ``torch.cuda.max_memory_allocated`` above the memory allocated at the start on a GPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        if device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            self.mode = "torch.cuda.max_memory_allocated"
        else:
            from benchmarks.measurement import PeakRSS, rss_kib

            self.base = rss_kib() * 1024
            self._rss = PeakRSS()
            self.mode = self._rss.mode

    def peak_mib(self) -> float:
        """Peak growth so far, MiB."""
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = self._rss.peak_bytes()
        return max(0, peak - self.base) / 2**20
