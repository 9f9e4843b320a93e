"""Fine-tune and evaluate a text classifier on your own data with ``transformers.Trainer``: single-label (any
number of labels, given as ids or as names), multi-label (a column of label lists) or regression (a float column).

Works with any model ``AutoModelForSequenceClassification`` loads, hf_xformers' long models and transformers' own.
Data come from local csv / json / jsonl files or a Hub dataset; the flags follow transformers'
``run_classification.py``: ``--text_column_names`` (comma-separated, joined with ``--text_column_delimiter``),
``--label_column_name``, ``--remove_columns``, ``--remove_splits``, ``--metric_name``, ``--shuffle_train_dataset``.

The kind of task comes from the label column: lists are multi-label (a sigmoid per label, ``--multi_label_threshold``),
floats are regression, anything else (ints, strings) single-label; string labels are kept as the model's
``id2label``. Metrics (scikit-learn / scipy, no Hub access): accuracy and macro F1 for single-label; micro and macro
F1 and exact-match accuracy for multi-label; MSE, Pearson and Spearman for regression; ``--metric_name`` adds one
more (``precision``, ``recall``, ``matthews_correlation``, ``mae`` ...).

Before training the script logs, for each split, how long the documents are in tokens against the model's length
(median, 90th percentile, how many would be truncated and how many tokens that loses; also in
``token_lengths.json``). Documents longer than ``--max_seq_length`` (default: all the model reads) are truncated in
training; in evaluation and prediction ``--long_documents chunks`` reads them whole instead, in overlapping windows
(``--doc_stride`` tokens of overlap) whose logits are aggregated (``--chunk_aggregation mean`` or ``max``).

Outputs, in ``--output_dir``: ``eval_results.json`` (``--do_eval``), ``predict_results.txt`` (``--do_predict``:
``index<TAB>prediction`` rows, label names; comma-separated names for multi-label), ``token_lengths.json``, and the
fine-tuned model with its tokenizer (``--do_train``).

Examples (see examples/README.md)::

    python -m examples.run_classification --model_name_or_path path/to/model \\
        --train_file train.csv --validation_file dev.csv --test_file test.csv \\
        --text_column_names title,body --label_column_name topic \\
        --do_train --do_eval --do_predict --output_dir out/topics
    python -m examples.run_classification --model_name_or_path out/topics --validation_file dev.csv \\
        --text_column_names title,body --label_column_name topic --do_eval \\
        --long_documents chunks --doc_stride 128 --output_dir out/topics-chunked
    torchrun --nproc_per_node=2 -m examples.run_classification ...   # same arguments, data-parallel
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import numpy as np
import torch
from datasets import ClassLabel, Dataset, List, Sequence, Value, load_dataset
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import (
    accuracy_score,
    f1_score,
    matthews_corrcoef,
    mean_absolute_error,
    mean_squared_error,
    precision_score,
    recall_score,
)
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    Trainer,
    TrainingArguments,
    set_seed,
)

import hf_xformers  # noqa: F401  (registers the hfx-* model types with the Auto classes)
from examples.run_glue import ModelArguments
from examples.utils_examples import (
    RunArguments,
    check_world_size,
    data_file_errors,
    describe_token_lengths,
    finish_output_dir,
    hub_model_id,
    load_local_file,
    model_max_length,
    model_origin,
    packed_collator,
    padding_free_message,
    padding_free_refusal,
    parse_script_args,
    require_columns,
    resume_checkpoint,
    sequence_parallel_collator,
    setup_logging,
    take,
    token_length_report,
)
from hf_xformers.packed_inference import (
    AGGREGATIONS,
    LONG_DOCUMENTS,
    aggregate_chunks,
    document_windows,
    special_token_layout,
)
from hf_xformers.sequence_parallel_data import DataCollatorForSequenceParallel, sequence_label_ids

logger = logging.getLogger("run_classification")

SINGLE_LABEL, MULTI_LABEL, REGRESSION = "single_label_classification", "multi_label_classification", "regression"
# The metrics every run reports, per kind of task, and those --metric_name may add.
DEFAULT_METRICS = {
    SINGLE_LABEL: ("accuracy", "f1_macro"),
    MULTI_LABEL: ("f1_micro", "f1_macro", "accuracy"),
    REGRESSION: ("mse", "pearson", "spearmanr"),
}
EXTRA_METRICS = {
    SINGLE_LABEL: ("f1", "precision", "recall", "matthews_correlation"),
    MULTI_LABEL: ("f1", "precision", "recall"),
    REGRESSION: ("mae",),
}


@dataclass
class DataTrainingArguments:
    """Which data, which columns, and how documents are tokenized, cut or chunked."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset (when no local files are given)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "csv/json/jsonl training file."})
    validation_file: str | None = field(default=None, metadata={"help": "csv/json/jsonl evaluation file."})
    test_file: str | None = field(default=None, metadata={"help": "csv/json/jsonl test file (labels not needed)."})
    text_column_names: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated text columns, joined with --text_column_delimiter into one input "
            "(default: 'sentence', or 'text' where there is no 'sentence' column)."
        },
    )
    text_column_delimiter: str = field(default=" ", metadata={"help": "Joins the text columns."})
    label_column_name: str = field(
        default="label",
        metadata={"help": "The label column: ids or names (single-label), lists (multi-label) or floats (regression)."},
    )
    problem_type: str | None = field(
        default=None,
        metadata={
            "help": "single_label_classification, multi_label_classification or regression (default: from the label "
            "column: lists are multi-label, floats regression, anything else single-label). Float class ids "
            "(0.0, 1.0, ...) need single_label_classification."
        },
    )
    remove_columns: str | None = field(default=None, metadata={"help": "Comma-separated columns to drop first."})
    remove_splits: str | None = field(default=None, metadata={"help": "Comma-separated Hub splits to drop."})
    metric_name: str | None = field(
        default=None, metadata={"help": "One more metric beside the defaults, e.g. precision, recall, mae."}
    )
    shuffle_train_dataset: bool = field(default=False, metadata={"help": "Shuffle the training set once, first."})
    shuffle_seed: int = field(default=42, metadata={"help": "Seed of --shuffle_train_dataset."})
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens the model reads at once (default: the model's maximum length)."}
    )
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every input to max_seq_length (default: pad each batch to its longest)."}
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Pack every batch into one row of unpadded documents (hf_xformers models; not hfx-linformer): "
            "no compute is spent on padding, and each document is classified as on its own."
        },
    )
    long_documents: str = field(
        default="truncate",
        metadata={
            "help": "Evaluation and prediction of documents longer than max_seq_length: 'truncate' (read the first "
            "max_seq_length tokens) or 'chunks' (read all of it in overlapping windows, aggregate their logits). "
            "Training always reads the first max_seq_length tokens."
        },
    )
    doc_stride: int = field(
        default=128, metadata={"help": "Overlap of two windows, in tokens (--long_documents chunks)."}
    )
    chunk_aggregation: str = field(
        default="mean", metadata={"help": "How windows' logits make a document's: 'mean' or 'max'."}
    )
    multi_label_threshold: float = field(
        default=0.5, metadata={"help": "Multi-label: a label is predicted when its sigmoid reaches this value."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation examples."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Use only the first N test examples."})

    def __post_init__(self) -> None:
        if self.dataset_name is None and not self.uses_local_files:
            raise ValueError("Give the data: --train_file / --validation_file / --test_file, or --dataset_name.")
        if self.long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"--long_documents must be one of {list(LONG_DOCUMENTS)}, got {self.long_documents!r}.")
        if self.chunk_aggregation not in AGGREGATIONS:
            raise ValueError(
                f"--chunk_aggregation must be one of {list(AGGREGATIONS)}, got {self.chunk_aggregation!r}."
            )
        if self.padding_free and self.pad_to_max_length:
            raise ValueError("--padding_free packs unpadded documents: drop --pad_to_max_length.")
        if not 0.0 < self.multi_label_threshold < 1.0:
            raise ValueError(f"--multi_label_threshold must lie in (0, 1), got {self.multi_label_threshold}.")
        if self.problem_type is not None and self.problem_type not in DEFAULT_METRICS:
            raise ValueError(f"--problem_type must be one of {list(DEFAULT_METRICS)}, got {self.problem_type!r}.")

    @property
    def uses_local_files(self) -> bool:
        return any((self.train_file, self.validation_file, self.test_file))


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def split_list(value: str | None) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``; None -> ``[]``."""
    return [part.strip() for part in value.split(",") if part.strip()] if value else []


def load_raw_splits(data_args: DataTrainingArguments, training_args: TrainingArguments, cache_dir: str | None):
    """``{"train" | "eval" | "predict": Dataset}``, the splits the ``--do_*`` flags ask for.

    Raises:
        ValueError: a split that ``--do_train`` / ``--do_eval`` / ``--do_predict`` needs is missing.
    """
    if data_args.uses_local_files:
        files = {"train": data_args.train_file, "eval": data_args.validation_file, "predict": data_args.test_file}
        raw = {name: load_local_file(path, cache_dir) for name, path in files.items() if path}
    else:
        hub = load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache_dir)
        for name in split_list(data_args.remove_splits):
            hub.pop(name, None)
        names = {"train": "train", "eval": "validation", "predict": "test"}
        raw = {ours: hub[theirs] for ours, theirs in names.items() if theirs in hub}
    wanted = {"train": training_args.do_train, "eval": training_args.do_eval, "predict": training_args.do_predict}
    flags = {"train": "--do_train needs --train_file", "eval": "--do_eval needs --validation_file",
             "predict": "--do_predict needs --test_file"}  # fmt: skip
    for name, needed in wanted.items():
        if needed and name not in raw:
            raise ValueError(f"{flags[name]} (or a Hub dataset with that split).")
    drop = split_list(data_args.remove_columns)
    return {
        name: data.remove_columns([c for c in drop if c in data.column_names])
        for name, data in raw.items()
        if wanted[name]
    }


def text_columns(data_args: DataTrainingArguments, dataset: Dataset) -> list[str]:
    """The text columns: ``--text_column_names``, else ``sentence`` (transformers' default), else ``text``."""
    given = split_list(data_args.text_column_names)
    if given:
        return given
    return ["text"] if "sentence" not in dataset.column_names and "text" in dataset.column_names else ["sentence"]


def class_names(dataset: Dataset, label_column: str) -> Dataset:
    """``dataset`` with a ``ClassLabel`` column (a Hub dataset's) given as its class names, the form string labels
    of local files take; other columns as they are."""
    feature = dataset.features[label_column]
    if not isinstance(feature, ClassLabel):
        return dataset
    features = dataset.features.copy()
    features[label_column] = Value("string")
    return dataset.map(
        lambda batch: {label_column: feature.int2str(batch[label_column])}, batched=True, features=features
    )


def task_kind(feature, problem_type: str | None = None) -> str:
    """The problem type: ``problem_type`` (``--problem_type``) when given, else what the label column's feature
    implies: lists are multi-label, floats regression, anything else single-label.

    Raises:
        ValueError: ``problem_type`` is multi-label and the column holds no lists, or the other way round.
    """
    is_list = isinstance(feature, (List, Sequence))
    if problem_type is None:
        if is_list:
            return MULTI_LABEL
        return REGRESSION if isinstance(feature, Value) and feature.dtype.startswith("float") else SINGLE_LABEL
    if is_list != (problem_type == MULTI_LABEL):
        holds = "lists of labels" if is_list else "one label per row"
        raise ValueError(f"--problem_type {problem_type} does not fit a label column that holds {holds}.")
    return problem_type


def announce_regression(dataset: Dataset, label_column: str) -> None:
    """Say that a float label column is taken for regression: a warning when every value is a whole number (class
    ids written as floats, e.g. by pandas for a column with gaps), which ``--problem_type`` then classifies."""
    values = [v for v in dataset[label_column] if v is not None]
    dtype = dataset.features[label_column].dtype
    if values and all(float(v).is_integer() for v in values):
        logger.warning(
            "The label column %r holds %s values that are all whole numbers (%d distinct): they look like class ids, "
            "but a float column means regression, so the model is trained to predict a number. Pass --problem_type "
            "single_label_classification to classify instead.",
            label_column,
            dtype,
            len(set(values)),
        )
    else:
        logger.info("The label column %r holds %s values: regression (--problem_type to change).", label_column, dtype)


def label_key(value) -> str:
    """A label as the label list writes it: a whole number in decimal (``3``, and ``3.0`` as ``"3"``), anything
    else as ``str``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def labels_in(kind: str, values: list) -> list:
    """The distinct labels of a label column's ``values`` (the labels of every row's list for multi-label)."""
    flat = [v for row in values for v in (row or [])] if kind == MULTI_LABEL else values
    return list({v: None for v in flat if v is not None})


def natural_order(values: list) -> list[str]:
    """``values`` as :func:`label_key` writes them, in their natural order: numbers by value (2 before 10, as
    transformers sorts them), anything else as strings."""
    numeric = all(isinstance(v, (int, float)) for v in values)  # bool is an int
    ordered = sorted(values) if numeric else sorted(values, key=str)
    return list(dict.fromkeys(label_key(v) for v in ordered))


def model_labels(config) -> tuple[list[str], bool]:
    """The model's class names in id order (:func:`label_key` of its ``id2label``), and whether it names its classes.
    transformers' default names ``LABEL_k`` stand for class ``k``: written ``"k"``, and they name nothing."""
    id2label = getattr(config, "id2label", None) or {}
    names, named = [], False
    for i in sorted(id2label, key=int):
        default = id2label[i] == f"LABEL_{int(i)}"
        names.append(str(int(i)) if default else label_key(id2label[i]))
        named = named or not default
    return names, named


def label_names(kind: str, splits: dict[str, Dataset], label_column: str, config) -> list[str]:
    """The class names, in id order, from the whole training split (else the evaluation split; before any
    ``--max_*_samples``): the model's own (``id2label``) when they include every one of those labels (a model
    fine-tuned before keeps its ids, even where an evaluation set lacks some of its classes; integer labels ``k``
    are the ids of a model whose ``id2label`` holds the ints ``k`` or transformers' ``LABEL_k``), else the labels
    in their natural order (:func:`natural_order`). Prediction alone takes the model's. Regression has none.

    Raises:
        ValueError: evaluation without training data holds labels that a model with named classes does not know.
    """
    if kind == REGRESSION:
        return []
    ours, named = model_labels(config)
    source = "train" if "train" in splits else "eval" if "eval" in splits else None
    if source is None:
        return ours
    found = labels_in(kind, splits[source][label_column])
    if {label_key(v) for v in found} <= set(ours):
        return ours
    if source == "eval" and named:  # the model's head is not trained here: its ids are the only right ones
        check_known_labels(kind, splits["eval"], label_column, ours, "eval data", "the model's labels (its id2label)")
    return natural_order(found)


def check_known_labels(kind: str, dataset: Dataset, label_column: str, labels: list[str], source: str, whose: str):
    """Raise a ``ValueError`` naming the labels of ``dataset`` that ``labels`` lacks, and ``labels`` (``whose``
    says whose they are); or the rows without a label."""
    values = dataset[label_column]
    missing = sum(v is None for v in values) if kind != MULTI_LABEL else 0
    if missing:
        raise ValueError(f"{source}: {missing} row(s) have no label in the column {label_column!r}.")
    unknown = [v for v in labels_in(kind, values) if label_key(v) not in set(labels)]
    if unknown:
        raise ValueError(
            f"{source}: label(s) {natural_order(unknown)} are not among {whose} {labels}. Give the labels as these "
            "names, or fine-tune on data that hold them (--do_train with a --train_file)."
        )


def encode(
    dataset: Dataset, columns: list[str], data_args: DataTrainingArguments, kind: str, labels: list[str], source: str
) -> Dataset:
    """``text`` (the text columns joined) and, where the split has labels, ``labels`` as the model takes them
    (every label is among ``labels``: :func:`check_known_labels`).

    Raises:
        ValueError: a missing column.
    """
    label_column = data_args.label_column_name
    with_labels = label_column in dataset.column_names
    require_columns(dataset, columns, source)
    ids = {name: i for i, name in enumerate(labels)}

    def convert(label):
        if kind == REGRESSION:
            return float(label)
        if kind == MULTI_LABEL:
            hot = [0.0] * len(labels)
            for value in label or []:
                hot[ids[label_key(value)]] = 1.0
            return hot
        return ids[label_key(label)]

    def row(batch: dict) -> dict:
        texts = [
            data_args.text_column_delimiter.join("" if batch[c][i] is None else str(batch[c][i]) for c in columns)
            for i in range(len(batch[columns[0]]))
        ]
        out = {"text": texts}
        if with_labels:
            out["labels"] = [convert(label) for label in batch[label_column]]
        return out

    return dataset.map(row, batched=True, remove_columns=dataset.column_names, desc=f"{source}: texts and labels")


# ---------------------------------------------------------------------------------------------------------------
# Metrics and predictions
# ---------------------------------------------------------------------------------------------------------------


def compute_metrics(
    kind: str, logits: np.ndarray, labels: np.ndarray, threshold: float = 0.5, extra: str | None = None
):
    """The run's metrics from document logits ``(num_documents, num_labels)`` and gold labels (class ids, multi-hot
    rows or scores)."""
    names = (*DEFAULT_METRICS[kind], *([extra] if extra and extra not in DEFAULT_METRICS[kind] else []))
    results = {}
    if kind == REGRESSION:
        scores = logits.reshape(-1)
        for name in names:
            if name == "mse":
                results[name] = mean_squared_error(labels, scores)
            elif name == "mae":
                results[name] = mean_absolute_error(labels, scores)
            elif name == "pearson":
                results[name] = pearsonr(scores, labels)[0] if len(labels) > 1 else float("nan")
            elif name == "spearmanr":
                results[name] = spearmanr(scores, labels)[0] if len(labels) > 1 else float("nan")
        return {k: float(v) for k, v in results.items()}
    if kind == MULTI_LABEL:
        predicted = (1.0 / (1.0 + np.exp(-logits)) >= threshold).astype(int)
        labels = labels.astype(int)
        average = "micro"
    else:
        predicted = np.argmax(logits, axis=-1)
        average = "macro"
    for name in names:
        if name == "accuracy":  # multi-label: every label of the document right
            results[name] = accuracy_score(labels, predicted)
        elif name in ("f1_micro", "f1_macro"):
            results[name] = f1_score(labels, predicted, average=name[3:], zero_division=0.0)
        elif name == "f1":
            results[name] = f1_score(labels, predicted, average=average, zero_division=0.0)
        elif name == "precision":
            results[name] = precision_score(labels, predicted, average=average, zero_division=0.0)
        elif name == "recall":
            results[name] = recall_score(labels, predicted, average=average, zero_division=0.0)
        elif name == "matthews_correlation":
            results[name] = matthews_corrcoef(labels, predicted)
    return {k: float(v) for k, v in results.items()}


def prediction_texts(kind: str, logits: np.ndarray, labels: list[str], threshold: float) -> list[str]:
    """What ``predict_results.txt`` says per document: a label name, comma-separated names, or a score."""
    if kind == REGRESSION:
        return [f"{v:.3f}" for v in logits.reshape(-1)]
    if kind == MULTI_LABEL:
        chosen = 1.0 / (1.0 + np.exp(-logits)) >= threshold
        return [",".join(labels[j] for j in np.flatnonzero(row)) for row in chosen]
    return [labels[i] for i in np.argmax(logits, axis=-1)]


def write_predictions(path: str, texts: list[str]) -> None:
    """``index<TAB>prediction`` rows with a header, as transformers' ``run_classification.py`` writes them."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\n")
        for index, text in enumerate(texts):
            f.write(f"{index}\t{text}\n")


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    """``(ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments)`` from the command line
    (``argv``), or from a single ``.json`` file argument."""
    return parse_script_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments), argv, __doc__, check_arguments
    )


def check_arguments(model_args: ModelArguments, data_args: DataTrainingArguments, *_) -> None:
    """Refuse, before any data are read, ``--padding_free`` with a model that cannot take packed batches
    (transformers' own models, hfx-linformer): its classification head is built on the meta device and asked."""
    if data_args.padding_free:
        refusal = padding_free_refusal(
            model_args.config_name or model_args.model_name_or_path,
            AutoModelForSequenceClassification,
            cache_dir=model_args.cache_dir,
            trust_remote_code=model_args.trust_remote_code,
        )
        if refusal is not None:
            raise ValueError(padding_free_message(refusal))


def load_labelled_data(
    model_args: ModelArguments, data_args: DataTrainingArguments, training_args: TrainingArguments
) -> tuple[dict[str, Dataset], str, list[str]]:
    """``(splits, kind, labels)``: the splits the ``--do_*`` flags ask for (``"train"``, ``"eval"``,
    ``"predict"``; a test split without its label column), each cut to its ``--max_*_samples``; the problem type;
    the class names in id order, found on the whole splits before that cut (as transformers does), so a sample
    that lacks a class still trains and evaluates all of them.

    Raises:
        ValueError: an empty file, a missing column, or labels the label list does not know.
    """
    raw = load_raw_splits(data_args, training_args, model_args.cache_dir)
    if "train" in raw and data_args.shuffle_train_dataset:
        raw["train"] = raw["train"].shuffle(seed=data_args.shuffle_seed)
    label_column = data_args.label_column_name
    if "predict" in raw and label_column in raw["predict"].column_names:
        raw["predict"] = raw["predict"].remove_columns(label_column)  # test sets may hold -1 or no real labels
    labelled = [name for name in ("train", "eval") if name in raw]
    for name in labelled:
        require_columns(raw[name], [label_column], f"{name} data")
        raw[name] = class_names(raw[name], label_column)
    pretrained_config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    if labelled:
        kind = task_kind(raw[labelled[0]].features[label_column], data_args.problem_type)
        if kind == REGRESSION and data_args.problem_type is None:
            announce_regression(raw[labelled[0]], label_column)
    else:  # prediction only: the fine-tuned model knows its task
        kind = data_args.problem_type or pretrained_config.problem_type or SINGLE_LABEL
    if extra := data_args.metric_name:
        allowed = (*DEFAULT_METRICS[kind], *EXTRA_METRICS[kind])
        if extra not in allowed:
            raise ValueError(f"--metric_name {extra!r} does not apply to {kind}; choose one of {list(allowed)}.")
    labels = label_names(kind, raw, label_column, pretrained_config)
    if kind != REGRESSION and not labels:
        raise ValueError("No labels found: give labelled training or evaluation data, or a fine-tuned model.")
    limits = {"train": data_args.max_train_samples, "eval": data_args.max_eval_samples,
              "predict": data_args.max_predict_samples}  # fmt: skip
    raw = {name: take(data, limits[name]) for name, data in raw.items()}
    if kind != REGRESSION:
        whose = "the training labels" if "train" in raw else "the model's labels (its id2label)"
        for name in labelled:
            check_known_labels(kind, raw[name], label_column, labels, f"{name} data", whose)
    return raw, kind, labels


def load_model(model_args: ModelArguments, data_args: DataTrainingArguments, kind: str, labels: list[str]):
    """``(model, tokenizer, max_length)``: the classifier of ``kind`` with ``labels`` as its ``id2label``, its
    tokenizer, and the tokens it reads at once (``--max_seq_length``, at most the model's length).

    Raises:
        ValueError: the model type has no sequence-classification head.
    """
    label_kwargs = {}
    if labels:
        label_kwargs = {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}}
    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        num_labels=len(labels) if labels else 1,
        problem_type=kind,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
        **label_kwargs,
    )
    if type(config) not in AutoModelForSequenceClassification._model_mapping:
        raise ValueError(
            f"{model_args.config_name or model_args.model_name_or_path!r} holds a {config.model_type!r} model, which "
            "has no sequence-classification head: run_classification.py fine-tunes text models (hfx-longformer, "
            "hfx-bigbird, BERT, RoBERTa, ...)."
        )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    limit = model_max_length(model, tokenizer)
    max_length = data_args.max_seq_length or limit
    if max_length > limit:
        logger.warning("max_seq_length %d exceeds the model's %d tokens; using the latter.", max_length, limit)
        max_length = limit
    return model, tokenizer, max_length


def data_collator(model, tokenizer, max_length: int, data_args: DataTrainingArguments, training_args):
    """The batches' collator: packed (``--padding_free``; a model that cannot take packed batches fails here,
    before the data are tokenized), padded to ``max_length`` (``--pad_to_max_length``), or to each batch's longest;
    for sequence parallelism wrapped for DeepSpeed's adapter (``sequence_parallel_collator``)."""
    if data_args.padding_free:
        collator = packed_collator(model, training_args, logger, per_document_labels=True)
    elif data_args.pad_to_max_length:
        collator = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=max_length)
    else:
        collator = DataCollatorWithPadding(tokenizer)
    return sequence_parallel_collator(collator, model, training_args, max_length, data_args.padding_free, logger)


def tokenize_splits(
    encoded: dict[str, Dataset],
    tokenizer,
    max_length: int,
    data_args: DataTrainingArguments,
    training_args: TrainingArguments,
) -> tuple[dict[str, Dataset], dict[str, list[int]], dict[str, dict]]:
    """``(features, document_index, reports)`` per split: the windows of ``max_length`` tokens the model reads
    (training truncates; evaluation and prediction follow ``--long_documents``), each window's document, and the
    token-length report (also written to ``token_lengths.json``)."""
    # Tokenization: every document whole first (its length is reported), then cut into the windows the model reads.
    prefix, suffix = special_token_layout(tokenizer)

    def tokenize(batch: dict) -> dict:
        ids = tokenizer(batch["text"], verbose=False, return_attention_mask=False)["input_ids"]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    def windows_of(batch: dict, indices: list[int], mode: str) -> dict:
        windows, owners = document_windows(batch["input_ids"], max_length, mode, data_args.doc_stride, prefix, suffix)
        out = {"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows],
               "document_index": [indices[j] for j in owners]}  # fmt: skip
        if "labels" in batch:
            out["labels"] = [batch["labels"][j] for j in owners]
        return out

    features, document_index, reports = {}, {}, {}
    for name, data in encoded.items():
        mode = "truncate" if name == "train" else data_args.long_documents
        # The main process tokenizes first and caches; torchrun replicas then read the cache.
        with training_args.main_process_first(desc=f"tokenizing {name} data"):
            tokens = data.map(tokenize, batched=True, remove_columns=["text"], desc=f"tokenizing {name} data")
            windows = tokens.map(
                windows_of, batched=True, with_indices=True, fn_kwargs={"mode": mode},
                remove_columns=tokens.column_names, desc=f"{name} data: windows of {max_length} tokens",
            )  # fmt: skip
        reports[name] = token_length_report(tokens["length"], max_length, [len(w) for w in windows["input_ids"]])
        logger.info("%s", describe_token_lengths(name, reports[name], mode))
        document_index[name] = windows["document_index"]
        features[name] = windows.remove_columns("document_index")
    if training_args.should_save:
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "token_lengths.json"), "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=2)
    return features, document_index, reports


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the script; returns the training and evaluation metrics (also written to ``output_dir``)."""
    model_args, data_args, training_args, run_args = parse_args(argv)
    setup_logging(training_args, logger)
    check_world_size(training_args)
    source, out, processes = model_args.model_name_or_path, training_args.output_dir, training_args.world_size
    logger.info("Model %s, output in %s, %d process(es)", source, out, processes)
    checkpoint = resume_checkpoint(training_args, run_args.overwrite_output_dir)
    set_seed(training_args.seed)

    # Data: load, pick the columns, find the kind of task and the labels (a bad file fails before any model loads).
    with data_file_errors("run_classification.py"):
        raw, kind, labels = load_labelled_data(model_args, data_args, training_args)
    columns = text_columns(data_args, next(iter(raw.values())))
    encoded = {name: encode(data, columns, data_args, kind, labels, f"{name} data") for name, data in raw.items()}
    logger.info("Task %s%s, text from %s", kind, f" with {len(labels)} labels" if labels else "",
                " + ".join(repr(c) for c in columns))  # fmt: skip

    model, tokenizer, max_length = load_model(model_args, data_args, kind, labels)
    collator = data_collator(model, tokenizer, max_length, data_args, training_args)
    features, document_index, reports = tokenize_splits(encoded, tokenizer, max_length, data_args, training_args)

    def window_metrics(prediction: EvalPrediction) -> dict[str, float]:
        # Periodic evaluation during training scores windows; the final evaluation scores documents.
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        label_ids = prediction.label_ids
        if isinstance(collator, DataCollatorForSequenceParallel) and kind != MULTI_LABEL:
            label_ids = sequence_label_ids(label_ids)  # spread over the tokens for DeepSpeed's adapter
        return compute_metrics(kind, logits, label_ids, data_args.multi_label_threshold)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=features.get("train"),
        eval_dataset=features.get("eval"),
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=window_metrics,
    )

    def document_logits(name: str) -> tuple[np.ndarray, dict[str, float]]:
        """Every process predicts (Trainer shards the windows); the windows' logits become the documents'."""
        output = trainer.predict(features[name], metric_key_prefix=name)
        logits = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
        logits = torch.from_numpy(np.asarray(logits, dtype=np.float32))
        documents = aggregate_chunks(logits, document_index[name], len(encoded[name]), data_args.chunk_aggregation)
        return documents.numpy(), output.metrics

    metrics: dict[str, float] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # model, config and tokenizer in output_dir
        train_metrics = {**result.metrics, "train_samples": len(encoded["train"])}
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()
        metrics.update(train_metrics)

    if training_args.do_eval:
        logits, eval_metrics = document_logits("eval")
        gold = np.asarray(encoded["eval"]["labels"], dtype=np.float32 if kind != SINGLE_LABEL else np.int64)
        scores = compute_metrics(kind, logits, gold, data_args.multi_label_threshold, data_args.metric_name)
        eval_metrics.update({f"eval_{k}": v for k, v in scores.items()})
        eval_metrics.update(eval_samples=len(encoded["eval"]), eval_windows=len(features["eval"]))
        for name in ("eval", "train") if "train" in reports else ("eval",):
            eval_metrics[f"{name}_tokens_per_document"] = reports[name]["tokens_read"] / max(len(encoded[name]), 1)
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)  # eval_results.json
        metrics.update(eval_metrics)

    if training_args.do_predict:
        logits, _ = document_logits("predict")
        texts = prediction_texts(kind, logits, labels, data_args.multi_label_threshold)
        if trainer.is_world_process_zero():
            path = os.path.join(training_args.output_dir, "predict_results.txt")
            write_predictions(path, texts)
            logger.info("Wrote %d predictions to %s", len(texts), path)

    finish_run(trainer, run_args, model_args, data_args, kind)
    return metrics


def finish_run(trainer: Trainer, run_args: RunArguments, model_args: ModelArguments, data_args, kind: str) -> None:
    """The upload-ready output folder (:func:`~examples.utils_examples.finish_output_dir`): card data of the run."""
    from_hub = not data_args.uses_local_files
    finish_output_dir(
        trainer,
        run_args,
        trained=trainer.args.do_train,
        base_model=hub_model_id(model_args.model_name_or_path),
        summary=f"Fine-tuned from {model_origin(model_args.model_name_or_path)} for {kind.replace('_', ' ')} on "
        f"{'the Hub dataset `' + data_args.dataset_name + '`' if from_hub else 'local files'} with "
        "`examples/run_classification.py` of hf_xformers.",
        datasets=[data_args.dataset_name] if from_hub else None,
        dataset_name=data_args.dataset_name if from_hub else "local files",
        dataset_type=data_args.dataset_name if from_hub else "local",
        dataset_config=data_args.dataset_config_name,
        task_type="text-classification",
    )


if __name__ == "__main__":
    main()
