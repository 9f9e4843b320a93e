"""One FSDP2 process of ``tests/test_fsdp.py``: every registered architecture, sharded over all ranks (gloo on CPU).

Run from the repository root as ``torchrun --standalone --nproc_per_node=2 -m tests.fsdp_worker OUT.json``.

accelerate does not shard on the CPU: ``TrainingArguments(fsdp=..., use_cpu=True)`` under torchrun trains with
``DistributedDataParallel`` and no message (accelerate 1.15 sets ``DistributedType.FSDP`` only for accelerator
types, so ``Trainer.is_fsdp_enabled`` is False), and without ``use_cpu`` Trainer stops with "ValueError: Using fsdp
only works in distributed training.". So this worker calls PyTorch's ``fully_shard`` (FSDP2) itself, the same
wrapping accelerate's FSDP2 plugin does on GPUs: one unit per instance of a class in the model's
``_no_split_modules`` (``transformer_layer_cls_to_wrap``), then the root module.

For each architecture, with the same initial weights on every rank (same seed):

- rank 0 trains an unsharded copy in this process on the whole global batch: the single-process reference;
- all ranks train the sharded model, each on its slice of that batch, and record the mean of their losses;
- the full (unsharded) state dict is gathered on rank 0, saved with ``save_pretrained`` and loaded with
  ``from_pretrained`` into a fresh model; its outputs are compared with the sharded model's (each rank evaluates its
  slice of an evaluation batch; the slices are gathered).

Rank 0 writes what it measured to ``OUT.json``; the test asserts on it.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import hf_xformers  # noqa: E402
from tests.conformance import SEQ_LEN, _ids  # noqa: E402
from tests.test_bigbird import TestBigBirdConformance  # noqa: E402
from tests.test_linformer import TestLinformerConformance, TestLinformerLayerwiseConformance  # noqa: E402
from tests.test_longformer import TestLongformerConformance  # noqa: E402
from tests.test_performer import TestPerformerConformance  # noqa: E402
from tests.test_reformer import TINY as REFORMER_TINY  # noqa: E402
from tests.test_swin import TestSwinConformance  # noqa: E402
from tests.test_transfo_xl import TINY as TRANSFO_XL_TINY  # noqa: E402
from tests.test_universal import TestUniversalConformance  # noqa: E402

GLOBAL_BATCH = 4
STEPS = 3
LR = 0.1


def _text(batch: int, seed: int) -> dict:
    return {"input_ids": _ids(batch, SEQ_LEN, seed=seed)}


def _lm_batch(batch: int, seed: int) -> dict:
    # Every position is a target: each rank's mean loss then weighs as many tokens as every other rank's, so the mean
    # over ranks is the mean over the global batch (with -100 labels at different counts per rank it would not be).
    inputs = _text(batch, seed)
    inputs["labels"] = inputs["input_ids"].clone()
    return inputs


def _classification_batch(batch: int, seed: int) -> dict:
    inputs = _text(batch, seed)
    inputs["labels"] = torch.arange(batch) % 3
    return inputs


def _span_batch(batch: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, SEQ_LEN - 4, (batch,), generator=g)
    return {**_text(batch, seed), "start_positions": start, "end_positions": start + 3}


def _image_batch(batch: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g), "labels": torch.arange(batch) % 3}


def _seq2seq_batch(batch: int, seed: int) -> dict:
    return {"input_ids": _ids(batch, SEQ_LEN, seed=seed), "labels": _ids(batch, 12, seed=seed + 100)}


def cases() -> dict[str, tuple[type, object, callable]]:
    """Case name (a model_type, or a variant) -> (head class, tiny config, batch maker): the conformance suites' tiny
    configs, one head each.

    Overrides make a single-process run of the global batch comparable with the sharded run of its slices:
    BigBird's training-mode random blocks are drawn per example from the global RNG (a batch of 4 draws other
    numbers than two batches of 2), so the seeded blocks are used; Reformer's LSH rotations likewise, so they are
    seeded. Universal's ACT leaves its loop early on the CPU once every position of the *local* batch has halted:
    ranks would then call the shared layer a different number of times, and FSDP's per-call all-gathers would no
    longer pair up across ranks, so early exit is off (``act_early_exit=False``, as every FSDP run needs).
    """
    m = hf_xformers
    return {
        "hfx-longformer": (
            m.HfxLongformerForSequenceClassification, TestLongformerConformance().make_config(), _classification_batch
        ),
        "hfx-bigbird": (
            m.HfxBigBirdForMaskedLM, TestBigBirdConformance().make_config(fixed_random_blocks=True), _lm_batch
        ),
        "hfx-swin": (m.HfxSwinForImageClassification, TestSwinConformance().make_config(), _image_batch),
        "hfx-linformer": (m.HfxLinformerForQuestionAnswering, TestLinformerConformance().make_config(), _span_batch),
        # One projection for all layers, owned by the base model (the default gives each layer its own).
        "hfx-linformer-layerwise": (
            m.HfxLinformerForQuestionAnswering, TestLinformerLayerwiseConformance().make_config(), _span_batch
        ),
        "hfx-performer": (
            m.HfxPerformerForCausalLM, TestPerformerConformance().make_config(is_decoder=True), _lm_batch
        ),
        "hfx-reformer": (m.HfxReformerForCausalLM, m.HfxReformerConfig(**REFORMER_TINY, hash_seed=3), _lm_batch),
        "hfx-transfo-xl": (m.HfxTransfoXLForCausalLM, m.HfxTransfoXLConfig(**TRANSFO_XL_TINY), _lm_batch),
        "hfx-universal": (
            m.HfxUniversalForSeq2SeqLM,
            TestUniversalConformance().make_config(act_max_steps=3, act_early_exit=False),
            _seq2seq_batch,
        ),
    }  # fmt: skip


def _slice(batch: dict, rank: int, world: int) -> dict:
    per = GLOBAL_BATCH // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def _train(model, batches, loss_of) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss_of(loss.detach()))
    return losses


def _mean_over_ranks(loss: torch.Tensor) -> float:
    loss = loss.clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def _eval_logits(model, batch: dict) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "start_positions", "end_positions")}
        if "decoder_input_ids" not in inputs and "labels" in batch and model.config.is_encoder_decoder:
            inputs["decoder_input_ids"] = batch["labels"]
        out = model(**inputs)
        logits = out.start_logits if "start_positions" in batch else out.logits
        return logits.float()


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def run_case(model_type: str, mesh, rank: int, world: int) -> dict | None:
    model_class, config, make_batch = cases()[model_type]
    torch.manual_seed(0)
    model = model_class(config)
    initial = copy.deepcopy(model)  # before fully_shard, which turns the modules into FSDP modules in place
    batches = [make_batch(GLOBAL_BATCH, seed=10 + step) for step in range(STEPS)]
    eval_batch = make_batch(GLOBAL_BATCH, seed=99)

    report = None
    if rank == 0:
        reference = copy.deepcopy(initial).train()
        reference_losses = _train(reference, batches, lambda loss: loss.item())

    unit_names = set(model._no_split_modules)
    units = [module for module in model.modules() if type(module).__name__ in unit_names]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    fsdp_losses = _train(model, [_slice(b, rank, world) for b in batches], _mean_over_ranks)

    local = _eval_logits(model, _slice(eval_batch, rank, world))
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    fsdp_logits = torch.cat(gathered)

    # A collective: every rank takes part, rank 0 receives the full tensors (the others an empty dict).
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    if rank == 0:
        reference_state = reference.state_dict()
        weight_diff = max(
            (full[k] - reference_state[k]).abs().max().item() for k in full if full[k].is_floating_point()
        )
        start = initial.state_dict()
        moved = max((reference_state[k] - start[k]).abs().max().item() for k in start if start[k].is_floating_point())
        full_keys = sorted(full)
        with tempfile.TemporaryDirectory() as folder:
            # save_pretrained empties the dict it is given (it pops tensors as it writes them): hand it a copy.
            initial.save_pretrained(folder, state_dict=dict(full))
            loaded, info = model_class.from_pretrained(folder, output_loading_info=True)
        # Slice by slice, as the ranks computed them: the same shapes give the same kernels (and bits).
        loaded_logits = torch.cat([_eval_logits(loaded, _slice(eval_batch, r, world)) for r in range(world)])
        reference_logits = torch.cat([_eval_logits(reference, _slice(eval_batch, r, world)) for r in range(world)])
        report = {
            "units": sorted(unit_names),
            "state_dict_matches_model": full_keys == sorted(reference_state),
            "unit_count": len(units),
            "all_parameters_sharded": sharded and all(isinstance(m, FSDPModule) for m in [model, *units]),
            "reference_losses": reference_losses,
            "fsdp_losses": fsdp_losses,
            "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(fsdp_losses, reference_losses)),
            "weights_max_abs_diff_vs_reference": weight_diff,
            "weights_max_abs_change_in_training": moved,
            "loading_info": {k: sorted(v) for k, v in info.items() if k != "error_msgs"},
            "loaded_vs_fsdp_max_abs_diff": (loaded_logits - fsdp_logits).abs().max().item(),
            "fsdp_vs_reference_logits_max_rel_diff": _max_rel(fsdp_logits, reference_logits),
        }
    return report


def accelerate_shards_on_cpu() -> bool:
    """Whether Trainer would shard on the CPU when asked to: False with accelerate 1.15 (it trains under DDP)."""
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder, use_cpu=True, fsdp=True, report_to="none",
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["HfxEncoderLayer"]},
        )  # fmt: skip
        model = hf_xformers.HfxLongformerForSequenceClassification(TestLongformerConformance().make_config())
        trainer = Trainer(model=model, args=args)
        return bool(trainer.is_fsdp_enabled)


def main() -> None:
    out_path = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    # One thread per process: the test runs two processes on a 2-core machine.
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for model_type in cases():
        if only is None or model_type in only:
            # Names the architecture in the output of a failed run.
            print(f"[rank {rank}] {model_type}", flush=True)
            try:
                results[model_type] = run_case(model_type, mesh, rank, world)
            except Exception as error:
                # Recorded, and the next architecture runs: the test reports each one. Every rank runs the same code
                # on the same shapes, so all of them fail at the same point and their collectives stay paired.
                results[model_type] = {"error": f"{type(error).__name__}: {error}"}
    results["accelerate_shards_on_cpu"] = accelerate_shards_on_cpu()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
