"""What differs between the transformers releases we support (``pyproject.toml``: ``transformers>=5.18,<6``).

Everything that reads a version-dependent name of transformers goes through here, so one code base runs on the
lowest supported release and on the newest one, and a new rename is absorbed in one place.

* The decoding cache. transformers 5.24 renamed the cache of model outputs and of ``generate()``'s model kwargs from
  ``past_key_values`` (and ``cache_params``) to ``cache``: output dataclasses have a ``cache`` field, and
  ``ModelOutput.__init__`` turns a ``past_key_values=`` keyword into ``cache=`` (so a dataclass of our own with a
  ``past_key_values`` field raises ``TypeError: ... unexpected keyword argument 'cache'``). :data:`CACHE_NAME` is the
  name of this release. Our output dataclasses declare the field as ``cache`` under :func:`cache_field`, which names
  it ``past_key_values`` on older releases, and code reads and writes it with :func:`output_cache` /
  ``**{CACHE_NAME: cache}``.
  Our ``forward`` methods keep their ``past_key_values`` argument (what every earlier caller passes) and also take
  ``cache``; :func:`resolve_cache_argument` merges the two.
* Activation checkpointing. transformers 5.23 renamed gradient checkpointing to activation checkpointing:
  ``TrainingArguments.activation_checkpointing`` / ``activation_checkpointing_kwargs`` and
  ``PreTrainedModel.activation_checkpointing_enable()`` (the ``gradient_checkpointing`` names stay as deprecated
  aliases). :data:`ACTIVATION_CHECKPOINTING` says whether this release has the new names, and
  :func:`checkpointing_argv` spells a command line's ``--activation_checkpointing`` the old way before 5.23.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# "cache" from transformers 5.24 on, "past_key_values" before.
CACHE_NAME: str = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

# True from transformers 5.23 on: `--activation_checkpointing` and `activation_checkpointing_enable()`; before, only
# the `gradient_checkpointing` names exist.
ACTIVATION_CHECKPOINTING: bool = hasattr(PreTrainedModel, "activation_checkpointing_enable")

# Every name under which generate() may hand a cache to prepare_inputs_for_generation, on any supported release.
CACHE_ARGUMENT_NAMES: tuple[str, ...] = ("cache", "past_key_values", "cache_params")


def cache_field(cls: type) -> type:
    """Class decorator for a ``ModelOutput`` subclass, applied before ``@dataclass``: the field declared as ``cache``
    becomes ``past_key_values`` (same place, same default) on releases before 5.24, so that transformers' generation
    code and ``ModelOutput`` find the cache under the name they use."""
    if CACHE_NAME == "cache":
        return cls
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    if "cache" not in annotations:
        raise TypeError(f"{cls.__name__} declares no `cache` field for @cache_field to rename.")
    cls.__annotations__ = {(CACHE_NAME if k == "cache" else k): v for k, v in annotations.items()}
    setattr(cls, CACHE_NAME, cls.__dict__["cache"])
    delattr(cls, "cache")
    return cls


def checkpointing_argv(argv: list[str]) -> list[str]:
    """Command-line arguments for ``HfArgumentParser(TrainingArguments)``: before transformers 5.23, whose
    TrainingArguments know only ``--gradient_checkpointing[_kwargs]``, ``--activation_checkpointing[_kwargs]`` is
    spelled that way; from 5.23 on the arguments are returned unchanged."""
    if ACTIVATION_CHECKPOINTING:
        return list(argv)
    new_prefix = "__activation_checkpointing"  # the option name with its dashes as underscores

    def old_spelling(arg: str) -> str:
        name, equals, value = arg.partition("=")
        name = name.replace("-", "_")
        if not name.startswith(new_prefix):
            return arg
        return "--gradient_checkpointing" + name[len(new_prefix) :] + equals + value

    return [old_spelling(arg) for arg in argv]


def resolve_cache_argument(past_key_values: Any = None, cache: Any = None) -> Any:
    """The cache a caller passed as ``past_key_values`` (transformers < 5.24, and every earlier caller) or ``cache``
    (transformers >= 5.24); None when neither.

    Raises:
        ValueError: both were given (and are not the same object).
    """
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("Pass the decoding cache once: as `cache` (transformers >= 5.24) or `past_key_values`.")
    return cache if cache is not None else past_key_values


def cache_from_kwargs(kwargs: dict) -> Any:
    """Pop the cache from ``prepare_inputs_for_generation``'s keyword arguments, whatever the release called it."""
    found = [kwargs.pop(name) for name in CACHE_ARGUMENT_NAMES if name in kwargs]
    found = [c for c in found if c is not None]
    if len({id(c) for c in found}) > 1:
        raise ValueError("Pass the decoding cache once: as `cache` (transformers >= 5.24) or `past_key_values`.")
    return found[0] if found else None


def output_cache(output: Any) -> Any:
    """The cache a model output carries (None when it has none), without transformers 5.24's deprecation warning
    for ``output.past_key_values``."""
    return getattr(output, CACHE_NAME, None)


__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "CACHE_ARGUMENT_NAMES",
    "CACHE_NAME",
    "cache_field",
    "cache_from_kwargs",
    "checkpointing_argv",
    "output_cache",
    "resolve_cache_argument",
]
