"""``hfx-swin``: the Swin Transformer (Liu et al., 2021): shifted-window attention in a four-stage hierarchy."""

from ...configs.architecture import Architecture
from .configuration_swin import HfxSwinConfig
from .image_processing_swin import HfxSwinImageProcessor
from .modeling_swin import (
    HfxSwinBackbone,
    HfxSwinForImageClassification,
    HfxSwinForMaskedImageModeling,
    HfxSwinModel,
    HfxSwinPreTrainedModel,
)

ARCHITECTURE = Architecture(
    config_class=HfxSwinConfig,
    auto_classes={
        "AutoModel": HfxSwinModel,
        "AutoModelForImageClassification": HfxSwinForImageClassification,
        "AutoModelForMaskedImageModeling": HfxSwinForMaskedImageModeling,
        "AutoBackbone": HfxSwinBackbone,
        # AutoImageProcessor.register(config, cls) files cls under the "pil" backend.
        "AutoImageProcessor": HfxSwinImageProcessor,
    },
    other_exports=(HfxSwinPreTrainedModel,),
)

__all__ = ["ARCHITECTURE", *ARCHITECTURE.exports]
