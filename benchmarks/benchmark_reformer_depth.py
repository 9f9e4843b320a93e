#!/usr/bin/env python
"""Does reversibility pay off? Peak training memory of Reformer against depth at one length.

For each depth (default 2, 6 and 12 layers, alternating local and LSH attention) and each of

* ``hfx``        - ``HfxReformerModel``, reversible layers (activations recomputed in the backward pass),
* ``hfx_stored`` - the same with ``config.reversible=False`` (ordinary autograd, activations stored; same numbers),
* ``ref``        - ``transformers.ReformerModel`` (reversible in training),

one forward + backward cell (train mode, ``last_hidden_state.sum().backward()``) runs in a fresh subprocess through
``benchmark_long_context.py``'s worker: the same configuration as its ``reformer`` entry (``--window`` = chunk
length), the same peak-RSS measurement (VmHWM reset after model and inputs are built), the same quiet-machine
waits. Reversible layers should make the growth nearly independent of depth (only the parameters' gradients and
one layer's activations grow), stored activations linearly.

    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_reformer_depth --length 8192 --depths 2 6 12 --repeats 2

Writes ``reformer_depth_memory.{json,md}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

from benchmarks.benchmark_long_context import fmt_mib, fmt_time
from benchmarks.long_context_models import BenchConfig
from benchmarks.long_context_worker import run_cell
from benchmarks.measurement import git_describe
from examples.utils_examples import script_parser

# label -> (registry entry, impl) of benchmark_long_context
VARIANTS = {
    "hfx": ("reformer", "hfx"),
    "hfx_stored": ("reformer_stored", "hfx"),
    "ref": ("reformer", "ref"),
}
LABELS = {
    "hfx": "hfx, reversible",
    "hfx_stored": "hfx, reversible=False",
    "ref": "transformers ReformerModel",
}


def render(meta: dict, results: dict) -> str:
    c, depths = meta["config"], meta["depths"]
    out = [
        f"# Reformer: peak training memory against depth at {meta['length']} tokens",
        "",
        f"- forward + backward (train mode, dropout {c['dropout']}), batch {c['batch']}, hidden {c['hidden']}, "
        f"{c['heads']} heads of 64, feed-forward {c['intermediate']}, chunk {c['window']}, 1 hashing round, layers "
        "alternating local and LSH attention; same config as `benchmark_long_context.py --arch reformer`.",
        "- MiB = growth of the process's peak RSS over warm-up + timed calls above the RSS once model and inputs are "
        f"built (parameters and their gradients' growth included), each cell in its own process; {meta['threads']} "
        f"threads, median of {meta['repeats']} timed calls. Machine: {meta['machine']}; torch {meta['torch']}, "
        f"transformers {meta['transformers']}; hf_xformers {meta['git']}; run {meta['date']}.",
        "",
        "| variant | " + " | ".join(f"{d} layers MiB" for d in depths) + f" | {depths[-1]}/{depths[0]} layers | "
        + " | ".join(f"{d} layers s" for d in depths) + " | bg CPU max |",
        "|---|" + "---:|" * (2 * len(depths) + 2),
    ]
    for label in VARIANTS:
        cells = [results.get(f"{label}|{d}") for d in depths]
        mib = [fmt_mib(r) for r in cells]
        secs = [fmt_time(r) for r in cells]
        first, last = cells[0], cells[-1]
        grow = (f"{last['peak_mib'] / first['peak_mib']:.2f}x" if first and last and first["status"] == "ok"
                and last["status"] == "ok" and first["peak_mib"] > 0 else "-")  # fmt: skip
        bg = [x for r in cells if r and r["status"] == "ok" for x in r["background_cpu"]]
        out.append(f"| {LABELS[label]} | " + " | ".join(mib) + f" | {grow} | " + " | ".join(secs)
                   + (f" | {max(bg) * 100:.0f}% |" if bg else " | - |"))  # fmt: skip
    params = {d: r["params_m"] for d in depths if (r := results.get(f"hfx|{d}")) and r["status"] == "ok"}
    if params:
        out += ["", "Parameters (M): " + ", ".join(f"{d} layers {p:.2f}" for d, p in params.items()) + "."]
    out += [
        "",
        f"`{depths[-1]}/{depths[0]} layers`: the memory of the deepest model over that of the shallowest "
        f"({depths[-1] // depths[0]}x the layers). `bg CPU max`: worst share of the CPU used by other processes "
        "during a counted timed call of the row.",
        "",
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--depths", type=int, nargs="+", default=[2, 6, 12])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--window", type=int, default=64, help="chunk length of local and LSH attention")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None, help="default: 4 * hidden")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--mem-limit-gib", type=float, default=16.0)
    p.add_argument("--max-background", type=float, default=0.15)
    p.add_argument("--quiet-wait", type=float, default=120.0)
    p.add_argument("--merge", action="store_true", help="keep cells of the existing JSON that this run does not redo")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)

    import psutil
    import torch
    import transformers

    json_path, md_path = (args.out / f"reformer_depth_memory.{ext}" for ext in ("json", "md"))
    results = json.loads(json_path.read_text())["results"] if args.merge and json_path.exists() else {}
    args.out.mkdir(parents=True, exist_ok=True)
    base = BenchConfig(hidden=args.hidden, heads=args.heads, intermediate=args.intermediate or 4 * args.hidden,
                           vocab=args.vocab, window=args.window, batch=1, dropout=args.dropout)  # fmt: skip
    meta = {
        "length": args.length, "depths": args.depths, "config": dataclasses.asdict(base), "threads": args.threads,
        "repeats": args.repeats, "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM",
        "date": time.strftime("%Y-%m-%d %H:%M"), "git": git_describe(),
    }  # fmt: skip
    for depth in args.depths:
        for label in args.variants:
            arch, impl = VARIANTS[label]
            cfg = dataclasses.replace(base, layers=depth)
            spec = {"arch": arch, "impl": impl, "length": args.length, "mode": "backward",
                    "config": dataclasses.asdict(cfg), "repeats": args.repeats, "threads": args.threads,
                    "seed": args.seed, "max_background": args.max_background, "quiet_wait": args.quiet_wait}  # fmt: skip
            res = run_cell(spec, args.timeout, args.mem_limit_gib)
            res["layers"] = depth
            results[f"{label}|{depth}"] = res
            extra = (f"{res['time_s']:.2f}s {res['peak_mib']:.0f}MiB bg={max(res['background_cpu']) * 100:.0f}%"
                     if res["status"] == "ok" else res.get("error", ""))  # fmt: skip
            print(f"[{time.strftime('%H:%M:%S')}] {label:10s} {depth:3d} layers {res['status']:7s} {extra}", flush=True)
            json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md_path.write_text(render(meta, results))
    print(f"wrote {md_path}, {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
