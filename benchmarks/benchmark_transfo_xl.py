"""Transformer-XL evaluation speed: memories against recomputing a sliding context (Dai et al., 2019, sec. 4.4).

For an attention span ``C``, both evaluations give every token ``C`` tokens of context:

* ``memory``: ``hfx-transfo-xl`` with ``mem_len = C`` and ``same_length=True`` reads the text in segments of
  ``C`` tokens, carrying the memories; each token is computed once.
* ``sliding``: the same model without memory (``mem_len = 0``) recomputes, for every token, a forward pass over
  the ``C`` tokens ending at it and keeps the last prediction (the vanilla Transformer evaluation of Al-Rfou et
  al.). Windows are batched (``--window-batch``) so the baseline is not penalised by tiny matrix products; it
  runs on the first ``--sliding-tokens`` positions and its tokens per second are extrapolated.

Reports tokens per second of each and their ratio (the paper: up to 1,800x at C = 3,800 on GPU, 24-layer model).
Inputs are random ids (speed does not depend on the text); eval mode, ``torch.inference_mode``, fixed threads.

    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_transfo_xl --spans 128 512 --out benchmarks/results

``--dtype`` runs both models with weights in that dtype, ``--device cuda`` on a GPU (timed with
``torch.cuda.synchronize()``); there is no training mode, hence no ``--autocast`` (:mod:`benchmarks.precision`).
Results of such runs go to ``transfo_xl_eval_speed_bf16...`` beside the float32 ``transfo_xl_eval_speed``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.measurement import BackgroundLoad  # noqa: E402
from benchmarks.precision import DEVICE_HELP, DEVICES, DTYPE_HELP, DTYPES, Precision  # noqa: E402
from examples.utils_examples import script_parser  # noqa: E402
from hf_xformers import HfxTransfoXLConfig, HfxTransfoXLForCausalLM  # noqa: E402


def build(args: argparse.Namespace, mem_len: int) -> HfxTransfoXLForCausalLM:
    torch.manual_seed(0)
    config = HfxTransfoXLConfig(
        vocab_size=args.vocab, cutoffs=[], div_val=1, d_model=args.hidden, n_head=args.heads, d_inner=4 * args.hidden,
        n_layer=args.layers, mem_len=mem_len, same_length=mem_len > 0, clamp_len=0, dropout=0.0,
    )  # fmt: skip
    return Precision.from_args(args).prepare(HfxTransfoXLForCausalLM(config), training=False).eval()


def time_memory(model: HfxTransfoXLForCausalLM, ids: torch.Tensor, span: int) -> float:
    """Seconds to score all of ``ids`` ``(1, n)`` segment by segment with memories."""
    start, mems = time.perf_counter(), None
    for pos in range(0, ids.shape[1], span):
        mems = model(input_ids=ids[:, pos : pos + span], mems=mems).mems
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_sliding(model: HfxTransfoXLForCausalLM, ids: torch.Tensor, span: int, tokens: int, batch: int) -> float:
    """Seconds to score positions ``span - 1 .. span - 2 + tokens`` with one ``span``-token window each."""
    windows = ids[0].unfold(0, span, 1)[:tokens]  # (tokens, span): window t ends at position t + span - 1
    start = time.perf_counter()
    for i in range(0, windows.shape[0], batch):
        model(input_ids=windows[i : i + batch]).logits[:, -1]
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict]:
    parser = script_parser(__doc__)
    parser.add_argument("--spans", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--text-tokens", type=int, default=4096, help="length of the text the memory model reads")
    parser.add_argument("--sliding-tokens", type=int, default=64, help="positions the sliding baseline scores")
    parser.add_argument("--window-batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256, help="character-level vocabulary")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="directory for transfo_xl_eval_speed.{json,md}")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    parser.add_argument("--device", default="cpu", choices=DEVICES, help=DEVICE_HELP)
    args = parser.parse_args(argv)
    precision = Precision.from_args(args)
    try:
        precision.check_available()
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)

    load = BackgroundLoad()
    # Other processes compete for the same cores: a busy machine slowed the committed run of this table tenfold.
    # Wait (up to a minute) for a quiet machine, and record the other processes' share during the timed calls.
    load.wait_quiet(0.15, 60.0)
    rows = []
    for span in args.spans:
        ids = torch.randint(0, args.vocab, (1, max(args.text_tokens, span + args.sliding_tokens)), device=args.device)
        with torch.inference_mode():
            memory_model, sliding_model = build(args, span), build(args, 0)
            time_memory(memory_model, ids[:, : 2 * span], span)  # warm-up
            time_sliding(sliding_model, ids, span, args.window_batch, args.window_batch)
            run_memory = functools.partial(time_memory, memory_model, ids, span)
            run_sliding = functools.partial(time_sliding, sliding_model, ids, span, args.sliding_tokens, args.window_batch)
            mem_runs = [load.measure(run_memory) for _ in range(args.repeats)]
            sl_runs = [load.measure(run_sliding) for _ in range(args.repeats)]
        t_mem, t_sl = statistics.median(w for w, _ in mem_runs), statistics.median(w for w, _ in sl_runs)
        background = max(other for _, other in mem_runs + sl_runs)
        mem_tps, sl_tps = ids.shape[1] / t_mem, args.sliding_tokens / t_sl
        rows.append(dict(span=span, memory_tokens_per_s=mem_tps, sliding_tokens_per_s=sl_tps, speedup=mem_tps / sl_tps,
                         background_cpu_max=background))  # fmt: skip
        print(f"span {span:5d}: memory {mem_tps:10.1f} tok/s  sliding {sl_tps:8.2f} tok/s  speedup {mem_tps / sl_tps:7.1f}x"
              f"  background {background:.0%}")  # fmt: skip

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        setup = {k: v for k, v in vars(args).items() if k != "out"}
        setup.update(torch=torch.__version__, machine=platform.processor() or platform.machine(), cpus=os.cpu_count())
        stem = "transfo_xl_eval_speed" + precision.suffix()
        (args.out / f"{stem}.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))
        lines = [
            "# Transformer-XL: evaluation with memory vs sliding-context recomputation",
            "",
            f"Model: {args.layers} layers, d_model {args.hidden}, {args.heads} heads, vocabulary {args.vocab}; "
            f"{args.device}, {args.threads} threads, torch {torch.__version__}, median of {args.repeats}; "
            f"{precision.describe(training=False)}. Memory: mem_len = "
            f"segment = span, same_length; {args.text_tokens} tokens. Sliding: one span-token window per token, "
            f"batches of {args.window_batch}, {args.sliding_tokens} tokens.",
            "",
            "| attention span | memory (tokens/s) | sliding (tokens/s) | speedup | bg CPU max |",
            "|---:|---:|---:|---:|---:|",
            *(f"| {r['span']} | {r['memory_tokens_per_s']:.0f} | {r['sliding_tokens_per_s']:.1f} | {r['speedup']:.0f}x "
              f"| {r['background_cpu_max']:.0%} |" for r in rows),  # fmt: skip
            "",
            "`bg CPU max`: the largest share of the machine's CPU that other processes used during a timed call of the "
            "row (the benchmark first waits up to a minute for it to fall below 15 %).",
            "",
        ]
        (args.out / f"{stem}.md").write_text("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
