"""Count device->host reads and dispatched operators of a model step on the CPU.

On a GPU every read of a tensor's value from Python (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, boolean-mask
indexing, ``nonzero``, ``torch.equal``, ``repeat_interleave`` / ``bincount`` without a given size) waits for the device
to finish everything queued before it. On the CPU nothing waits, so the reads are counted instead: every operator
torch dispatches passes through :class:`HostReadCounter`, which records the ones that hand a value to the host.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that return a value computed on the device to the host (or whose output shape depends on values, which
# needs the same read).
HOST_READ_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::equal",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::unique_dim",
}
# Operators that read a value when called without the size that would spare it.
_NEEDS_SIZE = {"aten::repeat_interleave": "output_size", "aten::bincount": None}


def _reads(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in HOST_READ_OPS:
        return True
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if name == "aten::bincount":
        return True
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)
    return False


class HostReadCounter(TorchDispatchMode):
    """``with HostReadCounter() as c: ...``; then ``c.reads`` (a Counter of operator names that read the host),
    ``c.total_reads``, ``c.ops`` (every dispatched operator, the launches a GPU would make) and ``c.tolist`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter = Counter()
        self.ops = 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        counter = self
        original = self._tolist

        def counting_tolist(tensor, *args, **kwargs):
            counter.reads["Tensor.tolist"] += 1
            return original(tensor, *args, **kwargs)

        torch.Tensor.tolist = counting_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if _reads(func, args, kwargs):
            self.reads[func._schema.name] += 1
        return func(*args, **kwargs)

    @property
    def total_reads(self) -> int:
        return sum(self.reads.values())
