"""``hfx-linformer``: RoBERTa with Linformer's low-rank attention (Wang et al., 2020): keys and values projected along
the sequence."""

from ...configs.architecture import Architecture
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

ARCHITECTURE = Architecture(
    config_class=HfxLinformerConfig,
    auto_classes={
        "AutoModel": HfxLinformerModel,
        "AutoModelForMaskedLM": HfxLinformerForMaskedLM,
        "AutoModelForSequenceClassification": HfxLinformerForSequenceClassification,
        "AutoModelForMultipleChoice": HfxLinformerForMultipleChoice,
        "AutoModelForQuestionAnswering": HfxLinformerForQuestionAnswering,
        "AutoModelForTokenClassification": HfxLinformerForTokenClassification,
    },
    other_exports=(HfxLinformerPreTrainedModel,),
)

__all__ = ["ARCHITECTURE", *ARCHITECTURE.exports]
