"""``hfx-reformer``: the Reformer (Kitaev et al., 2020): LSH and local attention in a reversible stack, axial
positions, a causal LM with a bucket cache."""

from ...configs.architecture import Architecture
from .configuration_reformer import HfxReformerConfig
from .modeling_reformer import (
    HfxReformerCache,
    HfxReformerForCausalLM,
    HfxReformerForMaskedLM,
    HfxReformerForQuestionAnswering,
    HfxReformerForSequenceClassification,
    HfxReformerModel,
    HfxReformerPreTrainedModel,
)

ARCHITECTURE = Architecture(
    config_class=HfxReformerConfig,
    auto_classes={
        "AutoModel": HfxReformerModel,
        "AutoModelForCausalLM": HfxReformerForCausalLM,
        "AutoModelForMaskedLM": HfxReformerForMaskedLM,
        "AutoModelForSequenceClassification": HfxReformerForSequenceClassification,
        "AutoModelForQuestionAnswering": HfxReformerForQuestionAnswering,
    },
    # LSH layers share one projection for queries and keys (query_key); local layers have query, key and value.
    lora_target_modules=("query_key", "query", "value"),
    ia3_target_modules=("query_key", "key", "value", "feed_forward.output.dense"),
    ia3_feedforward_modules=("feed_forward.output.dense",),
    other_exports=(HfxReformerPreTrainedModel, HfxReformerCache),
)

__all__ = ["ARCHITECTURE", *ARCHITECTURE.exports]
