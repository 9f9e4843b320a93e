"""Performer attention: FAVOR+ (Choromanski et al., 2021), softmax attention through positive random features.

Semantics. Softmax attention ``softmax(q k^T / sqrt(d)) v`` is ``D^-1 A v`` with ``A_ij = exp(q_i . k_j / sqrt(d))``.
FAVOR+ writes ``exp(x . y) = E_w[phi(x) . phi(y)]`` with positive features (``x_hat = x * d^-1/4``)::

    phi(x)_r = m^-1/2 * exp(w_r . x_hat - |x_hat|^2 / 2)        r = 1 .. m,  w_r = rows of the projection (m, d)

and replaces ``A`` by ``phi(Q) phi(K)^T``. Never forming that ``(n, n)`` product, the output is::

    out_i = phi(q_i) . (sum_j phi(k_j) v_j^T)  /  phi(q_i) . (sum_j phi(k_j))         (bidirectional)
    out_i = the same with sums over j <= i only                                        (causal, prefix sums)

at a cost linear in the sequence length. The rows ``w_r`` are *orthogonal random features*: blocks of ``d``
exactly orthogonal Gaussian directions (QR of a Gaussian matrix), each row rescaled to the length of a
Gaussian vector, which lowers the variance of the estimate compared with i.i.d. Gaussian rows.

Numerics, and why each choice:

* Stabilisers. ``exp`` overflows for large logits, so a constant is subtracted inside the exponential: per
  query row (the max over that row's features), and for keys one constant per (batch element, head), the
  max over that example's real keys and features. Either constant cancels between numerator and denominator,
  so the result does not depend on it; a constant shared across the batch would (through under/overflow)
  make an example's output depend on its batch-mates, which is why there is none. Causal attention uses, for
  query ``i``, the max over keys ``j <= i`` only (a running max, :func:`running_max`): with one max over all
  keys, a later key with a much larger logit made earlier keys' features underflow (``exp(-100)`` is subnormal in
  float32), so past outputs depended on future tokens, and cached decoding (which cannot see them) disagreed
  with the full forward. Key ``j`` is then stored as ``exp(l_j - s_j)`` and rescaled by ``exp(s_j - s_i) <= 1``
  where query ``i`` reads it.
* ``eps`` (1e-6 of a row's largest feature) is added to the *query* features only: it keeps every denominator
  positive (at least one key feature is 1 after stabilising) while the key stabiliser still cancels exactly.
* Constant factors (``m^-1/2``; for a query row ``exp(-|q_hat|^2 / 2)``) cancel the same way and are not computed.
* Padding: padded keys get features of exactly zero (their logits are set to ``-inf`` before the exponential
  and before the key stabiliser is taken), so they contribute nothing and do not move the stabiliser. ``-inf`` is
  safe here because those logits are always float32 (next point) and an example with no real key is handled
  explicitly; ``key_mask=None`` means nothing is padded (the model turns an all-True mask into None once per
  forward, so no layer reads the mask back to the host to find out).
* Precision. :func:`favor_attention` casts queries, keys, values and the projection to float32 and turns autocast
  off for everything after the q/k/v projections: the projection onto the random features, the exponentials and
  their stabilisers, the key-value sums (the causal prefix sums included) and the normaliser all compute in float32
  under ``torch.autocast`` and with half-precision weights (under autocast a matmul would otherwise run in half
  precision, and the ratio of two such sums loses about 1 % to 2 % of accuracy in bfloat16). Only the context is
  cast back, to the dtype of the values. With half-precision weights the projection buffer itself holds values
  rounded to that dtype, which are then used in float32.

The generalized kernel option (``kernel="relu"``) uses ``phi(x) = relu(W x_hat) + 1e-3`` instead: a different
(not softmax) attention kernel from the same paper, cheaper and without exponentials.

Causal attention is computed in chunks of ``chunk_size`` positions: inside a chunk a small masked quadratic
product, across chunks an exclusive prefix sum of the per-chunk ``phi(K)^T V`` states (with the running-max
stabiliser a ``(chunks, chunks)`` matrix of rescaling factors, entries ``<= 1``, instead of a plain ``cumsum``). That
is the prefix-sum formulation with one stored state per chunk instead of per position.

Packed (padding-free) batches (``document_ids`` ``(batch, seq)``, :mod:`~hf_xformers.ops.packing`): every sum above
runs over the query's own document only, and every stabiliser is the one that document's own forward takes (the max
over the document's keys; causally, the running max restarting at the document's first token), so each document gets
its solo output to rounding. Documents are contiguous, so they meet chunks of ``c`` positions as runs: inside a chunk a
same-document mask on the ``(c, c)`` product; across chunks, causally, each chunk's state holds only the document
through its last token and the ``(chunks, chunks)`` matrix keeps chunks of one document
(:func:`causal_linear_attention`); bidirectionally, the parts of each document that crosses a chunk boundary are
summed into one state per such document (:func:`packed_linear_attention`). Nothing costs documents x length, and
the operations of a step are the same whatever the number of documents: where the documents lie against the chunks
(:class:`FavorDocuments`) is worked out once per forward, by tensor operations, and shared by every layer.

Cached decoding (:func:`favor_attention_with_state`) is the same causal attention in its recurrent form: per
(batch, head) the running sum ``S = sum_j phi(k_j) [v_j, 1]`` ``(m, e + 1)`` and, for the softmax kernel, the running
key stabiliser it is expressed against. A new token rescales ``S`` when the stabiliser rises, adds its key and reads
its output: a cost independent of how many tokens came before.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ..configs.choices import FAVOR_KERNELS
from ..ops.input_checks import is_tracing
from ..ops.packing import same_document
from ..ops.precision import float32_autocast_off
from ..ops.shapes import ceil_div, merge_heads, split_heads, unblock
from .base import AttentionOutput, QKVProjection

KERNELS = FAVOR_KERNELS
QUERY_EPS = 1e-6
RELU_EPS = 1e-3
CAUSAL_CHUNK_SIZE = 64
# Bidirectional attention walks the sequence in blocks of this many tokens, so that each block's (heads, block, m)
# features stay in cache instead of streaming a (heads, seq, m) tensor through memory several times.
FEATURE_BLOCK_SIZE = 512


def default_num_features(head_dim: int) -> int:
    """``int(d * ln d)`` random features for head size ``d`` (the paper's choice; 266 for ``d = 64``)."""
    return max(1, int(head_dim * math.log(head_dim)))


def draw_random_features(
    num_features: int, head_dim: int, generator: torch.Generator, orthogonal: bool = True
) -> torch.Tensor:
    """Random projection rows ``w_r`` for FAVOR+.

    Args:
        num_features: ``m``, rows to draw.
        head_dim: ``d``.
        generator: CPU generator the draw comes from (the caller seeds it).
        orthogonal: blocks of ``d`` mutually orthogonal rows (QR of Gaussian matrices, signs fixed so each block
            is Haar-distributed), rows rescaled to the norms of independent Gaussian vectors (chi-distributed,
            so each row on its own is still a Gaussian vector). False: plain i.i.d. ``N(0, 1)`` rows.

    Returns:
        ``(num_features, head_dim)`` float32 tensor on CPU (whatever the default device and default dtype: the draw is
        the generator's, the same numbers wherever and in whatever dtype the model then runs; a model in 16 bits
        rounds them. Drawn in 16 bits they would be other numbers, and the CPU has no 16-bit QR).
    """
    cpu32 = dict(generator=generator, device="cpu", dtype=torch.float32)
    if not orthogonal:
        return torch.randn(num_features, head_dim, **cpu32)
    blocks = []
    for _ in range(-(-num_features // head_dim)):
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, **cpu32))
        # QR alone is not uniformly distributed over rotations; fixing the signs by diag(R) makes it so.
        q = q * torch.sign(torch.diagonal(r))
        blocks.append(q.T)
    rows = torch.cat(blocks)[:num_features]
    norms = torch.randn(num_features, head_dim, **cpu32).norm(dim=1)
    return rows * norms[:, None]


def document_max(x: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """Every position's document maximum: ``out[b, h, i] = max of x[b, h, j]`` over ``j`` in ``i``'s document.

    A segment max by ``scatter_reduce`` into one slot per document (document ids are below ``seq``, so ``seq`` slots
    per row suffice and no host read sizes the buffer), gathered back per position: linear in ``seq``.

    Args:
        x: ``(batch, heads, seq)``, may hold ``-inf``.
        document_ids: ``(batch, seq)`` long, documents numbered from 0 in each row.

    Returns:
        ``(batch, heads, seq)``.
    """
    index = document_ids[:, None, :].expand_as(x)
    slots = torch.full_like(x, float("-inf")).scatter_reduce(-1, index, x, reduce="amax", include_self=True)
    return slots.gather(-1, index)


def softmax_kernel_features(
    x: torch.Tensor,
    projection: torch.Tensor,
    is_query: bool,
    key_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positive random features ``phi(x)`` of FAVOR+ (module docstring), stabilised, up to constant factors.

    Factors that are the same for every feature of a query row (``m^-1/2``, ``exp(-|q_hat|^2/2)``, the row's
    stabiliser), or for every key of an example and head (``m^-1/2``, the key stabiliser), cancel between the
    numerator and the denominator of the attention, so they are left out:

    * queries: ``exp(w_r . q_hat - max_r' w_r' . q_hat)`` (the largest feature of each row is 1);
    * keys: ``exp(w_r . k_hat - |k_hat|^2 / 2 - s)`` with ``s`` the max of the exponent over the example's real keys
      and all features (per batch element and head; per document of a packed row, the max the document's own
      forward takes); padded keys get exactly 0.

    Computed in place on one ``(batch, heads, seq, m)`` buffer (every step is autograd-safe in place), which matters
    on CPU where each fresh tensor of that size costs page faults.

    Args:
        x: ``(batch, heads, seq, d)`` queries or keys (float32).
        projection: ``(m, d)`` random rows.
        is_query: which of the two stabilisers to use.
        key_mask: ``(batch, seq)`` bool, True for real tokens (keys only), or None when nothing is padded.
        document_ids: ``(batch, seq)`` long, the document of every token of a packed batch (keys only), or None.

    Returns:
        ``(batch, heads, seq, m)``, in ``x``'s dtype (float32 as :func:`favor_attention` calls it).
    """
    head_dim = x.shape[-1]
    logits = torch.matmul(x, projection.T * head_dim**-0.25)  # w_r . x_hat
    if is_query:
        # Detached: the stabiliser cancels in the normalisation, so it carries no gradient either way.
        return logits.sub_(logits.detach().amax(-1, keepdim=True)).exp_()
    logits.sub_((0.5 * head_dim**-0.5) * x.pow(2).sum(-1, keepdim=True))  # - |k_hat|^2 / 2
    if key_mask is not None:
        # -inf before the max and the exponential: padded keys neither move the stabiliser nor count.
        logits.masked_fill_(~key_mask[:, None, :, None], float("-inf"))
    if document_ids is None:
        stabiliser = logits.detach().amax(dim=(-2, -1), keepdim=True)
    else:
        stabiliser = document_max(logits.detach().amax(-1), document_ids).unsqueeze(-1)
    # An example made only of padding has no real key: any finite stabiliser will do (its features are all 0).
    stabiliser = torch.where(torch.isfinite(stabiliser), stabiliser, torch.zeros_like(stabiliser))
    return logits.sub_(stabiliser).exp_()


def relu_kernel_features(
    x: torch.Tensor, projection: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Generalized-kernel features ``relu(W x_hat) + 1e-3`` (zero for padded keys).

    Args:
        x: ``(batch, heads, seq, d)``; projection: ``(m, d)``; key_mask: ``(batch, seq)`` bool or None.

    Returns:
        ``(batch, heads, seq, m)``.
    """
    features = torch.relu(torch.matmul(x, projection.T * x.shape[-1] ** -0.25)) + RELU_EPS
    if key_mask is not None:
        features = features * key_mask[:, None, :, None].to(features.dtype)
    return features


def softmax_key_logits(
    key: torch.Tensor, projection: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The exponents of the key features, ``w_r . k_hat - |k_hat|^2 / 2`` (``-inf`` for padded keys).

    Args:
        key: ``(batch, heads, seq, d)`` (float32); projection: ``(m, d)``; key_mask: ``(batch, seq)`` bool or None.

    Returns:
        ``(batch, heads, seq, m)``.
    """
    head_dim = key.shape[-1]
    logits = torch.matmul(key, projection.T * head_dim**-0.25)
    logits.sub_((0.5 * head_dim**-0.5) * key.pow(2).sum(-1, keepdim=True))
    if key_mask is not None:
        logits.masked_fill_(~key_mask[:, None, :, None], float("-inf"))
    return logits


@dataclass(frozen=True, eq=False)
class FavorDocuments:
    """Where the documents of a packed batch lie against the chunks of ``chunk_size`` positions that packed FAVOR+
    works in: index and mask tensors only, worked out once per forward (the model does it in
    :meth:`~hf_xformers.models.performer.modeling_performer.HfxPerformerModel.prepare_attention_inputs`) and shared by
    every layer, so that a layer adds no operation for the layout and none whose count depends on the number of
    documents. Built by :func:`favor_documents`; nothing in it carries a gradient or is read back to the host.

    ``C = ceil(seq / c)`` chunks of ``c = chunk_size`` positions, the last padded with its row's last document.

    Attributes:
        document_ids: ``(batch, seq)`` long, the run of every token (:class:`~hf_xformers.ops.packing.PackedBatch`).
        chunk_size: ``c``.
        causal: which of the two attentions the masks below serve.
        documents: ``(batch, 1, C, c)`` long, ``document_ids`` in chunks (a head dimension to broadcast).
        visible: ``(batch, 1, C, c, c)`` bool, query ``i`` reads key ``j`` of its chunk through the ``(c, c)``
            product: same document (and ``j <= i`` when causal; bidirectionally only for documents that lie inside
            one chunk, the others read their whole document's state).
        links: causal, ``(batch, 1, C, C)`` bool: chunk ``c'`` comes before chunk ``c`` and its last token lies in the
            document of chunk ``c``'s first token (:func:`_earlier_links`); else None.
        carried: causal, ``(batch, 1, C, c)`` bool, keys of the document through the chunk's last token (the only
            ones a later chunk sees); else None.
        continued: ``(batch, 1, C, c)`` bool, queries of the document through the chunk's first token.
        pieces: bidirectional, ``(batch, 1, C, c, 2, 1)`` float: ``[..., 0, :]`` the keys of the chunk's last
            document (its "tail"), ``[..., 1, :]`` the keys of the document running in from the chunk before, where it
            ends in this chunk (its "head"); else None.
        reads: bidirectional, ``(batch, 1, C, c, 2, 1)`` float: ``[..., 0, :]`` the queries that read the state in
            ``tail_slots`` (their document runs on into the next chunk), ``[..., 1, :]`` those that read the one in
            ``head_slots`` (it runs in from the chunk before); else None.
        tail_slots, head_slots: bidirectional, ``(batch, 1, C, 1, 1)`` long, the state slot in its row
            (``0 .. C - 1``) that each chunk's tail goes to (the first chunk of the run of chunks whose last tokens
            share a document) and that its head goes to (the previous chunk's); else None.
    """

    document_ids: torch.Tensor
    chunk_size: int
    causal: bool
    documents: torch.Tensor
    visible: torch.Tensor
    continued: torch.Tensor
    links: torch.Tensor | None = None
    carried: torch.Tensor | None = None
    pieces: torch.Tensor | None = None
    reads: torch.Tensor | None = None
    tail_slots: torch.Tensor | None = None
    head_slots: torch.Tensor | None = None


def _chunked_documents(document_ids: torch.Tensor, chunks, chunk_size: int) -> torch.Tensor:
    """``(batch, seq)`` document ids -> ``(batch, 1, chunks, chunk_size)`` (a head dimension to broadcast), the
    padding at the end counted in the last document (padded positions carry zero features)."""
    batch, length = document_ids.shape
    pad = chunks * chunk_size - length
    padded = torch.cat([document_ids, document_ids[:, -1:].expand(batch, pad)], dim=1)
    return padded.view(batch, 1, chunks, chunk_size)


def _earlier_links(documents: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, chunks, chunks)`` bool: entry ``[c, c']`` is True where chunk ``c'`` comes before chunk ``c`` and
    its last token lies in the document of chunk ``c``'s first token. Documents being contiguous runs, every chunk
    between them then lies in that document too.

    Args:
        documents: ``(batch, 1, chunks, c)`` from :func:`_chunked_documents`.
    """
    first, last = documents[..., 0], documents[..., -1]  # (b, 1, C)
    index = torch.arange(documents.shape[2], device=documents.device)
    return (index[None, :] < index[:, None]) & (last.unsqueeze(-2) == first.unsqueeze(-1))


def _previous_chunk(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` shifted by one chunk along ``dim`` (chunk ``c`` gets chunk ``c - 1``'s entry, chunk 0 the last one's, which
    every caller masks). A roll, not a slice and a concatenation: slicing ``[:1]`` of a single chunk is a no-op that
    dispatches nothing, so the operations of a step would depend on the length."""
    return torch.roll(x, 1, dims=dim)


def favor_documents(document_ids: torch.Tensor, causal: bool, chunk_size: int = CAUSAL_CHUNK_SIZE) -> FavorDocuments:
    """The :class:`FavorDocuments` of ``document_ids`` ``(batch, seq)`` (long, contiguous runs numbered per row), for
    causal or bidirectional packed FAVOR+ in chunks of ``chunk_size``: a fixed number of tensor operations whatever the
    number of documents or the length, no host read."""
    with torch.no_grad():
        chunks = ceil_div(document_ids.shape[1], chunk_size)
        documents = _chunked_documents(document_ids, chunks, chunk_size)  # (b, 1, C, c)
        same = documents.unsqueeze(-1) == documents.unsqueeze(-2)  # (b, 1, C, c, c)
        first, last = documents.narrow(-1, 0, 1), documents.narrow(-1, chunk_size - 1, 1)  # (b, 1, C, 1)
        continued = documents == first
        if causal:
            causal_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=documents.device).tril()
            return FavorDocuments(
                document_ids, chunk_size, True, documents, same & causal_mask, continued,
                links=_earlier_links(documents), carried=documents == last,
            )  # fmt: skip
        # Chunk c's first document runs in from chunk c - 1 (it is that chunk's last); chunk 0's runs in from nothing.
        index = torch.arange(chunks, device=documents.device)[:, None]  # (C, 1)
        opens = (first != _previous_chunk(last, dim=2)) | (index == 0)  # (b, 1, C, 1)
        runs_in = ~opens
        runs_on = torch.roll(runs_in, -1, dims=2)  # the next chunk's first document is our last (chunk 0: never)
        in_last = documents == last
        reads_in = continued & runs_in
        reads_on = in_last & runs_on & ~reads_in  # (a document that spans the chunk reads once, as running in)
        ends = reads_in & (first != last)  # the document running in ends inside this chunk
        # One slot per run of chunks whose last tokens share a document: the run's first chunk.
        new_run = (last != _previous_chunk(last, dim=2)) | (index == 0)
        run_start = torch.where(new_run, index, torch.zeros_like(index)).cummax(dim=2).values  # (b, 1, C, 1)
        return FavorDocuments(
            document_ids, chunk_size, False, documents, same & ~(reads_in | reads_on).unsqueeze(-1), continued,
            pieces=torch.stack([in_last, ends], dim=-1).unsqueeze(-1).float(),
            reads=torch.stack([reads_on, reads_in], dim=-1).unsqueeze(-1).float(),
            tail_slots=run_start.unsqueeze(-1), head_slots=_previous_chunk(run_start, dim=2).unsqueeze(-1),
        )  # fmt: skip


def _as_documents(
    document_ids: torch.Tensor | FavorDocuments | None, causal: bool, chunk_size: int
) -> FavorDocuments | None:
    """``document_ids`` as the :class:`FavorDocuments` of ``causal`` attention (built here when given as ids)."""
    if document_ids is None or isinstance(document_ids, FavorDocuments):
        if document_ids is not None and document_ids.causal != causal:
            raise ValueError(
                f"These FavorDocuments were built for {'causal' if document_ids.causal else 'bidirectional'} "
                "attention; build them with favor_documents(document_ids, causal=...) for the attention they serve."
            )
        return document_ids
    return favor_documents(document_ids, causal, chunk_size)


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
        document_ids: ``(batch, n)`` long, or their causal :class:`FavorDocuments` (whose chunk size then counts), or
            None. Given, the max restarts at every document's first token (over ``j <= i`` in ``i``'s document only).

    Returns:
        ``(..., n)``.
    """
    if document_ids is not None:
        return _running_document_max(x, _as_documents(document_ids, True, chunk_size))
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


def _running_document_max(x: torch.Tensor, documents: FavorDocuments) -> torch.Tensor:
    """:func:`running_max` restarting at every document: ``x`` ``(batch, heads, n)``. Across chunks only the maxima
    of chunks whose last token lies in the document running into chunk ``c`` count, and only for that document's
    positions."""
    length, chunk_size = x.shape[-1], documents.chunk_size
    chunks = documents.documents.shape[2]
    x = torch.nn.functional.pad(x, (0, chunks * chunk_size - length), value=float("-inf"))
    x = x.view(*x.shape[:-1], chunks, chunk_size)
    within = x.unsqueeze(-2).masked_fill(~documents.visible, float("-inf")).amax(-1)  # (b, h, C, c)
    before = within[..., -1].unsqueeze(-2).masked_fill(~documents.links, float("-inf")).amax(-1)
    out = torch.maximum(within, before.unsqueeze(-1).masked_fill(~documents.continued, float("-inf")))
    return unblock(out, length, dim=out.dim() - 2)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``-inf`` (no real key seen yet) -> 0: any finite stabiliser will do where every feature is 0."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def causal_softmax_key_features(
    key_logits: torch.Tensor,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
    document_ids: torch.Tensor | FavorDocuments | None = None,
):
    """Causally stabilised key features: ``exp(l_j - s_j)`` with ``s_j`` the max of ``key_logits`` over keys
    ``j' <= j`` and all features (per batch element and head; in a packed batch over ``j'`` in ``j``'s document).

    Args:
        key_logits: ``(batch, heads, seq, m)`` from :func:`softmax_key_logits`.
        document_ids: ``(batch, seq)`` long, or their causal :class:`FavorDocuments`, or None.

    Returns:
        ``(features, stabiliser)``: ``(batch, heads, seq, m)`` and ``(batch, heads, seq)`` (0 where no real key has
        been seen yet, whose features are all 0), both without gradient through the stabiliser (it cancels).
    """
    stabiliser = _finite_or_zero(running_max(key_logits.detach().amax(-1), chunk_size, document_ids))
    return (key_logits - stabiliser.unsqueeze(-1)).exp(), stabiliser


def _rescale(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``exp(min(source - target, 0))``: the factor that moves a sum stabilised at ``source`` to ``target``.

    For real keys ``source <= target`` always (running maxima), so the clamp changes nothing; it only keeps the
    factor of keys seen before any real key (features 0, stabiliser replaced by 0) finite, so that ``0 * inf`` never
    makes a NaN.
    """
    return torch.exp((source - target).clamp(max=0.0))


def _with_ones(value: torch.Tensor) -> torch.Tensor:
    """``(..., seq, e)`` -> ``(..., seq, e + 1)``: a column of ones, so that the normaliser ``sum_j phi(k_j)`` comes
    out of the same products as the numerator (its last column)."""
    return torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)


def _normalise(out: torch.Tensor) -> torch.Tensor:
    """``(..., e + 1)`` numerator and denominator -> ``(..., e)``.

    Only a query with no real key at all (an example made only of padding) has a zero denominator; its numerator is
    zero too. Dividing it by 1 instead gives output 0 *and* finite gradients (clamping to a tiny value would give
    gradients of 1/tiny = inf, and NaN after multiplying by the zero features).
    """
    denominator = out[..., -1:]
    return out[..., :-1] / torch.where(denominator > 0, denominator, torch.ones_like(denominator))


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
    state = torch.matmul(key_features.transpose(-1, -2), _with_ones(value))  # (b, h, m, e + 1)
    out = torch.matmul(query_features, state)
    if query_eps:
        out = out + query_eps * state.sum(-2, keepdim=True)  # (phi(q) + eps) . state, without adding eps to phi(q)
    return _normalise(out)


class _ContiguousGradient(torch.autograd.Function):
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


def _pad_to_chunks(chunks: int, chunk_size: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``(batch, heads, seq, x)`` tensors -> ``(batch, heads, chunks, chunk_size, x)``, padded with zeros (padded
    positions then add nothing to any sum)."""
    out = []
    for t in tensors:
        t = torch.nn.functional.pad(t, (0, 0, 0, chunks * chunk_size - t.shape[2]))
        out.append(t.view(*t.shape[:2], chunks, chunk_size, t.shape[-1]))
    return out


def packed_linear_attention(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    document_ids: torch.Tensor | FavorDocuments,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
    query_eps: float = 0.0,
) -> torch.Tensor:
    """Bidirectional ``D^-1 (phi(Q) + eps) (phi(K)^T V)`` with every query reading its own document's keys only.

    Documents are contiguous runs, so against chunks of ``c`` positions each one is either inside a single chunk or
    crosses a chunk boundary. A document inside a chunk is read from a ``(c, c)`` product under a same-document mask.
    A crossing document's state ``sum_j phi(k_j) [v_j, 1]`` is a segmented sum of its parts in the chunks it touches:
    chunk ``c``'s keys of its last document (its "tail") and, where the document running in from chunk ``c - 1``
    ends inside chunk ``c``, that document's keys there (its "head"), both from one product per chunk. Tails of
    consecutive chunks whose last tokens share a document, plus the head after them, are summed into one slot per such
    run (``scatter_add`` over the chunks of each row, at most one slot per chunk), and the queries of a crossing
    document read their slot back (``gather``). No state per token, nothing documents x length, and the same
    operations whatever the number of documents. The sums are plain sums of one document's terms (no prefix-sum
    differences that would cancel).

    Args:
        query_features, key_features: ``(batch, heads, seq, m)``; key features need one constant per document (the
            document's stabiliser), which then cancels.
        value: ``(batch, heads, seq, e)``.
        document_ids: ``(batch, seq)`` long, the document of every token (:mod:`~hf_xformers.ops.packing`), or their
            bidirectional :class:`FavorDocuments` (whose chunk size then counts).
        chunk_size: ``c``.
        query_eps: added to every query feature.

    Returns:
        ``(batch, heads, seq, e)``.
    """
    documents = _as_documents(document_ids, False, chunk_size)
    batch, heads, length, _ = query_features.shape
    chunks, chunk_size = documents.documents.shape[2], documents.chunk_size
    q, k, v = _pad_to_chunks(chunks, chunk_size, query_features, key_features, _with_ones(value))
    k = _ContiguousGradient.apply(k)
    dim = v.shape[-1]
    # Tails and heads of every chunk from one product: (b, h, C, m, 2, e + 1).
    parts = torch.matmul(k.transpose(-1, -2), (v.unsqueeze(-2) * documents.pieces).flatten(-2))
    parts = parts.unflatten(-1, (2, dim))
    tail_slots, head_slots = (
        slots.expand(batch, heads, chunks, parts.shape[3], dim)
        for slots in (documents.tail_slots, documents.head_slots)
    )
    states = torch.zeros_like(parts[..., 0, :]).scatter_add(2, tail_slots, parts[..., 0, :])
    states = states.scatter_add(2, head_slots, parts[..., 1, :])  # (b, h, C, m, e + 1), one per slot
    read = torch.stack([states.gather(2, tail_slots), states.gather(2, head_slots)], dim=-2).flatten(-2)
    across = torch.matmul(q, read)  # (b, h, C, c, 2 (e + 1))
    if query_eps:
        across = across + query_eps * read.sum(-2, keepdim=True)
    across = (across.unflatten(-1, (2, dim)) * documents.reads).sum(-2)
    # Documents inside one chunk: the keys of the query's own document, for queries that read no slot.
    scores = torch.matmul(q, k.transpose(-1, -2))  # (b, h, C, c, c)
    if query_eps:
        scores = scores + query_eps * k.sum(-1).unsqueeze(-2)
    within = torch.matmul(scores.masked_fill(~documents.visible, 0.0), v)
    return _normalise(unblock(within + across, length, dim=2))


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
        query, key: ``(batch, heads, seq, d)``; value: ``(batch, heads, seq, e)`` (float32 from :func:`favor_attention`).
        projection: ``(m, d)``.
        key_mask: ``(batch, seq)`` bool, True for real tokens, or None when nothing is padded.
        query_eps: added to every query feature.
        block_size: tokens per block.

    Returns:
        ``(batch, heads, seq, e)``, in the inputs' dtype (float32 as :func:`favor_attention` calls it).
    """
    head_dim = query.shape[-1]
    weights = projection.T * head_dim**-0.25  # x . weights = w_r . x_hat
    # Blocks by ``split``, not by indexing: the gradient of a split is one concatenation, where every indexed
    # block's gradient would be a zero-filled full-length tensor (blocks x seq of memory traffic per tensor).
    values = _with_ones(value).split(block_size, dim=2)
    masks = key_mask.split(block_size, dim=1) if key_mask is not None else [None] * len(values)
    state = stabiliser = None
    for k, v, mask in zip(key.split(block_size, dim=2), values, masks):
        logits = torch.matmul(k, weights).sub_((0.5 * head_dim**-0.5) * k.pow(2).sum(-1, keepdim=True))
        if mask is not None:
            logits.masked_fill_(~mask[:, None, :, None], float("-inf"))
        block_max = logits.detach().amax(dim=(-2, -1), keepdim=True)  # (b, h, 1, 1)
        new = block_max if stabiliser is None else torch.maximum(stabiliser, block_max)
        # Blocks (or whole examples) of padding only have a -inf max; any finite stabiliser will do for them.
        new = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
        contribution = torch.matmul(logits.sub_(new).exp_().transpose(-1, -2), v)
        state = contribution if state is None else state * torch.exp(stabiliser - new) + contribution
        stabiliser = new
    eps_term = query_eps * state.sum(-2, keepdim=True)  # what adding eps to every query feature contributes
    outputs = []
    for q in query.split(block_size, dim=2):
        query_features = softmax_kernel_features(q, projection, is_query=True)
        outputs.append(_normalise(torch.matmul(query_features, state) + eps_term))
    return torch.cat(outputs, dim=2)


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
            :func:`favor_attention`, which is what keeps the prefix sums, where long sequences accumulate rounding
            error fastest, in float32).
        chunk_size: ``c``.
        query_eps: added to every query feature.
        key_stabiliser: ``(batch, heads, seq)`` non-decreasing along ``seq``, or None (features used as they are).
            With ``document_ids``, non-decreasing within each document (it restarts at each one).
        document_ids: ``(batch, seq)`` long, the document of every token of a packed batch, or their causal
            :class:`FavorDocuments` (whose chunk size then counts), or None: the sums then run over ``j <= i`` in
            ``i``'s document only (they restart at every document's first token).

    Returns:
        ``(batch, heads, seq, e)``.
    """
    if document_ids is not None:
        return _packed_causal_linear_attention(
            query_features, key_features, value, _as_documents(document_ids, True, chunk_size), query_eps,
            key_stabiliser,
        )  # fmt: skip
    batch, heads, length, num_features = query_features.shape
    value = _with_ones(value)
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
    scores = torch.matmul(q, k.transpose(-1, -2))  # (b, h, chunks, c, c)
    if query_eps:
        scores = scores + query_eps * k.sum(-1).unsqueeze(-2)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    if key_stabiliser is None:
        within = torch.matmul(scores.masked_fill(~causal, 0.0), v)
        states = torch.matmul(k.transpose(-1, -2), v).cumsum(dim=2)  # (b, h, chunks, m, e + 1), inclusive
        before = torch.cat([torch.zeros_like(states[:, :, :1]), states[:, :, :-1]], dim=2)  # exclusive prefix sum
        across = torch.matmul(q, before)
        if query_eps:
            across = across + query_eps * before.sum(-2, keepdim=True)
        return _normalise(unblock(within + across, length, dim=2))
    s = key_stabiliser.view(batch, heads, chunks, chunk_size)
    within = torch.matmul((scores * _rescale(s.unsqueeze(-2), s.unsqueeze(-1))).masked_fill(~causal, 0.0), v)
    last = s[..., -1]  # (b, h, chunks): the stabiliser each chunk's own state is expressed against
    own = torch.matmul((k * _rescale(s, last.unsqueeze(-1)).unsqueeze(-1)).transpose(-1, -2), v)  # (b,h,C,m,e+1)
    # The state before chunk c, expressed against the stabiliser at the end of chunk c - 1 (for c = 0: empty).
    reference = torch.cat([last[..., :1], last[..., :-1]], dim=-1)
    index = torch.arange(chunks, device=q.device)
    earlier = index[None, :] < index[:, None]
    mixing = _rescale(last.unsqueeze(-2), reference.unsqueeze(-1)).masked_fill(~earlier, 0.0)  # (b, h, C, C)
    before = torch.matmul(mixing, own.flatten(-2)).view(own.shape)
    across = torch.matmul(q, before)
    if query_eps:
        across = across + query_eps * before.sum(-2, keepdim=True)
    across = across * _rescale(reference.unsqueeze(-1), s).unsqueeze(-1)
    return _normalise(unblock(within + across, length, dim=2))


def _packed_causal_linear_attention(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    documents: FavorDocuments,
    query_eps: float,
    key_stabiliser: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`causal_linear_attention` with prefix sums that restart at every document.

    Inside a chunk the causal mask is also a same-document mask. Each chunk's state holds only the keys of the
    document through its last token (the only ones a later chunk can see), and chunk ``c`` sums the states of the
    earlier chunks whose last token lies in the document of its own first token (the mixing matrix keeps those only),
    read by that document's queries: the prefix sum of each document restarts at its first token without subtracting
    anything (no cancellation however long the row). With stabilisers the factors are those of the unpacked form (all
    ``<= 1`` between keys and queries of one document; pairs of different documents are masked out).
    """
    length = query_features.shape[2]
    chunks, chunk_size = documents.documents.shape[2], documents.chunk_size
    q, k, v = _pad_to_chunks(chunks, chunk_size, query_features, key_features, _with_ones(value))
    k = _ContiguousGradient.apply(k)
    scores = torch.matmul(q, k.transpose(-1, -2))  # (b, h, C, c, c)
    if query_eps:
        scores = scores + query_eps * k.sum(-1).unsqueeze(-2)
    carried = documents.carried.to(k.dtype)  # (b, 1, C, c)
    if key_stabiliser is None:
        within = torch.matmul(scores.masked_fill(~documents.visible, 0.0), v)
        own = torch.matmul((k * carried.unsqueeze(-1)).transpose(-1, -2), v)  # (b, h, C, m, e + 1)
        mixing = documents.links.to(own.dtype)
        reference = None
    else:
        # Always padded (by 0 at a multiple of the chunk), so that the operations do not depend on the length;
        # replicating the last stabiliser keeps the padded positions' factors finite (their features are 0).
        s = torch.nn.functional.pad(key_stabiliser, (0, chunks * chunk_size - length), mode="replicate")
        s = s.view(*s.shape[:2], chunks, chunk_size)
        within = torch.matmul(
            (scores * _rescale(s.unsqueeze(-2), s.unsqueeze(-1))).masked_fill(~documents.visible, 0.0), v
        )
        last = s[..., -1]  # (b, h, C): the stabiliser of the document through each chunk's end, at that end
        own = torch.matmul((k * (_rescale(s, last.unsqueeze(-1)) * carried).unsqueeze(-1)).transpose(-1, -2), v)
        # Chunk c reads earlier states against the stabiliser at the end of chunk c - 1 (chunk 0, which reads none:
        # any finite value); it belongs to the same document wherever a link exists (documents are contiguous), so
        # every factor is <= 1.
        reference = _previous_chunk(last, dim=-1)
        mixing = _rescale(last.unsqueeze(-2), reference.unsqueeze(-1)).masked_fill(~documents.links, 0.0)  # (b,h,C,C)
    before = torch.matmul(mixing, own.flatten(-2)).view(own.shape)
    across = torch.matmul(q, before)
    if query_eps:
        across = across + query_eps * before.sum(-2, keepdim=True)
    if reference is not None:
        across = across * _rescale(reference.unsqueeze(-1), s).unsqueeze(-1)
    return _normalise(unblock(within + across * documents.continued.unsqueeze(-1), length, dim=2))


def dense_kernel_attention(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    causal: bool = False,
    query_eps: float = 0.0,
    key_stabiliser: torch.Tensor | None = None,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The quadratic oracle of :func:`linear_attention` / :func:`causal_linear_attention` /
    :func:`packed_linear_attention`: the same features, with the ``(seq, seq)`` attention matrix formed explicitly
    (and lower-triangular when ``causal``; zero between documents when ``document_ids`` ``(batch, seq)``, or their
    :class:`FavorDocuments`, are given).

    ``key_stabiliser`` ``(batch, heads, seq)``: per-position key stabilisers (causal only), as in
    :func:`causal_linear_attention`.

    Returns:
        ``(out, probs)``: ``(batch, heads, seq, e)`` and ``(batch, heads, seq, seq)`` (rows sum to 1).
    """
    scores = torch.matmul(query_features + query_eps, key_features.transpose(-1, -2))
    if key_stabiliser is not None:
        scores = scores * _rescale(key_stabiliser.unsqueeze(-2), key_stabiliser.unsqueeze(-1))
    if isinstance(document_ids, FavorDocuments):
        document_ids = document_ids.document_ids
    if document_ids is not None:
        scores = scores.masked_fill(~same_document(document_ids, document_ids).unsqueeze(1), 0.0)
    if causal:
        scores = scores.tril()
    total = scores.sum(-1, keepdim=True)
    probs = scores / torch.where(total > 0, total, torch.ones_like(total))
    return torch.matmul(probs, value), probs


def favor_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    projection: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
    kernel: str = "softmax",
    output_attentions: bool = False,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FAVOR+ attention of split heads.

    Everything here computes in float32 with autocast off, whatever the inputs' dtype and the autocast state: the
    feature maps (projection, exponentials, stabilisers), the key-value sums and causal prefix sums, the normaliser
    and the implied attention matrix. Only the results are cast back.

    Args:
        query, key, value: ``(batch, heads, seq, d)``, any float dtype.
        projection: ``(m, d)`` random feature rows, any float dtype (used as its float32 values).
        attention_mask: ``(batch, seq)`` bool, True for real tokens, or None when nothing is padded.
        causal: query ``i`` sees keys ``j <= i`` only.
        kernel: ``"softmax"`` (FAVOR+ positive features) or ``"relu"`` (generalized kernel).
        output_attentions: also return the implied ``(batch, heads, seq, seq)`` attention matrix (quadratic).
        chunk_size: chunk of the causal prefix sums (and of the packed forms).
        document_ids: ``(batch, seq)`` long, the document of every token of a packed batch
            (:mod:`~hf_xformers.ops.packing`), or their :class:`FavorDocuments` for this ``causal`` (worked out once
            per forward by the model; their chunk size then counts), or None: every query then attends within its own
            document only, with that document's own stabilisers (module docstring), as that document's own forward
            would.

    Returns:
        ``(context, probs)``: context ``(batch, heads, seq, d)`` in ``value``'s dtype; probs (same dtype) or None.
    """
    if kernel not in KERNELS:
        raise ValueError(f"Unknown FAVOR kernel {kernel!r}; use one of {KERNELS} (config.favor_kernel).")
    dtype = value.dtype
    with float32_autocast_off(value.device.type):
        query, key, value, projection = (t.float() for t in (query, key, value, projection))
        context, probs = _favor_attention_float32(
            query, key, value, projection, attention_mask, causal, kernel, output_attentions, chunk_size, document_ids
        )
    return context.to(dtype), None if probs is None else probs.to(dtype)


def _favor_attention_float32(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    projection: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    kernel: str,
    output_attentions: bool,
    chunk_size: int,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`favor_attention` on float32 inputs, in their dtype (the caller has turned autocast off)."""
    # The block loop's trip count depends on the length, so traced graphs (torch.compile / torch.export) take the
    # one-shot form below: the same result to rounding, with every key feature in memory at once.
    if kernel == "softmax" and not causal and not output_attentions and document_ids is None and not is_tracing():
        return blocked_softmax_attention(query, key, value, projection, attention_mask), None
    if document_ids is not None and not output_attentions:
        document_ids = _as_documents(document_ids, causal, chunk_size)  # once for the stabilisers and the sums
    ids = document_ids.document_ids if isinstance(document_ids, FavorDocuments) else document_ids
    stabiliser = None
    if kernel == "softmax":
        query_features = softmax_kernel_features(query, projection, is_query=True)
        if causal:
            logits = softmax_key_logits(key, projection, attention_mask)
            key_features, stabiliser = causal_softmax_key_features(logits, chunk_size, document_ids)
        else:
            key_features = softmax_kernel_features(
                key, projection, is_query=False, key_mask=attention_mask, document_ids=ids
            )
        eps = QUERY_EPS
    else:
        query_features = relu_kernel_features(query, projection)
        key_features = relu_kernel_features(key, projection, key_mask=attention_mask)
        eps = 0.0
    if output_attentions:
        # The context comes from the returned (implied) attention matrix, the same numbers to rounding as the linear
        # form, so that the matrix is part of the autograd graph (`retain_grad()` on it gets a gradient).
        return dense_kernel_attention(query_features, key_features, value, causal, eps, stabiliser, document_ids)
    if causal:
        return (
            causal_linear_attention(query_features, key_features, value, chunk_size, eps, stabiliser, document_ids),
            None,
        )
    if document_ids is not None:
        return packed_linear_attention(query_features, key_features, value, document_ids, chunk_size, eps), None
    return linear_attention(query_features, key_features, value, eps), None


FavorState = tuple  # (key_value (batch, heads, m, e + 1), stabiliser (batch, heads) or None), both float32


def favor_attention_with_state(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    projection: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kernel: str,
    state: FavorState | None,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
) -> tuple[torch.Tensor, FavorState]:
    """Causal FAVOR+ of new tokens that follow the tokens summarised by ``state``: the recurrent form (cached decoding).

    The state holds, per (batch element, head), ``S = sum_j phi(k_j) exp(-s) [v_j, 1]`` over every key seen so far
    and, for the softmax kernel, the running key stabiliser ``s`` it is expressed against (the max over the keys
    seen, ``-inf`` before any real one). New tokens read ``S`` rescaled to their own running stabiliser plus the
    keys among themselves (a ``(new, new)`` product), then are added to it: the cost depends on the number of new
    tokens, never on how many came before. The outputs are those of :func:`favor_attention` with ``causal=True`` over
    the whole sequence (the same stabilisers, so the same terms, summed in another order).

    With ``state=None`` (a prompt) the new tokens go through the chunked prefix sums of
    :func:`causal_linear_attention`, and the state after the last of them is formed once.

    Args:
        query, key, value: ``(batch, heads, new, d)`` of the new tokens, any float dtype.
        projection: ``(m, d)``.
        attention_mask: ``(batch, new)`` bool for the new tokens (True = real), or None.
        kernel: ``"softmax"`` or ``"relu"``.
        state: what an earlier call returned, or None.
        chunk_size: chunk of the prefix sums (prompt) and of the running max.

    Returns:
        ``(context, state)``: ``(batch, heads, new, d)`` in ``value``'s dtype, and the state after the new tokens.
    """
    if kernel not in KERNELS:
        raise ValueError(f"Unknown FAVOR kernel {kernel!r}; use one of {KERNELS} (config.favor_kernel).")
    dtype = value.dtype
    with float32_autocast_off(value.device.type):
        query, key, value, projection = (t.float() for t in (query, key, value, projection))
        previous = None if state is None else state[1]
        if kernel == "softmax":
            query_features = softmax_kernel_features(query, projection, is_query=True)
            logits = softmax_key_logits(key, projection, attention_mask)
            running = running_max(logits.detach().amax(-1), chunk_size)  # (b, h, new), -inf before any real key
            if previous is not None:
                running = torch.maximum(running, previous.unsqueeze(-1))
            stabiliser = _finite_or_zero(running)
            key_features = (logits - stabiliser.unsqueeze(-1)).exp()
            eps = QUERY_EPS
        else:
            query_features = relu_kernel_features(query, projection)
            key_features = relu_kernel_features(key, projection, key_mask=attention_mask)
            stabiliser = running = None
            eps = 0.0
        value = _with_ones(value)
        if state is None:
            context = causal_linear_attention(
                query_features, key_features, value[..., :-1], chunk_size, eps, stabiliser
            )
        else:
            # Earlier tokens through the state, the new ones among themselves through a small causal product.
            key_value = state[0]
            scores = torch.matmul(query_features + eps, key_features.transpose(-1, -2))
            if stabiliser is not None:
                scores = scores * _rescale(stabiliser.unsqueeze(-2), stabiliser.unsqueeze(-1))
            out = torch.matmul(scores.tril(), value)
            earlier = torch.matmul(query_features, key_value) + eps * key_value.sum(-2, keepdim=True)
            if stabiliser is not None:
                earlier = earlier * _rescale(previous.unsqueeze(-1), stabiliser).unsqueeze(-1)
            context = _normalise(out + earlier)
        # The state after the last new token, against that token's running stabiliser.
        if stabiliser is not None:
            last = stabiliser[..., -1:]  # (b, h, 1)
            key_features = key_features * _rescale(stabiliser, last).unsqueeze(-1)
        key_value = torch.matmul(key_features.transpose(-1, -2), value)
        if state is not None:
            key_value = key_value + (
                state[0] if stabiliser is None else state[0] * _rescale(previous, last[..., 0])[..., None, None]
            )
        new_state = (key_value, None if running is None else running[..., -1])
    return context.to(dtype), new_state


def _draw_seed(seed: int, layer_idx: int, draw: int) -> int:
    """A 63-bit seed for draw number ``draw`` of layer ``layer_idx``: layers get different features, and the
    sequence of redraws is the same on every run and every process (so DDP ranks stay in step)."""
    digest = hashlib.sha256(f"hfx-performer:{seed}:{layer_idx}:{draw}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class HfxFavorSelfAttention(QKVProjection):
    """FAVOR+ self-attention of one Performer layer (module docstring for the maths).

    Config fields used: ``num_random_features`` (None: ``int(d ln d)``), ``favor_kernel`` (``"softmax"`` or
    ``"relu"``), ``orthogonal_features``, ``random_feature_seed``, ``is_decoder`` (causal attention).
    ``attention_probs_dropout_prob`` is not used: the attention matrix is never formed, so there are no
    probabilities to drop.

    Buffers (saved with the checkpoint): ``projection_matrix`` ``(m, head_dim)``, and ``num_redraws``, the index of
    the current draw. Draw ``t`` of layer ``l`` is seeded by ``(random_feature_seed, l, t)``: a fresh model from the
    same config has the same features, and :meth:`redraw_projection` is the only thing that changes them. Draws are
    made on the CPU (float32) and the buffer moves with the model, so the features are the same numbers on every
    device; ``model.to(half dtype)`` rounds them to that dtype (the attention still computes in float32), and so does
    building the model in a 16-bit dtype (``torch.set_default_dtype``, ``from_pretrained(dtype=...)``): never a 16-bit
    draw, which would be other numbers.

    ``attentions`` (with ``output_attentions=True``): the implied attention matrix ``(batch, heads, seq_len, seq_len)``
    (formed explicitly, quadratic in memory); the context is the linear-time one either way.
    """

    supports_global_attention = False

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads)
        self.layer_idx = layer_idx
        self.num_features = config.num_random_features or default_num_features(self.head_dim)
        self.kernel = config.favor_kernel
        self.orthogonal = config.orthogonal_features
        self.seed = config.random_feature_seed
        self.causal = bool(getattr(config, "is_decoder", False))
        # Drawn in float32, then in the dtype the model is built in (torch.get_default_dtype(); from_pretrained sets it
        # to its `dtype`): a 16-bit model holds the float32 model's features rounded, as after `model.to(dtype)`.
        projection = self.draw_projection_matrix(0).to(torch.get_default_dtype())
        self.register_buffer("projection_matrix", projection)
        self.register_buffer("num_redraws", torch.zeros((), dtype=torch.long))

    def draw_projection_matrix(self, draw: int) -> torch.Tensor:
        """Draw number ``draw`` of this layer's ``(num_features, head_dim)`` projection (float32, CPU)."""
        generator = torch.Generator(device="cpu").manual_seed(_draw_seed(self.seed, self.layer_idx, draw))
        return draw_random_features(self.num_features, self.head_dim, generator, self.orthogonal)

    @torch.no_grad()
    def redraw_projection(self, draw: int | None = None, fresh: torch.Tensor | None = None) -> None:
        """Replace the projection by draw number ``draw`` of this layer's sequence (in place, same device and dtype).

        The draw is made on the CPU from its seed (so it is the same numbers on every device) and copied to the
        buffer's device once.

        Args:
            draw: the draw's number; None: the next one (``num_redraws + 1``, read back from the buffer: a host
                synchronisation when the buffer is on an accelerator, which the model avoids by passing it).
            fresh: that draw's ``(num_features, head_dim)`` rows, already made (on any device), or None to make it.
        """
        if draw is None:
            draw = int(self.num_redraws) + 1
        if fresh is None:
            fresh = self.draw_projection_matrix(draw)
        self.num_redraws.fill_(draw)
        self.projection_matrix.copy_(fresh)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        cache=None,
        document_ids: torch.Tensor | None = None,
        favor_documents: FavorDocuments | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq, hidden)``; ``cache``: a decoding cache (causal only, the model's
        ``HfxPerformerCache``: ``states[layer_idx]`` is this layer's :data:`FavorState`, read and replaced here), or
        None. With a cache, ``seq`` is the new tokens and ``attention_mask`` their mask. ``document_ids``
        ``(batch, seq)`` long: the documents of a packed batch (:mod:`~hf_xformers.ops.packing`), each attended
        within as on its own; None for an ordinary batch. ``favor_documents``: their layout against the chunks
        (:func:`favor_documents`), which the model works out once per forward for every layer; None: worked out
        here from ``document_ids``."""
        if cache is not None and (document_ids is not None or favor_documents is not None):
            raise ValueError(
                "A decoding cache holds one running state per row, so it cannot follow the documents of a packed "
                "batch: decode each document in its own row (or pass use_cache=False)."
            )
        q, k, v = (split_heads(x, self.num_heads) for x in self.fused_qkv(hidden_states))
        if cache is not None:
            state = cache.states[self.layer_idx] if self.layer_idx < len(cache.states) else None
            context, state = favor_attention_with_state(
                q, k, v, self.projection_matrix, attention_mask, self.kernel, state
            )
            cache.set_state(self.layer_idx, state)
            return AttentionOutput(merge_heads(context), None)
        context, probs = favor_attention(
            q, k, v, self.projection_matrix, attention_mask, self.causal, self.kernel, output_attentions,
            document_ids=favor_documents if favor_documents is not None else document_ids,
        )  # fmt: skip
        return AttentionOutput(merge_heads(context), probs)
