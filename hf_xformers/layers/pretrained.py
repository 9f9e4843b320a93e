"""``HfxPreTrainedModel``: the ``PreTrainedModel`` defaults every hf_xformers model shares, text and vision.

An architecture subclasses it as ``Hfx<Arch>PreTrainedModel`` (sets ``config_class`` and ``base_model_prefix``); its
base model and heads derive from that class. Its ``TransformersCheckpointMixin`` (``layers/transformers_loading.py``)
lets ``from_pretrained`` read checkpoints saved by transformers' own class of the architecture.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from ..ops.attention_switch import mark_implementation_unset
from .head_layers import HfxLMHead
from .transformers_loading import TransformersCheckpointMixin


class HfxPreTrainedModel(TransformersCheckpointMixin, PreTrainedModel):
    """Defaults common to every hf_xformers model."""

    supports_gradient_checkpointing = True
    # The attention switch (ops/attention_switch.py): every attention module reads config._attn_implementation at each
    # forward. "eager" and "sdpa" everywhere; "flex_attention" where an architecture maps its pattern onto a BlockMask.
    _supports_sdpa = True
    _supports_flex_attn = False
    # Our forward passes take **kwargs only to pass them on; losses are plain means. Without this, Trainer
    # multiplies the loss by the world size under DDP (see the team notes on transformers v5).
    accepts_loss_kwargs = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxLMHead):
            nn.init.zeros_(module.decoder.bias)

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        # transformers calls this at construction with the requested choice, None when the user chose none (it then
        # records "sdpa"): remembered on the config, so that each device may run its measured default
        # (ops/attention_switch.attention_implementation). A base model built inside a head sees the head's "sdpa"
        # and leaves the mark as it is.
        if attn_implementation is None:
            mark_implementation_unset(self.config, True)
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        """As transformers' method; the choice is then the user's on every device ("sdpa" included)."""
        super().set_attn_implementation(attn_implementation, *args, **kwargs)
        mark_implementation_unset(self.config, False)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        # transformers guesses from the modeling file's source whether attention reads the switch at run time; ours
        # always does (ops/attention_switch.attention_implementation), so set_attn_implementation may change it.
        return True

    def _finish(self, output, return_dict: bool | None):
        """``output`` (a ModelOutput) as it is, or as a tuple when ``return_dict`` (None: ``config.return_dict``)
        is False."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return output if return_dict else output.to_tuple()

    def _head_result(self, output_class: type, base_output, loss: torch.Tensor | None, **fields):
        """A task head's output: ``output_class(loss=loss, hidden_states=..., attentions=..., **fields)`` with the
        hidden states and attentions of the base model's output ``base_output``. An architecture whose base model
        reports more (the Universal Transformer's ponder loss and steps) overrides this, and every head mixin in
        ``layers/heads.py`` then returns its fuller output."""
        return output_class(
            loss=loss, hidden_states=base_output.hidden_states, attentions=base_output.attentions, **fields
        )

    def default_global_attention_mask(
        self,
        task: str,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Global-attention mask a task head uses when the caller gives none (None: no global tokens); in a packed
        batch (``document_ids``, :mod:`~hf_xformers.ops.packing`) the task's rule applies to every document.
        ``inputs_embeds`` ``(batch, seq_len, hidden)`` stand for the tokens when ``input_ids`` is None.

        ``task`` is one of ``"sequence_classification"``, ``"multiple_choice"``, ``"question_answering"``,
        ``"token_classification"``, ``"masked_lm"``. Architectures with global attention override this.
        """
        return None
