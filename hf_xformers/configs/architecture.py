"""What an architecture declares about itself, once: :class:`Architecture`.

Each ``models/<arch>/__init__.py`` builds one ``ARCHITECTURE = Architecture(...)``; ``models/__init__.py`` lists the
architecture packages, and everything that used to be a hand-kept list is built from those declarations:

* ``registration.REGISTRY`` and ``register_all()`` (``AutoConfig`` and the ``AutoModel*`` classes),
* ``peft_support``'s default LoRA / IA3 target modules,
* the names ``hf_xformers`` exports (and ``__all__``), and each architecture package's ``__all__``,
* the Auto-class ``auto_map`` of self-contained Hub exports (``export.py``, through ``REGISTRY``).

The module holds no torch and no model code: a declaration names classes, it does not build them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# peft's defaults for BERT / RoBERTa, which every architecture that keeps BERT's module names inherits.
BERT_LORA_TARGETS: tuple[str, ...] = ("query", "value")
BERT_IA3_TARGETS: tuple[str, ...] = ("key", "value", "output.dense")
BERT_IA3_FEEDFORWARD: tuple[str, ...] = ("output.dense",)


@dataclass(frozen=True)
class Architecture:
    """One architecture's facts.

    Args:
        config_class: its ``PreTrainedConfig`` subclass; ``config_class.model_type`` (``"hfx-<arch>"``) is the model
            type it is registered under.
        auto_classes: ``{transformers Auto class name: our class}``, e.g. ``{"AutoModel": HfxLongformerModel,
            "AutoModelForMaskedLM": ...}``; ``"AutoImageProcessor"`` registers an image processor.
        lora_target_modules: default LoRA ``target_modules`` (suffixes of module names). Defaults to peft's choice
            for BERT, the query and value projections, under BERT's names (``query``, ``value``).
        ia3_target_modules: default IA3 ``target_modules`` (BERT's: keys, values, the feed-forward output).
        ia3_feedforward_modules: the feed-forward ones among them (peft requires a subset of ``ia3_target_modules``).
        other_exports: further public classes (caches, outputs, the ``PreTrainedModel`` base, trainers ...).

    Raises:
        ValueError: a model type outside the ``hfx-`` namespace, no ``AutoModel`` entry, or IA3 feed-forward modules
            that are not IA3 targets.
    """

    config_class: type
    auto_classes: Mapping[str, type]
    lora_target_modules: tuple[str, ...] = BERT_LORA_TARGETS
    ia3_target_modules: tuple[str, ...] = BERT_IA3_TARGETS
    ia3_feedforward_modules: tuple[str, ...] = BERT_IA3_FEEDFORWARD
    other_exports: tuple[type, ...] = field(default=())

    def __post_init__(self) -> None:
        if not str(getattr(self.config_class, "model_type", "")).startswith("hfx-"):
            raise ValueError(
                f"{self.config_class.__name__}.model_type must start with 'hfx-' (ours never collide with transformers' "
                f"own types), got {getattr(self.config_class, 'model_type', None)!r}."
            )
        if "AutoModel" not in self.auto_classes:
            raise ValueError(f"{self.model_type}: declare its base model under auto_classes['AutoModel'].")
        if not set(self.ia3_feedforward_modules) <= set(self.ia3_target_modules):
            raise ValueError(f"{self.model_type}: ia3_feedforward_modules must be a subset of ia3_target_modules.")

    @property
    def model_type(self) -> str:
        """``"hfx-<arch>"``, read from the config class."""
        return self.config_class.model_type

    @property
    def exports(self) -> dict[str, type]:
        """``{name: class}`` of everything public: the config, the Auto classes, then :attr:`other_exports`."""
        classes = [self.config_class, *self.auto_classes.values(), *self.other_exports]
        return {cls.__name__: cls for cls in classes}


__all__ = ["Architecture"]
