from .configuration_performer import HfxPerformerConfig
from .modeling_performer import (
    HfxPerformerCache,
    HfxPerformerForCausalLM,
    HfxPerformerForMaskedLM,
    HfxPerformerForMultipleChoice,
    HfxPerformerForQuestionAnswering,
    HfxPerformerForSequenceClassification,
    HfxPerformerForTokenClassification,
    HfxPerformerModel,
    HfxPerformerPreTrainedModel,
)

__all__ = [
    "HfxPerformerConfig",
    "HfxPerformerModel",
    "HfxPerformerPreTrainedModel",
    "HfxPerformerForMaskedLM",
    "HfxPerformerForSequenceClassification",
    "HfxPerformerForMultipleChoice",
    "HfxPerformerForQuestionAnswering",
    "HfxPerformerForTokenClassification",
    "HfxPerformerForCausalLM",
    "HfxPerformerCache",
]
