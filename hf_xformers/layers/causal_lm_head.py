"""The causal language model head that Performer, Reformer and the Universal Transformer share.

It stands on the decoder base (``layers/generation.py``: the cache through ``generate()``) and on the LM head of
``layers/head_base.py``; Transformer-XL, whose adaptive softmax is no vocabulary head, uses the decoder base directly.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..ops.compat import CACHE_NAME, output_cache, resolve_cache_argument
from .generation import HfxGenerationMixin
from .head_base import HfxLMHeadMixin
from .losses import causal_lm_loss, next_token_labels


class HfxCausalLMHeadMixin(HfxLMHeadMixin, HfxGenerationMixin):
    """A left-to-right language model: the base model as a decoder with its cache, a vocabulary head, the next-token
    loss and ``generate()`` (:class:`~hf_xformers.layers.generation.HfxGenerationMixin`: the cache under the release's
    name, unseen tokens only, beam reorder). Put it first in the bases and transformers' ``GenerationMixin`` last, as
    transformers' own causal LMs name it (``can_generate`` and transformers' tests look for it among the direct
    bases)::

        class HfxPerformerForCausalLM(HfxCausalLMHeadMixin, HfxPerformerPreTrainedModel, GenerationMixin):
            base_model_class = HfxPerformerModel

    The model is always causal: a config with ``is_decoder=False`` is copied with ``is_decoder=True``
    (:meth:`causal_config`; the caller's object is left as it is). ``labels`` ``(batch, seq_len)`` are the input ids
    (-100 where no loss is wanted), shifted inside: the logits at position ``t`` are scored against
    ``labels[:, t + 1]``; ``shift_labels``, already aligned with the positions, take precedence. An architecture whose
    base model takes other arguments (Reformer's ``num_hashes`` and ``past_buckets_states``) overrides
    :meth:`forward` and keeps the rest.
    """

    task = "causal_lm"

    def __init__(self, config) -> None:
        super().__init__(self.causal_config(config))

    @classmethod
    def causal_config(cls, config):
        """``config`` if it is a decoder's, else a copy with ``is_decoder=True``."""
        if config.is_decoder:
            return config
        config = copy.deepcopy(config)
        config.is_decoder = True
        return config

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Any = None,
        seq_idx: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
    ) -> CausalLMOutputWithPast | tuple:
        """Returns ``logits`` ``(batch, seq_len, vocab)`` (of the new tokens when a cache is passed back, as
        ``cache`` or ``past_key_values``), the cache when one is used (``use_cache=True``), and with ``labels`` or
        ``shift_labels`` the mean next-token cross-entropy (the sum over ``num_items_in_batch`` when Trainer passes
        it). A packed batch (``position_ids`` restarting per document, ``seq_idx`` or ``cu_seq_lens_q/k``, as
        ``DataCollatorWithFlattening`` returns them) is read as documents that never see each other, and no document's
        last token is scored against the next document's first."""
        cached = bool(use_cache) or past_key_values is not None or cache is not None
        documents = self._packed_batch(
            input_ids, inputs_embeds, position_ids, attention_mask,
            seq_idx, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, cached,
        )  # fmt: skip
        out = self._encode(
            input_ids, attention_mask, None, output_attentions, output_hidden_states, documents,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
            past_key_values=resolve_cache_argument(past_key_values, cache), use_cache=use_cache,
        )  # fmt: skip
        logits = self.lm_head(out.last_hidden_state)
        if documents is not None and shift_labels is None and labels is not None:
            shift_labels = next_token_labels(labels, documents.starts)
        loss = causal_lm_loss(logits, labels, shift_labels, num_items_in_batch)
        result = self._head_result(CausalLMOutputWithPast, out, loss, logits=logits, **{CACHE_NAME: output_cache(out)})
        return self._finish(result, return_dict)
