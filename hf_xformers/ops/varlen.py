"""Attention inside the documents of a packed row: one kernel call over the whole row, whatever its documents.

A packed batch (``ops/packing.py``) puts several documents in one row; a query must see only the keys of its own
document (and, for a decoder, only those up to itself). Calling the attention once per document would cost one launch
per document and need the boundaries on the host; instead every recurrent step or layer makes ONE call over the row,
with one of three kernels, chosen and prepared once per forward (:func:`document_layout`) and reused by every call
(:func:`document_attention`):

* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10 and later: FlashAttention's variable-length
  kernel, CUDA and 16-bit only, no dropout), given the row's cumulative lengths ``cu_seq_lens`` and the longest
  document: each document is attended as its own sequence, nothing is masked or skipped. One unpadded row only (the
  collator's ``cu_seq_lens`` form, or boundaries the eager forward worked out).
* ``flex``: FlexAttention with a document ``BlockMask``: the kernel skips the blocks between documents.
* ``sdpa`` (the fallback): ``scaled_dot_product_attention`` with a block-diagonal boolean mask
  ``(batch, 1, seq_len, seq_len)``, exact for any number of rows and documents and for padding (a padding run is a
  group of its own, see :func:`document_mask`).
* ``spans`` (the CPU in eager mode, one unpadded row): one SDPA call per document over its own tokens. On the CPU
  reading the boundaries waits for nothing and a call launches nothing, while the dense mask makes every call cost
  ``seq_len ** 2`` instead of the documents' ``sum(len ** 2)`` (3.4x slower for 8 documents of 512 tokens).

Nothing on an accelerator's path reads a tensor value back to the host: the kernel choice depends on devices, dtypes
and what the batch carries (``cu_seq_lens``), and the host integers (``max_length``) come from the batch; only the
``spans`` layout reads the boundaries, where the row lives in host memory (:func:`~hf_xformers.ops.input_checks.on_host`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .attention_switch import flex_attention, make_block_mask
from .input_checks import is_tracing, on_host
from .packing import document_spans, understated_longest

# FlashAttention's limits: 16-bit inputs, head sizes that are multiples of 8 up to 256.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


try:
    from torch.nn.attention.varlen import varlen_attn as _VARLEN_ATTN
except ImportError:  # torch before 2.10
    _VARLEN_ATTN = None
# torch 2.10's kernel takes `is_causal` and no `scale`; later ones take `window_size=(-1, 0)` for causal, and `scale`.
_VARLEN_PARAMETERS = frozenset(inspect.signature(_VARLEN_ATTN).parameters) if _VARLEN_ATTN is not None else frozenset()


def varlen_kernel() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn`` where the installed torch has it, else None (older releases)."""
    return _VARLEN_ATTN


@torch.compiler.assume_constant_result
def _flash_capable(index: int | None) -> bool:
    """Whether CUDA device ``index`` (None: the current one) is an Ampere or later GPU, which FlashAttention needs. A
    property of the hardware: traced graphs take it as a constant instead of tracing the query."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _flash_device(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FlashAttention's kernels run on ``device`` for ``dtype``: CUDA (Ampere or later), 16-bit."""
    device = torch.device(device)
    return device.type == "cuda" and dtype in _FLASH_DTYPES and _flash_capable(device.index)


def varlen_applies(device: torch.device, dtype: torch.dtype, head_dim: int, dropout_p: float = 0.0) -> bool:
    """Whether :func:`varlen_kernel` can run attention of ``dtype`` (the dtype the products run in: the autocast
    dtype under autocast) on ``device``: a CUDA device with FlashAttention, a torch that has the kernel, no dropout on
    the probabilities (the kernel has none) and a head size FlashAttention takes."""
    if dropout_p > 0.0 or head_dim % 8 != 0 or head_dim > _FLASH_MAX_HEAD_DIM:
        return False
    return varlen_kernel() is not None and _flash_device(device, dtype)


def compute_dtype(reference: torch.Tensor) -> torch.dtype:
    """The dtype the attention products of ``reference``'s projections run in: the autocast dtype when autocast is on
    for its device (the projections' outputs are cast to it), else ``reference``'s own."""
    device_type = reference.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return reference.dtype


def document_mask(document_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """Block-diagonal boolean mask ``(batch, 1, seq_len, seq_len)``: True where query and key lie in the same group
    of ``document_ids`` ``(batch, seq_len)`` (and, ``causal``, the key is not after the query). Every query keeps at
    least itself, so no row is empty (padding given a group of its own attends to padding, rows never read)."""
    allowed = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    if causal:
        positions = torch.arange(document_ids.shape[1], device=document_ids.device)
        allowed = allowed & (positions[None, :] <= positions[:, None])
    return allowed


def document_block_mask(document_ids: torch.Tensor, causal: bool) -> Any:
    """FlexAttention's ``BlockMask`` of :func:`document_mask`'s pattern: the kernel skips the blocks between documents,
    so a row costs about what its documents cost alone. ``document_ids`` ``(batch, seq_len)``."""

    def keep(b, h, q_idx, kv_idx):
        same = document_ids[b, q_idx] == document_ids[b, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    length = document_ids.shape[1]
    return make_block_mask(keep, document_ids.shape[0], None, length, length, document_ids.device)


class DocumentLayout(NamedTuple):
    """What one forward's attention calls need to keep a packed batch's documents apart, built once
    (:func:`document_layout`) and passed to every step or layer. Exactly one of the kernel inputs is set:

    * ``cu_seq_lens`` ``(num_documents + 1,)`` int32 and ``max_length``: the varlen kernel (one unpadded row);
    * ``block_mask``: FlexAttention;
    * ``mask`` ``(batch, 1, seq_len, seq_len)`` bool: SDPA;
    * ``spans``: the ``(start, end)`` of every document of one row in host memory: one SDPA call each.
    """

    document_ids: torch.Tensor
    """``(batch, seq_len)`` long: the group of every token (padding in groups of its own)."""
    causal: bool
    cu_seq_lens: torch.Tensor | None = None
    max_length: int | None = None
    block_mask: Any = None
    mask: torch.Tensor | None = None
    spans: tuple[tuple[int, int], ...] | None = None


def document_layout(
    document_ids: torch.Tensor,
    causal: bool,
    *,
    cu_seq_lens: torch.Tensor | None = None,
    max_length: int | None = None,
    varlen: bool = False,
    flex: bool = False,
) -> DocumentLayout:
    """The :class:`DocumentLayout` of one forward: the varlen kernel where ``varlen`` (:func:`varlen_applies`) and
    ``cu_seq_lens`` is given (one unpadded row), else FlexAttention's block mask where ``flex``, else SDPA's dense
    block-diagonal mask. Built once: the block mask and the dense mask cost a pass over the row each.

    Args:
        document_ids: ``(batch, seq_len)`` long, the group of every token (see :func:`document_mask`).
        causal: a decoder's attention (a query sees its document's keys up to itself).
        cu_seq_lens: ``(num_documents + 1,)`` cumulative lengths of one unpadded row, or None.
        max_length: the longest document (the collator's ``max_length_q``); None: the row's length, a bound that
            costs the kernel only empty tiles and spares a read of the lengths.
    """
    if varlen and cu_seq_lens is not None and document_ids.shape[0] == 1:
        longest = document_ids.shape[1] if max_length is None else max_length
        if max_length is not None:  # the kernel sizes its work by it: an understated one would drop queries
            torch._assert_async((cu_seq_lens.diff() <= max_length).all(), understated_longest(max_length))
        return DocumentLayout(document_ids, causal, cu_seq_lens=cu_seq_lens.to(torch.int32), max_length=longest)
    if flex:
        return DocumentLayout(document_ids, causal, block_mask=document_block_mask(document_ids, causal))
    if document_ids.shape[0] == 1 and on_host(document_ids.device) and not is_tracing():
        return DocumentLayout(document_ids, causal, spans=document_spans(document_ids, cu_seq_lens))
    return DocumentLayout(document_ids, causal, mask=document_mask(document_ids, causal))


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: DocumentLayout,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention of ``query`` ``(batch, heads, seq_len, d)`` against ``key`` / ``value`` ``(batch, heads,
    seq_len, d)`` of the same tokens, each query inside its own document: one kernel call over the whole batch.

    ``dropout_p``: dropout on the probabilities (the SDPA path; a layout for the varlen kernel or FlexAttention is
    only built where none is needed). Returns the context ``(batch, heads, seq_len, d)``.
    """
    # The kernel was chosen for the dtype the model expected; a query of another dtype (a caller that cast it) takes
    # the exact SDPA path instead.
    if layout.cu_seq_lens is not None and _flash_device(query.device, query.dtype):
        return _varlen(query, key, value, layout, scale)
    if layout.block_mask is not None:
        return flex_attention(query, key, value, block_mask=layout.block_mask, scale=scale)
    if layout.spans is not None:
        parts = [
            F.scaled_dot_product_attention(
                query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout_p, is_causal=layout.causal,
                scale=scale,
            )
            for a, b in layout.spans
        ]  # fmt: skip
        return torch.cat(parts, dim=2)
    mask = layout.mask if layout.mask is not None else document_mask(layout.document_ids, layout.causal)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def _varlen(query, key, value, layout: DocumentLayout, scale: float | None) -> torch.Tensor:
    options = {}
    if "window_size" in _VARLEN_PARAMETERS:
        options["window_size"] = (-1, 0) if layout.causal else (-1, -1)
    else:
        options["is_causal"] = layout.causal
    if scale is not None and "scale" in _VARLEN_PARAMETERS:
        options["scale"] = scale
    elif scale is not None:  # the kernel scales by d ** -0.5: fold the rest into the queries
        query = query * (scale * query.shape[-1] ** 0.5)
    # varlen_attn takes the row's tokens flat, (total_tokens, heads, d), and the documents' boundaries.
    flat = [t[0].transpose(0, 1) for t in (query, key, value)]
    cu, longest = layout.cu_seq_lens, layout.max_length
    out = varlen_kernel()(*flat, cu, cu, longest, longest, **options)
    return out.transpose(0, 1)[None]


__all__ = [
    "DocumentLayout",
    "compute_dtype",
    "document_attention",
    "document_block_mask",
    "document_layout",
    "document_mask",
    "varlen_applies",
    "varlen_kernel",
]
