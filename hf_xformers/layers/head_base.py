"""What every task head shares: building the base model, resolving a packed batch once, running the base model.

Each ``Hfx*HeadMixin`` of ``layers/heads.py`` holds the whole ``__init__`` / ``forward`` of one task on top of
:class:`HfxHeadMixin`; an architecture gets the head by mixing it into its ``PreTrainedModel`` subclass and naming
its base model class::

    class HfxLongformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxLongformerPreTrainedModel):
        base_model_class = HfxLongformerModel

The base model is stored under ``base_model_prefix`` (``self.longformer`` ...) so checkpoints keep the names
users know from ``transformers``.
"""

from __future__ import annotations

from torch import nn
from transformers.utils import ModelOutput

from ..ops.input_checks import refuse
from ..ops.packing import PackedBatch, PackedBatchKwargs, packing_kwargs, resolve_packed_batch
from .generation import forward_parameters
from .head_layers import HfxLMHead


class HfxHeadMixin:
    """Plumbing shared by the heads: builds the base model and runs it with a task's default global mask."""

    base_model_class: type[nn.Module]
    task: str

    def head_input_size(self, config) -> int:
        """Width of the base model's output that the head reads (Reformer: ``2 * hidden_size``)."""
        return config.hidden_size

    def _build_base_model(self, config, add_pooling_layer: bool = False) -> None:
        setattr(self, self.base_model_prefix, self.base_model_class(config, add_pooling_layer=add_pooling_layer))

    def _packed_batch(
        self, input_ids, inputs_embeds, position_ids, attention_mask, packing: PackedBatchKwargs
    ) -> PackedBatch | None:
        """The documents of a packed batch (:class:`~hf_xformers.ops.packing.PackedBatch`), worked out once here from
        whichever of the collator's forms arrived (``packing``: the forward's checked
        :class:`~hf_xformers.ops.packing.PackedBatchKwargs`) and handed to the base model as ``packed_batch``, or None
        for an ordinary batch (``position_ids`` never mark documents)."""
        ref = input_ids if input_ids is not None else inputs_embeds
        if ref is None or ref.dim() < 2:
            return None
        return resolve_packed_batch(
            tuple(ref.shape[:2]), ref.device, position_ids, attention_mask=attention_mask, **packing
        )

    def _encode_batch(
        self, input_ids, attention_mask, global_attention_mask, token_type_ids, position_ids, inputs_embeds,
        output_attentions, output_hidden_states, kwargs: dict, seq_idx=None,
    ) -> tuple[PackedBatch | None, ModelOutput]:  # fmt: skip
        """``(documents, out)``: the packed batch resolved once (:meth:`_packed_batch` from the forward's ``seq_idx``
        and ``kwargs``, checked to be :class:`~hf_xformers.ops.packing.CuSeqLensKwargs`; None for an ordinary batch)
        and the base model's output on it (:meth:`_encode`), what a token-sequence head's ``forward`` starts with."""
        packing = packing_kwargs(self, kwargs, seq_idx)
        documents = self._packed_batch(input_ids, inputs_embeds, position_ids, attention_mask, packing)
        out = self._encode(
            input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states, documents,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
        )  # fmt: skip
        return documents, out

    def _encode(
        self, input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states,
        packed=None, **kw,
    ):  # fmt: skip
        """Run the base model with ``return_dict=True``. A base model with global attention gets the task's default
        global mask when the caller gives none (per document in a packed batch, ``packed``); one without is not
        passed a ``global_attention_mask`` at all (the Universal Transformer's forward has no such argument) unless
        the caller gave one, which it then refuses."""
        attention_class = getattr(self.base_model_class, "attention_class", None)
        if packed is not None:
            kw["packed_batch"] = packed
        if global_attention_mask is None and getattr(attention_class, "supports_global_attention", False):
            document_ids = None if packed is None else packed.document_ids
            global_attention_mask = self.default_global_attention_mask(
                self.task, input_ids, attention_mask, document_ids=document_ids, inputs_embeds=kw.get("inputs_embeds")
            )
        if global_attention_mask is not None:
            if "global_attention_mask" not in forward_parameters(self.base_model_class):
                refuse("no_global_attention", f"{type(self).__name__} has no global attention")
            kw["global_attention_mask"] = global_attention_mask
        return self.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kw,
        )


class HfxLMHeadMixin(HfxHeadMixin):
    """A base model and a vocabulary head ``lm_head`` whose decoder is the output embedding (tied to the input
    embeddings through ``_tied_weights_keys``). Masked and causal language models differ only in ``forward``."""

    # An architecture whose LM head differs (BigBird's activation is config.hidden_act) sets a subclass here.
    lm_head_class: type[nn.Module] = HfxLMHead

    def __init__(self, config) -> None:
        super().__init__(config)
        self._build_base_model(config)
        self.lm_head = self.lm_head_class(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.decoder = new_embeddings
