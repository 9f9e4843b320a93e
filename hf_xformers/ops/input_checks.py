"""Input checks shared by every text model: clear ``ValueError`` s instead of errors deep inside torch.

Checks on shapes and dtypes always run; checks that read tensor values (id ranges) run only in eager mode, because a
Python branch on a tensor's value cannot be traced by ``torch.compile(fullgraph=True)`` or ``torch.export``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

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


def check_token_ids(ids: torch.Tensor | None, vocab_size: int, name: str = "input_ids") -> None:
    """``ids`` ``(batch, seq_len)`` must be integer ids in ``[0, vocab_size)``, with at least one row and one position.

    Raises:
        ValueError: float or boolean ids, an empty batch or sequence, or an id outside the vocabulary.
    """
    if ids is None:
        return
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        refuse("token_id_dtype", f"`{name}` must hold integer token ids (torch.long), got dtype {ids.dtype}")
    check_not_empty(tuple(ids.shape), name)
    if not reads_values(ids):
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        refuse("token_id_range", f"`{name}` contains the negative id {low}; ids lie in [0, {vocab_size - 1}]")
    if high >= vocab_size:
        refuse("token_id_range", f"`{name}` contains id {high} but vocab_size is {vocab_size}")


def token_shape(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> tuple[int, ...]:
    """The shape of the tokens: ``input_ids``' ``(batch, seq_len)``, or that of ``inputs_embeds``
    ``(batch, seq_len, hidden)`` without its last dimension; a ``ValueError`` unless exactly one of them is given."""
    if (input_ids is None) == (inputs_embeds is None):
        given = "neither" if input_ids is None else "both"
        refuse("ids_or_embeds", f"`input_ids` and `inputs_embeds`: {given} given")
    return tuple(input_ids.shape) if input_ids is not None else tuple(inputs_embeds.shape[:-1])


def check_not_empty(shape: tuple, name: str = "input_ids") -> None:
    """A ``(batch, seq_len, ...)`` input needs at least one example and one position."""
    if len(shape) >= 1 and shape[0] == 0:
        refuse("empty_batch", f"`{name}` is a batch of 0 examples")
    if len(shape) >= 2 and shape[1] == 0:
        refuse("empty_batch", f"`{name}` has sequences of length 0")


def check_type_ids(token_type_ids: torch.Tensor | None, type_vocab_size: int, shape: tuple) -> None:
    """``token_type_ids`` must have ``shape`` and values in ``[0, type_vocab_size)``."""
    if token_type_ids is None or not token_type_ids.numel():
        return
    if tuple(token_type_ids.shape) != tuple(shape):
        refuse(
            "token_type_shape", f"`token_type_ids` must have shape {tuple(shape)}, got {tuple(token_type_ids.shape)}"
        )
    if not reads_values(token_type_ids):
        return
    low, high = int(token_type_ids.min()), int(token_type_ids.max())
    if low < 0 or high >= type_vocab_size:
        refuse(
            "token_type_range",
            f"`token_type_ids` must lie in [0, {type_vocab_size - 1}] (config.type_vocab_size={type_vocab_size}); "
            f"got values from {low} to {high}",
        )


# ----- the input contract: one row per check, the source of docs/input-contract.md --------------------------------------

TEXT_MODELS = ("longformer", "bigbird", "linformer", "performer", "reformer", "universal", "transfo_xl")
POSITION_MODELS = ("longformer", "bigbird", "linformer", "performer", "reformer", "universal")


@dataclass(frozen=True)
class InputCheck:
    """One row of the input contract: a check a model makes before any kernel runs, and the ``ValueError`` it raises.

    Attributes:
        key: the row's name (what :func:`refuse` is called with).
        inputs: the arguments checked.
        refused: what is refused.
        fix: what to change; every message of the check ends with it.
        models: the architectures (folder names under ``models/``) that make the check.
        reads_values: a value check, made where values may be read (:func:`reads_values`: eager mode on the host, or
            without gradients); False: a check of shapes and dtypes, made always, also while tracing.
    """

    key: str
    inputs: str
    refused: str
    fix: str
    models: tuple[str, ...]
    reads_values: bool


INPUT_CONTRACT: dict[str, InputCheck] = {
    check.key: check
    for check in (
        InputCheck(
            "ids_or_embeds", "`input_ids`, `inputs_embeds`", "both, or neither",
            "pass exactly one of `input_ids` or `inputs_embeds`.", TEXT_MODELS, False,
        ),
        InputCheck(
            "token_id_dtype", "`input_ids`", "float, complex or boolean ids",
            "tokenize the text (tokenizer(..., return_tensors='pt')) or convert with .long().", TEXT_MODELS, False,
        ),
        InputCheck(
            "token_id_range", "`input_ids`", "an id outside `[0, vocab_size)`",
            "use the tokenizer that belongs to this checkpoint; pad inputs with its pad_token_id (-100 belongs in "
            "`labels`).", TEXT_MODELS, True,
        ),
        InputCheck(
            "input_rank", "`input_ids` / `inputs_embeds`", "tokens not shaped `(batch, seq_len)`",
            "add a batch dimension with `unsqueeze(0)`; multiple-choice inputs (batch, choices, seq_len) go to the "
            "ForMultipleChoice head.", TEXT_MODELS, False,
        ),
        InputCheck(
            "empty_batch", "`input_ids` / `inputs_embeds`", "0 examples or sequences of length 0",
            "pass at least one example of at least one token (the tokenizer adds the special tokens even to an empty "
            "text).", TEXT_MODELS, False,
        ),
        InputCheck(
            "embeds_width", "`inputs_embeds`", "a last dimension other than the input embeddings' width",
            "build `inputs_embeds` with model.get_input_embeddings() (its embedding width), or project them to that "
            "width.", TEXT_MODELS, False,
        ),
        InputCheck(
            "sequence_too_long", "`input_ids` / `inputs_embeds` (each document of a packed batch)",
            "more tokens than the positions cover (`max_position_embeddings`)",
            "truncate the input (tokenizer(..., truncation=True, max_length=...)), or use a model that covers more "
            "positions (hfx-convert --max-length; sinusoidal positions: raise "
            "max_position_embeddings, which adds no parameters).", POSITION_MODELS, False,
        ),
        InputCheck(
            "mask_shape", "`attention_mask`, `global_attention_mask`", "a shape other than the tokens' (with a cache "
            "or memories: also covering them)",
            "pass the mask the tokenizer returned for the same batch (1 = keep, 0 = padding).", TEXT_MODELS, False,
        ),
        InputCheck(
            "no_global_attention", "`global_attention_mask`", "a global mask for a model without global tokens",
            "drop `global_attention_mask`: only Longformer reads one (BigBird's global blocks are fixed by its "
            "pattern).", ("bigbird", "linformer", "performer", "reformer", "universal"), False,
        ),
        InputCheck(
            "token_type_shape", "`token_type_ids`", "a shape other than the tokens'",
            "pass the segment ids the tokenizer returned for the same batch.",
            ("longformer", "bigbird", "linformer", "performer", "universal"), False,
        ),
        InputCheck(
            "token_type_range", "`token_type_ids`",
            "segment ids outside `[0, type_vocab_size)`; Reformer: any `token_type_ids`",
            "pass segment ids below config.type_vocab_size, or drop `token_type_ids` (return_token_type_ids=False) "
            "for a single-segment model (RoBERTa-style, Reformer).",
            ("longformer", "bigbird", "linformer", "performer", "reformer", "universal"), True,
        ),
        InputCheck(
            "global_default_needs_ids", "`inputs_embeds` (Longformer question answering, multiple choice)",
            "no `global_attention_mask`: the default global tokens are found through separator ids",
            "pass `global_attention_mask` ((batch, seq_len), 1 on the question or choice tokens) with the "
            "embeddings, or pass `input_ids`.", ("longformer",), False,
        ),
        InputCheck(
            "global_default_needs_separator", "`input_ids` (Longformer question answering, multiple choice)",
            "a sequence (document) without `sep_token_id`, and no `global_attention_mask`",
            "encode text pairs with the tokenizer, or pass `global_attention_mask`.", ("longformer",), True,
        ),
        InputCheck(
            "packed_position_start", "`position_ids` of a packed batch",
            "a document whose positions start elsewhere than the model's first position",
            "number each document from the model's first position: "
            "DataCollatorWithFlattening(position_ids_start=hf_xformers.padding_free.position_ids_start_for(model)).",
            ("longformer", "bigbird", "performer", "reformer", "universal"), True,
        ),
        InputCheck(
            "position_ids_shape", "`position_ids`", "a shape other than `(batch, seq_len)` or `(1, seq_len)`",
            "pass one position per token, shaped like `input_ids` (or one row for the whole batch).",
            POSITION_MODELS, False,
        ),
        InputCheck(
            "position_ids_range", "`position_ids`", "a negative position, or one past the position table",
            "number the tokens from the model's first position (`embeddings.position_offset`: 2 for RoBERTa-style "
            "tables, else 0) and truncate inputs to the positions the model covers, or leave `position_ids` out.",
            POSITION_MODELS, True,
        ),
        InputCheck(
            "label_range", "`labels` (sequence classification, multiple choice)",
            "a class (choice) outside `[0, num_labels)` other than the ignored -100",
            "map the labels to 0 .. num_labels - 1 (set num_labels when loading the model) and mark examples "
            "without a label by -100.", TEXT_MODELS, True,
        ),
        InputCheck(
            "cu_seq_lens_padded", "`cu_seq_lens_q/k` with a padded row", "boundaries that end before the row does",
            "leave packed rows unpadded (no padding=\"max_length\" / pad_to_multiple_of after the collator), or "
            "append the row's length to `cu_seq_lens_q/k` and pass `attention_mask` with 0 on the padding.",
            TEXT_MODELS[:-1], True,
        ),
    )
}  # fmt: skip


def contract_table() -> str:
    """:data:`INPUT_CONTRACT` as the Markdown table of ``docs/input-contract.md`` (``tests/test_input_contract.py``
    checks that the page holds exactly this)."""
    lines = [
        "| check | inputs | refused | models | checked | what to change |",
        "|---|---|---|---|---|---|",
    ]
    for check in INPUT_CONTRACT.values():
        models = "all text models" if check.models == TEXT_MODELS else ", ".join(check.models)
        when = "eager, where values may be read" if check.reads_values else "always (also traced)"
        fix = check.fix.replace("|", "\\|")
        lines.append(f"| `{check.key}` | {check.inputs} | {check.refused} | {models} | {when} | {fix} |")
    return "\n".join(lines) + "\n"


def refuse(key: str, problem: str) -> NoReturn:
    """Raise the ``ValueError`` of :data:`INPUT_CONTRACT` row ``key``: ``problem`` (what was found), then the fix."""
    raise ValueError(f"{problem}; {INPUT_CONTRACT[key].fix}")


def check_embeds_width(inputs_embeds: torch.Tensor | None, width: int) -> None:
    """``inputs_embeds`` ``(batch, seq_len, width)``: the last dimension must be the input embeddings' ``width``."""
    if inputs_embeds is not None and inputs_embeds.shape[-1] != width:
        refuse(
            "embeds_width",
            f"`inputs_embeds` are {inputs_embeds.shape[-1]} wide but this model's input embeddings are {width} wide",
        )


def check_position_ids(position_ids: torch.Tensor | None, shape: tuple, low: int, high: int | None) -> None:
    """``position_ids`` must be ``(batch, seq_len)`` (``shape``) or ``(1, seq_len)``, with values in ``[low, high)``
    (``high`` None: no upper bound, sinusoidal positions); the range is checked where values may be read
    (:func:`reads_values`)."""
    if position_ids is None:
        return
    batch, length = shape
    if position_ids.dim() != 2 or position_ids.shape[1] != length or position_ids.shape[0] not in (1, batch):
        refuse("position_ids_shape", f"`position_ids` have shape {tuple(position_ids.shape)} for tokens {shape}")
    if position_ids.is_floating_point() or not position_ids.numel() or not reads_values(position_ids):
        return
    first, last = int(position_ids.min()), int(position_ids.max())
    if first < low or (high is not None and last >= high):
        table = f"[{low}, {high - 1}]" if high is not None else f"[{low}, ...)"
        refuse(
            "position_ids_range",
            f"`position_ids` run from {first} to {last}, but this model's positions lie in {table}",
        )


__all__ = [
    "INPUT_CONTRACT",
    "InputCheck",
    "as_if_on_accelerator",
    "check_embeds_width",
    "check_not_empty",
    "check_position_ids",
    "check_token_ids",
    "contract_table",
    "check_type_ids",
    "is_tracing",
    "on_host",
    "reads_values",
    "refuse",
    "unpadded_to_none",
]
