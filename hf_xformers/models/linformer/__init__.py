from .configuration_linformer import HfxLinformerConfig
from .modeling_linformer import (
    HfxLinformerForMaskedLM,
    HfxLinformerForMultipleChoice,
    HfxLinformerForQuestionAnswering,
    HfxLinformerForSequenceClassification,
    HfxLinformerForTokenClassification,
    HfxLinformerModel,
    HfxLinformerPreTrainedModel,
)

__all__ = [
    "HfxLinformerConfig",
    "HfxLinformerModel",
    "HfxLinformerPreTrainedModel",
    "HfxLinformerForMaskedLM",
    "HfxLinformerForSequenceClassification",
    "HfxLinformerForMultipleChoice",
    "HfxLinformerForQuestionAnswering",
    "HfxLinformerForTokenClassification",
]
