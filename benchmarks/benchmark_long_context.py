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

Adding an architecture is one registry entry::

    ARCHS["bigbird"] = Arch(build_hfx=lambda c, L: ..., build_reference=lambda c, L: ...)

where ``c`` is the :class:`BenchConfig` (hidden, layers, heads, intermediate, vocab, window) and ``L`` the length.

Usage::

    HF_HUB_OFFLINE=1 python -m benchmarks.benchmark_long_context --arch longformer \
        --lengths 512 1024 2048 4096 8192 16384 --repeats 3 --modes forward backward --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

IMPLS = ("hfx", "ref", "sdpa")
IMPL_LABELS = {"hfx": "hfx (ours)", "ref": "transformers reference", "sdpa": "RoBERTa full attention (SDPA)"}
MODE_LABELS = {"forward": "forward (eval, inference_mode)", "backward": "forward+backward (train)"}


# --------------------------------------------------------------------------------------------------------------
# Configuration and registry
# --------------------------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 1024
    vocab: int = 1000
    window: int = 512
    batch: int = 1
    dropout: float = 0.1


@dataclass
class Arch:
    """``build_hfx(cfg, length)`` / ``build_reference(cfg, length)`` return an ``nn.Module`` whose forward takes
    ``input_ids`` and ``attention_mask`` and returns an output with ``last_hidden_state``; the builder sizes the
    position table for ``length`` itself."""

    build_hfx: Callable
    build_reference: Callable
    description: str = ""


def _padded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def _hfx_longformer(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxLongformerConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        attention_window=c.window,
        max_position_embeddings=length + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxLongformerModel(config)


def _ref_longformer(c: BenchConfig, length: int):
    from transformers import LongformerConfig, LongformerModel

    config = LongformerConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        attention_window=c.window,
        # transformers pads the input to a multiple of the window before the embeddings.
        max_position_embeddings=_padded(length, c.window) + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return LongformerModel(config, add_pooling_layer=False)


def build_sdpa_roberta(c: BenchConfig, length: int):
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        max_position_embeddings=length + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
        attn_implementation="sdpa",
    )
    model = RobertaModel(config, add_pooling_layer=False)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


ARCHS: dict[str, Arch] = {
    "longformer": Arch(
        build_hfx=_hfx_longformer,
        build_reference=_ref_longformer,
        description="sliding window (attention_window = --window), no global tokens; "
        "reference = transformers.LongformerModel",
    ),
}


# BigBird: --window is the block size (run with --window 64); 3 random blocks. Both BigBirds use exact GELU, like
# the SDPA RoBERTa baseline, so the comparison is about attention, not activation functions.
BIGBIRD_RANDOM_BLOCKS = 3


def _hfx_bigbird(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxBigBirdConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        hidden_act="gelu",
        attention_type="block_sparse",
        block_size=c.window,
        num_random_blocks=BIGBIRD_RANDOM_BLOCKS,
        max_position_embeddings=length,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxBigBirdModel(config, add_pooling_layer=False)


def _ref_bigbird(c: BenchConfig, length: int):
    from transformers import BigBirdConfig, BigBirdModel

    config = BigBirdConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        hidden_act="gelu",
        attention_type="block_sparse",
        block_size=c.window,
        num_random_blocks=BIGBIRD_RANDOM_BLOCKS,
        # transformers pads the input to a multiple of the block size before the embeddings.
        max_position_embeddings=_padded(length, c.window),
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return BigBirdModel(config, add_pooling_layer=False)


ARCHS["bigbird"] = Arch(
    build_hfx=_hfx_bigbird,
    build_reference=_ref_bigbird,
    description="block sparse (block_size = --window, 3 random blocks, ITC), hidden_act gelu; reference = "
    "transformers.BigBirdModel(attention_type='block_sparse'), which switches to full attention at or below "
    "(5 + 2 * 3) blocks",
)




# Linformer: --window is the projected length k (run with --window 256), one E and one F per layer shared by the
# heads (headwise, lucidrains' default too). Performer: --window is the number of random features per head (run with
# --window 266, int(d ln d) for d = 64: lucidrains' default). The references are lucidrains' `linformer` and
# `performer-pytorch` stacks (pre-LN, GELU feed-forward of 4 x hidden) under a token + learned position embedding,
# as in the anchor benchmarks; they take no pooler, and neither do ours here.


def _hfx_linformer(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxLinformerConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        linformer_k=c.window,
        linformer_sharing="headwise",
        max_position_embeddings=length + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxLinformerModel(config, add_pooling_layer=False)


def _hfx_performer(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxPerformerConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        num_random_features=c.window,
        max_position_embeddings=length + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxPerformerModel(config, add_pooling_layer=False)


def _lucidrains_encoder(c: BenchConfig, length: int, stack, takes_mask: bool):
    """Token + learned position embeddings in front of a lucidrains stack, with our models' call signature."""
    from types import SimpleNamespace

    import torch

    class LucidrainsEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token_emb = torch.nn.Embedding(c.vocab, c.hidden)
            self.pos_emb = torch.nn.Embedding(length, c.hidden)
            self.stack = stack

        def forward(self, input_ids, attention_mask=None):
            x = self.token_emb(input_ids) + self.pos_emb(torch.arange(input_ids.shape[1], device=input_ids.device))
            kwargs = {"mask": attention_mask.bool()} if takes_mask and attention_mask is not None else {}
            return SimpleNamespace(last_hidden_state=self.stack(x, **kwargs))

    return LucidrainsEncoder()


def _ref_linformer(c: BenchConfig, length: int):
    from linformer import Linformer  # pip install linformer (the `benchmarks` extra)

    stack = Linformer(dim=c.hidden, seq_len=length, depth=c.layers, k=c.window, heads=c.heads, dropout=c.dropout)
    return _lucidrains_encoder(c, length, stack, takes_mask=False)


def _ref_performer(c: BenchConfig, length: int):
    from performer_pytorch import Performer  # pip install performer-pytorch (the `benchmarks` extra)

    stack = Performer(dim=c.hidden, depth=c.layers, heads=c.heads, dim_head=c.hidden // c.heads,
                      nb_features=c.window, ff_dropout=c.dropout, attn_dropout=c.dropout)  # fmt: skip
    return _lucidrains_encoder(c, length, stack, takes_mask=True)


ARCHS["linformer"] = Arch(
    build_hfx=_hfx_linformer,
    build_reference=_ref_linformer,
    description="projected length k = --window, headwise sharing; reference = lucidrains linformer.Linformer "
    "(same k, headwise) under token + position embeddings",
)
ARCHS["performer"] = Arch(
    build_hfx=_hfx_performer,
    build_reference=_ref_performer,
    description="FAVOR+ with --window orthogonal random features per head; reference = lucidrains "
    "performer_pytorch.Performer (same number of features) under token + position embeddings",
)


# Reformer: --window is the chunk length of local and LSH attention (run with --window 64); layers alternate local and
# LSH attention, 1 hashing round, the feed-forward is --intermediate wide (relu, transformers' default), heads of 64.
# Axial positions (64, L / 64) with widths (64, hidden - 64): transformers' training needs the grid to equal the
# length. Both models get the same explicit num_buckets (ours derives it from the length, transformers would pick it
# from the first input). `reformer_stored` is ours with reversible=False (stored activations, the same numbers), for
# the depth/memory study (benchmark_reformer_depth.py).
REFORMER_HEAD_SIZE = 64


def _reformer_kwargs(c: BenchConfig, length: int) -> dict:
    from hf_xformers.models.reformer.configuration_reformer import default_num_buckets

    if length % c.window or length // c.window < 2:
        raise ValueError(f"reformer: the length ({length}) must be a multiple (>= 2) of the chunk length --window")
    return dict(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        attn_layers=(["local", "lsh"] * c.layers)[: c.layers],
        num_attention_heads=c.heads,
        attention_head_size=REFORMER_HEAD_SIZE,
        feed_forward_size=c.intermediate,
        local_attn_chunk_length=c.window,
        lsh_attn_chunk_length=c.window,
        num_hashes=1,
        num_buckets=default_num_buckets(length, c.window),
        axial_pos_shape=(64, length // 64),
        axial_pos_embds_dim=(64, c.hidden - 64),
        max_position_embeddings=length,
        hidden_dropout_prob=c.dropout,
        local_attention_probs_dropout_prob=c.dropout,
        lsh_attention_probs_dropout_prob=c.dropout,
        hash_seed=None,
        is_decoder=False,
    )


def _hfx_reformer(c: BenchConfig, length: int, reversible: bool = True, **overrides):
    import hf_xformers

    kwargs = {**_reformer_kwargs(c, length), **overrides}
    return hf_xformers.HfxReformerModel(hf_xformers.HfxReformerConfig(**kwargs, reversible=reversible))


def _ref_reformer(c: BenchConfig, length: int, **overrides):
    from transformers import ReformerConfig, ReformerModel

    return ReformerModel(ReformerConfig(**{**_reformer_kwargs(c, length), **overrides}))


ARCHS["reformer"] = Arch(
    build_hfx=_hfx_reformer,
    build_reference=_ref_reformer,
    description="layers alternating chunked local and LSH attention, chunk length = --window, 1 hashing round, "
    "the same explicit num_buckets, axial positions (64, L/64); reference = transformers.ReformerModel (same config)",
)
ARCHS["reformer_stored"] = Arch(
    build_hfx=lambda c, length: _hfx_reformer(c, length, reversible=False),
    build_reference=_ref_reformer,
    description="as `reformer`, ours with reversible=False (activations stored for backward, the same numbers); "
    "reference = transformers.ReformerModel (always reversible in training)",
)


# Reformer against lucidrains' reformer-pytorch, whose layers all use LSH attention: ours gets attn_layers all "lsh"
# and the settings lucidrains fixes (num_buckets = L / bucket_size, chunk = bucket_size = --window, GELU feed-forward
# of 4 x hidden); lucidrains gets heads of 64, one hashing round, ff_chunks=1 (the feed-forward on all positions at
# once, as ours), dropout on attention probabilities, attention output and feed-forward activations, reversible
# layers, and the same axial positions (64, L / 64) of widths (64, hidden - 64) and a final LayerNorm in front of and
# behind its `Reformer` stack. What cannot match: lucidrains' output projection has a bias, it normalises the mean of
# the two streams (hidden wide) where ours normalises their concatenation, it has no dropout after the feed-forward
# output nor on the embeddings, and its self-attention mask value is -5e4 (ours -1e5).
def _hfx_reformer_all_lsh(c: BenchConfig, length: int):
    return _hfx_reformer(c, length, attn_layers=["lsh"] * c.layers, num_buckets=length // c.window,
                         hidden_act="gelu")  # fmt: skip


def _ref_reformer_lucidrains(c: BenchConfig, length: int):
    from types import SimpleNamespace

    import torch
    from axial_positional_embedding import AxialPositionalEmbedding
    from reformer_pytorch import Reformer  # pip install reformer-pytorch (the `benchmarks` extra)

    if c.intermediate % c.hidden:
        raise ValueError("reformer-pytorch's feed-forward width is a multiple of hidden: adjust --intermediate")

    class LucidrainsReformerEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token_emb = torch.nn.Embedding(c.vocab, c.hidden)
            self.pos_emb = AxialPositionalEmbedding(c.hidden, (64, length // 64), (64, c.hidden - 64))
            self.reformer = Reformer(dim=c.hidden, depth=c.layers, heads=c.heads, dim_head=REFORMER_HEAD_SIZE,
                                     bucket_size=c.window, n_hashes=1, ff_chunks=1, ff_mult=c.intermediate // c.hidden, causal=False,
                                     lsh_dropout=c.dropout, ff_dropout=c.dropout, post_attn_dropout=c.dropout)  # fmt: skip
            self.norm = torch.nn.LayerNorm(c.hidden)

        def forward(self, input_ids, attention_mask=None):
            x = self.token_emb(input_ids)
            x = x + self.pos_emb(x)
            kwargs = {"input_mask": attention_mask.bool()} if attention_mask is not None else {}
            return SimpleNamespace(last_hidden_state=self.norm(self.reformer(x, **kwargs)))

    return LucidrainsReformerEncoder()


ARCHS["reformer_lucidrains"] = Arch(
    build_hfx=_hfx_reformer_all_lsh,
    build_reference=_ref_reformer_lucidrains,
    description="every layer LSH attention (ours: attn_layers all 'lsh', num_buckets = L / --window, gelu), "
    "chunk = bucket_size = --window, 1 hashing round; reference = lucidrains reformer_pytorch.Reformer (ff_chunks=1, "
    "same dropouts but none after the feed-forward output) under token + axial position embeddings and a LayerNorm",
)


def build_model(arch: str, impl: str, c: BenchConfig, length: int):
    if impl == "sdpa":
        return build_sdpa_roberta(c, length)
    entry = ARCHS[arch]
    return entry.build_hfx(c, length) if impl == "hfx" else entry.build_reference(c, length)


# --------------------------------------------------------------------------------------------------------------
# Worker: one (arch, impl, length, mode) in this process
# --------------------------------------------------------------------------------------------------------------


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


class PeakRSS:
    """Peak RSS from a point on. Linux: reset the kernel's high-water mark (``/proc/self/clear_refs``) and read
    ``VmHWM``; elsewhere: poll ``psutil`` in a thread (may miss short spikes)."""

    def __init__(self) -> None:
        self._poll = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.mode = "VmHWM"
        except OSError:
            import psutil

            self.mode = "psutil-poll"
            self._proc = psutil.Process()
            self._peak = self._proc.memory_info().rss
            self._stop = threading.Event()
            self._poll = threading.Thread(target=self._run, daemon=True)
            self._poll.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(0.005)

    def peak_bytes(self) -> int:
        if self._poll is None:
            with open("/proc/self/status") as f:
                return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024
        self._stop.set()
        self._poll.join()
        return self._peak


class BackgroundLoad:
    """Share of the machine's CPU used by *other* processes during a call (0..1), from system and own CPU times."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.proc = psutil.Process()
        self.ncpu = psutil.cpu_count() or 1

    def _snap(self):
        sys_t = self.psutil.cpu_times()
        busy = sum(sys_t) - sys_t.idle - getattr(sys_t, "iowait", 0.0)
        own = self.proc.cpu_times()
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

    def other_share(self, interval: float) -> float:
        """Share of the CPU used by other processes over the next ``interval`` seconds (while we idle)."""
        return self.measure(lambda: time.sleep(interval))[1]

    def wait_quiet(self, threshold: float, max_wait: float) -> float:
        """Idle until other processes use at most ``threshold`` of the CPU (checked over 0.5 s), or ``max_wait``."""
        t0 = time.perf_counter()
        while True:
            other = self.other_share(0.5)
            if other <= threshold or time.perf_counter() - t0 > max_wait:
                return other

    def measure(self, fn):
        t0, b0, o0 = self._snap()
        fn()
        t1, b1, o1 = self._snap()
        wall = t1 - t0
        other = max(0.0, (b1 - b0) - (o1 - o0)) / (wall * self.ncpu) if wall > 0 else 0.0
        return wall, min(other, 1.0)


def hfx_source_hash(model=None) -> str:
    """Short hash of hf_xformers sources, to catch code that changed between cells of one run: with ``model``,
    only the files defining the classes it is built from (so unrelated architectures can change meanwhile)."""
    import hashlib
    import inspect

    import hf_xformers

    root = Path(hf_xformers.__file__).resolve().parent
    if model is None:
        files = set(root.rglob("*.py"))
    else:
        files = set()
        for cls in {c for m in model.modules() for c in type(m).__mro__} | {type(model.config)}:
            try:
                f = Path(inspect.getsourcefile(cls)).resolve()
            except (TypeError, OSError):
                continue
            if root in f.parents:
                files.add(f)
    h = hashlib.sha1()
    for f in sorted(files):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:10]


def run_worker(spec: dict) -> dict:
    import torch

    threads = spec["threads"]
    torch.set_num_threads(threads)
    torch.manual_seed(spec["seed"])
    c = BenchConfig(**spec["config"])
    length, mode = spec["length"], spec["mode"]

    model = build_model(spec["arch"], spec["impl"], c, length)
    gen = torch.Generator().manual_seed(spec["seed"])
    input_ids = torch.randint(5, c.vocab, (c.batch, length), generator=gen)
    attention_mask = torch.ones(c.batch, length, dtype=torch.long)
    params = sum(p.numel() for p in model.parameters())
    src = hfx_source_hash(model) if spec["impl"] == "hfx" else None

    if mode == "forward":
        model.eval()

        def step():
            with torch.inference_mode():
                model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.sum().item()

    else:
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            out = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            out.float().sum().backward()

    gc.collect()
    base = _rss_kib() * 1024
    peak = PeakRSS()
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
    peak_b = peak.peak_bytes()

    return {
        "status": "ok",
        "time_s": statistics.median(times),
        "times_s": times,
        "warmup_s": warm_t,
        "background_cpu": loads,
        "attempts": attempts,
        "waited_s": waited,
        "peak_mib": max(0, peak_b - base) / 2**20,
        "baseline_mib": base / 2**20,
        "params_m": params / 1e6,
        "mem_method": peak.mode,
        "hfx_model_src": src,
        "torch": torch.__version__,
    }


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------


def run_cell(spec: dict, timeout: float, mem_limit_gib: float) -> dict:
    """Run one cell in a fresh subprocess, killing it past ``timeout`` seconds or ``mem_limit_gib`` RSS."""
    import psutil

    # The worker runs as a module from the repository root, which is what makes `benchmarks` importable there.
    cmd = [sys.executable, "-m", "benchmarks.benchmark_long_context", "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[1])
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


def key(impl: str, length: int, mode: str) -> str:
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


def loglog_slope(results: dict, impl: str, mode: str, short: int, long: int) -> float | None:
    """How time grows with length between two lengths: ``log(t_long / t_short) / log(long / short)`` (1 = linear,
    2 = quadratic), or None when either cell is missing."""
    a, b = results.get(key(impl, short, mode)), results.get(key(impl, long, mode))
    if not (a and b and a["status"] == b["status"] == "ok"):
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


def render_markdown(meta: dict, results: dict) -> str:
    lengths = sorted({int(k.split("|")[1]) for k in results})
    modes = [m for m in ("forward", "backward") if any(k.endswith("|" + m) for k in results)]
    c = meta["config"]
    # Merged runs may differ in --repeats: name every count that occurs among the cells.
    counts = sorted({len(v["times_s"]) for v in results.values() if v.get("times_s")}) or [meta["repeats"]]
    repeats = " or ".join(str(n) for n in counts)
    out = [
        f"# Long-context benchmark: `{meta['arch']}`",
        "",
        f"- hfx: hf_xformers `{meta['arch']}`; ref: {ARCHS[meta['arch']].description}; "
        "sdpa: transformers `RobertaModel`, `attn_implementation=\"sdpa\"`, full attention.",
        f"- config: hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads, intermediate {c['intermediate']}, "
        f"vocab {c['vocab']}, window {c['window']}, batch {c['batch']}, dropout {c['dropout']}; random weights, "
        "random token ids in [5, vocab), attention_mask all ones, no global tokens.",
        f"- {meta['threads']} threads; median of {repeats} timed calls after 1 warm-up; each (impl, length, mode) "
        "in its own process. forward = eval + `torch.inference_mode`; fwd+bwd = train mode, "
        "`last_hidden_state.sum().backward()`.",
        "- memory = growth of the process's peak RSS (VmHWM reset after building model and inputs) over warm-up + "
        "timed calls, MiB.",
        f"- ratios > 1 mean ours is faster / leaner. Machine: {meta['machine']}; torch {meta.get('torch', '?')}, "
        f"transformers {meta.get('transformers', '?')}; hf_xformers {meta.get('git', '?')}; run {meta['date']}.",
        "",
    ]
    for mode in modes:
        out += [
            f"## {MODE_LABELS[mode]}",
            "",
            "| length | hfx s | ref s | sdpa s | ref/hfx time | sdpa/hfx time | hfx MiB | ref MiB | sdpa MiB "
            "| ref/hfx mem | sdpa/hfx mem | bg CPU max |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for L in lengths:
            h, r, s = (results.get(key(i, L, mode)) for i in IMPLS)
            bg = [x for cell in (h, r, s) if cell and cell["status"] == "ok" for x in cell["background_cpu"]]
            out.append(
                f"| {L} | {fmt_time(h)} | {fmt_time(r)} | {fmt_time(s)} | {ratio(r, h, 'time_s')} | "
                f"{ratio(s, h, 'time_s')} | {fmt_mib(h)} | {fmt_mib(r)} | {fmt_mib(s)} | {ratio(r, h, 'peak_mib')} | "
                f"{ratio(s, h, 'peak_mib')} | {max(bg) * 100:.0f}% |" if bg else
                f"| {L} | {fmt_time(h)} | {fmt_time(r)} | {fmt_time(s)} | - | - | {fmt_mib(h)} | {fmt_mib(r)} | "
                f"{fmt_mib(s)} | - | - | - |"
            )
        out += ["", slope_line(results, lengths, mode), ""]
    hashes = {v.get("hfx_model_src") for k, v in results.items() if v.get("hfx_model_src")}
    if len(hashes) > 1:
        out += [f"**Warning:** the hfx model's source files changed between cells ({len(hashes)} versions: "
                f"{', '.join(sorted(hashes))}); rerun for comparable hfx cells.", ""]
    out += [
        "`bg CPU max`: the largest share of the machine's CPU used by other processes during any counted timed call "
        "of that row (calls above `--max-background` are redone when possible).",
        "",
    ]
    errors = [(k, v) for k, v in results.items() if v["status"] == "error"]
    if errors:
        out += ["## Errors", ""] + [f"- `{k}`: {v.get('error', '')}" for k, v in errors] + [""]
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
    fig.suptitle(f"{meta['arch']}: hidden {c['hidden']}, {c['layers']} layers, window {c['window']}, "
                 f"batch {c['batch']}, {meta['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _git_describe() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hf_xformers"], cwd=root, capture_output=True,
                               text=True).stdout.strip()
        return f"{rev}{' (hf_xformers modified)' if dirty else ''}, src {hfx_source_hash()}"
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        try:
            res = run_worker(json.loads(args.worker))
        except (MemoryError, RuntimeError) as e:  # allocation failures come as RuntimeError from torch
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            status = "OOM" if isinstance(e, MemoryError) or "alloc" in msg.lower() or "memory" in msg.lower() else "error"
            res = {"status": status, "error": msg[:300]}
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    cfg = BenchConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                      intermediate=args.intermediate or 4 * args.hidden, vocab=args.vocab, window=args.window,
                      batch=args.batch, dropout=args.dropout)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.arch}_w{cfg.window}_h{cfg.hidden}_l{cfg.layers}_b{cfg.batch}"
    if cfg.dropout != 0.1:
        stem += f"_drop{cfg.dropout:g}"
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
            "git": _git_describe(),
        }
        # Lengths outermost and implementations innermost, so slow drifts of machine load hit all three alike.
        previous = dict(results)
        for L in args.lengths:
            for mode in args.modes:
                for impl in args.impls:
                    if args.rerun_noisy:
                        old = previous.get(key(impl, L, mode))
                        noisy = old is None or old["status"] == "error" or (
                            old["status"] == "ok" and max(old["background_cpu"]) > args.max_background)
                        if not noisy:
                            continue
                    spec = {"arch": args.arch, "impl": impl, "length": L, "mode": mode, "config": dataclasses.asdict(cfg),
                            "repeats": args.repeats, "threads": args.threads, "seed": args.seed,
                            "max_background": args.max_background, "quiet_wait": args.quiet_wait}
                    res = run_cell(spec, args.timeout, args.mem_limit_gib)
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
    md_path.write_text(render_markdown(meta, results))
    render_plot(meta, results, png_path)
    print(f"wrote {md_path}, {png_path}, {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
