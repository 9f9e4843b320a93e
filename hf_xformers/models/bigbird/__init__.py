from .configuration_bigbird import HfxBigBirdConfig
from .modeling_bigbird import (
    HfxBigBirdEmbeddings,
    HfxBigBirdForMaskedLM,
    HfxBigBirdForMultipleChoice,
    HfxBigBirdForQuestionAnswering,
    HfxBigBirdForSequenceClassification,
    HfxBigBirdForTokenClassification,
    HfxBigBirdLMHead,
    HfxBigBirdModel,
    HfxBigBirdPreTrainedModel,
)

__all__ = [
    "HfxBigBirdConfig",
    "HfxBigBirdEmbeddings",
    "HfxBigBirdLMHead",
    "HfxBigBirdModel",
    "HfxBigBirdPreTrainedModel",
    "HfxBigBirdForMaskedLM",
    "HfxBigBirdForSequenceClassification",
    "HfxBigBirdForMultipleChoice",
    "HfxBigBirdForQuestionAnswering",
    "HfxBigBirdForTokenClassification",
]
