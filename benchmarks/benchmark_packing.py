"""Training throughput of packed (padding-free) batches against padded ones, on the same documents (issue 34).

Three batching schemes share one seeded set of documents (lengths log-uniform in ``[--min-length, --max-length]``,
random token ids, a fixed 15 % of the positions of each document masked for masked-LM training):

* ``padded``: the documents in random order, ``B`` per batch, padded to the batch's longest rounded up to
  ``--pad-multiple`` (512: the issue's simulation), with an attention mask;
* ``group_by_length``: the batches of transformers' ``LengthGroupedSampler`` (``Trainer(group_by_length=True)``):
  ``transformers.trainer_pt_utils.get_length_grouped_indices``, mega-batches of ``--mega-batch-mult`` (50) batches
  sorted by length, padded as above. The run's documents are ``--num-batches`` batches spread evenly over one full
  mega-batch of the sampler (so they are grouped as tightly as in a long run), and the other schemes shuffle the same
  documents;
* ``packed``: the batches of ``padded`` (the same ``B`` documents each) concatenated into one row by
  ``transformers.DataCollatorWithFlattening`` with ``position_ids_start`` = the model's first position id (RoBERTa
  style, Longformer and Performer: ``pad_token_id + 1``; BigBird, Reformer, Universal: 0), the boundaries passed as
  ``cu_seq_lens_q/k`` + ``max_length_q/k`` (what ``DataCollatorForPackedDocuments`` sends: no host reads on a GPU;
  or ``seq_idx``: ``--packed-form``; restarting positions alone mark no documents).

A step is forward + backward + ``AdamW`` step of the masked-LM head (``--dtype bfloat16``: autocast, as
``Trainer(bf16=True)``). One timed repeat is one pass over all ``--num-batches`` batches; throughput is real
(unpadded) tokens per second of the median repeat, after warm-up steps (on CUDA a whole untimed pass, so that every
shape is compiled before timing; ``torch.cuda.synchronize()`` around every timed pass). Before training, each
scheme's batches go through the freshly initialised model in eval mode: every document's masked-LM loss must agree
across schemes (packing must not change what a document sees). On the CPU every (arch, dtype, attention, batch size,
scheme) cell runs in a fresh process, memory = growth of the peak RSS above the RSS once model and batches are built
(``--quick`` runs in this process); on CUDA every cell runs in this process, memory = ``torch.cuda.max_memory_allocated``
of the training steps (weights and optimizer states included).

Usage (from the repository root)::

    python -m benchmarks.benchmark_packing --quick                                  # smoke run, longformer
    python -m benchmarks.benchmark_packing --dtype float32                          # CPU table, all five archs
    python -m benchmarks.benchmark_packing --device cuda --dtype bfloat16 float32 \\
        --attn-implementation sdpa flex_attention --budget-s 200                  # a GPU
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks.benchmark_attention_switch import machine  # noqa: E402
from benchmarks.measurement import BackgroundLoad, PeakRSS, git_describe, hfx_source_hash, rss_kib  # noqa: E402
from examples.utils_examples import script_parser  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("longformer", "bigbird", "performer", "reformer", "universal")
SCHEMES = ("padded", "group_by_length", "packed")
# Goals of issue 34 for real-token throughput: packed / padded and packed / group_by_length.
GOALS = {"padded": 2.5, "group_by_length": 1.15}
# Ids 0-3 are special in every config below (pad, bos, eos); documents draw from [FIRST_ID, vocab).
MASK_ID, FIRST_ID = 4, 5
MASK_FRACTION = 0.15
# Every document's loss must agree across schemes to this relative difference (bfloat16 rounds differently in
# differently shaped batches).
LOSS_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
# Each architecture's own size knob (--window): attention window, block size, random features, chunk length; the
# Universal Transformer has none (full attention per document).
DEFAULT_WINDOW = {"longformer": 512, "bigbird": 64, "performer": 256, "reformer": 64, "universal": 0}
QUICK_WINDOW = {"longformer": 16, "bigbird": 8, "performer": 16, "reformer": 16, "universal": 0}


# ----------------------------------------------------------------------------------------------------------------
# Documents and batches
# ----------------------------------------------------------------------------------------------------------------


def document_lengths(count: int, min_length: int, max_length: int, seed: int) -> list[int]:
    """``count`` lengths drawn log-uniformly from ``[min_length, max_length]`` (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    logs = torch.empty(count, dtype=torch.float64).uniform_(math.log(min_length), math.log(max_length), generator=gen)
    return logs.exp().round().long().clamp(min_length, max_length).tolist()


def make_document(index: int, length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ``index`` of the pool: ``(input_ids, labels)``, each ``(length,)`` long. Random ids in
    ``[FIRST_ID, vocab)``; a seeded :data:`MASK_FRACTION` of the positions after the first replaced by ``MASK_ID`` and
    scored in ``labels`` (-100 elsewhere): the same positions in every scheme. The first token is never scored: the
    padding-free collator overwrites its label."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index + 1)
    ids = torch.randint(FIRST_ID, vocab, (length,), generator=gen)
    scored = max(1, round(MASK_FRACTION * (length - 1)))
    positions = torch.randperm(length - 1, generator=gen)[:scored] + 1
    labels = torch.full_like(ids, -100)
    labels[positions] = ids[positions]
    inputs = ids.clone()
    inputs[positions] = MASK_ID
    return inputs, labels


def group_by_length_batches(lengths: list[int], batch_size: int, mega_batch_mult: int, seed: int) -> list[list[int]]:
    """The batches ``Trainer(group_by_length=True)`` forms (``LengthGroupedSampler``): transformers' own
    ``get_length_grouped_indices``, mega-batches of ``mega_batch_mult`` batches each sorted by length."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    gen = torch.Generator().manual_seed(seed + 2)
    order = get_length_grouped_indices(lengths, batch_size, mega_batch_mult=mega_batch_mult, generator=gen)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def random_batches(indices: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """``indices`` in a seeded random order, ``batch_size`` per batch (a plain shuffling DataLoader)."""
    perm = torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed + 3)).tolist()
    return [[indices[i] for i in perm[j : j + batch_size]] for j in range(0, len(perm), batch_size)]


def select_batches(
    batch_size: int, num_batches: int, mega_batch_mult: int, min_length: int, max_length: int, seed: int
) -> tuple[list[int], dict[str, list[list[int]]]]:
    """The documents of a run and every scheme's batches of them.

    A pool of ``max(mega_batch_mult, num_batches) * batch_size`` document lengths is drawn; ``group_by_length``
    takes ``num_batches`` batches spread evenly over the sampler's batches of that pool (real batches of a full
    mega-batch, so they are as tightly grouped as in a long run, not the looser groups a sort of only
    ``num_batches * batch_size`` documents would give; all of them when ``num_batches >= mega_batch_mult``);
    ``padded`` and ``packed`` shuffle the same documents into random batches of ``batch_size``.

    Returns:
        the pool's lengths, and per scheme the batches as lists of pool indices (each chosen document once).
    """
    pool = document_lengths(max(mega_batch_mult, num_batches) * batch_size, min_length, max_length, seed)
    grouped = group_by_length_batches(pool, batch_size, mega_batch_mult, seed)
    picks = sorted({int((i + 0.5) * len(grouped) / num_batches) for i in range(num_batches)})
    grouped = [grouped[i] for i in picks]
    shuffled = random_batches([i for batch in grouped for i in batch], batch_size, seed)
    return pool, {"padded": shuffled, "group_by_length": grouped, "packed": shuffled}


def padded_length(longest: int, multiple: int) -> int:
    return -(-longest // multiple) * multiple


def overhead(batches: list[list[int]], lengths: list[int], multiple: int) -> float:
    """Tokens computed by padded batches over real tokens."""
    computed = sum(len(b) * padded_length(max(lengths[i] for i in b), multiple) for b in batches)
    return computed / sum(lengths[i] for b in batches for i in b)


def collate(
    scheme: str,
    documents: list[tuple[torch.Tensor, torch.Tensor]],
    pad_id: int,
    multiple: int,
    position_start: int,
    packed_form: str,
) -> dict:
    """The model inputs of one batch: padded ``(B, padded length)`` with ``attention_mask``, or one packed row
    ``(1, total)`` from ``DataCollatorWithFlattening`` with the boundaries in ``packed_form``."""
    if scheme == "packed":
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening(
            return_position_ids=True,
            position_ids_start=position_start,
            separator_id=-100,
            return_seq_idx=packed_form == "seq_idx",
            return_flash_attn_kwargs=packed_form == "cu_seq_lens",
        )
        batch = collator([{"input_ids": ids.tolist(), "labels": labels.tolist()} for ids, labels in documents])
        return {
            k: v.long() if torch.is_tensor(v) and k in ("input_ids", "labels", "position_ids") else v
            for k, v in batch.items()
        }
    length = padded_length(max(len(ids) for ids, _ in documents), multiple)
    input_ids = torch.full((len(documents), length), pad_id, dtype=torch.long)
    labels = torch.full((len(documents), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(documents), length), dtype=torch.long)
    for row, (ids, doc_labels) in enumerate(documents):
        input_ids[row, : len(ids)] = ids
        labels[row, : len(ids)] = doc_labels
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ----------------------------------------------------------------------------------------------------------------
# Models: the masked-LM head of each architecture, built from a config (no download)
# ----------------------------------------------------------------------------------------------------------------


def build_model(arch: str, c: dict, table: int) -> torch.nn.Module:
    """The masked-LM model of ``arch`` with the sizes of ``c`` (hidden, layers, heads, intermediate, vocab, window,
    dropout) and a position table for documents of up to ``table`` tokens (a padded batch's length)."""
    import hf_xformers

    common = dict(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        num_attention_heads=c["heads"],
        num_hidden_layers=c["layers"],
        intermediate_size=c["intermediate"],
        hidden_dropout_prob=c["dropout"],
        attention_probs_dropout_prob=c["dropout"],
        type_vocab_size=1,
    )
    window = c["window"]
    if arch == "longformer":
        config = hf_xformers.HfxLongformerConfig(**common, attention_window=window, max_position_embeddings=table + 2)
        return hf_xformers.HfxLongformerForMaskedLM(config)
    if arch == "bigbird":
        config = hf_xformers.HfxBigBirdConfig(
            **common,
            hidden_act="gelu",
            attention_type="block_sparse",
            block_size=window,
            num_random_blocks=3,
            max_position_embeddings=table,
        )
        return hf_xformers.HfxBigBirdForMaskedLM(config)
    if arch == "performer":
        config = hf_xformers.HfxPerformerConfig(**common, num_random_features=window, max_position_embeddings=table + 2)
        return hf_xformers.HfxPerformerForMaskedLM(config)
    if arch == "universal":
        # ACT (the paper's model), at most twice --layers steps (tensor2tensor's rule); sinusoidal positions.
        config = hf_xformers.HfxUniversalConfig(
            **common, use_act=True, act_max_steps=2 * c["layers"], max_position_embeddings=table
        )
        return hf_xformers.HfxUniversalForMaskedLM(config)
    if arch == "reformer":
        # Layers alternate chunked local and LSH attention (chunk = --window), one hashing round, heads of
        # hidden / heads, axial positions covering the table; num_buckets derived once from the table.
        grid = (64, -(-table // 64)) if table > 64 else (table, 1)
        config = hf_xformers.HfxReformerConfig(
            vocab_size=c["vocab"],
            hidden_size=c["hidden"],
            num_attention_heads=c["heads"],
            attention_head_size=c["hidden"] // c["heads"],
            attn_layers=(["local", "lsh"] * c["layers"])[: c["layers"]],
            feed_forward_size=c["intermediate"],
            local_attn_chunk_length=window,
            lsh_attn_chunk_length=window,
            num_hashes=1,
            axial_pos_shape=grid,
            axial_pos_embds_dim=(c["hidden"] // 4, c["hidden"] - c["hidden"] // 4),
            max_position_embeddings=math.prod(grid),
            hidden_dropout_prob=c["dropout"],
            local_attention_probs_dropout_prob=c["dropout"],
            lsh_attention_probs_dropout_prob=c["dropout"],
            is_decoder=False,
        )
        return hf_xformers.HfxReformerForMaskedLM(config)
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def first_position_id(model: torch.nn.Module) -> int:
    """The position id of a document's first token: ``position_ids_start`` of the padding-free collator."""
    embeddings = model.base_model.embeddings
    return int(getattr(embeddings, "position_offset", 0))


# ----------------------------------------------------------------------------------------------------------------
# One cell: an (arch, dtype, attention, batch size, scheme)
# ----------------------------------------------------------------------------------------------------------------


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _autocast(device: str, dtype: str):
    return torch.autocast(device, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()


def document_losses(
    model: torch.nn.Module,
    batches: list[dict],
    order: list[list[int]],
    documents: dict[int, tuple[torch.Tensor, torch.Tensor]],
    device: str,
    dtype: str,
) -> list[float]:
    """Each document's mean masked-LM cross-entropy (float32) over its scored positions, in the order of the
    documents' keys (pool indices: the same order in every scheme); eval mode, no gradients. ``order[b]`` are the
    documents of ``batches[b]`` (rows of a padded batch, or the consecutive segments of a packed row)."""
    model.eval()
    sums: dict[int, float] = {}
    # FlexAttention compiles a kernel per shape and per grad mode: on CUDA record gradients here too, so that training
    # reuses these kernels instead of compiling every shape twice.
    flex_on_cuda = device == "cuda" and model.config._attn_implementation == "flex_attention"
    with torch.enable_grad() if flex_on_cuda else torch.no_grad(), _autocast(device, dtype):
        for batch, indices in zip(batches, order):
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.detach().float()
            labels = batch["labels"]
            token_loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
            ).reshape(labels.shape)
            if labels.shape[0] == len(indices):  # padded: one document per row
                per_document = token_loss.sum(-1)
            else:  # packed: consecutive segments of the row
                segment = torch.repeat_interleave(
                    torch.arange(len(indices), device=labels.device),
                    torch.tensor([len(documents[i][0]) for i in indices], device=labels.device),
                )
                per_document = token_loss.new_zeros(len(indices)).index_add(0, segment, token_loss.reshape(-1))
            for i, value in zip(indices, per_document.tolist()):
                sums[i] = value
    return [sums[i] / int((labels != -100).sum()) for i, (_, labels) in sorted(documents.items())]


def timed_passes(one_pass: Callable[[], None], spec: dict) -> dict:
    """Median wall time of ``spec["repeats"]`` calls of ``one_pass``: before each, wait (at most ``quiet_wait`` s in
    all) until other processes use at most ``max_background`` of the CPU, and redo calls during which they used more
    (at most 3 x repeats attempts; the quietest are kept if the machine never calms down)."""
    load = BackgroundLoad()
    calls, waited, attempts = [], 0.0, 0
    kept: list[tuple[float, float]] = []
    while len(kept) < spec["repeats"] and attempts < 3 * spec["repeats"]:
        if spec["max_background"] < 1 and waited < spec["quiet_wait"]:
            start = time.perf_counter()
            load.wait_quiet(spec["max_background"], spec["quiet_wait"] - waited)
            waited += time.perf_counter() - start
        seconds, other = load.measure(one_pass)
        attempts += 1
        calls.append((seconds, other))
        if other <= spec["max_background"]:
            kept.append((seconds, other))
    if len(kept) < spec["repeats"]:
        kept = sorted(calls, key=lambda x: x[1])[: spec["repeats"]]
    times = [t for t, _ in kept]
    return {
        "time_s": statistics.median(times),
        "times_s": times,
        "background_cpu": [o for _, o in kept],
        "attempts": attempts,
        "waited_s": waited,
    }


class PreparedCell(SimpleNamespace):
    """One cell ready to train: ``row`` (what was measured so far; ``status`` set when the cell cannot train),
    ``step(batch)`` one training step, ``batches`` and ``sync()`` (CUDA: wait for the device)."""

    def one_pass(self) -> None:
        self.sync()
        for batch in self.batches:
            self.step(batch)
        self.sync()

    def warm_up(self, spec: dict) -> None:
        """The untimed steps before timing (``spec["warmup_batches"]``, None: a whole pass)."""
        count = len(self.batches) if spec["warmup_batches"] is None else min(spec["warmup_batches"], len(self.batches))
        t0 = time.perf_counter()
        self.sync()
        for batch in self.batches[:count]:
            self.step(batch)
        self.sync()
        self.row["warmup_s"] = time.perf_counter() - t0


def prepare_cell(spec: dict) -> PreparedCell:
    """Build one cell's documents, batches and model (seeded: the same weights in every scheme), check each
    document's loss in eval mode, and make its optimizer. A cell that cannot train has ``row["status"]`` set."""
    device, dtype, scheme, batch_size = spec["device"], spec["dtype"], spec["scheme"], spec["batch_size"]
    if device == "cpu":
        torch.set_num_threads(spec["threads"])
    pool, schemes = select_batches(
        batch_size, spec["num_batches"], spec["mega_batch_mult"], spec["min_length"], spec["max_length"], spec["seed"]
    )
    order = schemes[scheme]
    documents = {i: make_document(i, pool[i], spec["config"]["vocab"], spec["seed"]) for b in order for i in b}
    table = padded_length(spec["max_length"], spec["pad_multiple"])
    row: dict = {
        "real_tokens": sum(len(ids) for ids, _ in documents.values()),
        "documents": len(documents),
        "batch_lengths": [],
    }
    cell = PreparedCell(
        row=row, batches=[], step=None, sync=lambda: torch.cuda.synchronize() if device == "cuda" else None
    )
    if device == "cpu" and spec["attn_implementation"] == "flex_attention":
        # FlexAttention has no CPU backward: training would run the "sdpa" path (ops/attention_switch.flex_applies).
        row.update(status="n/a", error="no CPU backward (trains on sdpa)")
        return cell
    torch.manual_seed(spec["seed"])
    model = build_model(spec["arch"], spec["config"], table)
    try:
        model.set_attn_implementation(spec["attn_implementation"])
    except (ValueError, ImportError) as error:
        row.update(status="n/a", error=_short(error))
        return cell
    model.to(device)
    row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    row["hfx_model_src"] = hfx_source_hash(model)
    start = first_position_id(model)
    pad_id = model.config.pad_token_id
    for indices in order:
        batch = collate(
            scheme, [documents[i] for i in indices], pad_id, spec["pad_multiple"], start, spec["packed_form"]
        )
        cell.batches.append({k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
        row["batch_lengths"].append(list(batch["input_ids"].shape))
    row["computed_tokens"] = sum(b["input_ids"].numel() for b in cell.batches)
    row["position_ids_start"] = start

    t0 = time.perf_counter()
    try:
        losses = document_losses(model, cell.batches, order, documents, device, dtype)
    except torch.OutOfMemoryError as error:
        row.update(status="OOM", error=_short(error))
        return cell
    except Exception as error:  # noqa: BLE001 - a packed forward an architecture does not support yet
        row.update(status="error", error=_short(error))
        return cell
    row["loss_pass_s"] = time.perf_counter() - t0
    scored = [int((labels != -100).sum()) for _, (_, labels) in sorted(documents.items())]
    row.update(
        document_losses=losses,
        scored_tokens=sum(scored),
        mean_loss=sum(loss * n for loss, n in zip(losses, scored)) / sum(scored),
    )

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], **({"fused": True} if device == "cuda" else {}))

    def step(batch: dict) -> None:
        with _autocast(device, dtype):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cell.step = step
    return cell


def run_cell_here(spec: dict) -> dict:
    """Measure one cell in this process: :func:`prepare_cell`, then time training passes. Returns the result row
    (``status`` ``ok``, ``error``, ``OOM`` or ``n/a``)."""
    device = spec["device"]
    cell = prepare_cell(spec)
    row = cell.row
    if "status" in row:
        return row
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = rss_kib() * 1024
    peak = PeakRSS() if device == "cpu" else None
    try:
        cell.warm_up(spec)
        row.update(timed_passes(cell.one_pass, spec))
    except torch.OutOfMemoryError as error:
        return {**row, "status": "OOM", "error": _short(error)}
    except Exception as error:  # noqa: BLE001 - training failures are reported in the table
        return {**row, "status": "error", "error": _short(error)}
    if device == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        row["mem_method"] = "cuda max_memory_allocated"
    else:
        row["peak_mib"] = max(0, peak.peak_bytes() - base) / 2**20
        row["mem_method"] = f"RSS growth ({peak.mode})"
    row["tokens_per_s"] = row["real_tokens"] / row["time_s"]
    row["status"] = "ok"
    return row


def release_freed_memory() -> None:
    """glibc's ``malloc_trim(0)``: hand the heap's free pages back to the OS (elsewhere nothing), so that peak-RSS
    growth measured next counts what the next step allocates, not what the allocator kept from before."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_row_interleaved(spec: dict) -> list[dict]:
    """Measure the three schemes of one row in this process, their passes interleaved (``--interleave``).

    Each scheme is prepared (:func:`prepare_cell`) and warmed up by a whole pass over its batches, its memory measured
    over that pass (growth of peak RSS above the RSS before it); then ``spec["repeats"]`` rounds each time one pass
    of every scheme, back to back, in an order that rotates from round to round. A round during which other processes used more than
    ``max_background`` of the CPU is redone (at most 3 x repeats rounds; the quietest are kept otherwise). On a
    shared machine whose speed drifts by tens of percent over minutes, the schemes of one round meet the same
    conditions, so their ratios hold where cells timed minutes apart do not. Returns one row per scheme (as
    :func:`run_cell_here`), ``round_ratios`` on the packed row: packed / padded and packed / grouped per round."""
    cells = {}
    for scheme in SCHEMES:
        cell = prepare_cell({**spec, "scheme": scheme})
        if "status" not in cell.row:
            gc.collect()
            release_freed_memory()  # what earlier schemes freed goes back to the OS: each warm-up starts alike
            base = rss_kib() * 1024
            peak = PeakRSS()
            try:
                cell.warm_up({**spec, "warmup_batches": None})  # a whole pass: every batch's shape, every batch's peak
            except Exception as error:  # noqa: BLE001 - training failures are reported in the table
                cell.row.update(status="error", error=_short(error))
            else:
                cell.row["peak_mib"] = max(0, peak.peak_bytes() - base) / 2**20
                cell.row["mem_method"] = f"RSS growth over the warm-up ({peak.mode}), schemes in one process"
        cells[scheme] = cell
    ready = [s for s in SCHEMES if "status" not in cells[s].row]
    load = BackgroundLoad()
    rounds: list[tuple[dict[str, float], float]] = []  # (seconds per scheme, busiest other-process CPU share)
    waited = 0.0

    def quiet_rounds() -> int:
        return sum(other <= spec["max_background"] for _, other in rounds)

    while ready and quiet_rounds() < spec["repeats"] and len(rounds) < 3 * spec["repeats"]:
        if spec["max_background"] < 1 and waited < spec["quiet_wait"]:
            t0 = time.perf_counter()
            load.wait_quiet(spec["max_background"], spec["quiet_wait"] - waited)
            waited += time.perf_counter() - t0
        shift = len(rounds) % len(ready)
        times, busiest = {}, 0.0
        for scheme in ready[shift:] + ready[:shift]:
            times[scheme], other = load.measure(cells[scheme].one_pass)
            busiest = max(busiest, other)
        rounds.append((times, busiest))
    kept = [r for r in rounds if r[1] <= spec["max_background"]][: spec["repeats"]]
    if len(kept) < spec["repeats"]:
        kept = sorted(rounds, key=lambda r: r[1])[: spec["repeats"]]
    for scheme in ready:
        row = cells[scheme].row
        times = [r[0][scheme] for r in kept]
        row.update(
            time_s=statistics.median(times),
            times_s=times,
            background_cpu=[r[1] for r in kept],
            attempts=len(rounds),
            waited_s=waited,
            status="ok",
        )
        row["tokens_per_s"] = row["real_tokens"] / row["time_s"]
    if len(ready) == len(SCHEMES):
        tokens = {s: cells[s].row["real_tokens"] for s in SCHEMES}
        cells["packed"].row["round_ratios"] = {
            other: [(tokens["packed"] / r[0]["packed"]) / (tokens[other] / r[0][other]) for r in kept]
            for other in ("padded", "group_by_length")
        }
    return [{"scheme": s, **cells[s].row} for s in SCHEMES]


def run_worker_and_report(spec_json: str) -> None:
    """The worker process's whole job: run one cell (or, ``--interleave``, one row) and print its row (rows) as a
    ``RESULT`` line."""
    spec = json.loads(spec_json)
    try:
        row = run_row_interleaved(spec) if spec.get("interleave") else run_cell_here(spec)
    except MemoryError as error:
        row = {"status": "OOM", "error": _short(error)}
    print("RESULT " + json.dumps(row), flush=True)


def run_cell_in_worker(spec: dict, timeout: float, mem_limit_gib: float) -> dict | list[dict]:
    """Run one cell (``--interleave``: one row, a list of three cells) in a fresh process (``--worker``), killed past
    ``timeout`` seconds or ``mem_limit_gib`` RSS."""
    import psutil

    cmd = [sys.executable, "-m", "benchmarks.benchmark_packing", "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO_ROOT
    )
    watched, killed = psutil.Process(proc.pid), None
    while proc.poll() is None:
        try:
            rss = watched.memory_info().rss
        except psutil.Error:
            rss = 0
        if time.perf_counter() - t0 > timeout:
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
        return {"status": killed, "error": f"killed after {wall:.0f} s", "wall_s": wall}
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            if isinstance(result, list):  # --interleave: the row's three cells
                return [{**r, "wall_s": wall} for r in result]
            return {**result, "wall_s": wall}
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    status = "OOM" if proc.returncode in (-9, 137) else "error"
    return {"status": status, "error": tail[-300:] or f"exit code {proc.returncode}", "wall_s": wall}


# ----------------------------------------------------------------------------------------------------------------
# Tables and plot
# ----------------------------------------------------------------------------------------------------------------


def _cell_key(r: dict) -> tuple:
    return (r["dtype"], r["attn_implementation"], r["arch"], r["batch_size"])


def _tps(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return f"{r['status']}: {r.get('error', '')}".replace("|", "/")
    return f"{r['tokens_per_s']:,.0f}"


def _ratio(a: dict | None, b: dict | None, goal: float) -> str:
    if not (a and b and a["status"] == "ok" and b["status"] == "ok"):
        return "-"
    ratio = a["tokens_per_s"] / b["tokens_per_s"]
    rounds = a.get("round_ratios", {}).get(b["scheme"])
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if rounds and len(rounds) > 1 else ""
    return f"{ratio:.2f}x{spread}" + ("" if ratio >= goal else " (below goal)")


def _triple(cells: dict, field: str, fmt: str) -> str:
    """``field`` of the three schemes' cells, padded / group_by_length / packed ("-" where missing)."""
    return " / ".join(format(cells[s][field], fmt) if field in cells.get(s, {}) else "-" for s in SCHEMES)


def _overheads(cells: dict) -> str:
    return " / ".join(
        f"{cells[s]['computed_tokens'] / cells[s]['real_tokens']:.2f}" if "computed_tokens" in cells.get(s, {}) else "-"
        for s in SCHEMES
    )


def loss_agreement(cells: dict, dtype: str) -> str:
    """How far the other schemes' losses lie from ``padded``'s, relative: of the mean over all scored positions, and
    of the worst single document (the same documents and positions in every scheme); "agree" when the worst document
    is within :data:`LOSS_TOLERANCE`."""
    reference = cells.get("padded", {})
    others = [cells[s] for s in SCHEMES[1:] if "document_losses" in cells.get(s, {})]
    if "document_losses" not in reference or not others:
        return "-"
    mean = max(abs(c["mean_loss"] - reference["mean_loss"]) / abs(reference["mean_loss"]) for c in others)
    worst = max(abs(a - b) / abs(b) for c in others for a, b in zip(c["document_losses"], reference["document_losses"]))
    verdict = "agree" if worst <= LOSS_TOLERANCE[dtype] else "**DIFFER**"
    return f"mean {mean:.0e}, worst doc {worst:.0e}: {verdict}"


def render_markdown(meta: dict, results: list[dict]) -> str:
    lines = [
        "# Packed (padding-free) training against padded batches",
        "",
        f"Real (unpadded) tokens per second of a training step (forward + backward + AdamW step, masked-LM head), "
        f"median of {meta['repeats']} passes over the same {meta['num_batches']} batches per scheme"
        + (
            " (the three schemes of a row in one process, their passes interleaved round by round; a ratio's range "
            "over the rounds in brackets)"
            if meta.get("interleave")
            else ""
        )
        + ". Documents: "
        f"lengths log-uniform in [{meta['min_length']}, {meta['max_length']}] (seed {meta['seed']}), "
        f"{MASK_FRACTION:.0%} masked. Padded batches are padded to a multiple of {meta['pad_multiple']}; "
        f"group_by_length batches come from transformers' get_length_grouped_indices with mega-batches of "
        f"{meta['mega_batch_mult']} batches: the run's {meta['num_batches']} batches are spread evenly over one full "
        "mega-batch, and padded and packed shuffle the same documents; packed rows (the batches of padded) come from "
        f"DataCollatorWithFlattening (boundaries as `{meta['packed_form']}`).",
        "",
        f"Model: hidden {meta['config']['hidden']}, {meta['config']['layers']} layers, {meta['config']['heads']} "
        f"heads, feed-forward {meta['config']['intermediate']}, vocab {meta['config']['vocab']}, dropout "
        f"{meta['config']['dropout']}; windows {meta['windows']} (Longformer window, BigBird block, Performer "
        f"features, Reformer chunk). {meta['size_note']}",
        "",
        f"Machine: `{json.dumps(meta['machine'])}`; git {meta['git']}; {meta['date']}.",
        "",
        "Columns: tokens/s per scheme; the ratios packed / padded (goal >= "
        f"{GOALS['padded']}x) and packed / group_by_length (goal >= {GOALS['group_by_length']}x); computed / real "
        "tokens (padding overhead of the batches as given to the model); mean masked-LM loss per scored token of "
        "each scheme in eval mode on the initial weights (the same positions in every scheme), and the largest "
        "relative difference from `padded` of that mean and of any one document's mean loss (tolerance per document "
        f"{LOSS_TOLERANCE['float32']:g} in float32, {LOSS_TOLERANCE['bfloat16']:g} in bfloat16); peak memory "
        f"({meta['mem_note']}). Triples are padded / group_by_length / packed.",
        "",
    ]
    if meta.get("simulated_overhead"):
        sim = ", ".join(
            f"B={b}: padded {v['padded']:.2f}, group_by_length {v['group_by_length']:.2f}"
            for b, v in meta["simulated_overhead"].items()
        )
        lines += [f"Computed / real tokens simulated over {meta['simulated_batches']} batches (no model): {sim}.", ""]
    grouped: dict[tuple, dict] = {}
    for r in results:
        grouped.setdefault(_cell_key(r), {})[r["scheme"]] = r
    for dtype, attn in dict.fromkeys(k[:2] for k in grouped):  # in the order of the run
        lines += [
            f"## {meta['machine']['device']}, {dtype}, attn_implementation={attn}",
            "",
            "| arch | B | padded tok/s | group_by_length tok/s | packed tok/s | packed / padded | packed / grouped "
            "| computed / real | mean loss | loss agreement | peak MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key in sorted((k for k in grouped if k[:2] == (dtype, attn)), key=lambda k: (ARCHS.index(k[2]), k[3])):
            cells = grouped[key]
            packed = cells.get("packed")
            speeds = [_tps(cells.get(s)) for s in SCHEMES]
            if len(set(speeds)) == 1 and speeds[0] != "-" and not speeds[0][0].isdigit():
                speeds[1:] = ["(same)", "(same)"]  # one failure of the whole row, said once
            lines.append(
                f"| {key[2]} | {key[3]} | {' | '.join(speeds)} | "
                f"{_ratio(packed, cells.get('padded'), GOALS['padded'])} | "
                f"{_ratio(packed, cells.get('group_by_length'), GOALS['group_by_length'])} | "
                f"{_overheads(cells)} | {_triple(cells, 'mean_loss', '.4f')} | {loss_agreement(cells, dtype)} | "
                f"{_triple(cells, 'peak_mib', ',.0f')} |"
            )
        lines.append("")
    noisy = [r for r in results if r["status"] == "ok" and max(r["background_cpu"]) > meta["max_background"]]
    worst = max((max(r["background_cpu"]) for r in results if r["status"] == "ok"), default=0.0)
    lines.append(
        f"Largest background CPU load during a counted pass: {worst:.0%}"
        + (f" ({len(noisy)} cells above {meta['max_background']:.0%}: treat them as noisy)." if noisy else ".")
    )
    sources = {r["arch"]: set() for r in results}
    for r in results:
        if r.get("hfx_model_src"):
            sources[r["arch"]].add(r["hfx_model_src"])
    changed = [a for a, s in sources.items() if len(s) > 1]
    if changed:
        lines.append(f"Warning: the model sources of {', '.join(changed)} changed during the run (see the JSON).")
    return "\n".join(lines) + "\n"


def render_plot(results: list[dict], path: Path) -> None:
    """Bars of real tokens per second per architecture and scheme; a row of panels per (dtype, attention), a column
    per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in results if r["status"] == "ok"]
    settings = list(dict.fromkeys((r["dtype"], r["attn_implementation"]) for r in measured))  # in the order of the run
    sizes = sorted({r["batch_size"] for r in measured})
    if not settings:
        return
    fig, axes = plt.subplots(len(settings), len(sizes), figsize=(5.5 * len(sizes), 3.8 * len(settings)), squeeze=False)
    width = 0.8 / len(SCHEMES)
    for (dtype, attn), panel_row in zip(settings, axes):
        for batch_size, ax in zip(sizes, panel_row):
            rows = [
                r
                for r in results
                if (r["dtype"], r["attn_implementation"], r["batch_size"]) == (dtype, attn, batch_size)
            ]
            archs = [a for a in ARCHS if any(r["arch"] == a for r in rows)]
            for i, scheme in enumerate(SCHEMES):
                cells = [next((r for r in rows if r["arch"] == a and r["scheme"] == scheme), {}) for a in archs]
                values = [c["tokens_per_s"] if c.get("status") == "ok" else 0.0 for c in cells]
                ax.bar([x + (i - 1) * width for x in range(len(archs))], values, width, label=scheme)
            ax.set_xticks(range(len(archs)), archs, rotation=20)
            ax.set(ylabel="real tokens / s (training)", title=f"{dtype}, {attn}, B={batch_size}")
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--arch", nargs="+", choices=ARCHS, default=None, help="default: all (--quick: longformer)")
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--attn-implementation", nargs="+", choices=["sdpa", "eager", "flex_attention"], default=["sdpa"])
    p.add_argument("--hidden-size", type=int, default=None, help="default 768 on cuda, 256 on cpu")
    p.add_argument("--layers", type=int, default=None, help="default 2")
    p.add_argument("--heads", type=int, default=None, help="default 12 on cuda, 4 on cpu")
    p.add_argument("--intermediate", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--window", type=int, default=None, help=f"each arch's own knob, default {DEFAULT_WINDOW}")
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="hidden and attention dropout (0: FlexAttention applies; it has no dropout)",
    )
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 16])
    p.add_argument("--num-batches", type=int, default=8, help="batches per scheme (the same documents in each)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the batches (median)")
    p.add_argument(
        "--warmup-batches", type=int, default=None, help="untimed steps first (default: 1 on cpu, all on cuda)"
    )
    p.add_argument("--min-length", type=int, default=64)
    p.add_argument("--max-length", type=int, default=8192, help="longest document")
    p.add_argument("--pad-multiple", type=int, default=512, help="padded batches are padded to a multiple of this")
    p.add_argument("--mega-batch-mult", type=int, default=50, help="group_by_length: batches per sorted mega-batch")
    p.add_argument("--packed-form", choices=["seq_idx", "cu_seq_lens"], default="cu_seq_lens")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    p.add_argument("--max-background", type=float, default=0.15, help="CPU share other processes may use (CPU runs)")
    p.add_argument("--quiet-wait", type=float, default=120.0, help="seconds per cell to wait for a quiet machine")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per cell (CPU worker processes)")
    p.add_argument("--mem-limit-gib", type=float, default=48.0, help="RSS limit per cell (CPU worker processes)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no row (arch x dtype x attention x batch size) that would end past this many seconds "
        "(estimated from the slowest row so far); left-out rows show as skipped",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="CPU: the three schemes of a row in one fresh process, their timed passes interleaved round by round "
        "(ratios measured under the same machine conditions)",
    )
    p.add_argument("--in-process", action="store_true", help="run cells in this process (default on cuda and --quick)")
    p.add_argument("--workers", action="store_true", help="with --quick: a fresh process per cell all the same")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: hidden 32, 1 layer, documents of 16-256 tokens, B=4, 2 batches, 1 repeat",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument(
        "--merge",
        action="store_true",
        help="add the rows of this run to the saved JSON of the same name (rows measured again replace "
        "theirs), e.g. one architecture at a time",
    )
    p.add_argument("--render-only", action="store_true", help="only redraw the table and plot from the saved JSON")
    p.add_argument("--name", default=None, help="file stem (default packing_<device>_<dtypes>[_quick])")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if args.quick:
        args.arch = args.arch or ["longformer"]
        args.hidden_size, args.layers, args.heads = args.hidden_size or 32, args.layers or 1, args.heads or 2
        args.vocab, args.min_length, args.max_length, args.pad_multiple = 100, 16, 256, 16
        args.batch_sizes, args.num_batches, args.repeats, args.max_background = [4], 2, 1, 1.0
        args.warmup_batches = args.num_batches if args.warmup_batches is None else args.warmup_batches
        # One process for all cells: a fresh worker per cell spends its time importing torch and transformers.
        args.in_process = args.in_process or not args.workers
        windows = QUICK_WINDOW
    else:
        windows = DEFAULT_WINDOW
    args.arch = args.arch or list(ARCHS)
    args.hidden_size = args.hidden_size or (768 if cuda else 256)
    args.layers = args.layers or 2
    args.heads = args.heads or (12 if cuda else 4)
    args.intermediate = args.intermediate or 4 * args.hidden_size
    args.windows = {a: args.window if args.window is not None else windows[a] for a in ARCHS}
    if args.warmup_batches is None and not cuda:
        args.warmup_batches = 1
    args.in_process = args.in_process or cuda
    if args.interleave and cuda:
        p.error("--interleave is for the CPU (on CUDA every cell already runs in one process, back to back)")
    if cuda:
        args.max_background = 1.0  # other processes' CPU load does not slow a GPU down; do not wait for quiet
    return args


def simulated_overhead(args: argparse.Namespace, batches: int = 400) -> dict:
    """Padding overhead (computed / real tokens) of ``padded`` and ``group_by_length`` over a long run of ``batches``
    batches of other documents from the same distribution (no model): what the measured batches should resemble."""
    out = {}
    for b in args.batch_sizes:
        lengths = document_lengths(batches * b, args.min_length, args.max_length, args.seed + 7)
        schemes = {
            "padded": random_batches(list(range(len(lengths))), b, args.seed),
            "group_by_length": group_by_length_batches(lengths, b, args.mega_batch_mult, args.seed),
        }
        out[b] = {s: overhead(batches_of_s, lengths, args.pad_multiple) for s, batches_of_s in schemes.items()}
    return out


# What rows merged into one table (--merge) must share.
MERGE_SETTINGS = (
    "config",
    "windows",
    "num_batches",
    "repeats",
    "min_length",
    "max_length",
    "pad_multiple",
    "mega_batch_mult",
    "packed_form",
    "seed",
)

# The command-line settings every cell's spec carries.
CELL_ARGS = (
    "num_batches",
    "repeats",
    "warmup_batches",
    "min_length",
    "max_length",
    "pad_multiple",
    "mega_batch_mult",
    "packed_form",
    "lr",
    "seed",
    "threads",
    "max_background",
    "quiet_wait",
)


def run_cell(spec: dict, args: argparse.Namespace) -> dict:
    """One cell, in this process or a fresh one (``args.in_process``); its row always has ``status`` and ``wall_s``."""
    t0 = time.perf_counter()
    if not args.in_process:
        return run_cell_in_worker(spec, args.timeout, args.mem_limit_gib)
    try:
        row = run_cell_here(spec)
    except Exception as error:  # noqa: BLE001 - one failing cell must not end the run
        row = {"status": "error", "error": _short(error)}
    if args.device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return {**row, "wall_s": time.perf_counter() - t0}


def run_row(spec: dict, args: argparse.Namespace) -> list[dict]:
    """``--interleave``: the three cells of one row, measured together (:func:`run_row_interleaved`) in a fresh
    process (this one with ``--in-process``); each row has ``status`` and ``wall_s`` (the row's)."""
    spec = {**spec, "interleave": True}
    t0 = time.perf_counter()
    if args.in_process:
        try:
            return [{**r, "wall_s": time.perf_counter() - t0} for r in run_row_interleaved(spec)]
        except Exception as error:  # noqa: BLE001 - one failing row must not end the run
            result = {"status": "error", "error": _short(error), "wall_s": time.perf_counter() - t0}
    else:
        result = run_cell_in_worker(spec, args.timeout, args.mem_limit_gib)
    return result if isinstance(result, list) else [{"scheme": s, **result} for s in SCHEMES]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker_and_report(args.worker)
        return 0
    import transformers

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    # bfloat16 rows train under autocast (float32 weights), as Trainer(bf16=True)
    info = machine(SimpleNamespace(device=args.device, dtype="+".join(args.dtype), autocast="bfloat16" in args.dtype))
    config = dict(
        hidden=args.hidden_size,
        layers=args.layers,
        heads=args.heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        dropout=args.dropout,
    )
    cpu_default = args.device == "cpu" and (args.hidden_size, args.layers) == (256, 2)
    meta = {
        "machine": info,
        "transformers": transformers.__version__,
        "git": git_describe(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "config": config,
        "windows": args.windows,
        "size_note": "(The CPU default is narrower than a base model, hidden 256 instead of 768, so that a run takes "
        "minutes.)"
        if cpu_default
        else "",
        "mem_note": "CUDA max_memory_allocated during training, weights and optimizer included"
        if args.device == "cuda"
        else "growth of peak RSS above the RSS once model and batches are built, "
        + (
            "over each scheme's warm-up pass, the row's schemes in one process (the heap trimmed before each)"
            if args.interleave
            else "cells in one process: later cells reuse memory the allocator kept"
            if args.in_process
            else "one fresh process per cell"
        ),
        **{
            k: getattr(args, k)
            for k in (
                "repeats",
                "num_batches",
                "min_length",
                "max_length",
                "pad_multiple",
                "mega_batch_mult",
                "packed_form",
                "seed",
                "max_background",
                "batch_sizes",
                "warmup_batches",
                "lr",
                "threads",
                "interleave",
            )
        },
        "simulated_batches": 400,
        "simulated_overhead": simulated_overhead(args),
    }
    if args.device == "cuda":
        meta["machine"]["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    print(json.dumps(meta["machine"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"packing_{args.device}_{'-'.join(args.dtype)}" + ("_quick" if args.quick else "")
    json_path, md_path, png_path = (args.out / f"{stem}.{ext}" for ext in ("json", "md", "png"))
    if args.render_only:
        saved = json.loads(json_path.read_text())
        md_path.write_text(render_markdown(saved["meta"], saved["results"]))
        render_plot(saved["results"], png_path)
        print(f"wrote {md_path}, {png_path}")
        return 0
    results: list[dict] = []
    # Attention outermost: with --budget-s, the tables of the first choice (sdpa) fill up before FlexAttention's,
    # whose rows spend most of their time compiling a kernel per shape.
    rows = list(itertools.product(args.attn_implementation, args.dtype, args.arch, args.batch_sizes))
    if args.merge and json_path.exists():
        saved = json.loads(json_path.read_text())
        settings = [k for k in MERGE_SETTINGS if saved["meta"].get(k) != json.loads(json.dumps(meta[k]))]
        if settings:
            raise SystemExit(f"--merge: {json_path} was measured with other {', '.join(settings)}; use another --name")
        # Rows measured again replace the saved ones; the others stay.
        redo = {(a, b, d, i) for i, d, a, b in rows}
        results = [
            r
            for r in saved["results"]
            if (r["arch"], r["batch_size"], r["dtype"], r["attn_implementation"]) not in redo
        ]
    started, longest_row = time.perf_counter(), 0.0
    for attn, dtype, arch, batch_size in rows:
        identity = {"arch": arch, "batch_size": batch_size, "dtype": dtype, "attn_implementation": attn}
        if args.budget_s is not None and time.perf_counter() - started + longest_row > args.budget_s:
            # A row whose three cells would not end inside the budget is left out whole (its ratios need all three).
            results += [{**identity, "scheme": s, "status": "skipped", "error": "time budget"} for s in SCHEMES]
            continue
        if args.device == "cuda" and attn == "flex_attention":
            # FlexAttention compiles a kernel per shape, under a recompile limit per process (past it dynamo falls
            # back to the eager form, which materialises every score): start each row afresh (inductor's on-disk
            # cache keeps recompiling shapes it has seen cheap).
            torch._dynamo.reset()
        row_start = time.perf_counter()
        spec = {
            **identity,
            "device": args.device,
            "config": {**config, "window": args.windows[arch]},
            **{k: getattr(args, k) for k in CELL_ARGS},
        }
        # The schemes of one row back to back (--interleave: pass by pass), so that drifts of machine load hit all
        # three alike.
        if args.interleave:
            cells = run_row(spec, args)
        else:
            cells = (run_cell({**spec, "scheme": scheme}, args) for scheme in SCHEMES)  # each printed when done
        for scheme, cell in zip(SCHEMES, cells):
            row = {**identity, **cell, "scheme": scheme}
            results.append(row)
            summary = (
                f"{row['tokens_per_s']:,.0f} tok/s, loss {row['mean_loss']:.4f}, {row['peak_mib']:,.0f} MiB"
                if row["status"] == "ok"
                else row.get("error", "")
            )
            print(
                f"[{time.strftime('%H:%M:%S')}] {arch} {dtype} {attn} B={batch_size} {scheme}: {row['status']} "
                f"{summary} (wall {row['wall_s']:.0f} s)",
                flush=True,
            )
            json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        longest_row = max(longest_row, time.perf_counter() - row_start)
        md_path.write_text(render_markdown(meta, results))  # a run stopped from outside keeps its table so far
    if hasattr(os, "getloadavg"):
        meta["machine"]["load_average_1min_after"] = os.getloadavg()[0]
    json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    report = render_markdown(meta, results)
    md_path.write_text(report)
    render_plot(results, png_path)
    print(report)
    print(f"wrote {md_path}, {json_path}, {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
