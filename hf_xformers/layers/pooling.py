"""One vector, or one row, per sequence: and per document of a packed batch, which the heads answer for.

A packed batch (:class:`~hf_xformers.ops.packing.PackedBatch`) holds several documents in a row; the
sentence-level heads pool each document on its own and QA unpacks its logits into one row per document. Documents
are gathered with ``index_add`` into one slot each (padding into a slot that is dropped): no boolean index, so no
device-to-host read.
"""

from __future__ import annotations

import torch

from ..ops.packing import PackedBatch

CLASSIFIER_POOLINGS = ("first", "mean")


def classifier_pooling(config) -> str:
    """``config.classifier_pooling`` (``"first"`` when unset), checked against :data:`CLASSIFIER_POOLINGS`."""
    pooling = getattr(config, "classifier_pooling", None) or "first"
    if pooling not in CLASSIFIER_POOLINGS:
        raise ValueError(f"classifier_pooling must be one of {CLASSIFIER_POOLINGS}, got {pooling!r}.")
    return pooling


def pool_tokens(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pooling: str,
    packed: PackedBatch | None = None,
) -> torch.Tensor:
    """One vector per sequence: ``(batch, seq_len, hidden)`` -> ``(batch, hidden)``; for a packed batch
    (:class:`~hf_xformers.ops.packing.PackedBatch`) one per document, ``(num_documents, hidden)``.

    ``"first"``: the first token (RoBERTa's ``<s>``). ``"mean"``: the mean over real tokens (``attention_mask``
    ``(batch, seq_len)``, 1 = real; all tokens when None), as the Long Range Arena's models pool.
    """
    if packed is not None:
        return pool_documents(hidden_states, packed, pooling)
    if pooling == "first":
        return hidden_states[:, 0]
    if attention_mask is None:
        return hidden_states.mean(1)
    weights = attention_mask.to(hidden_states.dtype)[..., None]
    return (hidden_states * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def pool_documents(hidden_states: torch.Tensor, packed: PackedBatch, pooling: str = "first") -> torch.Tensor:
    """``(batch, seq_len, hidden)`` -> ``(num_documents, hidden)``: each document's first token, or the mean of its
    tokens (padding never counts)."""
    if pooling == "first":
        return packed.first_tokens(hidden_states)
    count = packed.num_documents()
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    slots = packed.slots()
    sums = flat.new_zeros(count + 1, flat.shape[-1]).index_add(0, slots, flat)[:count]
    counts = flat.new_zeros(count + 1).index_add(0, slots, flat.new_ones(slots.shape))[:count]
    return sums / counts.clamp(min=1.0)[:, None]


def unpack_document_rows(values: torch.Tensor, packed: PackedBatch, fill: float) -> torch.Tensor:
    """A packed ``(batch, seq_len)`` tensor as one row per document ``(num_documents, longest)``, places past a
    document's end set to ``fill`` (padding dropped)."""
    count, longest = packed.num_documents(), packed.longest_document()
    out = values.new_full((count + 1, longest), fill)
    # Padding runs may be longer than any document: their slot is dropped, so any place in it will do. A real token
    # past `longest` (an understated `max_length_q`, unchecked where values cannot be read) fails here instead of
    # overwriting its document's last place.
    positions = packed.assert_within(longest)
    out = out.index_put((packed.index.reshape(-1), positions.reshape(-1)), values.reshape(-1))
    return out[:count]


# What a batch of rows answered per row needs when it packs several documents per row: the boundaries, and a Trainer
# that keeps them (it keeps `seq_idx`, which every forward names, and drops the other columns by default).
UNMARKED_DOCUMENTS_FIX = (
    "if its rows pack several documents, pass their boundaries: `seq_idx` (DataCollatorWithFlattening("
    "return_seq_idx=True)) or `cu_seq_lens_q/k` with `max_length_q/k` (return_flash_attn_kwargs=True); `position_ids` "
    "never mark documents. A Trainer keeps a pre-packed dataset's `seq_idx` column and drops its `cu_seq_lens_*` / "
    "`max_length_*` columns unless TrainingArguments(remove_unused_columns=False)."
)


def check_row_count(what: str, given: int, rows: int) -> None:
    """A ``ValueError`` when a per-row input (``labels`` of sequence classification, QA positions) of a batch that
    marks no documents does not hold one entry per row: most often a packed batch whose boundaries were dropped (a
    Trainer's column pruning), whose per-document labels then outnumber its rows. Shapes only: no read."""
    if given != rows:
        raise ValueError(
            f"This batch marks no documents, so it is answered per row ({rows} rows), but `{what}` has {given} "
            f"entries; {UNMARKED_DOCUMENTS_FIX}"
        )


def check_document_count(what: str, given: int, packed: PackedBatch, fix: str) -> None:
    """A ``ValueError`` when a per-document input (``labels``, QA positions) does not hold one entry per document."""
    count = packed.num_documents()
    if given != count:
        raise ValueError(
            f"This packed batch holds {count} documents (padding is never a document) but `{what}` has {given} "
            f"entries; {fix}"
        )
