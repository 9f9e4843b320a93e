"""The table that tells ``transformers``' Auto classes about our architectures, built from their declarations.

:data:`REGISTRY` maps each ``model_type`` to ``(config class, {Auto class name: model class})``, read from every
``models/<arch>/__init__.py``'s ``ARCHITECTURE`` (:class:`~hf_xformers.configs.architecture.Architecture`).
``register_all()`` runs on ``import hf_xformers``; registering twice is harmless.
"""

from __future__ import annotations

import transformers
from transformers import AutoConfig

from .models import ARCHITECTURES

REGISTRY: dict[str, tuple[type, dict[str, type]]] = {
    arch.model_type: (arch.config_class, dict(arch.auto_classes)) for arch in ARCHITECTURES
}


def register_all() -> None:
    """Register every config with ``AutoConfig`` and every model with its ``AutoModel*`` class."""
    for model_type, (config_class, heads) in REGISTRY.items():
        AutoConfig.register(model_type, config_class, exist_ok=True)
        for auto_name, model_class in heads.items():
            getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
