"""``hfx-bigbird``: RoBERTa with BigBird's block-sparse attention (Zaheer et al., 2020): window, global and random
blocks."""

from ...configs.architecture import Architecture
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

ARCHITECTURE = Architecture(
    config_class=HfxBigBirdConfig,
    auto_classes={
        "AutoModel": HfxBigBirdModel,
        "AutoModelForMaskedLM": HfxBigBirdForMaskedLM,
        "AutoModelForSequenceClassification": HfxBigBirdForSequenceClassification,
        "AutoModelForMultipleChoice": HfxBigBirdForMultipleChoice,
        "AutoModelForQuestionAnswering": HfxBigBirdForQuestionAnswering,
        "AutoModelForTokenClassification": HfxBigBirdForTokenClassification,
    },
    other_exports=(HfxBigBirdPreTrainedModel, HfxBigBirdEmbeddings, HfxBigBirdLMHead),
)

__all__ = ["ARCHITECTURE", *ARCHITECTURE.exports]
