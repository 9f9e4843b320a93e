"""Helpers shared by the conversion scripts: reading checkpoints from disk, loading renamed weights, saving.

Weights are read straight from the files (``model.safetensors``, ``pytorch_model.bin`` or their sharded
indexes) rather than through a ``transformers`` model class, so any head's checkpoint can be read and we see
exactly which tensors it holds (for instance whether an MLM head is present).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hf_xformers.card import CARD_DATA_FILE, hub_model_id, save_card_data, write_model_card

logger = logging.getLogger(__name__)

# Buffers that some checkpoints store next to the weights; they are rebuilt by the model, never loaded.
BUFFER_SUFFIXES = (".position_ids", ".token_type_ids")
# Any of these next to a checkpoint means a tokenizer was saved there.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "sentencepiece.bpe.model",
    "spiece.model",
)


def read_config(source: str | Path, accepted: Iterable[str]) -> dict:
    """Read ``config.json`` of a local checkpoint and check its ``model_type``.

    Args:
        source: local directory of a saved checkpoint.
        accepted: the ``model_type`` values the caller can convert (used in the error messages too).

    Returns:
        The config as a plain dict.

    Raises:
        ValueError: ``source`` is not a directory, has no ``config.json``, or its ``model_type`` is not accepted.
    """
    accepted = sorted(accepted)
    path = Path(source)
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        raise ValueError(
            f"Source {str(source)!r} is not a local checkpoint directory with a config.json. Accepted: a directory "
            f"saved with save_pretrained() whose model_type is one of {accepted} (Hub ids are not downloaded; "
            "save the model locally first)."
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{config_file} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); the file is "
            "damaged or was cut short: copy it again from the original checkpoint."
        ) from error
    model_type = config.get("model_type")
    if model_type not in accepted:
        raise ValueError(f"Source {str(source)!r} has model_type {model_type!r}; accepted model types: {accepted}.")
    return config


def load_weights(source: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local checkpoint, on CPU, by its saved name.

    Reads ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``) or, for older
    checkpoints, ``pytorch_model.bin`` and its sharded index. TF-era LayerNorm names (``gamma``/``beta``) are
    renamed to ``weight``/``bias``.

    Raises:
        ValueError: no weight file found.
    """
    path = Path(source)
    files: list[Path] = []
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            files = [path / name]
            break
        index = path / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [path / shard for shard in shards]
            break
    if not files:
        raise ValueError(f"No model.safetensors or pytorch_model.bin (or sharded index) found in {str(source)!r}.")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            weights.update(load_file(str(file), device="cpu"))
        else:
            # weights_only: a .bin file is a pickle; never run code from it.
            weights.update(torch.load(file, map_location="cpu", weights_only=True))
    renamed = {}
    for key, tensor in weights.items():
        if key.endswith(".gamma"):
            key = key[: -len("gamma")] + "weight"
        elif key.endswith(".beta"):
            key = key[: -len("beta")] + "bias"
        renamed[key] = tensor
    return renamed


def drop_buffers(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove saved non-parameter buffers (``*.position_ids``, ``*.token_type_ids``)."""
    return {k: v for k, v in weights.items() if not k.endswith(BUFFER_SUFFIXES)}


def split_prefix(
    weights: dict[str, torch.Tensor], prefix: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a checkpoint into base-model weights (``prefix`` removed) and everything else (the heads).

    Checkpoints saved from a bare base model have no prefix at all: their ``embeddings.*``/``encoder.*``/
    ``pooler.*`` keys are taken as the base model.

    Returns:
        ``(base, rest)``.
    """
    base, rest = {}, {}
    has_prefix = any(k.startswith(prefix) for k in weights)
    for key, tensor in weights.items():
        if has_prefix and key.startswith(prefix):
            base[key[len(prefix) :]] = tensor
        elif not has_prefix and key.split(".", 1)[0] in ("embeddings", "encoder", "pooler"):
            base[key] = tensor
        else:
            rest[key] = tensor
    return base, rest


def load_converted_weights(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    may_be_missing: Iterable[str] = (),
    may_be_unused: Iterable[str] = (),
) -> None:
    """Load renamed weights into ``model`` and fail loudly when the renaming did not line up.

    Args:
        model: the freshly built target model.
        weights: tensors under the target's parameter names.
        may_be_missing: name prefixes of parameters allowed to keep their fresh initialisation (tied weights,
            heads the source does not have).
        may_be_unused: name prefixes of source tensors the target has no place for (e.g. a pooler).

    Raises:
        RuntimeError: other missing or unexpected names, or a shape mismatch; the message lists them.
    """
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith(tuple(may_be_missing))]
    unused = [k for k in result.unexpected_keys if not k.startswith(tuple(may_be_unused))]
    if missing or unused:
        raise RuntimeError(
            f"Converted weights do not match {type(model).__name__}: missing {missing[:10]}, unexpected {unused[:10]}. "
            "The source checkpoint has a layout this converter does not know."
        )
    skipped = [k for k in result.unexpected_keys if k not in unused]
    if skipped:
        logger.info("Not carried over (the target has no such module): %s", ", ".join(sorted(skipped)))
    fresh = sorted(result.missing_keys)
    if fresh:
        logger.info("Left at their initial values (tied or absent from the source): %s", ", ".join(fresh))


def load_tokenizer(source: str | Path, required: bool = True) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved next to a checkpoint (``AutoTokenizer``), or None when absent and not ``required``.

    Raises:
        ValueError: ``required`` and no tokenizer could be loaded from ``source``.
    """
    error: Exception | None = None
    # Without any tokenizer file AutoTokenizer does not fail: it builds an empty tokenizer from the model type.
    if any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        try:
            return AutoTokenizer.from_pretrained(str(source))
        except (OSError, ValueError, TypeError) as caught:
            error = caught
    if required:
        raise ValueError(
            f"Could not load a tokenizer from {str(source)!r} ({error or 'no tokenizer files'}); save the source "
            "tokenizer into the same directory (tokenizer.save_pretrained(source))."
        ) from error
    logger.info("No tokenizer in %s; converting the model only.", source)
    return None


# Files a saved checkpoint consists of: what --overwrite removes from an output folder before writing, so nothing of
# an earlier model (a stale preprocessor_config.json, another tokenizer's vocabulary) survives next to the new one.
CHECKPOINT_FILE_PATTERNS = (
    "config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json",
    "model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
    "tokenizer*.json", "special_tokens_map.json", "added_tokens.json", "chat_template.*", "vocab.*", "merges.txt",
    "*.model", CARD_DATA_FILE,
)  # fmt: skip


def prepare_output_dir(output_dir: str | Path, overwrite: bool = False) -> Path:
    """Check that ``output_dir`` can receive a converted checkpoint; create it.

    A folder that already holds files is refused (a stale file of another model there would be loaded with the
    new one), unless ``overwrite``: then the checkpoint files in it (:data:`CHECKPOINT_FILE_PATTERNS`) are removed
    and other files are left alone.

    Raises:
        ValueError: ``output_dir`` is a file, or a non-empty folder and ``overwrite`` is False.
    """
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"Output {str(path)!r} is a file; pass a folder (it is created if missing).")
    existing = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if existing and not overwrite:
        shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
        raise ValueError(
            f"Output folder {str(path)!r} is not empty ({shown}). Choose a new or empty folder, or pass "
            "--overwrite (overwrite=True) to replace the checkpoint files in it."
        )
    for pattern in CHECKPOINT_FILE_PATTERNS if existing else ():
        for stale in path.glob(pattern):
            if stale.is_file():
                stale.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_model_and_tokenizer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    output_dir: str | Path,
    provenance: dict | None = None,
) -> None:
    """``save_pretrained`` the model and (when given) the tokenizer into ``output_dir``.

    With ``provenance`` (:func:`conversion_provenance`), it is also recorded as the folder's card data and a model
    card (``README.md``) is written, so the converted folder is ready to upload and its card names ``base_model``.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(output_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(output_dir))
    if provenance is not None:
        save_card_data(output_dir, **provenance)
        write_model_card(output_dir)
    logger.info("Saved %s to %s", type(model).__name__, output_dir)


def conversion_provenance(source: str | Path, base_model: str | None, how: str) -> dict:
    """What a converted checkpoint was made from, as card data (see :mod:`hf_xformers.card`).

    Args:
        source: the local folder that was converted.
        base_model: the Hub id ``source`` holds (e.g. ``FacebookAI/roberta-base``). None: taken from a Hub cache
            path (``.../models--org--name/snapshots/...``) or from ``source``'s own card data when it has them;
            otherwise the card names no ``base_model`` (a local folder name is no Hub id).
        how: the conversion, in words (script and main options).
    """
    hub_id = base_model or hub_model_id(source)
    name = Path(source).name
    origin = f"[`{hub_id}`](https://huggingface.co/{hub_id})" if hub_id else f"the local checkpoint `{name}`"
    return {"base_model": hub_id, "source": f"`{name}`", "summary": f"Converted from {origin} {how}."}
