"""The sums of linear (FAVOR+) attention over a whole sequence, and the pieces every form of them shares.

Given features ``phi`` (:mod:`~hf_xformers.attention.favor_features`), bidirectional attention never forms the
``(n, n)`` product::

    out_i = (phi(q_i) + eps) . (sum_j phi(k_j) v_j^T)  /  (phi(q_i) + eps) . (sum_j phi(k_j))

The normaliser rides along as an extra value column of ones (:func:`with_ones`), so one product gives both.
:func:`linear_attention` is that sum; :func:`blocked_softmax_attention` computes it block by block from the queries
and keys (the softmax features of one block at a time). The causal and packed forms
(:mod:`~hf_xformers.attention.favor_causal`, :mod:`~hf_xformers.attention.favor_packed`) work in chunks of
:data:`CAUSAL_CHUNK_SIZE` positions with the helpers here.
"""

from __future__ import annotations

import torch

from .favor_features import QUERY_EPS, finite_or_zero, softmax_kernel_features, softmax_key_logits

CAUSAL_CHUNK_SIZE = 64
"""Positions per chunk of the causal prefix sums and of the packed forms."""
# Bidirectional attention walks the sequence in blocks of this many tokens, so that each block's (heads, block, m)
# features stay in cache instead of streaming a (heads, seq, m) tensor through memory several times.
FEATURE_BLOCK_SIZE = 512


def rescale(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``exp(min(source - target, 0))``: the factor that moves a sum stabilised at ``source`` to ``target``.

    For real keys ``source <= target`` always (running maxima), so the clamp changes nothing; it only keeps the
    factor of keys seen before any real key (features 0, stabiliser replaced by 0) finite, so that ``0 * inf`` never
    makes a NaN.
    """
    return torch.exp((source - target).clamp(max=0.0))


def with_ones(value: torch.Tensor) -> torch.Tensor:
    """``(..., seq, e)`` -> ``(..., seq, e + 1)``: a column of ones, so that the normaliser ``sum_j phi(k_j)`` comes
    out of the same products as the numerator (its last column)."""
    return torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)


def normalise(out: torch.Tensor) -> torch.Tensor:
    """``(..., e + 1)`` numerator and denominator -> ``(..., e)``.

    Only a query with no real key at all (an example made only of padding) has a zero denominator; its numerator is
    zero too. Dividing it by 1 instead gives output 0 *and* finite gradients (clamping to a tiny value would give
    gradients of 1/tiny = inf, and NaN after multiplying by the zero features).
    """
    denominator = out[..., -1:]
    return out[..., :-1] / torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def read_states(query_features: torch.Tensor, states: torch.Tensor, query_eps: float) -> torch.Tensor:
    """``(phi(q) + eps) . states`` without adding ``eps`` to ``phi(q)``: ``query_features`` ``(..., n, m)`` and
    ``states`` ``(..., m, e + 1)`` -> ``(..., n, e + 1)``."""
    out = torch.matmul(query_features, states)
    if query_eps:
        out = out + query_eps * states.sum(-2, keepdim=True)
    return out


def chunk_scores(q: torch.Tensor, k: torch.Tensor, query_eps: float) -> torch.Tensor:
    """``(phi(q) + eps) phi(k)^T`` inside every chunk: ``q``, ``k`` ``(..., chunks, c, m)`` -> ``(..., chunks, c,
    c)``."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    if query_eps:
        scores = scores + query_eps * k.sum(-1).unsqueeze(-2)
    return scores


def within_chunks(
    scores: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, stabiliser: torch.Tensor | None = None
) -> torch.Tensor:
    """What every query reads from the keys of its own chunk: ``scores`` ``(..., chunks, c, c)`` from
    :func:`chunk_scores`, zero where ``visible`` (broadcast to them) is False, times ``value`` ``(..., chunks, c, e +
    1)``. With ``stabiliser`` ``(..., chunks, c)`` (per-position key stabilisers) key ``j``'s term is first moved to
    query ``i``'s stabiliser (:func:`rescale`)."""
    if stabiliser is not None:
        scores = scores * rescale(stabiliser.unsqueeze(-2), stabiliser.unsqueeze(-1))
    return torch.matmul(scores.masked_fill(~visible, 0.0), value)


def linear_attention(
    query_features: torch.Tensor, key_features: torch.Tensor, value: torch.Tensor, query_eps: float = 0.0
) -> torch.Tensor:
    """Bidirectional ``D^-1 (phi(Q) + eps) (phi(K)^T V)``.

    Args:
        query_features, key_features: ``(batch, heads, seq, m)``; value: ``(batch, heads, seq, e)``.
        query_eps: added to every query feature (keeps denominators positive).

    Returns:
        ``(batch, heads, seq, e)``.
    """
    state = torch.matmul(key_features.transpose(-1, -2), with_ones(value))  # (b, h, m, e + 1)
    return normalise(read_states(query_features, state, query_eps))


class ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient.

    Both chunked products read the key features transposed (``phi(K_c)^T V_c`` and ``phi(Q_c) phi(K_c)^T``), so their
    gradient comes back transposed, ``(..., chunks, c, m)`` with the ``c`` positions innermost. Merging chunks and
    positions back into the sequence (the backward of the chunking view) is then a view for one chunk and a copy for
    several: the operations of a step would depend on the length. Made contiguous here, it is one copy every time.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def pad_to_chunks(chunks: int, chunk_size: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``(batch, heads, seq, x)`` tensors -> ``(batch, heads, chunks, chunk_size, x)``, padded with zeros (padded
    positions then add nothing to any sum)."""
    out = []
    for t in tensors:
        t = torch.nn.functional.pad(t, (0, 0, 0, chunks * chunk_size - t.shape[2]))
        out.append(t.view(*t.shape[:2], chunks, chunk_size, t.shape[-1]))
    return out


def blocked_softmax_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    projection: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    query_eps: float = QUERY_EPS,
    block_size: int = FEATURE_BLOCK_SIZE,
) -> torch.Tensor:
    """Bidirectional FAVOR+ (softmax kernel) computed block by block, never holding all features at once.

    The same result as ``linear_attention(softmax_kernel_features(q), softmax_kernel_features(k), v)`` to rounding.
    Keys are taken ``block_size`` at a time: each block's features go straight into the ``(m, e + 1)`` state
    ``sum_j phi(k_j) [v_j, 1]``. The key stabiliser is the running max over the blocks seen so far (per batch element
    and head, over real keys only); when it rises, the state is rescaled by ``exp(old - new)``, so the final state is
    the one a single global max would give. Then queries are taken block by block against the finished state.

    Args:
        query, key: ``(batch, heads, seq, d)``; value: ``(batch, heads, seq, e)`` (float32 from
            :func:`~hf_xformers.attention.favor.favor_attention`).
        projection: ``(m, d)``.
        key_mask: ``(batch, seq)`` bool, True for real tokens, or None when nothing is padded.
        query_eps: added to every query feature.
        block_size: tokens per block.

    Returns:
        ``(batch, heads, seq, e)``, in the inputs' dtype (float32 as
        :func:`~hf_xformers.attention.favor.favor_attention` calls it).
    """
    # Blocks by ``split``, not by indexing: the gradient of a split is one concatenation, where every indexed
    # block's gradient would be a zero-filled full-length tensor (blocks x seq of memory traffic per tensor).
    values = with_ones(value).split(block_size, dim=2)
    masks = key_mask.split(block_size, dim=1) if key_mask is not None else [None] * len(values)
    state = stabiliser = None
    for k, v, mask in zip(key.split(block_size, dim=2), values, masks):
        logits = softmax_key_logits(k, projection, mask)
        block_max = logits.detach().amax(dim=(-2, -1), keepdim=True)  # (b, h, 1, 1)
        new = block_max if stabiliser is None else torch.maximum(stabiliser, block_max)
        # Blocks (or whole examples) of padding only have a -inf max; any finite stabiliser will do for them.
        new = finite_or_zero(new)
        contribution = torch.matmul(logits.sub_(new).exp_().transpose(-1, -2), v)
        state = contribution if state is None else state * torch.exp(stabiliser - new) + contribution
        stabiliser = new
    eps_term = query_eps * state.sum(-2, keepdim=True)  # what adding eps to every query feature contributes
    outputs = []
    for q in query.split(block_size, dim=2):
        query_features = softmax_kernel_features(q, projection, is_query=True)
        outputs.append(normalise(torch.matmul(query_features, state) + eps_term))
    return torch.cat(outputs, dim=2)
