"""Old module paths that users may import, kept working after the layout of issue 29 (floors that import one way).

Each old dotted path becomes another name of the module that now holds its code (the same module object in
``sys.modules``, not a copy), so ``from hf_xformers.layers.act import ponder_loss`` and ``import
hf_xformers.layers.recurrent_block`` keep working without a shim file on a floor that would have to import upwards.
``import hf_xformers`` calls :func:`install_aliases`.
"""

from __future__ import annotations

import importlib
import sys

# old path (below the package) -> where the module lives now
MOVED_MODULES: dict[str, str] = {
    "layers.precision": "ops.precision",
    "layers.input_checks": "ops.input_checks",
    "layers.fast_dropout": "ops.fast_dropout",
    "layers.compat": "ops.compat",
    "attention.kernels": "ops.kernels",
    "layers.text_config": "configs.text_config",
    "layers.act": "models.universal.adaptive_computation_time",
    "layers.recurrent_block": "models.universal.recurrent_block",
    "layers.adaptive": "models.transfo_xl.adaptive_softmax",
    "layers.reversible": "models.reformer.reversible",
}


def install_aliases(package: str = __name__.rpartition(".")[0]) -> None:
    """Make every old path in :data:`MOVED_MODULES` name its new module (in ``sys.modules`` and as an attribute of
    the old parent package). Idempotent."""
    for old, new in MOVED_MODULES.items():
        module = importlib.import_module(f"{package}.{new}")
        sys.modules[f"{package}.{old}"] = module
        parent, _, name = old.rpartition(".")
        setattr(importlib.import_module(f"{package}.{parent}"), name, module)


__all__ = ["MOVED_MODULES", "install_aliases"]
