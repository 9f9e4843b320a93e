"""hf_xformers: efficient and long-context Transformers for the Hugging Face ecosystem.

Importing the package registers every architecture with ``AutoConfig`` and the ``AutoModel*`` classes.
"""

from .models.longformer import (
    HfxLongformerConfig,
    HfxLongformerForMaskedLM,
    HfxLongformerForMultipleChoice,
    HfxLongformerForQuestionAnswering,
    HfxLongformerForSequenceClassification,
    HfxLongformerForTokenClassification,
    HfxLongformerModel,
)
from .registration import REGISTRY, register_all

register_all()

__version__ = "0.1.0"

__all__ = [
    "REGISTRY",
    "register_all",
    "HfxLongformerConfig",
    "HfxLongformerModel",
    "HfxLongformerForMaskedLM",
    "HfxLongformerForSequenceClassification",
    "HfxLongformerForMultipleChoice",
    "HfxLongformerForQuestionAnswering",
    "HfxLongformerForTokenClassification",
]
