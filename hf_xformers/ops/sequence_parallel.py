"""Sequence parallelism (DeepSpeed Ulysses): what a model does when each rank holds a slice of the tokens.

Under accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` DeepSpeed builds a sequence-parallel group
of N ranks, and its ``UlyssesSPDataLoaderAdapter`` hands each rank 1/N of every training batch: every tensor of the
batch cut along dim 1 (rank ``r`` holds tokens ``r * S/N .. (r + 1) * S/N``). A model that supports it then:

1. at its outermost forward (:func:`gather_batch`), gathers the shards of the batch's 2-D inputs (ids, masks, positions,
   document ids, token labels): what a rank must know about the whole sequence (positions, global tokens, document
   boundaries, padding) arrives with the batch, once, a few integers per token;
2. embeds the whole sequence and keeps its own tokens (:meth:`SequenceShards.local`);
3. in every attention layer projects its tokens, exchanges tokens for heads with DeepSpeed's all-to-all
   (:func:`tokens_to_heads`: each rank then holds every token of ``H/N`` heads), runs the unchanged mechanism on those
   heads and exchanges back (:func:`heads_to_tokens`): the feed-forward blocks, the largest activations, stay sharded;
4. gathers the last hidden states (:meth:`SequenceShards.gather`), so that every sequence-level head (classification,
   QA) computes on every rank the loss one process computes; a token-level head (masked LM, causal LM, token
   classification) scores its rank's tokens and sums the ranks' parts of the loss (``token_outputs``): every rank
   again holds the loss of one process, and its logits are its own tokens' ``(batch, seq_len / size, ...)``.

Gradients: every rank computes the same loss, one process's. DeepSpeed's engine *sums* the ranks' gradients over the
sequence-parallel group (it all-reduces over the sequence-data-parallel group and divides by the data-parallel size
only), the convention of a loss split into per-rank parts. The loss a model returns therefore carries ``1 / size`` of
its gradient on each rank (:func:`share_of_gradient`): each rank's copy counts for a part, the collectives' backward
passes sum what flows back to each shard, and the sum of the ranks' gradients is one process's gradient, also under
Trainer's ``deepspeed_sp_compute_loss``, which weights the ranks' (equal) losses by their token counts
(``tests/test_sequence_parallel.py`` checks both to 1e-5 in float32).

The exchanges are DeepSpeed's (``deepspeed.sequence.layer._SeqAllToAll``, the autograd all-to-all its
``DistributedAttention`` uses) and torch.distributed's autograd all-gather; nothing here is a collective of our own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "PER_SEQUENCE_KEY",
    "SequenceShards",
    "current_shards",
    "gather_batch",
    "heads_to_tokens",
    "sequence_parallel_group",
    "share_of_gradient",
    "sharded_forward",
    "tokens_to_heads",
]


class SequenceShards(NamedTuple):
    """The sequence-parallel group of one forward and this rank's slice of the tokens."""

    group: object
    """The ``torch.distributed`` process group of the ranks that share the sequence."""
    rank: int
    """This rank's place in ``group``: it holds tokens ``rank * shard .. (rank + 1) * shard``."""
    size: int
    """Ranks in ``group`` (``sp_size``)."""
    shard: int
    """Tokens per rank; the whole sequence is ``size * shard``."""
    token_outputs: bool = False
    """The head scores tokens (masked LM, causal LM, token classification): the base model then returns this rank's
    tokens only (no gather), the head scores them, and :func:`~hf_xformers.layers.losses.token_cross_entropy` sums
    the ranks' parts; the ``(seq_len, vocab)`` logits, a step's largest tensor, never exist whole on a rank."""

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor: its ``1 / size`` slice along ``dim`` (a length ``size``
        divides; Reformer's row padded to its chunks is longer than the batch)."""
        part = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * part, part)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole sequence from every rank's ``(batch, shard, ...)`` slice: ``(batch, size * shard, ...)``. Autograd's
        all-gather: its backward sums the gradients of every rank's copy into the slice's owner."""
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(tensor.contiguous(), group=self.group), dim=1)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks (autograd's all-reduce: each rank's part gets the gradient of the sum)."""
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(tensor, group=self.group)


# A plain module global, not a ContextVar: torch.compile traces a read of it (and guards on it), not a ContextVar's.
_current: SequenceShards | None = None


def current_shards() -> SequenceShards | None:
    """The shards of the sequence-parallel forward under way (:func:`sharded_forward`), or None."""
    return _current


@contextmanager
def sharded_forward(shards: SequenceShards) -> Iterator[None]:
    """Mark a forward as sequence-parallel: base models called inside it shard their encoder by ``shards``."""
    global _current
    previous, _current = _current, shards
    try:
        yield
    finally:
        _current = previous


def sequence_parallel_group() -> object | None:
    """DeepSpeed's sequence-parallel group when one of more than one rank is set up, else None.

    accelerate sets it up (``UlyssesSPAttentionHF.register_with_transformers``) when ``ParallelismConfig(
    sp_backend="deepspeed", sp_size>1)`` prepares a model; so can a script, with
    ``deepspeed.runtime.sequence_parallel.parallel_state_sp.initialize_sequence_parallel(N)``. Without DeepSpeed
    imported there is none (no import here: a model's forward never pays for it).
    """
    if "deepspeed" not in sys.modules or not dist.is_available() or not dist.is_initialized():
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    group = parallel_state_sp._SEQUENCE_PARALLEL_GROUP
    if group is None or dist.get_world_size(group) < 2:
        return None
    return group


# The batch entry (a dict, which DeepSpeed's adapter copies to every rank) by which
# hf_xformers.sequence_parallel_data.DataCollatorForSequenceParallel names the sequence-level targets it spread over
# their rows' tokens ("per_sequence") and the entries it added for the adapter only ("added").
PER_SEQUENCE_KEY = "sequence_parallel_per_sequence"


def restore_per_sequence(kwargs: dict) -> dict:
    """The batch as the task made it, from one of ``DataCollatorForSequenceParallel``: each spread target read back
    from its row's last token (``(batch,)``), the adapter's extra entries dropped. Other batches as they are."""
    marks = kwargs.pop(PER_SEQUENCE_KEY, None)
    if marks is None:
        return kwargs
    for name in marks.get("per_sequence", ()):
        if isinstance(kwargs.get(name), torch.Tensor) and kwargs[name].dim() == 2:
            kwargs[name] = kwargs[name][:, -1]
    for name in marks.get("added", ()):
        kwargs.pop(name, None)
    return kwargs


def _shard_length(args: tuple, kwargs: dict) -> int | None:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[1]
    return None


def gather_batch(group, args: tuple, kwargs: dict) -> tuple[tuple, dict, SequenceShards]:
    """Whole-sequence inputs from this rank's shard of a batch: every tensor of two or more dimensions whose dim 1 is
    the shard's length is gathered along dim 1 from every rank (the reverse of DeepSpeed's data-loader adapter, which
    cut each of them so); other values (a sequence-level ``labels`` ``(batch,)``, flags) pass as they are.

    DeepSpeed's adapter replaces ``labels`` by ``shift_labels`` (``labels[:, 1:]`` padded with -100: written for causal
    LMs) and Trainer passes both; the label of each token is then ``shift_labels`` of the token before it, so this
    gives the heads ``labels`` back with the first token's label -100 (the one label the adapter drops: a masked-LM
    collator never masks the ``<s>``/``[CLS]`` token there). A causal LM's loss shifts them again, as without SP.

    Returns ``(args, kwargs, shards)``.
    """
    shard = _shard_length(args, kwargs)
    if shard is None:
        raise ValueError("A sequence-parallel forward needs `input_ids` or `inputs_embeds` of shape (batch, seq_len).")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    shards = SequenceShards(group, rank, size, shard)

    def whole(value):
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != shard:
            return value
        if value.requires_grad:
            return shards.gather(value)
        sent = value.to(torch.uint8) if value.dtype == torch.bool else value.contiguous()  # gloo has no bool
        parts = [torch.empty_like(sent) for _ in range(size)]
        dist.all_gather(parts, sent, group=group)
        return torch.cat(parts, dim=1).to(value.dtype)

    args = tuple(whole(value) for value in args)
    kwargs = {name: whole(value) for name, value in kwargs.items()}
    shift_labels = kwargs.pop("shift_labels", None)
    if shift_labels is not None:
        kwargs["labels"] = F.pad(shift_labels[:, :-1], (1, 0), value=-100)
    return args, restore_per_sequence(kwargs), shards


def share_of_gradient(loss: torch.Tensor, size: int) -> torch.Tensor:
    """``loss`` with the same value and ``1 / size`` of its gradient: one rank's share of a loss that every rank of the
    group computes whole (module docstring)."""
    return loss.detach() + (loss - loss.detach()) / size


def tokens_to_heads(tensor: torch.Tensor, group) -> torch.Tensor:
    """``(batch, shard, heads, e)`` on each rank -> ``(batch, size * shard, heads / size, e)``: every token of this
    rank's heads (DeepSpeed's all-to-all, scattering heads and gathering the sequence)."""
    from deepspeed.sequence.layer import _SeqAllToAll

    return _SeqAllToAll.apply(group, tensor.contiguous(), 2, 1, 0)


def heads_to_tokens(tensor: torch.Tensor, group) -> torch.Tensor:
    """The reverse of :func:`tokens_to_heads`: ``(batch, seq_len, heads / size, e)`` -> ``(batch, seq_len / size,
    heads, e)``."""
    from deepspeed.sequence.layer import _SeqAllToAll

    return _SeqAllToAll.apply(group, tensor.contiguous(), 1, 2, 0)
