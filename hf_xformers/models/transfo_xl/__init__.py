from .configuration_transfo_xl import HfxTransfoXLConfig
from .modeling_transfo_xl import (
    HfxTransfoXLCausalLMOutput,
    HfxTransfoXLForCausalLM,
    HfxTransfoXLForSequenceClassification,
    HfxTransfoXLModel,
    HfxTransfoXLModelOutput,
    HfxTransfoXLPreTrainedModel,
)
from .training_transfo_xl import HfxRecurrentTrainer, HfxStreamSegments

__all__ = [
    "HfxTransfoXLConfig",
    "HfxTransfoXLModel",
    "HfxTransfoXLPreTrainedModel",
    "HfxTransfoXLForCausalLM",
    "HfxTransfoXLForSequenceClassification",
    "HfxTransfoXLModelOutput",
    "HfxTransfoXLCausalLMOutput",
    "HfxRecurrentTrainer",
    "HfxStreamSegments",
]
