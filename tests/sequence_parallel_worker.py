"""One rank of ``tests/test_sequence_parallel.py``: every supported (type, head, batch) under DeepSpeed Ulysses on gloo.

Run from the repository root as ``torchrun --standalone --nproc_per_node=N -m tests.sequence_parallel_worker OUT.json``
with ``DS_ACCELERATOR=cpu``. Each rank:

1. computes every case in one process on the whole batch (training mode, no dropout): loss, logits, gradients;
2. sets up DeepSpeed's sequence-parallel group over all ranks (``parallel_state_sp.initialize_sequence_parallel``, what
   ``UlyssesSPAttentionHF.register_with_transformers`` does under accelerate);
3. runs each case again on its shard of the batch (rank ``r``: tokens ``r * S/N .. (r + 1) * S/N`` of every
   per-token tensor, as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` cuts them; the ``.../adapter`` cases go through the
   adapter itself and transformers' ``deepspeed_sp_compute_loss``, as Trainer does; the ``.../bf16`` cases run both
   under bfloat16 autocast), sums the gradients over the group (what DeepSpeed's engine does over its
   sequence-data-parallel group) and compares.

Rank 0 writes the largest differences per case to ``OUT.json``; ranks that disagree with rank 0 are reported too.
Further arguments keep only the cases whose name (``type/head/batch``) starts with one of them (scripts/gpu_check.py's
CPU dry run checks its plumbing on one case; the refusals always run).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from deepspeed.runtime.sequence_parallel import parallel_state_sp  # noqa: E402

from hf_xformers.attention.base import HfxSelfAttention  # noqa: E402
from hf_xformers.attention.lsh import HfxLSHSelfAttention  # noqa: E402
from hf_xformers.ops.sequence_parallel import SequenceShards  # noqa: E402
from tests.conformance import _TINY, _ids  # noqa: E402
from tests.test_bigbird import TestBigBirdConformance  # noqa: E402
from tests.test_linformer import TestLinformerConformance  # noqa: E402
from tests.test_longformer import TestLongformerConformance  # noqa: E402
from tests.test_performer import TestPerformerConformance  # noqa: E402
from tests.test_reformer import TestReformerConformance  # noqa: E402
from tests.test_universal import TestUniversalConformance  # noqa: E402

LENGTH = 32  # divisible by 2 and 4 ranks; 8 BigBird blocks of 4, several Longformer windows
DOCUMENTS = (9, 14, 9)  # the packed row's documents (sum = LENGTH)

CONFIGS = {
    "hfx-longformer": (TestLongformerConformance, {}),
    "hfx-bigbird": (TestBigBirdConformance, {"fixed_random_blocks": True, "num_random_blocks": 2}),
    "hfx-performer": (TestPerformerConformance, {}),
    "hfx-performer-causal": (TestPerformerConformance, {"is_decoder": True}),
    "hfx-linformer": (TestLinformerConformance, {"linformer_k": 16, "max_position_embeddings": 64}),
    # Seeded LSH rotations (training draws fresh ones otherwise); local chunks of 4, LSH chunks of 8.
    "hfx-reformer": (TestReformerConformance, {"hash_seed": 3, "num_attention_heads": 4}),
    "hfx-reformer-causal": (TestReformerConformance, {"hash_seed": 3, "num_attention_heads": 4, "is_decoder": True}),
    # Training's fresh random draws (BigBird's random blocks, Reformer's LSH rotations): every rank draws for all
    # heads, as one process does, and keeps its heads' part; the same generator state gives the same draws.
    "hfx-bigbird-drawn": (TestBigBirdConformance, {"fixed_random_blocks": False, "num_random_blocks": 2}),
    "hfx-reformer-drawn": (TestReformerConformance, {"num_attention_heads": 4}),
}
HEADS = {
    "masked_lm": "AutoModelForMaskedLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "question_answering": "AutoModelForQuestionAnswering",
    "token_classification": "AutoModelForTokenClassification",
    "causal_lm": "AutoModelForCausalLM",
}


def padded_batch(head: str) -> dict:
    ids = _ids(2, LENGTH, seed=3)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, LENGTH - 11 :] = 0  # row 1 padded: the last shard (of 4) is pure padding there
    ids = ids.masked_fill(mask == 0, 1)
    ids[:, 5] = 2  # a separator: Longformer's question answering puts the question (before it) global
    batch = {"input_ids": ids, "attention_mask": mask}
    return {**batch, **labels_for(head, ids, mask, sequences=2)}


def packed_batch(head: str) -> dict:
    ids = _ids(1, LENGTH, seed=4)
    seq_idx = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCUMENTS)])[None]
    starts = torch.tensor([0, *DOCUMENTS]).cumsum(0)[:-1]
    ids[0, starts + 3] = 2  # a separator in every document (Longformer's question answering)
    batch = {"input_ids": ids, "seq_idx": seq_idx}
    return {**batch, **labels_for(head, ids, torch.ones_like(ids), sequences=len(DOCUMENTS))}


def labels_for(head: str, ids: torch.Tensor, mask: torch.Tensor, sequences: int) -> dict:
    g = torch.Generator().manual_seed(5)
    if head in ("masked_lm", "causal_lm", "token_classification"):
        high = _TINY["vocab_size"] if head != "token_classification" else _TINY["num_labels"]
        labels = torch.randint(0, high, ids.shape, generator=g)
        keep = (torch.rand(ids.shape, generator=g) < 0.5) & mask.bool()
        labels = labels.masked_fill(~keep, -100)
        labels[:, 0] = -100  # the label DeepSpeed's adapter drops (see ops/sequence_parallel.gather_batch)
        return {"labels": labels}
    if head == "sequence_classification":
        return {"labels": torch.randint(0, _TINY["num_labels"], (sequences,), generator=g)}
    return {
        "start_positions": torch.randint(0, 20, (sequences,), generator=g),
        "end_positions": torch.randint(0, 20, (sequences,), generator=g),
    }


def cases() -> list[tuple[str, str, str]]:
    out = []
    for model_type in CONFIGS:
        causal = model_type.endswith("causal")
        heads = ("masked_lm", "sequence_classification", "question_answering")
        if model_type.endswith("drawn"):
            heads = ("masked_lm",)
        elif model_type != "hfx-reformer":
            heads += ("token_classification",)  # (Reformer has no token-classification head)
        for head in ("causal_lm",) if causal else heads:
            for form in ("padded", "packed"):
                if model_type == "hfx-linformer" and form == "packed":
                    continue  # Linformer refuses packed batches (its projections span the whole row)
                out.append((model_type, head, form))
    # Under bfloat16 autocast (Trainer(bf16=True)): the projections, the exchanges and the mechanisms in 16 bits.
    out += [
        ("hfx-longformer", "masked_lm", "bf16"),
        ("hfx-bigbird", "sequence_classification", "bf16"),
        ("hfx-performer-causal", "causal_lm", "bf16"),
        ("hfx-linformer", "question_answering", "bf16"),
        ("hfx-reformer-drawn", "masked_lm", "bf16"),
    ]
    out += [
        ("hfx-longformer", "masked_lm", "adapter"),
        ("hfx-performer-causal", "causal_lm", "adapter"),
        ("hfx-reformer-causal", "causal_lm", "adapter"),
    ]
    return out


def build(model_type: str, head: str):
    conformance, overrides = CONFIGS[model_type]
    config = conformance().make_config(**overrides)
    torch.manual_seed(0)
    auto = HEADS[head]
    model_class = conformance.heads.get(auto) or transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return model_class(config).train()


def batch_of(head: str, form: str) -> dict:
    return packed_batch(head) if form == "packed" else padded_batch(head)


def run(model, batch: dict, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    torch.manual_seed(1234)  # the same random draws in one process and on every rank
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
        out = model(**batch)
    out.loss.backward()
    logits = out.logits if hasattr(out, "logits") else torch.stack([out.start_logits, out.end_logits])
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return out.loss.detach(), logits.detach(), grads


def shard(batch: dict, rank: int, size: int) -> dict:
    cut = LENGTH // size
    return {
        k: (v[:, rank * cut : (rank + 1) * cut] if v.dim() == 2 and v.shape[1] == LENGTH else v)
        for k, v in batch.items()
    }


def through_adapter(model, batch: dict, rank: int, size: int, group) -> tuple:
    """As Trainer under ParallelismConfig(sp_backend="deepspeed"): DeepSpeed's adapter shards the batch (and turns
    labels into shift_labels), Trainer sets labels = shift_labels and combines the ranks' losses with
    deepspeed_sp_compute_loss."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    groups.mpu = parallel_state_sp  # what deepspeed.initialize(mpu=...) records
    positions = torch.arange(LENGTH).expand_as(batch["input_ids"]) + model.config.pad_token_id + 1
    full = {**batch, "position_ids": positions * batch["attention_mask"] + (1 - batch["attention_mask"])}
    loader = UlyssesSPDataLoaderAdapter([full], sp_rank=rank, sp_group=group, sp_world_size=size, device=DEVICE)
    inputs = on_device(next(iter(loader)))  # (the adapter keeps its shards on the CPU)
    inputs["labels"] = inputs["shift_labels"]
    pc = types.SimpleNamespace(sp_backend="deepspeed", sp_size=size)
    torch.manual_seed(1234)
    loss, out = deepspeed_sp_compute_loss(None, model, inputs, True, pc)
    loss.backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return loss.detach(), out.logits.detach(), grads, full


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1.0))


def refusals(rank: int, size: int) -> dict:
    """The ValueError of each call that sequence parallelism cannot serve, on this group (message or "no error")."""
    conformance, _ = CONFIGS["hfx-longformer"]
    calls = {
        "heads_not_divisible": lambda: build_with(conformance, num_attention_heads=size // 2)(),
        "output_attentions": lambda: build_with(conformance)(output_attentions=True),
        "unsupported_architecture": lambda: universal()(),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[f"refusal/{name}"] = {"message": "no error"}
        except ValueError as error:
            out[f"refusal/{name}"] = {"message": str(error)}
        except Exception:
            out[f"refusal/{name}"] = {"message": "other error: " + traceback.format_exc()[-1500:]}
    return out


def lsh_float32_hash(rank: int, size: int, group) -> dict:
    """One LSH layer under bfloat16 autocast with seeded rotations, where one process hashes a float32 re-projection
    of the layer input (LSHHashing.hash_input): the head shards must hash the same numbers. At 2 x 256 tokens hashing
    the exchanged bfloat16 query-keys flips buckets (on 2 ranks the context was 38 % away from one process's, the
    gradients 10 %)."""
    config = transformers.AutoConfig.for_model(
        "hfx-reformer", hidden_size=64, num_attention_heads=4, attn_layers=["lsh"], num_hidden_layers=1,
        lsh_attn_chunk_length=16, num_buckets=8, num_hashes=2, hash_seed=3, lsh_attention_probs_dropout_prob=0.0,
        axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32], max_position_embeddings=256, vocab_size=50,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = HfxLSHSelfAttention(config).train().to(DEVICE)
    x = torch.randn(2, 256, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def step(inputs, **kwargs):
        layer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            context = layer(inputs, **kwargs).context
        context.float().square().sum().backward()
        return context.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}

    reference, reference_grads = step(x)
    shards = SequenceShards(group, rank, size, 256 // size)
    context, grads = step(shards.local(x), sequence_parallel=shards)
    parts = [torch.empty_like(context) for _ in range(size)]
    dist.all_gather(parts, context.contiguous(), group=group)
    for g in grads.values():
        dist.all_reduce(g, group=group)
    return {
        "lsh_float32_hash": {
            "context_rel_diff": max_rel(torch.cat(parts, dim=1), reference),
            "grads_rel_diff": max(max_rel(grads[n], reference_grads[n]) for n in reference_grads),
        }
    }


def build_with(conformance, **overrides):
    """A call of a masked-LM model built with ``overrides`` on this rank's shard of the padded batch."""
    config = conformance().make_config(**overrides)
    model = conformance.heads["AutoModelForMaskedLM"](config).train()
    rank, size = dist.get_rank(), dist.get_world_size()
    return lambda **kw: model(**shard(padded_batch("masked_lm"), rank, size), **kw)


def universal():
    model = TestUniversalConformance.heads["AutoModelForMaskedLM"](TestUniversalConformance().make_config()).train()
    ids = _ids(1, LENGTH // dist.get_world_size(), seed=1)
    return lambda: model(input_ids=ids)


# HFX_SP_DEVICE=cuda (scripts/gpu_check.py on 2+ GPUs): each rank on its GPU, NCCL; otherwise the CPU and gloo.
DEVICE = os.environ.get("HFX_SP_DEVICE", "cpu")


def on_device(batch: dict) -> dict:
    return {k: v.to(DEVICE) for k, v in batch.items()}


def main(out_path: str, only: list[str] | None = None) -> None:
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 exactness, as on the CPU
        torch.backends.cudnn.allow_tf32 = False
    deepspeed.init_distributed(dist_backend="nccl" if DEVICE == "cuda" else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    todo = [case for case in cases() if not only or "/".join(case).startswith(tuple(only))]
    models, references = {}, {}
    failed = {}
    for case in todo:
        model_type, head, form = case
        try:
            models[case] = build(model_type, head).to(DEVICE)
        except Exception:
            failed["/".join(case)] = {"error": "building: " + traceback.format_exc()[-3000:]}
            continue
        batch = batch_of(head, form)
        if form == "adapter":  # the positions the adapter needs, in the reference too
            mask = batch["attention_mask"]
            positions = torch.arange(LENGTH).expand_as(mask) + models[case].config.pad_token_id + 1
            batch["position_ids"] = positions * mask + (1 - mask)
        try:
            references[case] = run(copy.deepcopy(models[case]), on_device(batch), bf16=form == "bf16")
        except Exception:
            failed["/".join(case)] = {"error": "one process: " + traceback.format_exc()[-3000:]}
    parallel_state_sp.initialize_sequence_parallel(size)
    group = parallel_state_sp.get_sequence_parallel_group()
    results = dict(failed)
    for case in todo:
        model_type, head, form = case
        name = "/".join(case)
        if name in failed:
            continue
        try:
            model = models[case]
            seen = []  # the tokens each attention layer gets on this rank: the shard, or SP did not run
            layers = [mod for mod in model.modules() if isinstance(mod, HfxSelfAttention)]
            hooks = [
                layer.register_forward_pre_hook(
                    # Only the layer's own call (it carries the shards), not the calls a mechanism makes inside.
                    lambda mod, args, kwargs, seen=seen: (
                        seen.append(args[0].shape[1]) if "sequence_parallel" in kwargs else None
                    ),
                    with_kwargs=True,
                )
                for layer in layers
            ]
            if form == "adapter":
                loss, logits, grads, _ = through_adapter(model, batch_of(head, "padded"), rank, size, group)
            else:
                loss, logits, grads = run(model, on_device(shard(batch_of(head, form), rank, size)), form == "bf16")
            for hook in hooks:
                hook.remove()
            tokens = logits.shape[-2] if head in ("masked_lm", "causal_lm", "token_classification") else None
            if tokens == LENGTH // size:
                # A token head returns this rank's tokens' logits (SequenceShards.token_outputs): gather to compare.
                parts = [torch.empty_like(logits) for _ in range(size)]
                dist.all_gather(parts, logits.contiguous(), group=group)
                logits = torch.cat(parts, dim=-2)
            results_tokens = tokens
            for g in grads.values():
                dist.all_reduce(g, group=group)  # summed over the group, as DeepSpeed's engine does
            ref_loss, ref_logits, ref_grads = references[case]
            results[name] = {
                "loss": float(loss),
                "reference_loss": float(ref_loss),
                "loss_rel_diff": max_rel(loss, ref_loss),
                "logits_rel_diff": max_rel(logits, ref_logits),
                "grads_rel_diff": max(max_rel(grads[n], ref_grads[n]) for n in ref_grads),
                "grads_max_abs": max(float(g.abs().max()) for g in ref_grads.values()),
                "encoder_tokens": sorted(set(seen)),
                "logits_tokens": results_tokens,
            }
        except Exception:  # reported per case: one broken case must not hide the others
            results[name] = {"error": traceback.format_exc()[-3000:]}
    results.update(refusals(rank, size))
    try:
        results.update(lsh_float32_hash(rank, size, group))
    except Exception:
        results["lsh_float32_hash"] = {"error": traceback.format_exc()[-3000:]}
    gathered = [None] * size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {name: {**result, "ranks": [g[name] for g in gathered]} for name, result in results.items()}
        with open(out_path, "w") as f:
            json.dump({"world_size": size, "device": DEVICE, "cases": merged}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
