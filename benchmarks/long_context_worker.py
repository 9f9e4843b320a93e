"""One cell of the long-context benchmark, an (arch, impl, length, mode): :func:`run_cell` runs it in a fresh
process (``python -m benchmarks.benchmark_long_context --worker SPEC``), so that peaks do not leak between cells,
and stops it past a time or memory limit; :func:`run_worker` is what that process does."""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.long_context_models import BenchConfig, build_model, cell_flops
from benchmarks.measurement import BackgroundLoad, hfx_source_hash
from benchmarks.precision import DeviceMemory, Precision

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_worker(spec: dict) -> dict:
    """Build the cell's model and inputs, then time ``spec["repeats"]`` calls after one warm-up and measure the peak
    memory growth over them; the result row (``status`` ``"ok"``, times, background loads, memory, sizes).

    ``spec`` may carry ``dtype``, ``autocast`` and ``device`` (:class:`~benchmarks.precision.Precision`; absent:
    float32 on the CPU)."""
    import torch

    threads = spec["threads"]
    torch.set_num_threads(threads)
    torch.manual_seed(spec["seed"])
    c = BenchConfig(**spec["config"])
    length, mode = spec["length"], spec["mode"]
    precision = Precision.from_record(spec)
    training = mode == "backward"

    model = precision.prepare(build_model(spec["arch"], spec["impl"], c, length), training)
    gen = torch.Generator().manual_seed(spec["seed"])
    input_ids = precision.cast(torch.randint(5, c.vocab, (c.batch, length), generator=gen), training)
    attention_mask = precision.cast(torch.ones(c.batch, length, dtype=torch.long), training)
    params = sum(p.numel() for p in model.parameters())
    flops = cell_flops(spec["arch"], spec["impl"], c, length, model, training)
    src = hfx_source_hash(model) if spec["impl"] == "hfx" else None

    if not training:
        model.eval()

        def step():
            with torch.inference_mode():
                # .item() waits for the device too.
                model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.sum().item()

    else:
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            with precision.context(training):
                out = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            out.float().sum().backward()
            precision.synchronize()

    gc.collect()
    memory = DeviceMemory(precision.device)
    load = BackgroundLoad()

    warm_t, warm_load = load.measure(step)
    times, loads = [], []
    attempts = 0
    # Timed calls. Before each, wait (up to --quiet-wait s per cell in all) until other processes leave the CPU nearly idle; a call
    # during which they used more than --max-background of it is redone (at most 3 * repeats attempts in all), and
    # the quietest calls are kept if the machine never calms down.
    all_calls = []
    waited = 0.0
    while len(times) < spec["repeats"] and attempts < 3 * spec["repeats"]:
        if spec["max_background"] < 1 and waited < spec["quiet_wait"]:
            t_wait = time.perf_counter()
            load.wait_quiet(spec["max_background"], spec["quiet_wait"] - waited)
            waited += time.perf_counter() - t_wait
        t, other = load.measure(step)
        attempts += 1
        all_calls.append((t, other))
        if other <= spec["max_background"]:
            times.append(t)
            loads.append(other)
    if len(times) < spec["repeats"]:
        quietest = sorted(all_calls, key=lambda x: x[1])[: spec["repeats"]]
        times, loads = [t for t, _ in quietest], [o for _, o in quietest]
    peak_mib = memory.peak_mib()

    return {
        "status": "ok",
        "time_s": statistics.median(times),
        "times_s": times,
        "warmup_s": warm_t,
        "background_cpu": loads,
        "attempts": attempts,
        "waited_s": waited,
        "peak_mib": peak_mib,
        "baseline_mib": memory.base / 2**20,
        "params_m": params / 1e6,
        "model_flops": flops,
        "mem_method": memory.mode,
        **precision.record(),
        "hfx_model_src": src,
        "torch": torch.__version__,
    }



def run_cell(spec: dict, timeout: float, mem_limit_gib: float) -> dict:
    """Run one cell in a fresh subprocess, killing it past ``timeout`` seconds or ``mem_limit_gib`` RSS."""
    import psutil

    # The worker runs as a module from the repository root, which is what makes `benchmarks` importable there.
    cmd = [sys.executable, "-m", "benchmarks.benchmark_long_context", "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=REPO_ROOT)
    killed = None
    watched = psutil.Process(proc.pid)
    while proc.poll() is None:
        elapsed = time.perf_counter() - t0
        try:
            rss = watched.memory_info().rss
        except psutil.Error:
            rss = 0
        if elapsed > timeout:
            killed = "timeout"
        elif rss > mem_limit_gib * 2**30:
            killed = "OOM"
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.1)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if killed:
        return {"status": killed, "wall_s": wall}
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT ") :])
            res["wall_s"] = wall
            return res
    tail = stderr.strip().splitlines()[-3:]
    oom = proc.returncode in (-9, 137) or any("memory" in t.lower() for t in tail)
    return {"status": "OOM" if oom else "error", "returncode": proc.returncode, "error": " | ".join(tail), "wall_s": wall}


def run_worker_and_report(spec_json: str) -> None:
    """The worker process's whole job: run the cell of ``spec_json`` and print its row as a ``RESULT`` line for
    :func:`run_cell`; allocation failures become an ``OOM`` row, other runtime errors an ``error`` row."""
    try:
        res = run_worker(json.loads(spec_json))
    except (MemoryError, RuntimeError) as e:  # allocation failures come as RuntimeError from torch
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        status = "OOM" if isinstance(e, MemoryError) or "alloc" in msg.lower() or "memory" in msg.lower() else "error"
        res = {"status": status, "error": msg[:300]}
    print("RESULT " + json.dumps(res), flush=True)
