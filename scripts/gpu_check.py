"""One command for a GPU: every check that needs an accelerator, in one run of a few minutes, into one folder.

GPU time is short (about 15 minutes at a time on one H100, machine start included), so this script runs the device
checks as a fixed list of steps, each in a process of its own with its own time limit, under one global cap (8
minutes on CUDA), and writes everything under ``<out>/<date>-<device>/``: a folder and a log per step and, at the
end, ``summary.md`` (each step's status, time and key figures) and ``summary.json``. A failing or timed-out step
does not stop the others; steps that write their results as they go keep what they finished.

Steps (:data:`STEPS`, in order):

1. ``environment``: versions (torch, transformers and the libraries it needs), the device, the floors of
   ``pyproject.toml``, one forward of a small model on the device.
2. ``conformance``: ``pytest --device <device>`` on the conformance suites' mixed-precision (bf16 and fp16), packed
   batch and device tests.
3. ``attention_implementations``: every ``attn_implementation`` of every architecture, forward and backward under
   bfloat16 autocast, against the float32 ``"eager"`` outputs and gradients of the same weights; then FlexAttention
   in float32 and at head dim 128 (this file's worker).
4. ``attention_switch``: ``benchmarks.benchmark_attention_switch``, training, 4k and 32k tokens, ours (sdpa and
   flex_attention) against transformers, BigBird first (its FlexAttention has no GPU figure yet), with model
   TFLOP/s and MFU.
5. ``long_context``: ``benchmarks.benchmark_long_context``, training at 32k tokens, Longformer against full-attention
   SDPA and transformers, with model TFLOP/s and MFU.
6. ``packing``: ``benchmarks.benchmark_packing``: packed (padding-free) batches against padded ones.
7. ``learning``: every architecture trains on a small synthetic classification task and must reach
   :data:`LEARNING_THRESHOLD` test accuracy (4 classes: chance is 25 %) in the steps it has (this file's worker).
   It replaces the ListOps run of earlier versions, which ended at chance after 60 steps on the H200.
8. ``sequence_parallel``: ``tests/sequence_parallel_worker.py`` on 2 to 4 GPUs over NCCL (DeepSpeed Ulysses): every
   supported type and head against one process, to 1e-5 in float32 (TF32 off). Needs DeepSpeed and two GPUs; with one
   (the usual loan) it reports that and ends at once. The dry run takes 2 gloo ranks on the CPU.

Steps whose work is a list of cells (the sweep, the two benchmarks, the learning check) get their step's time limit
as a budget, less a margin for the cell in flight: they start no cell past it and list the cells left as skipped,
so that a step ends by itself, ``ok``, inside the global cap. A step that ends early leaves its unused seconds to
the steps after it. Limits from the H200 run of wave 6 (torch 2.11): environment 24 s, conformance 90 s, sweep 98 s,
attention_switch needed more than 80 s (3 of 4 length groups), long_context more than 60 s (2 of 6 cells: each
cell is a fresh process, about 30 s), packing 46 s.

Nothing is installed. The script runs on the interpreter that starts it (on the GPU machines, their own ``python3``
with its CUDA torch) and gives every step a ``PYTHONPATH`` of the repository root (no ``pip install -e``) and of the
wheels in ``.whl/`` that the machine lacks or holds older: each such wheel (pure-Python ones, or built for this
interpreter and platform) is unpacked once under ``gpu_check_results/.cache/`` and put on the path, ahead of
site-packages. That is how a machine whose transformers is below our floor (5.18) runs the pinned release
(``.whl/transformers-5.23.0-py3-none-any.whl``).

Usage (from the repository root)::

    make gpu-check                                  # python3 scripts/gpu_check.py --device cuda
    make gpu-check DEVICE=cpu                       # the same steps at tiny sizes on the CPU, under two minutes
    python3 scripts/gpu_check.py --device cuda --steps environment conformance    # some steps only

    # on the project's GPU machine (the device tool): the tree travels, .whl/ with it; results come back in $OUT
    run(command="make gpu-check", carry=[".whl"])
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO_ROOT / ".whl"
CACHE_DIR = REPO_ROOT / "gpu_check_results" / ".cache"
# The whole run on a GPU machine: 8 of the 15 minutes a session gets, which leaves time for the machine's start and
# one rerun of a step. On the CPU (the dry run) the steps are tiny.
GLOBAL_CAP_S = {"cuda": 480.0, "cpu": 115.0}
# Every step not yet run keeps at least this much of the global cap, so that a slow step cannot starve the rest.
MIN_STEP_S = {"cuda": 20.0, "cpu": 8.0}
# A step past its limit gets SIGTERM, then SIGKILL this much later (its process group: cell workers included).
KILL_GRACE_S = 5.0
LOG_TAIL_LINES = 15


# ----------------------------------------------------------------------------------------------------------------
# The path the steps run with: the repository and the wheels of .whl/ this interpreter lacks
# ----------------------------------------------------------------------------------------------------------------


def version_tuple(text: str) -> tuple[int, ...]:
    """``"5.23.0"`` -> ``(5, 23, 0)``; a pre-release or local suffix (``2.11.0+cu128``, ``5.18.0rc1``) is cut at the
    first non-digit of each part."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = re.match(r"\d*", piece).group()
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def pyproject_floor(name: str) -> str:
    """The lowest version of ``name`` that ``pyproject.toml``'s dependencies admit (``"name>=X"``)."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    match = re.search(rf'"{re.escape(name)}\s*>=\s*([0-9][0-9.]*)', text)
    if match is None:
        raise ValueError(f"pyproject.toml names no floor for {name!r} ('{name}>=X' in [project] dependencies)")
    return match.group(1)


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this interpreter would import (without the wheels), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def wheel_fits(python_tag: str, abi_tag: str, platform_tag: str) -> bool:
    """Whether a wheel with these tags runs on this interpreter: pure Python, or built for this CPython and machine."""
    if platform_tag == "any":
        return any(tag.startswith("py3") or tag == "py2.py3" for tag in python_tag.split("."))
    ours = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return (
        sys.platform.startswith("linux")
        and platform.machine() in platform_tag
        and (ours in python_tag.split(".") or abi_tag == "abi3")
    )


@dataclass
class WheelChoice:
    path: Path
    name: str
    version: str
    installed: str | None
    used: bool
    reason: str


def choose_wheels(wheel_dir: Path = WHEEL_DIR) -> list[WheelChoice]:
    """Every wheel in ``wheel_dir``, and whether it goes on the path: yes when this interpreter lacks the
    distribution or has an older version (and the wheel fits this interpreter)."""
    choices = []
    for path in sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []:
        parts = path.stem.split("-")
        if len(parts) not in (5, 6):
            choices.append(WheelChoice(path, path.stem, "?", None, False, "not a wheel file name"))
            continue
        name, version, python_tag, abi_tag, platform_tag = parts[0], parts[1], *parts[-3:]
        installed = installed_version(name)
        if not wheel_fits(python_tag, abi_tag, platform_tag):
            used, reason = False, f"built for {python_tag}-{abi_tag}-{platform_tag}, not this interpreter"
        elif installed is None:
            used, reason = True, "not installed here"
        elif version_tuple(installed) < version_tuple(version):
            used, reason = True, f"installed {installed} is older"
        else:
            used, reason = False, f"installed {installed} is as new"
        choices.append(WheelChoice(path, name, version, installed, used, reason))
    return choices


def unpack_wheel(path: Path, cache_dir: Path = CACHE_DIR) -> Path:
    """``path`` unpacked under ``cache_dir`` (once: a marker file says the unpacking finished); a folder to put on the
    import path. Unpacked rather than imported from the zip: some packages read their own files from disk."""
    target = cache_dir / path.stem
    marker = target / ".unpacked"
    if not marker.exists():
        target.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(path) as archive:
            archive.extractall(target)
        marker.write_text(str(path.stat().st_size))
    return target


def step_environment(extra_paths: list[Path]) -> dict[str, str]:
    """The environment of every step: offline Hugging Face libraries, unbuffered output, and a ``PYTHONPATH`` of the
    repository root, then the unpacked wheels, then what was there."""
    env = dict(os.environ)
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *map(str, extra_paths), *old])
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        MPLBACKEND="Agg",
    )
    return env


# ----------------------------------------------------------------------------------------------------------------
# The steps
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Context:
    device: str
    run_dir: Path
    python: str
    limit_s: float = 0.0  # the time limit of the step being run (its argv passes a budget from it)


# Seconds a step keeps, inside its limit, for the cell in flight when its budget runs out (the longest cell of the
# H200 run took about 30 s: a long-context cell starting a process); at least a third of the limit stays a budget.
CELL_MARGIN_S = {"cuda": 25.0, "cpu": 5.0}
# The status of a cell a step did not start, its budget spent (the benchmarks write the same).
SKIPPED = "skipped (budget)"


def cell_budget(ctx: Context) -> float:
    """The budget (seconds) a step with cells gets: its limit less :data:`CELL_MARGIN_S`."""
    return max(ctx.limit_s / 3, ctx.limit_s - CELL_MARGIN_S[ctx.device])


@dataclass
class Step:
    """One step: ``argv(ctx, step_dir)`` is its command (run in the repository root); ``flags`` the options of
    ``module`` it needs (checked in the module's source before running, so that a benchmark without them yet is
    reported, not crashed); ``figures(step_dir, log)`` the key figures for the summary."""

    name: str
    title: str
    limit_s: dict[str, float]
    argv: Callable[[Context, Path], list[str]]
    figures: Callable[[Path, str], list[str]]
    module: str | None = None
    flags: tuple[str, ...] = ()
    # The step's utilisation for the summary's MFU column (steps that time training steps), from what it wrote.
    mfu: Callable[[Path, str], str] | None = None


def worker_argv(ctx: Context, step_dir: Path, worker: str) -> list[str]:
    return [
        ctx.python,
        str(Path(__file__).resolve()),
        "--worker",
        worker,
        "--device",
        ctx.device,
        "--out",
        str(step_dir),
        "--budget-s",
        f"{cell_budget(ctx):.0f}",
    ]


# The conformance suites: every architecture's (tests/test_<arch>.py subclasses of TextModelConformance, Swin's of
# VisionModelConformance).
SUITE_FILES = [
    f"tests/test_{arch}.py"
    for arch in ("longformer", "bigbird", "linformer", "performer", "reformer", "transfo_xl", "universal", "swin")
]
# Their mixed-precision tests (parametrised bf16 / fp16), packed batches, and the CPU-against-device comparison.
CONFORMANCE_K = {
    "cuda": "Conformance and (bf16 or fp16 or packed or on_the_device)",
    # The dry run: one architecture's bf16 tests and one packed-batch test, enough to show that the plumbing works.
    "cpu": "TestLongformerConformance and ((half_precision_weights and bf16) or (packed_documents and eval-seq_idx))",
}


def conformance_argv(ctx: Context, step_dir: Path) -> list[str]:
    files = SUITE_FILES if ctx.device != "cpu" else ["tests/test_longformer.py"]
    # The suites' many shapes under Longformer's CUDA default (FlexAttention: a compilation per new pattern and dtype)
    # would not fit the step's time: they run the sdpa paths, as in the H200 run (HFX_DEVICE_DEFAULTS=0); the learning
    # step trains Longformer under its CUDA default, and the sweep checks FlexAttention's numbers.
    return [
        "env", "HFX_DEVICE_DEFAULTS=0", ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "--device", ctx.device,
        "-k", CONFORMANCE_K[ctx.device], "--junitxml", str(step_dir / "junit.xml"), "--continue-on-collection-errors",
    ]  # fmt: skip


def attention_switch_argv(ctx: Context, step_dir: Path) -> list[str]:
    sizes = (
        ["--lengths", "4096", "32768", "--repeats", "2", "--warmup", "1"]
        if ctx.device != "cpu"
        else ["--lengths", "128", "--repeats", "1", "--warmup", "0", "--threads", "2"]
    )
    # BigBird first: its FlexAttention (which the 64-token BlockMask kept from compiling on the H200) has no figure
    # yet, Longformer's has (flex 1.25x our sdpa path at 32k). The dry run: Longformer only (768 wide, costly here).
    archs = ["bigbird", "longformer"] if ctx.device != "cpu" else ["longformer"]
    return [
        ctx.python, "-m", "benchmarks.benchmark_attention_switch", "--device", ctx.device, "--dtype", "bfloat16",
        "--autocast", "--modes", "train", "--archs", *archs, *sizes, "--budget-s", f"{cell_budget(ctx):.0f}",
        "--out", str(step_dir),
    ]  # fmt: skip


def long_context_argv(ctx: Context, step_dir: Path) -> list[str]:
    # Every cell runs in a fresh process (imports and CUDA start: about 30 s a cell on the H200, which ran 2 of 6
    # cells in 60 s), so the GPU run measures 32k tokens only (the 4k figures come from attention_switch): ours, then
    # full-attention SDPA RoBERTa, then transformers' Longformer; the dry run measures ours (one cell).
    sizes = (
        ["--lengths", "32768", "--impls", "hfx", "sdpa", "ref", "--hidden", "256", "--layers", "4",
         "--window", "512", "--timeout", "45"]
        if ctx.device != "cpu"
        else ["--lengths", "128", "--impls", "hfx", "--hidden", "32", "--layers", "1", "--heads", "2", "--window", "32",
              "--timeout", "60", "--threads", "2"]
    )  # fmt: skip
    return [
        ctx.python, "-m", "benchmarks.benchmark_long_context", "--arch", "longformer", "--device", ctx.device,
        "--dtype", "bfloat16", "--autocast", "--modes", "backward", "--repeats", "2", "--max-background", "1",
        "--quiet-wait", "0", *sizes, "--budget-s", f"{cell_budget(ctx):.0f}", "--out", str(step_dir),
    ]  # fmt: skip


def sequence_parallel_argv(ctx: Context, step_dir: Path) -> list[str]:
    """Sequence parallelism on 2 to 4 GPUs over NCCL (``tests/sequence_parallel_worker.py``: every supported type and
    head against one process); the dry run takes 2 gloo ranks on the CPU and one case. A machine with one GPU, or
    without DeepSpeed, runs a line that says so (the step's figures report it)."""
    import importlib.util

    out = str(step_dir / "sequence_parallel.json")
    if importlib.util.find_spec("deepspeed") is None:
        why = "DeepSpeed is not installed (pip install deepspeed with DS_BUILD_OPS=0)"
    elif ctx.device == "cpu":  # the dry run: the plumbing on one case (tests/test_sequence_parallel.py runs them all)
        why, ranks, only = None, 2, ["hfx-longformer/masked_lm/padded"]
    else:
        import torch

        ranks, only = (min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 0), []
        why = None if ranks >= 2 else f"{ranks} GPU(s) here: sequence parallelism needs 2 or more"
    if why is not None:
        record = json.dumps({"skipped": why})
        return [ctx.python, "-c", f"import pathlib; pathlib.Path({out!r}).write_text({record!r}); print({why!r})"]
    return [
        "env", f"HFX_SP_DEVICE={ctx.device}", f"DS_ACCELERATOR={ctx.device}", "OMP_NUM_THREADS=1",
        ctx.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        "-m", "tests.sequence_parallel_worker", out, *only,
    ]  # fmt: skip


def packing_argv(ctx: Context, step_dir: Path) -> list[str]:
    sizes = (
        ["--arch", "longformer", "bigbird", "performer", "reformer", "universal", "--batch-sizes", "8",
         "--num-batches", "4", "--repeats", "2", "--max-length", "4096", "--budget-s", "45"]
        if ctx.device != "cpu"
        else ["--quick", "--threads", "2"]
    )  # fmt: skip
    return [
        ctx.python, "-m", "benchmarks.benchmark_packing", "--device", ctx.device, "--dtype", "bfloat16", *sizes,
        "--name", "packing", "--out", str(step_dir),
    ]  # fmt: skip


# ----- key figures for the summary (each reads what its step wrote; a step stopped early has written less) -----


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def environment_figures(step_dir: Path, log: str) -> list[str]:
    env = _read_json(step_dir / "environment.json")
    if not env:
        return []
    lines = [
        f"python {env['python']}; torch {env['torch']} (CUDA {env.get('cuda') or '-'}); "
        f"device: {env.get('device_name', '-')}",
        f"transformers {env['transformers']} from {env['transformers_from']}; floors: torch >= {env['torch_floor']}, "
        f"transformers >= {env['transformers_floor']}",
    ]
    lines += [f"problem: {p}" for p in env.get("problems", [])]
    lines += [f"warning: {w}" for w in env.get("warnings", [])]
    if env.get("smoke"):
        lines.append(f"smoke forward on {env['device']}: {env['smoke']}")
    return lines


def conformance_figures(step_dir: Path, log: str) -> list[str]:
    import xml.etree.ElementTree as ElementTree

    path = step_dir / "junit.xml"
    if not path.exists():
        return []
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [
        f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
        f"in {float(suite.get('time', 0)):.0f} s"
    ]
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            lines.append(f"failed: {case.get('classname')}::{case.get('name')}")
    return lines[:21]


def sweep_figures(step_dir: Path, log: str) -> list[str]:
    data = _read_json(step_dir / "attention_implementations.json")
    if not data:
        return []
    lines = [
        f"{data['settings']}",
        "",
        "| architecture | attn_implementation | precision | head dim | status | first call s | step ms | peak MiB | "
        "mean rel. error | max dev. | grad cosine |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in data["cells"]:
        what = f"| {c['arch']} | {c['implementation']} | {c.get('precision', 'bf16')} | {c.get('head_dim', '-')} |"
        if c["status"] == "ok" or "step_ms" in c:
            lines.append(
                f"{what} {c['status']} | {c['first_call_s']:.1f} | "
                f"{c['step_ms']:.1f} | {c['peak_mib'] or '-'} | {c['mean_rel_error']:.2e} | {c['max_deviation']:.2e} | "
                f"{c['grad_cosine']:.4f} |"
            )
        else:
            lines.append(f"{what} {c['status']}: {c.get('error', '')} | | | | | | |")
    skipped = [c for c in data["cells"] if c["status"] == SKIPPED]
    if skipped:
        lines += ["", f"{len(skipped)} of {len(data['cells'])} cells skipped (past the step's budget)."]
    return lines


def _percent(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f} %" if value >= 0.01 else f"{100 * value:.2g} %"


def _switch_rows(log: str) -> tuple[dict, list[dict]]:
    """The attention-switch benchmark's machine line and cell rows, from its log (it prints one JSON line per cell as
    it goes; its JSON file is written at the end only)."""
    machine, rows = {}, []
    for line in log.splitlines():
        if line.startswith('{"arch"'):
            rows.append(json.loads(line))
        elif line.startswith('{"device"'):
            machine = json.loads(line)
    return machine, rows


def attention_switch_figures(step_dir: Path, log: str) -> list[str]:
    machine, rows = _switch_rows(log)
    cells = {}
    for row in rows:
        cells.setdefault((row["arch"], row["mode"], row["length"]), {})[row["implementation"]] = row
    lines = []
    if machine.get("matmul_tflops"):
        lines += [f"MFU: model TFLOP/s (benchmarks/utilisation.py) over a {machine.get('matmul', 'matrix product')} "
                  f"measured in the run: {machine['matmul_tflops']:.3g} TFLOP/s.", ""]  # fmt: skip
    lines += [
        "| arch | mode | tokens | sdpa | flex_attention | transformers | flex / sdpa | transformers / sdpa | "
        "MFU sdpa | MFU flex | MFU transformers |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (arch, mode, length), row in cells.items():
        seconds = {k: r["seconds"] for k, r in row.items()}
        ms = {k: f"{v * 1000:.0f} ms" if isinstance(v, float) else str(v) for k, v in seconds.items()}

        def ratio(name: str, seconds: dict = seconds) -> str:
            a, b = seconds.get(name), seconds.get("sdpa")
            return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"

        mfu = {k: _percent(r.get("mfu")) for k, r in row.items()}
        lines.append(
            f"| {arch} | {mode} | {length:,} | {ms.get('sdpa', '-')} | {ms.get('flex_attention', '-')} | "
            f"{ms.get('transformers', '-')} | {ratio('flex_attention')} | {ratio('transformers')} | "
            f"{mfu.get('sdpa', '-')} | {mfu.get('flex_attention', '-')} | {mfu.get('transformers', '-')} |"
        )
    skipped = [r for r in rows if r["seconds"] == "skipped (budget)"]
    if skipped:
        lines += ["", "Skipped (past the step's budget): "
                  + ", ".join(f"{r['arch']} {r['implementation']} {r['length']:,}" for r in skipped)]  # fmt: skip
    return lines if cells else []


def _tokens(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else f"{length:,}"


def attention_switch_mfu(step_dir: Path, log: str) -> str:
    return _best_mfu([(r.get("mfu"), f"{r['arch']} {r['implementation']} {_tokens(r['length'])}") for r in _switch_rows(log)[1]])  # fmt: skip


def _best_mfu(candidates: list[tuple[float | None, str]]) -> str:
    """The summary's MFU cell: the best measured utilisation of the step and its cell."""
    measured = [(value, name) for value, name in candidates if value]
    if not measured:
        return "-"
    value, name = max(measured)
    return f"{_percent(value)} ({name})"


def _long_context_cells(step_dir: Path) -> list[tuple[str, dict, dict]]:
    cells = []
    for path in sorted(step_dir.glob("*.json")):
        data = json.loads(path.read_text())
        cells += [(name, r, data.get("meta", {})) for name, r in data.get("results", {}).items()]
    return cells


def _long_context_mfu(r: dict, meta: dict) -> float | None:
    if r.get("status") != "ok" or not r.get("model_flops") or not meta.get("matmul_tflops"):
        return None
    return r["model_flops"] / r["time_s"] / 1e12 / meta["matmul_tflops"]


def long_context_figures(step_dir: Path, log: str) -> list[str]:
    lines = []
    for path in sorted(step_dir.glob("*.json")):
        data = json.loads(path.read_text())
        results, meta = data.get("results", {}), data.get("meta", {})
        rate = f"; matrix product {meta['matmul_tflops']:.3g} TFLOP/s" if meta.get("matmul_tflops") else ""
        lines += [f"`{path.name}`{rate}:", "", "| cell | status | seconds | peak MiB | model TFLOP/s | MFU |",
                  "|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for cell, r in results.items():
            ok = r.get("status") == "ok"
            seconds = f"{r['time_s']:.3f}" if ok else "-"
            peak = f"{r['peak_mib']:.0f}" if ok and "peak_mib" in r else "-"
            rate = f"{r['model_flops'] / r['time_s'] / 1e12:.3g}" if ok and r.get("model_flops") else "-"
            lines.append(f"| {cell} | {r.get('status')} | {seconds} | {peak} | {rate} | {_percent(_long_context_mfu(r, meta))} |")  # fmt: skip
    return lines


def long_context_mfu(step_dir: Path, log: str) -> str:
    return _best_mfu([(_long_context_mfu(r, meta), name) for name, r, meta in _long_context_cells(step_dir)])


def packing_figures(step_dir: Path, log: str) -> list[str]:
    data = _read_json(step_dir / "packing.json")
    if not data:
        return []
    lines = ["| arch | dtype | attention | B | scheme | status | tokens/s | peak MiB |", "|---|---|---|---:|---|---|---:|---:|"]  # fmt: skip
    for r in data["results"]:
        speed, peak = (f"{r['tokens_per_s']:,.0f}", f"{r['peak_mib']:,.0f}") if r["status"] == "ok" else ("-", "-")
        lines.append(
            f"| {r['arch']} | {r['dtype']} | {r['attn_implementation']} | {r['batch_size']} | {r['scheme']} | "
            f"{r['status']} | {speed} | {peak} |"
        )
    return lines


def sequence_parallel_figures(step_dir: Path, log: str) -> list[str]:
    data = _read_json(step_dir / "sequence_parallel.json")
    if not data:
        return []
    if "skipped" in data:
        return [f"Not run: {data['skipped']}."]
    # The model cases are named type/head/batch; the worker's other entries are the refusals and the LSH layer check.
    cases = {name: c for name, c in data["cases"].items() if name.count("/") == 2}
    failed = sorted(name for name, c in cases.items() if "error" in c)
    worst = max((max(c["loss_rel_diff"], c["logits_rel_diff"], c["grads_rel_diff"]) for c in cases.values()
                 if "error" not in c), default=float("nan"))  # fmt: skip
    lsh = data["cases"].get("lsh_float32_hash", {"error": "not run"})
    return [
        f"{data['world_size']} ranks on {data.get('device', 'cpu')}: {len(cases) - len(failed)} of {len(cases)} "
        f"(type, head, batch) cases ran; largest relative difference from one process {worst:.2e} (loss, logits, "
        "gradients).",
        *(f"- {name}: {cases[name]['error'].strip().splitlines()[-1]}" for name in failed),
        "LSH layer under bfloat16 autocast, seeded rotations: "
        + (f"failed: {lsh['error'].strip().splitlines()[-1]}" if "error" in lsh else
           f"context {lsh['context_rel_diff']:.2e}, gradients {lsh['grads_rel_diff']:.2e} from one process."),
    ]  # fmt: skip


def learning_figures(step_dir: Path, log: str) -> list[str]:
    data = _read_json(step_dir / "learning.json")
    if not data:
        return []
    lines = [
        data["settings"],
        "",
        "| architecture | test accuracy | threshold | learned | steps | seconds | first loss | final loss |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for c in data["cells"]:
        if c["status"] in ("ok", "below threshold"):
            lines.append(
                f"| {c['arch']} | {100 * c['accuracy']:.1f} % | {100 * data['threshold']:.0f} % | "
                f"{'yes' if c['status'] == 'ok' else 'NO'} | {c['steps']} | {c['seconds']:.1f} | {c['first_loss']:.3f} | "
                f"{c['final_loss']:.3f} |"
            )
        else:
            lines.append(f"| {c['arch']} | {c['status']}: {c.get('error', '')} | | | | | | |")
    return lines


# Limits on CUDA (seconds, summing to the 480 s cap) from the H200 run of wave 6: environment 24 s, conformance 90 s,
# the sweep 98 s (now with float32 and head-dim-128 FlexAttention cells, which its budget may skip), packing 46 s;
# attention_switch and long_context needed more than they had (80 s, 60 s) and now run within budgets of their
# limits; the learning check is about 5 s a tiny model plus one FlexAttention compilation (Longformer's default).
STEPS = [
    Step("environment", "Versions, device, floors, one forward", {"cuda": 30, "cpu": 20},
         lambda ctx, d: worker_argv(ctx, d, "environment"), environment_figures),
    Step("conformance", "pytest --device: conformance suites in bf16 and fp16, packed batches",
         {"cuda": 90, "cpu": 25}, conformance_argv, conformance_figures),
    Step("attention_implementations",
         "Every attn_implementation of every architecture, forward + backward, bf16; FlexAttention in fp32 and head dim 128",
         {"cuda": 110, "cpu": 30}, lambda ctx, d: worker_argv(ctx, d, "attention_implementations"), sweep_figures),
    Step("attention_switch", "Attention-switch benchmark: training, ours against transformers, MFU",
         {"cuda": 90, "cpu": 25}, attention_switch_argv, attention_switch_figures,
         module="benchmarks/benchmark_attention_switch.py", flags=("--device", "--dtype", "--autocast", "--budget-s"),
         mfu=attention_switch_mfu),
    Step("long_context", "Long-context benchmark: training, Longformer against full SDPA and transformers, MFU",
         {"cuda": 60, "cpu": 25}, long_context_argv, long_context_figures,
         module="benchmarks/benchmark_long_context.py", flags=("--device", "--dtype", "--autocast", "--budget-s"),
         mfu=long_context_mfu),
    Step("packing", "Packed (padding-free) batches against padded ones, training throughput",
         {"cuda": 40, "cpu": 20}, packing_argv, packing_figures,
         module="benchmarks/benchmark_packing.py", flags=("--device", "--dtype")),
    Step("learning", "Every architecture learns a small synthetic task (accuracy threshold)", {"cuda": 40, "cpu": 30},
         lambda ctx, d: worker_argv(ctx, d, "learning"), learning_figures),
    # Last: one GPU (the usual loan) skips it at once; 2+ GPUs start NCCL ranks (about 10 s of the 20).
    Step("sequence_parallel", "Sequence parallelism (DeepSpeed Ulysses) on 2-4 GPUs equals one process",
         {"cuda": 20, "cpu": 40}, sequence_parallel_argv, sequence_parallel_figures),
]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Running the steps
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    name: str
    title: str
    status: str  # ok, failed, timeout, not run
    seconds: float = 0.0
    cpu_s: float = 0.0  # CPU time of the step's processes (user + system): its cost on an idle machine
    limit_s: float = 0.0
    returncode: int | None = None
    command: str = ""
    note: str = ""
    mfu: str = "-"  # the best model FLOPs utilisation the step measured (steps that time training), and where
    figures: list[str] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)


def missing_flags(step: Step) -> list[str]:
    """The options of ``step.flags`` that ``step.module``'s command line does not define."""
    if step.module is None:
        return []
    source = (REPO_ROOT / step.module).read_text()
    return [flag for flag in step.flags if not re.search(rf"""add_argument\(\s*["']{re.escape(flag)}["']""", source)]


def run_step(step: Step, ctx: Context, limit_s: float, env: dict[str, str]) -> StepResult:
    step_dir = ctx.run_dir / step.name
    step_dir.mkdir(parents=True, exist_ok=True)
    log_path = ctx.run_dir / f"{step.name}.log"
    result = StepResult(step.name, step.title, "not run", limit_s=limit_s)
    missing = missing_flags(step)
    if missing:
        result.note = (
            f"{step.module} has no {', '.join(missing)} option yet: step not run (its command line needs "
            f"{' '.join(step.flags)})"
        )
        log_path.write_text(result.note + "\n")
        return result
    ctx = Context(ctx.device, ctx.run_dir, ctx.python, limit_s)
    argv = step.argv(ctx, step_dir)
    result.command = " ".join(argv)
    print(f"[{time.strftime('%H:%M:%S')}] {step.name}: up to {limit_s:.0f} s: {result.command}", flush=True)
    start, cpu_start = time.perf_counter(), _children_cpu_s()
    with log_path.open("w") as log:
        log.write(f"$ {result.command}\n")
        log.flush()
        # A session of its own: past the limit the whole group goes (benchmarks start a process per cell).
        process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            result.returncode = process.wait(timeout=limit_s)
            result.status = "ok" if result.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            result.status = "timeout"
            result.note = f"stopped at its limit of {limit_s:.0f} s; the figures are what it finished"
            _stop(process)
    result.seconds, result.cpu_s = time.perf_counter() - start, _children_cpu_s() - cpu_start
    text = log_path.read_text(errors="replace")
    if result.status != "ok":
        result.log_tail = text.splitlines()[-LOG_TAIL_LINES:]
    try:
        result.figures = step.figures(step_dir, text)
        if step.mfu is not None:
            result.mfu = step.mfu(step_dir, text)
    except Exception as error:  # noqa: BLE001 - a figure that cannot be read must not lose the step's status
        result.figures = [f"(figures unreadable: {type(error).__name__}: {error})"]
    print(f"[{time.strftime('%H:%M:%S')}] {step.name}: {result.status} in {result.seconds:.0f} s", flush=True)
    return result


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stop(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def write_summary(run_dir: Path, header: dict, results: list[StepResult]) -> str:
    lines = [
        f"# gpu-check: {header['device']}, {header['started']}",
        "",
        f"- machine: {header['machine']}; python {header['python']}",
        f"- wheels put on the path: {', '.join(header['wheels_used']) or 'none'}",
        f"- wheels left out: {', '.join(header['wheels_left_out']) or 'none'}",
        f"- total {header['total_s']:.0f} s of a {header['cap_s']:.0f} s cap; {header['git']}",
        "",
        "| step | status | seconds | CPU s | limit s | MFU (best cell) | note |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.cpu_s:.0f} | {r.limit_s:.0f} | {r.mfu} | {r.note} |"
        )
    for r in results:
        lines += [
            "",
            f"## {r.name}: {r.title}",
            "",
            f"Status: **{r.status}** ({r.seconds:.0f} s). Log: `{r.name}.log`.",
        ]
        if r.command:
            lines += ["", f"`{r.command}`"]
        if r.figures:
            lines += ["", *r.figures]
        if r.log_tail:
            lines += ["", "Last lines of the log:", "", "```", *r.log_tail, "```"]
    text = "\n".join(lines) + "\n"
    (run_dir / "summary.md").write_text(text)
    (run_dir / "summary.json").write_text(json.dumps({**header, "steps": [vars(r) for r in results]}, indent=1))
    return text


def git_state() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "git: unavailable"
    return f"git {out.stdout.strip()}" if out.returncode == 0 else "git: not a checkout"


def main_run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    cap = args.budget_s if args.budget_s is not None else GLOBAL_CAP_S[args.device]
    run_dir = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}-{args.device}"
    run_dir.mkdir(parents=True, exist_ok=True)
    choices = choose_wheels(args.wheels)
    extra = [unpack_wheel(c.path) for c in choices if c.used]
    env = step_environment(extra)
    env["GPU_CHECK_WHEELS"] = json.dumps({c.name: c.path.name for c in choices if c.used})
    ctx = Context(device=args.device, run_dir=run_dir, python=sys.executable)
    steps = [s for s in STEPS if not args.steps or s.name in args.steps]
    unknown = set(args.steps or ()) - {s.name for s in STEPS}
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {[s.name for s in STEPS]}")
    print(f"gpu-check on {args.device}: {len(steps)} steps, {cap:.0f} s cap, results in {run_dir}", flush=True)
    for c in choices:
        print(f"  wheel {c.path.name}: {'on the path' if c.used else 'left out'} ({c.reason})", flush=True)
    results = []
    planned = 0.0  # the sum of the limits so far: a step also gets what the steps before it left unused
    for i, step in enumerate(steps):
        elapsed = time.perf_counter() - started
        left = cap - elapsed
        reserve = MIN_STEP_S[args.device] * (len(steps) - i - 1)
        planned += step.limit_s[args.device] * args.limit_scale
        limit = min(max(planned - elapsed, step.limit_s[args.device] * args.limit_scale), left - reserve)
        if limit < MIN_STEP_S[args.device] / 2:
            results.append(StepResult(step.name, step.title, "not run", note="global time cap reached"))
            continue
        results.append(run_step(step, ctx, limit, env))
    header = {
        "device": args.device,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - (time.perf_counter() - started))),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
        "python": f"{sys.executable} {platform.python_version()}",
        "wheels_used": [f"{c.path.name} ({c.reason})" for c in choices if c.used],
        "wheels_left_out": [f"{c.path.name} ({c.reason})" for c in choices if not c.used],
        "total_s": time.perf_counter() - started,
        "cap_s": cap,
        "git": git_state(),
    }
    write_summary(run_dir, header, results)
    width = max(len(r.name) for r in results)
    print(f"\nsummary: {run_dir / 'summary.md'}")
    for r in results:
        print(f"  {r.name:<{width}}  {r.status:<8} {r.seconds:6.0f} s ({r.cpu_s:4.0f} s CPU)  {r.note}")
    return 0 if all(r.status == "ok" for r in results) else 1


# ----------------------------------------------------------------------------------------------------------------
# Workers (run as steps, with the repository and the wheels on the path; these import torch)
# ----------------------------------------------------------------------------------------------------------------

# Libraries the steps import besides torch and transformers, and what for (reported, never installed). transformers
# is imported (with tokenizers, huggingface_hub and safetensors, whose versions it checks); these are only looked up.
LIBRARIES = {
    "tokenizers": "transformers",
    "huggingface_hub": "transformers",
    "safetensors": "transformers",
    "accelerate": "transformers' Trainer (tests, LRA)",
    "PIL": "Swin's image processor",
    "pytest": "the conformance step",
    "psutil": "the long-context and packing benchmarks",
    "matplotlib": "the benchmarks' plots",
}
DISTRIBUTIONS = {"PIL": "pillow"}


def unmet_requirements(name: str) -> list[str]:
    """The requirements of distribution ``name`` (as found on the path; extras left out) that the installed
    libraries do not meet, one line each."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["packaging is missing: cannot check what transformers requires"]
    try:
        requires = importlib.metadata.requires(name) or []
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return [f"{name} is not installed"]
    unmet = []
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        found = installed_version(requirement.name)
        if found is None or not requirement.specifier.contains(found, prereleases=True):
            unmet.append(f"{name} {version} needs {requirement.name}{requirement.specifier}, found {found or 'none'}")
    return unmet


def library_versions(warnings: list[str]) -> dict[str, str]:
    """``{library: "version (folder)"}`` of every library of :data:`LIBRARIES` (``"missing"``, with a line in
    ``warnings``, for one that is not installed)."""
    import importlib.util

    libraries = {}
    for name, purpose in LIBRARIES.items():
        spec = importlib.util.find_spec(name)
        if spec is None:
            libraries[name] = "missing"
            warnings.append(f"{name} (for {purpose}) is missing")
            continue
        try:
            version = importlib.metadata.version(DISTRIBUTIONS.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        libraries[name] = f"{version} ({Path(spec.origin).parent})"
    return libraries


def smoke_forward(device: str, info: dict, problems: list[str]) -> None:
    """Import hf_xformers and run one forward and backward of a small Longformer in bfloat16 autocast on ``device``:
    where the package comes from and the loss go into ``info``, a failure or a non-finite loss into ``problems``."""
    import torch

    try:
        import hf_xformers

        info["hf_xformers"] = str(Path(hf_xformers.__file__).parent)
        torch.manual_seed(0)
        config = hf_xformers.HfxLongformerConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            attention_window=16, max_position_embeddings=258,
        )  # fmt: skip
        model = hf_xformers.HfxLongformerForMaskedLM(config).to(device)
        ids = torch.randint(5, 100, (2, 256), device=device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not torch.isfinite(loss):
            problems.append(f"the smoke forward's loss is {loss.item()}")
        info["smoke"] = f"HfxLongformerForMaskedLM, 256 tokens, bf16 autocast: loss {loss.item():.3f}, backward ok"
    except Exception as error:  # noqa: BLE001
        problems.append(f"import hf_xformers / smoke forward: {type(error).__name__}: {error}")


def environment_worker(device: str, out: Path) -> int:
    """Versions and where each library comes from, the device, the floors, and one forward of a small Longformer in
    bfloat16 autocast on ``device``; ``environment.json``. Exit 1 on a problem that stops the other steps."""
    problems, warnings, info = [], [], {}
    info["python"] = platform.python_version()
    info["wheels"] = json.loads(os.environ.get("GPU_CHECK_WHEELS", "{}"))
    info["torch_floor"], info["transformers_floor"] = pyproject_floor("torch"), pyproject_floor("transformers")
    import torch

    info["torch"], info["cuda"], info["device"] = torch.__version__, torch.version.cuda, device
    if version_tuple(torch.__version__) < version_tuple(info["torch_floor"]):
        problems.append(f"torch {torch.__version__} is below pyproject's floor {info['torch_floor']}")
    if device == "cuda":
        if not torch.cuda.is_available():
            problems.append("torch.cuda.is_available() is False")
        else:
            props = torch.cuda.get_device_properties(0)
            info["device_name"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
            info["bf16_supported"] = torch.cuda.is_bf16_supported()
    else:
        info["device_name"] = platform.processor() or platform.machine()
    # What the transformers on the path requires, checked before importing it: its import fails on a library that is
    # too old, and this says which one and which wheel would fix it.
    for unmet in unmet_requirements("transformers"):
        problems.append(f"{unmet}: add a wheel of a release it accepts to .whl/")
    try:
        import transformers
    except Exception as error:  # noqa: BLE001 - any import failure is a finding to report
        transformers = None
        problems.append(f"import transformers: {type(error).__name__}: {error}")
    info["libraries"] = library_versions(warnings)
    info["transformers"] = getattr(transformers, "__version__", "unavailable")
    info["transformers_from"] = (
        "the wheel " + info["wheels"]["transformers"]
        if "transformers" in info["wheels"]
        else "this Python's site-packages"
    )
    if transformers is not None and version_tuple(transformers.__version__) < version_tuple(info["transformers_floor"]):
        problems.append(
            f"transformers {transformers.__version__} is below our floor {info['transformers_floor']}: put the pinned "
            "wheel in .whl/ (and carry it)"
        )
    if transformers is not None:
        smoke_forward(device, info, problems)
    info["problems"], info["warnings"] = problems, warnings
    (out / "environment.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    if device == "cuda":
        try:
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
            (out / "nvidia-smi.txt").write_text(smi)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return 1 if problems else 0


# Sizes of the attention_implementations sweep: on CUDA, lengths where every sparse pattern is sparse (many windows,
# blocks and chunks); on the CPU the tiny sizes of the test suite.
SWEEP_SIZES = {
    "cuda": dict(batch=2, length=2048, hidden=256, heads=4, layers=2, ffn=1024, vocab=1000, window=128, block=64,
                 linformer_k=256, features=128, chunk=64, axial=(32, 64), mem=256, image=224, patch=4, swin_window=7,
                 swin_dim=96, timed=3),
    "cpu": dict(batch=2, length=32, hidden=32, heads=4, layers=2, ffn=64, vocab=100, window=4, block=4, linformer_k=16,
                features=16, chunk=8, axial=(4, 8), mem=16, image=32, patch=2, swin_window=4, swin_dim=16, timed=0),
}  # fmt: skip
# An implementation passes when its outputs (real positions) are within this mean relative error of the float32
# eager outputs, and its gradients point the same way (cosine): bfloat16 keeps 8 significant bits, and a few hashed
# tokens may land in other LSH buckets than in float32, so the measure is a mean, with the largest deviation reported.
SWEEP_MEAN_TOLERANCE = 3e-2
SWEEP_MIN_COSINE = 0.98


def sweep_models(s: dict) -> dict:
    """Builders of every architecture's base model at sizes ``s``, no dropout (outputs comparable across
    implementations), seeded randomness fixed (LSH hashes, random features, random blocks)."""
    import hf_xformers as H

    L, common = s["length"], dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                                 num_attention_heads=s["heads"], intermediate_size=s["ffn"], hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)  # fmt: skip
    return {
        "longformer": lambda: H.HfxLongformerModel(
            H.HfxLongformerConfig(**common, attention_window=s["window"], max_position_embeddings=L + 2)
        ),
        "bigbird": lambda: H.HfxBigBirdModel(
            H.HfxBigBirdConfig(**common, block_size=s["block"], num_random_blocks=3, max_position_embeddings=L)
        ),
        "linformer": lambda: H.HfxLinformerModel(
            H.HfxLinformerConfig(**common, linformer_k=s["linformer_k"], max_position_embeddings=L + 2)
        ),
        "performer": lambda: H.HfxPerformerModel(
            H.HfxPerformerConfig(**common, num_random_features=s["features"], max_position_embeddings=L + 2)
        ),
        "reformer": lambda: H.HfxReformerModel(
            H.HfxReformerConfig(
                vocab_size=s["vocab"],
                hidden_size=s["hidden"],
                num_attention_heads=s["heads"],
                attention_head_size=s["hidden"] // s["heads"],
                feed_forward_size=s["ffn"],
                attn_layers=["local", "lsh"],
                local_attn_chunk_length=s["chunk"],
                lsh_attn_chunk_length=s["chunk"],
                num_hashes=2,
                hash_seed=0,
                axial_pos_shape=list(s["axial"]),
                axial_pos_embds_dim=[s["hidden"] // 4, s["hidden"] - s["hidden"] // 4],
                max_position_embeddings=L,
                hidden_dropout_prob=0.0,
                local_attention_probs_dropout_prob=0.0,
                lsh_attention_probs_dropout_prob=0.0,
                pad_token_id=1,
                eos_token_id=None,
            )
        ),  # fmt: skip
        "transfo_xl": lambda: H.HfxTransfoXLModel(
            H.HfxTransfoXLConfig(
                vocab_size=s["vocab"],
                cutoffs=[],
                div_val=1,
                d_model=s["hidden"],
                n_head=s["heads"],
                d_head=s["hidden"] // s["heads"],
                d_inner=s["ffn"],
                n_layer=s["layers"],
                mem_len=s["mem"],
                clamp_len=0,
                dropout=0.0,
                dropatt=0.0,
            )
        ),  # fmt: skip
        "universal": lambda: H.HfxUniversalModel(
            H.HfxUniversalConfig(**common, use_act=False, max_position_embeddings=L)
        ),
        "swin": lambda: H.HfxSwinModel(
            H.HfxSwinConfig(
                image_size=s["image"],
                patch_size=s["patch"],
                embed_dim=s["swin_dim"],
                depths=[2, 2],
                num_heads=[s["heads"], 2 * s["heads"]],
                window_size=s["swin_window"],
                drop_path_rate=0.0,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),  # fmt: skip
    }


# Besides the bf16 cells of every implementation, FlexAttention's GPU kernels in the cases that exhausted shared
# memory or that their tile choice (ops/attention_switch.flex_kernel_options) changes: float32 inputs for every
# architecture that offers it, and head dim 128 (half the heads of the same width) in bf16 and float32 for the two
# table-built BlockMasks (Longformer's band; BigBird's blocks coarsened to 128). In this order: a run stopped at its
# budget keeps the earlier ones.
FLEX_ARCHS = ("longformer", "bigbird", "reformer", "universal", "swin")
WIDE_HEAD_ARCHS = ("longformer", "bigbird")


def sweep_cells(models_supporting: dict[str, tuple[bool, bool]]) -> list[tuple[str, str, str, int]]:
    """The sweep's cells in order, ``(arch, implementation, precision, heads_factor)`` from ``{arch: (supports sdpa,
    supports flex)}``: ``precision`` "bf16" (autocast) or "fp32"; ``heads_factor`` 1 (the sizes' heads) or 2 (half
    as many heads, twice the head dim)."""
    cells = [(arch, "eager", "bf16", 1) for arch in models_supporting]
    cells += [(arch, "sdpa", "bf16", 1) for arch, (sdpa, _) in models_supporting.items() if sdpa]
    flex = [arch for arch, (_, supports) in models_supporting.items() if supports]
    cells += [(arch, "flex_attention", "bf16", 1) for arch in flex]
    cells += [(arch, "flex_attention", "fp32", 1) for arch in flex if arch in FLEX_ARCHS]
    cells += [(arch, "flex_attention", p, 2) for arch in WIDE_HEAD_ARCHS if arch in flex for p in ("bf16", "fp32")]
    return cells


def sweep_settings(device: str, s: dict) -> str:
    """What the attention_implementations sweep measures with the sizes ``s`` of ``device``, in words."""
    settings = (
        f"batch {s['batch']} x {s['length']} tokens (second row 1/4 padding; Swin {s['image']} px images), hidden "
        f"{s['hidden']}, {s['layers']} layers, {s['heads']} heads (head dim {s['hidden'] // s['heads']}; 'head dim' "
        f"{2 * s['hidden'] // s['heads']}: half the heads); bf16: autocast, fp32: float32 inputs, both against float32 "
        f"eager; eval mode; step = forward + backward, median of {s['timed']} after the first call (which compiles "
        f"FlexAttention); ok: mean relative error <= {SWEEP_MEAN_TOLERANCE}, gradient cosine >= {SWEEP_MIN_COSINE}, all "
        "finite"
    )
    if device == "cpu":
        settings += "; on the CPU FlexAttention has no backward, so flex_attention cells run the sdpa path"
    return settings


class SweepBench:
    """The attention_implementations sweep's fixed inputs on ``device`` (a batch whose second row is a quarter
    padding, images for Swin), its models (built once per head count) and their float32 eager references."""

    def __init__(self, device: str, sizes: dict) -> None:
        import torch

        self.torch, self.device, self.s = torch, device, sizes
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, sizes["vocab"], (sizes["batch"], sizes["length"]), generator=generator)
        self.mask = torch.ones_like(self.ids)
        self.mask[1, -sizes["length"] // 4 :] = 0
        self.ids[1, -sizes["length"] // 4 :] = 1
        self.pixels = torch.randn(sizes["batch"], 3, sizes["image"], sizes["image"], generator=generator)
        self.models, self.references = {}, {}

    def model_for(self, arch: str, factor: int):
        """The model of ``arch`` with ``s['heads'] // factor`` heads (built once, perturbed from a fixed seed)."""
        torch = self.torch
        if (arch, factor) not in self.models:
            sizes = dict(self.s, heads=self.s["heads"] // factor)
            torch.manual_seed(0)
            model = sweep_models(sizes)[arch]().eval()
            weights = torch.Generator().manual_seed(factor)
            with torch.no_grad():  # as the tests do: no bias left at 0, no LayerNorm at 1, every tensor matters
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=weights))
            self.models[(arch, factor)] = model.to(self.device)
        return self.models[(arch, factor)]

    def inputs(self, arch: str) -> dict:
        if arch == "swin":
            return {"pixel_values": self.pixels.to(self.device)}
        return {"input_ids": self.ids.to(self.device), "attention_mask": self.mask.to(self.device)}

    def real_rows(self, arch: str, hidden):
        """Which positions of ``last_hidden_state`` ``(batch, positions, hidden)`` are real tokens."""
        if arch == "swin":
            return self.torch.ones(hidden.shape[:2], dtype=self.torch.bool, device=hidden.device)
        return self.mask.to(self.device).bool()

    def step(self, model, arch: str, autocast: bool):
        """One forward + backward; ``last_hidden_state`` (float32) and the flattened gradients."""
        torch = self.torch
        model.zero_grad(set_to_none=True)
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=autocast):
            hidden = model(**self.inputs(arch)).last_hidden_state
        hidden = hidden.float()
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).to(self.device)
        (hidden * weights * self.real_rows(arch, hidden)[..., None]).sum().div(hidden.numel()).backward()
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        return hidden.detach(), grads

    def timed_step(self, model, arch: str, autocast: bool):
        """:meth:`step`, and the seconds it took (the device synchronised)."""
        start = time.perf_counter()
        hidden, grads = self.step(model, arch, autocast)
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        return hidden, grads, time.perf_counter() - start

    def measure(self, cell: dict, arch: str, impl: str, precision: str, factor: int) -> None:
        """Fill ``cell`` with one (architecture, implementation, precision, head dim) case: its first call's and
        median step's time, peak memory, and its errors against the float32 eager run of the same weights."""
        torch = self.torch
        model = self.model_for(arch, factor)
        if (arch, factor) not in self.references:
            model.set_attn_implementation("eager")
            self.references[(arch, factor)] = self.step(model, arch, autocast=False)
        ref_hidden, ref_grads = self.references[(arch, factor)]
        model.set_attn_implementation(impl)
        autocast = precision == "bf16"
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        hidden, grads, cell["first_call_s"] = self.timed_step(model, arch, autocast)
        times = [self.timed_step(model, arch, autocast)[2] for _ in range(self.s["timed"])]
        cell["step_ms"] = 1000 * (sorted(times)[len(times) // 2] if times else cell["first_call_s"])
        cell["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20) if self.device == "cuda" else None
        real = self.real_rows(arch, ref_hidden)
        diff = (hidden - ref_hidden).abs()[real]
        cell["mean_rel_error"] = (diff.mean() / ref_hidden.abs()[real].mean()).item()
        cell["max_deviation"] = (diff.max() / ref_hidden.abs()[real].max().clamp(min=1.0)).item()
        cell["grad_cosine"] = torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0).item()
        finite = bool(torch.isfinite(hidden).all() and torch.isfinite(grads).all())
        good = finite and cell["mean_rel_error"] <= SWEEP_MEAN_TOLERANCE and cell["grad_cosine"] >= SWEEP_MIN_COSINE
        cell["status"] = "ok" if good else ("not finite" if not finite else "too far from float32 eager")


def attention_implementations_worker(device: str, out: Path, budget_s: float | None = None) -> int:
    """Every architecture's base model under each ``attn_implementation`` it accepts: forward and backward of a fixed
    projection of ``last_hidden_state`` under bfloat16 autocast (eval mode: no dropout, fixed random patterns), on a
    batch whose second row is a quarter padding, against the float32 ``"eager"`` run of the same weights; then
    FlexAttention on float32 inputs and at twice the head dim (:func:`sweep_cells`). Cells in order eager, sdpa,
    flex_attention (FlexAttention compiles a kernel per shape: its cells come last, so that a run stopped at its limit
    has the others); past ``budget_s`` seconds the cells left are recorded as skipped. ``attention_implementations.json``
    is rewritten after every cell."""
    import torch

    started = time.perf_counter()
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is float32
        torch.backends.cudnn.allow_tf32 = False
    s = SWEEP_SIZES[device]
    result = {"settings": sweep_settings(device, s), "cells": []}
    path = out / "attention_implementations.json"
    bench = SweepBench(device, s)
    supporting = {}
    for arch in sweep_models(s):
        try:
            model = bench.model_for(arch, 1)
            supporting[arch] = (model._supports_sdpa, model._supports_flex_attn)
        except Exception as error:  # noqa: BLE001 - a model that cannot be built is a finding; the others go on
            result["cells"].append({"arch": arch, "implementation": "-", "status": "error", "error": _short(error)})

    for arch, impl, precision, factor in sweep_cells(supporting):
        cell = {"arch": arch, "implementation": impl, "precision": precision,
                "head_dim": factor * s["hidden"] // s["heads"]}  # fmt: skip
        if budget_s is not None and time.perf_counter() - started > budget_s:
            cell["status"] = SKIPPED
            result["cells"].append(cell)
            continue
        try:
            bench.measure(cell, arch, impl, precision, factor)
        except Exception as error:  # noqa: BLE001 - one failing cell must not end the sweep
            cell.update(status="error", error=_short(error))
        result["cells"].append(cell)
        path.write_text(json.dumps(result, indent=1))
        print(json.dumps(cell), flush=True)
    path.write_text(json.dumps(result, indent=1))
    return 0 if all(c["status"] in ("ok", SKIPPED) for c in result["cells"]) else 1


# ----- the learning check: every architecture fits a small synthetic task ------------------------------------------

# 4 classes (chance 25 %, the task's labels are balanced); a model has learned the task at this test accuracy.
LEARNING_CLASSES = 4
LEARNING_THRESHOLD = 0.9
# Sizes of the learning check: CUDA trains every architecture of the Long Range Arena's small setting (2 layers,
# hidden 64) at 1,024 tokens (Swin: 32 x 32 one-channel images); the dry run Longformer alone at 64 tokens.
LEARNING_SIZES = {
    "cuda": dict(length=1024, image=32, steps=120, batch=32, eval=512, lr=3e-3, archs="all"),
    "cpu": dict(length=64, image=16, steps=30, batch=16, eval=128, lr=3e-3, archs=("hfx-longformer",)),
}
# The LRA models' ordering puts Longformer first: on CUDA it trains under its FlexAttention default (no dropout).
LEARNING_ORDER = ("hfx-longformer", "hfx-bigbird", "hfx-reformer", "hfx-performer", "hfx-linformer", "hfx-universal",
                  "hfx-transfo-xl", "hfx-swin")  # fmt: skip


def learning_batch(n: int, length: int, generator) -> tuple:
    """``n`` sequences of ``length`` ids with their labels: noise ids 1-64, and a quarter of the positions (drawn per
    sequence) holding the marker of the sequence's class (ids 100, 150, 200, 250). The model must find the markers
    among the noise: mean pooling over attention outputs reads them. As images (Swin: ids are pixel values 1-256),
    the class is the brightness of the marked pixels."""
    import torch

    ids = torch.randint(1, 65, (n, length), generator=generator)
    labels = torch.randint(0, LEARNING_CLASSES, (n,), generator=generator)
    marked = torch.rand(n, length, generator=generator) < 0.25
    ids = torch.where(marked, (100 + 50 * labels)[:, None].expand(-1, length), ids)
    return ids, labels


def learning_worker(device: str, out: Path, budget_s: float | None = None) -> int:
    """Trains each architecture (the Long Range Arena's small models, mean pooling, no dropout) on
    :func:`learning_batch` data for a fixed number of AdamW steps under bf16 autocast on CUDA (float32 on the CPU),
    then measures the accuracy on held-out sequences; ``learning.json``. Exit 1 when an architecture stays below
    :data:`LEARNING_THRESHOLD`; past ``budget_s`` seconds the architectures left are recorded as skipped."""
    import torch

    from benchmarks.lra.models import ARCHS, VISION_ARCHS, build_model

    started = time.perf_counter()
    s = LEARNING_SIZES[device]
    archs = [a for a in LEARNING_ORDER if a in ARCHS] if s["archs"] == "all" else list(s["archs"])
    autocast = device == "cuda"
    result = {
        "settings": (
            f"{LEARNING_CLASSES} balanced classes (chance 25 %): a quarter of the positions hold the class's marker "
            f"among noise ids; {s['steps']} AdamW steps (lr {s['lr']}) of batch {s['batch']} x {s['length']} tokens "
            f"(Swin: {s['image']} x {s['image']} images of the same ids), "
            f"{'bf16 autocast' if autocast else 'float32'}, no dropout; LRA small models (2 layers, hidden 64, mean "
            f"pooling); test accuracy on {s['eval']} held-out sequences; learned: accuracy >= {LEARNING_THRESHOLD:.0%}"
        ),
        "threshold": LEARNING_THRESHOLD,
        "cells": [],
    }
    path = out / "learning.json"
    for arch in archs:
        cell = {"arch": arch}
        if budget_s is not None and time.perf_counter() - started > budget_s:
            result["cells"].append({**cell, "status": SKIPPED})
            continue
        try:
            vision = arch in VISION_ARCHS
            length = s["image"] ** 2 if vision else s["length"]
            model, _ = build_model(
                arch, "listops", vocab_size=257, length=length, num_labels=LEARNING_CLASSES,
                image_shape=(s["image"], s["image"]) if vision else None, dropout=0.0, seed=0,
            )  # fmt: skip
            model = model.to(device).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"])
            generator = torch.Generator().manual_seed(0)
            start = time.perf_counter()
            losses = []
            for _ in range(s["steps"]):
                ids, labels = learning_batch(s["batch"], length, generator)
                ids, labels = ids.to(device), labels.to(device)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach())
            model.eval()
            ids, labels = learning_batch(s["eval"], length, torch.Generator().manual_seed(1))
            correct = 0
            # In training-sized batches: the shapes FlexAttention was compiled for (no recompilation for a new batch).
            for rows, row_labels in zip(ids.split(s["batch"]), labels.split(s["batch"])):
                rows = rows.to(device)
                with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                    logits = model(input_ids=rows, attention_mask=torch.ones_like(rows)).logits
                correct += int((logits.argmax(-1).cpu() == row_labels).sum())
            accuracy = correct / len(labels)
            cell.update(
                accuracy=accuracy, steps=s["steps"], seconds=time.perf_counter() - start,
                first_loss=losses[0].item(), final_loss=losses[-1].item(),
                status="ok" if accuracy >= LEARNING_THRESHOLD else "below threshold",
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001 - one failing architecture must not end the check
            cell.update(status="error", error=_short(error))
        result["cells"].append(cell)
        path.write_text(json.dumps(result, indent=1))
        print(json.dumps(cell), flush=True)
    path.write_text(json.dumps(result, indent=1))
    return 0 if all(c["status"] in ("ok", SKIPPED) for c in result["cells"]) else 1


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) < 400 else text[:400] + " ..."


WORKERS = {
    "environment": lambda device, out, budget_s=None: environment_worker(device, out),
    "attention_implementations": attention_implementations_worker,
    "learning": learning_worker,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run at tiny sizes")
    p.add_argument(
        "--out", type=Path, default=REPO_ROOT / "gpu_check_results", help="results go to OUT/<date>-<device>/"
    )
    p.add_argument("--steps", nargs="+", default=None, help=f"run only these steps: {', '.join(s.name for s in STEPS)}")
    p.add_argument("--budget-s", type=float, default=None,
                   help="global cap in seconds (default: 480 cuda, 115 cpu); a worker's own budget")  # fmt: skip
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every step's own time limit by this")
    p.add_argument("--wheels", type=Path, default=WHEEL_DIR, help="folder of wheels to put on the path where needed")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        args.out.mkdir(parents=True, exist_ok=True)
        return WORKERS[args.worker](args.device, args.out, args.budget_s)
    return main_run(args)


if __name__ == "__main__":
    sys.exit(main())
