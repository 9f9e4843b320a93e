"""``hfx-performer``: RoBERTa with FAVOR+ attention (Choromanski et al., 2021), and a causal LM with a recurrent
cache."""

from ...configs.architecture import Architecture
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

ARCHITECTURE = Architecture(
    config_class=HfxPerformerConfig,
    auto_classes={
        "AutoModel": HfxPerformerModel,
        "AutoModelForMaskedLM": HfxPerformerForMaskedLM,
        "AutoModelForSequenceClassification": HfxPerformerForSequenceClassification,
        "AutoModelForMultipleChoice": HfxPerformerForMultipleChoice,
        "AutoModelForQuestionAnswering": HfxPerformerForQuestionAnswering,
        "AutoModelForTokenClassification": HfxPerformerForTokenClassification,
        "AutoModelForCausalLM": HfxPerformerForCausalLM,
    },
    other_exports=(HfxPerformerPreTrainedModel, HfxPerformerCache),
)

__all__ = ["ARCHITECTURE", *ARCHITECTURE.exports]
