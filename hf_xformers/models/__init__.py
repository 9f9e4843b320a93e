"""The architectures, one package each (``models/<arch>/``), each declaring itself in its ``__init__.py`` as
``ARCHITECTURE`` (:class:`~hf_xformers.configs.architecture.Architecture`).

:data:`ARCHITECTURE_PACKAGES` is the one list of them: registration, the PEFT tables, the package's exports and the
Hub exports' ``auto_map`` are all built from :data:`ARCHITECTURES`. A new architecture is its folder plus one entry
here.
"""

from __future__ import annotations

import importlib

ARCHITECTURE_PACKAGES: tuple[str, ...] = (
    "longformer",
    "bigbird",
    "swin",
    "linformer",
    "performer",
    "reformer",
    "transfo_xl",
    "universal",
)

ARCHITECTURES = tuple(importlib.import_module(f".{name}", __name__).ARCHITECTURE for name in ARCHITECTURE_PACKAGES)

__all__ = ["ARCHITECTURES", "ARCHITECTURE_PACKAGES", *ARCHITECTURE_PACKAGES]
