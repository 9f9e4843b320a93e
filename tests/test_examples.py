"""End-to-end tests of examples/run_glue.py and examples/run_wikihop.py on tiny local data and tiny models.

Everything is offline: the models are built here and saved to temporary folders, the data are small csv/json
files (GLUE rows written by the tests, WikiHop examples in tests/fixtures/wikihop/). The scripts run in-process
through their ``main(argv)``, except the two-process case, which goes through ``torchrun``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
from transformers import AutoTokenizer, RobertaConfig, RobertaModel, TrainingArguments
from transformers.training_args import ParallelMode

import hf_xformers
from examples import run_clm, run_glue, run_image_classification, run_mlm, run_wikihop, utils_examples
from tests.tiny_tokenizers import SENTENCES, roberta_tokenizer

REPO = Path(__file__).resolve().parents[1]
WIKIHOP = Path(__file__).resolve().parent / "fixtures" / "wikihop"

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=130,
    # No dropout: the one- and two-process runs must compute the same first loss.
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


# ---------------------------------------------------------------------------------------------------------------
# Tiny models and data
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory) -> Path:
    """A tiny transformers RoBERTa base model: run_glue loads it as RobertaForSequenceClassification."""
    path = tmp_path_factory.mktemp("roberta")
    tokenizer = roberta_tokenizer()
    torch.manual_seed(0)
    RobertaModel(RobertaConfig(vocab_size=len(tokenizer), type_vocab_size=1, **TINY)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """datasets cache for the local files (kept out of the user's ~/.cache)."""
    return tmp_path_factory.mktemp("hf_cache")


def glue_rows(task: str, n: int, labels: str | None = "ids", idx: bool = False) -> list[dict]:
    """``n`` rows with ``task``'s text columns; ``labels`` as ``"ids"``, ``"names"`` or None (test sets)."""
    spec = run_glue.TASKS[task]
    rows = []
    for i in range(n):
        row = {column: SENTENCES[(i + j) % len(SENTENCES)] for j, column in enumerate(spec.text_columns)}
        if labels and spec.is_regression:
            row["label"] = round(5.0 * i / max(n - 1, 1), 2)
        elif labels:
            label = i % len(spec.labels)
            row["label"] = spec.labels[label] if labels == "names" else label
        if idx:
            row["idx"] = 100 + i
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict]) -> str:
    """Write ``rows`` as csv or JSON lines, by ``path``'s extension."""
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def run_args(model: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    """Arguments shared by the tiny runs: 2 steps of 4 examples, a log line per step, no checkpoints."""
    return [
        "--model_name_or_path", str(model), "--output_dir", str(out), "--cache_dir", str(cache),
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
        "--logging_steps", "1", "--save_strategy", "no", "--seed", "0", *extra,
    ]  # fmt: skip


def with_option(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced."""
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def read_tsv(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def torchrun(module: str, args: list[str]) -> None:
    """Run an example script (``examples.<name>``, from the repository root) in 2 CPU processes; fail with its
    stderr if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("ACCELERATE_USE_CPU", None)  # the script must find out by itself that there is no GPU
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(
        command + ["-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-4000:]


def first_logged_loss(out: Path) -> float:
    state = json.loads((out / "trainer_state.json").read_text())
    return next(entry["loss"] for entry in state["log_history"] if "loss" in entry)


# ---------------------------------------------------------------------------------------------------------------
# run_glue: metrics and submission format
# ---------------------------------------------------------------------------------------------------------------


def test_glue_metrics_are_the_official_ones():
    labels = np.array([1, 0, 1, 1, 0, 1])
    predicted = np.array([1, 0, 0, 1, 1, 1])
    # CoLA: Matthews correlation (tp=3 tn=1 fp=1 fn=1).
    mcc = (3 * 1 - 1 * 1) / math.sqrt(4 * 4 * 2 * 2)
    assert run_glue.glue_metrics("cola", predicted, labels) == pytest.approx({"matthews_correlation": mcc})
    # MRPC / QQP: F1 of the positive class and accuracy, and their mean.
    mrpc = run_glue.glue_metrics("mrpc", predicted, labels)
    assert mrpc == pytest.approx({"f1": 0.75, "accuracy": 4 / 6, "combined_score": (0.75 + 4 / 6) / 2})
    assert run_glue.glue_metrics("rte", predicted, labels) == pytest.approx({"accuracy": 4 / 6})
    # MNLI: accuracy over three classes.
    assert run_glue.glue_metrics("mnli", np.array([0, 1, 2, 2]), np.array([0, 1, 2, 0]))["accuracy"] == 0.75
    # STS-B: Pearson and Spearman correlations of the predicted scores.
    gold = np.array([0.0, 1.0, 2.5, 4.0, 5.0])
    scores = np.array([0.5, 0.7, 3.0, 3.5, 4.9])
    stsb = run_glue.glue_metrics("stsb", scores, gold)
    assert stsb["pearson"] == pytest.approx(np.corrcoef(scores, gold)[0, 1])
    assert stsb["spearmanr"] == pytest.approx(1.0)
    assert stsb["combined_score"] == pytest.approx((stsb["pearson"] + 1.0) / 2)
    # Logits -> predictions: argmax for classes, the scalar for the regression.
    assert run_glue.predictions_from_logits(np.array([[0.1, 0.9], [2.0, -1.0]]), "rte").tolist() == [1, 0]
    assert run_glue.predictions_from_logits(np.array([[1.5], [7.0]]), "stsb").tolist() == [1.5, 7.0]


SUBMISSION = {  # task: (file, what class ids 0, 1, 2 are written as)
    "cola": ("CoLA.tsv", ["0", "1"]),
    "sst2": ("SST-2.tsv", ["0", "1"]),
    "mrpc": ("MRPC.tsv", ["0", "1"]),
    "qqp": ("QQP.tsv", ["0", "1"]),
    "mnli": ("MNLI-m.tsv", ["entailment", "neutral", "contradiction"]),
    "qnli": ("QNLI.tsv", ["entailment", "not_entailment"]),
    "rte": ("RTE.tsv", ["entailment", "not_entailment"]),
    "wnli": ("WNLI.tsv", ["0", "1"]),  # the raw WNLI files, and so the GLUE server, use 0/1
}


@pytest.mark.parametrize("task", sorted(SUBMISSION))
def test_glue_submission_format_classification(task, tmp_path):
    name, written = SUBMISSION[task]
    assert run_glue.TASKS[task].submission_name + ".tsv" == name
    path = tmp_path / name
    ids = list(range(len(written)))
    run_glue.write_submission(str(path), task, [7 + i for i in ids], np.array(ids))
    assert read_tsv(path) == [["index", "prediction"]] + [[str(7 + i), label] for i, label in zip(ids, written)]


def test_glue_submission_format_stsb_clips_scores(tmp_path):
    path = tmp_path / "STS-B.tsv"
    run_glue.write_submission(str(path), "stsb", [0, 1, 2], np.array([-0.4, 2.345678, 6.2]))
    assert read_tsv(path) == [["index", "prediction"], ["0", "0.000"], ["1", "2.346"], ["2", "5.000"]]


# ---------------------------------------------------------------------------------------------------------------
# run_glue: end to end
# ---------------------------------------------------------------------------------------------------------------


def test_run_glue_hfx_longformer_train_eval_predict(longformer_dir, cache_dir, tmp_path):
    """RTE from csv files with label names: train -> evaluate -> eval_results.json -> RTE.tsv."""
    train = write_rows(tmp_path / "train.csv", glue_rows("rte", 8, labels="names"))
    dev = write_rows(tmp_path / "dev.csv", glue_rows("rte", 6, labels="names"))
    test = write_rows(tmp_path / "test.csv", glue_rows("rte", 5, labels=None))
    out = tmp_path / "out"
    metrics = run_glue.main(
        run_args(longformer_dir, out, cache_dir, "--task_name", "RTE", "--do_train", "--do_eval", "--do_predict")
        + ["--train_file", train, "--validation_file", dev, "--test_file", test, "--max_seq_length", "48"]
    )
    results = json.loads((out / "eval_results.json").read_text())
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and results["eval_samples"] == 6
    assert results["eval_accuracy"] == metrics["eval_accuracy"]
    assert json.loads((out / "train_results.json").read_text())["train_samples"] == 8
    assert json.loads((out / "config.json").read_text())["model_type"] == "hfx-longformer"
    assert math.isfinite(first_logged_loss(out))
    rows = read_tsv(out / "RTE.tsv")
    assert rows[0] == ["index", "prediction"] and [r[0] for r in rows[1:]] == ["0", "1", "2", "3", "4"]
    assert {r[1] for r in rows[1:]} <= {"entailment", "not_entailment"}


def test_run_glue_mnli_matched_and_mismatched(longformer_dir, cache_dir, tmp_path):
    """MNLI from json files: evaluated on matched and mismatched sets; MNLI-m, MNLI-mm and AX predictions."""
    files = {}
    for flag, rows in (
        ("--train_file", glue_rows("mnli", 6)),
        ("--validation_file", glue_rows("mnli", 6, labels="names")),
        ("--validation_mismatched_file", glue_rows("mnli", 3)),
        ("--test_file", glue_rows("mnli", 4, labels=None, idx=True)),
        ("--test_mismatched_file", glue_rows("mnli", 2, labels=None, idx=True)),
        ("--test_ax_file", glue_rows("mnli", 3, labels=None)),
    ):
        files[flag] = write_rows(tmp_path / (flag.strip("-") + ".json"), rows)
    out = tmp_path / "out"
    extra = [item for pair in files.items() for item in pair]
    run_glue.main(
        run_args(
            longformer_dir, out, cache_dir, "--task_name", "mnli", "--do_train", "--do_eval", "--do_predict", *extra
        )
    )
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_samples"] == 6 and results["eval_mismatched_samples"] == 3
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and 0.0 <= results["eval_mismatched_accuracy"] <= 1.0
    labels = {"entailment", "neutral", "contradiction"}
    for name, indices in (
        ("MNLI-m", ["100", "101", "102", "103"]),
        ("MNLI-mm", ["100", "101"]),
        ("AX", ["0", "1", "2"]),
    ):
        rows = read_tsv(out / f"{name}.tsv")
        assert [r[0] for r in rows[1:]] == indices  # the `idx` column when the test file has one
        assert {r[1] for r in rows[1:]} <= labels


def test_run_glue_hub_dataset_layout(longformer_dir, cache_dir, tmp_path, monkeypatch):
    """Without local files the script reads nyu-mll/glue: its split names, ClassLabel labels, -1 test labels and
    `idx` column, and the separate `ax` config for MNLI (the Hub is replaced by an in-memory copy of that layout)."""
    labels = ClassLabel(names=list(run_glue.TASKS["mnli"].labels))

    def hub_split(n: int, test: bool = False) -> Dataset:
        rows = glue_rows("mnli", n, idx=True)
        if test:
            rows = [{**row, "label": -1} for row in rows]
        features = Features(premise=Value("string"), hypothesis=Value("string"), label=labels, idx=Value("int32"))
        return Dataset.from_list(rows, features=features)

    calls = []

    def fake_load_dataset(name, config, split=None, cache_dir=None):
        calls.append((name, config, split))
        if config == "ax":
            return Dataset.from_list(glue_rows("mnli", 2, labels=None, idx=True))
        return DatasetDict(
            train=hub_split(4), validation_matched=hub_split(3), validation_mismatched=hub_split(2),
            test_matched=hub_split(3, test=True), test_mismatched=hub_split(2, test=True),
        )  # fmt: skip

    monkeypatch.setattr(run_glue, "load_dataset", fake_load_dataset)
    out = tmp_path / "out"
    run_glue.main(run_args(longformer_dir, out, cache_dir, "--task_name", "mnli", "--do_eval", "--do_predict"))
    assert calls == [("nyu-mll/glue", "mnli", None), ("nyu-mll/glue", "ax", "test")]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_samples"] == 3 and results["eval_mismatched_samples"] == 2
    assert [r[0] for r in read_tsv(out / "MNLI-m.tsv")[1:]] == ["100", "101", "102"]
    assert [r[0] for r in read_tsv(out / "MNLI-mm.tsv")[1:]] == ["100", "101"]
    assert len(read_tsv(out / "AX.tsv")) == 3


def test_run_glue_stsb_regression(longformer_dir, cache_dir, tmp_path):
    train = write_rows(tmp_path / "train.json", glue_rows("stsb", 8))
    dev = write_rows(tmp_path / "dev.json", glue_rows("stsb", 6))
    test = write_rows(tmp_path / "test.json", glue_rows("stsb", 3, labels=None))
    out = tmp_path / "out"
    run_glue.main(
        run_args(longformer_dir, out, cache_dir, "--task_name", "stsb", "--do_train", "--do_eval", "--do_predict")
        + ["--train_file", train, "--validation_file", dev, "--test_file", test]
    )
    config = json.loads((out / "config.json").read_text())
    assert len(config["id2label"]) == 1 and config["problem_type"] == "regression"
    results = json.loads((out / "eval_results.json").read_text())
    assert {"eval_pearson", "eval_spearmanr", "eval_combined_score"} <= set(results)
    assert all(0.0 <= float(r[1]) <= 5.0 for r in read_tsv(out / "STS-B.tsv")[1:])


def test_run_glue_any_transformers_model(roberta_dir, cache_dir, tmp_path):
    """A plain transformers RoBERTa through AutoModelForSequenceClassification, CoLA (Matthews correlation)."""
    train = write_rows(tmp_path / "train.csv", glue_rows("cola", 8))
    dev = write_rows(tmp_path / "dev.csv", glue_rows("cola", 6))
    out = tmp_path / "out"
    run_glue.main(
        run_args(roberta_dir, out, cache_dir, "--task_name", "cola", "--do_train", "--do_eval")
        + ["--train_file", train, "--validation_file", dev]
    )
    assert json.loads((out / "config.json").read_text())["architectures"] == ["RobertaForSequenceClassification"]
    results = json.loads((out / "eval_results.json").read_text())
    assert -1.0 <= results["eval_matthews_correlation"] <= 1.0


def test_run_glue_resumes_from_checkpoints(longformer_dir, cache_dir, tmp_path, capsys):
    train = write_rows(tmp_path / "train.csv", glue_rows("sst2", 8))
    out = tmp_path / "out"

    def run(*extra: str) -> None:
        args = run_args(longformer_dir, out, cache_dir, "--task_name", "sst2", "--do_train", "--train_file", train)
        run_glue.main(with_option(args, "--save_strategy", "steps") + ["--save_steps", "1", *extra])

    def written(step: int) -> int:
        return (out / f"checkpoint-{step}" / "model.safetensors").stat().st_mtime_ns

    run()
    first = json.loads((out / "trainer_state.json").read_text())["log_history"]
    first_written = {step: written(step) for step in (1, 2)}
    capsys.readouterr()

    # A longer run into the same output_dir continues from checkpoint-2 instead of starting over.
    run("--max_steps", "3")
    assert f"Resuming training from {out / 'checkpoint-2'}" in capsys.readouterr().out
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and (out / "checkpoint-3").is_dir()
    assert state["log_history"][:2] == first[:2]  # steps 1-2 come from the checkpoint
    assert {step: written(step) for step in (1, 2)} == first_written  # not retrained

    # An explicit checkpoint wins over the last one: steps 2-3 are trained again, step 1 is not.
    run("--max_steps", "3", "--resume_from_checkpoint", str(out / "checkpoint-1"))
    assert f"Resuming training from {out / 'checkpoint-1'}" in capsys.readouterr().out
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    assert written(1) == first_written[1] and written(2) != first_written[2]
    # --overwrite_output_dir starts from scratch.
    run("--overwrite_output_dir")
    assert "Resuming" not in capsys.readouterr().out
    assert written(1) != first_written[1]


@pytest.mark.parametrize(
    "task, rows, match",
    [
        ("rte", [{"sentence1": "a", "label": 0}], r"lacks the column\(s\) \['sentence2'\]"),
        ("sst2", [{"sentence": "a"}], r"lacks the column\(s\) \['label'\]"),
        ("rte", [{"sentence1": "a", "sentence2": "b", "label": "maybe"}], "not in the rte label set"),
        ("sst2", [{"sentence": "a", "label": 2}], "not in the sst2 label set"),
        ("mnli", [{"premise": "a", "hypothesis": "b", "label": -1}], "not in the mnli label set"),
        ("stsb", [{"sentence1": "a", "sentence2": "b", "label": 7.5}], r"STS-B labels must lie in \[0, 5\]"),
    ],
)
def test_run_glue_clear_errors(task, rows, match, longformer_dir, cache_dir, tmp_path):
    train = write_rows(tmp_path / "train.json", rows)
    with pytest.raises(ValueError, match=match):
        run_glue.main(
            run_args(
                longformer_dir, tmp_path / "out", cache_dir, "--task_name", task, "--do_train", "--train_file", train
            )
        )


def test_run_glue_argument_errors(longformer_dir, cache_dir, tmp_path, capsys):
    # Options the argument dataclasses refuse end the script with a one-line usage error (exit status 2).
    for task in ([], ["--task_name", "glue"]):  # none given, an unknown one
        with pytest.raises(SystemExit) as exited:
            run_glue.main(["--model_name_or_path", str(longformer_dir), "--output_dir", str(tmp_path), *task])
        error = capsys.readouterr().err
        assert exited.value.code == 2 and "error: --task_name must be one of" in error and "Traceback" not in error
    with pytest.raises(SystemExit) as exited:
        run_glue.main(
            run_args(longformer_dir, tmp_path, cache_dir, "--task_name", "rte", "--validation_mismatched_file", "x.csv")
        )
    assert exited.value.code == 2 and "--validation_mismatched_file is for MNLI only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--do_eval needs evaluation data"):
        train = write_rows(tmp_path / "train.csv", glue_rows("rte", 4))
        run_glue.main(
            run_args(longformer_dir, tmp_path, cache_dir, "--task_name", "rte", "--do_eval", "--train_file", train)
        )


def test_run_glue_on_an_image_model_says_so(cache_dir, tmp_path):
    swin = tmp_path / "swin"
    config = hf_xformers.HfxSwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2], num_heads=[2],
                                       window_size=4)  # fmt: skip
    hf_xformers.HfxSwinForImageClassification(config).save_pretrained(swin)
    train = write_rows(tmp_path / "train.csv", glue_rows("rte", 4))
    with pytest.raises(ValueError, match="'hfx-swin' model.*no sequence-classification head.*run_image_classification"):
        run_glue.main(run_args(swin, tmp_path / "out", cache_dir, "--task_name", "rte", "--do_train", "--train_file",
                               train))  # fmt: skip


def test_run_glue_torchrun_two_processes_same_loss(longformer_dir, cache_dir, tmp_path):
    """DDP on CPU (gloo): the logged first loss equals the single-process one, not world_size times it.

    STS-B (MSE) makes the loss depend strongly on which examples a step sees. The training set is one global
    batch (4 rows: 2 per process, or 4 in one process), so the first step sees the same examples either way;
    processes that silently trained alone would see 2 rows each and log another loss and half an epoch.
    """
    train = write_rows(tmp_path / "train.csv", glue_rows("stsb", 4))
    dev = write_rows(tmp_path / "dev.csv", glue_rows("stsb", 4))

    def args(out: Path, per_device: str) -> list[str]:
        args = run_args(longformer_dir, out, cache_dir, "--task_name", "stsb", "--do_train", "--do_eval")
        return with_option(args, "--per_device_train_batch_size", per_device) + [
            "--train_file", train, "--validation_file", dev, "--max_steps", "1", "--disable_tqdm", "true",
        ]  # fmt: skip

    single = tmp_path / "single"
    run_glue.main(args(single, "4"))

    double = tmp_path / "double"
    torchrun("examples.run_glue", args(double, "2"))
    state = json.loads((double / "trainer_state.json").read_text())
    assert state["epoch"] == 1.0 and state["global_step"] == 1  # 2 processes x 2 rows = the whole set
    assert "eval_pearson" in json.loads((double / "eval_results.json").read_text())
    one, two = first_logged_loss(single), first_logged_loss(double)
    assert one > 1.0  # MSE against scores spread over [0, 5]
    assert two == pytest.approx(one, rel=1e-3), f"2-process loss {two} vs 1-process {one}"


def test_torchrun_without_gpus_uses_cpu_processes(monkeypatch, tmp_path):
    """accelerate builds a CPU process group only when asked for the CPU (and TrainingArguments refuses --bf16
    without a GPU unless asked): the scripts ask on a machine without an accelerator, unless the command line says
    otherwise, and refuse to run with processes left out."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert utils_examples.cpu_argv(["--bf16"]) == ["--bf16"]  # GPUs: accelerate picks them up by itself
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert utils_examples.cpu_argv(["--bf16"]) == ["--bf16", "--use_cpu"]
    assert utils_examples.cpu_argv(["--use_cpu", "false"]) == ["--use_cpu", "false"]  # the user's word stands
    assert utils_examples.cpu_argv(["--use-cpu=true"]) == ["--use-cpu=true"]
    # A single .json arguments file gets the same default.
    options = tmp_path / "args.json"
    options.write_text(json.dumps({"output_dir": str(tmp_path), "bf16": True}))
    (training_args,) = utils_examples.parse_script_args((TrainingArguments,), [str(options)])
    assert training_args.use_cpu and training_args.bf16
    alone = SimpleNamespace(world_size=1, parallel_mode=ParallelMode.NOT_PARALLEL)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="2 processes were launched but Trainer set up 1"):
        utils_examples.check_world_size(alone)
    utils_examples.check_world_size(SimpleNamespace(world_size=2, parallel_mode=ParallelMode.DISTRIBUTED))


@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a machine without an accelerator does")
@pytest.mark.parametrize(
    ("script", "required"),
    [
        pytest.param(run_glue, ["--model_name_or_path", "unused", "--task_name", "sst2"], id="run_glue"),
        pytest.param(run_wikihop, ["--model_name_or_path", "unused"], id="run_wikihop"),
        pytest.param(run_mlm, ["--model_name_or_path", "unused"], id="run_mlm"),
        pytest.param(run_clm, ["--train_file", "unused.txt"], id="run_clm"),
        pytest.param(run_image_classification, [], id="run_image_classification"),
    ],
)
def test_bf16_without_use_cpu_parses_on_a_cpu(script, required, tmp_path):
    """Every Trainer script takes --bf16 as the README shows it, without --use_cpu, on a machine without a GPU
    (TrainingArguments alone refuses it: "Your setup doesn't support bf16/gpu ...")."""
    model = tmp_path / "model"  # the scripts check at parse time that the model folder exists
    model.mkdir()
    (model / "config.json").write_text("{}")
    required = [str(model) if arg == "unused" else arg for arg in required]
    parsed = script.parse_args([*required, "--output_dir", str(tmp_path / "out"), "--bf16"])
    (training_args,) = [args for args in parsed if isinstance(args, TrainingArguments)]
    assert training_args.bf16 and training_args.use_cpu and training_args.device.type == "cpu"


@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a machine without an accelerator does")
def test_run_glue_trains_in_bf16_on_a_cpu(longformer_dir, cache_dir, tmp_path):
    """`python -m examples.run_glue ... --bf16` as a new user types it on a laptop: it trains (bf16 autocast on
    the CPU) and evaluates, with no --use_cpu on the command line."""
    train = write_rows(tmp_path / "train.csv", glue_rows("sst2", 8))
    dev = write_rows(tmp_path / "dev.csv", glue_rows("sst2", 4))
    out = tmp_path / "out"
    args = run_args(longformer_dir, out, cache_dir, "--task_name", "sst2", "--do_train", "--do_eval", "--bf16")
    metrics = run_glue.main(args + ["--train_file", train, "--validation_file", dev, "--max_seq_length", "32"])
    assert math.isfinite(first_logged_loss(out)) and 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert json.loads((out / "hfx_card_data.json").read_text())["hyperparameters"]["mixed_precision"] == "bf16"


# ---------------------------------------------------------------------------------------------------------------
# run_wikihop
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wikihop_tokenizer(longformer_dir):
    tokenizer = AutoTokenizer.from_pretrained(longformer_dir)
    tokenizer.add_tokens([*run_wikihop.QUESTION_MARKERS, *run_wikihop.CANDIDATE_MARKERS], special_tokens=True)
    return tokenizer


def wikihop_examples(split: str = "train") -> list[dict]:
    return json.loads((WIKIHOP / f"{split}.json").read_text())


def as_batch(examples: list[dict]) -> dict[str, list]:
    return {key: [example[key] for example in examples] for key in examples[0]}


def test_wikihop_featurize_chunks_and_spans(wikihop_tokenizer):
    tok = wikihop_tokenizer
    examples = wikihop_examples()
    features = run_wikihop.featurize(as_batch(examples), tok, max_length=128, max_chunks=None)
    q_open, q_close, c_open, c_close = tok.convert_tokens_to_ids(["[q]", "[/q]", "[ent]", "[/ent]"])
    for i, example in enumerate(examples):
        chunks, prefix = features["input_ids"][i], features["prefix_length"][i]
        assert features["label"][i] == example["candidates"].index(example["answer"])
        # Every chunk: the same question+candidates prefix, then the next slice of the supports.
        assert all(len(chunk) <= 128 and chunk[:prefix] == chunks[0][:prefix] for chunk in chunks)
        head = chunks[0][:prefix]
        assert head[:2] == [tok.cls_token_id, q_open] and head[-1] == tok.sep_token_id
        context = [token for chunk in chunks for token in chunk[prefix:]]
        assert context.count(tok.sep_token_id) == len(example["supports"])  # each support ends with </s>
        expected = tok(" " + example["supports"][0].strip(), add_special_tokens=False)["input_ids"]
        assert context[: len(expected)] == expected
        # Each span covers [ent] candidate [/ent].
        spans = features["candidate_spans"][i]
        assert len(spans) == len(example["candidates"])
        for (start, end), candidate in zip(spans, example["candidates"]):
            assert head[start] == c_open and head[end - 1] == c_close
            assert tok.decode(head[start + 1 : end - 1]).strip() == candidate
    assert max(len(c) for c in features["input_ids"]) > 3  # the fixture has long documents
    capped = run_wikihop.featurize(as_batch(examples), tok, max_length=128, max_chunks=2)
    assert max(len(c) for c in capped["input_ids"]) == 2


def test_wikihop_collator_pads_chunks_tokens_and_candidates(wikihop_tokenizer):
    examples = wikihop_examples()[2:4]  # 2 and 5 candidates, different numbers of chunks
    features = run_wikihop.featurize(as_batch(examples), wikihop_tokenizer, max_length=128, max_chunks=None)
    rows = [{key: features[key][i] for key in features} for i in range(2)]
    batch = run_wikihop.WikiHopCollator(wikihop_tokenizer.pad_token_id)(rows)
    chunks = [len(r["input_ids"]) for r in rows]
    assert batch["input_ids"].shape[:2] == (2, max(chunks)) and batch["candidate_spans"].shape == (2, 5, 2)
    assert batch["chunk_mask"].sum(1).tolist() == chunks
    assert batch["candidate_mask"].sum(1).tolist() == [2, 5]
    assert batch["labels"].tolist() == [1, 0]
    for b, row in enumerate(rows):
        globals_ = batch["global_attention_mask"][b, : chunks[b]]
        assert (globals_.sum(-1) == row["prefix_length"]).all()
        assert batch["attention_mask"][b, : chunks[b]].sum().item() == sum(len(c) for c in row["input_ids"])
    assert (batch["input_ids"][batch["attention_mask"] == 0] == wikihop_tokenizer.pad_token_id).all()


def test_wikihop_model_averages_chunks_and_uses_global_attention(longformer_dir, roberta_dir, wikihop_tokenizer):
    tok = wikihop_tokenizer
    model = run_wikihop.WikiHopModel.from_pretrained(str(longformer_dir))
    model.encoder.resize_token_embeddings(len(tok))
    model.eval()
    assert model.accepts_loss_kwargs is False and model.uses_global_attention and model.encoder.pooler is None
    example = wikihop_examples("dev")[1]  # 2 candidates, several chunks
    features = run_wikihop.featurize(as_batch([example]), tok, max_length=96, max_chunks=None)
    row = {key: features[key][0] for key in features}
    assert len(row["input_ids"]) >= 2
    collate = run_wikihop.WikiHopCollator(tok.pad_token_id)
    with torch.no_grad():
        whole = model(**collate([row]))
        per_chunk = [model(**collate([{**row, "input_ids": [chunk]}])).logits for chunk in row["input_ids"]]
        assert torch.allclose(whole.logits, torch.stack(per_chunk).mean(0), atol=1e-5)
        assert whole.loss == pytest.approx(torch.nn.functional.cross_entropy(whole.logits, torch.tensor([0])).item())
        # Padding candidates never win, and the global mask reaches the encoder.
        padded = collate([row, {**row, "candidate_spans": row["candidate_spans"] * 3}])
        assert padded["candidate_mask"][0].tolist() == [1, 1, 0, 0, 0, 0]
        assert (model(**padded).logits[0, 2:] == torch.finfo(torch.float32).min).all()
        batch = collate([row])
        no_globals = model(**{**batch, "global_attention_mask": torch.zeros_like(batch["global_attention_mask"])})
        assert not torch.allclose(no_globals.logits, whole.logits)

    # A model without global attention (transformers' RoBERTa) gets no global_attention_mask.
    roberta = run_wikihop.WikiHopModel.from_pretrained(str(roberta_dir))
    roberta.encoder.resize_token_embeddings(len(tok))
    assert not roberta.uses_global_attention
    with torch.no_grad():
        assert roberta(**collate([row])).logits.shape == (1, 2)


def test_run_wikihop_train_eval_and_reload(longformer_dir, cache_dir, tmp_path):
    out = tmp_path / "out"
    args = with_option(
        run_args(longformer_dir, out, cache_dir, "--do_train", "--do_eval"), "--per_device_train_batch_size", "2"
    )
    args += ["--train_file", str(WIKIHOP / "train.json"), "--validation_file", str(WIKIHOP / "dev.json")]
    metrics = run_wikihop.main(args + ["--activation_checkpointing"])  # reaches the encoder through the wrapper
    results = json.loads((out / "eval_results.json").read_text())
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and results["eval_samples"] == 4
    assert math.isfinite(first_logged_loss(out))
    assert (out / run_wikihop.HEAD_FILE).is_file()
    assert "[ent]" in AutoTokenizer.from_pretrained(out).get_vocab()

    # The output folder is a model this script (and AutoModel) loads back: same predictions.
    again = run_wikihop.main(
        ["--model_name_or_path", str(out), "--output_dir", str(tmp_path / "eval"), "--cache_dir", str(cache_dir)]
        + ["--do_eval", "--validation_file", str(WIKIHOP / "dev.json"), "--per_device_eval_batch_size", "4"]
    )
    assert again["eval_accuracy"] == metrics["eval_accuracy"]
    assert again["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-4)


def test_run_wikihop_resumes_from_last_checkpoint(longformer_dir, cache_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = run_args(longformer_dir, out, cache_dir, "--do_train", "--train_file", str(WIKIHOP / "train.json"))
    args = with_option(with_option(args, "--save_strategy", "steps"), "--per_device_train_batch_size", "2")
    args += ["--save_steps", "1", "--max_chunks_per_example", "2"]
    run_wikihop.main(args)
    first = json.loads((out / "trainer_state.json").read_text())["log_history"]
    capsys.readouterr()
    run_wikihop.main(args + ["--max_steps", "3"])
    assert f"Resuming training from {out / 'checkpoint-2'}" in capsys.readouterr().out
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["log_history"][:2] == first[:2]


def test_run_wikihop_torchrun_two_processes_same_loss(longformer_dir, cache_dir, tmp_path):
    """The WikiHop wrapper under DDP: the first loss over the same 2 examples (1 per process, or 2 in one) matches
    the single-process one (the wrapper sets accepts_loss_kwargs = False), and every parameter gets a gradient."""

    def args(out: Path, per_device: str) -> list[str]:
        args = run_args(longformer_dir, out, cache_dir, "--do_train", "--train_file", str(WIKIHOP / "train.json"))
        return with_option(args, "--per_device_train_batch_size", per_device) + [
            "--max_train_samples", "2", "--max_steps", "1", "--disable_tqdm", "true",
        ]  # fmt: skip

    run_wikihop.main(args(tmp_path / "single", "2"))
    torchrun("examples.run_wikihop", args(tmp_path / "double", "1"))
    assert json.loads((tmp_path / "double" / "trainer_state.json").read_text())["epoch"] == 1.0
    one, two = first_logged_loss(tmp_path / "single"), first_logged_loss(tmp_path / "double")
    assert two == pytest.approx(one, rel=1e-3), f"2-process loss {two} vs 1-process {one}"


@pytest.mark.parametrize(
    "change, match",
    [
        pytest.param(lambda ex: ex.pop("supports"), r"lacks the column\(s\) \['supports'\]", id="missing-column"),
        pytest.param(
            lambda ex: ex.update(answer="atlantis"), "is not among its candidates", id="answer-not-a-candidate"
        ),
        pytest.param(lambda ex: ex.update(candidates=[]), "has no candidates", id="no-candidates"),
    ],
)
def test_run_wikihop_clear_errors(change, match, longformer_dir, cache_dir, tmp_path):
    examples = wikihop_examples()
    for example in examples:
        change(example)
    path = tmp_path / "train.json"
    path.write_text(json.dumps(examples))
    with pytest.raises(ValueError, match=match):
        run_wikihop.main(run_args(longformer_dir, tmp_path / "out", cache_dir, "--do_train", "--train_file", str(path)))


def test_run_wikihop_prefix_longer_than_the_model(longformer_dir, cache_dir, tmp_path):
    examples = wikihop_examples()
    examples[0]["candidates"] = [f"candidate number {i} with a long name" for i in range(12)]
    examples[0]["answer"] = examples[0]["candidates"][0]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(examples))
    args = run_args(longformer_dir, tmp_path / "out", cache_dir, "--do_train", "--train_file", str(path))
    with pytest.raises(ValueError, match="leaving no room for the documents"):
        run_wikihop.main(args)
    with pytest.raises(ValueError, match="exceeds the 128 tokens"):
        run_wikihop.main(args + ["--max_seq_length", "4096"])


# ---------------------------------------------------------------------------------------------------------------
# Every script runs as a file from any folder, and as a module
# ---------------------------------------------------------------------------------------------------------------

# Runs each script's --help in one process (torch and transformers load once), the way Python runs it:
# ``python examples/<script>.py`` (sys.path[0] is examples/, the repository root nowhere on the path, the working
# folder elsewhere) and ``python -m examples.<script>`` (the working folder, the repository root, first on the path).
HELP_DRIVER = """
import contextlib, io, json, os, runpy, sys
import hf_xformers  # the package as installed (or on PYTHONPATH); no folder with an examples/ package stays on the path
repo, outside, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
elsewhere = [p for p in sys.path if p not in ("", ".") and not os.path.isfile(os.path.join(p, "examples", "__init__.py"))]
results = {}
for mode in ("file", "module"):
    for name in names:
        for key in [k for k in sys.modules if k == "examples" or k.startswith("examples.")]:
            del sys.modules[key]
        script = os.path.join(repo, "examples", name + ".py")
        os.chdir(outside if mode == "file" else repo)
        sys.path[:] = [os.path.dirname(script) if mode == "file" else repo, *elsewhere]
        sys.argv = [script, "--help"]
        shown, code = io.StringIO(), None
        try:
            with contextlib.redirect_stdout(shown):
                if mode == "file":
                    runpy.run_path(script, run_name="__main__")
                else:
                    runpy.run_module("examples." + name, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code
        except ModuleNotFoundError as error:
            code = "skip" if error.name.split(".")[0] not in ("examples", "hf_xformers") else repr(error)
        except Exception as error:
            code = repr(error)
        results[mode + " " + name] = [code, "usage:" in shown.getvalue()]
print(json.dumps(results))
"""


def example_scripts() -> list[str]:
    """The scripts of examples/: every module there that runs as ``__main__``."""
    return sorted(p.stem for p in (REPO / "examples").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_every_script_runs_as_a_file_from_any_folder_and_as_a_module(tmp_path):
    scripts = example_scripts()
    assert {"run_classification", "run_glue", "run_qa", "long_vs_truncated"} <= set(scripts)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", HELP_DRIVER, str(REPO), str(tmp_path), ",".join(scripts)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    failed = {run: outcome for run, outcome in results.items() if outcome[0] != "skip" and outcome != [0, True]}
    assert not failed, failed  # e.g. {'file run_glue': ["ModuleNotFoundError(\"No module named 'examples'\")", False]}
    assert sum(outcome[0] == "skip" for outcome in results.values()) <= 2, results  # an optional package missing
    assert list(tmp_path.iterdir()) == []  # --help writes nothing
