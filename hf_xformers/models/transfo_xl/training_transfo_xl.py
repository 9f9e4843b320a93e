"""Training and evaluating Transformer-XL on long token streams with the ``transformers`` Trainer.

Segment-level recurrence needs two things the stock v5 Trainer does not do (it has no ``past_index`` any more):

1. **Stable batch rows.** :class:`HfxStreamSegments` cuts a corpus into ``batch_size`` contiguous streams and
   orders its items step-major, so with sequential sampling batch ``k`` holds segment ``k`` of every stream and
   stream ``b`` always sits in row ``b``.
2. **Memories across steps.** :class:`HfxRecurrentTrainer` samples sequentially, keeps the ``mems`` each step
   returns (detached by the model) and passes them to the next step: one memory for training, reset at the start
   of every epoch, and one for evaluation, reset at the start of every ``evaluate()``. Training and evaluation
   memories never mix.

Usage::

    train = HfxStreamSegments(train_ids, batch_size=8, segment_length=64)
    valid = HfxStreamSegments(valid_ids, batch_size=4, segment_length=64)
    args = TrainingArguments(..., per_device_train_batch_size=8, per_device_eval_batch_size=4)
    trainer = HfxRecurrentTrainer(model=model, args=args, train_dataset=train, eval_dataset=valid)
    trainer.train(); trainer.evaluate()["eval_loss"]   # mean NLL per token, every token scored once

Single process only (a distributed sampler would split the streams across ranks).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, SequentialSampler
from transformers import Trainer, TrainerCallback


class HfxStreamSegments(Dataset):
    """A token stream as ``batch_size`` parallel streams cut into consecutive segments.

    The stream (``(n_tokens,)`` ids) is split into ``batch_size`` contiguous pieces (the remainder is dropped).
    Item ``k * batch_size + b`` is segment ``k`` of piece ``b``: ``input_ids`` ``(segment_length,)`` and
    ``shift_labels`` ``(segment_length,)``, the next token of each position (the last target is the first token
    of the following segment, so every token after the first is predicted exactly once).
    """

    def __init__(self, token_ids: torch.Tensor | list[int], batch_size: int, segment_length: int) -> None:
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        per_stream = ids.numel() // batch_size
        if batch_size < 1 or segment_length < 1 or per_stream < segment_length + 1:
            raise ValueError(
                f"{ids.numel()} tokens cannot make {batch_size} streams of at least segment_length + 1 = "
                f"{segment_length + 1} tokens; use a smaller batch_size or segment_length, or more text."
            )
        self.batch_size, self.segment_length = batch_size, segment_length
        self.streams = ids[: per_stream * batch_size].view(batch_size, per_stream)
        self.num_segments = (per_stream - 1) // segment_length

    def __len__(self) -> int:
        return self.num_segments * self.batch_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        step, row = divmod(index, self.batch_size)
        start = step * self.segment_length
        chunk = self.streams[row, start : start + self.segment_length + 1]
        return {"input_ids": chunk[:-1], "shift_labels": chunk[1:]}


class _ResetTrainingMemory(TrainerCallback):
    def __init__(self, trainer: HfxRecurrentTrainer) -> None:
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        # Each epoch restarts the streams from their first segment.
        self.trainer.reset_memories("train")


class HfxRecurrentTrainer(Trainer):
    """``Trainer`` that carries Transformer-XL memories from one step to the next (module docstring).

    ``label_names`` defaults to ``["shift_labels"]`` (what :class:`HfxStreamSegments` yields) so evaluation
    reports the loss. Training with ``return_logits=False`` skips the full-vocabulary log-probabilities.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.args.label_names is None:
            self.label_names = ["shift_labels"]
        if self.args.world_size > 1:
            raise ValueError(
                "HfxRecurrentTrainer keeps each stream in one batch row of one process; run it in a single process."
            )
        self._memories: dict[str, tuple[torch.Tensor, ...] | None] = {"train": None, "eval": None}
        self.add_callback(_ResetTrainingMemory(self))

    def reset_memories(self, which: str | None = None) -> None:
        """Forget the ``"train"`` or ``"eval"`` memory (both when None)."""
        for key in (which,) if which else ("train", "eval"):
            self._memories[key] = None

    def _check_stream_batches(self, dataset, batch_size: int, argument: str) -> None:
        if isinstance(dataset, HfxStreamSegments) and dataset.batch_size != batch_size:
            raise ValueError(
                f"The stream dataset has {dataset.batch_size} streams but {argument}={batch_size}; they must be equal "
                "so that every stream stays in its batch row."
            )

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        self._check_stream_batches(dataset, self._train_batch_size, "per_device_train_batch_size")
        # Shuffling would move segments away from their stream's row and break the recurrence.
        return SequentialSampler(dataset)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        self._check_stream_batches(dataset, self.args.eval_batch_size, "per_device_eval_batch_size")
        self.reset_memories("eval")
        try:
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self.reset_memories("eval")

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        key = "train" if model.training else "eval"
        mems = self._memories[key]
        rows = inputs["input_ids"].shape[0]
        if mems is not None and mems[0].shape[0] != rows:
            mems = None  # a short last batch cannot continue the streams
        outputs = model(**inputs, mems=mems, return_logits=return_outputs)
        self._memories[key] = outputs.mems
        return (outputs.loss, outputs) if return_outputs else outputs.loss
