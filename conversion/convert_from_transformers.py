"""Import a checkpoint of one of ``transformers``' own architectures into the matching hf_xformers class.

For example ``allenai/longformer-base-4096``, saved locally with ``save_pretrained``, becomes an
``hfx-longformer`` checkpoint with the same weights, config values (attention windows, labels ...) and
tokenizer, and gives the same outputs.

Usage::

    python conversion/convert_from_transformers.py --source DIR --output DIR

:data:`IMPORTERS` maps the source ``model_type`` to its importer; BigBird, Swin, Reformer and Transformer-XL
plug in there.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    # Lets `python conversion/convert_from_transformers.py` find the `conversion` package from any directory.
    sys.path.insert(0, str(REPO_ROOT))

from conversion.common import (  # noqa: E402
    drop_buffers,
    load_converted_weights,
    load_tokenizer,
    load_weights,
    read_config,
    save_model_and_tokenizer,
    split_prefix,
)
from hf_xformers import (  # noqa: E402
    HfxLongformerConfig,
    HfxLongformerForMaskedLM,
    HfxLongformerForMultipleChoice,
    HfxLongformerForQuestionAnswering,
    HfxLongformerForSequenceClassification,
    HfxLongformerForTokenClassification,
    HfxLongformerModel,
)

logger = logging.getLogger(__name__)

# Keys of a saved transformers config that describe the source class or library, not the model
# (`attention_mode` and `ignore_attention_mask` are left in the original allenai/longformer-* configs).
_SOURCE_ONLY_CONFIG_KEYS = (
    "model_type",
    "architectures",
    "transformers_version",
    "_name_or_path",
    "auto_map",
    "onnx_export",
    "attention_mode",
    "ignore_attention_mask",
)

LONGFORMER_CLASSES: dict[str, type[PreTrainedModel]] = {
    "LongformerModel": HfxLongformerModel,
    "LongformerForMaskedLM": HfxLongformerForMaskedLM,
    "LongformerForSequenceClassification": HfxLongformerForSequenceClassification,
    "LongformerForMultipleChoice": HfxLongformerForMultipleChoice,
    "LongformerForQuestionAnswering": HfxLongformerForQuestionAnswering,
    "LongformerForTokenClassification": HfxLongformerForTokenClassification,
}


def _pick_class(
    config: dict,
    rest: dict[str, torch.Tensor],
    classes: dict[str, type[PreTrainedModel]],
    base_name: str,
    mlm_name: str,
) -> type[PreTrainedModel]:
    """Target class from ``config.architectures`` (``base_name`` when absent). A base-model checkpoint that also
    holds an MLM head becomes ``mlm_name``, so the pretrained head is not thrown away.

    Raises:
        ValueError: ``architectures`` names only classes missing from ``classes``.
    """
    architectures = config.get("architectures") or []
    known = [name for name in architectures if name in classes]
    if architectures and not known:
        raise ValueError(f"Unsupported architectures {architectures}; accepted: {sorted(classes)}.")
    name = known[0] if known else base_name
    if name == base_name and any(k.startswith("lm_head.") for k in rest):
        logger.info("%s checkpoint carries an MLM head: importing it as %s.", name, mlm_name)
        name = mlm_name
    return classes[name]


def import_longformer(source: Path, config: dict) -> PreTrainedModel:
    """``transformers`` Longformer (any head) -> the matching ``HfxLongformer*`` class with the same weights.

    Names are already ours except: the ``*.position_ids`` buffers are dropped and the MLM decoder bias, stored as
    ``lm_head.bias``, becomes ``lm_head.decoder.bias``.
    """
    weights = drop_buffers(load_weights(source))
    base, rest = split_prefix(weights, "longformer.")
    model_class = _pick_class(config, rest, LONGFORMER_CLASSES, "LongformerModel", "LongformerForMaskedLM")

    kwargs = {k: v for k, v in config.items() if k not in _SOURCE_ONLY_CONFIG_KEYS}
    kwargs["architectures"] = [model_class.__name__]
    hfx_config = HfxLongformerConfig(**kwargs)
    model = model_class(hfx_config)

    if "lm_head.bias" in rest:
        rest.setdefault("lm_head.decoder.bias", rest["lm_head.bias"])
        del rest["lm_head.bias"]
    if model_class is HfxLongformerModel:
        state = dict(base)
    else:
        state = {f"longformer.{k}": v for k, v in base.items()}
    state.update(rest)
    may_be_missing = []
    if getattr(hfx_config, "tie_word_embeddings", True):
        state.pop("lm_head.decoder.weight", None)
        may_be_missing.append("lm_head.decoder.weight")
    # A pooler (or an MLM head) saved with a class that does not use it has nowhere to go.
    load_converted_weights(
        model, state, may_be_missing=may_be_missing, may_be_unused=("pooler.", "longformer.pooler.", "lm_head.")
    )
    return model


# Source model_type -> importer(source dir, source config dict). BigBird, Swin, Reformer, Transformer-XL go here.
IMPORTERS: dict[str, Callable[[Path, dict], PreTrainedModel]] = {
    "longformer": import_longformer,
}


def convert_from_transformers(
    source: str | Path, output_dir: str | Path | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Import a local ``transformers`` checkpoint into hf_xformers.

    Args:
        source: directory saved with ``save_pretrained`` (config, weights, optionally the tokenizer).
        output_dir: when given, the converted model (and tokenizer) are saved there.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode, ``tokenizer`` is None when the source has none.

    Raises:
        ValueError: the source is not a local directory of one of the :data:`IMPORTERS` model types.
    """
    path = Path(source)
    config = read_config(path, IMPORTERS)
    model = IMPORTERS[config["model_type"]](path, config).eval()
    tokenizer = load_tokenizer(path, required=False)
    if output_dir is not None:
        save_model_and_tokenizer(model, tokenizer, output_dir)
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source", required=True, help=f"local checkpoint directory, model_type in {sorted(IMPORTERS)}"
    )
    parser.add_argument("--output", required=True, help="directory to save the converted model and tokenizer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    convert_from_transformers(args.source, args.output)


if __name__ == "__main__":
    main()
