"""The decoder base: ``generate()`` for our decoders, whose caches are not transformers ``Cache`` objects, and the
base class of those caches.

Performer keeps the recurrent state of causal linear attention, Reformer the normalised layer inputs and LSH buckets
of earlier positions, the Universal Transformer keys and values per recurrent step, Transformer-XL its memories.
:class:`HfxGenerationMixin` is what they share with transformers' ``GenerationMixin``:

* the cache travels between steps under the name of the installed transformers release (``past_key_values`` before
  5.24, ``cache`` from 5.24 on; ``ops/compat.py``), whatever the model's own output field is called;
* ``prepare_inputs_for_generation`` feeds only the tokens the cache has not seen and passes every other keyword
  argument on, as transformers' own ``prepare_inputs_for_generation`` does (``token_type_ids``,
  ``output_attentions``, a model's own arguments, ...), except ``generate()``'s bookkeeping and what ``forward`` never
  takes although ``generate()`` lets it through (:meth:`HfxGenerationMixin._not_forwarded`);
* beam search reorders the cache through :meth:`_reorder_cache` (a cache's own ``reorder_cache``, or a tuple of
  batch-first tensors such as Transformer-XL's memories);
* assisted decoding and prompt lookup are refused by transformers itself (``_is_stateful``): they need to roll the
  cache back to an earlier token, which a recurrent state or memories cannot do.

Caches derive from :class:`HfxCache` and name the attributes that hold batch rows (``batch_fields``); beam search
reorders exactly those, with :func:`select_batch_rows`, which also reorders Transformer-XL's memories (a plain tuple
of batch-first tensors, the output contract of transformers' TransfoXL that our model keeps).

The causal-LM head that Performer, Reformer and the Universal Transformer share (``layers/heads.py``,
``HfxCausalLMHeadMixin``) stands on this mixin; Transformer-XL, whose adaptive softmax is no vocabulary head, uses the
mixin directly.

Put the mixin before the ``PreTrainedModel`` subclass in a model's bases (``PreTrainedModel`` sets ``_is_stateful =
False``), and name transformers' ``GenerationMixin`` last, as transformers' own generating models do
(``class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin)``): transformers 5 recognises a generating class by
a direct base called ``GenerationMixin`` (``PreTrainedModel.can_generate``), and its tests check exactly that. A
model sets :attr:`generation_cache_argument` (the ``forward`` argument that takes its cache) and
:attr:`generation_cache_class` and, where the defaults do not fit, overrides :meth:`_unseen_tokens` and
:meth:`_cache_of_output`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.utils import TransformersKwargs

from ..ops.compat import CACHE_ARGUMENT_NAMES, CACHE_NAME, cache_from_kwargs, output_cache
from ..ops.packing import forward_keywords


@functools.cache
def _parameter_names(forward) -> frozenset[str]:
    return forward_keywords(forward)


def forward_parameters(model_class: type) -> frozenset[str]:
    """The keyword arguments ``model_class.forward`` takes, the packed batch's included
    (:func:`~hf_xformers.ops.packing.forward_keywords`; read once per class, not at every decoding step)."""
    return _parameter_names(model_class.forward)


def select_batch_rows(value: Any, index: torch.Tensor) -> Any:
    """``value`` with only the batch rows ``index`` ``(n,)``: a batch-first tensor, or lists, tuples and dicts of them
    (nested), for beam search. None and non-tensor leaves (counters) come back as they are."""
    if torch.is_tensor(value):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, dict):
        return {key: select_batch_rows(item, index) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)(*(select_batch_rows(item, index) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(select_batch_rows(item, index) for item in value)
    return value


class HfxCache:
    """Base of our decoding caches (Performer's recurrent state, Reformer's inputs and buckets, the Universal
    Transformer's per-step keys and values): what ``generate()`` and beam search ask of a cache.

    A subclass holds its state in attributes, lists batch-first ones in :attr:`batch_fields` (tensors or lists,
    tuples and dicts of them; beam search keeps their rows ``beam_idx``) and says how many tokens it has seen
    (:meth:`get_seq_length`). Caches are filled in place by ``forward``.
    """

    # Python containers of changing length: torch.compile must not treat the cache as a static input.
    is_compileable = False
    batch_fields: tuple[str, ...] = ()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The number of tokens the cache has seen."""
        raise NotImplementedError(f"{type(self).__name__} must say how many tokens it has seen (get_seq_length).")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the batch rows ``beam_idx`` ``(batch,)`` of every field in :attr:`batch_fields` (beam search)."""
        for name in self.batch_fields:
            setattr(self, name, select_batch_rows(getattr(self, name), beam_idx))


# generate() keeps these in its model kwargs for itself; they never reach forward.
_GENERATE_BOOKKEEPING = frozenset({"labels", "next_sequence_length", "is_first_iteration", "cache_position"})
# Keywords generate() accepts for any model (transformers' TransformersKwargs: output_attentions, seq_idx, ...) even
# where forward has no such parameter.
_LIBRARY_KEYWORDS = frozenset(TransformersKwargs.__optional_keys__)


class HfxGenerationMixin(GenerationMixin):
    """``GenerationMixin`` for a decoder with a cache of its own (see the module docstring)."""

    # Assisted decoding / prompt lookup would crop the cache back to the accepted tokens: refuse them the way
    # transformers refuses them for recurrent models ("assisted generation is not supported with stateful models").
    _is_stateful = True
    # The forward argument that takes the cache ("past_key_values", "past_buckets_states", "mems").
    generation_cache_argument: str = "past_key_values"
    # The cache generate() starts with (an HfxCache subclass), or None where forward makes its own.
    generation_cache_class: type | None = None

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # Our caches are made by prepare_inputs_for_generation, not by generate() as a DynamicCache.
        return False

    # ----- hooks ---------------------------------------------------------------------------------------------
    def _new_generation_cache(self) -> Any:
        """A fresh cache for the first step: a :attr:`generation_cache_class` (None: the model makes one itself on its
        first forward)."""
        return None if self.generation_cache_class is None else self.generation_cache_class()

    def _unseen_tokens(self, input_ids: torch.Tensor, cache: Any) -> int:
        """How many of the last tokens of ``input_ids`` ``(batch, seq_len)`` the cache has not seen."""
        return input_ids.shape[1] - (cache.get_seq_length() if cache is not None else 0)

    def _cache_of_output(self, outputs: Any) -> Any:
        """The cache a forward output carries (None without one)."""
        return output_cache(outputs)

    # ----- generate() plumbing ---------------------------------------------------------------------------------
    def _forward_parameters(self) -> frozenset[str]:
        return forward_parameters(type(self))

    def _not_forwarded(self) -> frozenset[str]:
        """The keyword arguments :meth:`prepare_inputs_for_generation` drops: ``generate()``'s own bookkeeping, and
        what ``generate()`` accepts although this ``forward`` never takes it: transformers' model-agnostic keywords
        (``TransformersKwargs``) our ``forward`` has no parameter for, and, for an encoder-decoder model, the
        encoder's own arguments (``generate()`` has already given them to the encoder). Anything else goes on to
        ``forward``, which refuses a name it does not know rather than ignoring it."""
        accepted = self._forward_parameters()
        dropped = _GENERATE_BOOKKEEPING | (_LIBRARY_KEYWORDS - accepted)
        if self.config.is_encoder_decoder:
            encoder = self.get_encoder()
            dropped |= forward_parameters(type(encoder)) - accepted
        return frozenset(dropped)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> dict:
        """One step's ``forward`` arguments: the tokens the cache has not seen (all of them on the first step or
        without a cache), the cache (a fresh one on the first step unless ``use_cache=False``), the attention mask of
        every token so far, and every other keyword argument, as transformers' ``prepare_inputs_for_generation``
        forwards them (but those :meth:`_not_forwarded` names); ``position_ids`` and ``token_type_ids`` are cut to
        the new tokens."""
        cache = cache_from_kwargs(kwargs)
        if self.config.is_encoder_decoder:
            # generate() passes the decoder's ids as input_ids; the encoder's mask stays attention_mask.
            ids_key, mask_key, mask = (
                "decoder_input_ids",
                "decoder_attention_mask",
                kwargs.pop("decoder_attention_mask", None),
            )
        else:
            ids_key, mask_key, mask = "input_ids", "attention_mask", attention_mask
        if use_cache is not False and cache is None:
            cache = self._new_generation_cache()
        new = self._unseen_tokens(input_ids, cache)
        inputs = {ids_key: input_ids[:, -new:], mask_key: mask}
        inputs_embeds = kwargs.pop("inputs_embeds", None)
        if inputs_embeds is not None and not self.config.is_encoder_decoder and kwargs.get("is_first_iteration"):
            # generate(inputs_embeds=...): the prompt enters as embeddings on the first step, as ids after it.
            inputs[ids_key], inputs["inputs_embeds"] = None, inputs_embeds
        if self.config.is_encoder_decoder:
            inputs["attention_mask"] = attention_mask
        dropped = self._not_forwarded()
        for key, value in kwargs.items():
            if key in dropped or key in CACHE_ARGUMENT_NAMES or key in inputs:
                continue
            if key in ("position_ids", "token_type_ids", "decoder_position_ids") and value is not None:
                value = value[..., -new:]
            inputs[key] = value
        if "use_cache" in self._forward_parameters():
            inputs["use_cache"] = use_cache is not False
        inputs[self.generation_cache_argument] = cache
        return inputs

    def _update_model_kwargs_for_generation(
        self, outputs: Any, model_kwargs: dict, is_encoder_decoder: bool = False, num_new_tokens: int = 1
    ) -> dict:
        """transformers' update (attention mask, positions, token types), with our cache kept under the release's
        cache name (transformers 5.24 reads only an output field named ``cache``)."""
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens
        )
        for name in CACHE_ARGUMENT_NAMES:
            model_kwargs.pop(name, None)
        cache = self._cache_of_output(outputs)
        if cache is not None and model_kwargs.get("use_cache") is not False:
            model_kwargs[CACHE_NAME] = cache
        return model_kwargs

    def _reorder_cache(self, cache: Any, beam_idx: torch.Tensor) -> Any:
        """Beam search: keep the batch rows ``beam_idx`` of the cache (an :class:`HfxCache`, in place, or a tuple of
        batch-first tensors such as Transformer-XL's memories)."""
        if isinstance(cache, HfxCache):
            cache.reorder_cache(beam_idx)
            return cache
        return select_batch_rows(cache, beam_idx)


__all__ = ["HfxCache", "HfxGenerationMixin", "select_batch_rows"]
