"""``hfx-universal``: the Universal Transformer (Dehghani et al., 2019): one shared block applied in depth with
Adaptive Computation Time; encoder heads, a causal LM and an encoder-decoder LM."""

from ...configs.architecture import Architecture
from .configuration_universal import HfxUniversalConfig
from .modeling_universal import (
    HfxUniversalForCausalLM,
    HfxUniversalForMaskedLM,
    HfxUniversalForSeq2SeqLM,
    HfxUniversalForSequenceClassification,
    HfxUniversalForTokenClassification,
    HfxUniversalModel,
    HfxUniversalModelOutput,
    HfxUniversalPreTrainedModel,
)
from .recurrent_block import HfxUniversalCache

ARCHITECTURE = Architecture(
    config_class=HfxUniversalConfig,
    auto_classes={
        "AutoModel": HfxUniversalModel,
        "AutoModelForMaskedLM": HfxUniversalForMaskedLM,
        "AutoModelForSequenceClassification": HfxUniversalForSequenceClassification,
        "AutoModelForTokenClassification": HfxUniversalForTokenClassification,
        "AutoModelForCausalLM": HfxUniversalForCausalLM,
        "AutoModelForSeq2SeqLM": HfxUniversalForSeq2SeqLM,
    },
    # LoRA / IA3 targets: BERT's (the default): its adapters are shared across depth as the block's weights are.
    other_exports=(HfxUniversalPreTrainedModel, HfxUniversalModelOutput, HfxUniversalCache),
)

__all__ = ["ARCHITECTURE", *ARCHITECTURE.exports]
