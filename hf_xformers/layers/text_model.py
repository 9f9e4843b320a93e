"""``HfxTextModel``: the base model of the encoder-only text architectures (embeddings -> encoder -> pooler).

An architecture subclasses :class:`~hf_xformers.layers.pretrained.HfxPreTrainedModel` and
builds its base model as ``class XModel(HfxTextModel, XPreTrainedModel)`` with ``attention_class`` set.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from typing_extensions import Unpack

from ..ops.input_checks import (
    check_embeds_width,
    check_not_empty,
    check_position_ids,
    check_token_ids,
    check_type_ids,
    is_tracing,
    reads_values,
    refuse,
    token_shape,
    unpadded_to_none,
)
from ..ops.packing import (
    CuSeqLensKwargs,
    PackedBatch,
    PackedBatchKwargs,
    packing_kwargs,
    refuse_packed,
    resolve_packed_batch,
)
from ..ops.sequence_parallel import current_shards
from .embeddings import HfxTextEmbeddings
from .encoder import HfxEncoder, HfxModelOutput, HfxPooler
from .pretrained import HfxPreTrainedModel  # noqa: F401 (its old import path)


class HfxTextModel:
    """Embeddings -> encoder of :class:`HfxEncoderLayer` -> optional pooler. Mixed into ``XModel`` classes."""

    attention_class: type[nn.Module]
    # Architectures whose embeddings differ (BigBird: positions from 0, no RoBERTa offset) set their own class;
    # it must offer `word_embeddings` and the `max_tokens` property.
    embeddings_class: type[nn.Module] = HfxTextEmbeddings
    # Why the architecture cannot attend within the documents of a packed row, and what to do instead (None: it can;
    # its attention then takes `document_ids`). See ops/packing.py.
    packing_refusal: tuple[str, str] | None = None

    def __init__(self, config, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.encoder = HfxEncoder(config, self.attention_factory(config))
        self.pooler = HfxPooler(config) if add_pooling_layer else None
        self.post_init()

    def attention_factory(self, config) -> Callable[..., nn.Module]:
        """What the encoder calls as ``factory(config, layer_idx)`` to build each layer's attention.

        ``attention_class`` itself by default. It runs after ``nn.Module.__init__`` and before the encoder is built,
        so an architecture whose layers share one module (Linformer's layerwise projection) can register that
        module on the base model here and bind it to the attention class with ``functools.partial``.
        """
        return self.attention_class

    def prepare_attention_inputs(
        self,
        attention_mask: torch.Tensor | None,
        global_attention_mask: torch.Tensor | None,
        length: int,
        packed: PackedBatch | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """What every layer's attention gets, decided once per forward instead of once per layer.

        On a GPU every "is anything padded / global" test of a tensor is a device-to-host synchronisation; made here,
        each costs one per forward. In eager mode an all-True ``attention_mask`` becomes None (no padding) and a
        ``global_attention_mask`` without a global token becomes None; traced graphs keep both as given (no branch on
        values), and padding is never global. Architectures add what their layers would otherwise each work out from the masks (returned as the
        dict of keyword arguments passed to every layer's attention).

        Args:
            attention_mask, global_attention_mask: ``(batch, seq_len)`` bool, or None.
            length: ``seq_len``.
            packed: the documents of a packed batch (:class:`~hf_xformers.ops.packing.PackedBatch`), or None; every
                layer's attention gets ``packed.document_ids`` as ``document_ids`` (and architectures derive their
                own layouts from ``packed`` here, once).
        Returns:
            ``(attention_mask, global_attention_mask, attention_kwargs)``.
        """
        if global_attention_mask is not None and attention_mask is not None:
            global_attention_mask = global_attention_mask & attention_mask  # padding is never global
        attention_mask = unpadded_to_none(attention_mask)
        if global_attention_mask is not None and not is_tracing() and not bool(global_attention_mask.any()):
            global_attention_mask = None
        return attention_mask, global_attention_mask, {} if packed is None else {"document_ids": packed.document_ids}

    def _encode_tokens(self, hidden, attention_mask, global_attention_mask, output_attentions, output_hidden_states,
                       attention_kwargs: dict) -> HfxModelOutput:  # fmt: skip
        """The encoder on the embeddings ``hidden`` ``(batch, seq_len, hidden)``. In a sequence-parallel forward
        (``ops/sequence_parallel.py``) the masks and layouts are the whole sequence's, the encoder runs on this rank's
        tokens (its attention exchanging heads for tokens) and the last hidden states are gathered whole, unless the
        head scores tokens (``shards.token_outputs``: this rank's tokens are returned)."""
        shards = current_shards()
        if shards is not None:
            hidden = shards.local(hidden)
            attention_kwargs = {**attention_kwargs, "sequence_parallel": shards}
        out = self.encoder(
            hidden, attention_mask, global_attention_mask, output_attentions, output_hidden_states, attention_kwargs
        )
        if shards is not None and not shards.token_outputs:
            out.last_hidden_state = shards.gather(out.last_hidden_state)
        return out

    def _pool(self, hidden_states: torch.Tensor, packed: PackedBatch | None) -> torch.Tensor | None:
        """The pooler's output, or None without a pooler, or for a packed batch whose number of documents a traced
        graph cannot know (boundaries from ``seq_idx``; ``cu_seq_lens`` give it)."""
        if self.pooler is None:
            return None
        if packed is not None and packed.count is None:
            return None
        return self.pooler(hidden_states, packed)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def packed_batch(
        self,
        shape: tuple[int, int],
        device: torch.device,
        position_ids=None,
        attention_mask=None,
        packing: PackedBatchKwargs | None = None,
        resolved: PackedBatch | None = None,
    ) -> PackedBatch | None:
        """The documents of a packed batch (:class:`~hf_xformers.ops.packing.PackedBatch`) or None: the one a head
        ``resolved``, else resolved here from the collator's keywords ``packing``; refuses a packed batch with a
        ``ValueError`` if the architecture sets ``packing_refusal``."""
        packed = resolved
        if packed is None:
            packed = resolve_packed_batch(shape, device, position_ids, attention_mask=attention_mask, **(packing or {}))
        if packed is not None and self.packing_refusal is not None:
            refuse_packed(type(self).__name__, *self.packing_refusal)
        return packed

    def packed_position_ids(self, packed: PackedBatch, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Position ids of a packed row: the caller's, checked (where values may be read), or each document's own
        count from the first position (``embeddings.position_offset``: 2 for RoBERTa-style tables, 0 for BigBird)."""
        offset = self.embeddings.position_offset
        if position_ids is None:
            return packed.positions + offset
        if reads_values(position_ids):
            starts = position_ids.masked_select(packed.starts)
            if bool((starts != offset).any()):
                refuse(
                    "packed_position_start",
                    f"In a packed batch every document's positions must start at {offset}, the first position of "
                    f"this model's table, but some start at {sorted(set(starts.tolist()))[:4]} (a wrong start shifts "
                    f"every position and silently changes every output): this model needs position_ids_start={offset}",
                )
        return position_ids

    def _check_inputs(
        self, input_ids, inputs_embeds, attention_mask, global_attention_mask, token_type_ids, packed=None,
        position_ids=None,
    ):  # fmt: skip
        shape = token_shape(input_ids, inputs_embeds)
        if len(shape) != 2:
            refuse("input_rank", f"`input_ids` must have shape (batch, seq_len), got {shape}")
        limit = self.embeddings.max_tokens
        longest = shape[1]
        if packed is not None:
            # A packed row may be longer than the table: each document must fit (its positions restart).
            if packed.longest is not None:
                longest = packed.longest
            elif position_ids is not None and reads_values(position_ids):
                longest = int(position_ids.max()) - self.embeddings.position_offset + 1
            else:
                longest = 0  # unknown without a read: the embeddings' lookup fails past the table
        if longest > limit:
            refuse(
                "sequence_too_long",
                f"Sequence length {longest} exceeds the {limit} tokens this model's position embeddings cover "
                f"(config.max_position_embeddings={self.config.max_position_embeddings})",
            )
        check_token_ids(input_ids, self.config.vocab_size)
        check_not_empty(shape, "input_ids" if input_ids is not None else "inputs_embeds")
        check_embeds_width(inputs_embeds, self.get_input_embeddings().embedding_dim)
        check_position_ids(position_ids, shape, 0, self.embeddings.position_embeddings.num_embeddings)
        for name, mask in (("attention_mask", attention_mask), ("global_attention_mask", global_attention_mask)):
            if mask is not None and tuple(mask.shape) != shape:
                refuse("mask_shape", f"`{name}` must have the shape of `input_ids` {shape}, got {tuple(mask.shape)}")
        if global_attention_mask is not None and not getattr(self.attention_class, "supports_global_attention", False):
            refuse("no_global_attention", f"{type(self).__name__} has no global attention")
        check_type_ids(token_type_ids, self.config.type_vocab_size, shape)

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
        *,
        seq_idx: torch.Tensor | None = None,
        packed_batch: PackedBatch | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxModelOutput | tuple:
        """Encode a batch, or a packed batch of documents (transformers' ``DataCollatorWithFlattening``).

        Args:
            input_ids: ``(batch, seq_len)`` token ids (or ``inputs_embeds`` ``(batch, seq_len, hidden)``).
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding.
            global_attention_mask: ``(batch, seq_len)``, 1 for tokens with global attention (Longformer only; the
                other architectures refuse it).
            token_type_ids: ``(batch, seq_len)`` segment ids.
            position_ids: ``(batch, seq_len)`` positions (positions only: they never mark documents; in a packed
                batch each document's count from the model's first position).
            inputs_embeds: ``(batch, seq_len, hidden)``, instead of ``input_ids``.
            output_attentions: also return every layer's attention probabilities.
            output_hidden_states: also return every layer's hidden states.
            return_dict: a :class:`HfxModelOutput` (None: ``config.return_dict``) or a tuple.
            seq_idx: ``(batch, seq_len)``, the document of every token of a packed batch
                (``DataCollatorWithFlattening(return_seq_idx=True)``; named here so that ``Trainer`` keeps a
                pre-packed dataset's column): every document then gets what its own forward gives.
            packed_batch: the :class:`~hf_xformers.ops.packing.PackedBatch` a head already resolved (then the
                boundary keywords are not read again).
            **kwargs: the boundaries of a packed row in FlashAttention's form
                (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`: ``cu_seq_lens_q/k``, and ``max_length_q/k``, the
                longest document, which spares a read).
        Returns:
            :class:`HfxModelOutput` with ``last_hidden_state`` ``(batch, seq_len, hidden)`` and
            ``pooler_output`` ``(batch, hidden)`` (None without a pooler); for a packed batch ``pooler_output`` is
            ``(num_documents, hidden)``, one row per document in order (None in a traced graph given ``seq_idx``: the
            number of documents is unknown there without a read).
        """
        shape = token_shape(input_ids, inputs_embeds)
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        packing = packing_kwargs(self, kwargs, seq_idx)
        packed = None
        if len(shape) == 2:
            packed = self.packed_batch(shape, device, position_ids, attention_mask, packing, packed_batch)
        if packed is not None:
            position_ids = self.packed_position_ids(packed, position_ids)
        self._check_inputs(
            input_ids, inputs_embeds, attention_mask, global_attention_mask, token_type_ids, packed, position_ids
        )
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        hidden = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if global_attention_mask is not None:
            global_attention_mask = global_attention_mask.bool()
        attention_mask, global_attention_mask, attention_kwargs = self.prepare_attention_inputs(
            attention_mask, global_attention_mask, hidden.shape[1], packed
        )
        out = self._encode_tokens(
            hidden, attention_mask, global_attention_mask, output_attentions, output_hidden_states, attention_kwargs
        )
        out = HfxModelOutput(
            last_hidden_state=out.last_hidden_state,
            pooler_output=self._pool(out.last_hidden_state, packed),
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            global_attentions=out.global_attentions,
        )
        return self._finish(out, return_dict)
