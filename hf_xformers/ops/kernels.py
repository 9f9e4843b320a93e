"""Softmax attention with dropout on the attention probabilities, cheaper than SDPA's math path on CPU.

PyTorch's fused ``scaled_dot_product_attention`` kernels cover inference and dropout-free training. With
``dropout_p > 0`` on CPU it falls back to its "math" path: a float Bernoulli draw per score (the largest single cost
of a Longformer training step at 4k tokens, measured 322 ms of 2.1 s), a float noise tensor, and three score-sized
tensors kept for the backward pass (probabilities, noise, dropped probabilities: 12 bytes per score).

:func:`attention` keeps the fused kernel where it applies and otherwise runs :class:`_DropoutAttention`, which

* draws the dropout mask as 16-bit random integers, four per 64-bit draw (``layers.fast_dropout.dropout_mask``:
  about 8x cheaper than ``bernoulli_``; drop probability within ``2**-17`` of ``p``);
* keeps the probabilities and a 1-byte mask for the backward pass (5 bytes per score instead of 12);
* computes the gradient in closed form: with ``P`` the probabilities, ``M`` the kept mask scaled by ``1 / (1 - p)``,
  ``O = (P * M) V`` and upstream gradient ``dO``::

      dV = (P * M)^T dO,   dP = (dO V^T) * M,   dS = P * (dP - rowsum(dO * O)),   dQ = dS K / sqrt(d),   dK = dS^T Q / sqrt(d)

  where ``P * dP = (P * M) * (dO V^T)``, so ``dS = (P * M) * (dO V^T) - P * rowsum(dO * O)``

  (``rowsum(P * dP) = rowsum(dO * O)`` also with dropout, as in FlashAttention).

The distribution is ``nn.Dropout``'s (to ``2**-17`` in ``p``); the random stream is not, so training-mode outputs
differ from a run with SDPA's dropout (eval mode is unaffected). Traced graphs (``torch.compile`` /
``torch.export``) keep SDPA.

The kernel is for the CPU only. On any other device SDPA's fused kernels (flash, memory-efficient) fuse the dropout
and never build the score matrix, which no hand-written per-head ``bmm`` can beat: there :func:`attention` is SDPA.

Precision: scores, probabilities and products run in one compute dtype, the autocast dtype inside an autocast region
(what SDPA would compute in) and otherwise the inputs' common dtype; the softmax itself is taken in float32 and its
probabilities rounded to the compute dtype, as SDPA's math path does. In half precision the operands are made
head-major and contiguous once and every product is one batched call (:func:`_head_major`): the AMX kernels copy any
other layout in every call. float32 keeps the per-head products on views, which need no copy at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .fast_dropout import dropout_mask
from .input_checks import is_tracing
from .precision import is_half_precision


def _per_head_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` ``(heads, batch, n, k)`` @ ``b`` ``(heads, batch, k, m)`` -> contiguous ``(heads, batch, n, m)``, one
    ``torch.bmm`` per head: the operands may be any strided views, where ``torch.matmul`` would first copy a pair of
    batch dimensions it cannot merge (Longformer's overlapping key windows)."""
    out = a.new_empty(a.shape[0], a.shape[1], a.shape[2], b.shape[3])
    for h in range(a.shape[0]):
        torch.bmm(a[h], b[h], out=out[h])
    return out


def _head_major(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(batch, heads, ...)`` -> ``(heads, batch, ...)``: a view in float32 (:func:`_per_head_bmm` takes any strides),
    a contiguous copy in half precision, whose batched products otherwise copy every strided operand in every call
    and every head (measured: a Longformer block product at 4k tokens 577 ms per-head on strided views, 160 ms with
    one copy and one batched product; no copy at all where the operand is already head-major)."""
    views = tuple(t.transpose(0, 1) for t in tensors)
    return tuple(t.contiguous() for t in views) if is_half_precision(tensors[0].dtype) else views


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(heads, batch, n, k)`` @ ``(heads, batch, k, m)``: one batched product over ``heads * batch`` for
    half-precision operands (contiguous up to a transpose of the last two dimensions, :func:`_head_major`), one per
    head otherwise (:func:`_per_head_bmm`)."""
    return torch.matmul(a, b) if is_half_precision(a.dtype) else _per_head_bmm(a, b)


class _DropoutAttention(torch.autograd.Function):
    """``dropout(softmax(q k^T / sqrt(d) + mask), p) v`` with a compact saved state (see the module docstring).

    Inputs and gradients are ``(batch, heads, ...)``; inside, everything is head-major ``(heads, batch, ...)``
    (:func:`_per_head_bmm`), so ``q``, ``k`` and ``v`` are never copied, in the forward or the backward pass. The
    ``1 / (1 - p)`` scale is applied to the ``(L, d)`` outputs and gradients, not to the ``(Lq, Lk)`` probabilities.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, p):  # noqa: D102 (documented on `attention`; q, k, v share one dtype)
        qh, kh, vh = _head_major(q, k, v)
        scores = _bmm(qh * q.shape[-1] ** -0.5, kh.transpose(-1, -2))
        if mask is not None:
            # Broadcast like SDPA (trailing dimensions align), then to the head-major layout of `scores`.
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).transpose(0, 1)
            if mask.dtype == torch.bool:
                scores.masked_fill_(~mask, float("-inf"))
            else:
                scores += mask
        # Softmax statistics in at least float32: CPU softmax of half-precision scores accumulates in float32 and
        # rounds only its output, the same probabilities as a float32 softmax cast down, without a float32 copy.
        probs = torch.softmax(scores, dim=-1)
        del scores
        dropped = dropout_mask(probs.shape, p, probs.device)
        out = _bmm(probs.masked_fill(dropped, 0.0), vh).mul_(1.0 / (1.0 - p))
        # The inputs as given (views, no memory of their own), not the head-major copies of half precision.
        ctx.save_for_backward(q, k, v, probs, dropped, out)
        ctx.p = p
        return out.transpose(0, 1)

    @staticmethod
    @once_differentiable  # the closed-form gradient is not itself differentiable: say so instead of a wrong result
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, probs, dropped, out = ctx.saved_tensors
        qh, kh, vh = _head_major(q, k, v)
        (grad_out,) = _head_major(grad_out)  # like everything saved
        row_dot = (grad_out * out).sum(-1, keepdim=True)  # rowsum(P * dP)
        # dO / (1 - p): the gradient of the kept, unscaled probabilities' product.
        grad_kept = grad_out.mul(1.0 / (1.0 - ctx.p))
        kept = probs.masked_fill(dropped, 0.0)
        grad_v = _bmm(kept.transpose(-1, -2), grad_kept)
        # dS = P * (M * dP - rowsum(P * M * dP)) = kept * dP - P * rowsum(...): two passes over the scores, no mask.
        grad_scores = _bmm(grad_kept, vh.transpose(-1, -2)).mul_(kept).addcmul_(probs, row_dot, value=-1.0)
        scale = qh.shape[-1] ** -0.5
        grad_q = _bmm(grad_scores, kh).mul_(scale)
        grad_k = _bmm(grad_scores.transpose(-1, -2), qh).mul_(scale)
        return grad_q.transpose(0, 1), grad_k.transpose(0, 1), grad_v.transpose(0, 1), None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention; the drop-in for ``F.scaled_dot_product_attention(q, k, v, mask, dropout_p)``.

    Args:
        q: ``(batch, heads, Lq, d)``; k, v: ``(batch, heads, Lk, d)`` (any strides).
        mask: broadcastable to ``(batch, heads, Lq, Lk)`` (at most 4-D): bool (True = may attend) or additive float
            (0 / -inf). Every query row must keep at least one key (a fully masked row gives NaN, as in SDPA's math
            path).
        dropout_p: dropout on the attention probabilities (pass 0 in eval mode).
    Returns:
        ``(batch, heads, Lq, d)`` (with dropout: a head-major buffer seen through a transpose).

    Without dropout, while tracing, or on a device other than the CPU this is SDPA itself (its fused kernels); with
    dropout on the CPU the masked scores are computed explicitly with a cheaper mask draw and smaller saved state
    (module docstring).
    """
    if dropout_p == 0.0 or is_tracing() or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if mask is not None and mask.requires_grad:
        raise ValueError("attention(): the mask must not require a gradient; detach it or pass dropout_p=0.")
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    # The kernel writes into preallocated buffers (`bmm(out=...)`), which autocast does not cast: it runs with autocast
    # off on inputs already in the dtype autocast would have chosen (the backward pass sees no autocast either).
    with torch.autocast("cpu", enabled=False):
        return _DropoutAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), mask, dropout_p)


__all__ = ["attention"]
