"""Packed (padding-free) FAVOR+: every query attends within its own document, as that document's own forward.

A packed batch marks its documents with ``document_ids`` ``(batch, seq)`` (:mod:`~hf_xformers.ops.packing`). Every
sum runs over the query's own document only, and every stabiliser is the one that document's own forward takes (the
max over the document's keys; causally, the running max restarting at the document's first token), so each document
gets its solo output to rounding. Documents are contiguous, so they meet chunks of ``c`` positions as runs: inside a
chunk a same-document mask on the ``(c, c)`` product; across chunks, causally, each chunk's state holds only the
document through its last token and the ``(chunks, chunks)`` matrix keeps chunks of one document
(:func:`packed_causal_linear_attention`); bidirectionally, the parts of each document that crosses a chunk boundary
are summed into one state per such document (:func:`packed_linear_attention`). Nothing costs documents x length, and
the operations of a step are the same whatever the number of documents: where the documents lie against the chunks
(:class:`FavorDocuments`) is worked out once per forward, by tensor operations, and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.shapes import ceil_div, unblock
from .favor_linear import (
    CAUSAL_CHUNK_SIZE,
    ContiguousGradient,
    chunk_scores,
    normalise,
    pad_to_chunks,
    read_states,
    rescale,
    with_ones,
    within_chunks,
)


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
        spans: the ``(start, end)`` of every document of a single unpadded row in host memory
            (:meth:`~hf_xformers.ops.packing.PackedBatch.host_spans`), or None. Given, each document runs its own
            FAVOR+ (:func:`~hf_xformers.attention.favor.favor_attention`): on the CPU the segmented sums above cost
            about three times the documents' own forwards (the packing benchmark's sizes), and a loop launches nothing.
    """

    document_ids: torch.Tensor
    chunk_size: int
    causal: bool
    documents: torch.Tensor | None
    visible: torch.Tensor | None
    continued: torch.Tensor | None
    links: torch.Tensor | None = None
    carried: torch.Tensor | None = None
    pieces: torch.Tensor | None = None
    reads: torch.Tensor | None = None
    tail_slots: torch.Tensor | None = None
    head_slots: torch.Tensor | None = None
    spans: tuple[tuple[int, int], ...] | None = None


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


def favor_documents(
    document_ids: torch.Tensor,
    causal: bool,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
    spans: tuple[tuple[int, int], ...] | None = None,
) -> FavorDocuments:
    """The :class:`FavorDocuments` of ``document_ids`` ``(batch, seq)`` (long, contiguous runs numbered per row), for
    causal or bidirectional packed FAVOR+ in chunks of ``chunk_size``: a fixed number of tensor operations whatever the
    number of documents or the length, no host read. ``spans``: see :class:`FavorDocuments`."""
    if spans is not None:
        return FavorDocuments(document_ids, chunk_size, causal, None, None, None, spans=spans)
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


def as_documents(
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


def running_document_max(x: torch.Tensor, documents: FavorDocuments) -> torch.Tensor:
    """:func:`~hf_xformers.attention.favor_causal.running_max` restarting at every document: ``x`` ``(batch, heads,
    n)``. Across chunks only the maxima of chunks whose last token lies in the document running into chunk ``c``
    count, and only for that document's positions."""
    length, chunk_size = x.shape[-1], documents.chunk_size
    chunks = documents.documents.shape[2]
    x = torch.nn.functional.pad(x, (0, chunks * chunk_size - length), value=float("-inf"))
    x = x.view(*x.shape[:-1], chunks, chunk_size)
    within = x.unsqueeze(-2).masked_fill(~documents.visible, float("-inf")).amax(-1)  # (b, h, C, c)
    before = within[..., -1].unsqueeze(-2).masked_fill(~documents.links, float("-inf")).amax(-1)
    out = torch.maximum(within, before.unsqueeze(-1).masked_fill(~documents.continued, float("-inf")))
    return unblock(out, length, dim=out.dim() - 2)


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
    documents = as_documents(document_ids, False, chunk_size)
    batch, heads, length, _ = query_features.shape
    chunks, chunk_size = documents.documents.shape[2], documents.chunk_size
    q, k, v = pad_to_chunks(chunks, chunk_size, query_features, key_features, with_ones(value))
    k = ContiguousGradient.apply(k)
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
    across = read_states(q, read, query_eps)  # (b, h, C, c, 2 (e + 1))
    across = (across.unflatten(-1, (2, dim)) * documents.reads).sum(-2)
    # Documents inside one chunk: the keys of the query's own document, for queries that read no slot.
    within = within_chunks(chunk_scores(q, k, query_eps), v, documents.visible)
    return normalise(unblock(within + across, length, dim=2))


def packed_causal_linear_attention(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    documents: FavorDocuments,
    query_eps: float,
    key_stabiliser: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`~hf_xformers.attention.favor_causal.causal_linear_attention` with prefix sums that restart at every
    document: ``(batch, heads, seq, m)`` features and ``(batch, heads, seq, e)`` values -> ``(batch, heads, seq, e)``.

    Inside a chunk the causal mask is also a same-document mask. Each chunk's state holds only the keys of the
    document through its last token (the only ones a later chunk can see), and chunk ``c`` sums the states of the
    earlier chunks whose last token lies in the document of its own first token (the mixing matrix keeps those only),
    read by that document's queries: the prefix sum of each document restarts at its first token without subtracting
    anything (no cancellation however long the row). With stabilisers the factors are those of the unpacked form (all
    ``<= 1`` between keys and queries of one document; pairs of different documents are masked out).
    """
    length = query_features.shape[2]
    chunks, chunk_size = documents.documents.shape[2], documents.chunk_size
    q, k, v = pad_to_chunks(chunks, chunk_size, query_features, key_features, with_ones(value))
    k = ContiguousGradient.apply(k)
    scores = chunk_scores(q, k, query_eps)  # (b, h, C, c, c)
    carried = documents.carried.to(k.dtype)  # (b, 1, C, c)
    if key_stabiliser is None:
        within = within_chunks(scores, v, documents.visible)
        own = torch.matmul((k * carried.unsqueeze(-1)).transpose(-1, -2), v)  # (b, h, C, m, e + 1)
        mixing = documents.links.to(own.dtype)
        reference = None
    else:
        # Always padded (by 0 at a multiple of the chunk), so that the operations do not depend on the length;
        # replicating the last stabiliser keeps the padded positions' factors finite (their features are 0).
        s = torch.nn.functional.pad(key_stabiliser, (0, chunks * chunk_size - length), mode="replicate")
        s = s.view(*s.shape[:2], chunks, chunk_size)
        within = within_chunks(scores, v, documents.visible, s)
        last = s[..., -1]  # (b, h, C): the stabiliser of the document through each chunk's end, at that end
        own = torch.matmul((k * (rescale(s, last.unsqueeze(-1)) * carried).unsqueeze(-1)).transpose(-1, -2), v)
        # Chunk c reads earlier states against the stabiliser at the end of chunk c - 1 (chunk 0, which reads none:
        # any finite value); it belongs to the same document wherever a link exists (documents are contiguous), so
        # every factor is <= 1.
        reference = _previous_chunk(last, dim=-1)
        mixing = rescale(last.unsqueeze(-2), reference.unsqueeze(-1)).masked_fill(~documents.links, 0.0)  # (b,h,C,C)
    before = torch.matmul(mixing, own.flatten(-2)).view(own.shape)
    across = read_states(q, before, query_eps)
    if reference is not None:
        across = across * rescale(reference.unsqueeze(-1), s).unsqueeze(-1)
    return normalise(unblock(within + across * documents.continued.unsqueeze(-1), length, dim=2))
