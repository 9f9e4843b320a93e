"""hf_xformers: efficient and long-context Transformers for the Hugging Face ecosystem.

Importing the package registers every architecture with ``AutoConfig`` and the ``AutoModel*`` classes.
"""

from .models.bigbird import (
    HfxBigBirdConfig,
    HfxBigBirdForMaskedLM,
    HfxBigBirdForMultipleChoice,
    HfxBigBirdForQuestionAnswering,
    HfxBigBirdForSequenceClassification,
    HfxBigBirdForTokenClassification,
    HfxBigBirdModel,
)
from .models.linformer import (
    HfxLinformerConfig,
    HfxLinformerForMaskedLM,
    HfxLinformerForMultipleChoice,
    HfxLinformerForQuestionAnswering,
    HfxLinformerForSequenceClassification,
    HfxLinformerForTokenClassification,
    HfxLinformerModel,
)
from .models.longformer import (
    HfxLongformerConfig,
    HfxLongformerForMaskedLM,
    HfxLongformerForMultipleChoice,
    HfxLongformerForQuestionAnswering,
    HfxLongformerForSequenceClassification,
    HfxLongformerForTokenClassification,
    HfxLongformerModel,
)
from .models.performer import (
    HfxPerformerCache,
    HfxPerformerConfig,
    HfxPerformerForCausalLM,
    HfxPerformerForMaskedLM,
    HfxPerformerForMultipleChoice,
    HfxPerformerForQuestionAnswering,
    HfxPerformerForSequenceClassification,
    HfxPerformerForTokenClassification,
    HfxPerformerModel,
)
from .models.reformer import (
    HfxReformerCache,
    HfxReformerConfig,
    HfxReformerForCausalLM,
    HfxReformerForMaskedLM,
    HfxReformerForQuestionAnswering,
    HfxReformerForSequenceClassification,
    HfxReformerModel,
)
from .models.swin import (
    HfxSwinBackbone,
    HfxSwinConfig,
    HfxSwinForImageClassification,
    HfxSwinForMaskedImageModeling,
    HfxSwinImageProcessor,
    HfxSwinModel,
)
from .models.transfo_xl import (
    HfxRecurrentTrainer,
    HfxStreamSegments,
    HfxTransfoXLConfig,
    HfxTransfoXLForCausalLM,
    HfxTransfoXLForSequenceClassification,
    HfxTransfoXLModel,
)
from .models.universal import (
    HfxUniversalConfig,
    HfxUniversalForCausalLM,
    HfxUniversalForMaskedLM,
    HfxUniversalForSeq2SeqLM,
    HfxUniversalForSequenceClassification,
    HfxUniversalForTokenClassification,
    HfxUniversalModel,
)
from .peft_support import register_with_peft
from .registration import REGISTRY, register_all

register_all()
# With peft installed, LoraConfig(task_type=...) then finds our attention projections without target_modules.
register_with_peft()

__version__ = "0.1.0"

# The Hub tools load lazily (PEP 562): `python -m hf_xformers.export` would otherwise find its own module already
# imported by the package (a RuntimeWarning), and model code need not import huggingface_hub's card machinery.
_HUB_TOOLS = {"export_for_hub": "export", "write_model_card": "card"}


def __getattr__(name: str):
    if name in _HUB_TOOLS:
        import importlib

        return getattr(importlib.import_module(f".{_HUB_TOOLS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REGISTRY",
    "register_all",
    "register_with_peft",
    "export_for_hub",
    "write_model_card",
    "HfxBigBirdConfig",
    "HfxBigBirdModel",
    "HfxBigBirdForMaskedLM",
    "HfxBigBirdForSequenceClassification",
    "HfxBigBirdForMultipleChoice",
    "HfxBigBirdForQuestionAnswering",
    "HfxBigBirdForTokenClassification",
    "HfxLongformerConfig",
    "HfxLongformerModel",
    "HfxLongformerForMaskedLM",
    "HfxLongformerForSequenceClassification",
    "HfxLongformerForMultipleChoice",
    "HfxLongformerForQuestionAnswering",
    "HfxLongformerForTokenClassification",
    "HfxSwinConfig",
    "HfxSwinImageProcessor",
    "HfxSwinModel",
    "HfxSwinForImageClassification",
    "HfxSwinForMaskedImageModeling",
    "HfxSwinBackbone",
    "HfxLinformerConfig",
    "HfxLinformerForMaskedLM",
    "HfxLinformerForMultipleChoice",
    "HfxLinformerForQuestionAnswering",
    "HfxLinformerForSequenceClassification",
    "HfxLinformerForTokenClassification",
    "HfxLinformerModel",
    "HfxPerformerCache",
    "HfxPerformerConfig",
    "HfxPerformerForCausalLM",
    "HfxPerformerForMaskedLM",
    "HfxPerformerForMultipleChoice",
    "HfxPerformerForQuestionAnswering",
    "HfxPerformerForSequenceClassification",
    "HfxPerformerForTokenClassification",
    "HfxPerformerModel",
    "HfxReformerCache",
    "HfxReformerConfig",
    "HfxReformerModel",
    "HfxReformerForCausalLM",
    "HfxReformerForMaskedLM",
    "HfxReformerForSequenceClassification",
    "HfxReformerForQuestionAnswering",
    "HfxTransfoXLConfig",
    "HfxTransfoXLModel",
    "HfxTransfoXLForCausalLM",
    "HfxTransfoXLForSequenceClassification",
    "HfxRecurrentTrainer",
    "HfxStreamSegments",
    "HfxUniversalConfig",
    "HfxUniversalModel",
    "HfxUniversalForMaskedLM",
    "HfxUniversalForSequenceClassification",
    "HfxUniversalForTokenClassification",
    "HfxUniversalForCausalLM",
    "HfxUniversalForSeq2SeqLM",
]
