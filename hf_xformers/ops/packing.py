"""Padding-free ("packed") batches: several documents concatenated in one row, and where each one starts.

transformers' ``DataCollatorWithFlattening`` concatenates a batch into one row ``(1, total_tokens)`` and describes the
boundaries in one of three forms: ``position_ids`` that restart at every document (always returned unless asked not
to), ``seq_idx`` (the document of every token, ``return_seq_idx=True``) or FlashAttention's ``cu_seq_lens_q/k`` +
``max_length_q/k`` (``return_flash_attn_kwargs=True``). Every model reduces whichever it is given to one
``document_ids`` tensor ``(batch, seq_len)`` (long, documents numbered 0, 1, ... from the start of each row, each one a
contiguous run of tokens) and hands that to every layer's attention, which then never lets a token see another
document's. None means "one document per row", the ordinary batch.

Forms, in the order they are used when several are given:

* ``seq_idx`` ``(batch, seq_len)``: any integer labels; a new document starts wherever the label changes.
* ``cu_seq_lens_q`` (= ``cu_seq_lens_k``) ``(num_docs + 1,)``: cumulative lengths ``[0, l0, l0 + l1, ..., total]`` of
  the documents of a single row (``batch`` must be 1).
* ``position_ids`` alone, ``batch == 1``, nothing padded, eager mode: a new document starts wherever the position does
  not follow on from the previous one (as transformers infers packing). A batch of several rows, or a padded row, is
  never inferred packed from its positions (padding restarts them too); give ``seq_idx`` to pack several rows, and
  ``seq_idx`` or ``cu_seq_lens`` to a compiled model.
"""

from __future__ import annotations

import torch

from .input_checks import is_tracing

# The keyword arguments of transformers' padding-free collator that describe document boundaries, as every text
# model's and head's forward accepts them.
PACKING_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _runs(labels: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)`` labels -> run numbers ``0, 1, ...`` per row: a new run wherever the label changes."""
    changes = labels[:, 1:] != labels[:, :-1]
    return torch.cat([torch.zeros_like(labels[:, :1]), changes.long().cumsum(-1)], dim=-1)


def document_ids_from_inputs(
    shape: tuple[int, int],
    device: torch.device,
    position_ids: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The document of every token, ``(batch, seq_len)`` long, or None for an ordinary batch (one document per row).

    Args:
        shape: ``(batch, seq_len)`` of the inputs.
        position_ids, seq_idx, cu_seq_lens_q, cu_seq_lens_k: as the padding-free collator returns them (module doc).
        attention_mask: ``(batch, seq_len)``, or None. Restarting ``position_ids`` mark documents only where nothing
            is padded (a left-padded prompt in ``generate()`` restarts its positions after the padding), and only in
            eager mode: a traced graph reads documents from ``seq_idx`` / ``cu_seq_lens`` alone, so that an ordinary
            forward with ``position_ids`` traces the unpacked path.
    Returns:
        None when no boundary form is given, or (eager mode only) when the row holds a single document; else the
        document ids. While tracing the ids are returned as computed (no branch on values).
    Raises:
        ValueError: a boundary tensor of the wrong shape, cumulative lengths that do not add up to the row, or
            ``cu_seq_lens_q`` differing from ``cu_seq_lens_k`` (these encoders attend within one sequence).
    """
    batch, length = shape
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (batch, length):
            raise ValueError(
                f"`seq_idx` must have the shape of `input_ids` {(batch, length)} (the document of every token), got "
                f"{tuple(seq_idx.shape)}; use DataCollatorWithFlattening(return_seq_idx=True)."
            )
        documents = _runs(seq_idx.to(device))
    elif cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        cu = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k
        cu = cu.to(device).reshape(-1).long()
        if batch != 1:
            raise ValueError(
                f"`cu_seq_lens_q/k` describe the documents of one packed row, but the batch has {batch} rows; pack "
                "the batch into one row (DataCollatorWithFlattening) or pass `seq_idx` for several packed rows."
            )
        if not is_tracing():
            if (
                cu_seq_lens_q is not None
                and cu_seq_lens_k is not None
                and not torch.equal(
                    cu_seq_lens_q.reshape(-1).long().to(device), cu_seq_lens_k.reshape(-1).long().to(device)
                )
            ):
                raise ValueError(
                    "`cu_seq_lens_q` and `cu_seq_lens_k` differ; these models attend within each document, so "
                    "queries and keys share the boundaries (pass the collator's values unchanged)."
                )
            if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != length or bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(
                    f"`cu_seq_lens_q/k` must rise from 0 to the row's length {length} (cumulative document "
                    f"lengths), got {cu.tolist()}."
                )
        positions = torch.arange(length, device=device)
        documents = torch.searchsorted(cu[1:-1].contiguous(), positions, right=True)[None]
    elif position_ids is not None and batch == 1 and length > 1 and not is_tracing():
        if tuple(position_ids.shape) != (batch, length):
            return None  # a broadcast (1, seq_len) table of a wider batch: not a packed row
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            return None
        position_ids = position_ids.to(device)
        restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
        documents = torch.cat([torch.zeros_like(position_ids[:, :1]), restarts.long().cumsum(-1)], dim=-1)
    else:
        return None
    if is_tracing():
        return documents
    return documents if bool((documents[:, -1] > 0).any()) else None


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)`` bool: True at the first token of every document."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def positions_in_documents(document_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``(batch, seq_len)`` long: each token's position inside its document, counted from ``start``."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    first = torch.where(document_starts(document_ids), index, torch.zeros_like(index)).cummax(-1).values
    return index - first + start


def document_lengths(document_ids: torch.Tensor) -> torch.Tensor:
    """``(num_documents,)`` long: the length of every document, row by row (a host read: eager only)."""
    counts = []
    for row in document_ids:
        counts.append(torch.bincount(row, minlength=int(row[-1]) + 1))
    return torch.cat(counts)


def document_spans(document_ids: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The ``(start, end)`` token spans of the documents of a single packed row ``(1, seq_len)`` (a host read: eager
    only), for mechanisms that run each document as its own forward would (SDPA, FAVOR+ per document)."""
    ends = torch.cumsum(document_lengths(document_ids[:1]), 0).tolist()
    return tuple(zip([0, *ends[:-1]], ends))


def flat_document_index(document_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)`` long: document numbers that run on across rows (row 1's first document follows row 0's
    last), so that ``index_add`` / ``scatter`` over this index give one slot per document of the whole batch."""
    per_row = document_ids[:, -1] + 1
    offsets = torch.cumsum(per_row, 0) - per_row
    return document_ids + offsets[:, None]


def same_document(document_ids_q: torch.Tensor, document_ids_k: torch.Tensor) -> torch.Tensor:
    """``(batch, q_len, k_len)`` bool: True where query and key lie in the same document."""
    return document_ids_q[:, :, None] == document_ids_k[:, None, :]


def unpack_documents(values: torch.Tensor, document_ids: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """A packed ``(batch, seq_len, ...)`` tensor as one row per document, ``(num_documents, longest, ...)``, the
    places beyond a document's end set to ``fill`` (a host read: eager only)."""
    flat = flat_document_index(document_ids).reshape(-1)
    inside = positions_in_documents(document_ids).reshape(-1)
    lengths = document_lengths(document_ids)
    out = values.new_full((lengths.numel(), int(lengths.max()), *values.shape[2:]), fill)
    out[flat, inside] = values.reshape(-1, *values.shape[2:])
    return out


def refuse_packed(model_name: str, reason: str, instead: str) -> None:
    """Raise the ``ValueError`` of a model that cannot attend within packed documents."""
    raise ValueError(f"{model_name} cannot take a packed (padding-free) batch: {reason}. {instead}")


__all__ = [
    "PACKING_KWARGS",
    "document_ids_from_inputs",
    "document_lengths",
    "document_spans",
    "document_starts",
    "flat_document_index",
    "positions_in_documents",
    "refuse_packed",
    "same_document",
    "unpack_documents",
]
