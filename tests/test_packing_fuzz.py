"""Generative test of packed (padding-free) batches and of ordinary ones (issue 46, point 2; issue 51): ``hypothesis``
draws batches in the forms that transformers' ``DataCollatorWithFlattening``, our ``DataCollatorForPackedDocuments``,
pre-packed, padded datasets and ``generate()`` produce, for every packing architecture and head.

Two families of batches, one oracle each:

* **Packed** (``seq_idx``, ``cu_seq_lens`` + ``max_length``, or both): each document must get what its own forward
  gives (outputs, loss, gradients).
* **Unmarked** (form ``none``: no boundaries, whatever the ``position_ids``): an ordinary batch, answered per row. Each
  row must get what it gets alone (outputs, loss, gradients), the outputs keep one row per batch row, and positions
  never change that: the collator's restarting positions, ``generate()``'s (counted over a mask with left padding or
  holes), RoBERTa's (``padding_idx + 1`` origin), constant ones or none. A single row whose real tokens' positions fall
  (a numbering that starts again) warns where the positions may be read, and no other batch does.

Either way the call must answer: a refusal (a ``ValueError`` of the package) passes only where the input contract
refuses the input (:func:`allowed_refusals`: ``cu_seq_lens`` of a padded row, Longformer's question answering from
``inputs_embeds`` without a global mask, a traced graph that cannot count the documents of ``seq_idx``). Any other
exception, a refusal elsewhere, a mismatch or a wrong warning fails.

What is drawn (:class:`PackedCase`): rows holding different numbers of documents (one-token documents, documents longer
than the tiny windows / blocks / chunks); the boundary form; the collator that builds a single unpadded row; padding
(right, left, or trailing past the longest row) with ``attention_mask`` (holes too, for unmarked rows), an all-ones
mask or none; the positions' numbering; ``input_ids`` or ``inputs_embeds``; Longformer's global tokens; eval or
training (then gradients too); the CPU form or the accelerator form (``as_if_on_accelerator``); float32 or bfloat16
autocast. A second, smaller test runs compiled (``aot_eager``).

Profiles (tests/conftest.py, ``HYPOTHESIS_PROFILE``): ``ci`` (``make test``: derandomized, a small budget, plus the
anchor cases of :data:`ANCHORS`) and ``fuzz`` (``make fuzz``: a larger budget, fresh draws). Failures found by the
fuzzer are kept below as explicit cases in :data:`REGRESSIONS`. ``scripts/mutation_check.py`` applies known bugs to a
copy of the package and checks that this file's ``ci`` profile catches every one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
import warnings
from collections.abc import Callable
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from transformers import DataCollatorWithFlattening

from hf_xformers.ops import packing
from hf_xformers.ops.input_checks import INPUT_CONTRACT, as_if_on_accelerator
from hf_xformers.padding_free import DataCollatorForPackedDocuments

# Module objects, not their classes: a Test* class in this namespace would be collected here a second time.
from . import test_bigbird, test_longformer, test_performer, test_reformer, test_universal
from .packing_conformance import _document

SUITES = {
    "longformer": test_longformer.TestLongformerConformance,
    "bigbird": test_bigbird.TestBigBirdConformance,
    "performer": test_performer.TestPerformerConformance,
    "reformer": test_reformer.TestReformerConformance,
    "universal": test_universal.TestUniversalConformance,
}
# Multiple choice groups documents into examples: tests/packing_conformance.py covers it.
HEADS = {arch: tuple(h for h in suite.heads if h != "AutoModelForMultipleChoice") for arch, suite in SUITES.items()}
TOKEN_HEADS = ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModelForTokenClassification")
FP32_ATOL = 1e-5
# bfloat16 keeps 8 bits of mantissa (a relative step of 2**-8 = 3.9e-3 of a value's magnitude): a packed row and a
# lone document round differently wherever the kernels split the work differently (packed attention, reductions
# over other shapes), and two layers and a backward pass compound that, so documents agree to some steps of the
# largest value compared (gradients reach ~10), not bit for bit. The bound: BF16_TOL times the larger of 1 and the
# largest magnitude compared. Measured on answered batches: the largest gap was 0.033 of that scale over 150 draws
# forced to bf16 (1,645 comparisons) and 0.065 over 200 ordinary draws (622 bf16 comparisons), so the bound leaves
# a factor of 2. bf16 draws find dtype faults and gross mixing; the fp32 draws find the small gaps (1e-3).
BF16_TOL = 0.15
# The longest row: every tiny config has 64 positions (Reformer's axial grid is 8 x 8).
MAX_ROW = 48
PAD = 1
# How an unmarked batch numbers its positions: restarting per segment (DataCollatorWithFlattening's default row),
# generate()'s (counted over the mask, padding at 1), RoBERTa's (padding at the first position - 1, real tokens
# counted on from the first position), constant, or no position_ids at all.
NUMBERINGS = ("documents", "generate", "roberta", "constant", "absent")


@dataclasses.dataclass(frozen=True)
class PackedCase:
    """One drawn batch. ``rows``: the document lengths of every row. ``form``: the boundaries the batch carries
    (``seq_idx``, ``cu_seq_lens``, ``seq_idx+cu_seq_lens``, or ``none``: an unmarked, ordinary batch whose rows hold
    the documents as segments); ``positions``: ``position_ids`` given too (numbered by ``numbering``, one of
    :data:`NUMBERINGS`; packed batches number every document from the model's first position). ``collator``: what
    built a single unpadded row (``transformers``, ``ours``) or ``hand`` (a pre-packed dataset padded into rows).
    ``padding``: ``none``, ``right`` / ``left`` (rows padded to the longest), ``trailing`` (every row padded past the
    longest); ``pad_seq_idx``: the padding's ``seq_idx``, ``own`` (a label of its own) or ``adjacent`` (its
    neighbouring document's). ``mask``: ``none``, ``ones`` (all-ones), ``padding`` (zeros over the padding) or
    ``holes`` (also zeros inside the rows: unmarked batches only). ``globals_seed``: Longformer's global tokens (None:
    the task's default)."""

    arch: str
    head: str
    rows: tuple[tuple[int, ...], ...]
    form: str = "seq_idx"
    positions: bool = True
    collator: str = "hand"
    padding: str = "none"
    pad_seq_idx: str = "own"
    mask: str = "none"
    embeds: bool = False
    globals_seed: int | None = None
    train: bool = False
    accelerator: bool = False
    bf16: bool = False
    seed: int = 0
    numbering: str = "documents"

    @property
    def marked(self) -> bool:
        return self.form != "none"


@dataclasses.dataclass
class Unit:
    """What the oracle compares: a document of a packed batch, or a row of an unmarked one. ``place``: its (row,
    span) in the batch; ``ids``: its tokens as they run alone; ``inputs``: its own batch (one row); ``label``: its
    labels (see :func:`labels_of`); ``real``: its real tokens (the Universal Transformer's ponder loss weighs by
    them); ``pooled``: whether the batch gives its pooled output (not where a traced graph cannot count documents)."""

    place: tuple[int, slice]
    ids: torch.Tensor
    inputs: dict
    label: object
    real: int
    pooled: bool = True


# ----- the models: one per architecture and head, built once ---------------------------------------------------
@cache
def suite(arch: str):
    return SUITES[arch]()


@cache
def model_for(arch: str, head: str) -> torch.nn.Module:
    """The conformance suite's tiny model, weights perturbed so that biases and LayerNorms matter (a default init
    of std 0.02 leaves every document close to the same output, and a mixing of documents hard to see)."""
    host = suite(arch)
    model = host.make_model(head, **host.packing_config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


@cache
def compiled_model_for(arch: str, head: str) -> torch.nn.Module:
    """``model_for``'s model compiled once (dynamic shapes, so that other document counts and lengths reuse the
    graph): dynamo and AOT autograd trace forward and backward, without inductor's code generation."""
    return torch.compile(model_for(arch, head), fullgraph=True, dynamic=True, backend="aot_eager")


# ----- building the batch --------------------------------------------------------------------------------------
def documents_of(case: PackedCase) -> list[torch.Tensor]:
    vocab = suite(case.arch).make_config().vocab_size
    return [
        _document(n, case.seed * 97 + i, vocab) for i, n in enumerate(length for row in case.rows for length in row)
    ]


def labels_of(case: PackedCase, model, docs: list[torch.Tensor]) -> list:
    """Every document's labels for the head (None: no labels): per token (-100 where not scored), a class, or a
    ``(start, end)`` answer span."""
    g = torch.Generator().manual_seed(case.seed + 1)
    labels = []
    for doc in docs:
        n = doc.numel()
        if case.head == "AutoModelForMaskedLM":
            labels.append(doc.masked_fill(torch.rand(n, generator=g) > 0.5, -100))
        elif case.head == "AutoModelForCausalLM":
            labels.append(doc.clone())
        elif case.head == "AutoModelForTokenClassification":
            labels.append(torch.randint(0, model.config.num_labels, (n,), generator=g))
        elif case.head == "AutoModelForSequenceClassification":
            labels.append(int(torch.randint(0, model.config.num_labels, (), generator=g)))
        elif case.head == "AutoModelForQuestionAnswering":
            start = int(torch.randint(0, n, (), generator=g))
            labels.append((start, int(torch.randint(start, n, (), generator=g))))
        else:
            labels.append(None)
    return labels


def global_masks_of(case: PackedCase, docs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    if case.globals_seed is None:
        return None
    g = torch.Generator().manual_seed(case.globals_seed)
    return [torch.rand(doc.numel(), generator=g) < 0.15 for doc in docs]


def collated_row(case: PackedCase, model, docs, labels, start: int) -> dict:
    """A single unpadded row as a collator returns it."""
    seq_idx, flash = "seq_idx" in case.form, "cu_seq_lens" in case.form
    if case.collator == "ours":
        collator = DataCollatorForPackedDocuments.for_model(
            model, return_position_ids=case.positions, return_seq_idx=seq_idx, return_flash_attn_kwargs=flash,
            causal_lm=case.head == "AutoModelForCausalLM",
        )  # fmt: skip
        features = []
        for doc, label in zip(docs, labels):
            feature = {"input_ids": doc.tolist()}
            if isinstance(label, tuple):
                feature["start_positions"], feature["end_positions"] = label
            elif torch.is_tensor(label):
                feature["labels"] = label.tolist()
            elif label is not None:
                feature["labels"] = label
            features.append(feature)
        return collator(features)
    collator = DataCollatorWithFlattening(
        position_ids_start=start, return_position_ids=case.positions, return_seq_idx=seq_idx,
        return_flash_attn_kwargs=flash,
    )  # fmt: skip
    batch = collator([{"input_ids": doc.tolist()} for doc in docs])
    batch.pop("labels")  # the input ids copied; the head's labels are added below
    add_labels(case, batch, labels, [[(0, slice(a, b))] for a, b in spans_in_row(case.rows[0])])
    return batch


def spans_in_row(lengths) -> list[tuple[int, int]]:
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [(end - n, end) for n, end in zip(lengths, ends)]


def add_labels(case: PackedCase, batch: dict, labels: list, places) -> None:
    """The head's labels in the batch: per token over the row (padding not scored), else one per unit."""
    if case.head in TOKEN_HEADS:
        token_labels = torch.full(batch["input_ids"].shape, -100)
        for label, [(row, span)] in zip(labels, places):
            token_labels[row, span] = label
        batch["labels"] = token_labels
    elif case.head == "AutoModelForSequenceClassification":
        batch["labels"] = torch.tensor(labels)
    elif case.head == "AutoModelForQuestionAnswering":
        batch["start_positions"] = torch.tensor([s for s, _ in labels])
        batch["end_positions"] = torch.tensor([e for _, e in labels])


def build_batch(case: PackedCase, model, docs, labels, globs) -> tuple[dict, list[tuple[int, slice]]]:
    """The batch of ``case`` (without the head's labels where it is unmarked: they are the rows',
    :func:`row_units`) and where every document lies in it (row, span)."""
    start = suite(case.arch).packing_position_start(model)
    if case.collator != "hand":
        batch = collated_row(case, model, docs, labels, start)
        places = [(0, slice(a, b)) for a, b in spans_in_row(case.rows[0])]
    else:
        batch, places = padded_rows(case, docs, start)
        if case.marked:
            add_labels(case, batch, labels, [[p] for p in places])
    if case.mask == "ones":
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    if globs is not None:
        glob = torch.zeros(batch["input_ids"].shape, dtype=torch.long)
        for g, (row, span) in zip(globs, places):
            glob[row, span] = g.long()
        batch["global_attention_mask"] = glob
    return batch, places


def numbered(case: PackedCase, restarting: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """A row's ``position_ids`` in ``case.numbering`` (``restarting``: every segment numbered from ``start``,
    padding at ``start``; ``mask``: the row's real tokens)."""
    if case.numbering == "generate":  # GenerationMixin: attention_mask.cumsum(-1) - 1, padding at 1
        return (mask.cumsum(0) - 1).masked_fill(mask == 0, 1)
    if case.numbering == "roberta":  # create_position_ids_from_input_ids: padding_idx + cumsum over the real tokens
        return (mask.cumsum(0) * mask + start - 1).clamp(min=0)
    if case.numbering == "constant":
        return torch.full_like(restarting, start)
    return restarting


def real_tokens(case: PackedCase, row: int, width: int, fill: int, left: bool) -> torch.Tensor:
    """``(width,)`` long: 1 on a row's real tokens, 0 on its padding and, with ``mask="holes"``, on some tokens inside
    the row (never its first real token)."""
    mask = torch.ones(width, dtype=torch.long)
    if left:
        mask[:fill] = 0
    elif fill:
        mask[width - fill :] = 0
    if case.mask == "holes":
        g = torch.Generator().manual_seed(case.seed * 31 + row)
        holes = torch.rand(width, generator=g) < 0.2
        holes[fill if left else 0] = False
        mask = mask.masked_fill(holes, 0)
    return mask


def padded_rows(case: PackedCase, docs, start: int) -> tuple[dict, list[tuple[int, slice]]]:
    """Rows of a pre-packed dataset (or, unmarked, of an ordinary batch), padded together: ``input_ids``, the
    boundaries of ``case.form``, ``position_ids`` and, with padding or holes, an ``attention_mask``."""
    longest = max(sum(row) for row in case.rows)
    # Trailing padding, and a single left-padded row (a prompt as generate() pads it), run 3 tokens past the longest.
    extra = case.padding == "trailing" or (case.padding == "left" and len(case.rows) == 1)
    width = longest + (3 if extra else 0)
    ids_rows, seq_rows, pos_rows, mask_rows, places = [], [], [], [], []
    doc_iter = iter(docs)
    left = case.padding == "left"
    for lengths in case.rows:
        row_docs = [next(doc_iter) for _ in lengths]
        fill = width - sum(lengths)
        seq = torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths))
        pos = torch.cat([torch.arange(n) for n in lengths]) + start
        pad_label = {"own": -1 if left else len(lengths), "adjacent": 0 if left else len(lengths) - 1}[case.pad_seq_idx]
        pads = (torch.full((fill,), PAD), torch.full((fill,), pad_label), torch.full((fill,), start))
        parts = zip(pads, (torch.cat(row_docs), seq, pos))
        ids, seq, pos = (torch.cat([p, x]) if left else torch.cat([x, p]) for p, x in parts)
        mask = real_tokens(case, len(ids_rows), width, fill, left)
        offset = fill if left else 0
        for a, b in spans_in_row(lengths):
            places.append((len(ids_rows), slice(offset + a, offset + b)))
        ids_rows.append(ids), seq_rows.append(seq), mask_rows.append(mask)
        pos_rows.append(numbered(case, pos, mask, start))
    batch = {"input_ids": torch.stack(ids_rows)}
    if case.positions and case.numbering != "absent":
        batch["position_ids"] = torch.stack(pos_rows)
    if "seq_idx" in case.form:
        batch["seq_idx"] = torch.stack(seq_rows).int()
    if "cu_seq_lens" in case.form:
        # One row (the form's contract): the cumulative lengths of its documents, the longest as an int.
        cu = torch.tensor([0, *torch.tensor(case.rows[0]).cumsum(0).tolist()], dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(case.rows[0]), max_length_k=max(case.rows[0]))
    if case.mask in ("padding", "holes"):
        batch["attention_mask"] = torch.stack(mask_rows)
    return batch, places


def document_units(case: PackedCase, docs, labels, globs, places) -> list[Unit]:
    """The documents of a packed batch, each as its own forward runs it."""
    return [
        Unit(place, doc, solo_batch(case, doc, label, None if globs is None else globs[k]), label, doc.numel())
        for k, (doc, label, place) in enumerate(zip(docs, labels, places))
    ]


def row_units(case: PackedCase, batch: dict, labels, places) -> list[Unit]:
    """The rows of an unmarked batch, each alone (its mask and positions with it), and their labels added to
    ``batch``: per token the documents' over their spans, per row the first document's (a QA span moved with it)."""
    rows, width = batch["input_ids"].shape
    row_labels = []
    for row in range(rows):
        mine = [(label, span) for label, (r, span) in zip(labels, places) if r == row]
        if case.head in TOKEN_HEADS:
            label = torch.full((width,), -100)
            for value, span in mine:
                label[span] = value
        elif case.head == "AutoModelForQuestionAnswering":
            (first, last), span = mine[0]
            label = (first + span.start, last + span.start)
        else:
            label = mine[0][0]
        row_labels.append(label)
    add_labels(case, batch, row_labels, [[(row, slice(0, width))] for row in range(rows)])
    units = []
    for row, label in enumerate(row_labels):
        glob = batch.get("global_attention_mask")
        inputs = solo_batch(case, batch["input_ids"][row], label, None if glob is None else glob[row].bool())
        for name in ("attention_mask", "position_ids"):
            if name in batch:
                inputs[name] = batch[name][row : row + 1]
        real = int(batch["attention_mask"][row].sum()) if "attention_mask" in batch else width
        units.append(Unit((row, slice(0, width)), batch["input_ids"][row], inputs, label, real))
    return units


def units_of(case: PackedCase, model) -> tuple[dict, list[Unit]]:
    """The batch of ``case`` and the units the oracle compares: its documents (packed) or its rows (unmarked)."""
    docs = documents_of(case)
    labels = labels_of(case, model, docs)
    globs = global_masks_of(case, docs)
    batch, places = build_batch(case, model, docs, labels, globs)
    if case.marked:
        return batch, document_units(case, docs, labels, globs, places)
    return batch, row_units(case, batch, labels, places)


# ----- running and comparing -----------------------------------------------------------------------------------
def precision(case: PackedCase):
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.bf16 else contextlib.nullcontext()


def form_of(case: PackedCase):
    return as_if_on_accelerator() if case.accelerator else contextlib.nullcontext()


def with_embeddings(model, batch: dict, train: bool) -> torch.Tensor:
    """``batch``'s ids replaced by their word embeddings (a leaf that collects gradients in training)."""
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach().requires_grad_(train)
    batch["inputs_embeds"] = embeds
    return embeds


def run(case: PackedCase, model, batch: dict):
    """One forward (and, in training, a backward of a fixed random projection of the outputs: a sum of independent
    per-unit terms, so that a unit's input gradient is its own and the parameter gradient the units' sum). Reseeded
    first: Reformer draws its LSH rotations per training call, the same draw for any length."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with torch.set_grad_enabled(case.train), form_of(case), precision(case):
        out = model(**batch)
    return out


def per_document(case: PackedCase, out, places, docs) -> list[dict[str, torch.Tensor]]:
    """Every unit's share of an output: token outputs sliced at its span, per-unit outputs at its index."""
    shares = []
    for k, ((row, span), doc) in enumerate(zip(places, docs)):
        share = {}
        if case.head == "AutoModel":
            share["last_hidden_state"] = out.last_hidden_state[row, span]
            if getattr(out, "pooler_output", None) is not None:
                share["pooler_output"] = out.pooler_output[k]
        elif case.head in TOKEN_HEADS:
            share["logits"] = out.logits[row, span]
        elif case.head == "AutoModelForSequenceClassification":
            share["logits"] = out.logits[k]
        else:
            share["start_logits"] = out.start_logits[k, : doc.numel()]
            share["end_logits"] = out.end_logits[k, : doc.numel()]
        shares.append(share)
    return shares


def solo_batch(case: PackedCase, doc, label, glob) -> dict:
    batch = {"input_ids": doc[None]}
    if glob is not None:  # as the packed batch's (a document without global tokens has none, not the default)
        batch["global_attention_mask"] = glob[None].long()
    if case.head in TOKEN_HEADS:
        batch["labels"] = label[None]
    elif case.head == "AutoModelForSequenceClassification":
        batch["labels"] = torch.tensor([label])
    elif case.head == "AutoModelForQuestionAnswering":
        batch["start_positions"], batch["end_positions"] = torch.tensor([label[0]]), torch.tensor([label[1]])
    return batch


def scored(case: PackedCase, label) -> int:
    """How many of a unit's tokens its loss averages over (token heads; the causal LM predicts n - 1)."""
    count = int((label != -100).sum())
    return count - int(label[0] != -100) if case.head == "AutoModelForCausalLM" else count


def expected_loss(case: PackedCase, losses: list[torch.Tensor], labels) -> torch.Tensor | None:
    """The batch's loss from its units' own ``losses``: the mean over every scored token (token heads, as a padded
    batch computes it), else the mean over the units."""
    if case.head not in TOKEN_HEADS:
        return torch.stack(losses).mean()
    counts = [scored(case, label) for label in labels]
    if sum(counts) == 0:
        return None  # nothing scored: a NaN either way
    return sum(loss * c for loss, c in zip(losses, counts) if c) / sum(counts)


def compare_losses(case: PackedCase, out, solos, units: list[Unit]) -> None:
    if case.head == "AutoModel":
        return
    packed_loss, losses = out.loss, [s.loss for s in solos]
    if getattr(out, "ponder_loss", None) is not None:
        # The Universal Transformer adds its ponder loss, a mean over the batch's real tokens: the length-weighted
        # mean of the units' own (tests/packing_conformance.py); the task losses are compared without it.
        lengths = [unit.real for unit in units]
        ponder = sum(s.ponder_loss * n for s, n in zip(solos, lengths)) / sum(lengths)
        assert_matches(case, out.ponder_loss, ponder, "ponder loss", rtol=1e-5)
        packed_loss, losses = packed_loss - out.ponder_loss, [s.loss - s.ponder_loss for s in solos]
    expected = expected_loss(case, losses, [unit.label for unit in units])
    if expected is not None:
        assert_matches(case, packed_loss, expected, "loss", rtol=1e-5)


def assert_matches(case: PackedCase, actual: torch.Tensor, expected: torch.Tensor, what: str, **fp32) -> None:
    """``actual`` (in the batch) equals ``expected`` (alone): to ``FP32_ATOL`` (or ``fp32``'s tolerances) in float32,
    to ``BF16_TOL`` of the values' scale under bfloat16 autocast."""
    actual, expected = actual.detach().float(), expected.detach().float()
    if case.bf16:
        scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
        tolerances = dict(atol=BF16_TOL * scale, rtol=0)
    else:
        tolerances = {"atol": FP32_ATOL, "rtol": 0, **fp32}
    torch.testing.assert_close(actual, expected, **tolerances, msg=_named(what))


def _named(what: str):
    return lambda message: f"{what}: {message}"


def projection(shares: list[dict[str, torch.Tensor]], weights: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """A scalar made of independent per-unit terms: each unit's outputs against its own fixed weights."""
    return sum(
        (value.float() * weights[k][name]).sum() for k, share in enumerate(shares) for name, value in share.items()
    )


def note(what: str) -> None:
    """Count ``what`` in hypothesis' statistics (``--hypothesis-show-statistics``); outside a draw, nothing."""
    if currently_in_test_context():
        event(what)


def refusal_of(error: Exception) -> Exception | None:
    """The ``ValueError`` with which a forward refused the batch, or None. A refusal is raised by the package's own
    checks (a ValueError out of torch, such as ``cross_entropy``'s "Expected input batch_size (3) to match target
    batch_size (2)", is a fault that slipped past them). While tracing (``fullgraph=True``) a refusal reaches the
    caller as dynamo's ``Unsupported`` ("Observed exception") caused by the ``ValueError``."""
    if isinstance(error, ValueError):
        innermost = traceback.extract_tb(error.__traceback__)[-1].filename
        return error if f"{os.sep}hf_xformers{os.sep}" in innermost else None
    cause = error.__cause__
    if isinstance(error, torch._dynamo.exc.Unsupported) and "raised exception ValueError(" in str(cause):
        return cause
    return None


def allowed_refusals(case: PackedCase, compiled: bool) -> tuple[str, ...]:
    """What a refusal of ``case`` may say: the fix of each input-contract row that refuses it (docs/input-contract.md),
    and a traced graph's word that it cannot count the documents (:func:`uncounted_while_tracing`). Nothing else:
    every other drawn batch is valid and must be answered."""
    allowed = []
    if "cu_seq_lens" in case.form and case.padding == "trailing":
        allowed.append(INPUT_CONTRACT["cu_seq_lens_padded"].fix)
    qa = case.head == "AutoModelForQuestionAnswering"
    if case.arch == "longformer" and qa and case.embeds and case.globals_seed is None:
        allowed.append(INPUT_CONTRACT["global_default_needs_ids"].fix)
    if uncounted_while_tracing(case, compiled):
        allowed += ["while tracing", "traced graph"]
    return tuple(allowed)


def uncounted_while_tracing(case: PackedCase, compiled: bool) -> bool:
    """Whether a traced graph cannot count ``case``'s documents (docs/packing.md, "Compiled models"): only the shape of
    ``cu_seq_lens`` of one row without ``attention_mask`` gives the count; ``seq_idx``, and a mask (which may hold
    padding: a graph cannot read that it is all ones), need a read. Per-document heads refuse there, and the pooled
    output is None."""
    return compiled and case.marked and ("cu_seq_lens" not in case.form or case.mask != "none")


def assert_one_answer_per_unit(case: PackedCase, out, batch: dict, count: int) -> None:
    """Token outputs keep the batch's shape; per-unit outputs have one row per document (packed) or per row."""
    shape = tuple(batch["input_ids" if "input_ids" in batch else "inputs_embeds"].shape[:2])
    if case.head == "AutoModel":
        assert tuple(out.last_hidden_state.shape[:2]) == shape
        pooled = getattr(out, "pooler_output", None)
        assert pooled is None or pooled.shape[0] == count, f"pooler_output {tuple(pooled.shape)} for {count} units"
    elif case.head in TOKEN_HEADS:
        assert tuple(out.logits.shape[:2]) == shape
    else:
        logits = out.logits if case.head == "AutoModelForSequenceClassification" else out.start_logits
        assert logits.shape[0] == count, f"{tuple(logits.shape)} logits for {count} units"


def expects_warning(case: PackedCase, batch: dict, compiled: bool) -> bool:
    """Whether the batch must warn that positions do not mark documents: a single unmarked row whose real tokens'
    positions fall somewhere (each compared with the previous real token), where the positions may be read (eager;
    the CPU form, or no gradients)."""
    positions = batch.get("position_ids")
    if case.marked or positions is None or positions.shape[0] != 1 or compiled or (case.accelerator and case.train):
        return False
    real = batch.get("attention_mask", torch.ones_like(positions))[0].tolist()
    previous = None
    for position, is_real in zip(positions[0].tolist(), real):
        if is_real:
            if previous is not None and position < previous:
                return True
            previous = position
    return False


def run_batch(case: PackedCase, model, batch: dict, compiled: bool):
    """The batch's forward, checked for the warning about unmarked restarting positions (:func:`expects_warning`)."""
    packing._WARNED_UNMARKED_RESTARTS = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(case, model, batch)
    warned = any("positions never mark documents" in str(w.message) for w in caught)
    expected = expects_warning(case, batch, compiled)
    assert warned == expected, f"the batch {'did not warn' if expected else 'warned'} about unmarked positions"
    return out


def check(case: PackedCase, compiled: bool = False) -> bool:
    """The oracle: every unit of ``case``'s batch (a document of a packed batch, a row of an unmarked one) gets what it
    gets alone: outputs, loss and gradients (inputs_embeds and parameters, in training). A refusal (a ``ValueError``)
    passes only where the input contract refuses the input (:func:`allowed_refusals`); True if the call answered."""
    model = model_for(case.arch, case.head).train(case.train)
    batch, units = units_of(case, model)
    embeds = with_embeddings(model, batch, case.train) if case.embeds else None
    try:
        out = run_batch(case, compiled_model_for(case.arch, case.head) if compiled else model, batch, compiled)
        assert_one_answer_per_unit(case, out, batch, len(units))
        shares = per_document(case, out, [u.place for u in units], [u.ids for u in units])
        g = torch.Generator().manual_seed(case.seed + 2)
        weights = [{name: torch.randn(v.shape, generator=g) for name, v in share.items()} for share in shares]
        if case.train:
            with form_of(case):
                projection(shares, weights).backward()
    except Exception as error:
        refusal = refusal_of(error)
        if refusal is None:
            raise
        note(f"refused: {str(refusal)[:50]}")
        allowed = allowed_refusals(case, compiled)
        if not any(fix in str(refusal) for fix in allowed):
            raise AssertionError(f"an input the contract takes was refused: {refusal}") from error
        if not case.accelerator and not compiled:
            check(dataclasses.replace(case, accelerator=True))  # where it cannot refuse, it must answer right
        return False
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    if uncounted_while_tracing(case, compiled):  # documented: no pooled output where the count is unknown
        units = [dataclasses.replace(unit, pooled=False) for unit in units]
    solos = compare_units(case, model, units, shares, weights, embeds, packed_grads)
    compare_losses(case, out, solos, units)
    return True


def compare_units(case: PackedCase, model, units: list[Unit], shares, weights, embeds, packed_grads) -> list:
    """Run every unit alone and compare its outputs (and, in training, its input gradient and the sum of the units'
    parameter gradients) with its share of the batch's; the units' own outputs, for their losses."""
    solos, solo_grads = [], {}
    for k, unit in enumerate(units):
        inputs = dict(unit.inputs)
        solo_embeds = with_embeddings(model, inputs, case.train) if case.embeds else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a row alone warns as the batch did (run_batch checks that)
            solo = run(case, model, inputs)
        solos.append(solo)
        share = per_document(case, solo, [(0, slice(0, unit.ids.numel()))], [unit.ids])[0]
        if not unit.pooled:
            share.pop("pooler_output", None)
        missing = set(share) - set(shares[k])
        assert not missing, f"unit {k}: the batch returns no {', '.join(sorted(missing))}"
        for name, value in share.items():
            assert_matches(case, shares[k][name], value, f"unit {k} {name}")
        if case.train:
            projection([share], [weights[k]]).backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    solo_grads[name] = solo_grads.get(name, 0) + p.grad
            if embeds is not None:
                row, span = unit.place
                assert_matches(case, embeds.grad[row, span], solo_embeds.grad[0], f"unit {k} input grad")
    for name, grad in solo_grads.items():
        # A sum over the units, in another order than the batch's backward: a relative tolerance on top.
        assert name in packed_grads, f"{name}: no gradient from the batch"
        assert_matches(case, packed_grads[name], grad, f"gradient of {name}", atol=10 * FP32_ATOL, rtol=1e-4)
    return solos


# ----- the draws -----------------------------------------------------------------------------------------------
# Document lengths: one-token documents, shorter than the tiny windows / blocks / chunks (4 to 8 tokens), and longer
# than several of them.
LENGTHS = st.one_of(st.integers(1, 3), st.integers(1, 30))


@st.composite
def rows_of_documents(draw, max_rows: int = 3) -> tuple[tuple[int, ...], ...]:
    """Rows of document lengths, each row at most ``MAX_ROW`` tokens."""
    rows = []
    for _ in range(draw(st.integers(1, max_rows))):
        row, budget = [], MAX_ROW
        for length in draw(st.lists(LENGTHS, min_size=1, max_size=4)):
            if length > budget:
                break
            row.append(length)
            budget -= length
        rows.append(tuple(row))
    return tuple(rows)


@st.composite
def packed_cases(draw, compiled: bool = False, train: st.SearchStrategy[bool] | None = None) -> PackedCase:
    """A :class:`PackedCase` in any form a collator, a padded pre-packed dataset or an ordinary (unmarked) batch
    gives (``train``: the strategy of the training flag, both values by default)."""
    arch = draw(st.sampled_from(tuple(SUITES)))
    head = draw(st.sampled_from(HEADS[arch]))
    rows = draw(rows_of_documents(max_rows=2 if compiled else 3))
    single = len(rows) == 1
    same_width = len({sum(row) for row in rows}) == 1
    padding = draw(st.sampled_from(("none", "trailing") if single else ("right", "left", "trailing")))
    if padding in ("right", "left") and same_width:
        padding = draw(st.sampled_from(("none", "trailing")))
    if not single and padding == "none" and not same_width:
        padding = "right"
    # An unmarked batch in one draw of three; a single row of it may be left-padded, as generate() pads a prompt.
    form = draw(
        st.sampled_from(("none", "seq_idx", "none") + (("cu_seq_lens", "seq_idx+cu_seq_lens") if single else ()))
    )
    if form == "none" and single and padding == "trailing":
        padding = draw(st.sampled_from(("trailing", "left")))
    collator, mask, numbering = "hand", draw(st.sampled_from(("none", "ones"))), "documents"
    if form == "none":
        numbering = draw(st.sampled_from(NUMBERINGS))
        mask = draw(st.sampled_from(("padding", "holes", "none") if padding != "none" else ("none", "ones", "holes")))
    else:
        mask = "padding" if padding != "none" else mask
        if single and padding == "none":
            collator = draw(st.sampled_from(("transformers", "ours", "hand")))
    return PackedCase(
        arch=arch,
        head=head,
        rows=rows,
        form=form,
        positions=form == "none" or draw(st.booleans()),
        collator=collator,
        padding=padding,
        pad_seq_idx=draw(st.sampled_from(("own", "adjacent"))) if padding != "none" and "seq_idx" in form else "own",
        mask=mask,
        embeds=draw(st.booleans()),
        globals_seed=draw(st.none() | st.integers(0, 3)) if arch == "longformer" else None,
        train=draw(st.booleans() if train is None else train),
        accelerator=draw(st.booleans()),
        # bfloat16 in one draw of eight: it shows dtype errors, not the small gaps fp32 catches.
        bf16=not compiled and draw(st.integers(0, 7)) == 0,
        seed=draw(st.integers(0, 2**16)),
        numbering=numbering,
    )


# ----- findings still open ------------------------------------------------------------------------------------
# A finding that another branch is still fixing goes here as the region of draws it covers, as a function of (case,
# compiled): a drawn case that fails inside one of these regions is recorded (hypothesis' statistics: `pytest
# --hypothesis-show-statistics`) instead of failing the run; one that fails outside every region fails. Every finding
# so far is fixed (their shrunk cases below run as plain regression tests).
OPEN_FINDINGS: dict[str, Callable[[PackedCase, bool], bool]] = {}


def open_finding(case: PackedCase, compiled: bool) -> str | None:
    for name, covers in OPEN_FINDINGS.items():
        if covers(case, compiled):
            return name
    return None


def check_or_known(case: PackedCase, compiled: bool = False) -> None:
    try:
        check(case, compiled)
    except Exception:
        finding = open_finding(case, compiled)
        if finding is None:
            raise
        note(f"open finding {finding}")


# Cases every profile runs before its draws, so that the small ci budget always meets them: per-document heads on a
# multi-document row with the task's default global tokens (Longformer's <s> of every document), and ordinary batches
# in the forms transformers' own tests and generate() build (a left-padded prompt numbered over its mask, a mask with
# holes, RoBERTa's positions without a mask, constant positions).
# generate()'s inputs: no boundaries, positions counted over the attention mask.
GENERATE = dict(form="none", numbering="generate")
ANCHORS = [
    PackedCase(
        "longformer", "AutoModelForSequenceClassification", ((6, 9, 4),), "cu_seq_lens", collator="transformers"
    ),
    PackedCase("universal", "AutoModel", ((4, 5),), padding="left", mask="padding", **GENERATE),
    PackedCase(
        "performer", "AutoModelForCausalLM", ((7,), (4, 3)), padding="right", mask="holes", train=True, **GENERATE
    ),
    PackedCase(
        "longformer", "AutoModelForSequenceClassification", ((6,), (4,)), "none", padding="right", numbering="roberta"
    ),
    PackedCase("bigbird", "AutoModelForQuestionAnswering", ((12,),), "none", numbering="constant", accelerator=True),
]


def with_anchors(test):
    for case in reversed(ANCHORS):
        test = example(case=case)(test)
    return test


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=packed_cases())
@with_anchors
def test_packed_batches_match_solo_forwards(case):
    """Every drawn batch (eager; fp32 or bf16 autocast; CPU or accelerator form) answers each document of a packed
    batch as its own forward, and each row of an unmarked batch as that row alone, or refuses what the input contract
    refuses."""
    check_or_known(case)


# Compiling costs tens of seconds per architecture, head and grad mode (each draw of another one compiles afresh;
# dynamic shapes let the lengths and document counts of later draws reuse the graph): an eightieth of the budget
# (one draw in make test).
COMPILED_EXAMPLES = max(1, settings.default.max_examples // 80)


@pytest.mark.skipif(
    settings.default.max_examples < 80,
    reason="a compiled draw costs tens of seconds to minutes of CPU; make fuzz draws them, and the compiled "
    "regression cases of test_fuzz_findings run in make test",
)
@settings(max_examples=COMPILED_EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Compiling a training step (AOT autograd traces the backward too) costs minutes of CPU where inference costs
# seconds: the single draw of make test compiles inference.
@given(case=packed_cases(compiled=True, train=st.booleans() if COMPILED_EXAMPLES > 1 else st.just(False)))
def test_compiled_packed_batches_match_solo_forwards(case):
    """The same under ``torch.compile(fullgraph=True, dynamic=True, backend="aot_eager")``, fp32: each document (or
    row) as its own eager forward, or a refusal the input contract allows (a ValueError, raised while tracing)."""
    check_or_known(case, compiled=True)


# ----- what the fuzzer found: each failure shrunk to a small case, kept as it is -----------------------------------
def finding(name: str, case: PackedCase, compiled: bool = False):
    return pytest.param(case, compiled, id=name)


REGRESSIONS = [
    # Issue 46 read restarting positions alone as documents; issue 51 made them positions: these rows, once found
    # mixing documents, are ordinary rows now, one answer each, as each row alone gives it.
    # Two rows with restarting positions and nothing else (then 3 documents, 2 pooled rows; values 7e-3 off).
    finding("1-pooled", PackedCase("bigbird", "AutoModel", ((1,), (1, 1)), "none", padding="right", mask="padding")),
    finding(
        "1-logits",
        PackedCase("universal", "AutoModelForMaskedLM", ((2,), (2, 1)), "none", padding="right", mask="padding"),
    ),
    # Restarting positions with an all-ones mask in a training step of the accelerator form (then: the CPU and
    # accelerator forms disagreed).
    finding(
        "2-gradients",
        PackedCase(
            "performer",
            "AutoModelForCausalLM",
            ((2, 2),),
            "none",
            mask="ones",
            embeds=True,
            train=True,
            accelerator=True,
        ),  # fmt: skip
    ),
    finding(
        "2-pooled",
        PackedCase("performer", "AutoModel", ((2, 2),), "none", mask="ones", train=True, accelerator=True),
    ),
    # Classification from inputs_embeds: no global <s> per document (logits 2.1e-2 off).
    finding(
        "3-embeds", PackedCase("longformer", "AutoModelForSequenceClassification", ((2, 3),), "seq_idx", embeds=True)
    ),
    # Compiled, one ordinary row with positions: no pooled output (eager mode pools it).
    finding("5-compiled-row", PackedCase("performer", "AutoModel", ((6,),), "none"), compiled=True),
    finding("new-C-compiled-pooling", PackedCase("performer", "AutoModel", ((1, 1),), "none"), compiled=True),
    # Compiled Reformer given seq_idx and cu_seq_lens refuses (while cu_seq_lens alone compiles).
    finding(
        "6-compiled-seq-idx",
        PackedCase("reformer", "AutoModelForMaskedLM", ((3, 4),), "seq_idx+cu_seq_lens", collator="transformers"),
        compiled=True,
    ),
    # QA on a seq_idx row with trailing padding, training: the CPU form refuses ("some documents of the packed batch
    # have none" separator), the accelerator form answers every document exactly.
    finding(
        "7-refusal",
        PackedCase(
            "longformer",
            "AutoModelForQuestionAnswering",
            ((3, 4),),
            "seq_idx",
            padding="trailing",
            mask="padding",
            train=True,
        ),  # fmt: skip
    ),
    # One row padded to a fixed width whose positions restart, no seq_idx / cu_seq_lens (then read as one document).
    finding(
        "new-A-padded-row",
        PackedCase(
            "performer", "AutoModelForTokenClassification", ((5, 2),), "none", padding="trailing", mask="padding"
        ),
    ),
    # seq_idx rows that each hold one document, padded, are read as an ordinary padded batch: left padding moves
    # 0-based positions and the pooled first token (Reformer 2.7 off), QA scores the padding positions
    # (loss 1.40 where the documents' own is 0).
    finding(
        "new-B-left-padding",
        PackedCase("reformer", "AutoModel", ((2,), (1,)), "seq_idx", positions=False, padding="left", mask="padding"),
    ),
    finding(
        "new-B-qa-loss",
        PackedCase(
            "performer",
            "AutoModelForQuestionAnswering",
            ((1,), (1,)),
            "seq_idx",
            padding="trailing",
            pad_seq_idx="adjacent",
            mask="padding",
            train=True,
        ),  # fmt: skip
    ),
    # cu_seq_lens of a row padded after packing, bf16 training: refused in the CPU form (the input contract's
    # cu_seq_lens_padded), answered by the accelerator form, which cannot read the boundaries (issue 51's fuzz run of
    # 479aea5 failed here on its then rule that the two forms must agree).
    finding(
        "51-cu-padded",
        PackedCase(
            "bigbird",
            "AutoModel",
            ((1,),),
            "cu_seq_lens",
            positions=False,
            padding="trailing",
            mask="padding",
            train=True,
            bf16=True,
        ),  # fmt: skip
    ),
]


@pytest.mark.parametrize("case, compiled", REGRESSIONS)
def test_fuzz_findings(case, compiled):
    """The failures the fuzzer found, each as its shrunk case."""
    check(case, compiled)
