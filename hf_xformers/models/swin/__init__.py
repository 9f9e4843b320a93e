from .configuration_swin import HfxSwinConfig
from .image_processing_swin import HfxSwinImageProcessor
from .modeling_swin import (
    HfxSwinBackbone,
    HfxSwinForImageClassification,
    HfxSwinForMaskedImageModeling,
    HfxSwinModel,
    HfxSwinPreTrainedModel,
)

__all__ = [
    "HfxSwinConfig",
    "HfxSwinImageProcessor",
    "HfxSwinModel",
    "HfxSwinPreTrainedModel",
    "HfxSwinForImageClassification",
    "HfxSwinForMaskedImageModeling",
    "HfxSwinBackbone",
]
