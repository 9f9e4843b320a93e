"""Input checks shared by every text model: clear ``ValueError`` s instead of errors deep inside torch.

Checks on shapes and dtypes always run; checks that read tensor values (id ranges) run only in eager mode, because a
Python branch on a tensor's value cannot be traced by ``torch.compile(fullgraph=True)`` or ``torch.export``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Set by as_if_on_accelerator(): CPU tensors then count as device tensors for reads_values().
_AS_IF_ON_ACCELERATOR = False


def is_tracing() -> bool:
    """True while ``torch.compile`` / ``torch.export`` trace the model (value checks are skipped then)."""
    return torch.compiler.is_compiling()


def reads_values(tensor: torch.Tensor) -> bool:
    """Whether a check may read ``tensor``'s values (``int(t)``, ``bool(t)``, ``.tolist()``).

    In eager mode only, and only where the read costs no wait: a tensor in host memory (the CPU), or a forward
    without gradients (inference, where one read per forward is cheap next to the work). A training step on an
    accelerator makes no read: each would stall the device until everything queued before it has run. Inputs that
    skip their checks there were built by a collator on the host (``DataCollatorWithFlattening``,
    :class:`~hf_xformers.padding_free.DataCollatorForPackedDocuments`) or already ran through an eager CPU or
    inference forward.
    """
    if is_tracing():
        return False
    return on_host(tensor.device) or not torch.is_grad_enabled()


def on_host(device: torch.device) -> bool:
    """Whether ``device`` is host memory, where reading a value back waits for nothing: the CPU, unless
    :func:`as_if_on_accelerator` is on."""
    return torch.device(device).type == "cpu" and not _AS_IF_ON_ACCELERATOR


@contextmanager
def as_if_on_accelerator() -> Iterator[None]:
    """Treat CPU tensors as device tensors in :func:`reads_values`, so that a CPU test can count the host reads a
    training step would make on a GPU (``tests/host_reads.py``)."""
    global _AS_IF_ON_ACCELERATOR
    previous, _AS_IF_ON_ACCELERATOR = _AS_IF_ON_ACCELERATOR, True
    try:
        yield
    finally:
        _AS_IF_ON_ACCELERATOR = previous


def unpadded_to_none(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``mask`` ``(batch, seq_len)`` bool (True = real token), or None when nothing is padded.

    Models call this once per forward, so that their layers can read ``attention_mask is None`` as "no padding"
    instead of checking every layer (each ``bool(mask.all())`` is a device-to-host synchronisation on a GPU). While
    tracing the mask is kept as it is (no branch on its values): layers then apply it, with the same result.
    """
    if mask is None or is_tracing():
        return mask
    return None if bool(mask.all()) else mask


def check_token_ids(
    ids: torch.Tensor | None, vocab_size: int, name: str = "input_ids", hint: str = "use the tokenizer that belongs to "
    "this checkpoint"
) -> None:  # fmt: skip
    """``ids`` ``(batch, seq_len)`` must be integer ids in ``[0, vocab_size)``, with at least one row and one position.

    Raises:
        ValueError: float or boolean ids, an empty batch or sequence, or an id outside the vocabulary.
    """
    if ids is None:
        return
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(
            f"`{name}` must hold integer token ids (torch.long), got dtype {ids.dtype}; tokenize the text "
            "(tokenizer(..., return_tensors='pt')) or convert with .long()."
        )
    check_not_empty(tuple(ids.shape), name)
    if not reads_values(ids):
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ValueError(
            f"`{name}` contains the negative id {low}; ids lie in [0, {vocab_size - 1}]. Label padding (-100) belongs "
            "in `labels`, not in the inputs: pad inputs with the tokenizer's pad_token_id."
        )
    if high >= vocab_size:
        raise ValueError(f"`{name}` contains id {high} but vocab_size is {vocab_size}; {hint}.")


def token_shape(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> tuple[int, ...]:
    """The shape of the tokens: ``input_ids``' ``(batch, seq_len)``, or that of ``inputs_embeds``
    ``(batch, seq_len, hidden)`` without its last dimension; a ``ValueError`` unless exactly one of them is given."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
    return tuple(input_ids.shape) if input_ids is not None else tuple(inputs_embeds.shape[:-1])


def check_not_empty(shape: tuple, name: str = "input_ids") -> None:
    """A ``(batch, seq_len, ...)`` input needs at least one example and one position."""
    if len(shape) >= 1 and shape[0] == 0:
        raise ValueError(f"`{name}` is a batch of 0 examples; pass at least one example.")
    if len(shape) >= 2 and shape[1] == 0:
        raise ValueError(
            f"`{name}` has sequences of length 0; every example needs at least one token (the tokenizer adds the "
            "special tokens even to an empty text)."
        )


def check_type_ids(token_type_ids: torch.Tensor | None, type_vocab_size: int, shape: tuple) -> None:
    """``token_type_ids`` must have ``shape`` and values in ``[0, type_vocab_size)``."""
    if token_type_ids is None or not token_type_ids.numel():
        return
    if tuple(token_type_ids.shape) != tuple(shape):
        raise ValueError(f"`token_type_ids` must have shape {tuple(shape)}, got {tuple(token_type_ids.shape)}.")
    if not reads_values(token_type_ids):
        return
    low, high = int(token_type_ids.min()), int(token_type_ids.max())
    if low < 0 or high >= type_vocab_size:
        single = " RoBERTa-style models use a single segment: drop `token_type_ids` (return_token_type_ids=False)."
        raise ValueError(
            f"`token_type_ids` must lie in [0, {type_vocab_size - 1}] (config.type_vocab_size={type_vocab_size}); "
            f"got values from {low} to {high}.{single if type_vocab_size == 1 else ''}"
        )


__all__ = [
    "as_if_on_accelerator",
    "check_not_empty",
    "check_token_ids",
    "check_type_ids",
    "is_tracing",
    "on_host",
    "reads_values",
    "unpadded_to_none",
]
