"""``hfx-longformer``: RoBERTa with sliding-window + global attention (Beltagy et al., 2020).

The attention itself lives in ``hf_xformers/attention/sliding_window.py``; this file wires it into the shared
encoder and heads and chooses the default global tokens of each task (the paper's recipe).
"""

from __future__ import annotations

import torch

from ...attention.sliding_window import HfxSlidingWindowSelfAttention
from ...layers.heads import (
    HfxMaskedLMHeadMixin,
    HfxMultipleChoiceHeadMixin,
    HfxQuestionAnsweringHeadMixin,
    HfxSequenceClassificationHeadMixin,
    HfxTokenClassificationHeadMixin,
)
from ...layers.text_model import HfxPreTrainedModel, HfxTextModel
from .configuration_longformer import HfxLongformerConfig


class HfxLongformerPreTrainedModel(HfxPreTrainedModel):
    config_class = HfxLongformerConfig
    base_model_prefix = "longformer"
    _no_split_modules = ["HfxEncoderLayer"]

    def default_global_attention_mask(self, task, input_ids, attention_mask):
        """``<s>`` is global for sentence-level tasks (classification, multiple choice); for question
        answering, the question (every token before the first ``sep_token_id``). None otherwise."""
        if input_ids is None or task in ("masked_lm", "token_classification"):
            return None
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        if task == "question_answering":
            is_sep = input_ids == self.config.sep_token_id
            if not bool(is_sep.any(-1).all()):
                raise ValueError(
                    "Question answering puts global attention on the question, the tokens before the first "
                    f"separator (sep_token_id={self.config.sep_token_id}), but some inputs have none; encode "
                    "(question, context) pairs with the tokenizer or pass `global_attention_mask`."
                )
            first_sep = is_sep.int().argmax(-1, keepdim=True)
            return torch.arange(input_ids.shape[1], device=input_ids.device)[None] < first_sep
        mask[:, 0] = True
        return mask


class HfxLongformerModel(HfxTextModel, HfxLongformerPreTrainedModel):
    """Longformer encoder. See :class:`~hf_xformers.layers.text_model.HfxTextModel` for inputs and outputs.

    Inputs of any length up to the position table work: each layer pads internally to its block size and
    cuts the result back, so no caller-side padding to the window is needed.
    """

    attention_class = HfxSlidingWindowSelfAttention


class HfxLongformerForMaskedLM(HfxMaskedLMHeadMixin, HfxLongformerPreTrainedModel):
    base_model_class = HfxLongformerModel
    _tied_weights_keys = {"lm_head.decoder.weight": "longformer.embeddings.word_embeddings.weight"}


class HfxLongformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxLongformerPreTrainedModel):
    base_model_class = HfxLongformerModel


class HfxLongformerForMultipleChoice(HfxMultipleChoiceHeadMixin, HfxLongformerPreTrainedModel):
    base_model_class = HfxLongformerModel


class HfxLongformerForQuestionAnswering(HfxQuestionAnsweringHeadMixin, HfxLongformerPreTrainedModel):
    base_model_class = HfxLongformerModel


class HfxLongformerForTokenClassification(HfxTokenClassificationHeadMixin, HfxLongformerPreTrainedModel):
    base_model_class = HfxLongformerModel


__all__ = [
    "HfxLongformerPreTrainedModel",
    "HfxLongformerModel",
    "HfxLongformerForMaskedLM",
    "HfxLongformerForSequenceClassification",
    "HfxLongformerForMultipleChoice",
    "HfxLongformerForQuestionAnswering",
    "HfxLongformerForTokenClassification",
]
