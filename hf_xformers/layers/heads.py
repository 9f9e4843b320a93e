"""Task heads shared by the text architectures: the encoder tasks, and the causal LM of the decoders.

Each ``Hfx*HeadMixin`` holds the whole ``__init__``/``forward`` of one task; an architecture gets the head by
mixing it into its ``PreTrainedModel`` subclass and naming its base model class::

    class HfxLongformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxLongformerPreTrainedModel):
        base_model_class = HfxLongformerModel

The base model is stored under ``base_model_prefix`` (``self.longformer`` ...) so checkpoints keep the names
users know from ``transformers``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import gelu
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from ..ops.compat import CACHE_NAME, output_cache, resolve_cache_argument
from ..ops.input_checks import reads_values
from ..ops.packing import PackedBatch, resolve_packed_batch
from .generation import HfxGenerationMixin, forward_parameters


class HfxLMHead(nn.Module):
    """``decoder(LayerNorm(gelu(dense(h))))``, RoBERTa's MLM head; ``decoder.weight`` is tied to the input
    embeddings. ``(batch, seq_len, hidden)`` -> ``(batch, seq_len, vocab)``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(gelu(self.dense(hidden_states))))


CLASSIFIER_POOLINGS = ("first", "mean")


def pool_tokens(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pooling: str,
    packed: PackedBatch | None = None,
) -> torch.Tensor:
    """One vector per sequence: ``(batch, seq_len, hidden)`` -> ``(batch, hidden)``; for a packed batch
    (:class:`~hf_xformers.ops.packing.PackedBatch`) one per document, ``(num_documents, hidden)``.

    ``"first"``: the first token (RoBERTa's ``<s>``). ``"mean"``: the mean over real tokens (``attention_mask``
    ``(batch, seq_len)``, 1 = real; all tokens when None), as the Long Range Arena's models pool. Packed documents are
    gathered with ``index_add`` into one slot each (padding into a slot that is dropped): no boolean index, no read.
    """
    if packed is not None:
        return pool_documents(hidden_states, packed, pooling)
    if pooling == "first":
        return hidden_states[:, 0]
    if attention_mask is None:
        return hidden_states.mean(1)
    weights = attention_mask.to(hidden_states.dtype)[..., None]
    return (hidden_states * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def pool_documents(hidden_states: torch.Tensor, packed: PackedBatch, pooling: str = "first") -> torch.Tensor:
    """``(batch, seq_len, hidden)`` -> ``(num_documents, hidden)``: each document's first token, or the mean of its
    tokens (padding never counts)."""
    if pooling == "first":
        return packed.first_tokens(hidden_states)
    count = packed.num_documents()
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    slots = packed.slots()
    sums = flat.new_zeros(count + 1, flat.shape[-1]).index_add(0, slots, flat)[:count]
    counts = flat.new_zeros(count + 1).index_add(0, slots, flat.new_ones(slots.shape))[:count]
    return sums / counts.clamp(min=1.0)[:, None]


def unpack_document_rows(values: torch.Tensor, packed: PackedBatch, fill: float) -> torch.Tensor:
    """A packed ``(batch, seq_len)`` tensor as one row per document ``(num_documents, longest)``, places past a
    document's end set to ``fill`` (padding dropped)."""
    count, longest = packed.num_documents(), packed.longest_document()
    out = values.new_full((count + 1, longest), fill)
    positions = packed.positions.clamp(max=longest - 1)  # padding runs may be longer; their slot is dropped
    out = out.index_put((packed.index.reshape(-1), positions.reshape(-1)), values.reshape(-1))
    return out[:count]


def check_document_count(what: str, given: int, packed: PackedBatch, fix: str) -> None:
    """A ``ValueError`` when a per-document input (``labels``, QA positions) does not hold one entry per document."""
    count = packed.num_documents()
    if given != count:
        raise ValueError(
            f"This packed batch holds {count} documents (padding is never a document) but `{what}` has {given} "
            f"entries; {fix}"
        )


def classifier_pooling(config) -> str:
    """``config.classifier_pooling`` (``"first"`` when unset), checked against :data:`CLASSIFIER_POOLINGS`."""
    pooling = getattr(config, "classifier_pooling", None) or "first"
    if pooling not in CLASSIFIER_POOLINGS:
        raise ValueError(f"classifier_pooling must be one of {CLASSIFIER_POOLINGS}, got {pooling!r}.")
    return pooling


class HfxClassificationHead(nn.Module):
    """RoBERTa's sentence head: ``out_proj(dropout(tanh(dense(dropout(pooled)))))``, ``pooled`` the first token or,
    with ``config.classifier_pooling = "mean"``, the mean of the real tokens (:func:`pool_tokens`)."""

    def __init__(self, config, in_features: int | None = None) -> None:
        super().__init__()
        self.pooling = classifier_pooling(config)
        self.dense = nn.Linear(in_features or config.hidden_size, config.hidden_size)
        dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        packed: PackedBatch | None = None,
    ) -> torch.Tensor:
        """``(batch, seq_len, hidden)`` (and the ``(batch, seq_len)`` mask for mean pooling) -> ``(batch, num_labels)``;
        for a packed batch ``(num_documents, num_labels)``."""
        pooled = pool_tokens(hidden_states, attention_mask, self.pooling, packed)
        x = torch.tanh(self.dense(self.dropout(pooled)))
        return self.out_proj(self.dropout(x))


def token_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``(..., num_classes)`` against ``targets`` ``(...)``, positions equal to
    ``ignore_index`` left out: the mean over the scored positions, or their sum divided by ``num_items_in_batch``
    (Trainer's count of scored tokens across gradient-accumulation steps). A batch with no scored position gives 0
    with zero gradients (a plain mean gives NaN, which would poison accumulated gradients)."""
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).to(logits.device)
    total = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / (flat_targets != ignore_index).sum().clamp(min=1)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Next-token loss as transformers' causal LMs compute it: ``labels`` ``(batch, seq_len)`` are the input ids
    (-100 = no loss) and position ``t`` is scored against ``labels[:, t + 1]``; ``shift_labels``, already shifted,
    take precedence (Trainer sends both under context parallelism). None when neither is given."""
    if shift_labels is None:
        if labels is None:
            return None
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return token_cross_entropy(logits, shift_labels, num_items_in_batch)


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """Loss by ``config.problem_type`` (set on first use as transformers does): ``regression`` (MSE, e.g.
    STS-B, when ``num_labels == 1``), ``single_label_classification`` (cross-entropy on integer labels) or
    ``multi_label_classification`` (BCE with logits on float multi-hot labels)."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1), labels.squeeze(-1).to(logits.dtype))
    if config.problem_type == "single_label_classification":
        if (
            labels.numel()
            and reads_values(labels)
            and (int(labels.max()) >= config.num_labels or int(labels.min()) < -100)
        ):
            raise ValueError(
                f"labels must lie in [0, {config.num_labels - 1}] (config.num_labels={config.num_labels}); "
                f"got values from {int(labels.min())} to {int(labels.max())}. Set num_labels when loading the model."
            )
        return F.cross_entropy(logits.view(-1, config.num_labels), labels.view(-1))
    if config.problem_type == "multi_label_classification":
        if labels.shape != logits.shape:
            raise ValueError(
                f"multi-label labels must be multi-hot floats of shape {tuple(logits.shape)}, got {tuple(labels.shape)}."
            )
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    raise ValueError(
        f"Unknown config.problem_type {config.problem_type!r}; use 'regression', "
        "'single_label_classification' or 'multi_label_classification'."
    )


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
        self, input_ids, inputs_embeds, position_ids, attention_mask, seq_idx=None, cu_seq_lens_q=None,
        cu_seq_lens_k=None, max_length_q=None, max_length_k=None, cached: bool = False,
    ) -> PackedBatch | None:  # fmt: skip
        """The documents of a packed batch (:class:`~hf_xformers.ops.packing.PackedBatch`), worked out once here from
        whichever of the collator's forms arrived and handed to the base model as ``packed_batch``, or None for an
        ordinary batch. ``cached``: the call continues a cache, whose positions are never read as boundaries while
        tracing (a compiled decoding step)."""
        ref = input_ids if input_ids is not None else inputs_embeds
        if ref is None or ref.dim() < 2:
            return None
        return resolve_packed_batch(
            tuple(ref.shape[:2]), ref.device, position_ids, seq_idx, cu_seq_lens_q, cu_seq_lens_k, max_length_q,
            max_length_k, attention_mask, positions_while_tracing=not cached,
        )  # fmt: skip

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
            if packed is None:
                global_attention_mask = self.default_global_attention_mask(self.task, input_ids, attention_mask)
            else:
                global_attention_mask = self.default_global_attention_mask(
                    self.task, input_ids, attention_mask, document_ids=packed.document_ids
                )
        if global_attention_mask is not None:
            if "global_attention_mask" not in forward_parameters(self.base_model_class):
                raise ValueError(
                    f"{type(self).__name__} has no global attention: drop `global_attention_mask` (only Longformer "
                    "and BigBird read it)."
                )
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
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
            shift_labels = shift_labels.masked_fill(F.pad(documents.starts, (0, 1))[:, 1:], -100)
        loss = causal_lm_loss(logits, labels, shift_labels, num_items_in_batch)
        result = self._head_result(CausalLMOutputWithPast, out, loss, logits=logits, **{CACHE_NAME: output_cache(out)})
        return self._finish(result, return_dict)


class HfxMaskedLMHeadMixin(HfxLMHeadMixin):
    """Masked language modelling. ``labels`` ``(batch, seq_len)``, -100 where no loss is wanted."""

    task = "masked_lm"

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        seq_idx: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
    ) -> MaskedLMOutput | tuple:
        """Returns ``logits`` ``(batch, seq_len, vocab_size)`` and the loss when ``labels`` are given. A packed batch
        (boundaries in any form of ``DataCollatorWithFlattening``) keeps its row: ``(1, total_tokens, vocab_size)``."""
        documents = self._packed_batch(
            input_ids, inputs_embeds, position_ids, attention_mask,
            seq_idx, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
        )  # fmt: skip
        out = self._encode(
            input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states, documents,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
        )  # fmt: skip
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels)
        return self._finish(self._head_result(MaskedLMOutput, out, loss, logits=logits), return_dict)


class HfxSequenceClassificationHeadMixin(HfxHeadMixin):
    """Sentence (pair) classification or regression from the first token (or the mean of the tokens, with
    ``config.classifier_pooling = "mean"``); see :func:`sequence_classification_loss`."""

    task = "sequence_classification"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._build_base_model(config)
        self.classifier = HfxClassificationHead(config, self.head_input_size(config))
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        seq_idx: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
    ) -> SequenceClassifierOutput | tuple:
        """Returns ``logits`` ``(batch, num_labels)``; ``labels`` ``(batch,)`` (or ``(batch, num_labels)`` multi-label).

        A packed batch (boundaries in any form of ``DataCollatorWithFlattening``) is classified per document:
        ``logits`` ``(num_documents, num_labels)`` and ``labels`` ``(num_documents,)``, each document pooled from its
        own first token (or its own tokens' mean)."""
        documents = self._packed_batch(
            input_ids, inputs_embeds, position_ids, attention_mask,
            seq_idx, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
        )  # fmt: skip
        out = self._encode(
            input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states, documents,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
        )  # fmt: skip
        if documents is not None and labels is not None:
            check_document_count(
                "labels",
                labels.shape[0] if labels.dim() else 1,
                documents,
                "give one label per document (DataCollatorForPackedDocuments "
                "collects them from the features), in the order the documents are packed.",
            )
        logits = self.classifier(out.last_hidden_state, attention_mask, documents)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return self._finish(self._head_result(SequenceClassifierOutput, out, loss, logits=logits), return_dict)


class HfxMultipleChoiceHeadMixin(HfxHeadMixin):
    """Scores each choice from its pooled first token. Inputs are ``(batch, num_choices, seq_len)``."""

    task = "multiple_choice"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._build_base_model(config, add_pooling_layer=True)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        seq_idx: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        num_choices: int | None = None,
    ) -> MultipleChoiceModelOutput | tuple:
        """Returns ``logits`` ``(batch, num_choices)``; ``labels`` ``(batch,)`` holds the right choice.

        A packed batch is one row ``(1, total_tokens)`` whose documents are the (context, choice) pairs, example by
        example and choice by choice (``hf_xformers.padding_free.DataCollatorForPackedDocuments``), with the
        boundaries in any form of ``DataCollatorWithFlattening`` and ``num_choices`` (or ``labels``, one per example,
        from which it follows)."""
        ref = input_ids if input_ids is not None else inputs_embeds
        documents = None
        if ref is not None and ref.dim() == (2 if input_ids is not None else 3):
            documents = self._packed_batch(
                input_ids, inputs_embeds, position_ids, attention_mask,
                seq_idx, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
            )  # fmt: skip
        if documents is not None:
            out = self._encode(
                input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states, documents,
                token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
            )  # fmt: skip
            count = documents.num_documents(type(self).__name__)
            if num_choices is None and labels is not None and labels.numel() and count % labels.numel() == 0:
                num_choices = count // labels.numel()
            if (
                num_choices is None
                or count % num_choices
                or (labels is not None and labels.numel() * num_choices != count)
            ):
                raise ValueError(
                    f"A packed multiple-choice batch holds {count} (context, choice) documents (padding is never a "
                    f"document), which cannot be grouped into "
                    f"{'examples' if labels is None else f'{labels.numel()} examples (one label each)'}"
                    f"{'' if num_choices is None else f' of num_choices={num_choices}'}; pass `num_choices` and one "
                    "label per example (the collator hf_xformers.padding_free.DataCollatorForPackedDocuments adds "
                    "both)."
                )
            scores = self.classifier(self.dropout(out.pooler_output)).view(-1)
            logits = scores.view(-1, num_choices)
        else:
            if ref is None or ref.dim() != (3 if input_ids is not None else 4):
                raise ValueError(
                    "Multiple-choice inputs must be shaped (batch, num_choices, seq_len); tokenize every "
                    "(context, choice) pair and stack them per example (or pack the pairs into one row with "
                    "`num_choices`)."
                )
            num_choices = ref.shape[1]

            def flat(t):
                return None if t is None else t.reshape(-1, *t.shape[2:])

            out = self._encode(
                flat(input_ids), flat(attention_mask), flat(global_attention_mask), output_attentions,
                output_hidden_states, token_type_ids=flat(token_type_ids), position_ids=flat(position_ids),
                inputs_embeds=flat(inputs_embeds),
            )  # fmt: skip
            logits = self.classifier(self.dropout(out.pooler_output)).view(-1, num_choices)
        loss = None
        if labels is not None:
            if labels.numel() and reads_values(labels) and (int(labels.max()) >= num_choices or int(labels.min()) < 0):
                raise ValueError(f"labels must be choice indices in [0, {num_choices - 1}], got {labels.tolist()}.")
            loss = F.cross_entropy(logits, labels.view(-1))
        return self._finish(self._head_result(MultipleChoiceModelOutput, out, loss, logits=logits), return_dict)


class HfxQuestionAnsweringHeadMixin(HfxHeadMixin):
    """Extractive QA: start and end logits per token. Positions outside the input are ignored in the loss."""

    task = "question_answering"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._build_base_model(config)
        self.qa_outputs = nn.Linear(self.head_input_size(config), 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        seq_idx: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
    ) -> QuestionAnsweringModelOutput | tuple:
        """Returns ``start_logits`` and ``end_logits``, each ``(batch, seq_len)``.

        For a packed batch (boundaries in any form of ``DataCollatorWithFlattening``) they are
        ``(num_documents, longest_document)``, one row per document as its own forward gives them (places beyond a
        document's end hold the dtype's lowest value, so no softmax picks them), and ``start_positions`` /
        ``end_positions`` ``(num_documents,)`` count from each document's first token."""
        documents = self._packed_batch(
            input_ids, inputs_embeds, position_ids, attention_mask,
            seq_idx, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
        )  # fmt: skip
        out = self._encode(
            input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states, documents,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
        )  # fmt: skip
        start_logits, end_logits = self.qa_outputs(out.last_hidden_state).unbind(-1)
        loss = None
        if documents is not None:
            lowest = torch.finfo(start_logits.dtype).min
            start_logits = unpack_document_rows(start_logits, documents, lowest)
            end_logits = unpack_document_rows(end_logits, documents, lowest)
            if start_positions is not None and end_positions is not None:
                fix = "give one start and one end position per document, counted from the document's first token."
                check_document_count("start_positions", start_positions.numel(), documents, fix)
                check_document_count("end_positions", end_positions.numel(), documents, fix)
                # A position outside its document is ignored, as one past the end of an unpacked sequence is.
                ignored = start_logits.shape[1]
                lengths = documents.lengths().to(start_logits.device)
                start = start_positions.view(-1).clamp(min=0)
                end = end_positions.view(-1).clamp(min=0)
                start = start.masked_fill(start >= lengths, ignored)
                end = end.masked_fill(end >= lengths, ignored)
                loss = (
                    token_cross_entropy(start_logits, start, ignore_index=ignored)
                    + token_cross_entropy(end_logits, end, ignore_index=ignored)
                ) / 2
        elif start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (
                token_cross_entropy(start_logits, start, ignore_index=ignored)
                + token_cross_entropy(end_logits, end, ignore_index=ignored)
            ) / 2
        result = self._head_result(
            QuestionAnsweringModelOutput, out, loss,
            start_logits=start_logits.contiguous(), end_logits=end_logits.contiguous(),
        )  # fmt: skip
        return self._finish(result, return_dict)


class HfxTokenClassificationHeadMixin(HfxHeadMixin):
    """Per-token labels (NER, POS). ``labels`` ``(batch, seq_len)``, -100 where no loss is wanted."""

    task = "token_classification"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._build_base_model(config)
        dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        seq_idx: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
    ) -> TokenClassifierOutput | tuple:
        """Returns ``logits`` ``(batch, seq_len, num_labels)`` (a packed batch keeps its row:
        ``(1, total_tokens, num_labels)``)."""
        documents = self._packed_batch(
            input_ids, inputs_embeds, position_ids, attention_mask,
            seq_idx, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
        )  # fmt: skip
        out = self._encode(
            input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states, documents,
            token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
        )  # fmt: skip
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels)
        return self._finish(self._head_result(TokenClassifierOutput, out, loss, logits=logits), return_dict)
