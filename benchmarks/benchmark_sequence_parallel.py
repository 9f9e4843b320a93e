#!/usr/bin/env python
"""Sequence parallelism (DeepSpeed Ulysses) on the CPU: per-rank peak memory and training-step time against length.

For each rank count in ``--ranks`` (default 1, 2 and 4) this script launches ``torch.distributed.run --standalone
--nproc_per_node=N -m benchmarks.benchmark_sequence_parallel --worker ...`` on gloo (``DS_ACCELERATOR=cpu``). With
N > 1 every rank sets up DeepSpeed's sequence-parallel group over all ranks
(``parallel_state_sp.initialize_sequence_parallel(N)``) and calls the model in training mode on its slice of the
tokens (rank ``r``: tokens ``r * L/N .. (r + 1) * L/N``, as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` cuts them;
see ``hf_xformers/ops/sequence_parallel.py``); with N = 1 there is no group: the plain model on the whole row.

A step is forward + backward of ``HfxLongformerForMaskedLM`` (``--arch``: also hfx-bigbird, hfx-performer) on one
row of ``L`` tokens with masked-LM labels on 15% of them, gradients set to None before each step. Per rank:

* memory = the growth of the process's peak RSS (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` just
  before the step) over its RSS just before the step: model, gradients-to-be excluded, what the step allocates
  (activations, gradients, the collectives' buffers) included. The workers run with a fixed glibc
  ``MALLOC_MMAP_THRESHOLD_`` so that large tensors freed by one step are returned to the system, not kept in the heap
  to hide the next step's growth. The table shows the largest rank's value, the largest over the timed steps;
* time = the slowest rank's step (ranks start together after a barrier), median of ``--repeats`` steps after
  ``--warmup`` steps.

Precision (the flags of every benchmark here, :mod:`benchmarks.precision`; a step is training): ``--dtype bfloat16
--autocast`` runs what ``Trainer(bf16=True)`` runs (float32 weights, the forward under ``torch.autocast``: the
projections, the all-to-all exchanges and the mechanisms in bfloat16), ``--dtype bfloat16`` alone trains bfloat16
weights. Results other than float32 go to files with a suffix (``_bf16_autocast``).

``--budget_mb``: for each rank count, the longest tested length whose per-rank peak fits the budget, and a linear
extrapolation (least squares over the measured lengths) of the length whose peak would reach it.

    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_sequence_parallel --ranks 1 2 4 --lengths 1024 2048 4096 8192

Writes ``sequence_parallel_{arch}_h{hidden}_l{layers}[_v{vocab}]{precision suffix}.{json,md}`` (``_v``: a
``--vocab`` other than 1000) to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.measurement import BackgroundLoad, PeakRSS, git_describe, rss_kib
from benchmarks.precision import AUTOCAST_HELP, DTYPE_HELP, DTYPES, Precision
from examples.utils_examples import script_parser

ROOT = Path(__file__).resolve().parent.parent

ARCHS = ("hfx-longformer", "hfx-bigbird", "hfx-performer")
# --window per architecture: Longformer's attention_window, BigBird's block_size, Performer's random features.
WINDOW_DEFAULT = {"hfx-longformer": 128, "hfx-bigbird": 64, "hfx-performer": 128}
WINDOW_MEANING = {"hfx-longformer": "attention_window", "hfx-bigbird": "block_size (3 random blocks)",
                  "hfx-performer": "num_random_features"}  # fmt: skip
VOCAB_DEFAULT = 1000  # small, so that the encoder's memory shows; RoBERTa's 50,265 makes the logits dominate
MALLOC_MMAP_THRESHOLD = "131072"  # fixed: glibc then maps every tensor over 128 KiB and unmaps it when freed


# ----- worker: one rank -------------------------------------------------------------------------------------------


def build_model(spec: dict, max_length: int):
    import torch

    import hf_xformers as h

    common = dict(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"], intermediate_size=spec["intermediate"],
        hidden_dropout_prob=spec["dropout"], attention_probs_dropout_prob=spec["dropout"], type_vocab_size=1,
    )  # fmt: skip
    torch.manual_seed(spec["seed"])
    if spec["arch"] == "hfx-longformer":
        config = h.HfxLongformerConfig(
            **common, attention_window=spec["window"], max_position_embeddings=max_length + 2
        )
        return h.HfxLongformerForMaskedLM(config).train()
    if spec["arch"] == "hfx-bigbird":
        config = h.HfxBigBirdConfig(**common, attention_type="block_sparse", block_size=spec["window"],
                                    num_random_blocks=3, max_position_embeddings=max_length)  # fmt: skip
        return h.HfxBigBirdForMaskedLM(config).train()
    config = h.HfxPerformerConfig(**common, num_random_features=spec["window"], max_position_embeddings=max_length + 2)
    return h.HfxPerformerForMaskedLM(config).train()


def batch_of(spec: dict, length: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(spec["seed"] + length)
    ids = torch.randint(5, spec["vocab"], (1, length), generator=g)
    labels = torch.randint(5, spec["vocab"], (1, length), generator=g)
    labels = labels.masked_fill(torch.rand(1, length, generator=g) >= 0.15, -100)
    labels[:, 0] = -100  # the label DeepSpeed's adapter drops
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def run_worker(spec: dict, out_path: str) -> None:
    """One rank: every length of ``spec`` (shortest first); rank 0 writes every rank's numbers to ``out_path``."""
    import torch

    torch.set_num_threads(spec["threads"])
    size = int(os.environ.get("WORLD_SIZE", "1"))
    dist = None
    if size > 1:
        import deepspeed
        import torch.distributed as dist
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        deepspeed.init_distributed(dist_backend="gloo")
        parallel_state_sp.initialize_sequence_parallel(size)
    rank = dist.get_rank() if dist else 0
    precision = Precision.from_record(spec)
    model = precision.prepare(build_model(spec, max(spec["lengths"])), training=True)
    params = sum(p.numel() for p in model.parameters())
    peak_mode = PeakRSS().mode
    rows = []
    for length in spec["lengths"]:
        if length % size:
            rows.append({"length": length, "status": f"length not divisible by {size} ranks"})
            continue
        cut = length // size
        batch = {k: v[:, rank * cut : (rank + 1) * cut] for k, v in batch_of(spec, length).items()}
        times, peaks, bases = [], [], []
        error = None
        for i in range(spec["warmup"] + spec["repeats"]):
            model.zero_grad(set_to_none=True)
            if dist:
                dist.barrier()
            base = rss_kib()
            peak = PeakRSS()
            start = time.perf_counter()
            try:
                with precision.context(training=True):  # autocast around the forward only, as Trainer
                    loss = model(**batch).loss
                loss.backward()
            except Exception as exc:  # noqa: BLE001 - reported per length; other lengths still run
                error = f"{type(exc).__name__}: {str(exc)[:500]}"
            elapsed = time.perf_counter() - start
            grew = peak.peak_bytes() / 2**20 - base / 1024
            if i >= spec["warmup"]:
                times.append(elapsed)
                peaks.append(grew)
                bases.append(base / 1024)
            if error:
                break
        rows.append({"length": length, "status": "error", "error": error} if error else
                    {"length": length, "status": "ok", "times_s": times, "peak_mib": peaks, "base_mib": bases})  # fmt: skip
    model.zero_grad(set_to_none=True)
    mine = {"rank": rank, "params": params, "peak_mode": peak_mode, "rows": rows}
    gathered = [mine]
    if dist:
        gathered = [None] * size
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"world_size": size, "ranks": gathered}, indent=1))
    if dist:
        dist.barrier()
        dist.destroy_process_group()


# ----- parent: launches, merging, table ---------------------------------------------------------------------------


def merge(launch: dict, ranks: int) -> list[dict]:
    """One row per length from every rank's numbers: peak = largest rank, largest timed step; time = per step the
    slowest rank, then the median over the steps."""
    out = []
    per_rank = [r["rows"] for r in launch["ranks"]]
    for i, first in enumerate(per_rank[0]):
        rows = [rows[i] for rows in per_rank]
        row = {"ranks": ranks, "length": first["length"]}
        bad = [r for r in rows if r["status"] != "ok"]
        if bad:
            out.append({**row, "status": bad[0]["status"], "error": bad[0].get("error")})
            continue
        steps = [max(r["times_s"][k] for r in rows) for k in range(len(first["times_s"]))]
        out.append({
            **row, "status": "ok", "time_s": statistics.median(steps), "times_s": steps,
            "peak_mib": max(max(r["peak_mib"]) for r in rows),
            "peak_mib_per_rank": [max(r["peak_mib"]) for r in rows],
            "base_mib_per_rank": [max(r["base_mib"]) for r in rows],
            "tokens_per_rank": first["length"] // ranks,
        })  # fmt: skip
    return out


def launch(spec: dict, ranks: int, timeout: float, idle_check_s: float = 1.0) -> dict:
    """One torch.distributed.run launch of ``ranks`` workers over every length; its merged rows (or an error row per
    length) and the machine's load before and after."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu",
           "MALLOC_MMAP_THRESHOLD_": MALLOC_MMAP_THRESHOLD,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        # 1 rank: a plain process (no group, no launcher); N ranks: torch.distributed.run's N processes.
        launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        cmd = [sys.executable, *launcher, "-m", "benchmarks.benchmark_sequence_parallel", "--worker", str(spec_path),
               str(out_path)]  # fmt: skip
        other = BackgroundLoad().other_share(idle_check_s) if idle_check_s > 0 else None
        load_before = os.getloadavg()
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            error = None if proc.returncode == 0 and out_path.exists() else (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
        wall = time.perf_counter() - start
        info = {"ranks": ranks, "wall_s": wall, "other_cpu_before": other, "loadavg_before": load_before,
                "loadavg_after": os.getloadavg()}  # fmt: skip
        if error:
            rows = [{"ranks": ranks, "length": n, "status": "error", "error": error} for n in spec["lengths"]]
            return {**info, "rows": rows, "error": error}
        result = json.loads(out_path.read_text())
    return {**info, "rows": merge(result, ranks), "params": result["ranks"][0]["params"],
            "peak_mode": result["ranks"][0]["peak_mode"]}  # fmt: skip


def budget_lengths(rows: list[dict], budget_mib: float) -> dict:
    """For one rank count: the longest measured length within ``budget_mib`` per rank, and the length at which a
    least-squares line through (length, peak) reaches it (None with fewer than two points or no growth)."""
    ok = [(r["length"], r["peak_mib"]) for r in rows if r["status"] == "ok"]
    fits = [n for n, mib in ok if mib <= budget_mib]
    extrapolated = None
    if len(ok) >= 2:
        mx = statistics.fmean(n for n, _ in ok)
        my = statistics.fmean(m for _, m in ok)
        sxx = sum((n - mx) ** 2 for n, _ in ok)
        slope = sum((n - mx) * (m - my) for n, m in ok) / sxx if sxx else 0.0
        if slope > 0:
            extrapolated = int(mx + (budget_mib - my) / slope)
    return {"longest_measured": max(fits) if fits else None, "linear_extrapolation": extrapolated}


def render(meta: dict, results: list[dict], budgets: dict) -> str:
    s = meta["spec"]
    lengths, rank_counts = s["lengths"], meta["rank_counts"]
    out = [
        f"# Sequence parallelism (DeepSpeed Ulysses, gloo, CPU): {s['arch']} training step per rank",
        "",
        f"- {s['arch']} masked LM, batch 1, hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, "
        f"feed-forward {s['intermediate']}, vocab {s['vocab']}, --window {s['window']} ({WINDOW_MEANING[s['arch']]}), "
        f"dropout {s['dropout']}; {meta['params_m']:.2f} M parameters. 1 rank: the plain model, no group; N ranks: "
        "DeepSpeed's sequence-parallel group over N gloo processes, each holding L/N tokens.",
        f"- {Precision.from_record(s).describe(forward=False)}.",
        "- step = forward + backward (train mode, 15% masked-LM labels); time = slowest rank per step, median of "
        f"{s['repeats']} steps after {s['warmup']} warm-up step(s).",
        "- MiB = per-rank growth of the process's peak RSS (VmHWM reset just before the step) over its RSS just before "
        "the step (parameters excluded, gradients included), the largest rank and step; glibc "
        f"MALLOC_MMAP_THRESHOLD_={MALLOC_MMAP_THRESHOLD} so that freed tensors leave the RSS.",
        f"- {s['threads']} thread(s) per rank; machine: {meta['machine']}. With more ranks x threads than cores "
        "the ranks share cores (time then measures the machine, not the method). torch "
        f"{meta['torch']}, deepspeed {meta['deepspeed']}, transformers {meta['transformers']}; hf_xformers "
        f"{meta['git']}; run {meta['date']}.",
        "",
        "| length | "
        + " | ".join(f"{n} rank{'s' * (n > 1)} MiB" for n in rank_counts)
        + " | "
        + " | ".join(f"{n} rank{'s' * (n > 1)} s" for n in rank_counts)
        + " |",
        "|---:|" + "---:|" * (2 * len(rank_counts)),
    ]
    cells = {(r["ranks"], r["length"]): r for r in results}

    def fmt(r, field, spec):
        if r is None:
            return "-"
        return format(r[field], spec) if r["status"] == "ok" else "error"

    for n in lengths:
        mib = [fmt(cells.get((k, n)), "peak_mib", ".1f") for k in rank_counts]
        sec = [fmt(cells.get((k, n)), "time_s", ".3f") for k in rank_counts]
        out.append(f"| {n} | " + " | ".join(mib) + " | " + " | ".join(sec) + " |")
    out += [
        "",
        f"Longest sequence within {s['budget_mb']:.0f} MiB per rank (growth as above):",
        "",
        "| ranks | longest measured length within budget | linear extrapolation (least squares over the lengths) |",
        "|---:|---:|---:|",
    ]
    for k in rank_counts:
        b = budgets[str(k)]
        out.append(f"| {k} | {b['longest_measured'] or 'none'} | {b['linear_extrapolation'] or '-'} |")
    out += ["", "Machine load per launch (other processes' CPU share over 1 s before it; 1-minute load average "
            "before / after; launch wall time):", ""]  # fmt: skip
    for launch_info in meta["launches"]:
        other = launch_info["other_cpu_before"]
        out.append(f"- {launch_info['ranks']} rank(s): other CPU {'-' if other is None else f'{other * 100:.0f}%'}, "
                   f"load {launch_info['loadavg_before'][0]:.2f} / {launch_info['loadavg_after'][0]:.2f}, "
                   f"{launch_info['wall_s']:.0f} s")  # fmt: skip
    errors = [r for r in results if r["status"] != "ok"]
    if errors:
        out += ["", "Errors:", ""] + [f"- {r['ranks']} ranks, {r['length']}: {str(r.get('error'))[-300:]}"
                                      for r in errors]  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--arch", choices=ARCHS, default="hfx-longformer")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None, help="default: 4 * hidden")
    p.add_argument("--vocab", type=int, default=VOCAB_DEFAULT)
    p.add_argument("--window", type=int, default=None,
                   help="Longformer attention_window (default 128), BigBird block_size (64), Performer random "
                   "features (128)")  # fmt: skip
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--autocast", action="store_true", help=AUTOCAST_HELP)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget_mb", type=float, default=256.0, help="per-rank memory budget, MiB")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch (all lengths of one rank count)")
    p.add_argument("--idle_check_s", type=float, default=1.0,
                   help="seconds before each launch over which other processes' CPU share is measured (0: none)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse_suppress())
    args = p.parse_args(argv)
    if args.worker:
        run_worker(json.loads(Path(args.worker[0]).read_text()), args.worker[1])
        return 0

    import psutil

    precision = Precision(args.dtype, args.autocast)
    spec = {
        "arch": args.arch, "lengths": sorted(args.lengths), "hidden": args.hidden, "layers": args.layers,
        "heads": args.heads, "intermediate": args.intermediate or 4 * args.hidden, "vocab": args.vocab,
        "window": args.window or WINDOW_DEFAULT[args.arch], "dropout": args.dropout, "threads": args.threads,
        "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed, "budget_mb": args.budget_mb,
        **precision.record(),
    }  # fmt: skip

    def version(package: str) -> str:  # the version only: importing them would cost the parent seconds
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    results, launches = [], []
    start = time.perf_counter()
    for ranks in args.ranks:
        done = launch(spec, ranks, args.timeout, args.idle_check_s)
        results += done.pop("rows")
        launches.append(done)
        ok = [r for r in results if r["ranks"] == ranks and r["status"] == "ok"]
        print(f"[{time.strftime('%H:%M:%S')}] {ranks} rank(s): {len(ok)}/{len(spec['lengths'])} lengths ok in "
              f"{done['wall_s']:.0f} s" + ("" if "error" not in done else f"\n{done['error']}"), flush=True)  # fmt: skip
    params = next((x["params"] for x in launches if "params" in x), 0)
    meta = {
        "spec": spec, "rank_counts": args.ranks, "params_m": params / 1e6, "launches": launches,
        "torch": version("torch"), "transformers": version("transformers"), "deepspeed": version("deepspeed"),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, "
                   f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM",
        "date": time.strftime("%Y-%m-%d %H:%M"), "git": git_describe(), "total_wall_s": time.perf_counter() - start,
        "memory_measure": "per-rank growth of peak RSS (VmHWM) over RSS just before the step, MiB",
    }  # fmt: skip
    budgets = {str(k): budget_lengths([r for r in results if r["ranks"] == k], args.budget_mb) for k in args.ranks}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"sequence_parallel_{args.arch.removeprefix('hfx-')}_h{args.hidden}_l{args.layers}"
    name += (f"_v{args.vocab}" if args.vocab != VOCAB_DEFAULT else "") + precision.suffix()
    stem = args.out / name
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results, "budget": budgets}, indent=1))
    stem.with_suffix(".md").write_text(render(meta, results, budgets))
    print(f"wrote {stem}.md, {stem}.json")
    return 0 if all(r["status"] == "ok" for r in results) else 1


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
