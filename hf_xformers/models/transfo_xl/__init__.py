"""``hfx-transfo-xl``: Transformer-XL (Dai et al., 2019): segment-level recurrence with relative positions, adaptive
input embeddings and adaptive softmax."""

from ...configs.architecture import Architecture
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

ARCHITECTURE = Architecture(
    config_class=HfxTransfoXLConfig,
    auto_classes={
        "AutoModel": HfxTransfoXLModel,
        "AutoModelForCausalLM": HfxTransfoXLForCausalLM,
        "AutoModelForSequenceClassification": HfxTransfoXLForSequenceClassification,
    },
    # One fused projection makes queries, keys and values (as GPT-2's c_attn, which peft targets whole).
    lora_target_modules=("qkv_net",),
    ia3_target_modules=("qkv_net", "ff_out"),
    ia3_feedforward_modules=("ff_out",),
    other_exports=(
        HfxTransfoXLPreTrainedModel,
        HfxTransfoXLModelOutput,
        HfxTransfoXLCausalLMOutput,
        HfxRecurrentTrainer,
        HfxStreamSegments,
    ),
)

__all__ = ["ARCHITECTURE", *ARCHITECTURE.exports]
