"""Padding-free ("packed") batches: several documents concatenated in one row, and where each one starts.

transformers' ``DataCollatorWithFlattening`` concatenates a batch into one row ``(1, total_tokens)`` and describes the
boundaries as ``seq_idx`` (the document of every token, ``return_seq_idx=True``) or FlashAttention's
``cu_seq_lens_q/k`` + ``max_length_q/k`` (``return_flash_attn_kwargs=True``). Every model reduces whichever it is given
to one ``document_ids`` tensor ``(batch, seq_len)`` (long, documents numbered 0, 1, ... from the start of each row, each
one a contiguous run of tokens) and hands that to every layer's attention, which then never lets a token see another
document's. None means "one document per row", the ordinary batch.

Forms, in the order they are used when both are given:

* ``cu_seq_lens_q`` (= ``cu_seq_lens_k``) ``(num_docs + 1,)``: cumulative lengths ``[0, l0, l0 + l1, ..., total]`` of
  the documents of a single row (``batch`` must be 1). First where it applies, because its shape gives the number of
  documents, which a traced graph cannot read from ``seq_idx`` (``return_seq_idx=True`` with
  ``return_flash_attn_kwargs=True`` gives both).
* ``seq_idx`` ``(batch, seq_len)``: any integer labels; a new document starts wherever the label changes. Every
  ``forward`` names it, so that ``Trainer`` keeps a pre-packed dataset's ``seq_idx`` column.

``position_ids`` are positions and nothing more, as in transformers' own encoders under SDPA and eager attention: they
never mark documents, so an ordinary batch (padded, generating, with any numbering) is never read as a packed one. The
collator's restarting ``position_ids`` still reach the embeddings, and where a batch carries boundaries its positions
are checked against them (each document must start at the model's first position). A single row whose positions
restart without boundaries (``DataCollatorWithFlattening``'s default row, or a pre-packed dataset whose ``cu_seq_lens``
columns ``Trainer`` dropped) is answered as one sequence, with a warning where the positions may be read
(:func:`warn_unmarked_restarts`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import torch
from typing_extensions import Unpack

from .input_checks import is_tracing, on_host, reads_values, refuse


class CuSeqLensKwargs(TypedDict, total=False):
    """FlashAttention's boundaries of the documents of one packed row, as transformers' ``DataCollatorWithFlattening(
    return_flash_attn_kwargs=True)`` returns them. Every text model's and head's ``forward`` takes them as ``**kwargs:
    Unpack[CuSeqLensKwargs]``, as transformers' own models take the same names (``FlashAttentionKwargs``), beside its
    named ``seq_idx`` parameter, and checks the names with :func:`packing_kwargs`.

    Attributes:
        cu_seq_lens_q: ``(num_documents + 1,)`` cumulative lengths of the documents of one row.
        cu_seq_lens_k: equal to ``cu_seq_lens_q`` (attention stays inside each document).
        max_length_q: the longest document (a Python int), which spares a read of the lengths.
        max_length_k: equal to ``max_length_q``.
    """

    cu_seq_lens_q: torch.Tensor | None
    cu_seq_lens_k: torch.Tensor | None
    max_length_q: int | None
    max_length_k: int | None


class PackedBatchKwargs(CuSeqLensKwargs, total=False):
    """Every boundary keyword of a packed batch (module docstring): :class:`CuSeqLensKwargs` and ``seq_idx``, what
    :func:`packing_kwargs` collects from a ``forward``'s ``seq_idx`` parameter and ``**kwargs``.

    Attributes:
        seq_idx: ``(batch, seq_len)``, the document of every token
            (``DataCollatorWithFlattening(return_seq_idx=True)``).
    """

    seq_idx: torch.Tensor | None


# The names of PackedBatchKwargs, seq_idx first.
PACKING_KWARGS = ("seq_idx", *CuSeqLensKwargs.__annotations__)


def packing_kwargs(owner: object, kwargs: dict, seq_idx: torch.Tensor | None = None) -> PackedBatchKwargs:
    """The packed batch's keywords of ``owner``'s ``forward``: ``kwargs``, what its ``**kwargs`` collected, once they
    are known to be :class:`CuSeqLensKwargs` only (a misspelt keyword is refused, not ignored), and its ``seq_idx``.

    Raises:
        TypeError: a keyword that is no parameter of the ``forward`` and none of :data:`PACKING_KWARGS`, named as
            Python names an unexpected keyword argument.
    """
    for name in kwargs:
        if name not in PACKING_KWARGS:
            raise TypeError(
                f"{type(owner).__name__}.forward() got an unexpected keyword argument {name!r} (besides its "
                f"parameters it takes the packed batch's {', '.join(PACKING_KWARGS[1:])})"
            )
    return kwargs if seq_idx is None else {**kwargs, "seq_idx": seq_idx}


def marks_documents(packing: PackedBatchKwargs) -> bool:
    """Whether ``packing`` marks documents: ``seq_idx`` or ``cu_seq_lens_q/k`` given (the longest length alone marks
    none)."""
    return any(packing.get(name) is not None for name in ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"))


def forward_keywords(forward: Callable) -> frozenset[str]:
    """The keyword arguments ``forward`` takes: its named parameters, and :data:`PACKING_KWARGS` where it takes
    ``**kwargs: Unpack[CuSeqLensKwargs]`` (or ``Unpack[PackedBatchKwargs]``; any other ``*args`` / ``**kwargs``
    names nothing)."""
    names = set()
    for name, parameter in inspect.signature(forward).parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD:
            annotation = str(parameter.annotation)
            if CuSeqLensKwargs.__name__ in annotation or PackedBatchKwargs.__name__ in annotation:
                names.update(PACKING_KWARGS)
        elif parameter.kind is not parameter.VAR_POSITIONAL:
            names.add(name)
    return frozenset(names)


def document_ids_from_inputs(
    shape: tuple[int, int],
    device: torch.device,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **packing: Unpack[PackedBatchKwargs],
) -> torch.Tensor | None:
    """``resolve_packed_batch(...).document_ids``: the run of every token ``(batch, seq_len)``, or None for an
    ordinary batch (for callers that need nothing else of :class:`PackedBatch`)."""
    packed = resolve_packed_batch(shape, device, position_ids, attention_mask=attention_mask, **packing)
    return None if packed is None else packed.document_ids


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """The documents of a packed batch, worked out once at the model's entry (head or base model) and handed down:
    heads, embeddings, every layer and every attention read this and never recompute it.

    Everything here is computed with tensor operations from what the batch carries; a number that the host needs
    (``count``, ``longest``) is taken from the batch when it says so (``cu_seq_lens`` gives the count by its shape,
    ``max_length_q`` the longest document, as transformers' collator returns it), else read once here, in eager
    mode only.

    Attributes:
        document_ids: ``(batch, seq_len)`` long, the run of every token in its row (0, 1, ... from each row's start):
            a new run wherever the document or the padding changes. What attention masks compare: tokens of
            different runs never see each other. Padding runs are runs too (keys of padding are masked anyway).
        starts: ``(batch, seq_len)`` bool, True at the first token of every real document (padding never starts one).
        index: ``(batch, seq_len)`` long, the number of every token's document over the whole batch, ``0 ..
            count - 1`` in order, row after row; padding tokens hold ``count`` (a slot the heads drop).
        positions: ``(batch, seq_len)`` long, every token's position inside its run, from 0.
        count: the number of real documents, or None when it would take a read that tracing cannot make.
        longest: the longest document's length when the batch says (``max_length_q``) or it was read, else None.
        cu_seq_lens: ``(count + 1,)`` int32 cumulative lengths over the flattened batch when nothing is padded and
            the batch is one row (FlashAttention's varlen form), else None.
        padded: whether any token may be padding (``attention_mask`` given, and not known to be all ones).
    """

    document_ids: torch.Tensor
    starts: torch.Tensor
    index: torch.Tensor
    positions: torch.Tensor
    count: int | None
    longest: int | None
    cu_seq_lens: torch.Tensor | None
    padded: bool

    @property
    def batch_size(self) -> int:
        return self.document_ids.shape[0]

    def host_spans(self) -> tuple[tuple[int, int], ...] | None:
        """The ``(start, end)`` of every document of a single unpadded row whose boundaries lie in host memory (the
        CPU in eager mode, where reading them waits for nothing), else None. On the CPU, a mechanism whose packed form
        does more work than its documents' own forwards (FAVOR+'s segmented sums, BigBird's block layout) runs each
        document on its own there; accelerators and traced graphs keep the packed form (no read, no loop)."""
        ids = self.document_ids
        if ids.shape[0] != 1 or self.padded or is_tracing() or not on_host(ids.device):
            return None
        return document_spans(ids, self.cu_seq_lens)

    def num_documents(self, what: str = "this head") -> int:
        """``count``, or a ``ValueError`` when it is unknown (a traced graph given ``seq_idx``, or ``cu_seq_lens`` of
        a padded row)."""
        if self.count is None:
            raise ValueError(
                f"{what} answers per document, and the number of documents of this packed batch is unknown while "
                "tracing: `seq_idx` (and `cu_seq_lens` of a padded row) give it only by a read. Pass the documents as "
                "one unpadded row with `cu_seq_lens_q/k` (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), "
                "whose shape gives the count, or run this model in eager mode."
            )
        return self.count

    def longest_document(self) -> int:
        """``longest``, read once from the lengths when the batch did not say (eager mode only)."""
        if self.longest is not None:
            return self.longest
        if is_tracing():
            raise ValueError(
                "The longest document of a packed batch is needed here and unknown while tracing; pass "
                "`max_length_q` (DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns it)."
            )
        lengths = self.lengths()
        return int(lengths.max()) if lengths.numel() else 0

    def lengths(self) -> torch.Tensor:
        """``(count,)`` long, every real document's length (padding not counted)."""
        count = self.num_documents()
        real = self.index < count
        ones = real.reshape(-1).long()
        return ones.new_zeros(count + 1).index_add(0, self.index.reshape(-1), ones)[:count]

    def slots(self) -> torch.Tensor:
        """``(batch * seq_len,)`` long: every token's document slot for ``index_add``, padding in slot ``count``."""
        return self.index.reshape(-1)

    def first_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """``(batch, seq_len, ...)`` -> ``(count, ...)``: every document's first token (padding never counts)."""
        count = self.num_documents()
        flat = values.reshape(-1, *values.shape[2:])
        return flat.new_zeros(count + 1, *flat.shape[1:]).index_add(0, self.first_token_slots(), flat)[:count]

    def assert_within(self, longest: int) -> torch.Tensor:
        """Fail at run time (a graph assertion: no host read) where a real token lies ``longest`` or more tokens into
        its document: a layout sized by an understated ``max_length_q/k`` would drop that document's tail. Where the
        values may be read, :func:`resolve_packed_batch` has refused such a batch with a ``ValueError`` already.

        Returns:
            ``(batch, seq_len)`` long, the positions it checked: :attr:`positions`, padding's set to 0 when
            :attr:`count` is known (its slot is dropped).
        """
        positions = self.positions if self.count is None else self.positions.masked_fill(self.index == self.count, 0)
        torch._assert_async((positions < longest).all(), understated_longest(longest))
        return positions

    def first_token_slots(self) -> torch.Tensor:
        """``(batch * seq_len,)`` long: a document's first token in its slot, every other token in slot ``count``,
        so that an ``index_add`` into ``count + 1`` slots picks the first tokens without a boolean index (a read)."""
        count = self.num_documents()
        return torch.where(self.starts, self.index, torch.full_like(self.index, count)).reshape(-1)


def _run_ids(labels: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch, seq_len)`` labels -> (run numbers per row, run starts): a new run wherever the label or the padding
    changes."""
    changes = labels[:, 1:] != labels[:, :-1]
    if real is not None:
        changes = changes | (real[:, 1:] != real[:, :-1])
    run_starts = torch.cat([torch.ones_like(labels[:, :1], dtype=torch.bool), changes], dim=-1)
    return run_starts.long().cumsum(-1) - 1, run_starts


def _positions_in_runs(run_starts: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)`` long: each token's position inside its run, from 0 (``run_starts``: where runs start)."""
    index = torch.arange(run_starts.shape[1], device=run_starts.device).expand_as(run_starts)
    first = torch.where(run_starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def _check_cu_seq_lens(cu_q, cu_k, length: int, device) -> torch.Tensor:
    cu = (cu_q if cu_q is not None else cu_k).to(device).reshape(-1).long()
    if cu.numel() < 2:
        raise ValueError(
            f"`cu_seq_lens_q/k` must hold at least two values (0 and the row's length {length}), got {cu.numel()}."
        )
    if reads_values(cu):
        if cu_q is not None and cu_k is not None and not torch.equal(cu, cu_k.to(device).reshape(-1).long()):
            raise ValueError(
                "`cu_seq_lens_q` and `cu_seq_lens_k` differ; these models attend within each document, so "
                "queries and keys share the boundaries (pass the collator's values unchanged)."
            )
        values = cu.tolist()
        if values[0] == 0 and values[-1] < length and all(b > a for a, b in zip(values, values[1:])):
            refuse(
                "cu_seq_lens_padded",
                f"`cu_seq_lens_q/k` end at {values[-1]} but the row holds {length} tokens: it was padded after packing",
            )
        if values[0] != 0 or values[-1] != length or any(b <= a for a, b in zip(values, values[1:])):
            raise ValueError(
                f"`cu_seq_lens_q/k` must rise strictly from 0 to the row's length {length} (cumulative lengths of "
                f"non-empty documents), got {values[:8]}{' ...' if len(values) > 8 else ''}; drop empty documents "
                "before packing."
            )
    return cu


def resolve_packed_batch(
    shape: tuple[int, int],
    device: torch.device,
    position_ids: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> PackedBatch | None:
    """The :class:`PackedBatch` of a batch whose documents ``seq_idx`` or ``cu_seq_lens_q/k`` mark (in the order of the
    module doc), or None for an ordinary batch: one without either, whatever its ``position_ids``, which are positions
    only (a single row whose positions restart gets a warning: :func:`warn_unmarked_restarts`).

    Raises:
        ValueError: a boundary tensor of the wrong shape; ``cu_seq_lens`` that do not rise strictly from 0 to the row's
            length (an empty document) or that differ between q and k; ``max_length_q/k`` below the longest
            document (both checked where values may be read: :func:`~hf_xformers.ops.input_checks.reads_values`).
    """
    batch, length = shape
    cu_given = cu_seq_lens_q is not None or cu_seq_lens_k is not None
    if seq_idx is None and not cu_given:
        warn_unmarked_restarts(position_ids, attention_mask)
        return None
    real = _real_tokens(attention_mask, device)
    if seq_idx is not None and not (cu_given and batch == 1):
        if tuple(seq_idx.shape) != (batch, length):
            raise ValueError(
                f"`seq_idx` must have the shape of `input_ids` {(batch, length)} (the document of every token), got "
                f"{tuple(seq_idx.shape)}; use DataCollatorWithFlattening(return_seq_idx=True)."
            )
        document_ids, run_starts = _run_ids(seq_idx.to(device), real)
        cu, count = None, None
    else:
        document_ids, run_starts, cu, count = _runs_from_cu_seq_lens(cu_seq_lens_q, cu_seq_lens_k, shape, device, real)
    longest = max_length_q if max_length_q is not None else max_length_k
    return _packed_from_runs(document_ids, run_starts, real, cu, count, longest)


# Whether warn_unmarked_restarts has warned in this process (it warns once, and reads nothing afterwards).
_WARNED_UNMARKED_RESTARTS = False


def warn_unmarked_restarts(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
    """Warn (once per process) where a single row without ``seq_idx`` / ``cu_seq_lens`` has real tokens whose
    position falls below the previous real token's: ``DataCollatorWithFlattening``'s row of several documents, or a
    pre-packed dataset whose boundary columns ``Trainer`` dropped, which is answered as one sequence whose documents
    see each other. Only where the positions may be read (:func:`~hf_xformers.ops.input_checks.reads_values`: never a
    training step on an accelerator, never a traced graph); ``generate()``'s positions (counting the real tokens, with
    left padding or holes in the mask) never fall."""
    global _WARNED_UNMARKED_RESTARTS
    if _WARNED_UNMARKED_RESTARTS or position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return
    if position_ids.shape[1] < 2 or not reads_values(position_ids):
        return
    real = None
    if attention_mask is not None and tuple(attention_mask.shape) == tuple(position_ids.shape):
        real = attention_mask.to(position_ids.device).bool()
    if bool(_positions_fall(position_ids, real).any()):
        _WARNED_UNMARKED_RESTARTS = True
        warnings.warn(
            "`position_ids` restart inside a row, but positions never mark documents: the row is read as one "
            "sequence, its tokens attend to each other. If it packs several documents, pass their boundaries: "
            "`seq_idx` (DataCollatorWithFlattening(return_seq_idx=True)) or `cu_seq_lens_q/k` with `max_length_q/k` "
            "(return_flash_attn_kwargs=True); a pre-packed dataset keeps its `seq_idx` column through Trainer, and "
            "its `cu_seq_lens_*` / `max_length_*` columns with TrainingArguments(remove_unused_columns=False).",
            UserWarning,
            stacklevel=3,
        )


def _positions_fall(position_ids: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """``(batch, seq_len)`` bool: the real tokens whose position lies below the previous *real* token's (a numbering
    that starts again). Padding is skipped, wherever it lies: ``generate()``'s left padding and masks with holes hold
    positions that count the real tokens only, and never fall."""
    if real is None:
        falls = position_ids[:, 1:] < position_ids[:, :-1]
        return torch.cat([torch.zeros_like(falls[:, :1]), falls], dim=-1)
    index = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    last_real = torch.where(real, index, -1).cummax(-1).values
    previous = torch.cat([torch.full_like(last_real[:, :1], -1), last_real[:, :-1]], dim=-1)
    falls = position_ids < position_ids.gather(-1, previous.clamp(min=0))
    return real & (previous >= 0) & falls


def _real_tokens(attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``attention_mask`` as bool on ``device``, or None when nothing is padded (known in eager mode only)."""
    if attention_mask is None:
        return None
    real = attention_mask.to(device).bool()
    if not is_tracing() and reads_values(real) and bool(real.all()):
        return None
    return real


def _runs_from_cu_seq_lens(
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
    shape: tuple[int, int],
    device: torch.device,
    real: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int | None]:
    """``(document_ids, run_starts, cu_seq_lens, count)`` of a single row given FlashAttention's cumulative lengths;
    padding inside the documents splits the runs where it starts and ends (then no ``cu_seq_lens`` or count)."""
    batch, length = shape
    if batch != 1:
        raise ValueError(
            f"`cu_seq_lens_q/k` describe the documents of one packed row, but the batch has {batch} rows; pack "
            "the batch into one row (DataCollatorWithFlattening) or pass `seq_idx` for several packed rows."
        )
    cu = _check_cu_seq_lens(cu_seq_lens_q, cu_seq_lens_k, length, device)
    run_starts = torch.zeros(length, dtype=torch.bool, device=device).index_fill(0, cu[:-1], True)[None]
    document_ids = run_starts.long().cumsum(-1) - 1
    if real is None:
        return document_ids, run_starts, cu, cu.shape[0] - 1
    document_ids, run_starts = _run_ids(document_ids, real)
    return document_ids, run_starts, None, None


def _packed_from_runs(
    document_ids: torch.Tensor,
    run_starts: torch.Tensor,
    real: torch.Tensor | None,
    cu: torch.Tensor | None,
    count: int | None,
    longest: int | None,
) -> PackedBatch | None:
    """The :class:`PackedBatch` of the runs ``(batch, seq_len)`` of a batch (``real``: its real tokens, None when
    nothing is padded), or None when every row holds one document and nothing is padded (padded rows of one document
    each stay packed: as an ordinary padded batch, left padding would shift their positions and a QA head would score
    their padding). ``count`` and ``cu`` are worked out here (eager mode) when the boundaries did not give them."""
    batch, length = document_ids.shape
    starts = run_starts if real is None else run_starts & real
    flat_index = starts.reshape(-1).long().cumsum(0).reshape(batch, length) - 1
    positions = _positions_in_runs(run_starts)
    if longest is not None and reads_values(starts):
        _check_longest(longest, positions, real)
    if count is None and not is_tracing():
        per_row = starts.sum(-1)
        if bool((per_row <= 1).all()) and real is None:
            return None  # one document per row, nothing padded: an ordinary batch
        count = int(per_row.sum())
    elif count == batch == 1:
        return None
    if real is not None and count is not None:
        flat_index = torch.where(real, flat_index, torch.full_like(flat_index, count))
    if cu is None and count is not None and real is None and batch == 1 and not is_tracing():
        cu = torch.cat([flat_index.new_zeros(1), torch.bincount(flat_index.reshape(-1), minlength=count).cumsum(0)])
    return PackedBatch(
        document_ids=document_ids,
        starts=starts,
        index=flat_index,
        positions=positions,
        count=count,
        longest=longest,
        cu_seq_lens=None if cu is None else cu.to(torch.int32),
        padded=real is not None,
    )


def understated_longest(longest: int) -> str:
    """The message of the graph assertions that fail where ``max_length_q/k`` (``longest``) understate a document
    (:meth:`PackedBatch.assert_within`, and the varlen kernel's layout); a traced graph's message does not hold the
    value, which may be symbolic there."""
    said = "" if is_tracing() else f" ({longest})"
    return (
        f"`max_length_q/k`{said} understate the longest document of this packed batch; pass the collator's "
        "values unchanged (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or leave them out."
    )


def _check_longest(longest: int, positions: torch.Tensor, real: torch.Tensor | None) -> None:
    """A ``ValueError`` where the batch's ``max_length_q/k`` understates its longest document (a read: where
    :func:`~hf_xformers.ops.input_checks.reads_values` allows it). Layouts and the per-document rows of question
    answering are sized by it, and would cut the longer documents."""
    inside = positions if real is None else positions.masked_fill(~real, -1)
    actual = int(inside.max()) + 1
    if actual > longest:
        raise ValueError(
            f"`max_length_q/k` say the longest document of this packed batch has {longest} tokens, but one has "
            f"{actual}; pass the collator's `max_length_q/k` unchanged (DataCollatorWithFlattening("
            "return_flash_attn_kwargs=True)), or leave them out."
        )


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)`` bool: True at the first token of every document."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def positions_in_documents(document_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``(batch, seq_len)`` long: each token's position inside its document, counted from ``start``."""
    return _positions_in_runs(document_starts(document_ids)) + start


def document_lengths(document_ids: torch.Tensor) -> torch.Tensor:
    """``(num_documents,)`` long: the length of every document, row by row (a host read: eager only)."""
    counts = []
    for row in document_ids:
        counts.append(torch.bincount(row, minlength=int(row[-1]) + 1))
    return torch.cat(counts)


def document_spans(document_ids: torch.Tensor, cu_seq_lens: torch.Tensor | None = None) -> tuple[tuple[int, int], ...]:
    """The ``(start, end)`` token spans of the documents of a single packed row ``(1, seq_len)`` (a host read: eager
    only), for mechanisms that run each document as its own forward would (SDPA, FAVOR+, BigBird per document);
    from the row's ``cu_seq_lens`` when given (the same spans), else the runs of equal ids in ``document_ids`` (any
    ids: a group of padding slots is a run like a document)."""
    if cu_seq_lens is not None:
        ends = cu_seq_lens.tolist()[1:]
    else:
        ends = torch.unique_consecutive(document_ids[0], return_counts=True)[1].cumsum(0).tolist()
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
    "CuSeqLensKwargs",
    "PackedBatch",
    "PackedBatchKwargs",
    "forward_keywords",
    "marks_documents",
    "packing_kwargs",
    "resolve_packed_batch",
    "document_ids_from_inputs",
    "document_lengths",
    "document_spans",
    "document_starts",
    "flat_document_index",
    "positions_in_documents",
    "refuse_packed",
    "same_document",
    "understated_longest",
    "unpack_documents",
    "warn_unmarked_restarts",
]
