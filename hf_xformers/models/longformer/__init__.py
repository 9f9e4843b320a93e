from .configuration_longformer import HfxLongformerConfig
from .modeling_longformer import (
    HfxLongformerForMaskedLM,
    HfxLongformerForMultipleChoice,
    HfxLongformerForQuestionAnswering,
    HfxLongformerForSequenceClassification,
    HfxLongformerForTokenClassification,
    HfxLongformerModel,
    HfxLongformerPreTrainedModel,
)

__all__ = [
    "HfxLongformerConfig",
    "HfxLongformerModel",
    "HfxLongformerPreTrainedModel",
    "HfxLongformerForMaskedLM",
    "HfxLongformerForSequenceClassification",
    "HfxLongformerForMultipleChoice",
    "HfxLongformerForQuestionAnswering",
    "HfxLongformerForTokenClassification",
]
