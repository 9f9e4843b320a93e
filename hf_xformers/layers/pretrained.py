"""``HfxPreTrainedModel``: the ``PreTrainedModel`` defaults every hf_xformers model shares, text and vision.

An architecture subclasses it as ``Hfx<Arch>PreTrainedModel`` (sets ``config_class`` and ``base_model_prefix``); its
base model and heads derive from that class.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from .heads import HfxLMHead


class HfxPreTrainedModel(PreTrainedModel):
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
    ) -> torch.Tensor | None:
        """Global-attention mask a task head uses when the caller gives none (None: no global tokens); in a packed
        batch (``document_ids``, :mod:`~hf_xformers.ops.packing`) the task's rule applies to every document.

        ``task`` is one of ``"sequence_classification"``, ``"multiple_choice"``, ``"question_answering"``,
        ``"token_classification"``, ``"masked_lm"``. Architectures with global attention override this.
        """
        return None
