"""``hfx-linformer``: RoBERTa with Linformer attention (Wang et al., 2020).

The attention lives in ``hf_xformers/attention/low_rank.py``; this file wires it into the shared encoder and heads.
With ``linformer_sharing="layerwise"`` the base model owns the one projection matrix (``shared_kv_projection``) and
hands it to every layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init

from ...attention.low_rank import HfxLowRankSelfAttention, HfxSequenceProjection, linformer_max_length
from ...layers.heads import (
    HfxMaskedLMHeadMixin,
    HfxMultipleChoiceHeadMixin,
    HfxQuestionAnsweringHeadMixin,
    HfxSequenceClassificationHeadMixin,
    HfxTokenClassificationHeadMixin,
)
from ...layers.pretrained import HfxPreTrainedModel
from ...layers.text_model import HfxTextModel
from ...ops.input_checks import is_tracing
from .configuration_linformer import HfxLinformerConfig


class HfxLinformerPreTrainedModel(HfxPreTrainedModel):
    config_class = HfxLinformerConfig
    base_model_prefix = "linformer"
    _no_split_modules = ["HfxEncoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxSequenceProjection):
            # transformers' init helpers skip tensors already loaded from a checkpoint.
            init.uniform_(module.weight, -module.init_bound, module.init_bound)


class HfxLinformerModel(HfxTextModel, HfxLinformerPreTrainedModel):
    """Linformer encoder. See :class:`~hf_xformers.layers.text_model.HfxTextModel` for inputs and outputs.

    Inputs may be up to ``max_position_embeddings - pad_token_id - 1`` tokens long (the rows of the projections).
    """

    attention_class = HfxLowRankSelfAttention
    packing_refusal = (
        "its keys and values are projected along the whole sequence (E K, F V), so every output mixes every "
        "document of the row",
        'Pad the batch instead (DataCollatorWithPadding; TrainingArguments(train_sampling_strategy="group_by_length") '
        "keeps the padding small).",
    )

    def prepare_attention_inputs(self, attention_mask, global_attention_mask, length, document_ids=None):
        """As :meth:`HfxTextModel.prepare_attention_inputs`, plus each layer's mask of supported projected positions
        (``projection_support``, None for a layer where all are): deciding whether a layer needs one reads a value
        back to the host, so it is done here for all layers at once."""
        attention_mask, global_attention_mask, kwargs = super().prepare_attention_inputs(
            attention_mask, global_attention_mask, length, document_ids
        )
        projections = [w for layer in self.encoder.layer for w in layer.attention.self.projections()]
        if any(type(w.data) is not torch.Tensor for w in projections):
            # Weights that are not materialised before their layer runs (FSDP's sharded DTensors, offloaded weights):
            # each layer works its mask out itself, inside its forward, where the weights are whole.
            return attention_mask, global_attention_mask, kwargs
        supports = [layer.attention.self.support_mask(attention_mask, length) for layer in self.encoder.layer]
        if not is_tracing():
            complete = torch.stack([s.all() for s in supports]).tolist()  # one host read for every layer
            supports = [None if full else s for s, full in zip(supports, complete)]
        kwargs["projection_support"] = tuple(supports)
        return attention_mask, global_attention_mask, kwargs

    def attention_factory(self, config) -> Callable[..., nn.Module]:
        if config.linformer_sharing != "layerwise":
            return self.attention_class
        self.shared_kv_projection = HfxSequenceProjection(linformer_max_length(config), config.linformer_k)
        return functools.partial(self.attention_class, shared_projection=self.shared_kv_projection)


class HfxLinformerForMaskedLM(HfxMaskedLMHeadMixin, HfxLinformerPreTrainedModel):
    base_model_class = HfxLinformerModel
    _tied_weights_keys = {"lm_head.decoder.weight": "linformer.embeddings.word_embeddings.weight"}


class HfxLinformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxLinformerPreTrainedModel):
    base_model_class = HfxLinformerModel


class HfxLinformerForMultipleChoice(HfxMultipleChoiceHeadMixin, HfxLinformerPreTrainedModel):
    base_model_class = HfxLinformerModel


class HfxLinformerForQuestionAnswering(HfxQuestionAnsweringHeadMixin, HfxLinformerPreTrainedModel):
    base_model_class = HfxLinformerModel


class HfxLinformerForTokenClassification(HfxTokenClassificationHeadMixin, HfxLinformerPreTrainedModel):
    base_model_class = HfxLinformerModel
