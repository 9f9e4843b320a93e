"""The losses of the task heads, and the label checks that name the fix.

Every loss here is a plain mean (or a sum over Trainer's ``num_items_in_batch``): the models set
``accepts_loss_kwargs = False`` so that Trainer never rescales them (``layers/pretrained.py``). Class labels of any
integer dtype are taken (cast to long, which ``cross_entropy`` requires): a dataset's int32 column is a class label, as
transformers' heads read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.input_checks import reads_values, refuse
from ..ops.sequence_parallel import current_shards


def labels_out_of_range(labels: torch.Tensor, high: int, ignore_index: int = -100) -> bool:
    """Whether some of ``labels`` (any shape) lie outside ``[0, high)`` and are not ``ignore_index`` (one read);
    False where values may not be read (:func:`~hf_xformers.ops.input_checks.reads_values`) or there are none."""
    if not labels.numel() or not reads_values(labels):
        return False
    return bool((((labels < 0) | (labels >= high)) & (labels != ignore_index)).any())


def check_class_labels(labels: torch.Tensor, high: int, what: str) -> None:
    """``labels`` must be classes in ``[0, high)`` or the ignored -100 (where values may be read): a ``ValueError``
    naming the fix otherwise (``what``: the classes' name and bound, for the message)."""
    if labels_out_of_range(labels, high):
        found = sorted({v for v in labels.reshape(-1).tolist() if v != -100 and not 0 <= v < high})
        refuse("label_range", f"labels must be {what} in [0, {high - 1}] or -100 (ignored), got {found[:8]}")


def token_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``(..., num_classes)`` against ``targets`` ``(...)``, positions equal to
    ``ignore_index`` left out: the mean over the scored positions, or their sum divided by ``num_items_in_batch``
    (Trainer's count of scored tokens across gradient-accumulation steps). A batch with no scored position gives 0
    with zero gradients (a plain mean gives NaN, which would poison accumulated gradients). In a sequence-parallel
    forward whose head scored only this rank's tokens (``logits`` ``(batch, seq_len / size, C)`` against the whole
    sequence's ``targets``), the ranks' parts are summed: the loss of one process, on every rank."""
    shards = current_shards()
    if shards is not None and logits.shape[-2] == shards.shard != targets.shape[-1]:
        # A sequence-parallel forward's token head scored this rank's tokens only (SequenceShards.token_outputs):
        # this rank's sum over the whole batch's count, summed over the ranks, is the loss of one process.
        count = (targets != ignore_index).sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return shards.sum(token_cross_entropy(logits, shards.local(targets), count, ignore_index))
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).to(logits.device, torch.long)
    total = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / (flat_targets != ignore_index).sum().clamp(min=1)


def next_token_labels(labels: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """``labels`` ``(batch, seq_len)`` shifted one place left, -100 in the last place: position ``t``'s target is
    ``labels[:, t + 1]``. With ``starts`` ``(batch, seq_len)`` bool, the first tokens of a packed batch's documents,
    a document's last token gets -100 too instead of the next document's first."""
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    if starts is None:
        return shifted
    return shifted.masked_fill(F.pad(starts, (0, 1))[:, 1:], -100)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Next-token loss as transformers' causal LMs compute it: ``labels`` ``(batch, seq_len)`` are the input ids
    (-100 = no loss) and position ``t`` is scored against ``labels[:, t + 1]``; ``shift_labels``, already shifted,
    take precedence (Trainer sends both under context parallelism). None when neither is given."""
    if shift_labels is None:
        if labels is None:
            return None
        shift_labels = next_token_labels(labels)
    return token_cross_entropy(logits, shift_labels, num_items_in_batch)


def problem_type(config, labels: torch.Tensor) -> str:
    """``config.problem_type``, or where it is unset the one transformers infers from ``labels``: ``regression`` when
    ``num_labels == 1``, ``single_label_classification`` for long / int labels, else ``multi_label_classification``."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def check_sequence_labels(labels: torch.Tensor | None, config) -> None:
    """A sequence classifier's ``labels`` ``(batch,)``: classes in ``[0, num_labels)`` or -100 for a single-label
    task (where values may be read), checked before the model runs."""
    if labels is not None and problem_type(config, labels) == "single_label_classification":
        check_class_labels(labels, config.num_labels, f"classes (config.num_labels={config.num_labels})")


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """Loss by ``config.problem_type`` (set on first use as transformers does, :func:`problem_type`): ``regression``
    (MSE, e.g. STS-B, when ``num_labels == 1``), ``single_label_classification`` (cross-entropy on integer labels) or
    ``multi_label_classification`` (BCE with logits on float multi-hot labels)."""
    config.problem_type = problem_type(config, labels)
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1), labels.squeeze(-1).to(logits.dtype))
    if config.problem_type == "single_label_classification":
        check_sequence_labels(labels, config)
        return F.cross_entropy(logits.view(-1, config.num_labels), labels.reshape(-1).long())
    if config.problem_type == "multi_label_classification":
        if labels.shape != logits.shape:
            raise ValueError(
                f"multi-label labels must be multi-hot floats of shape {tuple(logits.shape)}, got {tuple(labels.shape)}."
            )
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    raise ValueError(
        f"Unknown config.problem_type {config.problem_type!r}; use 'regression', "
        "'single_label_classification' or 'multi_label_classification'."
    )


def multiple_choice_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``(num_examples, num_choices)`` against the right choices ``labels``
    ``(num_examples,)``."""
    num_choices = logits.shape[-1]
    check_class_labels(labels, num_choices, "choice indices")
    return F.cross_entropy(logits, labels.reshape(-1).long())


def span_loss(
    start_logits: torch.Tensor, end_logits: torch.Tensor, start: torch.Tensor, end: torch.Tensor
) -> torch.Tensor:
    """Extractive QA's loss: the mean of the start and end cross-entropies. ``start_logits`` / ``end_logits``
    ``(n, length)``, ``start`` / ``end`` ``(n,)`` with ``length`` where a position is to be ignored (outside the
    input)."""
    ignored = start_logits.shape[1]
    start_loss = token_cross_entropy(start_logits, start, ignore_index=ignored)
    return (start_loss + token_cross_entropy(end_logits, end, ignore_index=ignored)) / 2
