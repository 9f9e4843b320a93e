"""Batches for sequence-parallel training under Trainer (docs/training-past-one-device.md).

DeepSpeed's ``UlyssesSPDataLoaderAdapter``, which Trainer puts around the training data loader when
``ParallelismConfig(sp_backend="deepspeed", sp_size > 1)`` is set, asks three things of every batch:

- ``position_ids``: a rank cannot count positions from its slice of the tokens;
- every tensor of shape ``(batch, seq_len)``, with ``seq_len`` a multiple of ``sp_size``, and the same shape on every
  rank (it all-gathers the ranks' batches; gloo refuses ragged ones), and a ``labels`` entry (it turns it into
  ``shift_labels``);
- nothing of another shape: a sequence-level target ``(batch,)`` stops it (``labels's shape ... must match
  input_ids's shape``).

:class:`DataCollatorForSequenceParallel` wraps the task's collator and gives it all three: pads to a fixed length,
adds the model's own ``position_ids``, and spreads each sequence-level target over its row's tokens (named in
``sequence_parallel_per_sequence``, a list DeepSpeed copies to every rank), which the model reads back at its entry
(``ops/sequence_parallel.gather_batch``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .ops.sequence_parallel import PER_SEQUENCE_KEY
from .padding_free import position_ids_start_for

__all__ = [
    "DataCollatorForSequenceParallel",
    "sequence_label_ids",
    "sequence_parallel_size",
    "setup_sequence_parallel",
]

# What each per-token input is padded with (input_ids: the model's pad token).
PAD_VALUES = {"attention_mask": 0, "labels": -100, "token_type_ids": 0, "global_attention_mask": 0}


def sequence_label_ids(label_ids: Any) -> Any:
    """``label_ids`` of a sequence-level task as Trainer's ``compute_metrics`` gets them from batches of
    :class:`DataCollatorForSequenceParallel` (one per token, ``(examples, max_length)``), one per example
    ``(examples,)``; other arrays as they are. A NumPy array or a tensor."""
    if getattr(label_ids, "ndim", 0) == 2:
        return label_ids[:, -1]
    return label_ids


def sequence_parallel_size(training_args: Any = None) -> int:
    """The ``sp_size`` a run trains with: ``training_args.parallelism_config``'s, or the one ``accelerate launch``
    passes from its config file (``parallelism_config_sp_size``, in ``PARALLELISM_CONFIG_SP_SIZE``); 1 without."""
    config = getattr(training_args, "parallelism_config", None)
    if config is not None and getattr(config, "sp_backend", None) == "deepspeed":
        return int(config.sp_size)
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        if os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") == "deepspeed":
            return int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1"))
    return 1


def setup_sequence_parallel(training_args: Any) -> None:
    """What a training script does once, after parsing its ``TrainingArguments``, before ``Trainer.train``, when it
    trains sequence-parallel: DeepSpeed's communication set up on the process group (on the CPU, gloo: with
    ``use_cpu=True`` accelerate leaves it unset and DeepSpeed's ``initialize_sequence_parallel`` then fails with a bare
    ``AssertionError``), and the last, smaller batch dropped (the ranks' batches must have one shape)."""
    if sequence_parallel_size(training_args) < 2:
        return
    import deepspeed
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if getattr(training_args, "use_cpu", False) else None)
    training_args.dataloader_drop_last = True


class DataCollatorForSequenceParallel:
    """Wraps a collator so that its batches pass DeepSpeed's sequence-parallel data-loader adapter (module docstring).

    Args:
        collator: the task's collator (``DataCollatorForLanguageModeling``, ``DataCollatorWithPadding``, ...), or None
            for features that are already tensors of one length.
        model: the model (or its config), for its ``pad_token_id`` and first position
            (:func:`~hf_xformers.padding_free.position_ids_start_for`).
        sp_size: ranks that share each sequence.
        max_length: every batch is padded to this many tokens, a multiple of ``sp_size`` (the ranks' batches must have
            one shape); longer batches are refused.

    Raises:
        ValueError: ``max_length`` not a multiple of ``sp_size``; a model that cannot train sequence-parallel (its
            architecture, or heads that ``sp_size`` does not divide), named with the fix.

    Trainer collates its evaluation batches with the same collator (it has one): the model reads them as the task
    made them (evaluation runs without sequence parallelism, whole sequences on every rank), but a ``compute_metrics``
    of a sequence-level task then gets ``label_ids`` ``(examples, max_length)``: :func:`sequence_label_ids` gives them
    back as ``(examples,)``.

    Example::

        collator = DataCollatorForSequenceParallel(DataCollatorWithPadding(tokenizer), model, sp_size=4,
                                                   max_length=65536)
    """

    def __init__(self, collator: Callable | None, model: Any, sp_size: int, max_length: int) -> None:
        if max_length % sp_size:
            raise ValueError(
                f"max_length ({max_length}) must be a multiple of sp_size ({sp_size}): each rank takes max_length / "
                "sp_size tokens of every row; round it up."
            )
        config = getattr(model, "config", model)
        if hasattr(model, "check_sequence_parallel"):
            # At set-up, not at the first step: an architecture without the path, or heads sp_size does not divide.
            model.check_sequence_parallel(sp_size, (), {})
        self.collator = collator
        self.sp_size = sp_size
        self.max_length = max_length
        self.pad_token_id = 0 if config.pad_token_id is None else int(config.pad_token_id)
        self.first_position = position_ids_start_for(model)

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        batch = dict(self.collator(features)) if self.collator is not None else {
            k: torch.stack([torch.as_tensor(f[k]) for f in features]) for k in features[0]
        }  # fmt: skip
        ids = batch["input_ids"]
        rows, length = ids.shape
        if length > self.max_length:
            raise ValueError(
                f"A batch of {length} tokens is longer than max_length={self.max_length}: truncate the inputs to "
                "max_length (the ranks' batches must all have max_length tokens)."
            )
        pad = self.max_length - length
        mask = batch.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        if "position_ids" not in batch:
            # The model's own numbering: real tokens from its first position, padding at the pad position.
            counted = mask.long().cumsum(-1) - 1 + self.first_position
            padding = self.pad_token_id if self.first_position else 0
            batch["position_ids"] = torch.where(mask.bool(), counted, padding)
        carried = []
        for name, value in list(batch.items()):
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == rows:
                # A sequence-level target (class, start/end position): spread over the row's tokens, read back by the
                # model (ops/sequence_parallel.gather_batch).
                batch[name] = value[:, None].expand(rows, length).contiguous()
                carried.append(name)
        batch["attention_mask"] = mask
        for name, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                continue
            if value.shape[1] != length:
                raise ValueError(
                    f"`{name}` has shape {tuple(value.shape)}, neither one value per example nor one per token: "
                    "DeepSpeed's sequence-parallel adapter cuts every tensor of a batch along its tokens, so such a "
                    "target (multi-label classes, for example) cannot train sequence-parallel; train without sp_size."
                )
            if pad:
                fill = self.pad_token_id if name in ("input_ids", "position_ids") else PAD_VALUES.get(name, 0)
                if name in carried:
                    fill = value[:, -1:]  # a carried target is the same at every token
                    batch[name] = torch.cat([value, fill.expand(rows, pad)], dim=1)
                else:
                    batch[name] = F.pad(value, (0, pad), value=fill)
        added = []
        if "labels" not in batch:
            # The adapter needs one (it shifts it); the model drops it again (a QA head takes start/end positions).
            # Not -100: transformers' deepspeed_sp_compute_loss zeroes the loss of a batch whose labels count no token.
            batch["labels"] = torch.zeros((rows, self.max_length), dtype=torch.long)
            added.append("labels")
        if carried or added:
            batch[PER_SEQUENCE_KEY] = {"per_sequence": carried, "added": added}
        return batch
