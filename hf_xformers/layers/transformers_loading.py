"""``from_pretrained`` of transformers' own checkpoints: :class:`TransformersCheckpointMixin`.

Every hf_xformers model (``HfxPreTrainedModel``, ``layers/pretrained.py``) takes it, so that ``from_pretrained``
also reads a checkpoint saved by transformers' own class of the architecture: the config is translated by the
configuration class (``configs/transformers_checkpoints.py``) and the tensors renamed as they load.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re

import torch
from torch import nn
from transformers.utils import CONFIG_NAME, cached_file

from ..configs.transformers_checkpoints import IMPORTER, WeightRenames

logger = logging.getLogger(__name__)

# What from_pretrained passes on to transformers' file lookup (local folder, Hub cache or download).
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
# Set while from_pretrained loads a transformers checkpoint: its renames, whose dropped tensors and copy targets the load
# report should not list as unexpected / missing (a context variable: the model instance that reads it is built inside
# transformers' from_pretrained, after this class hands over).
_RENAMES: contextvars.ContextVar[WeightRenames | None] = contextvars.ContextVar("hfx_renames", default=None)


class TransformersCheckpointMixin:
    """``from_pretrained`` that also reads a checkpoint saved by transformers' own class of the architecture
    (``LongformerForMaskedLM``, ``BigBirdModel``, ``SwinBackbone``, 4.x ``TransfoXLLMHeadModel`` ...), a local folder
    or a Hub id: the config is translated (``config_class.get_config_dict``, see
    ``configs/transformers_checkpoints.py``) and the tensors renamed through transformers' ``key_mapping`` as they
    load. The model is the one ``hfx-import`` writes, loaded into this class;
    ``save_pretrained`` then writes our format. One info line says what was converted.
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' ``from_pretrained``, plus checkpoints of ``config_class.transformers_model_type``.

        Raises:
            ValueError: a transformers checkpoint that does not convert exactly (a setting or head we do not
                implement, or tensors that need more than renames); the message says why and names the importer.
        """
        config_class = cls.config_class
        source = None
        if (
            getattr(config_class, "transformers_model_type", None) is not None
            and pretrained_model_name_or_path is not None
            and kwargs.get("gguf_file") is None
        ):
            source = _source_config(pretrained_model_name_or_path, kwargs)
        if source is None or not config_class.is_transformers_config(source):
            return cls._from_own_checkpoint(pretrained_model_name_or_path, *model_args, **kwargs)

        model_type, where = source["model_type"], str(pretrained_model_name_or_path)
        try:
            config_class.config_dict_from_transformers(source)  # refuse before any tensor is read
        except ValueError as error:
            raise ValueError(
                f"{cls.__name__}.from_pretrained: transformers' `{model_type}` checkpoint {where!r} does not convert "
                f"exactly: {error} (`{IMPORTER}` refuses it too.)"
            ) from error
        weights = _CheckpointWeights(pretrained_model_name_or_path, kwargs)
        names = weights.names
        try:
            renames = config_class.transformers_weight_renames(source, names)
        except ValueError as error:
            raise ValueError(
                f"{cls.__name__}.from_pretrained: transformers' `{model_type}` checkpoint {where!r} does not convert "
                f"by renaming: {error}"
            ) from error

        # The head's renames act on the translated names, the caller's own key_mapping after ours (renames chain in
        # order).
        head_renames = _head_renames(cls, names, renames.key_mapping)
        key_mapping = {**renames.key_mapping, **head_renames, **(kwargs.pop("key_mapping", None) or {})}
        token = _RENAMES.set(renames)
        try:
            loaded = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, key_mapping=key_mapping or None, **kwargs
            )
        finally:
            _RENAMES.reset(token)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        copied = _copy_tensors(model, renames.copies, weights)
        # transformers keeps the renames it used and reverts them in save_pretrained; the model is ours now and must
        # save under our names (and model_type), or it would not load again.
        model._weight_conversions = []
        renamed = [
            f"{pattern.strip('^$').replace(chr(92), '')} -> {target}"
            for pattern, target in renames.key_mapping.items()
            if names is None or any(re.search(pattern, name) for name in names)
        ]
        logger.info(
            "Converted transformers' `%s` checkpoint %r to %s on the fly (config -> %s; tensors renamed: %s%s), as "
            "`%s` would.",
            model_type, where, cls.__name__, config_class.model_type, ", ".join(renamed) or "none",
            f"; copied: {', '.join(copied)}" if copied else "", IMPORTER,
        )  # fmt: skip
        return loaded

    @classmethod
    def own_checkpoint_renames(cls, tensor_names: set[str]) -> dict[str, str]:
        """Renames for a checkpoint whose tensors are ``tensor_names`` (our names; a transformers checkpoint's once
        translated), in the form of ``from_pretrained(key_mapping=...)``: none here; a head that starts a layer from
        a tensor another class saved overrides it (the sequence-classification head: its ``classifier.dense`` from a
        stored pooler)."""
        return {}

    @classmethod
    def _from_own_checkpoint(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' ``from_pretrained`` of a checkpoint in our format, with :meth:`own_checkpoint_renames` of
        its tensor names passed as ``key_mapping`` (transformers' own renaming hook) before the caller's."""
        renames = {}
        if pretrained_model_name_or_path is not None and _renames_tensors(cls):
            renames = _head_renames(cls, _CheckpointWeights(pretrained_model_name_or_path, kwargs).names, {})
        if not renames:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        key_mapping = {**renames, **(kwargs.pop("key_mapping", None) or {})}
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, key_mapping=key_mapping, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        # transformers reverts the renames it used in save_pretrained; ours must not be (the model saves its own names,
        # `classifier.dense`, not the tensor it started from), the caller's still are.
        model._weight_conversions = [
            conversion for conversion in getattr(model, "_weight_conversions", None) or []
            if not set(conversion.source_patterns) <= set(renames)
        ]  # fmt: skip
        return loaded

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        # transformers' hook that drops the missing / unexpected keys a model declares harmless; a transformers
        # checkpoint adds the tensors its conversion drops on purpose (saved buffers, a next-sentence head ...) and
        # the ones it sets after loading (`copies`).
        super()._adjust_missing_and_unexpected_keys(loading_info)
        renames = _RENAMES.get()
        if renames is None:
            return
        if renames.unused:
            pattern = re.compile("|".join(renames.unused))
            kept = [key for key in loading_info.unexpected_keys if not pattern.search(key)]
            loading_info.unexpected_keys = type(loading_info.unexpected_keys)(kept)
        if renames.copies:
            prefix = f"{self.base_model_prefix}."
            filled = {name for target in renames.copies for name in (target, target.removeprefix(prefix))}
            kept = [key for key in loading_info.missing_keys if key not in filled]
            loading_info.missing_keys = type(loading_info.missing_keys)(kept)


def _renames_tensors(cls) -> bool:
    """Whether ``cls`` renames tensors as they load (:meth:`TransformersCheckpointMixin.own_checkpoint_renames`);
    only such a class reads a checkpoint's tensor names (a safetensors header, a shard index)."""
    return cls.own_checkpoint_renames.__func__ is not TransformersCheckpointMixin.own_checkpoint_renames.__func__


def _head_renames(cls, names: set[str] | None, translation: dict[str, str]) -> dict[str, str]:
    """``cls.own_checkpoint_renames`` of a checkpoint's tensor ``names`` once the ``translation`` renames (a
    transformers checkpoint's, :class:`~hf_xformers.configs.transformers_checkpoints.WeightRenames`) have made them
    ours; ``{}`` when the names are unknown or ``cls`` renames nothing."""
    if names is None or not _renames_tensors(cls):
        return {}
    for pattern, target in translation.items():
        names = {re.sub(pattern, target, name, count=1) for name in names}
    return cls.own_checkpoint_renames(names)


@torch.no_grad()
def _copy_tensors(model: nn.Module, copies: dict[str, str], weights: _CheckpointWeights) -> list[str]:
    """Set ``model``'s tensors named in ``copies`` (``{our name: checkpoint name}``, our names as in the head classes)
    from the checkpoint; a name this class lacks is skipped, one under the base-model prefix is also looked up without
    it (the base model). Returns ``"checkpoint name -> our name"`` per source, for the info line."""
    own = dict(model.named_parameters())
    prefix = f"{model.base_model_prefix}."
    done: dict[str, list[str]] = {}
    for target, source in copies.items():
        name = target if target in own else target.removeprefix(prefix)
        if name in own:
            own[name].copy_(weights.tensor(source))
            done.setdefault(source, []).append(name)
    return [f"{source} -> {names[0]}" + (f" (+{len(names) - 1} more)" if len(names) > 1 else "")
            for source, names in done.items()]  # fmt: skip


def _source_config(pretrained_model_name_or_path, kwargs: dict) -> dict | None:
    """The ``config.json`` at ``pretrained_model_name_or_path`` (local folder, Hub cache or download, through
    transformers' ``cached_file``), or None when there is none to read (transformers' own loading then reports it)."""
    if os.path.isfile(str(pretrained_model_name_or_path)):
        return None
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    try:
        resolved = cached_file(
            pretrained_model_name_or_path, CONFIG_NAME, _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False, **hub,
        )  # fmt: skip
        if resolved is None:
            return None
        with open(resolved, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


class _CheckpointWeights:
    """The weight files of a checkpoint (local folder, Hub cache or download, through transformers' ``cached_file``),
    in transformers' order of preference: their tensor names, read without loading tensors (a safetensors header, a
    shard index, a ``.bin`` loaded onto the meta device), and single tensors on demand."""

    def __init__(self, pretrained_model_name_or_path, kwargs: dict) -> None:
        self.path = pretrained_model_name_or_path
        self.hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        self.names: set[str] | None = None
        self._files: dict[str, str] = {}  # tensor name -> weight file name (a shard for sharded checkpoints)
        self._bins: dict[str, dict[str, torch.Tensor]] = {}  # memory-mapped .bin files read by `tensor`
        variant = kwargs.get("variant")
        candidates = [
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
        ]
        if kwargs.get("use_safetensors") is False:
            candidates = candidates[2:]
        for name in candidates:
            if variant:
                stem, _, suffix = name.partition(".")
                name = f"{stem}.{variant}.{suffix}"
            try:
                resolved = self._resolve(name)
                if resolved is None:
                    continue
                if name.endswith(".json"):
                    with open(resolved, encoding="utf-8") as file:
                        self._files = dict(json.load(file)["weight_map"])
                else:
                    self._files = dict.fromkeys(self._names_in(resolved), name)
                self.names = set(self._files)
            except Exception:  # noqa: BLE001 - a hint only: without names the renames assume 5.x's layout
                self._files, self.names = {}, None
            return

    def _resolve(self, filename: str) -> str | None:
        return cached_file(
            self.path, filename, _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False, **self.hub,
        )  # fmt: skip

    @staticmethod
    def _names_in(resolved: str) -> list[str]:
        if resolved.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(resolved, framework="pt") as file:
                return list(file.keys())
        return list(torch.load(resolved, map_location="meta", weights_only=True))

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor of the checkpoint, on the CPU (a ``.bin`` file is memory-mapped once)."""
        resolved = self._resolve(self._files[name])
        if resolved.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(resolved, framework="pt") as file:
                return file.get_tensor(name)
        if resolved not in self._bins:
            try:
                self._bins[resolved] = torch.load(resolved, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                self._bins[resolved] = torch.load(resolved, map_location="cpu", weights_only=True)
        return self._bins[resolved][name]
