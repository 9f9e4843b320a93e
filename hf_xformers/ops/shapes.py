"""Block and head reshapes that trace: lengths cut into blocks and back, heads split off and merged.

Every blocked attention pads a sequence to whole blocks and cuts its result back to the input length; written here
once so that the padding arithmetic is right under ``torch.compile`` / ``torch.export`` / ONNX export with a symbolic
length (see each function).
"""

from __future__ import annotations

import torch


def ceil_div(size, divisor: int):
    """``ceil(size / divisor)`` for a positive ``divisor``, written ``(size + divisor - 1) // divisor`` so that a
    symbolic ``size`` traces into a correct graph: the ``-(-size // divisor)`` idiom divides a negative number, and
    ONNX's integer ``Div`` (which the ONNX exporter emits for symbolic sizes) truncates towards zero instead of
    flooring, so an exported graph would get a block count one short at lengths that need padding."""
    return (size + divisor - 1) // divisor


def cut_to_length(x: torch.Tensor, dim: int, length) -> torch.Tensor:
    """The first ``length`` entries of ``x`` along ``dim``: cuts a block-padded result back to the input length.

    Eager mode slices (a view). While ``torch.compile`` / ``torch.export`` trace, an ``index_select`` of
    ``arange(length)`` is used instead: slicing a padded length such as ``ceil(L / b) * b`` back to ``L`` makes the
    tracer try to prove ``L <= ceil(L / b) * b`` and decide whether the slice is contiguous (``L % b == 0``), which
    specialises the graph on the length; the gather needs neither. The same numbers either way.
    """
    if not torch.compiler.is_compiling():
        # Uncut inputs come back as they are (not a view): returned attention maps stay on the autograd path.
        return x if x.shape[dim] == length else x.narrow(dim, 0, length)
    return x.index_select(dim, torch.arange(length, device=x.device))


def unblock(x: torch.Tensor, length, dim: int = 1) -> torch.Tensor:
    """Blocks back in sequence order: ``x`` with ``num_blocks`` at ``dim`` and ``block`` at ``dim + 1``
    (``(..., num_blocks, block, *rest)``) -> ``(..., length, *rest)``, cut to the first ``length <= num_blocks * block``
    positions.

    Eager mode merges the two block dimensions and slices (a view where possible). While tracing, position ``t`` is
    read as ``x[..., t // block, t % block]`` instead: merging ``num_blocks`` (a ceil-division of a symbolic length)
    with the block size asks the tracer to decide ``ceil(L / b) % (ceil(L / b) * b)``, which it cannot, and slicing
    back to ``L`` to prove ``L <= ceil(L / b) * b``; ``torch.export`` then rejects a dynamic length. The same numbers
    either way.

    The block of position ``t`` is counted by a cumulative sum of block starts, not computed as ``t // block``:
    inductor (torch 2.13, CPU, dynamic length) writes ``arange(L) // block`` with a loop of ``floor(L / block)``
    blocks of ``block`` positions, so at a length that is not a multiple of ``block`` the tail of that index tensor
    (all of it when ``L < block``) is left unwritten, and the backward's ``index_put`` reads garbage indices (an
    out-of-bounds check inside an OpenMP region: "Fatal Python error: Aborted").
    """
    block = x.shape[dim + 1]
    if not torch.compiler.is_compiling():
        return x.flatten(dim, dim + 1).narrow(dim, 0, length)
    within = torch.arange(length, device=x.device) % block
    return x[(slice(None),) * dim + ((within == 0).long().cumsum(0) - 1, within)]


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(batch, seq, heads * dim)`` -> ``(batch, heads, seq, dim)``."""
    batch, seq, _ = x.shape
    return x.view(batch, seq, num_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(batch, heads, seq, dim)`` -> ``(batch, seq, heads * dim)``."""
    batch, heads, seq, dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * dim)
