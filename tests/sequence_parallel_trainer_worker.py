"""The stock transformers ``Trainer`` under DeepSpeed Ulysses sequence parallelism on the CPU (``tests/test_sequence_parallel.py``).

Two modes, from the repository root, with ``DS_ACCELERATOR=cpu``; TASK (third argument) is ``masked_lm`` or
``sequence_classification``:

* ``torchrun --standalone --nproc_per_node=2 -m tests.sequence_parallel_trainer_worker sp OUT_DIR TASK``: four SGD
  steps (gradient clipping at 3.0) on a tiny hfx-longformer with ``TrainingArguments(parallelism_config=
  ParallelismConfig(sp_backend="deepspeed", sp_size=2, ...), deepspeed={ZeRO stage 0}, use_cpu=True)``, DeepSpeed's
  communication set up by ``setup_sequence_parallel``, batches from ``DataCollatorForSequenceParallel`` (LENGTH
  tokens, the model's ``position_ids``, a class label spread over its row). DeepSpeed's ``UlyssesSPDataLoaderAdapter``
  makes the two ranks process ONE batch per step, each rank's batch in turn; the collator records which examples each
  rank's batches hold, so rank 0 writes the order the group trained on (``OUT_DIR/sp.json``: that order, the logged
  losses, the tokens the encoder saw per rank) and the trained weights (``OUT_DIR/sp.pt``).
* ``python -m tests.sequence_parallel_trainer_worker single OUT_DIR TASK``: one process, no DeepSpeed, the same
  initial weights and arguments, the examples in the order of ``sp.json`` (sequential sampling, same batch size): the
  same steps on the same batches; writes ``OUT_DIR/single.json``, ``OUT_DIR/single.pt`` and the initial weights
  ``OUT_DIR/initial.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_xformers import (  # noqa: E402
    DataCollatorForSequenceParallel,
    HfxLongformerConfig,
    HfxLongformerForMaskedLM,
    HfxLongformerForSequenceClassification,
    setup_sequence_parallel,
)

SP_SIZE = 2
BATCH = 2  # examples per batch (per rank): the group trains on one such batch per step
LENGTHS = (13, 22, 9, 30, 17, 26, 11, 20)
# Every batch padded to this many tokens (a multiple of SP_SIZE: the adapter cuts each row into SP_SIZE equal shards).
# A fixed length, not the batch's longest: the adapter all-gathers each rank's batch with torch.distributed.all_gather,
# which gloo refuses for tensors of different lengths ("ProcessGroupGloo::allgather: invalid tensor size").
LENGTH = 32
MASK_ID = 3
CONFIG_PAD = 1
# masked_lm (token labels: each rank scores its tokens) or sequence_classification (one label per example, spread over
# its row by DataCollatorForSequenceParallel and read back by the model).
TASK = sys.argv[3] if len(sys.argv) > 3 else "masked_lm"

CONFIG = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
    max_position_embeddings=64, attention_window=[4, 6], type_vocab_size=1, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)  # fmt: skip


def examples() -> list[dict]:
    """Masked-LM examples fixed in advance (every process builds the same): ``<s> ... </s>``, 30 % of the inner tokens
    replaced by the mask id with their label kept; the first token is never masked (DeepSpeed's adapter drops the
    first token's label, see ops/sequence_parallel.gather_batch)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for idx, length in enumerate(LENGTHS):
        ids = torch.randint(5, CONFIG["vocab_size"], (length,), generator=g)
        ids[0], ids[-1] = 0, 2
        masked = torch.rand(length, generator=g) < 0.3
        masked[0] = masked[-1] = False
        masked[1] = True  # at least one label per example
        labels = ids.masked_fill(~masked, -100)
        ids = ids.masked_fill(masked, MASK_ID)
        label = labels.tolist() if TASK == "masked_lm" else idx % 3
        out.append({"idx": idx, "input_ids": (ids if TASK == "masked_lm" else ids.masked_fill(masked, 7)).tolist(),
                    "labels": label})  # fmt: skip
    return out


class RecordingCollator:
    """The package's :class:`~hf_xformers.DataCollatorForSequenceParallel` (pads to LENGTH, adds the model's
    ``position_ids``, spreads a sequence-level ``labels`` over its row) around a plain padding collator; records the
    examples of each batch in ``seen``."""

    def __init__(self, net) -> None:
        self.inner = DataCollatorForSequenceParallel(pad_longest, net, sp_size=SP_SIZE, max_length=LENGTH)
        self.seen: list[list[int]] = []

    def __call__(self, features: list[dict]) -> dict:
        self.seen.append([f["idx"] for f in features])
        return self.inner(features)


def pad_longest(features: list[dict]) -> dict:
    """Pads to the batch's longest row (as DataCollatorWithPadding does); labels per token or one per example."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), CONFIG_PAD)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if isinstance(features[0]["labels"], list):
        labels = torch.full((len(features), width), -100)
        for row, f in enumerate(features):
            labels[row, : len(f["labels"])] = torch.tensor(f["labels"])
    else:
        labels = torch.tensor([f["labels"] for f in features])
    batch["labels"] = labels
    return batch


def model():
    torch.manual_seed(0)
    if TASK == "masked_lm":
        return HfxLongformerForMaskedLM(HfxLongformerConfig(**CONFIG))
    return HfxLongformerForSequenceClassification(HfxLongformerConfig(**CONFIG, num_labels=3))


def arguments(out_dir: str, **kwargs) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, num_train_epochs=1, learning_rate=0.5,
        lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=3.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, remove_unused_columns=False, **kwargs,
    )  # fmt: skip


def count_encoder_tokens(net) -> list[int]:
    """Tokens per row the encoder's first layer saw at each forward (the shard's length under SP)."""
    seen: list[int] = []
    layer = net.longformer.encoder.layer[0]
    layer.register_forward_hook(lambda _m, args, _out: seen.append(int(args[0].shape[1])))
    return seen


def train(trainer: Trainer, collator: RecordingCollator, net) -> dict:
    encoder_tokens = count_encoder_tokens(net)
    start = time.perf_counter()
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    grad_norms = [float(entry["grad_norm"]) for entry in trainer.state.log_history if "grad_norm" in entry]
    return {
        "losses": losses, "grad_norms": grad_norms, "steps": trainer.state.global_step, "seconds": time.perf_counter() - start,
        "batches": collator.seen, "encoder_tokens": sorted(set(encoder_tokens)),
    }  # fmt: skip


def weights(net) -> dict:
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def run_sp(out_dir: str) -> None:
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    # use_cpu=True makes accelerate see the 2 gloo processes (one data shard each, one main process); without it,
    # on a machine with no GPU, accelerate finds no backend and every rank believes it is alone (num_processes 1:
    # every rank reads every batch, so the adapter trains each twice, and every rank logs and saves as the main one).
    # With use_cpu=True accelerate leaves DeepSpeed's comm unset: setup_sequence_parallel sets it up (gloo).
    net = model()
    collator = RecordingCollator(net)
    args = arguments(
        out_dir,
        use_cpu=True,
        ddp_backend="gloo",
        train_sampling_strategy="sequential",
        parallelism_config=ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=SP_SIZE,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
        ),  # fmt: skip
        deepspeed={
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 0},
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
        },  # fmt: skip
    )
    setup_sequence_parallel(args)
    trainer = Trainer(model=net, args=args, train_dataset=examples(), data_collator=collator)
    result = train(trainer, collator, net)

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"batches": result["batches"], "losses": result["losses"]})
    if dist.get_rank() == 0:
        # The adapter's order: each rank's k-th batch, rank by rank, then the (k+1)-th.
        order = [b for k in range(len(every[0]["batches"])) for rank in every for b in rank["batches"][k : k + 1]]
        result["order"] = order
        result["rank_losses"] = [rank["losses"] for rank in every]
        result["world_size"] = dist.get_world_size()
        result["distributed_type"] = str(trainer.accelerator.distributed_type)
        result["accelerate_num_processes"] = trainer.accelerator.num_processes
        with open(os.path.join(out_dir, "sp.json"), "w") as f:
            json.dump(result, f)
        torch.save(weights(trainer.model if not hasattr(trainer.model, "module") else trainer.model.module),
                   os.path.join(out_dir, "sp.pt"))  # fmt: skip
    dist.barrier()


def run_single(out_dir: str) -> None:
    with open(os.path.join(out_dir, "sp.json")) as f:
        order = json.load(f)["order"]
    by_idx = {e["idx"]: e for e in examples()}
    dataset = [by_idx[i] for batch in order for i in batch]
    net = model()
    torch.save(weights(net), os.path.join(out_dir, "initial.pt"))
    collator = RecordingCollator(net)
    args = arguments(out_dir, train_sampling_strategy="sequential")
    trainer = Trainer(model=net, args=args, train_dataset=dataset, data_collator=collator)
    result = train(trainer, collator, net)
    with open(os.path.join(out_dir, "single.json"), "w") as f:
        json.dump(result, f)
    torch.save(weights(net), os.path.join(out_dir, "single.pt"))


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]  # (argv[3]: TASK)
    os.makedirs(out, exist_ok=True)
    (run_sp if mode == "sp" else run_single)(out)
