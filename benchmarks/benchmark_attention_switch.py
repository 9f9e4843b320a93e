"""Inference (and, on accelerators, training) time of the attention choices: our ``"sdpa"`` path, our
``"flex_attention"`` path and transformers' own implementation, for Longformer and BigBird.

Every cell is the median of ``--repeats`` timed calls after warm-up calls (which include FlexAttention's compilation
for that shape); the three implementations of one length run back to back in the same process, with the same inputs
(ours share their weights: only the kernel differs). transformers' models get their own weights of the same shapes.

Usage (from the repository root)::

    python -m benchmarks.benchmark_attention_switch                              # CPU, float32, forward
    python -m benchmarks.benchmark_attention_switch --device cuda --dtype bfloat16 --autocast \\
        --lengths 4096 8192 16384 32768 --modes forward train                   # a GPU

``--dtype`` casts the weights of every model (forward, and train without ``--autocast``); ``--autocast`` trains
float32 weights with the forward under ``torch.autocast(--dtype)``, as ``Trainer(bf16=True)`` does
(:mod:`benchmarks.precision`). On ``--device cuda`` each cell also records its peak memory
(``torch.cuda.max_memory_allocated`` above what the model and inputs hold, reset per cell). Results go to
``attention_switch_<device>_<dtype>[_autocast].{json,md,png}``.

Utilisation: every cell also reports its model TFLOP/s and MFU, the ratio to a ``--dtype`` matrix product measured at
the start of the run on the same device (:mod:`benchmarks.utilisation`, where the formula is: ``6 N T`` for the
parameters plus ``3 x 4 T K W`` per layer for attention, ``K`` the keys per query of the pattern: Longformer's
window + 1, BigBird's blocks). ``--budget-s`` stops starting cells once that many seconds have passed; the cells left
are listed as skipped (``make gpu-check`` runs the benchmark under its step's time limit).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_xformers  # noqa: E402
from benchmarks.precision import AUTOCAST_HELP, DEVICE_HELP, DEVICES, DTYPE_HELP, DTYPES, DeviceMemory, Precision  # noqa: E402
from benchmarks.utilisation import (  # noqa: E402
    MATMUL_SIZE,
    format_mfu,
    format_tflops,
    global_projection_parameters,
    keys_bigbird,
    keys_longformer,
    matmul_parameters,
    matmul_tflops,
    step_flops,
    tflops,
    utilisation,
)
from examples.utils_examples import script_parser  # noqa: E402

HIDDEN, HEADS, LAYERS, INTERMEDIATE, VOCAB = 768, 12, 2, 3072, 1000
WINDOW, BLOCK, RANDOM_BLOCKS = 512, 64, 3
IMPLEMENTATIONS = ("sdpa", "flex_attention", "transformers")
SKIPPED = "skipped (budget)"
MATMUL_SIZE_TEXT = {device: f"{n} x {n} x {n}" for device, n in MATMUL_SIZE.items()}


def build(arch: str, implementation: str, max_length: int, seed: int = 0) -> torch.nn.Module:
    """The base model of ``arch`` (hidden 768, 12 heads, 2 layers; Longformer window 512, BigBird blocks of 64 with
    3 random blocks), ours under ``implementation`` or transformers' own."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
        intermediate_size=INTERMEDIATE, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    if arch == "longformer":
        if implementation == "transformers":
            config = transformers.LongformerConfig(**common, attention_window=WINDOW, max_position_embeddings=max_length + 2)
            return transformers.LongformerModel(config, add_pooling_layer=False)
        config = hf_xformers.HfxLongformerConfig(**common, attention_window=WINDOW, max_position_embeddings=max_length + 2)
        model = hf_xformers.HfxLongformerModel(config, add_pooling_layer=False)
    elif arch == "bigbird":
        extra = dict(block_size=BLOCK, num_random_blocks=RANDOM_BLOCKS, max_position_embeddings=max_length)
        if implementation == "transformers":
            config = transformers.BigBirdConfig(**common, attention_type="block_sparse", **extra)
            return transformers.BigBirdModel(config, add_pooling_layer=False)
        model = hf_xformers.HfxBigBirdModel(hf_xformers.HfxBigBirdConfig(**common, **extra), add_pooling_layer=False)
    else:
        raise ValueError(f"unknown arch {arch!r}; use longformer or bigbird")
    model.set_attn_implementation(implementation)
    return model


def time_calls(step, repeats: int, warmup: int, device: str) -> float:
    """Median seconds of ``repeats`` calls of ``step`` after ``warmup`` calls."""

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def keys_per_query(arch: str, length: int) -> float:
    """The keys each query attends to under ``arch``'s pattern at ``length`` (:mod:`benchmarks.utilisation`)."""
    if arch == "longformer":
        return keys_longformer(WINDOW, length)
    return keys_bigbird(BLOCK, RANDOM_BLOCKS, length)


def model_flops(model: torch.nn.Module, arch: str, length: int, batch: int, training: bool) -> float:
    """Model FLOPs of one call of the cell (a training step, or a forward)."""
    # Longformer's global projections do nothing without global tokens (none here): not in N.
    parameters = matmul_parameters(model) - (global_projection_parameters(model) if arch == "longformer" else 0)
    return step_flops(parameters, batch * length, LAYERS, keys_per_query(arch, length), HIDDEN, training)


def measure(arch: str, implementation: str, length: int, mode: str, args) -> tuple[float | str, float | None, float]:
    """Median seconds of the cell (or why it did not run), on a GPU its peak memory growth in MiB, and its model
    FLOPs per call."""
    precision = Precision.from_args(args)
    training = mode == "train"
    if training and implementation == "flex_attention" and args.device == "cpu":
        return "n/a (no CPU backward)", None, 0.0
    model = precision.prepare(build(arch, implementation, args.max_length), training)
    flops = model_flops(model, arch, length, args.batch, training)
    ids = torch.randint(5, VOCAB, (args.batch, length), device=args.device)
    mask = torch.ones_like(ids)
    if not training:
        model.eval()

        def step():
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=mask)

    else:
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            with precision.context(training):
                out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            out.float().sum().backward()

    memory = DeviceMemory(args.device) if args.device == "cuda" else None
    try:
        seconds = time_calls(step, args.repeats, args.warmup, args.device)
    except (RuntimeError, torch.OutOfMemoryError) as error:  # out of memory at long lengths
        return f"failed: {type(error).__name__}", None, flops
    return seconds, memory.peak_mib() if memory else None, flops


def machine(args) -> dict:
    info = {
        "device": args.device,
        "dtype": args.dtype,
        "autocast": args.autocast,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_1min_before"] = os.getloadavg()[0]
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _ms(value) -> str:
    return f"{value * 1000:.0f} ms" if isinstance(value, float) else str(value)


def _mib(value) -> str:
    return f"{value:,.0f}" if isinstance(value, float) else "-"


def _ratio(cell: dict, name: str) -> str:
    a, b = cell.get(name), cell.get("sdpa")
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"


def table(results: list[dict], peak_tflops: float | None = None) -> str:
    """One table per (mode, arch): times, ratios, MFU of each implementation (against ``peak_tflops``, the product
    rate of the run) and, on a GPU, peak memory."""
    lines = []
    with_memory = any(r.get("peak_mib") is not None for r in results)
    for mode in sorted({r["mode"] for r in results}):
        for arch in sorted({r["arch"] for r in results}):
            rows = [r for r in results if r["arch"] == arch and r["mode"] == mode]
            if not rows:
                continue
            memory_head = " sdpa MiB | flex MiB | transformers MiB |" if with_memory else ""
            lines += [
                f"### {arch}, {mode}",
                "",
                "| tokens | ours, sdpa path | ours, flex_attention | transformers | flex / sdpa | transformers / sdpa "
                "| model TFLOP/s (sdpa / flex / transformers) | MFU sdpa | MFU flex | MFU transformers |" + memory_head,
                "|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 3 if with_memory else ""),
            ]
            for length in sorted({r["length"] for r in rows}):
                here = [r for r in rows if r["length"] == length]
                cell = {r["implementation"]: r["seconds"] for r in here}
                peak = {r["implementation"]: r.get("peak_mib") for r in here}
                rate = {r["implementation"]: tflops(r.get("flops"), r["seconds"] if isinstance(r["seconds"], float) else None) for r in here}  # fmt: skip
                mfu = {k: (v / peak_tflops if v is not None and peak_tflops else None) for k, v in rate.items()}
                memory = (f" {_mib(peak.get('sdpa'))} | {_mib(peak.get('flex_attention'))} | "
                          f"{_mib(peak.get('transformers'))} |" if with_memory else "")  # fmt: skip
                lines.append(
                    f"| {length:,} | {_ms(cell.get('sdpa'))} | {_ms(cell.get('flex_attention'))} | "
                    f"{_ms(cell.get('transformers'))} | {_ratio(cell, 'flex_attention')} | {_ratio(cell, 'transformers')} | "
                    f"{' / '.join(format_tflops(rate.get(i)) for i in IMPLEMENTATIONS)} | "
                    f"{' | '.join(format_mfu(mfu.get(i)) for i in IMPLEMENTATIONS)} |"
                    + memory
                )
            lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["arch"], r["mode"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (arch, mode) in zip(axes[0], panels):
        for implementation in IMPLEMENTATIONS:
            points = sorted(
                (r["length"], r["seconds"]) for r in results
                if (r["arch"], r["mode"], r["implementation"]) == (arch, mode, implementation)
                and isinstance(r["seconds"], float)
            )  # fmt: skip
            if points:
                ax.plot(*zip(*points), marker="o", label=implementation)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="seconds", title=f"{arch} ({mode})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--archs", nargs="+", default=["longformer", "bigbird"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--modes", nargs="+", default=["forward"], choices=["forward", "train"])
    parser.add_argument("--device", default="cpu", choices=DEVICES, help=DEVICE_HELP)
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    parser.add_argument("--autocast", action="store_true", help=AUTOCAST_HELP)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no cell after this many seconds; the cells left are reported as skipped")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    try:
        precision = Precision.from_args(args)
        precision.check_available()
    except ValueError as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    args.max_length = max(args.lengths)
    started = time.perf_counter()
    info = machine(args)
    # The products of the timed steps run in --dtype (weights cast, or autocast): the rate to compare them with.
    info["matmul_tflops"] = matmul_tflops(args.device, precision.torch_dtype())
    info["matmul"] = f"{args.dtype} product of {MATMUL_SIZE_TEXT[args.device]}"
    print(json.dumps(info))
    results = []
    for mode in args.modes:
        for arch in args.archs:
            for length in args.lengths:
                for implementation in args.implementations:
                    row = dict(arch=arch, mode=mode, length=length, implementation=implementation)
                    if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                        row.update(seconds=SKIPPED, peak_mib=None, flops=None, tflops=None, mfu=None)
                    else:
                        seconds, peak_mib, flops = measure(arch, implementation, length, mode, args)
                        timed = seconds if isinstance(seconds, float) else None
                        row.update(seconds=seconds, peak_mib=peak_mib, flops=flops, tflops=tflops(flops, timed),
                                   mfu=utilisation(flops, timed, info["matmul_tflops"]))  # fmt: skip
                    results.append(row)
                    print(json.dumps(row), flush=True)
    skipped = [r for r in results if r["seconds"] == SKIPPED]
    if skipped:
        print(f"{len(skipped)} of {len(results)} cells skipped: past --budget-s {args.budget_s:g} s", flush=True)
    if hasattr(os, "getloadavg"):
        info["load_average_1min_after"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"attention_switch_{args.device}_{args.dtype}{'_autocast' if args.autocast else ''}"
    stem.with_suffix(".json").write_text(json.dumps({"machine": info, "results": results}, indent=1))
    report = table(results, info["matmul_tflops"])
    modes = set(args.modes)
    header = precision.describe(forward="forward" in modes, training="train" in modes)
    memory = ("; memory: growth of `torch.cuda.max_memory_allocated` over warm-up + timed calls, reset per cell"
              if args.device == "cuda" else "")  # fmt: skip
    mfu = (f" MFU = model TFLOP/s (benchmarks/utilisation.py) over the {info['matmul']}, "
           f"{info['matmul_tflops']:.1f} TFLOP/s in this run.")  # fmt: skip
    stem.with_suffix(".md").write_text(f"Machine: `{json.dumps(info)}`\n\n{header}; device {args.device}{memory}.{mfu}\n\n{report}")
    plot(results, stem.with_suffix(".png"))
    print(report)


if __name__ == "__main__":
    main()
