"""Long Range Arena for the eight hf_xformers architectures: one CLI, one Trainer, one table.

    python -m benchmarks.lra.run --task listops --arch hfx-longformer --steps 2000
    python -m benchmarks.lra.run --task listops image --arch all --steps 300      # every architecture, one table
    python -m benchmarks.lra.run --task listops --data_dir listops=lra_release/listops --arch all
    python -m benchmarks.lra.run --smoke                                           # every task x architecture, tiny

Every (task, architecture) cell trains with the same seed, data order, number of steps, optimiser and schedule
(AdamW, linear warm-up then cosine decay) through ``transformers.Trainer``, then reports test accuracy, training
steps per second and peak memory at the task's length. A cell runs in a process of its own (so that its peak memory
is its own) and writes ``cells/<task>__<arch>.json`` and ``logs/<task>__<arch>.log`` under ``--out``; a cell whose
result exists with the same settings is not rerun (``--overwrite`` reruns it). After every cell the table
(``lra_results.md``, with the published figures beside ours) and the plot (``lra_results.png``: accuracy against
speed, bubble area = memory, as LRA's Figure 3) are rewritten from all cells present.

Precision (:mod:`benchmarks.precision`, as in every benchmark here): ``--dtype bfloat16`` trains and evaluates the
models with bfloat16 weights ("pure" bfloat16); with ``--autocast`` the weights stay float32 and the Trainer runs
its forward under ``torch.autocast`` (``TrainingArguments(bf16=True)``, or ``fp16=True`` for float16), and so does
the evaluation. The table records the precision of its cells; a run other than float32 writes to
``results/lra_bf16[_autocast]/`` by default, beside the float32 ``results/lra/``. ``--device`` picks the device
(default: CUDA when there is one).

Data: :mod:`benchmarks.lra.data` (generators for ListOps and Pathfinder, readers for the release files, offline
stand-ins for Text, Retrieval and Image); models: :mod:`benchmarks.lra.models`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.precision import AUTOCAST_HELP, DEVICES, DTYPE_HELP, DTYPES, Precision
from examples.utils_examples import script_parser

RESULTS = Path(__file__).resolve().parents[1] / "results" / "lra"
TASK_ORDER = ("listops", "text", "retrieval", "image", "pathfinder")

# Published accuracies (%), task order ListOps / Text / Retrieval / Image / Pathfinder: context, not our results.
PUBLISHED = {
    "LRA Table 1 (JAX, paper settings)": {
        "Transformer": (36.37, 64.27, 57.46, 42.44, 71.40),
        "hfx-longformer": (35.63, 62.85, 56.89, 42.22, 69.71),
        "hfx-bigbird": (36.05, 64.02, 59.29, 40.83, 74.87),
        "hfx-linformer": (35.70, 53.94, 52.27, 38.56, 76.34),
        "hfx-performer": (18.01, 65.40, 53.82, 42.77, 77.05),
        "hfx-reformer": (37.27, 56.10, 53.40, 38.07, 68.50),
    },
    "Skyformer re-run (PyTorch, small setting, 50K steps)": {
        "Transformer": (38.37, 61.95, 80.69, 40.57, 65.26),
        "hfx-bigbird": (39.25, 63.86, 80.28, 43.16, 68.72),
        "hfx-linformer": (37.45, 58.93, 78.19, 37.96, 60.93),
        "hfx-performer": (38.02, 64.19, 80.04, 41.43, 66.30),
        "hfx-reformer": (37.68, 62.93, 78.99, 48.87, 66.49),
    },
}


def _precision(args) -> Precision:
    """The run's precision on its device (``--device`` absent: CUDA when there is one, as before the flag)."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return Precision(args.dtype, args.autocast, device)


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.lra.data import TASKS
    from benchmarks.lra.models import ARCHS

    p = script_parser(__doc__)
    p.add_argument("--task", nargs="+", default=["listops"], help=f"tasks, or 'all': {', '.join(TASKS)}")
    p.add_argument("--arch", nargs="+", default=["all"], help=f"architectures, or 'all': {', '.join(ARCHS)}")
    p.add_argument("--setting", choices=["small", "lra"], default="small",
                   help="small: 2 layers, hidden 64, FFN 128, 2 heads (the PyTorch re-runs); lra: LRA's per-task sizes")
    p.add_argument("--steps", type=int, default=1000, help="training steps, the same for every cell")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--max_length", type=int, default=None, help="sequence length (default: each task's own)")
    p.add_argument("--num_train", type=int, default=None, help="training examples (generated tasks; default: the task's)")
    p.add_argument("--num_eval", type=int, default=None, help="validation / test examples (generated tasks)")
    p.add_argument("--data_dir", nargs="*", default=[], metavar="TASK=DIR",
                   help="the release's files for a task, e.g. listops=lra_release/listops (default: generated or offline data)")
    p.add_argument("--option", nargs="*", default=[], metavar="TASK.KEY=VALUE",
                   help="a keyword of the task's loader, e.g. text.hub_dataset=imdb or text.text_column=review")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per cell (default: torch's)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--overwrite", action="store_true", help="rerun cells whose results exist")
    p.add_argument("--smoke", action="store_true",
                   help="every task and architecture at tiny lengths for 2 steps, in this process (tests)")
    p.add_argument("--in_process", action="store_true", help="run cells in this process (memory is then shared)")
    p.add_argument("--no_progress", action="store_true")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--autocast", action="store_true", help=AUTOCAST_HELP)
    p.add_argument("--device", default=None, choices=DEVICES, help="default: cuda when available, else cpu")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        Precision(args.dtype, args.autocast)
    except ValueError as error:
        p.error(str(error))
    if args.out == RESULTS and (args.dtype != "float32" or args.autocast):
        args.out = RESULTS.with_name(RESULTS.name + Precision(args.dtype, args.autocast).suffix())
    args.task = list(TASKS) if args.task == ["all"] else args.task
    args.arch = list(ARCHS) if args.arch == ["all"] else args.arch
    for task in args.task:
        if task not in TASKS:
            p.error(f"unknown task {task!r}; choose from {', '.join(TASKS)} or 'all'")
    for arch in args.arch:
        if arch not in ARCHS:
            p.error(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)} or 'all'")
    dirs = {}
    for item in args.data_dir:
        task, sep, path = item.partition("=")
        if not sep or task not in TASKS:
            p.error(f"--data_dir takes TASK=DIR pairs with a task from {', '.join(TASKS)}, got {item!r}")
        dirs[task] = path
    args.data_dir = dirs
    options: dict[str, dict] = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        task, dot, key = name.partition(".")
        if not sep or not dot or task not in TASKS:
            p.error(f"--option takes TASK.KEY=VALUE with a task from {', '.join(TASKS)}, got {item!r}")
        options.setdefault(task, {})[key] = int(value) if value.lstrip("-").isdigit() else value
    args.option = options
    if args.smoke:
        args.steps, args.batch_size, args.in_process = 2, 4, True
        args.out = args.out if args.out != RESULTS else Path(tempfile.mkdtemp(prefix="lra_smoke_"))
    return args


def task_options(task: str, args) -> dict:
    """Keyword arguments of ``load_task`` for this run (the smoke mode's tiny sizes included)."""
    options = dict(data_dir=args.data_dir.get(task), max_length=args.max_length, seed=args.seed)
    options.update(args.option.get(task, {}))
    if args.num_train is not None:
        options["num_train"] = args.num_train
    if args.num_eval is not None:
        options["num_eval"] = args.num_eval
    if args.smoke:
        options.update(num_train=8, num_eval=4)
        if task == "listops":
            options.update(max_length=48, min_length=16)
        elif task in ("text", "retrieval"):
            options.update(max_length=40)
        elif task == "image":  # 16 x 16 images
            options.update(max_length=256)
        else:  # 24 x 24: two pathfinder contours do not fit apart in 16 x 16
            options.update(max_length=576)
    return options


def cell_key(task: str, arch: str, args) -> str:
    """What a cell's result depends on: a cell with the same key is not rerun."""
    fields = dict(
        task=task, arch=arch, setting=args.setting, steps=args.steps, batch=args.batch_size, lr=args.learning_rate,
        warmup=args.warmup_ratio, wd=args.weight_decay, dropout=args.dropout, seed=args.seed,
        data=task_options(task, args),
    )  # fmt: skip
    if args.dtype != "float32" or args.autocast:  # float32 cells keep the keys they were saved with
        fields.update(dtype=args.dtype, autocast=args.autocast)
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _collate(rows: list[dict]) -> dict:
    import torch

    keys = [k for k in ("input_ids", "input_ids_2", "label") if k in rows[0]]
    batch = {}
    for key in keys:
        values = torch.tensor([row[key] for row in rows])
        batch["labels" if key == "label" else key] = values
    batch["attention_mask"] = (batch["input_ids"] != 0).long()
    if "input_ids_2" in batch:
        batch["attention_mask_2"] = (batch["input_ids_2"] != 0).long()
    return batch


def accuracy(model, rows: list[dict], batch_size: int, device, precision: Precision | None = None) -> float:
    import torch

    model.eval()
    correct = 0
    # Under --autocast the evaluation runs as the training forward did (Trainer's own evaluation does the same).
    autocast = precision.context(training=True) if precision else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in _collate(rows[start : start + batch_size]).items()}
            labels = batch.pop("labels")
            correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    return correct / max(1, len(rows))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_cell(task: str, arch: str, args) -> dict:
    """Train and evaluate one (task, architecture) cell; returns its result record."""
    import torch
    from transformers import Trainer, TrainingArguments

    from benchmarks.lra.data import load_task
    from benchmarks.lra.models import VISION_ARCHS, build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    data = load_task(task, **task_options(task, args))
    if arch in VISION_ARCHS and data.image_shape is None:
        return {"task": task, "arch": arch, "skipped": f"{arch} is a vision model; {task} is a 1-D token task"}
    model, settings = build_model(
        arch, task, vocab_size=data.vocab_size, length=data.max_length, num_labels=data.num_labels,
        two_tower=data.two_tower, image_shape=data.image_shape, setting=args.setting, dropout=args.dropout,
        seed=args.seed,
    )  # fmt: skip
    precision = _precision(args)
    precision.check_available()
    device = torch.device(precision.device)
    if not args.autocast:
        model.to(precision.torch_dtype())  # pure --dtype training (a no-op for float32)
    labels = [row["label"] for row in data.test]
    majority = max(labels.count(c) for c in set(labels)) / len(labels)
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(
            output_dir=scratch, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.learning_rate, warmup_steps=args.warmup_ratio, lr_scheduler_type="cosine",
            weight_decay=args.weight_decay, max_grad_norm=1.0, seed=args.seed, data_seed=args.seed,
            logging_steps=max(1, args.steps // 20), save_strategy="no", eval_strategy="no", report_to="none",
            remove_unused_columns=False, use_cpu=device.type == "cpu", disable_tqdm=args.no_progress or args.smoke,
            dataloader_drop_last=True, bf16=args.autocast and args.dtype == "bfloat16",
            fp16=args.autocast and args.dtype == "float16",
        )  # fmt: skip
        trainer = Trainer(model=model, args=training, train_dataset=data.train, data_collator=_collate)
        rss_before = _peak_rss_mib()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        load_before, cpu_before = os.getloadavg()[0], _cpu_seconds()
        start = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - start
        # Background load: the machine's 1-minute load average minus what this process kept busy (threads' worth).
        own_load = (_cpu_seconds() - cpu_before) / seconds
        background = max(0.0, (load_before + os.getloadavg()[0]) / 2 - own_load)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    record = {
        "task": task, "arch": arch, "steps": args.steps, "batch_size": args.batch_size, "length": data.max_length,
        "setting": settings, "source": data.source, "num_train": len(data.train), "num_test": len(data.test),
        "test_accuracy": accuracy(model, data.test, args.batch_size, device, precision),
        "validation_accuracy": accuracy(model, data.validation, args.batch_size, device, precision),
        "majority_baseline": majority, "train_seconds": seconds, "steps_per_second": args.steps / seconds,
        "final_train_loss": losses[-1] if losses else result.training_loss, "loss_curve": losses,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_rss_mib": _peak_rss_mib(), "rss_before_training_mib": rss_before,
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        "threads": torch.get_num_threads(), "device": str(device), "torch": torch.__version__,
        "own_cpu_load": own_load, "background_load": background, "dtype": args.dtype, "autocast": args.autocast,
    }  # fmt: skip
    return record


def _load_cells(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]


def _memory(cell: dict) -> float:
    return cell["peak_cuda_mib"] if cell.get("peak_cuda_mib") else cell["peak_rss_mib"]


def write_table(out: Path) -> Path:
    """``lra_results.md`` from every cell under ``out``: accuracy per task and the average, the majority baseline,
    speed and memory per task, then the published figures."""
    from benchmarks.lra.models import ARCHS

    cells = [c for c in _load_cells(out) if "skipped" not in c]
    tasks = [t for t in TASK_ORDER if any(c["task"] == t for c in cells)]
    by = {(c["task"], c["arch"]): c for c in cells}
    lines = ["# Long Range Arena: hf_xformers architectures", ""]
    if not cells:
        lines.append("No results yet.")
    else:
        first = cells[0]
        lines += [
            f"Setting: {first['setting']['setting']} ({first['setting']['layers']} layers, hidden "
            f"{first['setting']['hidden']}, FFN {first['setting']['ffn']}, {first['setting']['heads']} heads, mean "
            f"pooling); {first['steps']} steps of batch {first['batch_size']} per cell, the same seed, data order, "
            f"optimiser and schedule for every architecture; {first['device']}, {first['threads']} threads, torch "
            f"{first['torch']}. Accuracy on the test split (%).",
            "",
            precision_line(cells),
            "",
            "| architecture | " + " | ".join(tasks) + " | average |",
            "|---|" + "---|" * (len(tasks) + 1),
        ]
        for arch in ARCHS:
            row = [by.get((t, arch)) for t in tasks]
            if not any(row):
                continue
            accs = [100 * c["test_accuracy"] for c in row if c]
            mark = " (2-D image)" if arch == "hfx-swin" else ""
            cells_txt = [f"{100 * c['test_accuracy']:.1f}" if c else "-" for c in row]
            avg = f"{sum(accs) / len(accs):.1f}" if len(accs) == len(tasks) else "-"
            lines.append(f"| {arch}{mark} | " + " | ".join(cells_txt) + f" | {avg} |")
        base = [max((c["majority_baseline"] for c in cells if c["task"] == t), default=0) for t in tasks]
        lines.append("| majority class | " + " | ".join(f"{100 * b:.1f}" for b in base) + " | |")
        lines += ["", "Training speed (steps/s) and peak memory (MiB, process RSS on CPU) at each task's length:", ""]
        lines += ["| architecture | " + " | ".join(f"{t} ({by_len(cells, t)})" for t in tasks) + " |", "|---|" + "---|" * len(tasks)]
        for arch in ARCHS:
            row = [by.get((t, arch)) for t in tasks]
            if any(row):
                lines.append(f"| {arch} | " + " | ".join(
                    f"{c['steps_per_second']:.2f} / {_memory(c):.0f}" if c else "-" for c in row) + " |")
        lines += ["", "Per-cell data and knobs (from `cells/*.json`):", ""]
        for c in cells:
            knobs = {k: v for k, v in c["setting"].items() if k not in ("layers", "hidden", "ffn", "heads", "setting")}
            load = f", background load {c['background_load']:.1f} cores" if "background_load" in c else ""
            lines.append(f"- {c['task']} / {c['arch']}: {c['train_seconds']:.0f} s{load}, {c['parameters']:,} parameters, "
                         f"final loss {c['final_train_loss']:.3f}, knobs {knobs}; data: {c['source']}")
    lines += ["", "## Published figures, for context (not our runs)", ""]
    for name, rows in PUBLISHED.items():
        lines += [f"{name}:", "", "| model | " + " | ".join(TASK_ORDER) + " | average |", "|---|" + "---|" * 6]
        for model, accs in rows.items():
            lines.append(f"| {model} | " + " | ".join(f"{a:.2f}" for a in accs) + f" | {sum(accs) / 5:.2f} |")
        lines.append("")
    path = out / "lra_results.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def precision_line(cells: list[dict]) -> str:
    """The table's precision (cells saved before the flags were float32); several if the cells differ."""
    # The evaluation runs as the training does (the same weights; under autocast too).
    kinds = sorted({Precision.from_record({**c, "device": "cpu"}).describe(forward=False) for c in cells})
    kinds = [kind.replace(" (training)", " (training and evaluation)") for kind in kinds]
    if len(kinds) == 1:
        return f"Precision: {kinds[0]}."
    return "Precision differs between cells: " + " / ".join(kinds) + "."


def by_len(cells: list[dict], task: str) -> str:
    lengths = sorted({c["length"] for c in cells if c["task"] == task})
    return "/".join(str(n) for n in lengths)


def write_plot(out: Path) -> Path | None:
    """``lra_results.png``: per task, accuracy against training steps/s, bubble area proportional to memory."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells = [c for c in _load_cells(out) if "skipped" not in c]
    tasks = [t for t in TASK_ORDER if any(c["task"] == t for c in cells)]
    if not tasks:
        return None
    from benchmarks.lra.models import ARCHS

    colours = {arch: plt.get_cmap("tab10")(i) for i, arch in enumerate(ARCHS)}  # one colour per architecture
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [c for c in cells if c["task"] == task]
        top = max(_memory(c) for c in rows)
        for c in rows:
            ax.scatter(c["steps_per_second"], 100 * c["test_accuracy"], s=1500 * _memory(c) / top, alpha=0.45,
                       color=colours.get(c["arch"]))  # fmt: skip
            ax.annotate(c["arch"].removeprefix("hfx-"), (c["steps_per_second"], 100 * c["test_accuracy"]),
                        ha="center", va="center", fontsize=8)
        ax.axhline(100 * rows[0]["majority_baseline"], color="grey", ls="--", lw=1, label="majority class")
        ax.set_title(f"{task} ({by_len(rows, task)} tokens)")
        ax.set_xlabel("training steps / s")
        ax.set_ylabel("test accuracy (%)")
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("Long Range Arena, hf_xformers (bubble area: peak memory)")
    fig.tight_layout()
    path = out / "lra_results.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _run_in_subprocess(task: str, arch: str, argv: list[str], log: Path) -> dict:
    """The cell in a fresh process (its own peak memory); its stdout/stderr go to ``log``."""
    result_file = log.with_suffix(".result.json")
    command = [sys.executable, "-m", "benchmarks.lra.run", *argv, "--task", task, "--arch", arch,
               "--worker", str(result_file)]  # fmt: skip
    with log.open("w") as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    if code != 0 or not result_file.exists():
        raise RuntimeError(f"cell {task}/{arch} failed (exit {code}); see {log}")
    record = json.loads(result_file.read_text())
    result_file.unlink()
    return record


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        record = run_cell(args.task[0], args.arch[0], args)
        Path(args.worker).write_text(json.dumps(record))
        return 0
    (args.out / "cells").mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    # The arguments a worker needs: everything but the task / architecture lists (it gets one of each).
    passthrough = _strip(argv, ("--task", "--arch"))
    cells = [(t, a) for t in args.task for a in args.arch]
    try:
        from tqdm.auto import tqdm

        progress = tqdm(cells, desc="LRA cells", disable=args.no_progress)
    except ImportError:
        progress = cells
    for task, arch in progress:
        path = args.out / "cells" / f"{task}__{arch}.json"
        key = cell_key(task, arch, args)
        if path.exists() and not args.overwrite and json.loads(path.read_text()).get("key") == key:
            continue  # finished earlier with the same settings
        if hasattr(progress, "set_postfix_str"):
            progress.set_postfix_str(f"{task} / {arch}")
        if args.in_process:
            record = run_cell(task, arch, args)
        else:
            record = _run_in_subprocess(task, arch, passthrough, args.out / "logs" / f"{task}__{arch}.log")
        record["key"] = key
        path.write_text(json.dumps(record, indent=1))
        write_table(args.out)
        write_plot(args.out)
    table = write_table(args.out)
    write_plot(args.out)
    print(table.read_text())
    return 0


def _strip(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``options`` and their values."""
    out, skipping = [], False
    for item in argv:
        if item.startswith("--"):
            skipping = item.split("=")[0] in options
            if skipping:
                continue
        elif skipping:
            continue
        out.append(item)
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
