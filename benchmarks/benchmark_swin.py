#!/usr/bin/env python
"""Swin-T benchmark: hf_xformers' ``hfx-swin`` against transformers' ``SwinModel`` (and timm's, when importable).

Swin-T (embed 96, depths [2, 2, 6, 2], heads [3, 6, 12, 24], window 7, patch 4, drop_path 0.1, 27.5 M parameters,
random weights) at 224 px with batch 8 and at 448 px with batch 2, side by side in the same run:

* ``hfx``  - ``hf_xformers.HfxSwinModel`` (SDPA window attention);
* ``hf``   - ``transformers.SwinModel`` with its default attention (``sdpa``);
* ``timm`` - ``timm``'s ``swin_tiny_patch4_window7_224`` (``num_classes=0``), when ``import timm`` works (it
  needs torchvision, which has no CPU build on this registry: the cell then records the import error).

Modes: ``forward`` (eval mode, ``torch.inference_mode``) and ``backward`` (train mode, forward +
``last_hidden_state.float().sum().backward()``; timm: ``forward_features``). Time = median of ``--repeats`` timed
calls after one warm-up. Memory = growth of the process's peak RSS above the RSS once model and inputs exist.
Every (impl, size, mode) runs in a fresh subprocess; implementations alternate within each (size, mode) so slow
drifts of the machine's load hit them alike. Timed calls during which other processes used more than
``--max-background`` of the CPU are redone (the noise control of ``benchmark_long_context.py``, whose
``PeakRSS`` and ``BackgroundLoad`` this script reuses). Process-to-process differences (memory layout, the VM's
neighbours) move single cells by ~10 % even on a quiet machine; ``--rounds N`` runs the whole set N times (the
order of implementations flipping every round) and reports the median over all rounds' calls.

Precision and device (:mod:`benchmarks.precision`, as in every benchmark here): ``--dtype`` casts the weights and
the pixels of every model for the forward mode, and for the backward mode unless ``--autocast``, which trains float32
weights with the forward under ``torch.autocast(--dtype)`` (``Trainer(bf16=True)``); ``--device cuda`` times with
``torch.cuda.synchronize()`` and measures ``torch.cuda.max_memory_allocated``. Results of such runs go to
``swin_bf16.{md,json}``, ``swin_bf16_autocast...``, ``swin..._cuda...``, beside the float32 ``swin.{md,json}``.

Usage::

    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_swin --repeats 5 --rounds 3  # -> benchmarks/results/swin.{md,json}
    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_swin --repeats 5 --dtype bfloat16 --autocast  # -> swin_bf16_autocast
    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_swin --repeats 5 --sizes 224 --modes backward --merge  # redo cells
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.measurement import BackgroundLoad, hfx_source_hash  # noqa: E402
from benchmarks.precision import AUTOCAST_HELP, DEVICE_HELP, DEVICES, DTYPE_HELP, DTYPES, DeviceMemory, Precision  # noqa: E402
from examples.utils_examples import script_parser  # noqa: E402

HERE = Path(__file__).resolve().parent

IMPLS = ("hfx", "hf", "timm")
IMPL_LABELS = {"hfx": "hfx-swin (ours)", "hf": "transformers SwinModel", "timm": "timm swin_tiny_patch4_window7_224"}
SIZES = {"224": (224, 8), "448": (448, 2)}  # image side -> batch
SWIN_T = dict(embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24], window_size=7, patch_size=4)


def build(impl: str, image_size: int):
    """The model, and a function from pixel values to the tensor whose sum is the training loss."""
    if impl == "hfx":
        import hf_xformers

        model = hf_xformers.HfxSwinModel(hf_xformers.HfxSwinConfig(image_size=image_size, **SWIN_T))
        return model, lambda x: model(pixel_values=x).last_hidden_state
    if impl == "hf":
        from transformers import SwinConfig, SwinModel

        model = SwinModel(SwinConfig(image_size=image_size, **SWIN_T))
        return model, lambda x: model(pixel_values=x).last_hidden_state
    import timm  # noqa: F401 - the import itself is what fails without torchvision

    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=0, img_size=image_size)
    return model, model.forward_features


def run_worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    image_size, batch = SIZES[spec["size"]]
    precision = Precision.from_record(spec)  # older specs without the fields: float32 on the CPU
    training = spec["mode"] == "backward"
    try:
        model, features = build(spec["impl"], image_size)
    except ImportError as error:
        note = " (timm imports torchvision, which has no CPU build on this registry)" if spec["impl"] == "timm" else ""
        return {"status": "unavailable", "error": f"{spec['impl']}: {type(error).__name__}: {error}{note}"}
    precision.prepare(model, training)
    x = torch.randn(batch, 3, image_size, image_size, generator=torch.Generator().manual_seed(1))
    x = precision.cast(x, training)
    params = sum(p.numel() for p in model.parameters())

    if not training:
        model.eval()

        def step():
            with torch.inference_mode():
                features(x).sum().item()  # .item() waits for the device too

    else:
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            with precision.context(training):
                out = features(x)
            out.float().sum().backward()
            precision.synchronize()

    gc.collect()
    memory = DeviceMemory(precision.device)
    load = BackgroundLoad()
    warm_t, _ = load.measure(step)
    times, loads, calls, waited = [], [], [], 0.0
    while len(times) < spec["repeats"] and len(calls) < 3 * spec["repeats"]:
        if waited < spec["quiet_wait"]:
            t0 = time.perf_counter()
            load.wait_quiet(spec["max_background"], spec["quiet_wait"] - waited)
            waited += time.perf_counter() - t0
        t, other = load.measure(step)
        calls.append((t, other))
        if other <= spec["max_background"]:
            times.append(t)
            loads.append(other)
    if len(times) < spec["repeats"]:  # the machine never calmed down: keep the quietest calls
        quietest = sorted(calls, key=lambda c: c[1])[: spec["repeats"]]
        times, loads = [t for t, _ in quietest], [o for _, o in quietest]
    return {
        "status": "ok",
        "time_s": statistics.median(times),
        "times_s": times,
        "background_cpu": loads,
        "warmup_s": warm_t,
        "attempts": len(calls),
        "waited_s": waited,
        "peak_mib": memory.peak_mib(),
        "mem_method": memory.mode,
        "params_m": params / 1e6,
        **precision.record(),
        "hfx_src": hfx_source_hash(),
    }


def run_cell(spec: dict, timeout: float) -> dict:
    """One (impl, size, mode) in a fresh subprocess."""
    cmd = [sys.executable, "-m", "benchmarks.benchmark_swin", "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "wall_s": time.perf_counter() - t0}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT ") :]), "wall_s": time.perf_counter() - t0}
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    return {"status": "error", "error": tail, "returncode": proc.returncode, "wall_s": time.perf_counter() - t0}


def combine(rounds: list[dict]) -> dict:
    """One cell from its rounds: the median of every counted call of every round, the median peak memory."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if not ok:
        return rounds[-1]
    times = [t for r in ok for t in r["times_s"]]
    return {
        **ok[-1],
        "time_s": statistics.median(times),
        "times_s": times,
        "background_cpu": [b for r in ok for b in r["background_cpu"]],
        "peak_mib": statistics.median(r["peak_mib"] for r in ok),
        "peaks_mib": [r["peak_mib"] for r in ok],
        "rounds": len(ok),
    }


def cell(results: dict, impl: str, size: str, mode: str) -> dict | None:
    return results.get(f"{impl}|{size}|{mode}")


def fmt(r: dict | None, field: str, digits: int) -> str:
    if r is None:
        return "-"
    return f"{r[field]:.{digits}f}" if r["status"] == "ok" else r["status"]


def ratio(num: dict | None, den: dict | None, field: str) -> str:
    if not num or not den or num["status"] != "ok" or den["status"] != "ok" or den[field] <= 0:
        return "-"
    return f"{num[field] / den[field]:.2f}x"


def render_markdown(meta: dict, results: dict) -> str:
    impls = [i for i in IMPLS if any(k.startswith(i + "|") for k in results)]
    # Cells merged from several runs may have different numbers of rounds.
    rounds = sorted({r.get("rounds", 1) for r in results.values() if r["status"] == "ok"}) or [1]
    rounds_text = str(rounds[0]) if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
    precision = Precision.from_record(meta)
    memory = (
        "MiB = growth of `torch.cuda.max_memory_allocated` over model + inputs (median over rounds)"
        if precision.device == "cuda"
        else "MiB = growth of peak RSS over model + inputs (median over rounds)"
    )
    device = f"{precision.device} ({meta['gpu']})" if meta.get("gpu") else precision.device
    out = [
        "# Swin-T benchmark: hfx-swin vs transformers' Swin",
        "",
        "- Swin-T: embed 96, depths [2, 2, 6, 2], heads [3, 6, 12, 24], window 7, patch 4, drop_path 0.1, random "
        "weights, base models (no classifier).",
        f"- {meta['threads']} threads; median of {meta['repeats']} timed calls after 1 warm-up per process, over "
        f"{rounds_text} round(s) per cell; every (impl, size, mode) of every round in a fresh process. fwd = eval + `torch.inference_mode`; fwd+bwd = train mode, "
        f"`last_hidden_state.float().sum().backward()`. {memory}.",
        f"- {precision.describe()}; device {device}.",
        f"- Machine: {meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}; "
        f"hf_xformers src {meta['src']}; run {meta['date']}. Ratios: transformers / ours (> 1: ours faster or leaner).",
        "",
        "| impl | img | batch | fwd s | fwd+bwd s | fwd MiB | fwd+bwd MiB | params M | bg CPU max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, (image, batch) in SIZES.items():
        for impl in impls:
            f, b = cell(results, impl, size, "forward"), cell(results, impl, size, "backward")
            ok = [c for c in (f, b) if c and c["status"] == "ok"]
            bg = max((x for c in ok for x in c["background_cpu"]), default=None)
            params = f"{ok[0]['params_m']:.2f}" if ok else "-"
            out.append(
                f"| {IMPL_LABELS[impl]} | {image} | {batch} | {fmt(f, 'time_s', 3)} | {fmt(b, 'time_s', 3)} | "
                f"{fmt(f, 'peak_mib', 0)} | {fmt(b, 'peak_mib', 0)} | {params} | "
                f"{'-' if bg is None else f'{bg * 100:.0f}%'} |"
            )
    out += [
        "",
        "## Ratios (transformers / hfx)",
        "",
        "| img | batch | fwd time | fwd+bwd time | fwd memory | fwd+bwd memory |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size, (image, batch) in SIZES.items():
        h = {m: cell(results, "hfx", size, m) for m in ("forward", "backward")}
        r = {m: cell(results, "hf", size, m) for m in ("forward", "backward")}
        out.append(
            f"| {image} | {batch} | {ratio(r['forward'], h['forward'], 'time_s')} | "
            f"{ratio(r['backward'], h['backward'], 'time_s')} | {ratio(r['forward'], h['forward'], 'peak_mib')} | "
            f"{ratio(r['backward'], h['backward'], 'peak_mib')} |"
        )
    notes = sorted(
        {v["error"] for k, v in results.items() if v["status"] in ("unavailable", "error") and v.get("error")}
    )
    if notes:
        out += ["", "## Not measured", ""] + [f"- {n}" for n in notes]
    out += [
        "",
        "`bg CPU max`: the largest share of the machine's CPU that other processes used during a counted timed call "
        "of that row (calls above the threshold are redone when possible). Single cells vary by about ±30 % on a "
        "shared machine; compare ratios from one run.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--modes", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--rounds", type=int, default=1, help="run every cell this many times (fresh processes); report medians"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-background", type=float, default=0.15)
    p.add_argument("--quiet-wait", type=float, default=60.0, help="most seconds per cell spent waiting for calm")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--merge", action="store_true", help="keep the cells of the saved swin.json this run does not redo")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--autocast", action="store_true", help=AUTOCAST_HELP)
    p.add_argument("--device", default="cpu", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print("RESULT " + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return 0

    import psutil
    import torch
    import transformers

    try:
        precision = Precision.from_args(args)
        precision.check_available()
    except ValueError as error:
        p.error(str(error))
    meta = {
        "threads": args.threads,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "src": hfx_source_hash(),
        **precision.record(),
    }
    if precision.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    results = {}
    stem = "swin" + precision.suffix()
    saved = args.out / f"{stem}.json"
    if args.merge and saved.exists():  # e.g. redo the cells a busy machine spoilt
        results = json.loads(saved.read_text())["results"]
        meta["date"] += " (merged with an earlier run)"
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for size in args.sizes:
            for mode in args.modes:
                # Alternate the order between rounds too, so neither implementation always runs first.
                for impl in args.impls if round_ % 2 == 0 else args.impls[::-1]:
                    spec = {"impl": impl, "size": size, "mode": mode, "repeats": args.repeats, "threads": args.threads,
                            "max_background": args.max_background, "quiet_wait": args.quiet_wait,
                            **precision.record()}  # fmt: skip
                    res = run_cell(spec, args.timeout)
                    runs.setdefault(f"{impl}|{size}|{mode}", []).append(res)
                    detail = (
                        f"{res['time_s']:.3f}s {res['peak_mib']:.0f}MiB "
                        f"times=[{', '.join(f'{t:.3f}' for t in res['times_s'])}] "
                        f"bg={max(res['background_cpu']) * 100:.0f}%"
                        if res["status"] == "ok"
                        else res.get("error", "")
                    )
                    print(f"[{time.strftime('%H:%M:%S')}] round {round_ + 1} {impl:4s} {size} {mode:8s} "
                          f"{res['status']} {detail}", flush=True)  # fmt: skip
    results.update({k: combine(v) for k, v in runs.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (args.out / f"{stem}.md").write_text(render_markdown(meta, results))
    print(render_markdown(meta, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
