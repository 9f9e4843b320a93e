"""Packed batches answer every document as its own forward would, or refuse (issue 46): in the CPU form (eager mode,
values read for free) and in the accelerator form (a training step that reads nothing back, reached on the CPU with
``as_if_on_accelerator``), and under ``torch.compile``.

Findings covered: a pre-packed dataset through ``Trainer``'s default column pruning (1; issue 51: ``seq_idx``, which
every ``forward`` names, is kept, and only it or ``cu_seq_lens`` mark documents); restarting ``position_ids`` with an
all-ones ``attention_mask`` (2; now positions only, the same in both forms); an understated ``max_length_q`` (4); an
ordinary row with explicit ``position_ids`` under compile (5); Longformer's QA and multiple choice on a padded packed
row (7); the compiled per-document heads' message about which boundaries give the count (8).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments  # noqa: E402

from hf_xformers.ops.input_checks import as_if_on_accelerator  # noqa: E402

from . import test_bigbird, test_longformer, test_performer, test_reformer, test_universal  # noqa: E402
from .packing_conformance import _document  # noqa: E402

ATOL = 1e-5
# The conformance suites' tiny configs (hidden 32, 2 layers), reached through their modules so that pytest does not
# collect the suites a second time here.
SUITES = {
    "longformer": test_longformer.TestLongformerConformance,
    "bigbird": test_bigbird.TestBigBirdConformance,
    "performer": test_performer.TestPerformerConformance,
    "reformer": test_reformer.TestReformerConformance,
    "universal": test_universal.TestUniversalConformance,
}
ARCHITECTURES = list(SUITES)
# How values may be read: freely (the CPU in eager mode), or not at all (an accelerator's training step).
FORMS = {"cpu": contextlib.nullcontext, "accelerator": as_if_on_accelerator}


def build(arch: str, head: str):
    suite = SUITES[arch]()
    return suite, suite.make_model(head, **suite.packing_config)


def run_in_form(form: str, model, **batch):
    """``model(**batch)`` with gradients on (a training step's forward; the tiny configs have no dropout): values are
    then read only in the CPU form."""
    with FORMS[form](), torch.enable_grad():
        return model(**batch)


def solo(model, document: torch.Tensor, **extra):
    with torch.no_grad():
        return model(input_ids=document[None], **extra)


def documents(suite, lengths, seed: int = 0) -> list[torch.Tensor]:
    vocab = suite.make_config().vocab_size
    return [_document(n, seed + i, vocab) for i, n in enumerate(lengths)]


def assert_rows_match(values: torch.Tensor, docs: list[torch.Tensor], solos: list[torch.Tensor]) -> None:
    """``values`` ``(1, total, ...)``, a packed row: each document's span equals its own forward's ``(1, n, ...)``."""
    start = 0
    for doc, expected in zip(docs, solos):
        torch.testing.assert_close(values[0, start : start + len(doc)].detach(), expected[0], atol=ATOL, rtol=0)
        start += len(doc)


# ----- 1: a pre-packed dataset through Trainer ------------------------------------------------------------------------


def trainer_batch(model, rows: list[dict], tmp_path, **args) -> dict:
    """The first evaluation batch ``Trainer`` (defaults unless ``args``) makes of a dataset of pre-packed ``rows``."""
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list([{k: v[0].tolist() for k, v in row.items()} for row in rows])
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=len(rows), use_cpu=True, report_to="none", **args
    )
    return next(iter(Trainer(model=model, args=args).get_eval_dataloader(dataset)))


@pytest.mark.parametrize("positions", [True, False], ids=["with-positions", "seq-idx-only"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", ["longformer", "performer"])
def test_trainer_keeps_the_seq_idx_of_a_pre_packed_dataset(arch, form, positions, tmp_path):
    """A dataset packed ahead of time (two rows of documents marked by ``seq_idx``, with or without restarting
    ``position_ids``) through ``Trainer`` with its defaults: ``forward`` names ``seq_idx``, so the column is kept,
    the default collator stacks it as ``(batch, seq_len)``, and every document gets what its own forward gives
    (479aea5 dropped it: masked-LM losses 0.115 off for Longformer, 0.039 for Performer, without positions)."""
    suite, model = build(arch, "AutoModelForMaskedLM")
    groups = [documents(suite, (10, 23, 7)), documents(suite, (15, 25), seed=3)]  # 40 tokens a row: stackable
    collator = DataCollatorWithFlattening(
        position_ids_start=suite.packing_position_start(model), return_seq_idx=True, return_position_ids=positions
    )
    batch = trainer_batch(model, [collator([{"input_ids": d.tolist()} for d in group]) for group in groups], tmp_path)
    assert batch["input_ids"].shape == batch["seq_idx"].shape == (2, 40)
    out = run_in_form(form, model, **batch)
    for row, group in enumerate(groups):
        assert_rows_match(out.logits[row : row + 1], group, [solo(model, d).logits for d in group])


def test_trainer_dropping_cu_seq_lens_is_named_not_mixed(tmp_path):
    """A pre-packed classification dataset marked by ``cu_seq_lens`` alone: ``Trainer``'s defaults drop those columns,
    and the per-document labels then outnumber the rows: a ValueError naming the boundaries and
    ``remove_unused_columns=False`` (479aea5: torch's batch-size error)."""
    suite, model = build("performer", "AutoModelForSequenceClassification")
    docs = documents(suite, (10, 23, 7))
    row = DataCollatorWithFlattening(
        position_ids_start=suite.packing_position_start(model), return_flash_attn_kwargs=True
    )([{"input_ids": d.tolist()} for d in docs])
    row = {k: v for k, v in row.items() if k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")}
    row["labels"] = torch.tensor([[0, 1, 2]])
    batch = trainer_batch(model, [row], tmp_path)
    assert "cu_seq_lens_q" not in batch
    with pytest.raises(ValueError, match=r"`labels` has 3 entries.*remove_unused_columns=False"):
        model(**batch)


# ----- 2: restarting positions with an all-ones mask ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_restarting_positions_with_an_all_ones_mask_are_positions_in_both_forms(arch):
    """``DataCollatorWithFlattening``'s default row (positions only) plus the all-ones ``attention_mask`` a pipeline
    adds: one sequence, the same answer whether or not the mask and positions can be read (479aea5: documents in
    one form, one sequence in the other); with the row's ``seq_idx`` every document gets its own forward's."""
    suite, model = build(arch, "AutoModel")
    docs = suite.packing_documents()
    batch = suite.pack(model, docs, "position_ids")
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    on_cpu = run_in_form("cpu", model, **batch).last_hidden_state
    on_accelerator = run_in_form("accelerator", model, **batch).last_hidden_state
    torch.testing.assert_close(on_accelerator, on_cpu, atol=ATOL, rtol=0)
    marked = run_in_form("accelerator", model, **suite.pack(model, docs, "seq_idx")).last_hidden_state
    assert_rows_match(marked, docs, [solo(model, d).last_hidden_state for d in docs])


# ----- 4: an understated max_length_q ---------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", ["longformer", "bigbird", "performer", "reformer"])
def test_understated_max_length_is_refused_not_cut(arch, form):
    """Documents of 6 and 20 tokens said to be at most 8 long: a ``ValueError`` naming ``max_length_q`` where the
    lengths can be read (before any layer runs); where they cannot, the QA rows fail loudly instead of holding
    a longer document's tail in their last place."""
    suite, model = build(arch, "AutoModelForQuestionAnswering")
    batch = suite.pack(model, documents(suite, (6, 20)), "cu_seq_lens")
    batch["max_length_q"] = batch["max_length_k"] = 8
    if form == "cpu":
        calls = []
        hook = model.base_model.register_forward_pre_hook(lambda *args: calls.append(1))
        with pytest.raises(ValueError, match=r"`max_length_q/k` say the longest document .* 8 tokens, but one has 20"):
            run_in_form(form, model, **batch)
        hook.remove()
        assert not calls, "the check ran after the base model started"
    else:
        with pytest.raises(RuntimeError, match=r"`max_length_q/k` \(8\) understate the longest document"):
            run_in_form(form, model, **batch)


# ----- 5 and 8: compiled heads --------------------------------------------------------------------------------------


def compiled(model):
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend="eager")


# One compile each (tracing costs tens of seconds here): the pooler of the shared text model and the Universal
# Transformer's own, sequence classification and question answering.
COMPILED_HEADS = [
    ("universal", "AutoModel", "pooler_output"),
    ("longformer", "AutoModel", "pooler_output"),
    ("bigbird", "AutoModelForSequenceClassification", "logits"),
    ("performer", "AutoModelForQuestionAnswering", "start_logits"),
]


@pytest.mark.parametrize("arch,head,field", COMPILED_HEADS, ids=[f"{a}-{h}" for a, h, _ in COMPILED_HEADS])
def test_compiled_ordinary_row_with_positions_is_answered_as_in_eager_mode(arch, head, field):
    """One ordinary row with explicit ``position_ids`` and no mask: the pooler, sequence classification and question
    answering give under ``torch.compile(fullgraph=True)`` what eager mode gives (not None, not a packed-batch
    error). Positions never mark documents, compiled or not."""
    suite, model = build(arch, head)
    document = documents(suite, (12,))[0]
    inputs = dict(input_ids=document[None], position_ids=torch.arange(12)[None] + suite.packing_position_start(model))
    with torch.no_grad():
        expected = getattr(model(**inputs), field)
        got = getattr(compiled(model)(**inputs), field)
    assert expected.shape[0] == 1 and got is not None, f"{head}.{field} is None when compiled"
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["performer"])
def test_compiled_classifier_reads_the_collators_default_row_as_one_sequence(arch):
    """The compiled classifier given ``DataCollatorWithFlattening``'s default row (restarting positions, no
    boundaries) answers it as eager mode does: one sequence, one row of logits (479aea5 failed at run time, reading
    the positions as three documents it could not count)."""
    suite, model = build(arch, "AutoModelForSequenceClassification")
    batch = suite.pack(model, suite.packing_documents(), "position_ids")
    with torch.no_grad():
        expected = model(**batch).logits
        got = compiled(model)(**batch).logits
    assert got.shape == (1, model.config.num_labels)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["performer"])
def test_compiled_per_document_head_names_the_boundaries_that_give_the_count(arch):
    """``seq_idx`` with per-document ``labels`` does not give a traced graph the number of documents: the error says
    ``cu_seq_lens`` (and no longer offers ``seq_idx``); the conformance suite's compiled packed training shows that
    ``cu_seq_lens`` answer per document there."""
    suite, model = build(arch, "AutoModelForSequenceClassification")
    docs = suite.packing_documents()
    labels = torch.arange(len(docs)) % model.config.num_labels
    batch = suite.pack(model, docs, "seq_idx", labels=labels)
    with torch.no_grad(), pytest.raises((ValueError, torch._dynamo.exc.Unsupported)) as error:
        compiled(model)(**batch)
    message = str(error.value)
    assert "one unpadded row with `cu_seq_lens_q/k`" in message and "`seq_idx` with per-document" not in message


# ----- 7: Longformer's QA and multiple choice on a padded packed row --------------------------------------------------


def _pair(suite, first: int, second: int, seed: int) -> torch.Tensor:
    """``<s> first </s></s> second </s>``: a (question, context) or (context, choice) pair."""
    document = documents(suite, (first + second + 4,), seed)[0]
    document[first + 1 : first + 3] = suite.make_config().sep_token_id
    return document


def _padded_packed_row(suite, docs: list[torch.Tensor], padding: int) -> dict:
    """One row of ``docs`` then ``padding`` pad tokens: ``seq_idx`` + ``attention_mask``, the documented form of a
    padded packed row."""
    ids = torch.cat([*docs, torch.full((padding,), suite.make_config().pad_token_id)])[None]
    mask = torch.ones_like(ids)
    mask[0, -padding:] = 0
    seq_idx = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)] + [torch.full((padding,), len(docs))])
    return dict(input_ids=ids, attention_mask=mask, seq_idx=seq_idx[None])


@pytest.mark.parametrize("form", FORMS)
def test_longformer_qa_and_multiple_choice_take_a_padded_packed_row(form):
    """Trailing padding is no document, so it needs no separator: each question's logits and each example's choice
    scores equal their own forwards'."""
    suite, qa = build("longformer", "AutoModelForQuestionAnswering")
    docs = [_pair(suite, 3, 6, 0), _pair(suite, 4, 9, 1)]
    out = run_in_form(form, qa, **_padded_packed_row(suite, docs, 5))
    assert out.start_logits.shape == (2, max(len(d) for d in docs))
    for i, doc in enumerate(docs):
        expected = solo(qa, doc)
        torch.testing.assert_close(
            out.start_logits[i, : len(doc)].detach(), expected.start_logits[0], atol=ATOL, rtol=0
        )
        torch.testing.assert_close(out.end_logits[i, : len(doc)].detach(), expected.end_logits[0], atol=ATOL, rtol=0)

    _, mc = build("longformer", "AutoModelForMultipleChoice")
    choices = [_pair(suite, 6, 2, 2), _pair(suite, 6, 3, 3), _pair(suite, 5, 2, 4), _pair(suite, 5, 4, 5)]
    out = run_in_form(form, mc, **_padded_packed_row(suite, choices, 6), num_choices=2)
    expected = torch.cat([solo(mc, c[None]).logits for c in choices]).view(2, 2)
    torch.testing.assert_close(out.logits.detach(), expected, atol=ATOL, rtol=0)
