"""hf_xformers: efficient and long-context Transformers for the Hugging Face ecosystem.

Importing the package registers every architecture with ``AutoConfig`` and the ``AutoModel*`` classes, and exports
the classes each architecture declares (``models/<arch>/__init__.py``: ``ARCHITECTURE``), e.g.
``from hf_xformers import HfxLongformerForSequenceClassification``.
"""

from .models import ARCHITECTURES
from .moved_modules import install_aliases
from .peft_support import register_with_peft
from .registration import REGISTRY, register_all

register_all()
# With peft installed, LoraConfig(task_type=...) then finds our attention projections without target_modules.
register_with_peft()
# Module paths of the earlier layout (hf_xformers.layers.act, ...) name the modules that hold that code now.
install_aliases()

__version__ = "0.1.0"

# Every architecture's public classes, from its declaration (no hand-kept list to forget a class in).
_EXPORTS: dict[str, type] = {name: cls for arch in ARCHITECTURES for name, cls in arch.exports.items()}
globals().update(_EXPORTS)

# The Hub tools load lazily (PEP 562): `python -m hf_xformers.export` would otherwise find its own module already
# imported by the package (a RuntimeWarning), and model code need not import huggingface_hub's card machinery.
_HUB_TOOLS = {"export_for_hub": "export", "write_model_card": "card"}
# Padding-free batches: the collator for Trainer, and packed inference over ragged documents.
_PACKING_TOOLS = {
    "DataCollatorForPackedDocuments": "padding_free",
    "pack_by_token_budget": "padding_free",
    "position_ids_start_for": "padding_free",
    "packing_refusal": "padding_free",
    "classify_documents": "packed_inference",
    "embed_documents": "packed_inference",
    # Sequence parallelism: the batches DeepSpeed's data-loader adapter takes, and a script's set-up.
    "DataCollatorForSequenceParallel": "sequence_parallel_data",
    "sequence_parallel_size": "sequence_parallel_data",
    "sequence_label_ids": "sequence_parallel_data",
    "setup_sequence_parallel": "sequence_parallel_data",
}


def __getattr__(name: str):
    if name in _HUB_TOOLS or name in _PACKING_TOOLS:
        import importlib

        module = _HUB_TOOLS.get(name) or _PACKING_TOOLS[name]
        return getattr(importlib.import_module(f".{module}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ARCHITECTURES",
    "REGISTRY",
    "register_all",
    "register_with_peft",
    "export_for_hub",
    "write_model_card",
    *_PACKING_TOOLS,
    *_EXPORTS,
]
