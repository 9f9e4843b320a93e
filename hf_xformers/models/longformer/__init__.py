"""``hfx-longformer``: RoBERTa with sliding-window + global attention (Beltagy et al., 2020)."""

from ...configs.architecture import Architecture
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

ARCHITECTURE = Architecture(
    config_class=HfxLongformerConfig,
    auto_classes={
        "AutoModel": HfxLongformerModel,
        "AutoModelForMaskedLM": HfxLongformerForMaskedLM,
        "AutoModelForSequenceClassification": HfxLongformerForSequenceClassification,
        "AutoModelForMultipleChoice": HfxLongformerForMultipleChoice,
        "AutoModelForQuestionAnswering": HfxLongformerForQuestionAnswering,
        "AutoModelForTokenClassification": HfxLongformerForTokenClassification,
    },
    # Global tokens have their own projections; a classification head reads the (global) first token, so they adapt too.
    lora_target_modules=("query", "value", "query_global", "value_global"),
    ia3_target_modules=("key", "value", "key_global", "value_global", "output.dense"),
    ia3_feedforward_modules=("output.dense",),
    other_exports=(HfxLongformerPreTrainedModel,),
)

__all__ = ["ARCHITECTURE", *ARCHITECTURE.exports]
