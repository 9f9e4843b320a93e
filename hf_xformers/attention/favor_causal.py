"""Causal FAVOR+: ``out_i`` reads keys ``j <= i`` only, by chunked prefix sums.

Causal attention is computed in chunks of ``chunk_size`` positions: inside a chunk a small masked quadratic product,
across chunks an exclusive prefix sum of the per-chunk ``phi(K)^T V`` states. That is the prefix-sum formulation with
one stored state per chunk instead of per position.

Stabiliser. Query ``i`` reads the keys against the max over keys ``j <= i`` only (a running max,
:func:`running_max`): with one max over all keys, a later key with a much larger logit made earlier keys' features
underflow (``exp(-100)`` is subnormal in float32), so past outputs depended on future tokens, and cached decoding
(which cannot see them) disagreed with the full forward. Key ``j`` is then stored as ``exp(l_j - s_j)`` and rescaled
by ``exp(s_j - s_i) <= 1`` where query ``i`` reads it; across chunks that makes a ``(chunks, chunks)`` matrix of
rescaling factors, entries ``<= 1``, instead of a plain ``cumsum``.

Packed batches restart every sum and every running max at each document's first token
(:mod:`~hf_xformers.attention.favor_packed`).
"""

from __future__ import annotations

import torch

from ..ops.input_checks import is_tracing
from ..ops.shapes import ceil_div, unblock
from .favor_features import finite_or_zero
from .favor_linear import CAUSAL_CHUNK_SIZE, chunk_scores, normalise, read_states, rescale, with_ones, within_chunks
from .favor_packed import FavorDocuments, as_documents, packed_causal_linear_attention, running_document_max


def running_max(
    x: torch.Tensor,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> torch.Tensor:
    """``out[..., i] = max(x[..., :i + 1])`` along the last dimension, with operations every exporter knows.

    (``torch.cummax`` has no ONNX form.) Chunks of ``chunk_size``: inside a chunk a masked ``(c, c)`` max, across
    chunks a masked ``(chunks, chunks)`` max of the chunk maxima.

    Args:
        x: ``(..., n)``, may hold ``-inf``; ``(batch, heads, n)`` when ``document_ids`` is given.
        document_ids: ``(batch, n)`` long, or their causal :class:`~hf_xformers.attention.favor_packed.FavorDocuments`
            (whose chunk size then counts), or None. Given, the max restarts at every document's first token (over
            ``j <= i`` in ``i``'s document only).

    Returns:
        ``(..., n)``.
    """
    if document_ids is not None:
        return running_document_max(x, as_documents(document_ids, True, chunk_size))
    length = x.shape[-1]
    chunks = ceil_div(length, chunk_size)
    x = torch.nn.functional.pad(x, (0, chunks * chunk_size - length), value=float("-inf"))
    x = x.view(*x.shape[:-1], chunks, chunk_size)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    within = x.unsqueeze(-2).masked_fill(~causal, float("-inf")).amax(-1)  # (..., chunks, c)
    index = torch.arange(chunks, device=x.device)
    earlier = index[None, :] < index[:, None]  # (chunks, chunks): chunk c' strictly before chunk c
    before = within[..., -1].unsqueeze(-2).masked_fill(~earlier, float("-inf")).amax(-1)  # (..., chunks)
    out = torch.maximum(within, before.unsqueeze(-1))
    return unblock(out, length, dim=out.dim() - 2)


def causal_softmax_key_features(
    key_logits: torch.Tensor,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causally stabilised key features: ``exp(l_j - s_j)`` with ``s_j`` the max of ``key_logits`` over keys
    ``j' <= j`` and all features (per batch element and head; in a packed batch over ``j'`` in ``j``'s document).

    Args:
        key_logits: ``(batch, heads, seq, m)`` from :func:`~hf_xformers.attention.favor_features.softmax_key_logits`.
        document_ids: ``(batch, seq)`` long, or their causal
            :class:`~hf_xformers.attention.favor_packed.FavorDocuments`, or None.

    Returns:
        ``(features, stabiliser)``: ``(batch, heads, seq, m)`` and ``(batch, heads, seq)`` (0 where no real key has
        been seen yet, whose features are all 0), both without gradient through the stabiliser (it cancels).
    """
    stabiliser = finite_or_zero(running_max(key_logits.detach().amax(-1), chunk_size, document_ids))
    return (key_logits - stabiliser.unsqueeze(-1)).exp(), stabiliser


def causal_linear_attention(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
    query_eps: float = 0.0,
    key_stabiliser: torch.Tensor | None = None,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> torch.Tensor:
    """Causal ``out_i = q_i . S_i / q_i . z_i`` with ``q_i = phi(q_i) + eps``, ``S_i = sum_{j<=i} phi(k_j) v_j^T`` and
    ``z_i = sum_{j<=i} phi(k_j)``, by chunked prefix sums.

    Within a chunk of ``c`` positions: ``(q_c phi(K_c)^T * lower-triangle) V_c``; from earlier chunks: an exclusive
    cumulative sum over chunks of ``phi(K_c)^T V_c``. The normaliser ``z`` rides along as an extra value column of
    ones. Memory: ``(seq / c) * m * (e + 1)`` per (batch, head) for the states.

    With ``key_stabiliser`` ``s`` (per-position stabilisers, :func:`causal_softmax_key_features`), key ``j``'s
    features are ``phi(k_j) exp(-s_j)`` and query ``i`` reads them times ``exp(s_j - s_i)``: every term is then
    ``phi(k_j) exp(-s_i)``, one constant per query that cancels. Across chunks each chunk's state is expressed
    against the stabiliser at its last position and combined by a ``(chunks, chunks)`` matrix of such factors
    (a cumulative sum would need one common stabiliser, the thing this avoids): ``chunks^2 * m * (e + 1)`` extra
    multiply-adds, a third of the linear part's at 4096 tokens with ``c = 64``.

    Args:
        query_features, key_features: ``(batch, heads, seq, m)``; value: ``(batch, heads, seq, e)`` (float32 from
            :func:`~hf_xformers.attention.favor.favor_attention`, which is what keeps the prefix sums, where long
            sequences accumulate rounding error fastest, in float32).
        chunk_size: ``c``.
        query_eps: added to every query feature.
        key_stabiliser: ``(batch, heads, seq)`` non-decreasing along ``seq``, or None (features used as they are).
            With ``document_ids``, non-decreasing within each document (it restarts at each one).
        document_ids: ``(batch, seq)`` long, the document of every token of a packed batch, or their causal
            :class:`~hf_xformers.attention.favor_packed.FavorDocuments` (whose chunk size then counts), or None: the
            sums then run over ``j <= i`` in ``i``'s document only (they restart at every document's first token).

    Returns:
        ``(batch, heads, seq, e)``.
    """
    if document_ids is not None:
        return packed_causal_linear_attention(
            query_features, key_features, value, as_documents(document_ids, True, chunk_size), query_eps,
            key_stabiliser,
        )  # fmt: skip
    length = query_features.shape[2]
    q, k, v, s = _in_chunks(query_features, key_features, with_ones(value), key_stabiliser, chunk_size)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    within = within_chunks(chunk_scores(q, k, query_eps), v, causal, s)
    return normalise(unblock(within + _from_earlier_chunks(q, k, v, s, query_eps), length, dim=2))


def _in_chunks(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    key_stabiliser: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(batch, heads, seq, x)`` features and values (and ``(batch, heads, seq)`` stabilisers) -> ``(batch, heads,
    chunks, chunk_size, x)`` (and ``(batch, heads, chunks, chunk_size)``), padded to whole chunks."""
    batch, heads, length, num_features = query_features.shape
    dim = value.shape[-1]
    # Ceil-division written so that a symbolic length traces (chunks * chunk_size - length is the padding).
    chunks = ceil_div(length, chunk_size)
    pad = chunks * chunk_size - length
    if is_tracing() or length % chunk_size:  # traced graphs always pad (by 0 at a multiple): no branch on the length
        # Zero features and values: the padded positions add nothing to any sum.
        query_features, key_features, value = (
            torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (query_features, key_features, value)
        )
        if key_stabiliser is not None:
            # Replicating the last stabiliser keeps the padded positions' factors finite (their features are 0).
            key_stabiliser = torch.nn.functional.pad(key_stabiliser, (0, pad), mode="replicate")
    q = query_features.view(batch, heads, chunks, chunk_size, num_features)
    k = key_features.view(batch, heads, chunks, chunk_size, num_features)
    v = value.view(batch, heads, chunks, chunk_size, dim)
    s = None if key_stabiliser is None else key_stabiliser.view(batch, heads, chunks, chunk_size)
    return q, k, v, s


def _from_earlier_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor | None, query_eps: float
) -> torch.Tensor:
    """What every query reads from the chunks before its own: ``q``, ``k`` ``(batch, heads, chunks, c, m)``, ``v``
    ``(batch, heads, chunks, c, e + 1)``, ``s`` ``(batch, heads, chunks, c)`` or None -> ``(batch, heads, chunks,
    c, e + 1)``, expressed against each query's own stabiliser."""
    if s is None:
        states = torch.matmul(k.transpose(-1, -2), v).cumsum(dim=2)  # (b, h, chunks, m, e + 1), inclusive
        before = torch.cat([torch.zeros_like(states[:, :, :1]), states[:, :, :-1]], dim=2)  # exclusive prefix sum
        return read_states(q, before, query_eps)
    last = s[..., -1]  # (b, h, chunks): the stabiliser each chunk's own state is expressed against
    own = torch.matmul((k * rescale(s, last.unsqueeze(-1)).unsqueeze(-1)).transpose(-1, -2), v)  # (b,h,C,m,e+1)
    # The state before chunk c, expressed against the stabiliser at the end of chunk c - 1 (for c = 0: empty).
    reference = torch.cat([last[..., :1], last[..., :-1]], dim=-1)
    index = torch.arange(s.shape[2], device=q.device)
    earlier = index[None, :] < index[:, None]
    mixing = rescale(last.unsqueeze(-2), reference.unsqueeze(-1)).masked_fill(~earlier, 0.0)  # (b, h, C, C)
    before = torch.matmul(mixing, own.flatten(-2)).view(own.shape)
    return read_states(q, before, query_eps) * rescale(reference.unsqueeze(-1), s).unsqueeze(-1)
