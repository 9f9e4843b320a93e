"""Checkpoint conversion: the converters, importable from the installed package.

* :func:`convert_roberta_to_long` turns a short-context RoBERTa/BERT encoder into a long-context hf_xformers model
  (Longformer recipe: tiled position table, copied global projections); command line ``hfx-convert``.
* :func:`convert_from_transformers` imports a checkpoint of one of ``transformers``' own efficient architectures
  into the matching hf_xformers class; command line ``hfx-import``.

``from hf_xformers.conversion import convert_roberta_to_long`` gives the function. The modules that define them load
on first use (PEP 562): ``python -m hf_xformers.conversion.<name>`` would otherwise find its own module imported by
the package and run a second copy of it as ``__main__``. The repository's top-level ``conversion/`` keeps the old
import paths as thin wrappers of these modules.
"""

from __future__ import annotations

import importlib
import sys
import types

# Public name -> the module of this package that defines it.
_EXPORTS = {
    "convert_roberta_to_long": "convert_roberta_to_long",
    "copy_proj_layers": "convert_roberta_to_long",
    "TARGETS": "convert_roberta_to_long",
    "convert_from_transformers": "convert_from_transformers",
    "IMPORTERS": "convert_from_transformers",
}


class _ConversionPackage(types.ModuleType):
    """This package, whose exported functions keep their names after their modules are imported.

    Two functions share their module's name. Importing a submodule binds it as an attribute of its package, which
    would shadow the function for every later ``from hf_xformers.conversion import convert_roberta_to_long``; those
    bindings are skipped here (the modules stay reachable through ``sys.modules`` and ``import_module``).
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


sys.modules[__name__].__class__ = _ConversionPackage

__all__ = list(_EXPORTS)
