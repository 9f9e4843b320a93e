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
    sequence_parallel_refusal = None  # Ulysses: each rank runs the whole sequence on heads / sp_size heads
    _no_split_modules = ["HfxEncoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxSequenceProjection):
            # transformers' init helpers skip tensors already loaded from a checkpoint.
            init.uniform_(module.weight, -module.init_bound, module.init_bound)


class HfxLinformerModel(HfxTextModel, HfxLinformerPreTrainedModel):
    """Linformer encoder: RoBERTa's embeddings and layers with keys and values projected along the sequence to
    ``linformer_k`` rows, and a pooler (``add_pooling_layer``). Its inputs and outputs: ``forward``.

    Inputs may be up to ``max_position_embeddings - pad_token_id - 1`` tokens long (the rows of the projections).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLinformerConfig, HfxLinformerModel
        >>> config = HfxLinformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, linformer_k=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxLinformerModel(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> attention_mask = torch.ones(2, 40, dtype=torch.long)
        >>> attention_mask[1, 30:] = 0  # the second sequence: 30 tokens, then padding
        >>> out = model(input_ids, attention_mask=attention_mask)
        >>> out.last_hidden_state.shape, out.pooler_output.shape
        (torch.Size([2, 40, 32]), torch.Size([2, 32]))
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
    """Linformer with a masked-language-modelling head, its decoder tied to the input embeddings.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLinformerConfig, HfxLinformerForMaskedLM
        >>> config = HfxLinformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, linformer_k=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxLinformerForMaskedLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> labels = torch.full_like(input_ids, -100)  # -100: no loss
        >>> labels[:, 7] = input_ids[:, 7]
        >>> input_ids[:, 7] = 4  # <mask> in RoBERTa's vocabulary
        >>> out = model(input_ids, labels=labels)
        >>> out.logits.shape, out.loss.dim()
        (torch.Size([2, 40, 100]), 0)
    """

    base_model_class = HfxLinformerModel
    _tied_weights_keys = {"lm_head.decoder.weight": "linformer.embeddings.word_embeddings.weight"}


class HfxLinformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxLinformerPreTrainedModel):
    """Linformer with a classification or regression head on the first token (``<s>``), or on the mean of the tokens
    with ``config.classifier_pooling = "mean"``; the loss follows ``config.problem_type``. Packed batches are refused:
    the projections mix every document of a row.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLinformerConfig
        >>> from hf_xformers import HfxLinformerForSequenceClassification
        >>> config = HfxLinformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, linformer_k=16,
        ...     max_position_embeddings=66, num_labels=3,
        ... )
        >>> model = HfxLinformerForSequenceClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> model(input_ids, labels=torch.tensor([0, 2])).logits.shape
        torch.Size([2, 3])
    """

    base_model_class = HfxLinformerModel


class HfxLinformerForMultipleChoice(HfxMultipleChoiceHeadMixin, HfxLinformerPreTrainedModel):
    """Linformer for multiple choice: every (context, choice) pair of ``(batch, num_choices, seq_len)`` inputs is scored
    from its pooled first token.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLinformerConfig, HfxLinformerForMultipleChoice
        >>> config = HfxLinformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, linformer_k=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxLinformerForMultipleChoice(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 4, 24))  # 2 examples, 4 choices
        >>> input_ids[..., 16:18] = config.sep_token_id  # context </s></s> choice
        >>> model(input_ids, labels=torch.tensor([3, 0])).logits.shape
        torch.Size([2, 4])
    """

    base_model_class = HfxLinformerModel


class HfxLinformerForQuestionAnswering(HfxQuestionAnsweringHeadMixin, HfxLinformerPreTrainedModel):
    """Linformer for extractive question answering: a start and an end logit for every token.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLinformerConfig
        >>> from hf_xformers import HfxLinformerForQuestionAnswering
        >>> config = HfxLinformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, linformer_k=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxLinformerForQuestionAnswering(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> input_ids[:, 6:8] = config.sep_token_id  # question </s></s> context
        >>> start, end = torch.tensor([12, 20]), torch.tensor([14, 25])
        >>> out = model(input_ids, start_positions=start, end_positions=end)
        >>> out.start_logits.shape, out.end_logits.shape
        (torch.Size([2, 40]), torch.Size([2, 40]))
    """

    base_model_class = HfxLinformerModel


class HfxLinformerForTokenClassification(HfxTokenClassificationHeadMixin, HfxLinformerPreTrainedModel):
    """Linformer with a per-token classification head (named entities, parts of speech).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLinformerConfig
        >>> from hf_xformers import HfxLinformerForTokenClassification
        >>> config = HfxLinformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, linformer_k=16,
        ...     max_position_embeddings=66, num_labels=5,
        ... )
        >>> model = HfxLinformerForTokenClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> model(input_ids, labels=torch.randint(0, 5, (2, 40))).logits.shape
        torch.Size([2, 40, 5])
    """

    base_model_class = HfxLinformerModel
