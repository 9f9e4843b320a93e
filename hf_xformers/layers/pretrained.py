"""``HfxPreTrainedModel``: the ``PreTrainedModel`` defaults every hf_xformers model shares, text and vision.

An architecture subclasses it as ``Hfx<Arch>PreTrainedModel`` (sets ``config_class`` and ``base_model_prefix``); its
base model and heads derive from that class. Its ``TransformersCheckpointMixin`` (``layers/transformers_loading.py``)
lets ``from_pretrained`` read checkpoints saved by transformers' own class of the architecture.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from ..ops.attention_switch import mark_implementation_unset
from ..ops.sequence_parallel import (
    current_shards,
    gather_batch,
    restore_per_sequence,
    sequence_parallel_group,
    sharded_forward,
    share_of_gradient,
)
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
    # Why this architecture cannot run sequence-parallel (ops/sequence_parallel.py; docs/training-past-one-device.md),
    # or None where it can: the architectures whose encoder is HfxTextModel's, with attention that reads its input
    # only through per-token projections, set None.
    sequence_parallel_refusal: str | None = "its layers have no sequence-parallel path"
    # A head that scores tokens gets its rank's tokens from the base model under sequence parallelism (SequenceShards
    # .token_outputs); the others get the whole sequence.
    sequence_parallel_token_outputs = False

    def __call__(self, *args, **kwargs):
        # Sequence parallelism (DeepSpeed Ulysses under accelerate's ParallelismConfig(sp_backend="deepspeed")): in
        # training, with DeepSpeed's group set up, the batch arrives as this rank's slice of the tokens. The outermost
        # call gathers the inputs and marks the forward; a base model inside it shards its encoder. Evaluation runs
        # whole on every rank, as accelerate asks of DeepSpeed (disable_in_eval) and Trainer feeds it.
        group = None if not self.training or current_shards() is not None else sequence_parallel_group()
        if group is None:
            return super().__call__(*args, **restore_per_sequence(kwargs))
        self.check_sequence_parallel(torch.distributed.get_world_size(group), args, kwargs)
        args, kwargs, shards = gather_batch(group, args, kwargs)
        shards = shards._replace(token_outputs=self.sequence_parallel_token_outputs)
        with sharded_forward(shards):
            out = super().__call__(*args, **kwargs)
        if isinstance(out, ModelOutput) and out.get("loss") is not None:
            out["loss"] = share_of_gradient(out["loss"], shards.size)
        elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 0:
            out = (share_of_gradient(out[0], shards.size), *out[1:])
        return out

    def check_sequence_parallel(self, size: int, args: tuple, kwargs: dict) -> None:
        """``ValueError`` naming the fix when this model, or this call, cannot run on ``size`` ranks sharing the
        sequence: an architecture without the path (``sequence_parallel_refusal``), heads that ``size`` does not
        divide, per-rank outputs that would be slices (attentions, hidden states), a cache, several choices."""
        name = type(self).__name__
        if self.sequence_parallel_refusal is not None:
            raise ValueError(
                f"{name} cannot train with sequence parallelism: {self.sequence_parallel_refusal}. Train it without "
                "sp_size (ParallelismConfig(sp_size=1)), or use hfx-longformer, hfx-bigbird, hfx-performer, "
                "hfx-linformer or hfx-reformer (docs/training-past-one-device.md)."
            )
        heads = self.config.num_attention_heads
        if heads % size:
            raise ValueError(
                f"{name} has {heads} attention heads, which the {size} ranks of the sequence-parallel group cannot "
                f"share (each rank runs heads / sp_size of them): choose an sp_size that divides {heads}."
            )
        for option in ("output_attentions", "output_hidden_states", "use_cache"):
            if kwargs.get(option) or (option != "use_cache" and getattr(self.config, option, False)):
                raise ValueError(
                    f"{name}: {option}=True is not available under sequence parallelism (each rank holds a slice of "
                    f"the heads and tokens); pass {option}=False, or run the model without sp_size to inspect it."
                )
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() != 2:
            raise ValueError(
                f"{name}: sequence parallelism takes input_ids of shape (batch, seq_len) (DeepSpeed shards dim 1), got "
                f"{tuple(ids.shape)}; multiple-choice inputs (batch, choices, seq_len) cannot be sharded so."
            )

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
