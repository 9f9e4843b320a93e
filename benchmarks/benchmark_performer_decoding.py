"""Performer decoding: time per generated token against the prefix length, cached (recurrent) vs uncached.

* ``cached``: ``HfxPerformerForCausalLM`` with ``HfxPerformerCache``, the recurrent form of causal FAVOR+: each new
  token updates the per-layer running sums ``sum_j phi(k_j) [v_j, 1]`` ``(heads, m, head_dim + 1)``, so its cost
  should not depend on the prefix length.
* ``uncached``: ``use_cache=False``, what ``generate(use_cache=False)`` does: a forward pass over the whole prefix
  plus the new token for every new token (linear in the prefix length).

For each prefix length the prompt is run once (not timed), then ``--steps`` single-token steps are timed (cached),
or ``--reps`` forward passes over ``prefix + 1`` tokens (uncached); the median per token is reported, with the share
of the CPU other processes used meanwhile. Random ids (speed does not depend on the text), eval mode,
``torch.inference_mode``, fixed threads.

    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_performer_decoding --out benchmarks/results
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

from benchmarks.measurement import BackgroundLoad  # noqa: E402
from examples.utils_examples import script_parser  # noqa: E402
from hf_xformers import HfxPerformerConfig, HfxPerformerForCausalLM  # noqa: E402


def build(hidden: int, layers: int, heads: int, max_length: int) -> HfxPerformerForCausalLM:
    config = HfxPerformerConfig(
        vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, max_position_embeddings=max_length + 4, hidden_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return HfxPerformerForCausalLM(config).eval()


def time_cached(model, ids: torch.Tensor, steps: int) -> list[float]:
    """Seconds per single-token step after a prompt of ``ids.shape[1] - steps`` tokens."""
    prefix = ids.shape[1] - steps
    out = model(ids[:, :prefix], use_cache=True)
    cache, times = out.past_key_values, []
    for t in range(prefix, ids.shape[1]):
        start = time.perf_counter()
        model(ids[:, t : t + 1], past_key_values=cache)
        times.append(time.perf_counter() - start)
    return times


def time_uncached(model, ids: torch.Tensor, reps: int) -> list[float]:
    """Seconds per forward pass over all of ``ids`` (the prefix and the new token), as uncached decoding does."""
    model(ids)  # warm-up (allocator, page faults)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model(ids)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16, help="timed cached steps per length")
    parser.add_argument("--reps", type=int, default=3, help="timed uncached forwards per length")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="folder for performer_decoding.{md,json,png}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.hidden, args.layers, args.heads, max(args.lengths) + args.steps)
    load = BackgroundLoad()
    rows = []
    with torch.inference_mode():
        for length in args.lengths:
            ids = torch.randint(5, 1000, (1, length + args.steps), generator=torch.Generator().manual_seed(length))
            results = {}

            def run_cached(ids=ids, results=results):
                results["cached"] = time_cached(model, ids, args.steps)

            def run_uncached(ids=ids, length=length, results=results):
                results["uncached"] = time_uncached(model, ids[:, : length + 1], args.reps)

            other_cached = load.measure(run_cached)[1]
            other_uncached = load.measure(run_uncached)[1]
            rows.append({
                "prefix": length,
                "cached_ms": 1e3 * statistics.median(results["cached"]),
                "uncached_ms": 1e3 * statistics.median(results["uncached"]),
                "other_cpu_share": round(max(other_cached, other_uncached), 3),
            })  # fmt: skip
            row = rows[-1]
            print(f"{length:>6}  cached {row['cached_ms']:8.2f} ms/token  uncached {row['uncached_ms']:9.2f} ms/token"
                  f"  (other processes: {row['other_cpu_share']:.0%} of the CPU)")  # fmt: skip
    meta = {
        "model": f"hfx-performer causal LM, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"m = {model.performer.encoder.layer[0].attention.self.num_features} features, batch 1",
        "threads": args.threads, "steps": args.steps, "reps": args.reps, "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
    }  # fmt: skip
    if args.out is None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "performer_decoding.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "# Performer decoding: time per generated token vs prefix length",
        "",
        f"{meta['model']}; {args.threads} thread(s); cached: median of {args.steps} single-token steps after the "
        f"prefix; uncached (`use_cache=False`): median of {args.reps} forwards over prefix + 1 tokens. "
        f"torch {torch.__version__}, {meta['machine']}. `other CPU` is the share of the machine other processes used "
        "while the row ran (a shared machine).",
        "",
        "| prefix | cached ms/token | uncached ms/token | uncached / cached | other CPU |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prefix']} | {r['cached_ms']:.2f} | {r['uncached_ms']:.1f} | {r['uncached_ms'] / r['cached_ms']:.0f}x"
            f" | {r['other_cpu_share']:.0%} |"
        )
    (args.out / "performer_decoding.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    prefixes = [r["prefix"] for r in rows]
    ax.plot(prefixes, [r["cached_ms"] for r in rows], "o-", label="cached (recurrent state)")
    ax.plot(prefixes, [r["uncached_ms"] for r in rows], "s-", label="uncached (use_cache=False)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("ms per generated token")
    ax.set_title(f"hfx-performer decoding, {args.threads} thread(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "performer_decoding.png", dpi=120)


if __name__ == "__main__":
    main()
