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

  (``rowsum(P * dP) = rowsum(dO * O)`` also with dropout, as in FlashAttention).

The distribution is ``nn.Dropout``'s (to ``2**-17`` in ``p``); the random stream is not, so training-mode outputs
differ from a run with SDPA's dropout (eval mode is unaffected). Traced graphs (``torch.compile`` /
``torch.export``) keep SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..layers.fast_dropout import dropout_mask
from ..layers.input_checks import is_tracing


class _DropoutAttention(torch.autograd.Function):
    """``dropout(softmax(q k^T / sqrt(d) + mask), p) v`` with a compact saved state (see the module docstring).

    Products run one head at a time with ``torch.bmm`` into head-major ``(heads, batch, ...)`` buffers: ``q``, ``k``
    and ``v`` may then be any strided views (Longformer passes overlapping key windows), which ``torch.matmul``
    would first copy, in the forward and again in the backward pass. The ``1 / (1 - p)`` scale is applied to the
    ``(L, d)`` outputs and gradients, not to the ``(Lq, Lk)`` probabilities.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, p):  # noqa: D102 (documented on `attention`)
        heads = q.shape[1]
        scaled_q = q * q.shape[-1] ** -0.5
        scores = q.new_empty(heads, q.shape[0], q.shape[2], k.shape[2])
        for h in range(heads):
            torch.bmm(scaled_q[:, h], k[:, h].transpose(1, 2), out=scores[h])
        if mask is not None:
            # Broadcast like SDPA (trailing dimensions align), then to the head-major layout of `scores`.
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).transpose(0, 1)
            if mask.dtype == torch.bool:
                scores.masked_fill_(~mask, float("-inf"))
            else:
                scores += mask
        probs = torch.softmax(scores, dim=-1)
        del scores
        dropped = dropout_mask(probs.shape, p, probs.device)
        kept = torch.where(dropped, 0.0, probs)
        out = q.new_empty(heads, q.shape[0], q.shape[2], v.shape[-1])
        for h in range(heads):
            torch.bmm(kept[h], v[:, h], out=out[h])
        out = out.mul_(1.0 / (1.0 - p)).transpose(0, 1)
        ctx.save_for_backward(q, k, v, probs, dropped, out)
        ctx.p = p
        return out

    @staticmethod
    @once_differentiable  # the closed-form gradient is not itself differentiable: say so instead of a wrong result
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, probs, dropped, out = ctx.saved_tensors
        heads, scale = q.shape[1], q.shape[-1] ** -0.5
        row_dot = (grad_out * out).sum(-1, keepdim=True).transpose(0, 1)  # rowsum(P * dP), head-major
        # dO / (1 - p): the gradient of the kept, unscaled probabilities' product; head-major and contiguous.
        grad_kept = grad_out.transpose(0, 1).mul(1.0 / (1.0 - ctx.p))
        kept = torch.where(dropped, 0.0, probs)
        grad_v = v.new_empty(heads, v.shape[0], v.shape[2], v.shape[3])
        grad_scores = torch.empty_like(probs)
        for h in range(heads):
            torch.bmm(kept[h].transpose(1, 2), grad_kept[h], out=grad_v[h])
            torch.bmm(grad_kept[h], v[:, h].transpose(1, 2), out=grad_scores[h])
        del kept
        grad_scores.masked_fill_(dropped, 0.0).sub_(row_dot).mul_(probs)  # dS = P * (dP - rowsum(P * dP))
        grad_q = q.new_empty(heads, q.shape[0], q.shape[2], q.shape[3])
        grad_k = k.new_empty(heads, k.shape[0], k.shape[2], k.shape[3])
        for h in range(heads):
            torch.bmm(grad_scores[h], k[:, h], out=grad_q[h])
            torch.bmm(grad_scores[h].transpose(1, 2), q[:, h], out=grad_k[h])
        return grad_q.mul_(scale).transpose(0, 1), grad_k.mul_(scale).transpose(0, 1), grad_v.transpose(0, 1), None, None


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

    Without dropout (or while tracing) this is SDPA itself (its fused kernels); with dropout the masked scores
    are computed explicitly with a cheaper mask draw and smaller saved state (module docstring).
    """
    if dropout_p == 0.0 or is_tracing():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if mask is not None and mask.requires_grad:
        raise ValueError("attention(): the mask must not require a gradient; detach it or pass dropout_p=0.")
    return _DropoutAttention.apply(q, k, v, mask, dropout_p)


__all__ = ["attention"]
