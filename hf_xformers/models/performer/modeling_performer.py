"""``hfx-performer``: RoBERTa with FAVOR+ attention (Choromanski et al., 2021), plus a causal LM.

The attention lives in ``hf_xformers/attention/favor.py``; this file wires it into the shared encoder and heads, owns
the redraw schedule of the random projections, and adds ``HfxPerformerForCausalLM`` (causal FAVOR+ by prefix sums)
with ``generate()`` on :class:`HfxPerformerCache`, the recurrent form of causal linear attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from typing_extensions import Unpack

from ...attention.favor import HfxFavorSelfAttention
from ...attention.favor_decoding import FavorState
from ...attention.favor_features import seeded_random_features
from ...attention.favor_packed import favor_documents
from ...layers.encoder import HfxModelOutput
from ...layers.generation import HfxCache
from ...layers.heads import (
    HfxCausalLMHeadMixin,
    HfxMaskedLMHeadMixin,
    HfxMultipleChoiceHeadMixin,
    HfxQuestionAnsweringHeadMixin,
    HfxSequenceClassificationHeadMixin,
    HfxTokenClassificationHeadMixin,
)
from ...layers.pretrained import HfxPreTrainedModel
from ...layers.text_model import HfxTextModel
from ...ops.compat import CACHE_NAME, cache_field, resolve_cache_argument
from ...ops.input_checks import reads_values
from ...ops.packing import CuSeqLensKwargs, PackedBatch, PackedBatchKwargs, marks_documents, packing_kwargs
from .configuration_performer import HfxPerformerConfig


@dataclass
@cache_field
class HfxPerformerModelOutput(HfxModelOutput):
    """:class:`HfxModelOutput` of a cached call, with the cache it updated (``cache``; ``past_key_values`` before
    transformers 5.24)."""

    cache: HfxPerformerCache | None = None


class HfxPerformerCache(HfxCache):
    """The decoding cache of a causal Performer: per layer the recurrent state of causal FAVOR+ (its size does not
    grow with the number of tokens seen).

    ``states[layer]``: ``(key_value, stabiliser)``, ``(batch, heads, m, head_dim + 1)`` running sums
    ``sum_j phi(k_j) [v_j, 1]`` and ``(batch, heads)`` the running key stabiliser they are expressed against (None
    for the relu kernel); see :func:`~hf_xformers.attention.favor_decoding.favor_attention_with_state`.
    ``last_position``: ``(batch,)`` the largest position id used so far (numbering continues from it when a call
    gives no ``position_ids``). ``seen_tokens``: tokens (padding included) the states summarise.

    ``inputs`` ``(batch, seen_tokens, hidden)`` and ``key_mask`` ``(batch, seen_tokens)`` bool: the embedded tokens and
    which of them are real, kept only when the first call asks for attentions (``output_attentions=True``, which
    ``generate()`` then asks at every step), None otherwise. The running sums cannot give attention probabilities;
    these let every later call form its new tokens' rows by the uncached causal FAVOR+ (a cost that grows with the
    length, as the probabilities themselves do).
    """

    batch_fields = ("states", "last_position", "inputs", "key_mask")

    def __init__(self) -> None:
        self.states: list[FavorState] = []
        self.last_position: torch.Tensor | None = None
        self.seen_tokens = 0
        self.inputs: torch.Tensor | None = None
        self.key_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The number of tokens already seen."""
        return self.seen_tokens

    def set_state(self, layer_idx: int, state: FavorState) -> None:
        """Store layer ``layer_idx``'s state after this call (layers fill the list in order on the first call)."""
        if layer_idx == len(self.states):
            self.states.append(state)
        else:
            self.states[layer_idx] = state


class HfxPerformerPreTrainedModel(HfxPreTrainedModel):
    config_class = HfxPerformerConfig
    base_model_prefix = "performer"
    sequence_parallel_refusal = None  # Ulysses: each rank runs the whole sequence on heads / sp_size heads
    _no_split_modules = ["HfxEncoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxFavorSelfAttention):
            # Draw 0 of the layer's seeded sequence; transformers' init helpers leave loaded buffers alone.
            init.copy_(module.projection_matrix, module.draw_projection_matrix(0))
            init.zeros_(module.num_redraws)
        if isinstance(module, HfxPerformerModel):
            init.zeros_(module.training_calls)

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
    """Performer encoder: RoBERTa's embeddings and layers with FAVOR+ attention (random features in place of the
    softmax, linear in the sequence length), and a pooler (``add_pooling_layer``). Its inputs and outputs: ``forward``.

    With ``config.feature_redraw_interval = N``, forward calls in training mode number 0, 1, 2, ... and the
    projections are redrawn before calls N, 2N, ... (here, not inside the layers, so that gradient checkpointing,
    which reruns layer forwards, never sees a different projection in its recomputation), by tensor operations that
    trace into one graph for every call and make no host read (:meth:`scheduled_redraw`).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxPerformerConfig, HfxPerformerModel
        >>> config = HfxPerformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, num_random_features=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxPerformerModel(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> attention_mask = torch.ones(2, 40, dtype=torch.long)
        >>> attention_mask[1, 30:] = 0  # the second sequence: 30 tokens, then padding
        >>> out = model(input_ids, attention_mask=attention_mask)
        >>> out.last_hidden_state.shape, out.pooler_output.shape
        (torch.Size([2, 40, 32]), torch.Size([2, 32]))
    """

    attention_class = HfxFavorSelfAttention

    def prepare_attention_inputs(self, attention_mask, global_attention_mask, length, packed=None):
        """As :meth:`HfxTextModel.prepare_attention_inputs`, plus, for a packed batch, where its documents lie
        against FAVOR+'s chunks (``favor_documents``, :func:`~hf_xformers.attention.favor_packed.favor_documents`): worked
        out once here for every layer, with a fixed number of tensor operations whatever the number of documents and
        no host read, so that each layer runs one vectorised FAVOR+ over the whole batch."""
        attention_mask, global_attention_mask, kwargs = super().prepare_attention_inputs(
            attention_mask, global_attention_mask, length, packed
        )
        if packed is not None:
            kwargs["favor_documents"] = favor_documents(
                packed.document_ids, bool(self.config.is_decoder), spans=packed.host_spans()
            )
        return attention_mask, global_attention_mask, kwargs

    def __init__(self, config, add_pooling_layer: bool = True) -> None:
        super().__init__(config, add_pooling_layer)
        # The schedule's count of training calls, a tensor so that a compiled step neither recompiles as it grows nor
        # reads it back; a position in this run's schedule, not part of the checkpoint.
        self.register_buffer("training_calls", torch.zeros((), dtype=torch.long), persistent=False)

    def scheduled_redraw(self) -> None:
        """Count a training call and redraw every layer's projection before calls ``N, 2N, ...``
        (``config.feature_redraw_interval = N``; nothing in eval mode or without an interval).

        Tensor operations only (:meth:`~hf_xformers.attention.favor.HfxFavorSelfAttention.redraw_where`): the count,
        the test and the draw trace into one graph for every call (``torch.compile(fullgraph=True)`` compiles once) and
        read nothing back to the host. On an accelerator the draw is made on its device, every call (a few small QRs
        per layer, cheaper than a host read per step), from the same integer keys as the CPU draws
        (:func:`~hf_xformers.attention.favor_features.draw_key`), so its features equal the CPU's within float32
        rounding; the CPU draws only when due.
        """
        interval = self.config.feature_redraw_interval
        if not (self.training and interval):
            return
        calls = self.training_calls
        due = (calls > 0) & (calls % interval == 0)
        with torch.no_grad():
            calls.add_(1)
            if reads_values(due) and not bool(due):  # one free read spares the draw of every layer
                return
            modules = [module for module in self.modules() if isinstance(module, HfxFavorSelfAttention)]
            # Every layer is built from the one config: one batched draw for all of them.
            first = modules[0]
            keys = torch.stack([module.next_draw_key() for module in modules])
            fresh = seeded_random_features(first.num_features, first.head_dim, keys, first.orthogonal)
            for module, rows in zip(modules, fresh):
                module.redraw_where(due, rows)

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
        past_key_values: HfxPerformerCache | None = None,
        use_cache: bool | None = None,
        cache: HfxPerformerCache | None = None,
        *,
        seq_idx: torch.Tensor | None = None,
        packed_batch: PackedBatch | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxModelOutput | tuple:
        """As :meth:`HfxTextModel.forward`, after the scheduled redraw of the projections (training mode).

        A packed batch (``seq_idx``, or ``kwargs``: ``cu_seq_lens_q/k``, as ``DataCollatorWithFlattening`` returns
        them; :mod:`~hf_xformers.ops.packing`) gives every document what its
        own forward gives, bidirectional or causal. It cannot be combined with a cache (``use_cache=True`` or a
        cache passed back): packing is for training and encoding, a cache for decoding one row at a time.

        Causal models (``config.is_decoder``) also decode with a cache: ``use_cache=True`` starts an
        :class:`HfxPerformerCache` (returned as the output's ``cache``; ``past_key_values`` before transformers 5.24),
        and a cache passed back (as ``cache`` or ``past_key_values``) makes the call process
        only the new tokens (``attention_mask`` is then ``(batch, new)`` or ``(batch, past + new)``, of which the last
        ``new`` columns are used). Without ``position_ids`` a cached call numbers the new tokens on from the last
        position, counting the tokens that are not ``pad_token_id`` as the uncached model does.

        Args:
            input_ids: ``(batch, seq_len)`` token ids (with a cache: the new tokens), or a packed row
                ``(1, total_tokens)``.
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding; with a cache also
                ``(batch, past + seq_len)``.
            global_attention_mask: refused (Performer has no global tokens).
            token_type_ids: ``(batch, seq_len)`` segment ids.
            position_ids: ``(batch, seq_len)`` positions on RoBERTa's table (None: counted from ``pad_token_id + 1``
                over the real tokens); positions only, they never mark documents.
            inputs_embeds: ``(batch, seq_len, hidden)``, instead of ``input_ids``.
            output_attentions: also return every layer's attention probabilities ``(batch, heads, seq_len, keys)``
                (computed densely from the random features).
            output_hidden_states: also return the hidden states after the embeddings and after every layer.
            return_dict: an :class:`HfxPerformerModelOutput` (None: ``config.return_dict``) or a plain tuple.
            past_key_values: an :class:`HfxPerformerCache` from an earlier call (its name before transformers 5.24).
            use_cache: start or continue a cache and return it (causal models only).
            cache: the same as ``past_key_values``, under its name from transformers 5.24.
            seq_idx: ``(batch, seq_len)``, the document of every token of a packed batch.
            packed_batch: the :class:`~hf_xformers.ops.packing.PackedBatch` a head already resolved (then the
                boundary keywords are not read again).
            **kwargs: the boundaries of a packed row (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`:
                ``cu_seq_lens_q/k`` with ``max_length_q/k``).

        Returns:
            ``HfxPerformerModelOutput``: ``last_hidden_state`` ``(batch, seq_len, hidden)``, ``pooler_output``
            ``(batch, hidden)`` (``(num_documents, hidden)`` for a packed batch; None without a pooler), the cache when
            one is used, ``hidden_states`` and ``attentions`` when asked.
        """
        past_key_values = resolve_cache_argument(past_key_values, cache)
        packing = packing_kwargs(self, kwargs, seq_idx)
        self.scheduled_redraw()
        if use_cache or past_key_values is not None:
            self._refuse_packed_with_cache(
                input_ids, inputs_embeds, attention_mask, position_ids, packing, packed_batch
            )
        if use_cache and past_key_values is None:
            past_key_values = HfxPerformerCache()
        if past_key_values is None:
            return super().forward(
                input_ids, attention_mask, global_attention_mask, token_type_ids, position_ids, inputs_embeds,
                output_attentions, output_hidden_states, return_dict, packed_batch=packed_batch, **packing,
            )  # fmt: skip
        return self._cached_forward(
            input_ids, attention_mask, global_attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions, output_hidden_states, return_dict, past_key_values,
        )  # fmt: skip

    def _refuse_packed_with_cache(
        self, input_ids, inputs_embeds, attention_mask, position_ids, packing: PackedBatchKwargs, packed_batch=None
    ) -> None:
        """A ``ValueError`` if a call with a cache is given a packed batch (a cache holds one state per row): in
        ``packing`` (the forward's :class:`~hf_xformers.ops.packing.PackedBatchKwargs`) or ``packed_batch``
        (``position_ids`` never mark documents: generate()'s are positions)."""
        ref = input_ids if input_ids is not None else inputs_embeds
        if ref is None or ref.dim() != (2 if input_ids is not None else 3):
            return  # the shape checks of the forward name the problem
        if packed_batch is None and not marks_documents(packing):
            return
        if packed_batch is not None or self.packed_batch(tuple(ref.shape[:2]), ref.device, position_ids, None, packing):
            raise ValueError(
                "A packed (padding-free) batch cannot be decoded with a cache: the cache keeps one running state per "
                "row, not per document. Pass use_cache=False (and no past_key_values) for packed training or "
                "encoding, and decode each document in its own row."
            )

    def _cached_forward(
        self, input_ids, attention_mask, global_attention_mask, token_type_ids, position_ids, inputs_embeds,
        output_attentions, output_hidden_states, return_dict, cache,
    ) -> HfxModelOutput | tuple:  # fmt: skip
        """:meth:`forward` with a cache: the new tokens only, every layer reading and updating its state."""
        if not self.config.is_decoder:
            raise ValueError(
                "A decoding cache needs causal attention: set config.is_decoder=True (or use_cache=False)."
            )
        if not isinstance(cache, HfxPerformerCache):
            raise ValueError(
                f"past_key_values must be an HfxPerformerCache, got {type(cache).__name__}; pass use_cache=True to "
                "start one."
            )
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if output_attentions and cache.seen_tokens and cache.inputs is None:
            raise ValueError(
                "This cache was started without output_attentions=True, so it kept no inputs to form attention "
                "probabilities from: ask for attentions from the first call on (generate() does), or pass "
                "use_cache=False."
            )
        new = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if attention_mask is not None and attention_mask.shape[-1] == cache.seen_tokens + new:
            attention_mask = attention_mask[:, -new:]  # generate() passes the mask of every token so far
        self._check_inputs(input_ids, inputs_embeds, attention_mask, global_attention_mask, token_type_ids)
        if cache.seen_tokens + new > self.embeddings.max_tokens:
            raise ValueError(
                f"{cache.seen_tokens} cached + {new} new tokens exceed the {self.embeddings.max_tokens} positions of "
                f"this model (config.max_position_embeddings={self.config.max_position_embeddings})."
            )
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        padding_idx = self.embeddings.padding_idx
        if position_ids is None:
            reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
            counted = (
                input_ids.ne(padding_idx) if input_ids is not None else torch.ones_like(reference, dtype=torch.bool)
            ).long()
            start = cache.last_position - padding_idx if cache.last_position is not None else 0
            position_ids = (counted.cumsum(-1) + (start[:, None] if torch.is_tensor(start) else start)) * counted
            position_ids = position_ids + padding_idx
        batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        last = position_ids.amax(-1).expand(batch)  # position_ids may be (1, new), shared by the batch
        cache.last_position = last if cache.last_position is None else torch.maximum(cache.last_position, last)
        hidden = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if output_attentions or cache.inputs is not None:
            real = attention_mask if attention_mask is not None else hidden.new_ones(batch, new, dtype=torch.bool)
            fresh = cache.inputs is None
            cache.inputs = hidden if fresh else torch.cat([cache.inputs, hidden], dim=1)
            cache.key_mask = real if fresh else torch.cat([cache.key_mask, real], dim=1)
        attention_mask, _, attention_kwargs = self.prepare_attention_inputs(attention_mask, None, new)
        out = self.encoder(
            hidden, attention_mask, None, False, output_hidden_states, {**attention_kwargs, "cache": cache}
        )
        cache.seen_tokens += new
        out = HfxPerformerModelOutput(
            last_hidden_state=out.last_hidden_state,
            pooler_output=self.pooler(out.last_hidden_state) if self.pooler is not None else None,
            hidden_states=out.hidden_states,
            attentions=self._attentions_of_new_tokens(cache, new) if output_attentions else None,
            **{CACHE_NAME: cache},
        )
        return self._finish(out, return_dict)

    def _attentions_of_new_tokens(self, cache: HfxPerformerCache, new: int) -> tuple[torch.Tensor, ...]:
        """Per layer, the attention probabilities of the last ``new`` tokens over every token so far, ``(batch,
        heads, new, seen_tokens)``: the rows of the uncached causal forward over the inputs the cache kept. Causal
        FAVOR+ stabilises each key by the keys before it, so earlier rows never depend on later tokens and these
        rows are the ones an uncached forward over the whole sequence returns; the recurrent context of this call
        is the context they give, to rounding."""
        mask, _, attention_kwargs = self.prepare_attention_inputs(cache.key_mask, None, cache.inputs.shape[1])
        full = self.encoder(cache.inputs, mask, None, True, False, attention_kwargs)
        return tuple(probs[:, :, -new:] for probs in full.attentions)


class HfxPerformerForMaskedLM(HfxMaskedLMHeadMixin, HfxPerformerPreTrainedModel):
    """Performer with a masked-language-modelling head, its decoder tied to the input embeddings.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxPerformerConfig, HfxPerformerForMaskedLM
        >>> config = HfxPerformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, num_random_features=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxPerformerForMaskedLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> labels = torch.full_like(input_ids, -100)  # -100: no loss
        >>> labels[:, 7] = input_ids[:, 7]
        >>> input_ids[:, 7] = 4  # <mask> in RoBERTa's vocabulary
        >>> out = model(input_ids, labels=labels)
        >>> out.logits.shape, out.loss.dim()
        (torch.Size([2, 40, 100]), 0)
    """

    base_model_class = HfxPerformerModel
    _tied_weights_keys = {"lm_head.decoder.weight": "performer.embeddings.word_embeddings.weight"}


class HfxPerformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxPerformerPreTrainedModel):
    """Performer with a classification or regression head on the first token (``<s>``), or on the mean of the tokens
    with ``config.classifier_pooling = "mean"``; the loss follows ``config.problem_type``. A packed batch is classified
    per document.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxPerformerConfig
        >>> from hf_xformers import HfxPerformerForSequenceClassification
        >>> config = HfxPerformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, num_random_features=16,
        ...     max_position_embeddings=66, num_labels=3,
        ... )
        >>> model = HfxPerformerForSequenceClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> model(input_ids, labels=torch.tensor([0, 2])).logits.shape
        torch.Size([2, 3])
        >>> # Two documents of 25 and 15 tokens packed in one row, as
        >>> # DataCollatorForPackedDocuments sends them: one row of logits each
        >>> cu_seq_lens = torch.tensor([0, 25, 40], dtype=torch.int32)
        >>> out = model(input_ids[:1], labels=torch.tensor([1, 0]),
        ...             cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens,
        ...             max_length_q=25, max_length_k=25)
        >>> out.logits.shape
        torch.Size([2, 3])
    """

    base_model_class = HfxPerformerModel


class HfxPerformerForMultipleChoice(HfxMultipleChoiceHeadMixin, HfxPerformerPreTrainedModel):
    """Performer for multiple choice: every (context, choice) pair of ``(batch, num_choices, seq_len)`` inputs is scored
    from its pooled first token.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxPerformerConfig, HfxPerformerForMultipleChoice
        >>> config = HfxPerformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, num_random_features=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxPerformerForMultipleChoice(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 4, 24))  # 2 examples, 4 choices
        >>> input_ids[..., 16:18] = config.sep_token_id  # context </s></s> choice
        >>> model(input_ids, labels=torch.tensor([3, 0])).logits.shape
        torch.Size([2, 4])
    """

    base_model_class = HfxPerformerModel


class HfxPerformerForQuestionAnswering(HfxQuestionAnsweringHeadMixin, HfxPerformerPreTrainedModel):
    """Performer for extractive question answering: a start and an end logit for every token.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxPerformerConfig
        >>> from hf_xformers import HfxPerformerForQuestionAnswering
        >>> config = HfxPerformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, num_random_features=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxPerformerForQuestionAnswering(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> input_ids[:, 6:8] = config.sep_token_id  # question </s></s> context
        >>> start, end = torch.tensor([12, 20]), torch.tensor([14, 25])
        >>> out = model(input_ids, start_positions=start, end_positions=end)
        >>> out.start_logits.shape, out.end_logits.shape
        (torch.Size([2, 40]), torch.Size([2, 40]))
    """

    base_model_class = HfxPerformerModel


class HfxPerformerForTokenClassification(HfxTokenClassificationHeadMixin, HfxPerformerPreTrainedModel):
    """Performer with a per-token classification head (named entities, parts of speech).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxPerformerConfig
        >>> from hf_xformers import HfxPerformerForTokenClassification
        >>> config = HfxPerformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, num_random_features=16,
        ...     max_position_embeddings=66, num_labels=5,
        ... )
        >>> model = HfxPerformerForTokenClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> model(input_ids, labels=torch.randint(0, 5, (2, 40))).logits.shape
        torch.Size([2, 40, 5])
    """

    base_model_class = HfxPerformerModel


class HfxPerformerForCausalLM(HfxCausalLMHeadMixin, HfxPerformerPreTrainedModel, GenerationMixin):
    """Left-to-right language model on causal FAVOR+ attention; the decoder is tied to the input embeddings.

    Inputs, labels and outputs as in :class:`~hf_xformers.layers.heads.HfxCausalLMHeadMixin` (the config is copied
    with ``is_decoder=True`` when it is not a decoder's; labels are shifted inside). ``generate()`` (greedy,
    sampling, beam search; ``pipeline("text-generation")``) keeps an :class:`HfxPerformerCache`: per layer the
    running sums of causal linear attention, so each new token costs the same whatever the length of the prefix;
    ``use_cache=False`` recomputes the whole prefix every step instead (the same tokens). With
    ``output_attentions=True`` a cached step also returns its new tokens' attention rows over every token so far
    (:meth:`HfxPerformerModel._attentions_of_new_tokens`).

    Positions are RoBERTa's (from ``padding_idx + 1``, ``padding_idx`` at padding). ``generate()`` counts them as
    transformers' ``generate()`` does for every model, from 0 over the attention mask (the ``position_ids`` it makes,
    continues and accepts: pass those, not table indices), and :meth:`prepare_inputs_for_generation` moves them onto
    the table; left padding works, and ``generate(position_ids=...)`` with the positions ``generate()`` would infer
    gives the same tokens as without them.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxPerformerConfig, HfxPerformerForCausalLM
        >>> config = HfxPerformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, num_random_features=16,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxPerformerForCausalLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 12))
        >>> out = model(input_ids, labels=input_ids)  # shifted inside
        >>> out.logits.shape
        torch.Size([2, 12, 100])
        >>> model.generate(input_ids, min_new_tokens=4, max_new_tokens=4).shape
        torch.Size([2, 16])
    """

    base_model_class = HfxPerformerModel
    generation_cache_class = HfxPerformerCache
    _tied_weights_keys = {"lm_head.decoder.weight": "performer.embeddings.word_embeddings.weight"}

    # ----- generation --------------------------------------------------------------------------------------
    def prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, use_cache: bool | None = None,
        **kwargs,
    ) -> dict:  # fmt: skip
        """The shared step inputs, with ``generate()``'s positions ``(batch or 1, new)``, counted from 0 over the
        attention mask, moved onto RoBERTa's table: ``+ embeddings.position_offset`` for real tokens,
        ``padding_idx`` where the mask ``(batch, seen + new)`` is 0."""
        inputs = super().prepare_inputs_for_generation(input_ids, attention_mask, use_cache, **kwargs)
        positions = inputs.get("position_ids")
        if positions is not None:
            embeddings = self.performer.embeddings
            positions = positions + embeddings.position_offset
            if attention_mask is not None:
                real = attention_mask[:, -positions.shape[-1] :].bool()
                positions = torch.where(real, positions, torch.full_like(positions, embeddings.padding_idx))
            inputs["position_ids"] = positions
        return inputs
