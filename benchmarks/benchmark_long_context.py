#!/usr/bin/env python
"""Long-context benchmark: an hf_xformers model against transformers' reference and full-attention SDPA.

For every sequence length and mode, three implementations are measured side by side in the same run:

* ``hfx``  - the hf_xformers model (``build_hfx(cfg, length)`` in the registry),
* ``ref``  - the transformers reference implementation of the same architecture (``build_reference``),
* ``sdpa`` - full-attention RoBERTa through ``scaled_dot_product_attention`` (the same for every arch).

Modes: ``forward`` (eval mode, ``torch.inference_mode``) and ``backward`` (train mode, forward + backward of
``last_hidden_state.sum()``). Time = median over ``--repeats`` timed calls after one warm-up call. Memory =
growth of the process's peak RSS over warm-up + timed calls, above the RSS after the model and inputs are built.
Every (impl, length, mode) runs in a fresh subprocess (this file with ``--worker``), so peaks do not leak between
cells; a run that exceeds ``--timeout`` or ``--mem-limit-gib`` (or dies) shows as ``timeout`` / ``OOM``.

Utilisation (:mod:`benchmarks.utilisation`, where the formula is): every cell records its model FLOPs (``6 N T`` for
the parameters plus ``3 x 4 T K W`` per layer for attention in a training step, ``K`` the keys per query of the
architecture's pattern, the full length for ``sdpa``), and the run measures a ``--dtype`` matrix product on the device
before its cells; the tables give each implementation's model TFLOP/s and MFU (TFLOP/s over that product's rate).
``--budget-s`` starts no cell after that many seconds (and cuts the last cell's ``--timeout`` to what is left): the
cells left show as ``skipped``.

Precision and device (the same flags as every benchmark here, :mod:`benchmarks.precision`): ``--dtype`` casts every
model's weights (ours and the references alike) for the forward mode, and for the backward mode unless
``--autocast``, which trains float32 weights with the forward under ``torch.autocast`` (``Trainer(bf16=True)``);
``--device cuda`` times with ``torch.cuda.synchronize()`` and measures ``torch.cuda.max_memory_allocated``. The
table's header says which; results of a run other than float32 on the CPU go to files with a suffix (``_bf16``,
``_bf16_autocast``, ``_cuda``). ``--compare FP32_JSON`` adds a table of this run against another (bf16 against
fp32: the speed-up of each implementation and ours against the reference in each).

Adding an architecture is one registry entry (in ``benchmarks/long_context_models.py``)::

    ARCHS["bigbird"] = Arch(build_hfx=lambda c, L: ..., build_reference=lambda c, L: ...)

where ``c`` is the :class:`BenchConfig` (hidden, layers, heads, intermediate, vocab, window) and ``L`` the length.

Usage::

    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_long_context --arch longformer \
        --lengths 512 1024 2048 4096 8192 16384 --repeats 3 --modes forward backward --out benchmarks/results
    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_long_context --arch longformer --dtype bfloat16 --autocast \
        --compare benchmarks/results/longformer_w512_h256_l4_b1.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The parts: what is built (long_context_models), how one cell is measured (long_context_worker, on measurement's
# tools); this module is the command line, the table and the plot.
from benchmarks.long_context_models import ARCHS, IMPLS, BenchConfig  # noqa: E402
from benchmarks.long_context_worker import run_cell, run_worker_and_report  # noqa: E402
from benchmarks.measurement import git_describe  # noqa: E402
from benchmarks.precision import AUTOCAST_HELP, DEVICE_HELP, DEVICES, DTYPE_HELP, DTYPES, Precision  # noqa: E402
from benchmarks.utilisation import format_mfu, format_tflops, tflops  # noqa: E402
from examples.utils_examples import script_parser  # noqa: E402

IMPL_LABELS = {"hfx": "hfx (ours)", "ref": "transformers reference", "sdpa": "RoBERTa full attention (SDPA)"}
MODE_LABELS = {"forward": "forward (eval, inference_mode)", "backward": "forward+backward (train)"}


def key(impl: str, length: int, mode: str) -> str:
    """The results key of one cell."""
    return f"{impl}|{length}|{mode}"


def fmt_time(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return r["status"]
    t = r["time_s"]
    return f"{t:.3f}" if t < 10 else f"{t:.1f}"


def fmt_mib(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['peak_mib']:.0f}" if r["status"] == "ok" else r["status"]


def ratio(num: dict | None, den: dict | None, field: str) -> str:
    if not num or not den or num["status"] != "ok" or den["status"] != "ok":
        if den and den.get("status") == "ok" and num and num["status"] in ("OOM", "timeout"):
            return f"> ({num['status']})"
        return "-"
    d = den[field]
    return f"{num[field] / d:.2f}x" if d > 0 else "-"


def cell_tflops(r: dict | None) -> float | None:
    """Model TFLOP/s of a cell (None: not run, failed, or saved before the benchmark recorded FLOPs)."""
    if not r or r.get("status") != "ok":
        return None
    return tflops(r.get("model_flops"), r.get("time_s"))


def cell_mfu(r: dict | None, meta: dict) -> str:
    rate, peak = cell_tflops(r), meta.get("matmul_tflops")
    return format_mfu(rate / peak if rate is not None and peak else None)


def loglog_slope(results: dict, impl: str, mode: str, short: int, long: int) -> float | None:
    """How time grows with length between two lengths: ``log(t_long / t_short) / log(long / short)`` (1 = linear,
    2 = quadratic), or None when either cell is missing."""
    a, b = results.get(key(impl, short, mode)), results.get(key(impl, long, mode))
    if short == long or not (a and b and a["status"] == b["status"] == "ok"):
        return None
    return math.log(b["time_s"] / a["time_s"]) / math.log(long / short)


def slope_line(results: dict, lengths: list[int], mode: str) -> str:
    """One line: the log-log slope of every implementation's time from 2048 (or the shortest length) to the
    longest."""
    short = 2048 if 2048 in lengths else lengths[0]
    long = lengths[-1]
    parts = []
    for impl in IMPLS:
        slope = loglog_slope(results, impl, mode, short, long)
        parts.append(f"{impl} {slope:.2f}" if slope is not None else f"{impl} -")
    return f"Log-log slope of time from {short} to {long} tokens (1 = linear, 2 = quadratic): {', '.join(parts)}."


def device_text(meta: dict) -> str:
    """The device of a run: ``cpu`` (older results files say nothing: the CPU), or ``cuda (GPU name)``."""
    device = meta.get("device", "cpu")
    return f"{device} ({meta['gpu']})" if meta.get("gpu") else device


def memory_text(precision: Precision) -> str:
    if precision.device == "cuda":
        return ("- memory = growth of `torch.cuda.max_memory_allocated` (peak reset after building model and inputs) "
                "over warm-up + timed calls, MiB.")  # fmt: skip
    return ("- memory = growth of the process's peak RSS (VmHWM reset after building model and inputs) over warm-up + "
            "timed calls, MiB.")  # fmt: skip


def render_markdown(meta: dict, results: dict) -> str:
    lengths = sorted({int(k.split("|")[1]) for k in results})
    modes = [m for m in ("forward", "backward") if any(k.endswith("|" + m) for k in results)]
    c = meta["config"]
    # Merged runs may differ in --repeats: name every count that occurs among the cells.
    counts = sorted({len(v["times_s"]) for v in results.values() if v.get("times_s")}) or [meta["repeats"]]
    repeats = " or ".join(str(n) for n in counts)
    precision = Precision.from_record(meta)
    out = [
        f"# Long-context benchmark: `{meta['arch']}`",
        "",
        f"- hfx: hf_xformers `{meta['arch']}`; ref: {ARCHS[meta['arch']].description}; "
        "sdpa: transformers `RobertaModel`, `attn_implementation=\"sdpa\"`, full attention.",
        f"- config: hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads, intermediate {c['intermediate']}, "
        f"vocab {c['vocab']}, window {c['window']}, batch {c['batch']}, dropout {c['dropout']}; random weights, "
        "random token ids in [5, vocab), attention_mask all ones, no global tokens.",
        f"- {precision.describe()}; device {device_text(meta)}.",
        f"- {meta['threads']} threads; median of {repeats} timed calls after 1 warm-up; each (impl, length, mode) "
        "in its own process. forward = eval + `torch.inference_mode`; fwd+bwd = train mode, "
        "`last_hidden_state.sum().backward()`.",
        memory_text(precision),
        "- TFLOP/s = model FLOPs per call (benchmarks/utilisation.py: 6 N T + 3 x 4 T K W per layer in training, "
        "2 N T + 4 T K W per layer in a forward) over its time; MFU = that over a "
        + (f"{meta['matmul']} measured in this run, {meta['matmul_tflops']:.1f} TFLOP/s."
           if meta.get("matmul_tflops") else "matrix product of the run (not measured: MFU '-')."),
        f"- ratios > 1 mean ours is faster / leaner. Machine: {meta['machine']}; torch {meta.get('torch', '?')}, "
        f"transformers {meta.get('transformers', '?')}; hf_xformers {meta.get('git', '?')}; run {meta['date']}.",
        "",
    ]
    for mode in modes:
        out += [
            f"## {MODE_LABELS[mode]}",
            "",
            "| length | hfx s | ref s | sdpa s | ref/hfx time | sdpa/hfx time | hfx MiB | ref MiB | sdpa MiB "
            "| ref/hfx mem | sdpa/hfx mem | bg CPU max | hfx TFLOP/s | hfx MFU | ref MFU | sdpa MFU |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for L in lengths:
            h, r, s = (results.get(key(i, L, mode)) for i in IMPLS)
            bg = [x for cell in (h, r, s) if cell and cell["status"] == "ok" for x in cell["background_cpu"]]
            use = (f" {format_tflops(cell_tflops(h))} | {cell_mfu(h, meta)} | {cell_mfu(r, meta)} | "
                   f"{cell_mfu(s, meta)} |")  # fmt: skip
            out.append(
                f"| {L} | {fmt_time(h)} | {fmt_time(r)} | {fmt_time(s)} | {ratio(r, h, 'time_s')} | "
                f"{ratio(s, h, 'time_s')} | {fmt_mib(h)} | {fmt_mib(r)} | {fmt_mib(s)} | {ratio(r, h, 'peak_mib')} | "
                f"{ratio(s, h, 'peak_mib')} | {max(bg) * 100:.0f}% |" + use if bg else
                f"| {L} | {fmt_time(h)} | {fmt_time(r)} | {fmt_time(s)} | - | - | {fmt_mib(h)} | {fmt_mib(r)} | "
                f"{fmt_mib(s)} | - | - | - |" + use
            )
        out += ["", slope_line(results, lengths, mode), ""] if len(lengths) > 1 else [""]
    hashes = {v.get("hfx_model_src") for k, v in results.items() if v.get("hfx_model_src")}
    if len(hashes) > 1:
        out += [f"**Warning:** the hfx model's source files changed between cells ({len(hashes)} versions: "
                f"{', '.join(sorted(hashes))}); rerun for comparable hfx cells.", ""]
    out += [
        "`bg CPU max`: the largest share of the machine's CPU used by other processes during any counted timed call "
        "of that row (calls above `--max-background` are redone when possible).",
        "",
    ]
    skipped = sorted(k for k, v in results.items() if v["status"] == "skipped")
    if skipped:
        out += [f"Skipped (past `--budget-s`): {', '.join(f'`{k}`' for k in skipped)}.", ""]
    errors = [(k, v) for k, v in results.items() if v["status"] == "error"]
    if errors:
        out += ["## Errors", ""] + [f"- `{k}`: {v.get('error', '')}" for k, v in errors] + [""]
    return "\n".join(out)


def run_label(meta: dict, mode: str) -> str:
    """What a run computed in ``mode``, in a few characters: ``fp32``, ``bf16``, ``bf16 autocast`` (+ `` cuda``)."""
    precision = Precision.from_record(meta)
    label = precision.label(training=mode == "backward")
    return label + (" cuda" if precision.device == "cuda" else "")


def render_comparison(meta: dict, results: dict, other_meta: dict, other_results: dict) -> str:
    """A table of this run (A, e.g. bfloat16) against another of the same arch and config (B, e.g. float32): per
    mode and length, each implementation's time B / A (> 1: A faster), ours against the reference in A and in B,
    and the memory B / A."""
    for field in ("arch", "config"):
        if meta[field] != other_meta[field]:
            raise ValueError(
                f"--compare needs a results file of the same {field}: {meta[field]!r} here, {other_meta[field]!r} "
                "there; pass the JSON of the same --arch and sizes"
            )
    lengths = sorted({int(k.split("|")[1]) for k in results} & {int(k.split("|")[1]) for k in other_results})
    out = []
    for mode in ("forward", "backward"):
        if not any(k.endswith("|" + mode) for k in results) or not any(k.endswith("|" + mode) for k in other_results):
            continue
        a, b = run_label(meta, mode), run_label(other_meta, mode)
        if a == b:
            a, b = "A", "B"
        out += [
            f"## {a} against {b}: {MODE_LABELS[mode]}",
            "",
            f"A = this run ({a}), B = the run of {other_meta.get('date', '?')} ({b}). `B/A` = B's time (memory) "
            f"over A's: > 1 means {a} is faster (leaner) than {b}. `ref/hfx` > 1 means ours is faster.",
            "",
            "| length | hfx A s | hfx B s | hfx B/A | ref B/A | sdpa B/A | ref/hfx A | ref/hfx B | sdpa/hfx A "
            "| hfx mem B/A | ref mem B/A |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for L in lengths:
            this = {impl: results.get(key(impl, L, mode)) for impl in IMPLS}
            other = {impl: other_results.get(key(impl, L, mode)) for impl in IMPLS}
            out.append(
                f"| {L} | {fmt_time(this['hfx'])} | {fmt_time(other['hfx'])} | "
                f"{ratio(other['hfx'], this['hfx'], 'time_s')} | {ratio(other['ref'], this['ref'], 'time_s')} | "
                f"{ratio(other['sdpa'], this['sdpa'], 'time_s')} | {ratio(this['ref'], this['hfx'], 'time_s')} | "
                f"{ratio(other['ref'], other['hfx'], 'time_s')} | {ratio(this['sdpa'], this['hfx'], 'time_s')} | "
                f"{ratio(other['hfx'], this['hfx'], 'peak_mib')} | {ratio(other['ref'], this['ref'], 'peak_mib')} |"
            )
        out.append("")
    return "\n".join(out)


def render_plot(meta: dict, results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("forward", "backward") if any(k.endswith("|" + m) for k in results)]
    lengths = sorted({int(k.split("|")[1]) for k in results})
    colors = {"hfx": "tab:blue", "ref": "tab:orange", "sdpa": "tab:green"}
    styles = {"forward": "-", "backward": "--"}
    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(5.2 * (len(modes) + 1), 4.4))
    for ax, mode in zip(axes, modes):
        for impl in IMPLS:
            pts = [(L, results[key(impl, L, mode)]["time_s"]) for L in lengths
                   if results.get(key(impl, L, mode), {}).get("status") == "ok"]
            if pts:
                ax.plot(*zip(*pts), "o-", color=colors[impl], label=IMPL_LABELS[impl])
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="seconds (median)",
               title=MODE_LABELS[mode])
        ax.set_xticks(lengths, [str(L) for L in lengths], rotation=45)
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    for mode in modes:
        for impl in IMPLS:
            pts = [(L, max(results[key(impl, L, mode)]["peak_mib"], 1.0)) for L in lengths
                   if results.get(key(impl, L, mode), {}).get("status") == "ok"]
            if pts:
                ax.plot(*zip(*pts), "o" + styles[mode], color=colors[impl], label=f"{impl} {mode}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="peak RSS growth (MiB)",
           title="peak memory (solid: forward, dashed: fwd+bwd)")
    ax.set_xticks(lengths, [str(L) for L in lengths], rotation=45)
    ax.minorticks_off()
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    c = meta["config"]
    precision = Precision.from_record(meta)
    fig.suptitle(f"{meta['arch']}: hidden {c['hidden']}, {c['layers']} layers, window {c['window']}, "
                 f"batch {c['batch']}, {meta['threads']} threads, {precision.label(False)} forward / "
                 f"{precision.label(True)} training, {precision.device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--arch", default="longformer", choices=sorted(ARCHS))
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--modes", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None, help="default: 4 * hidden")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="hidden and attention-probability dropout of every model (active in the backward mode only); "
                   "note that CPU SDPA leaves its fused kernel for the O(L^2) math path when attention dropout > 0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per (impl, length, mode) process")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no cell after this many seconds (the last one's --timeout is cut to what is left); "
                   "the cells left are reported as skipped")
    p.add_argument("--mem-limit-gib", type=float, default=16.0, help="kill a run whose RSS exceeds this: 'OOM'")
    p.add_argument("--max-background", type=float, default=0.15,
                   help="redo timed calls during which other processes used more than this share of the CPU")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="most seconds per cell to spend waiting, before timed calls, for other processes to calm down")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--merge", action="store_true",
                   help="keep cells of an earlier results JSON in --out that this run does not measure")
    p.add_argument("--rerun-noisy", action="store_true",
                   help="rerun only the cells of the results JSON in --out (within --lengths/--modes/--impls) whose "
                   "counted calls saw more than --max-background of other CPU load, or that failed with an error; "
                   "implies --merge")
    p.add_argument("--render-only", action="store_true", help="only redraw the table and plot from the JSON")
    p.add_argument("--compare", type=Path, metavar="OTHER_JSON",
                   help="add a table of this run against another results JSON of the same arch and config (e.g. this "
                   "bfloat16 run against the float32 one): speed-ups and ours/reference in each")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--autocast", action="store_true", help=AUTOCAST_HELP)
    p.add_argument("--device", default="cpu", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        run_worker_and_report(args.worker)
        return 0

    try:
        precision = Precision.from_args(args)
    except ValueError as error:
        p.error(str(error))
    cfg = BenchConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                      intermediate=args.intermediate or 4 * args.hidden, vocab=args.vocab, window=args.window,
                      batch=args.batch, dropout=args.dropout)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.arch}_w{cfg.window}_h{cfg.hidden}_l{cfg.layers}_b{cfg.batch}"
    if cfg.dropout != 0.1:
        stem += f"_drop{cfg.dropout:g}"
    stem += precision.suffix()
    json_path, md_path, png_path = (args.out / f"{stem}.{ext}" for ext in ("json", "md", "png"))

    results: dict = {}
    meta: dict = {}
    if args.rerun_noisy:
        args.merge = True
    if (args.merge or args.render_only) and json_path.exists():
        saved = json.loads(json_path.read_text())
        results, meta = saved["results"], saved["meta"]
    if not args.render_only:
        import platform

        import psutil
        import torch
        import transformers

        meta = {
            "arch": args.arch,
            "config": dataclasses.asdict(cfg),
            "threads": args.threads,
            "repeats": args.repeats,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, "
                       f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "git": git_describe(),
            **precision.record(),
        }
        try:
            precision.check_available()
        except ValueError as error:
            p.error(str(error))
        if precision.device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name()
        from benchmarks.utilisation import MATMUL_SIZE, matmul_tflops

        # The rate the cells' model TFLOP/s are compared with: a product in the dtype their matrix products run in.
        torch.set_num_threads(args.threads)
        size = MATMUL_SIZE[precision.device]
        meta["matmul_tflops"] = matmul_tflops(precision.device, precision.torch_dtype())
        meta["matmul"] = f"{precision.dtype} {size} x {size} x {size} product"
        started = time.perf_counter()
        impls = list(args.impls)
        if "ref" in impls and ARCHS[args.arch].build_reference is None:
            print(f"{args.arch} has no reference implementation: its 'ref' cells are left out", flush=True)
            impls.remove("ref")
        # Lengths outermost and implementations innermost, so slow drifts of machine load hit all three alike.
        previous = dict(results)
        for L in args.lengths:
            for mode in args.modes:
                for impl in impls:
                    if args.rerun_noisy:
                        old = previous.get(key(impl, L, mode))
                        noisy = old is None or old["status"] in ("error", "skipped") or (
                            old["status"] == "ok" and max(old["background_cpu"]) > args.max_background)
                        if not noisy:
                            continue
                    spec = {"arch": args.arch, "impl": impl, "length": L, "mode": mode, "config": dataclasses.asdict(cfg),
                            "repeats": args.repeats, "threads": args.threads, "seed": args.seed,
                            "max_background": args.max_background, "quiet_wait": args.quiet_wait,
                            **precision.record()}
                    timeout = args.timeout
                    if args.budget_s is not None:
                        timeout = min(timeout, args.budget_s - (time.perf_counter() - started))
                    if timeout <= 0:
                        res = {"status": "skipped", "wall_s": 0.0}
                    else:
                        res = run_cell(spec, timeout, args.mem_limit_gib)
                    results[key(impl, L, mode)] = res
                    extra = (f"{res['time_s']:.3f}s {res['peak_mib']:.0f}MiB times={[f'{t:.3f}' for t in res['times_s']]} "
                             f"bg={max(res['background_cpu']) * 100:.0f}%" if res["status"] == "ok"
                             else res.get("error", ""))
                    print(f"[{time.strftime('%H:%M:%S')}] {impl:4s} L={L:6d} {mode:8s} {res['status']:7s} {extra} "
                          f"(wall {res['wall_s']:.0f}s)", flush=True)
                    json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if not results:
        print("no results", file=sys.stderr)
        return 1
    text = render_markdown(meta, results)
    if args.compare:
        other = json.loads(args.compare.read_text())
        try:
            text += "\n" + render_comparison(meta, results, other["meta"], other["results"])
        except ValueError as error:
            p.error(str(error))
    md_path.write_text(text)
    render_plot(meta, results, png_path)
    print(f"wrote {md_path}, {png_path}, {json_path}")
    return 0




if __name__ == "__main__":
    sys.exit(main())
