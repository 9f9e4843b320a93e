"""Input checks shared by every text model: clear ``ValueError`` s instead of errors deep inside torch.

Checks on shapes and dtypes always run; checks that read tensor values (id ranges) run only in eager mode, because a
Python branch on a tensor's value cannot be traced by ``torch.compile(fullgraph=True)`` or ``torch.export``.
"""

from __future__ import annotations

import torch


def is_tracing() -> bool:
    """True while ``torch.compile`` / ``torch.export`` trace the model (value checks are skipped then)."""
    return torch.compiler.is_compiling()


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
    if is_tracing():
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ValueError(
            f"`{name}` contains the negative id {low}; ids lie in [0, {vocab_size - 1}]. Label padding (-100) belongs "
            "in `labels`, not in the inputs: pad inputs with the tokenizer's pad_token_id."
        )
    if high >= vocab_size:
        raise ValueError(f"`{name}` contains id {high} but vocab_size is {vocab_size}; {hint}.")


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
    if is_tracing():
        return
    low, high = int(token_type_ids.min()), int(token_type_ids.max())
    if low < 0 or high >= type_vocab_size:
        single = " RoBERTa-style models use a single segment: drop `token_type_ids` (return_token_type_ids=False)."
        raise ValueError(
            f"`token_type_ids` must lie in [0, {type_vocab_size - 1}] (config.type_vocab_size={type_vocab_size}); "
            f"got values from {low} to {high}.{single if type_vocab_size == 1 else ''}"
        )


__all__ = ["check_not_empty", "check_token_ids", "check_type_ids", "is_tracing", "unpadded_to_none"]
