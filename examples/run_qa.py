"""Extractive question answering (SQuAD v1.1 and v2.0 format) over long contexts with ``transformers.Trainer``.

Any model ``AutoModelForQuestionAnswering`` loads: the hfx heads (Longformer, BigBird, Linformer, Performer,
Reformer) and transformers' own. Each example is ``question`` + ``context``, encoded as a text pair with the question
first; the head predicts the answer's first and last token.

* Long contexts. ``--max_seq_length`` defaults to everything the model reads, so a long model (4,096 tokens) reads
  a long context in one window. A context that does not fit is read, by default (``--long_documents chunks``), in
  overlapping windows (``--doc_stride`` tokens shared by two neighbours), each the question plus the next slice of
  the context, and the answer is chosen across the windows of an example; ``--long_documents truncate`` reads only
  the first window instead (a short model's baseline; the log says how many contexts were cut).
* Global attention on the question (``[CLS]`` and the question tokens) for models that have it (hfx-longformer,
  transformers' Longformer); other models get no ``global_attention_mask``.
* Post-processing by the rules of transformers' example (``postprocess_qa_predictions`` in its ``utils_qa.py``;
  the tests check it against an oracle of those rules): the ``--n_best_size`` best starts and ends of every window,
  spans of at most ``--max_answer_length`` tokens inside the context, ranked by start + end logit across windows, mapped
  back to the context's characters. SQuAD v2 (``--version_2_with_negative``): the best span is the best one whose
  text is not empty (a span of tokens that cover no character, such as a byte-level BPE's whitespace token, is no
  answer), and the answer is empty when the null score (start + end logit on ``[CLS]``, the lowest over the
  windows) beats it by more than ``--null_score_diff_threshold``.
* Answers are checked before any model is loaded: an ``answer_start`` at which the context does not read the
  answer's text (a shifted offset would train on the wrong span) stops the run, naming the examples;
  ``--misaligned_answers skip`` leaves those examples out instead, with a warning that counts them.
* Metrics computed here (no Hub download): exact match and F1 in percent, after SQuAD's normalisation (lower case,
  no punctuation, no articles, single spaces), the best over the gold answers; v2 adds them for answerable
  (``HasAns_*``) and unanswerable (``NoAns_*``) questions, and the best null threshold (``best_*``).

Data: a local JSON file in SQuAD's layout (``{"data": [...]}``, either the flattened rows ``id``, ``title``,
``context``, ``question``, ``answers: {"text": [...], "answer_start": [...]}`` or the original nested ``paragraphs``
/ ``qas``), JSON lines of flattened rows, or a Hub dataset (``--dataset_name rajpurkar/squad``). Outputs in
``--output_dir``: ``eval_results.json``, ``predictions.json`` (id -> answer), ``nbest_predictions.json``,
``null_odds.json`` (v2), and the fine-tuned model with its tokenizer (``--do_train``).

    python -m examples.run_qa --model_name_or_path path/to/longformer-base-4096 \\
        --train_file train-v1.1.json --validation_file dev-v1.1.json --do_train --do_eval \\
        --max_seq_length 4096 --doc_stride 128 --output_dir out/squad

Training resumes from the last ``checkpoint-*`` in ``--output_dir`` (or ``--resume_from_checkpoint PATH``) unless
``--overwrite_output_dir`` is given.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import numpy as np
import torch
from datasets import Dataset, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    EvalPrediction,
    Trainer,
    TrainingArguments,
    set_seed,
)

import hf_xformers  # noqa: F401  (registers the hfx-* model types with the Auto classes)
from examples.utils_examples import (
    RunArguments,
    check_world_size,
    finish_output_dir,
    hub_model_id,
    load_local_file,
    model_max_tokens,
    model_origin,
    parse_script_args,
    require_columns,
    resume_checkpoint,
    sequence_parallel_collator,
    setup_logging,
    supports_global_attention,
    take,
)
from hf_xformers.packed_inference import LONG_DOCUMENTS  # the choices run_classification offers too

logger = logging.getLogger("run_qa")

# Columns of a featurized window that only post-processing reads; the model never sees them.
WINDOW_COLUMNS = ("example_id", "offset_mapping", "cls_index", "example_windows")
# What to do with an example whose answer text is not at its answer_start (see check_answers).
MISALIGNED_ANSWERS = ("error", "skip")


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to fine-tune."""

    model_name_or_path: str = field(metadata={"help": "Local folder or Hub id of the model to fine-tune."})
    config_name: str | None = field(default=None, metadata={"help": "Config to use instead of the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer to use instead of the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Cache for downloaded models and datasets."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom code from the Hub (trusted repos only)."}
    )


@dataclass
class DataTrainingArguments:
    """Which data, how to cut long contexts into windows, and how to read answers out of the logits."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset in SQuAD's layout (rajpurkar/squad, rajpurkar/squad_v2)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "SQuAD-format .json (or .jsonl) training file."})
    validation_file: str | None = field(default=None, metadata={"help": "SQuAD-format .json (or .jsonl) dev file."})
    question_column_name: str = field(default="question", metadata={"help": "Column holding the question."})
    context_column_name: str = field(default="context", metadata={"help": "Column holding the context."})
    answer_column_name: str = field(
        default="answers", metadata={"help": "Column holding the answers: {'text': [...], 'answer_start': [...]}."}
    )
    version_2_with_negative: bool = field(
        default=False, metadata={"help": "SQuAD v2: some questions have no answer in their context."}
    )
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens per window, question included (default: all the model reads)."}
    )
    long_documents: str = field(
        default="chunks",
        metadata={
            "help": "Contexts longer than a window: 'chunks' (read all of it in overlapping windows; the answer is "
            "chosen across them) or 'truncate' (read the first window only), in training and evaluation."
        },
    )
    doc_stride: int = field(default=128, metadata={"help": "Tokens two neighbouring windows share (chunks)."})
    n_best_size: int = field(default=20, metadata={"help": "Best start and end positions tried per window."})
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer, in tokens."})
    null_score_diff_threshold: float = field(
        default=0.0,
        metadata={"help": "v2: answer nothing when the null score beats the best span by more than this."},
    )
    misaligned_answers: str = field(
        default="error",
        metadata={
            "help": "An answer whose text is not the context's characters at its answer_start (a shifted offset): "
            "'error' (stop, naming the examples) or 'skip' (leave those examples out, with a warning that counts them)."
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation examples."})

    def __post_init__(self) -> None:
        if self.long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"--long_documents must be one of {list(LONG_DOCUMENTS)}, got {self.long_documents!r}.")
        if self.misaligned_answers not in MISALIGNED_ANSWERS:
            raise ValueError(
                f"--misaligned_answers must be one of {list(MISALIGNED_ANSWERS)}, got {self.misaligned_answers!r}."
            )
        if self.doc_stride < 0:
            raise ValueError(f"--doc_stride must be >= 0, got {self.doc_stride}.")
        if self.n_best_size < 1 or self.max_answer_length < 1:
            raise ValueError("--n_best_size and --max_answer_length must be at least 1.")


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def squad_rows(document: dict | list) -> list[dict]:
    """Flattened SQuAD rows (``id``, ``title``, ``context``, ``question``, ``answers``) from a parsed JSON file:
    ``{"data": rows}`` with flattened rows, ``{"data": articles}`` in the original nested layout
    (``paragraphs`` -> ``qas``), or a bare list of rows."""
    records = document.get("data", document) if isinstance(document, dict) else document
    if not isinstance(records, list):
        raise ValueError("A SQuAD file holds a list of rows, or an object whose 'data' field is one.")
    if not records or "paragraphs" not in records[0]:
        return records
    rows = []
    for article in records:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = qa.get("answers", [])
                rows.append({
                    "id": str(qa["id"]),
                    "title": article.get("title", ""),
                    "context": paragraph["context"],
                    "question": qa["question"],
                    "answers": {"text": [a["text"] for a in answers],
                                "answer_start": [int(a["answer_start"]) for a in answers]},
                })  # fmt: skip
    return rows


def load_squad_file(path: str, cache_dir: str | None = None) -> Dataset:
    """A SQuAD-format ``.json`` file (see :func:`squad_rows`), or a ``.jsonl`` file of flattened rows, as a
    ``Dataset``.

    Raises:
        ValueError: another file type, or a JSON layout that is not SQuAD's.
        FileNotFoundError: the file does not exist.
    """
    if Path(path).suffix.lower() != ".json":
        if Path(path).suffix.lower() != ".jsonl":
            raise ValueError(f"{path}: use a SQuAD-format .json file or a .jsonl file of flattened rows.")
        return load_local_file(path, cache_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file.")
    with open(path, encoding="utf-8") as f:
        return Dataset.from_list(squad_rows(json.load(f)))


def check_answers(dataset: Dataset, data_args: DataTrainingArguments, source: str) -> Dataset:
    """``dataset`` with its answers checked: a ``ValueError`` naming the example when answers and starts differ in
    number, or when a v1 run meets a question without an answer; misaligned answers (:func:`misaligned_answer`)
    are refused, naming the examples, or with ``--misaligned_answers skip`` those examples are left out (a warning
    counts them). Returns the examples kept."""
    require_columns(
        dataset, [data_args.question_column_name, data_args.context_column_name, data_args.answer_column_name], source
    )
    misaligned = []  # (index, what is wrong with its first misaligned answer)
    for index, (example_id, context, answers) in enumerate(
        zip(dataset["id"], dataset[data_args.context_column_name], dataset[data_args.answer_column_name])
    ):
        texts, starts = answers["text"], answers["answer_start"]
        if len(texts) != len(starts):
            raise ValueError(
                f"{source}: example {example_id!r} has {len(texts)} answer texts but {len(starts)} starts."
            )
        if not texts and not data_args.version_2_with_negative:
            raise ValueError(
                f"{source}: example {example_id!r} has no answer; pass --version_2_with_negative for SQuAD v2 data."
            )
        problems = [p for text, start in zip(texts, starts) if (p := misaligned_answer(context, text, start))]
        if problems:
            misaligned.append((index, f"example {example_id!r}: {problems[0]}"))
    if not misaligned:
        return dataset
    shown = "; ".join(problem for _, problem in misaligned[:3]) + ("; ..." if len(misaligned) > 3 else "")
    summary = (
        f"{source}: {len(misaligned)} of {len(dataset)} examples have an answer whose text is not the context's "
        f"characters at its answer_start ({shown})"
    )
    fix = "Correct answer_start (the character offset of the answer's text in its context)"
    if data_args.misaligned_answers == "error":
        raise ValueError(
            f"{summary}. Training on them would teach a shifted span. {fix}, or pass --misaligned_answers skip to "
            "leave these examples out."
        )
    if len(misaligned) == len(dataset):
        raise ValueError(f"{summary}: --misaligned_answers skip leaves no example. {fix}.")
    kept = len(dataset) - len(misaligned)
    logger.warning("%s. Left out (--misaligned_answers skip): %d examples remain.", summary, kept)
    left_out = {index for index, _ in misaligned}
    return dataset.select([i for i in range(len(dataset)) if i not in left_out])


def misaligned_answer(context: str, text: str, start: int) -> str | None:
    """What is wrong when ``text`` is not ``context``'s characters from ``start`` (None when it is): where the context
    differs, or that the answer lies outside it, and where the text does occur (the nearest place), if anywhere."""
    there = context[start : start + len(text)] if start >= 0 else None
    if there == text:
        return None
    if not 0 <= start <= start + len(text) <= len(context):
        problem = f"the answer {text!r} at character {start} lies outside its context of {len(context)} characters"
    else:
        problem = f"the answer {text!r} at character {start}, where the context reads {there!r}"
    places = [m.start() for m in re.finditer(re.escape(text), context)] if text else []
    if places:
        problem += f", the text is at character {min(places, key=lambda p: abs(p - start))}"
    return problem


def featurize(
    examples: dict,
    tokenizer,
    data_args: DataTrainingArguments,
    max_length: int,
    global_attention: bool,
    return_token_type_ids: bool | None,
) -> dict:
    """Windows of a batch of examples (a ``datasets`` batched map), labelled with the answer's token span.

    Each window is ``[CLS] question [SEP] slice of the context [SEP]`` (the tokenizer's pair template). Returns per
    window the model inputs (``input_ids``, ``attention_mask``, maybe ``token_type_ids``, and with
    ``global_attention`` a ``global_attention_mask`` over ``[CLS]`` + question), ``start_positions`` /
    ``end_positions`` (the first answer's first and last token, or ``cls_index`` when the window does not hold it
    whole or the question has none), for post-processing ``example_id``, ``cls_index`` and ``offset_mapping``
    (character spans of the context tokens, None elsewhere), and ``example_windows``, how many windows the whole
    context takes (more than 1 under ``truncate``: the context was cut).
    """
    questions = [q.lstrip() for q in examples[data_args.question_column_name]]  # leading spaces waste window room
    contexts = examples[data_args.context_column_name]
    chunks = data_args.long_documents == "chunks"
    encoded = tokenizer(
        questions,
        contexts,
        truncation="only_second",
        max_length=max_length,
        stride=data_args.doc_stride if chunks else 0,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_token_type_ids=return_token_type_ids,
    )
    owners = encoded.pop("overflow_to_sample_mapping")
    ids = examples["id"]
    keep = [w for w, owner in enumerate(owners) if chunks or w == 0 or owners[w - 1] != owner]
    windows_per_example = collections.Counter(owners)
    features = {key: [encoded[key][w] for w in keep] for key in encoded if key != "offset_mapping"}
    features.update(
        {"start_positions": [], "end_positions": [], "example_id": [], "cls_index": [], "offset_mapping": [],
         "example_windows": []}
    )  # fmt: skip
    if global_attention:
        features["global_attention_mask"] = []
    for w in keep:
        owner = owners[w]
        input_ids, sequence_ids = encoded["input_ids"][w], encoded.sequence_ids(w)
        cls_index = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
        context_tokens = [i for i, s in enumerate(sequence_ids) if s == 1]
        offsets = [span if sequence_ids[i] == 1 else None for i, span in enumerate(encoded["offset_mapping"][w])]
        answers = examples[data_args.answer_column_name][owner]
        start = end = cls_index
        if answers["answer_start"] and context_tokens:
            first_char = answers["answer_start"][0]
            last_char = first_char + len(answers["text"][0])
            first, last = context_tokens[0], context_tokens[-1]
            if offsets[first][0] <= first_char and offsets[last][1] >= last_char:
                start = next(i for i in context_tokens if offsets[i][1] > first_char)
                end = next(i for i in reversed(context_tokens) if offsets[i][0] < last_char)
        features["start_positions"].append(start)
        features["end_positions"].append(end)
        features["example_id"].append(str(ids[owner]))
        features["cls_index"].append(cls_index)
        features["offset_mapping"].append(offsets)
        features["example_windows"].append(windows_per_example[owner])
        if global_attention:
            question_end = max(i for i, s in enumerate(sequence_ids) if s == 0)
            features["global_attention_mask"].append([int(i <= question_end) for i in range(len(input_ids))])
    return features


@dataclass
class QACollator:
    """Pads windows on the right into a batch: ``input_ids`` with ``pad_token_id``, the masks and token types with
    0 (``global_attention_mask`` too, which the tokenizer's own padding does not know); labels as ``(batch,)``."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        batch = {}
        for key in features[0]:
            if key in ("start_positions", "end_positions"):
                batch[key] = torch.tensor([f[key] for f in features], dtype=torch.long)
                continue
            fill = self.pad_token_id if key == "input_ids" else 0
            batch[key] = torch.tensor([f[key] + [fill] * (length - len(f[key])) for f in features], dtype=torch.long)
        return batch


# ---------------------------------------------------------------------------------------------------------------
# Post-processing: logits of windows -> an answer per example
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Answers:
    """What post-processing chose: ``predictions`` (id -> answer text, ``""`` for no answer), ``nbest`` (id -> the
    best candidates, each ``{"text", "start", "score", "start_logit", "end_logit", "probability"}`` with ``start``
    the answer's first character, -1 for the null answer), ``null_odds`` (id -> null score minus the best non-empty
    span's score; v2 only, else empty) and ``best_spans`` (id -> the best non-empty span's text, ``""`` when there
    is none, whatever the null score says)."""

    predictions: dict[str, str]
    nbest: dict[str, list[dict]]
    null_odds: dict[str, float]
    best_spans: dict[str, str]


def candidate(text: str, start: int, start_logit: float, end_logit: float) -> dict:
    """One n-best entry; its score is the sum of the two logits."""
    return {"text": text, "start": start, "score": start_logit + end_logit, "start_logit": start_logit,
            "end_logit": end_logit}  # fmt: skip


def window_spans(
    context: str,
    offsets: list,
    starts: np.ndarray,
    ends: np.ndarray,
    data_args: DataTrainingArguments,
) -> list[dict]:
    """The candidate spans of one window, best start first, then best end (the order ties keep).

    ``offsets``: per token of the window the context characters it covers (None outside the context);
    ``starts`` / ``ends``: the window's logits ``(tokens,)``, possibly padded past ``len(offsets)``. A candidate
    is a start and an end among the ``n_best_size`` best, both in the context, the end not before the start, at
    most ``max_answer_length`` tokens; its text runs from the start token's first character to the end token's
    last, and is empty when both tokens cover no character (e.g. a whitespace token of a byte-level BPE).
    """
    top = data_args.n_best_size
    # Only the window's own tokens: a padded row's tail holds the padding value, not logits.
    best_starts = np.argsort(starts[: len(offsets)])[::-1][:top]
    best_ends = np.argsort(ends[: len(offsets)])[::-1][:top]
    spans = []
    for s in best_starts:
        for e in best_ends:
            if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > data_args.max_answer_length:
                continue
            first, last = offsets[s][0], offsets[e][1]
            spans.append(candidate(context[first:last], int(first), float(starts[s]), float(ends[e])))
    return spans


def with_probabilities(nbest: list[dict]) -> list[dict]:
    """``nbest`` with each entry's ``probability``: the softmax of the scores over the list."""
    if not nbest:
        return nbest
    scores = np.array([c["score"] for c in nbest])
    weights = np.exp(scores - scores.max())
    return [{**c, "probability": float(p)} for c, p in zip(nbest, weights / weights.sum())]


def postprocess(
    examples: Dataset,
    windows: Dataset,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    data_args: DataTrainingArguments,
) -> Answers:
    """An answer per example from its windows' logits, by the rules of transformers' ``postprocess_qa_predictions``
    (``examples/pytorch/question-answering/utils_qa.py``).

    ``windows`` holds ``example_id``, ``cls_index`` and ``offset_mapping`` per window (:func:`featurize`), in the
    order of ``start_logits`` / ``end_logits`` ``(windows, tokens)`` (rows may be padded past a window's length;
    those places are never read). The candidates are every window's :func:`window_spans`, ranked by score (a stable
    sort: ties keep the window order). v1 answers the top candidate's text (an empty one too, as transformers'
    does; no candidate at all gives ``""``). v2 (``version_2_with_negative``): the null score is the lowest over the
    windows of the logits on ``[CLS]``; a span with an empty text is no answer, so the best span is the best
    non-empty one, and the answer is ``""`` exactly when ``null score - best span score`` exceeds
    ``null_score_diff_threshold`` (or no non-empty span exists). The n-best list holds the ``n_best_size`` best
    candidates (v2: with the null answer among them, ranked after spans of equal score, and appended when it
    ranks lower).
    """
    by_example = collections.defaultdict(list)
    for w, example_id in enumerate(windows["example_id"]):
        by_example[example_id].append(w)
    offsets_of, cls_of = windows["offset_mapping"], windows["cls_index"]
    top, v2 = data_args.n_best_size, data_args.version_2_with_negative
    answers = Answers({}, {}, {}, {})
    ids = [str(example_id) for example_id in examples["id"]]
    for example_id, context in zip(ids, examples[data_args.context_column_name]):
        spans, null = [], None
        for w in by_example[example_id]:
            cls = cls_of[w]
            window_null = candidate("", -1, float(start_logits[w][cls]), float(end_logits[w][cls]))
            null = window_null if null is None or window_null["score"] < null["score"] else null
            spans += window_spans(context, offsets_of[w], start_logits[w], end_logits[w], data_args)
        ranked = sorted(spans, key=lambda c: c["score"], reverse=True)
        best = next((c for c in ranked if c["text"]), None)
        answers.best_spans[example_id] = best["text"] if best else ""
        if not v2:
            answers.predictions[example_id] = ranked[0]["text"] if ranked else ""
            answers.nbest[example_id] = with_probabilities(ranked[:top])
            continue
        odds = null["score"] - best["score"] if best else float("inf")
        answers.null_odds[example_id] = odds
        answers.predictions[example_id] = "" if odds > data_args.null_score_diff_threshold else best["text"]
        nbest = sorted([*ranked, null], key=lambda c: c["score"], reverse=True)[:top]
        answers.nbest[example_id] = with_probabilities(nbest if any(c is null for c in nbest) else [*nbest, null])
    return answers


# ---------------------------------------------------------------------------------------------------------------
# SQuAD metrics: exact match and F1
# ---------------------------------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, punctuation removed, the articles a/an/the removed, single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the two answers are equal after :func:`normalize_answer`, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """F1 of the two answers' normalised tokens (counted with multiplicity); 1.0 when both are empty, 0.0 when
    only one is."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(
    predictions: dict[str, str],
    references: dict[str, list[str]],
    null_odds: dict[str, float] | None = None,
    best_spans: dict[str, str] | None = None,
) -> dict[str, float]:
    """Exact match and F1 (percent, the best over each question's gold answers) over ``references`` (id -> gold
    texts; an empty list is an unanswerable question, whose only right answer is ``""``).

    When some question is unanswerable, or ``null_odds`` is given (v2), also ``HasAns_*`` / ``NoAns_*`` (each with
    its ``_total``). With ``null_odds`` (id -> null score minus best span score) and ``best_spans`` (id -> the best
    span, whatever the threshold chose), ``best_exact_match`` / ``best_f1`` and their ``_thresh``: the scores the
    best ``--null_score_diff_threshold`` would give (a question is answered with nothing when its odds exceed it).
    """

    def scored(answers: dict[str, str]) -> tuple[dict[str, float], dict[str, float]]:
        exact, f1 = {}, {}
        for qid, golds in references.items():
            golds, answer = golds or [""], answers.get(qid, "")
            exact[qid] = max(exact_match(answer, gold) for gold in golds)
            f1[qid] = max(token_f1(answer, gold) for gold in golds)
        return exact, f1

    exact, f1 = scored(predictions)
    total = len(references)
    results = {"exact_match": 100.0 * sum(exact.values()) / total, "f1": 100.0 * sum(f1.values()) / total,
               "total": total}  # fmt: skip
    answerable = {qid for qid, golds in references.items() if golds}
    if null_odds is not None or len(answerable) < total:
        for name, subset in (("HasAns", answerable), ("NoAns", set(references) - answerable)):
            results[f"{name}_total"] = len(subset)
            if subset:
                results[f"{name}_exact_match"] = 100.0 * sum(exact[q] for q in subset) / len(subset)
                results[f"{name}_f1"] = 100.0 * sum(f1[q] for q in subset) / len(subset)
    if null_odds is not None and best_spans is not None:
        for name, span_scores in zip(("exact_match", "f1"), scored(best_spans)):
            best, threshold = best_null_threshold(references, span_scores, null_odds)
            results[f"best_{name}"], results[f"best_{name}_thresh"] = best, threshold
    return results


def best_null_threshold(
    references: dict[str, list[str]], span_scores: dict[str, float], null_odds: dict[str, float]
) -> tuple[float, float]:
    """The best score (percent) over thresholds on ``null_odds``, and that threshold.

    ``span_scores``: each question's score when answered with its best span. Below every question's odds all are
    answered with nothing, and the unanswerable ones score 1 each (the threshold reported then is 1 below the
    lowest odds). Raising the threshold to a question's odds answers it with its span instead: its score changes
    from 1 (unanswerable) or 0 (answerable) to the span's. A question without any span (infinite odds) is never
    answered.
    """
    finite = sorted((odds, qid) for qid, odds in null_odds.items() if qid in references and np.isfinite(odds))
    score = float(sum(1 for golds in references.values() if not golds))
    best, threshold = score, (finite[0][0] - 1.0 if finite else 0.0)
    for i, (odds, qid) in enumerate(finite):
        score += span_scores[qid] - (0.0 if references[qid] else 1.0)
        # Questions with equal odds switch together: judge the threshold after the last of them.
        if (i + 1 == len(finite) or finite[i + 1][0] != odds) and score > best:
            best, threshold = score, odds
    return 100.0 * best / max(len(references), 1), float(threshold)


def gold_answers(examples: Dataset, answer_column: str) -> dict[str, list[str]]:
    """id -> the example's gold answer texts (empty for an unanswerable question)."""
    return {
        str(example_id): list(answers["text"]) for example_id, answers in zip(examples["id"], examples[answer_column])
    }


@dataclass
class QAEvaluation:
    """Trainer's ``compute_metrics``: post-processes the windows' logits into answers (:func:`postprocess`) and
    scores them against the examples' gold answers (:func:`squad_metrics`). The answers of the last call stay in
    ``answers`` for ``predictions.json``.

    Trainer calls it only when the evaluation batches carry labels, so the evaluation windows keep theirs
    (``start_positions`` / ``end_positions``, which also give an evaluation loss).
    """

    examples: Dataset
    windows: Dataset
    data_args: DataTrainingArguments
    answers: Answers | None = None

    def __call__(self, prediction: EvalPrediction) -> dict[str, float]:
        start_logits, end_logits = prediction.predictions[:2]
        self.answers = postprocess(self.examples, self.windows, start_logits, end_logits, self.data_args)
        v2 = self.data_args.version_2_with_negative
        return squad_metrics(
            self.answers.predictions,
            gold_answers(self.examples, self.data_args.answer_column_name),
            null_odds=self.answers.null_odds if v2 else None,
            best_spans=self.answers.best_spans if v2 else None,
        )

    def save(self, output_dir: str) -> None:
        """Write ``predictions.json``, ``nbest_predictions.json`` and, for v2, ``null_odds.json``."""
        files = {"predictions.json": self.answers.predictions, "nbest_predictions.json": self.answers.nbest}
        if self.data_args.version_2_with_negative:
            files["null_odds.json"] = self.answers.null_odds
        for name, content in files.items():
            with open(os.path.join(output_dir, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2, ensure_ascii=False)


def load_raw_splits(data_args: DataTrainingArguments, training_args: TrainingArguments, cache_dir: str | None):
    """``{"train": Dataset, "eval": Dataset}``, the splits the ``--do_*`` flags ask for, checked.

    Raises:
        ValueError: a split that is asked for has no data, or its answers are malformed or misaligned
            (:func:`check_answers`; misaligned examples are left out instead under ``--misaligned_answers skip``).
    """
    wanted = {"train": (training_args.do_train, data_args.train_file, "train", data_args.max_train_samples),
              "eval": (training_args.do_eval, data_args.validation_file, "validation", data_args.max_eval_samples)}  # fmt: skip
    hub = None
    splits = {}
    for name, (asked, path, hub_split, limit) in wanted.items():
        if not asked:
            continue
        if path is not None:
            data = load_squad_file(path, cache_dir)
        elif data_args.dataset_name is not None:
            if hub is None:
                hub = load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache_dir)
            data = hub[hub_split]
        else:
            flag = "--train_file" if name == "train" else "--validation_file"
            raise ValueError(f"--do_{name} needs data: pass {flag} (SQuAD-format JSON) or --dataset_name.")
        data = take(data, limit)
        if "id" not in data.column_names:  # answers are matched to their questions by id
            data = data.add_column("id", [str(i) for i in range(len(data))])
        splits[name] = check_answers(data, data_args, path or f"{data_args.dataset_name} ({hub_split})")
    return splits


def parse_args(argv: list[str] | None = None):
    """``(ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments)`` from the command line
    (``argv``), or from a single ``.json`` file argument."""
    return parse_script_args((ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments), argv, __doc__)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the script; returns the training and evaluation metrics (also written to ``output_dir``)."""
    model_args, data_args, training_args, run_args = parse_args(argv)
    setup_logging(training_args, logger)
    check_world_size(training_args)
    checkpoint = resume_checkpoint(training_args, run_args.overwrite_output_dir)
    set_seed(training_args.seed)

    # Data first: a bad file fails before any model is loaded.
    splits = load_raw_splits(data_args, training_args, model_args.cache_dir)
    config, tokenizer, model = load_model(model_args)
    options = window_options(model, config, data_args)

    train, evaluation, evaluator = None, None, None
    if "train" in splits:
        train = windows_of(splits["train"], "training data", tokenizer, data_args, options, training_args)
    if "eval" in splits:
        evaluation = windows_of(splits["eval"], "evaluation data", tokenizer, data_args, options, training_args)
        evaluator = QAEvaluation(splits["eval"], evaluation.select_columns(list(WINDOW_COLUMNS)), data_args)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=model_inputs(train),
        eval_dataset=model_inputs(evaluation),
        processing_class=tokenizer,
        data_collator=sequence_parallel_collator(
            QACollator(tokenizer.pad_token_id), model, training_args, options["max_length"], False, logger
        ),
        compute_metrics=evaluator,
    )
    metrics: dict[str, float] = {}
    if training_args.do_train:
        metrics.update(run_training(trainer, checkpoint, splits["train"], train))
    if training_args.do_eval:
        metrics.update(run_evaluation(trainer, evaluator, splits["eval"], evaluation))
    record_run(trainer, model_args, data_args, run_args, options["max_length"])
    return metrics


def load_model(model_args: ModelArguments) -> tuple:
    """``(config, tokenizer, model)``: the model with its question-answering head, and its fast tokenizer.

    Raises:
        ValueError: the model type has no question-answering head, or the tokenizer is not a fast one (answers are
            mapped to characters through a fast tokenizer's offsets).
    """
    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    if type(config) not in AutoModelForQuestionAnswering._model_mapping:
        raise ValueError(
            f"{model_args.config_name or model_args.model_name_or_path!r} holds a {config.model_type!r} model, which "
            "has no question-answering head: run_qa.py fine-tunes text encoders (hfx-longformer, hfx-bigbird, "
            "hfx-linformer, hfx-performer, hfx-reformer, BERT, RoBERTa, ...)."
        )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    if not tokenizer.is_fast:
        raise ValueError(
            f"run_qa.py maps answers to characters through a fast tokenizer's offsets; {type(tokenizer).__name__} is "
            "not one. Pass --tokenizer_name with a fast tokenizer (tokenizer.json)."
        )
    model = AutoModelForQuestionAnswering.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    return config, tokenizer, model


def window_options(model, config, data_args: DataTrainingArguments) -> dict:
    """How :func:`featurize` cuts the examples into windows for ``model``: ``max_length`` (``--max_seq_length``, by
    default all the model reads), ``global_attention`` (for models that take a ``global_attention_mask``) and
    ``return_token_type_ids`` (False for models with a single segment, else the tokenizer's default).

    Raises:
        ValueError: ``--max_seq_length`` exceeds what the model reads, or ``--doc_stride`` is not under half a window.
    """
    limit = model_max_tokens(model.base_model)
    max_length = data_args.max_seq_length or limit
    if max_length > limit:
        raise ValueError(f"--max_seq_length {max_length} exceeds the {limit} tokens the model reads; lower it.")
    if data_args.long_documents == "chunks" and data_args.doc_stride >= max_length // 2:
        raise ValueError(
            f"--doc_stride {data_args.doc_stride} must be under half of --max_seq_length {max_length}: each window "
            "must move on by more than the slice it shares with its neighbour."
        )
    global_attention = supports_global_attention(model.base_model)
    # Models with a single segment (RoBERTa-style, hfx text models) cannot embed a BERT tokenizer's segment ids 1.
    token_types = None if getattr(config, "type_vocab_size", 2) > 1 else False
    logger.info(
        "Windows of %d tokens (%s, overlap %d); global attention on the question: %s",
        max_length,
        data_args.long_documents,
        data_args.doc_stride if data_args.long_documents == "chunks" else 0,
        global_attention,
    )
    return {"max_length": max_length, "global_attention": global_attention, "return_token_type_ids": token_types}


def windows_of(
    data: Dataset,
    desc: str,
    tokenizer,
    data_args: DataTrainingArguments,
    options: dict,
    training_args: TrainingArguments,
) -> Dataset:
    """``data``'s examples featurized into windows (:func:`featurize` with the :func:`window_options`), logged."""
    # The main process featurizes first and caches; torchrun replicas then read the cache.
    with training_args.main_process_first(desc=desc):
        windows = data.map(
            featurize,
            batched=True,
            remove_columns=data.column_names,
            fn_kwargs={"tokenizer": tokenizer, "data_args": data_args, **options},
            desc=desc,
        )
    report_windows(data, windows, data_args.long_documents, desc)
    return windows


def run_training(trainer: Trainer, checkpoint: str | None, examples: Dataset, windows: Dataset) -> dict[str, float]:
    """Train (resuming from ``checkpoint``); save the model with its config and tokenizer, the training metrics
    (``train_results.json``) and the trainer state. Returns the metrics."""
    result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()  # model, config and tokenizer in output_dir
    metrics = {**result.metrics, "train_samples": len(examples), "train_windows": len(windows)}
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    return metrics


def run_evaluation(trainer: Trainer, evaluator: QAEvaluation, examples: Dataset, windows: Dataset) -> dict[str, float]:
    """Evaluate; save the metrics (``eval_results.json``) and, on the main process, the answers
    (:meth:`QAEvaluation.save`). Returns the metrics."""
    metrics = {**trainer.evaluate(), "eval_samples": len(examples), "eval_windows": len(windows)}
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)  # eval_results.json
    if trainer.is_world_process_zero():
        evaluator.save(trainer.args.output_dir)
    return metrics


def record_run(
    trainer: Trainer,
    model_args: ModelArguments,
    data_args: DataTrainingArguments,
    run_args: RunArguments,
    max_length: int,
) -> None:
    """Record the run in ``output_dir``'s model card, and upload it with ``--push_to_hub``
    (:func:`finish_output_dir`)."""
    from_hub = data_args.dataset_name is not None and not (data_args.train_file or data_args.validation_file)
    finish_output_dir(
        trainer,
        run_args,
        trained=trainer.args.do_train,
        base_model=hub_model_id(model_args.model_name_or_path),
        summary=f"Fine-tuned from {model_origin(model_args.model_name_or_path)} for extractive question answering "
        f"(SQuAD {'v2' if data_args.version_2_with_negative else 'v1'} format) with `examples/run_qa.py` of "
        "hf_xformers.",
        datasets=[data_args.dataset_name] if from_hub else None,
        dataset_name=data_args.dataset_name if from_hub else "local SQuAD-format files",
        dataset_type=data_args.dataset_name if from_hub else "local",
        task_type="question-answering",
        extra_hyperparameters={
            "max_seq_length": max_length,
            "long_documents": data_args.long_documents,
            "doc_stride": data_args.doc_stride,
        },
    )


def model_inputs(windows: Dataset | None) -> Dataset | None:
    """``windows`` without the columns only post-processing reads (:data:`WINDOW_COLUMNS`)."""
    return None if windows is None else windows.remove_columns(list(WINDOW_COLUMNS))


def report_windows(examples: Dataset, windows: Dataset, long_documents: str, desc: str) -> None:
    """Log how many contexts did not fit one window: read in several (chunks), or cut (truncate, a warning)."""
    needed = {example_id: n for example_id, n in zip(windows["example_id"], windows["example_windows"])}
    longer = sum(1 for n in needed.values() if n > 1)
    if long_documents == "chunks":
        logger.info("%s: %d examples in %d windows (%d read in several).", desc, len(examples), len(windows), longer)
    elif longer:
        logger.warning(
            "%s: %d of %d contexts are longer than a window and were cut (--long_documents truncate): answers past "
            "the cut cannot be found. --long_documents chunks reads them whole.",
            desc,
            longer,
            len(examples),
        )


if __name__ == "__main__":
    main()
