"""Default PEFT target modules for our model types.

``peft`` fills in ``target_modules`` (LoRA and the methods that share its table) and ``target_modules`` /
``feedforward_modules`` (IA3) from tables keyed by ``config.model_type``, and knows only the model types of
``transformers``; for any other type ``get_peft_model`` asks for ``target_modules``. PEFT has no registration
function for these tables (its ``register_peft_method`` adds new methods, not model types), so
:func:`register_with_peft` adds our rows to them; ``import hf_xformers`` calls it, and it does nothing when peft is not
installed (hf_xformers does not depend on peft).

Names are suffixes of module names, as in peft's own rows. The defaults follow peft's choices for BERT / RoBERTa
(LoRA on the query and value projections; IA3 on keys, values and the feed-forward output), translated to each
architecture's own projection names, declared in its ``models/<arch>/__init__.py``.
"""

from __future__ import annotations

from .models import ARCHITECTURES

# LoRA: the query and value projections of every attention layer (each architecture's declaration says which).
LORA_TARGET_MODULES: dict[str, list[str]] = {a.model_type: list(a.lora_target_modules) for a in ARCHITECTURES}
# IA3: the modules whose activations get a learned scale; the feed-forward ones (scaled on their input) are listed
# again in IA3_FEEDFORWARD_MODULES, which peft requires to be a subset.
IA3_TARGET_MODULES: dict[str, list[str]] = {a.model_type: list(a.ia3_target_modules) for a in ARCHITECTURES}
IA3_FEEDFORWARD_MODULES: dict[str, list[str]] = {a.model_type: list(a.ia3_feedforward_modules) for a in ARCHITECTURES}

# peft's table name -> our rows. A table missing from the installed peft version is skipped.
_TABLES = {
    "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING": LORA_TARGET_MODULES,
    "TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING": IA3_TARGET_MODULES,
    "TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING": IA3_FEEDFORWARD_MODULES,
}


def register_with_peft() -> bool:
    """Add our model types to peft's default target-module tables, so that ``LoraConfig(task_type=...)`` and
    ``IA3Config(...)`` work without ``target_modules``. Registering twice is harmless.

    Returns:
        True if peft is installed (and the rows were added), False otherwise.
    """
    try:
        from peft.utils import constants
    except ImportError:
        return False
    for table_name, rows in _TABLES.items():
        table = getattr(constants, table_name, None)
        if table is None:
            continue
        # The tuners hold these very dict objects (LoraModel.target_module_mapping is the LoRA table), so updating
        # them in place is seen everywhere; copies made at peft's import (LoHa, LoKr, ...) keep peft's own rows.
        table.update({model_type: list(modules) for model_type, modules in rows.items()})
    return True
