"""``hfx-performer``: RoBERTa with FAVOR+ attention (Choromanski et al., 2021), plus a causal LM.

The attention lives in ``hf_xformers/attention/favor.py``; this file wires it into the shared encoder and heads, owns
the redraw schedule of the random projections, and adds ``HfxPerformerForCausalLM`` (causal FAVOR+ by prefix sums).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutput

from ...attention.favor import HfxFavorSelfAttention
from ...layers.encoder import HfxModelOutput
from ...layers.heads import (
    HfxLMHeadMixin,
    HfxMaskedLMHeadMixin,
    HfxMultipleChoiceHeadMixin,
    HfxQuestionAnsweringHeadMixin,
    HfxSequenceClassificationHeadMixin,
    HfxTokenClassificationHeadMixin,
    causal_lm_loss,
)
from ...layers.text_model import HfxPreTrainedModel, HfxTextModel
from .configuration_performer import HfxPerformerConfig


class HfxPerformerPreTrainedModel(HfxPreTrainedModel):
    config_class = HfxPerformerConfig
    base_model_prefix = "performer"
    _no_split_modules = ["HfxEncoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxFavorSelfAttention):
            # Draw 0 of the layer's seeded sequence; transformers' init helpers leave loaded buffers alone.
            init.copy_(module.projection_matrix, module.draw_projection_matrix(0))
            init.zeros_(module.num_redraws)

    @torch.no_grad()
    def redraw_projections(self) -> None:
        """Draw new random features in every layer (the next draw of each layer's seeded sequence).

        The only way, besides ``config.feature_redraw_interval`` in training mode, that the projections change.
        Draws are made on the CPU from their seeds (the same numbers on every device). For the layers on one device,
        the draw counters are read back in one transfer and the new projections are copied over in one transfer,
        rather than one synchronisation and one copy per layer.
        """
        groups: dict[tuple, list[HfxFavorSelfAttention]] = {}
        for module in self.modules():
            if isinstance(module, HfxFavorSelfAttention):
                key = (module.projection_matrix.device, module.projection_matrix.dtype, module.projection_matrix.shape)
                groups.setdefault(key, []).append(module)
        for (device, dtype, _), modules in groups.items():
            draws = [count + 1 for count in torch.stack([m.num_redraws for m in modules]).tolist()]
            fresh = torch.stack([m.draw_projection_matrix(d) for m, d in zip(modules, draws)]).to(device, dtype)
            for module, draw, rows in zip(modules, draws, fresh):
                module.redraw_projection(draw, rows)


class HfxPerformerModel(HfxTextModel, HfxPerformerPreTrainedModel):
    """Performer encoder. See :class:`~hf_xformers.layers.text_model.HfxTextModel` for inputs and outputs.

    With ``config.feature_redraw_interval = N``, forward calls in training mode number 0, 1, 2, ... and the
    projections are redrawn before calls N, 2N, ... (here, not inside the layers, so that gradient checkpointing,
    which reruns layer forwards, never sees a different projection in its recomputation). A redraw is the one thing
    in a forward that works on the CPU whatever the model's device: the new projections are drawn there from their
    seeds (reproducible, the same on every device) and copied to the model's device in one transfer per device.
    """

    attention_class = HfxFavorSelfAttention

    def __init__(self, config, add_pooling_layer: bool = True) -> None:
        super().__init__(config, add_pooling_layer)
        self.training_calls = 0

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> HfxModelOutput | tuple:
        """As :meth:`HfxTextModel.forward`, after the scheduled redraw of the projections (training mode)."""
        interval = self.config.feature_redraw_interval
        if self.training and interval:
            if self.training_calls and self.training_calls % interval == 0:
                self.redraw_projections()
            self.training_calls += 1
        return super().forward(
            input_ids, attention_mask, global_attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions, output_hidden_states, return_dict,
        )  # fmt: skip


class HfxPerformerForMaskedLM(HfxMaskedLMHeadMixin, HfxPerformerPreTrainedModel):
    base_model_class = HfxPerformerModel
    _tied_weights_keys = {"lm_head.decoder.weight": "performer.embeddings.word_embeddings.weight"}


class HfxPerformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxPerformerPreTrainedModel):
    base_model_class = HfxPerformerModel


class HfxPerformerForMultipleChoice(HfxMultipleChoiceHeadMixin, HfxPerformerPreTrainedModel):
    base_model_class = HfxPerformerModel


class HfxPerformerForQuestionAnswering(HfxQuestionAnsweringHeadMixin, HfxPerformerPreTrainedModel):
    base_model_class = HfxPerformerModel


class HfxPerformerForTokenClassification(HfxTokenClassificationHeadMixin, HfxPerformerPreTrainedModel):
    base_model_class = HfxPerformerModel


class HfxPerformerForCausalLM(HfxLMHeadMixin, HfxPerformerPreTrainedModel):
    """Left-to-right language model on causal FAVOR+ attention; the decoder is tied to the input embeddings.

    The model is always causal: a config with ``is_decoder=False`` is copied with ``is_decoder=True`` (the caller's
    config object is left as it is). ``labels`` ``(batch, seq_len)`` are the input ids themselves (-100 where no
    loss is wanted); they are shifted inside, as in transformers' causal LMs: the logits at position ``t``
    are scored against ``labels[:, t + 1]``.
    """

    task = "causal_lm"
    base_model_class = HfxPerformerModel
    _tied_weights_keys = {"lm_head.decoder.weight": "performer.embeddings.word_embeddings.weight"}

    def __init__(self, config) -> None:
        if not config.is_decoder:
            config = copy.deepcopy(config)
            config.is_decoder = True
        super().__init__(config)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> CausalLMOutput | tuple:
        """Returns ``logits`` ``(batch, seq_len, vocab)``; with ``labels`` (or already shifted ``shift_labels``), the
        mean next-token cross-entropy (the sum over ``num_items_in_batch`` when Trainer passes it)."""
        out = self._encode(
            input_ids, attention_mask, None, output_attentions, output_hidden_states,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
        )  # fmt: skip
        logits = self.lm_head(out.last_hidden_state)
        loss = causal_lm_loss(logits, labels, shift_labels, num_items_in_batch)
        result = CausalLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)
        return self._finish(result, return_dict)


__all__ = [
    "HfxPerformerPreTrainedModel",
    "HfxPerformerModel",
    "HfxPerformerForMaskedLM",
    "HfxPerformerForSequenceClassification",
    "HfxPerformerForMultipleChoice",
    "HfxPerformerForQuestionAnswering",
    "HfxPerformerForTokenClassification",
    "HfxPerformerForCausalLM",
]
