"""Checkpoints saved by transformers' own classes (``LongformerModel``, ``BigBirdForMaskedLM``, ``SwinModel`` ...),
read by our classes: the rules shared by ``from_pretrained`` and ``hfx-import``.

An architecture whose config derives from :class:`TransformersCheckpointConfig` names the transformers
``model_type`` it reads (``transformers_model_type``) and implements two translations:

* :meth:`~TransformersCheckpointConfig.config_dict_from_transformers`: transformers' ``config.json`` -> ours (the
  importer and ``from_pretrained`` both build the config from it; it raises ``ValueError`` for what we do not
  implement);
* :meth:`~TransformersCheckpointConfig.transformers_weight_renames`: the tensor renames, as regular expressions for
  ``from_pretrained(key_mapping=...)`` (transformers' own loading hook), plus the tensors the importer drops.

``get_config_dict`` translates on the fly, so ``HfxLongformerConfig.from_pretrained(dir)`` of a transformers
``longformer`` folder or Hub id gives our config without transformers' warning that the model types differ;
``layers/transformers_loading.py`` adds the weight renames when a model loads. No torch here (the configuration floor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .text_config import drop_runtime_keys

# The command that imports a transformers checkpoint once and saves it in our format (errors name it): the entry
# point of hf_xformers.conversion.convert_from_transformers, which `python -m` runs the same.
IMPORTER = "hfx-import"

# Keys of a saved transformers config that describe the source class or library, not the model
# (`attention_mode` and `ignore_attention_mask` are left in the original allenai/longformer-* configs).
SOURCE_ONLY_CONFIG_KEYS = (
    "model_type",
    "architectures",
    "transformers_version",
    "_name_or_path",
    "auto_map",
    "onnx_export",
    "attention_mode",
    "ignore_attention_mask",
)

# Buffers older text checkpoints save next to the weights (allenai/longformer-*, google/bigbird-*): rebuilt by the
# model, never loaded (the importer's `drop_buffers`).
SAVED_BUFFERS = (r"\.position_ids$", r"\.token_type_ids$")
# A pooler saved with a class that has none (transformers' BigBirdForMaskedLM has one, ours not): nowhere to go, as in the
# importer. (Matched against unexpected keys only, so a class with a pooler still loads it.)
UNUSED_POOLER = r"(^|\.)pooler\."


@dataclass(frozen=True)
class WeightRenames:
    """How the tensors of a transformers checkpoint become ours.

    Args:
        key_mapping: ``{regular expression: replacement}`` in the form of ``from_pretrained(key_mapping=...)``;
            applied in order to every checkpoint name (a pattern may chain onto an earlier one's result), before
            transformers adds or strips the base-model prefix.
        unused: regular expressions of checkpoint tensors that have no counterpart and are dropped without being
            reported as unexpected (saved buffers we recompute, heads the importer drops, sources of ``copies``).
        copies: ``{our tensor: checkpoint tensor}`` set after loading, for what a rename cannot express (one tensor
            copied into several places; of two saved copies, the one that sorts second). Our names are those of the
            head classes (base-model prefix included); the base model drops the prefix.
    """

    key_mapping: dict[str, str] = field(default_factory=dict)
    unused: tuple[str, ...] = ()
    copies: dict[str, str] = field(default_factory=dict)


class TransformersCheckpointConfig:
    """Config mixin (put before ``PreTrainedConfig`` in the bases): reads transformers' ``config.json`` of
    ``transformers_model_type`` as ours.

    Subclasses set ``transformers_model_type`` and ``transformers_architectures`` (transformers class name -> ours)
    and override :meth:`config_dict_from_transformers` / :meth:`transformers_weight_renames` where the plain rules
    (drop :data:`SOURCE_ONLY_CONFIG_KEYS`, keep the rest, rename no tensor) are not enough.
    """

    # Unannotated: class settings, not config fields (PreTrainedConfig subclasses are dataclasses).
    transformers_model_type = None
    transformers_architectures = {}

    def _remove_keys_not_serialized(self, d: dict[str, Any]) -> None:
        # Run-time state on the config (text_config.RUNTIME_ONLY_PREFIX) stays out of config.json; this mixin is
        # the common base of the configs that are not HfxTextConfigs (Reformer, Transformer-XL, Swin).
        super()._remove_keys_not_serialized(d)
        drop_runtime_keys(d)

    @classmethod
    def is_transformers_config(cls, config_dict: dict) -> bool:
        """Whether ``config_dict`` (a saved ``config.json``) is transformers' config of our architecture."""
        return cls.transformers_model_type is not None and config_dict.get("model_type") == cls.transformers_model_type

    @classmethod
    def config_dict_from_transformers(cls, config_dict: dict) -> dict:
        """transformers' saved config -> ours, as a dict for ``from_dict`` (``model_type`` ours, ``architectures``
        our class names where transformers' have one here).

        Raises:
            ValueError: a setting our architecture does not implement (the message says which and what to do).
        """
        ours = {k: v for k, v in config_dict.items() if k not in SOURCE_ONLY_CONFIG_KEYS}
        architectures = [cls.transformers_architectures[name] for name in config_dict.get("architectures") or []
                         if name in cls.transformers_architectures]  # fmt: skip
        if architectures:
            ours["architectures"] = architectures
        ours["model_type"] = cls.model_type
        return ours

    @classmethod
    def transformers_weight_renames(cls, config_dict: dict, tensor_names: set[str] | None) -> WeightRenames:
        """The renames of the tensors of a checkpoint saved with transformers' config ``config_dict``.

        Args:
            config_dict: the checkpoint's ``config.json`` as saved by transformers.
            tensor_names: the checkpoint's tensor names, or None when they could not be read (the renames then
                assume the layout transformers 5.x writes).

        Raises:
            ValueError: the checkpoint needs more than renames (e.g. one tensor copied to several places); the
                message names the importer, which converts it.
        """
        return WeightRenames()

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """transformers' ``get_config_dict`` (local folder, file or Hub id), translated by
        :meth:`config_dict_from_transformers` when it is transformers' config of our architecture."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if cls.is_transformers_config(config_dict):
            config_dict = cls.config_dict_from_transformers(config_dict)
        return config_dict, kwargs


__all__ = [
    "IMPORTER",
    "SAVED_BUFFERS",
    "UNUSED_POOLER",
    "SOURCE_ONLY_CONFIG_KEYS",
    "TransformersCheckpointConfig",
    "WeightRenames",
]
