"""Fine-tune and evaluate a text model on a GLUE task with ``transformers.Trainer``.

Works with any hfx text model (``hfx-longformer`` ...) and any ``transformers`` model that
``AutoModelForSequenceClassification`` can load. Data come from the Hub dataset ``nyu-mll/glue`` or from local
csv/json files with the task's columns. Outputs, in ``--output_dir``:

* ``eval_results.json`` (``--do_eval``): the task's official metric(s), computed with scikit-learn/scipy (no
  ``evaluate.load``, which needs the Hub at run time); MNLI adds ``eval_mismatched_*``;
* ``<Task>.tsv`` (``--do_predict``): test predictions in the GLUE submission format (``CoLA.tsv``, ``SST-2.tsv``,
  ``MNLI-m.tsv``, ``MNLI-mm.tsv``, ``AX.tsv`` ... with ``index<TAB>prediction`` rows);
* the fine-tuned model, tokenizer, ``train_results.json`` and ``trainer_state.json`` (``--do_train``).

Examples (see examples/README.md)::

    python -m examples.run_glue --model_name_or_path path/to/model --task_name rte \\
        --do_train --do_eval --do_predict --max_seq_length 128 --output_dir out/rte
    python -m examples.run_glue --model_name_or_path path/to/model --task_name sst2 \\
        --train_file train.csv --validation_file dev.csv --do_train --do_eval --output_dir out/sst2
    torchrun --nproc_per_node=2 examples/run_glue.py ...   # same arguments, data-parallel

Training resumes from the last ``checkpoint-*`` in ``--output_dir`` (or ``--resume_from_checkpoint PATH``)
unless ``--overwrite_output_dir`` is given. ``--padding_free`` packs every batch into one row of unpadded examples
(hf_xformers models except hfx-linformer; each example is classified as on its own, so the results are the padded
run's).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import numpy as np
from datasets import Dataset, Value, load_dataset
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import hf_xformers  # noqa: F401  (registers the hfx-* model types with the Auto classes)
from examples.utils_examples import (
    RunArguments,
    check_world_size,
    finish_output_dir,
    hub_model_id,
    load_local_file,
    model_origin,
    packed_collator,
    parse_script_args,
    require_columns,
    resume_checkpoint,
    setup_logging,
    take,
)

logger = logging.getLogger("run_glue")


@dataclass(frozen=True)
class GlueTask:
    """What the script needs to know about one GLUE task.

    ``labels`` are the class names in the order of ``nyu-mll/glue``'s ``ClassLabel`` (empty for the STS-B
    regression); ``submission_labels`` are what the GLUE server expects in the prediction files (the raw
    GLUE files' label values: names for the NLI tasks, 0/1 elsewhere, WNLI included).
    """

    text_columns: tuple[str, ...]
    labels: tuple[str, ...]
    submission_labels: tuple[str, ...]
    submission_name: str
    metrics: tuple[str, ...]

    @property
    def is_regression(self) -> bool:
        return not self.labels


TASKS = {
    "cola": GlueTask(("sentence",), ("unacceptable", "acceptable"), ("0", "1"), "CoLA", ("matthews_correlation",)),
    "sst2": GlueTask(("sentence",), ("negative", "positive"), ("0", "1"), "SST-2", ("accuracy",)),
    "mrpc": GlueTask(
        ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), ("0", "1"), "MRPC", ("f1", "accuracy")
    ),
    "qqp": GlueTask(("question1", "question2"), ("not_duplicate", "duplicate"), ("0", "1"), "QQP", ("f1", "accuracy")),
    "stsb": GlueTask(("sentence1", "sentence2"), (), (), "STS-B", ("pearson", "spearmanr")),
    "mnli": GlueTask(
        ("premise", "hypothesis"),
        ("entailment", "neutral", "contradiction"),
        ("entailment", "neutral", "contradiction"),
        "MNLI-m",
        ("accuracy",),
    ),
    "qnli": GlueTask(
        ("question", "sentence"),
        ("entailment", "not_entailment"),
        ("entailment", "not_entailment"),
        "QNLI",
        ("accuracy",),
    ),
    "rte": GlueTask(
        ("sentence1", "sentence2"),
        ("entailment", "not_entailment"),
        ("entailment", "not_entailment"),
        "RTE",
        ("accuracy",),
    ),
    "wnli": GlueTask(("sentence1", "sentence2"), ("not_entailment", "entailment"), ("0", "1"), "WNLI", ("accuracy",)),
}
STSB_RANGE = (0.0, 5.0)  # similarity scores; predictions are clipped to it for submission


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
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={"help": "Re-initialise a classifier whose size differs from the task's number of labels."},
    )


@dataclass
class DataTrainingArguments:
    """Which task and data, and how to tokenize them."""

    task_name: str | None = field(default=None, metadata={"help": "One of: " + ", ".join(TASKS)})
    dataset_name: str = field(default="nyu-mll/glue", metadata={"help": "Hub dataset (when no local files are given)."})
    train_file: str | None = field(default=None, metadata={"help": "csv/json training file (task columns + label)."})
    validation_file: str | None = field(default=None, metadata={"help": "csv/json evaluation file (MNLI: matched)."})
    validation_mismatched_file: str | None = field(default=None, metadata={"help": "MNLI mismatched evaluation file."})
    test_file: str | None = field(
        default=None, metadata={"help": "csv/json test file (labels not needed; MNLI: matched)."}
    )
    test_mismatched_file: str | None = field(default=None, metadata={"help": "MNLI mismatched test file."})
    test_ax_file: str | None = field(default=None, metadata={"help": "MNLI only: the diagnostic (AX) test file."})
    max_seq_length: int = field(default=128, metadata={"help": "Longer inputs are truncated to this many tokens."})
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every input to max_seq_length (default: pad each batch to its longest)."}
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Pack every batch into one row of unpadded examples (hf_xformers models; not hfx-linformer): "
            "no compute is spent on padding, and each example is classified as on its own."
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation examples."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Use only the first N test examples."})

    def __post_init__(self) -> None:
        if self.task_name is None or self.task_name.lower() not in TASKS:
            raise ValueError(f"--task_name must be one of {list(TASKS)}, got {self.task_name!r}.")
        if self.padding_free and self.pad_to_max_length:
            raise ValueError("--padding_free packs unpadded examples: drop --pad_to_max_length.")
        self.task_name = self.task_name.lower()
        if self.task_name != "mnli":
            for name in ("validation_mismatched_file", "test_mismatched_file", "test_ax_file"):
                if getattr(self, name):
                    raise ValueError(f"--{name} is for MNLI only (task {self.task_name}).")

    @property
    def uses_local_files(self) -> bool:
        return any(
            (self.train_file, self.validation_file, self.validation_mismatched_file, self.test_file,
             self.test_mismatched_file, self.test_ax_file)
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def load_raw_splits(data_args: DataTrainingArguments, training_args: TrainingArguments, cache_dir: str | None):
    """The raw splits the run needs, as ``(train, {eval_name: Dataset}, {submission_name: Dataset})``.

    Evaluation names are the metric prefixes (``eval``, and ``eval_mismatched`` for MNLI); test names are the
    submission file stems (``MNLI-m``, ``MNLI-mm``, ``AX`` ...). Splits the run does not need are skipped.

    Raises:
        ValueError: a split that ``--do_train`` / ``--do_eval`` / ``--do_predict`` needs is missing.
    """
    task = TASKS[data_args.task_name]
    mnli = data_args.task_name == "mnli"

    def local(path: str | None) -> Dataset | None:
        return load_local_file(path, cache_dir) if path else None

    if data_args.uses_local_files:
        train = local(data_args.train_file) if training_args.do_train else None
        evaluation = {"eval": local(data_args.validation_file)}
        test = {task.submission_name: local(data_args.test_file)}
        if mnli:
            evaluation["eval_mismatched"] = local(data_args.validation_mismatched_file)
            test["MNLI-mm"] = local(data_args.test_mismatched_file)
            test["AX"] = local(data_args.test_ax_file)
    else:
        hub = load_dataset(data_args.dataset_name, data_args.task_name, cache_dir=cache_dir)
        train = hub["train"]
        if mnli:
            evaluation = {"eval": hub["validation_matched"], "eval_mismatched": hub["validation_mismatched"]}
            test = {"MNLI-m": hub["test_matched"], "MNLI-mm": hub["test_mismatched"]}
            if training_args.do_predict:  # the diagnostic set GLUE scores with the MNLI model
                test["AX"] = load_dataset(data_args.dataset_name, "ax", split="test", cache_dir=cache_dir)
        else:
            evaluation = {"eval": hub["validation"]}
            test = {task.submission_name: hub["test"]}

    # The first set of each kind is required by its --do_* flag; the extra MNLI sets are used when given.
    if training_args.do_train and train is None:
        raise ValueError("--do_train needs training data: pass --train_file (or no local files, to use the Hub).")
    if training_args.do_eval and evaluation["eval"] is None:
        raise ValueError("--do_eval needs evaluation data: pass --validation_file.")
    if training_args.do_predict and next(iter(test.values())) is None:
        raise ValueError("--do_predict needs test data: pass --test_file.")
    evaluation = {k: v for k, v in evaluation.items() if v is not None} if training_args.do_eval else {}
    test = {k: v for k, v in test.items() if v is not None} if training_args.do_predict else {}
    return (train if training_args.do_train else None), evaluation, test


def encode_labels(dataset: Dataset, task_name: str, source: str) -> Dataset:
    """Check the ``label`` column against the task and return it as class ids (floats for STS-B).

    Class labels may be given as ids (``0``, ``1`` ...) or as the task's names (``entailment`` ..., as in the
    raw GLUE files of MNLI, QNLI and RTE).

    Raises:
        ValueError: a label outside the task's label set (or, for STS-B, outside [0, 5]).
    """
    task = TASKS[task_name]
    values = dataset.unique("label")
    if task.is_regression:
        try:
            scores = [float(v) for v in values]
        except (TypeError, ValueError):
            raise ValueError(f"{source}: STS-B labels must be similarity scores in [0, 5], got {values[:5]}.") from None
        bad = [v for v in scores if not STSB_RANGE[0] <= v <= STSB_RANGE[1]]
        if bad:
            raise ValueError(f"{source}: STS-B labels must lie in [0, 5], got {sorted(bad)[:5]}.")
        return relabel(dataset, float, "float32")

    names = {name: i for i, name in enumerate(task.labels)}
    # ids 0..n-1, their string forms (csv files read as text), or the label names.
    allowed = {**names, **{i: i for i in range(len(task.labels))}, **{str(i): i for i in range(len(task.labels))}}
    bad = [v for v in values if v not in allowed or isinstance(v, bool)]
    if bad:
        raise ValueError(
            f"{source}: label(s) {bad[:5]} are not in the {task_name} label set; use ids 0..{len(task.labels) - 1} "
            f"or the names {list(task.labels)}."
        )
    return relabel(dataset, allowed.__getitem__, "int64")


def relabel(dataset: Dataset, convert, dtype: str) -> Dataset:
    """Apply ``convert`` to every label and store the column as ``dtype`` (``map`` alone would keep the old
    column type, e.g. strings)."""
    features = dataset.features.copy()
    features["label"] = Value(dtype)
    return dataset.map(lambda example: {"label": convert(example["label"])}, features=features, desc="labels")


def prepare(dataset: Dataset, task_name: str, source: str, with_labels: bool) -> Dataset:
    """Check a raw split's columns, encode its labels (when ``with_labels``) and drop what the model does not use."""
    task = TASKS[task_name]
    require_columns(dataset, list(task.text_columns) + (["label"] if with_labels else []), source)
    if with_labels:
        dataset = encode_labels(dataset, task_name, source)
    keep = list(task.text_columns) + (["label"] if with_labels else [])
    return dataset.select_columns(keep)


# ---------------------------------------------------------------------------------------------------------------
# Metrics and submission files
# ---------------------------------------------------------------------------------------------------------------


def predictions_from_logits(logits: np.ndarray | tuple, task_name: str) -> np.ndarray:
    """Class ids (argmax) for classification, the scalar output for STS-B. ``logits`` may be the tuple Trainer
    returns when the model has more outputs (hidden states ...); the logits come first."""
    logits = logits[0] if isinstance(logits, tuple) else logits
    return logits.reshape(-1) if TASKS[task_name].is_regression else np.argmax(logits, axis=-1)


def glue_metrics(task_name: str, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The task's official GLUE metric(s) from predicted class ids (or STS-B scores) and gold labels.

    CoLA: Matthews correlation; MRPC and QQP: F1 (of the positive class) and accuracy; STS-B: Pearson and
    Spearman correlations; the others: accuracy. Tasks with two metrics also get their mean,
    ``combined_score``, as the GLUE leaderboard averages them.
    """
    task = TASKS[task_name]
    results = {}
    for name in task.metrics:
        if name == "accuracy":
            results[name] = accuracy_score(labels, predictions)
        elif name == "f1":
            results[name] = f1_score(labels, predictions, zero_division=0.0)
        elif name == "matthews_correlation":
            results[name] = matthews_corrcoef(labels, predictions)
        elif name == "pearson":
            results[name] = pearsonr(predictions, labels)[0]
        elif name == "spearmanr":
            results[name] = spearmanr(predictions, labels)[0]
    results = {k: float(v) for k, v in results.items()}
    if len(results) > 1:
        results["combined_score"] = float(np.mean(list(results.values())))
    return results


def write_submission(path: str, task_name: str, indices, predictions: np.ndarray) -> None:
    """Write ``index<TAB>prediction`` rows with a header, the format the GLUE server reads.

    Class ids become the task's submission labels; STS-B scores are clipped to [0, 5] and written with three
    decimals.
    """
    task = TASKS[task_name]
    with open(path, "w") as f:
        f.write("index\tprediction\n")
        for index, value in zip(indices, predictions):
            if task.is_regression:
                text = f"{float(np.clip(value, *STSB_RANGE)):.3f}"
            else:
                text = task.submission_labels[int(value)]
            f.write(f"{index}\t{text}\n")


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    """``(ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments)`` from the command line
    (``argv``), or from a single ``.json`` file argument."""
    return parse_script_args((ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments), argv, __doc__)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the script; returns the training and evaluation metrics (also written to ``output_dir``)."""
    model_args, data_args, training_args, run_args = parse_args(argv)
    setup_logging(training_args, logger)
    check_world_size(training_args)
    logger.info(
        "Task %s, model %s, output in %s, %d process(es)",
        data_args.task_name,
        model_args.model_name_or_path,
        training_args.output_dir,
        training_args.world_size,
    )
    checkpoint = resume_checkpoint(training_args, run_args.overwrite_output_dir)
    set_seed(training_args.seed)
    task_name = data_args.task_name

    # Data: load, check columns and labels (a bad file fails here, before any model is loaded).
    train, evaluation, test, test_indices = load_splits(data_args, training_args, model_args.cache_dir)
    config, tokenizer, model = load_model(model_args, task_name)

    # A model that cannot take packed batches fails here, before the data are tokenized.
    if data_args.padding_free:
        collator = packed_collator(model, training_args, logger)
    elif data_args.pad_to_max_length:
        collator = default_data_collator
    else:
        collator = DataCollatorWithPadding(tokenizer)
    tokenized = tokenizer_of_splits(tokenizer, config, data_args, training_args)
    train = tokenized(train, "tokenizing training data") if train is not None else None
    evaluation = {name: tokenized(data, f"tokenizing {name}") for name, data in evaluation.items()}
    test = {name: tokenized(data, f"tokenizing {name}") for name, data in test.items()}

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        predictions = predictions_from_logits(prediction.predictions, task_name)
        return glue_metrics(task_name, predictions, prediction.label_ids)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation.get("eval"),
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
    )
    metrics = train_and_evaluate(trainer, training_args, checkpoint, train, evaluation)
    if training_args.do_predict:
        predict(trainer, training_args.output_dir, task_name, test, test_indices)
    finish(trainer, run_args, training_args, model_args, data_args)
    return metrics


def load_splits(data_args: DataTrainingArguments, training_args: TrainingArguments, cache_dir: str | None):
    """``(train, evaluation, test, test_indices)``: the task's splits loaded, cut to the ``--max_*_samples`` and
    checked (columns, labels); ``train`` is None without one, ``evaluation`` and ``test`` map split names to data,
    ``test_indices`` each test split's row ids (GLUE's ``idx``, or the row's position in a local file)."""
    task_name = data_args.task_name
    train, evaluation, test = load_raw_splits(data_args, training_args, cache_dir)
    if train is not None:
        train = prepare(take(train, data_args.max_train_samples), task_name, "training data", with_labels=True)
    evaluation = {
        name: prepare(take(data, data_args.max_eval_samples), task_name, f"evaluation data ({name})", with_labels=True)
        for name, data in evaluation.items()
    }
    test_indices = {}
    for name, data in list(test.items()):
        data = take(data, data_args.max_predict_samples)
        # GLUE test rows are identified by their `idx` (the Hub dataset has it); local files by their position.
        test_indices[name] = data["idx"] if "idx" in data.column_names else list(range(len(data)))
        test[name] = prepare(data, task_name, f"test data ({name})", with_labels=False)
    return train, evaluation, test, test_indices


def load_model(model_args: ModelArguments, task_name: str):
    """``(config, tokenizer, model)`` for the task. The task fixes the number of labels and their names, so
    predictions map back to label names; a model type without a sequence-classification head is refused."""
    task = TASKS[task_name]
    num_labels = 1 if task.is_regression else len(task.labels)
    label_kwargs = {}
    if not task.is_regression:
        label_kwargs = {"id2label": dict(enumerate(task.labels)), "label2id": {n: i for i, n in enumerate(task.labels)}}
    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        num_labels=num_labels,
        finetuning_task=task_name,
        problem_type="regression" if task.is_regression else "single_label_classification",
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
        **label_kwargs,
    )
    if type(config) not in AutoModelForSequenceClassification._model_mapping:
        # Checked before the tokenizer: loading one for, e.g., an image model fails with an unrelated message.
        raise ValueError(
            f"{model_args.config_name or model_args.model_name_or_path!r} holds a {config.model_type!r} model, which "
            "has no sequence-classification head: run_glue.py fine-tunes text models (hfx-longformer, hfx-bigbird, "
            "BERT, RoBERTa, ...). For an image model use examples/run_image_classification.py."
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
    return config, tokenizer, model


def tokenizer_of_splits(tokenizer, config, data_args: DataTrainingArguments, training_args: TrainingArguments):
    """``tokenized(data, desc)``: a split's text columns replaced by the model's inputs, cut at ``max_seq_length``
    (at most the tokenizer's ``model_max_length``). hfx-longformer and RoBERTa have a single segment
    (type_vocab_size 1): a BERT-style tokenizer would hand them segment ids 1 for the second sentence, which they
    cannot embed."""
    task = TASKS[data_args.task_name]
    max_length = data_args.max_seq_length
    if max_length > tokenizer.model_max_length:
        logger.warning(
            "max_seq_length %d exceeds the tokenizer's model_max_length %d; using the latter.",
            max_length,
            tokenizer.model_max_length,
        )
        max_length = tokenizer.model_max_length
    token_types = None if getattr(config, "type_vocab_size", 2) > 1 else False

    def tokenize(batch: dict) -> dict:
        texts = [batch[column] for column in task.text_columns]
        return tokenizer(
            *texts,
            truncation=True,
            max_length=max_length,
            padding="max_length" if data_args.pad_to_max_length else False,
            return_token_type_ids=token_types,
        )

    def tokenized(data: Dataset, desc: str) -> Dataset:
        # The main process tokenizes first and caches; torchrun replicas then read the cache.
        with training_args.main_process_first(desc=desc):
            return data.map(tokenize, batched=True, remove_columns=list(task.text_columns), desc=desc)

    return tokenized


def train_and_evaluate(
    trainer: Trainer, training_args: TrainingArguments, checkpoint: str | None, train, evaluation: dict
) -> dict[str, float]:
    """Train (``--do_train``, resuming from ``checkpoint``) and evaluate every evaluation split (``--do_eval``);
    returns the metrics, also written to ``output_dir`` (``train_results.json``, ``eval_results.json``)."""
    metrics: dict[str, float] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # model, config and tokenizer in output_dir
        train_metrics = {**result.metrics, "train_samples": len(train)}
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()  # trainer_state.json, with the logged losses
        metrics.update(train_metrics)

    if training_args.do_eval:
        # Every process evaluates (Trainer shards the set across them); only the main one writes files.
        eval_metrics = {}
        for name, data in evaluation.items():
            eval_metrics.update(trainer.evaluate(eval_dataset=data, metric_key_prefix=name))
            eval_metrics[f"{name}_samples"] = len(data)
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)  # eval_results.json
        metrics.update(eval_metrics)
    return metrics


def predict(trainer: Trainer, output_dir: str, task_name: str, test: dict, test_indices: dict) -> None:
    """Write each test split's predictions as a GLUE submission file ``<output_dir>/<split>.tsv``."""
    for name, data in test.items():
        output = trainer.predict(data, metric_key_prefix=f"predict_{name}")
        predictions = predictions_from_logits(output.predictions, task_name)
        if trainer.is_world_process_zero():
            path = os.path.join(output_dir, f"{name}.tsv")
            write_submission(path, task_name, test_indices[name], predictions)
            logger.info("Wrote %d test predictions to %s", len(predictions), path)


def finish(
    trainer: Trainer,
    run_args: RunArguments,
    training_args: TrainingArguments,
    model_args: ModelArguments,
    data_args: DataTrainingArguments,
) -> None:
    """An upload-ready output_dir: the model card (with --self_contained also the model code); --push_to_hub
    uploads it."""
    task_name = data_args.task_name
    from_hub = not data_args.uses_local_files
    finish_output_dir(
        trainer,
        run_args,
        trained=training_args.do_train,
        base_model=hub_model_id(model_args.model_name_or_path),
        summary=f"Fine-tuned from {model_origin(model_args.model_name_or_path)} on GLUE {task_name.upper()} "
        f"({'the Hub dataset `' + data_args.dataset_name + '`' if from_hub else 'local files'}) with "
        "`examples/run_glue.py` of hf_xformers.",
        datasets=[data_args.dataset_name] if from_hub else None,
        dataset_name=f"GLUE {task_name.upper()}",
        dataset_type=data_args.dataset_name if from_hub else "local",
        dataset_config=task_name,
        task_type="text-classification",
        eval_splits={
            "eval": "validation_matched" if task_name == "mnli" else "validation",
            "eval_mismatched": "validation_mismatched",
        },  # fmt: skip
    )


if __name__ == "__main__":
    main()
