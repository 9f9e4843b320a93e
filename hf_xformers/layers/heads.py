"""The task heads: masked LM, sequence classification, multiple choice, question answering, token classification,
and the causal LM of the decoders.

Each ``Hfx*HeadMixin`` holds the whole ``__init__``/``forward`` of one task on the plumbing of
:class:`~hf_xformers.layers.head_base.HfxHeadMixin`; an architecture gets the head by mixing it into its
``PreTrainedModel`` subclass and naming its base model class::

    class HfxLongformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxLongformerPreTrainedModel):
        base_model_class = HfxLongformerModel

Masked LM, sequence and token classification share one ``forward`` (:class:`HfxLogitsHeadMixin`: ``labels`` in,
``logits`` out) and say only how their logits and loss are made. A packed batch (boundaries in any form of
``DataCollatorWithFlattening``) is answered per document where the task is per document: sequence classification
``(num_documents, num_labels)``, multiple choice ``(num_examples, num_choices)``, QA one row of start / end logits per
document; the token-level heads keep the packed row.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput
from typing_extensions import Unpack

from ..ops.compat import CACHE_NAME, output_cache, resolve_cache_argument
from ..ops.packing import CuSeqLensKwargs, PackedBatch, packing_kwargs
from .generation import HfxGenerationMixin
from .head_base import HfxHeadMixin, HfxLMHeadMixin

# The names below moved to the modules of one idea each; they stay importable from here (`from ..layers.heads import
# X`), the path the architectures and user code import them by.
from .head_layers import HfxClassificationHead, HfxLMHead, classifier_dropout, classifier_from_pooler  # noqa: F401
from .losses import (  # noqa: F401
    causal_lm_loss,
    check_class_labels,
    check_sequence_labels,
    multiple_choice_loss,
    next_token_labels,
    problem_type,
    sequence_classification_loss,
    span_loss,
    token_cross_entropy,
)
from .pooling import (  # noqa: F401
    CLASSIFIER_POOLINGS,
    UNMARKED_DOCUMENTS_FIX,
    check_document_count,
    check_row_count,
    classifier_pooling,
    pool_documents,
    pool_tokens,
    unpack_document_rows,
)


class HfxLogitsHeadMixin(HfxHeadMixin):
    """The ``forward`` of a head that scores ``logits`` against ``labels`` (masked LM, sequence and token
    classification): a task sets :attr:`output_class` and says how its logits and loss are made
    (:meth:`head_logits`, :meth:`head_loss`)."""

    output_class: type[ModelOutput]

    def head_logits(
        self, out: ModelOutput, attention_mask: torch.Tensor | None, documents: PackedBatch | None
    ) -> torch.Tensor:
        """The task's logits from the base model's output ``out``."""
        raise NotImplementedError

    def head_loss(self, logits: torch.Tensor, labels: torch.Tensor, documents: PackedBatch | None) -> torch.Tensor:
        """The task's loss of ``logits`` against ``labels``."""
        raise NotImplementedError

    def check_labels(self, labels: torch.Tensor) -> None:
        """Refuse ``labels`` the loss cannot score before the model runs (nothing to check by default)."""

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
        *,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> ModelOutput | tuple:
        """Score a batch (or a packed batch of documents): ``logits``, and the loss when ``labels`` are given.

        Args:
            input_ids: ``(batch, seq_len)`` token ids, or a packed row ``(1, total_tokens)``.
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding (None: nothing is padded).
            global_attention_mask: ``(batch, seq_len)``, 1 for tokens that attend to and are attended by every token
                (Longformer only, the other architectures refuse it; None: the task's default, ``<s>`` for sequence
                classification, none for the token-level tasks).
            token_type_ids: ``(batch, seq_len)`` segment ids.
            position_ids: ``(batch, seq_len)`` positions (None: counted from the model's first position); positions
                only, they never mark documents.
            inputs_embeds: ``(batch, seq_len, hidden)``, instead of ``input_ids``.
            labels: masked LM and token classification: ``(batch, seq_len)`` ids or classes, -100 where no loss is
                wanted; sequence classification: ``(batch,)`` class ids (``problem_type`` single-label), floats
                (regression, ``num_labels=1``) or ``(batch, num_labels)`` multi-hot floats (multi-label); one per
                document of a packed batch.
            output_attentions: also return every layer's attention probabilities.
            output_hidden_states: also return the hidden states after the embeddings and after every layer.
            return_dict: a ``ModelOutput`` (None: ``config.return_dict``) or a plain tuple.
            seq_idx: ``(batch, seq_len)``, the document of every token of a packed batch
                (``DataCollatorWithFlattening(return_seq_idx=True)``; named so that ``Trainer`` keeps a pre-packed
                dataset's column).
            **kwargs: the boundaries of a packed row as ``DataCollatorWithFlattening`` and
                ``DataCollatorForPackedDocuments`` return them (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`:
                ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``(num_documents + 1,)`` with ``max_length_q`` /
                ``max_length_k``); every document then gets what its own forward gives.

        Returns:
            ``MaskedLMOutput``, ``SequenceClassifierOutput`` or ``TokenClassifierOutput`` (the head's
            ``output_class``): ``loss`` (a scalar, with ``labels``), ``logits`` (masked LM ``(batch, seq_len,
            vocab_size)``; sequence classification ``(batch, num_labels)``, a packed batch ``(num_documents,
            num_labels)``; token classification ``(batch, seq_len, num_labels)``; a packed batch keeps its row
            ``(1, total_tokens, ...)`` for the token-level tasks), ``hidden_states`` and ``attentions`` when asked.
        """
        if labels is not None:
            self.check_labels(labels)
        documents, out = self._encode_batch(
            input_ids, attention_mask, global_attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions, output_hidden_states, kwargs, seq_idx,
        )  # fmt: skip
        logits = self.head_logits(out, attention_mask, documents)
        loss = None if labels is None else self.head_loss(logits, labels, documents)
        return self._finish(self._head_result(self.output_class, out, loss, logits=logits), return_dict)


class HfxMaskedLMHeadMixin(HfxLMHeadMixin, HfxLogitsHeadMixin):
    """Masked language modelling: ``logits`` ``(batch, seq_len, vocab_size)``, ``labels`` ``(batch, seq_len)``, -100
    where no loss is wanted. A packed batch keeps its row: ``(1, total_tokens, vocab_size)``."""

    task = "masked_lm"
    output_class = MaskedLMOutput
    sequence_parallel_token_outputs = True

    def head_logits(self, out, attention_mask, documents) -> torch.Tensor:
        return self.lm_head(out.last_hidden_state)

    def head_loss(self, logits, labels, documents) -> torch.Tensor:
        return token_cross_entropy(logits, labels)


class HfxSequenceClassificationHeadMixin(HfxLogitsHeadMixin):
    """Sentence (pair) classification or regression from the first token (or the mean of the tokens, with
    ``config.classifier_pooling = "mean"``); see :func:`~hf_xformers.layers.losses.sequence_classification_loss`.

    ``logits`` ``(batch, num_labels)``; ``labels`` ``(batch,)`` (or ``(batch, num_labels)`` multi-label). A packed
    batch is classified per document: ``logits`` ``(num_documents, num_labels)`` and ``labels`` ``(num_documents,)``,
    each document pooled from its own first token (or its own tokens' mean)."""

    task = "sequence_classification"
    output_class = SequenceClassifierOutput

    def __init__(self, config) -> None:
        super().__init__(config)
        self._build_base_model(config)
        self.classifier = HfxClassificationHead(config, self.head_input_size(config))
        self.post_init()

    @classmethod
    def own_checkpoint_renames(cls, tensor_names: set[str]) -> dict[str, str]:
        # A checkpoint with a pooler and no head (a converted BERT) starts `classifier.dense` from the pooler.
        return classifier_from_pooler(cls.__name__, cls.base_model_prefix, tensor_names)

    def head_logits(self, out, attention_mask, documents) -> torch.Tensor:
        return self.classifier(out.last_hidden_state, attention_mask, documents)

    def head_loss(self, logits, labels, documents) -> torch.Tensor:
        # One label per sequence (a multi-hot row each for multi-label): a default collator stacks a pre-packed
        # row's per-document labels into (1, num_documents), which must count as that many labels.
        multi_label = problem_type(self.config, labels) == "multi_label_classification"
        given = labels.shape[0] if multi_label and labels.dim() else labels.numel()
        if documents is None:
            check_row_count("labels", given, logits.shape[0])
        else:
            fix = (
                "give one label per document (DataCollatorForPackedDocuments collects them from the features), in the "
                "order the documents are packed."
            )
            check_document_count("labels", given, documents, fix)
        return sequence_classification_loss(logits, labels, self.config)

    def check_labels(self, labels: torch.Tensor) -> None:
        check_sequence_labels(labels, self.config)


class HfxTokenClassificationHeadMixin(HfxLogitsHeadMixin):
    """Per-token labels (NER, POS): ``logits`` ``(batch, seq_len, num_labels)`` (a packed batch keeps its row:
    ``(1, total_tokens, num_labels)``), ``labels`` ``(batch, seq_len)``, -100 where no loss is wanted."""

    task = "token_classification"
    output_class = TokenClassifierOutput
    sequence_parallel_token_outputs = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self._build_base_model(config)
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def head_logits(self, out, attention_mask, documents) -> torch.Tensor:
        return self.classifier(self.dropout(out.last_hidden_state))

    def head_loss(self, logits, labels, documents) -> torch.Tensor:
        return token_cross_entropy(logits, labels)


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
    sequence_parallel_token_outputs = True

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
        *,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> CausalLMOutputWithPast | tuple:
        """Returns ``logits`` ``(batch, seq_len, vocab)`` (of the new tokens when a cache is passed back, as
        ``cache`` or ``past_key_values``), the cache when one is used (``use_cache=True``), and with ``labels`` or
        ``shift_labels`` the mean next-token cross-entropy (the sum over ``num_items_in_batch`` when Trainer passes
        it). A packed batch (``seq_idx`` or ``cu_seq_lens_q/k``, as ``DataCollatorWithFlattening`` returns them;
        ``kwargs``: :class:`~hf_xformers.ops.packing.CuSeqLensKwargs`) is read as documents that never see each other,
        and no document's last token is scored against the next document's first.

        Args:
            input_ids: ``(batch, seq_len)`` token ids (with a cache: the new tokens only), or a packed row
                ``(1, total_tokens)``.
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding; with a cache it may also cover the
                cached positions ``(batch, past + seq_len)``, as ``generate()`` passes it.
            token_type_ids: ``(batch, seq_len)`` segment ids.
            position_ids: ``(batch, seq_len)`` (None: counted on from the cache); positions only, they never mark
                documents.
            inputs_embeds: ``(batch, seq_len, hidden)``, instead of ``input_ids``.
            past_key_values: the cache an earlier call returned (its name before transformers 5.24).
            use_cache: start or continue a cache and return it (None: ``config.use_cache``).
            labels: ``(batch, seq_len)``, usually the input ids; -100 where no loss is wanted; shifted inside.
            shift_labels: ``(batch, seq_len)`` labels already aligned with the positions (used instead of ``labels``).
            num_items_in_batch: the number of scored tokens over the accumulated batch (Trainer): the loss is then
                their sum over it.
            output_attentions: also return every layer's attention probabilities.
            output_hidden_states: also return the hidden states after the embeddings and after every layer.
            return_dict: a ``CausalLMOutputWithPast`` (None: ``config.return_dict``) or a plain tuple.
            cache: the cache an earlier call returned (its name from transformers 5.24; either name works).
            seq_idx: ``(batch, seq_len)``, the document of every token of a packed batch.
            **kwargs: the boundaries of a packed row (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`:
                ``cu_seq_lens_q/k`` with ``max_length_q/k``).

        Returns:
            ``CausalLMOutputWithPast``: ``loss`` (with ``labels`` or ``shift_labels``), ``logits``
            ``(batch, seq_len, vocab_size)``, the cache (``use_cache=True``; as ``cache`` from transformers 5.24, else
            ``past_key_values``), ``hidden_states`` and ``attentions`` when asked.
        """
        packing = packing_kwargs(self, kwargs, seq_idx)
        documents = self._packed_batch(input_ids, inputs_embeds, position_ids, attention_mask, packing)
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
        *,
        num_choices: int | None = None,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> MultipleChoiceModelOutput | tuple:
        """Score every choice of every example: ``logits`` ``(batch, num_choices)``, and the loss with ``labels``.

        A packed batch is one row ``(1, total_tokens)`` whose documents are the (context, choice) pairs, example by
        example and choice by choice (``hf_xformers.padding_free.DataCollatorForPackedDocuments``), with the
        boundaries in either form of ``DataCollatorWithFlattening`` (``seq_idx``, or ``kwargs``:
        :class:`~hf_xformers.ops.packing.CuSeqLensKwargs`) and ``num_choices`` (or ``labels``, one per example, from
        which it follows).

        Args:
            input_ids: ``(batch, num_choices, seq_len)``: each (context, choice) pair tokenized, stacked per example;
                or a packed row ``(1, total_tokens)``.
            attention_mask: the shape of ``input_ids``, 1 for real tokens, 0 for padding.
            global_attention_mask: the shape of ``input_ids`` (Longformer only, the other architectures refuse it;
                None: the task's default, the choice's tokens after the first separator pair).
            token_type_ids: the shape of ``input_ids``, segment ids.
            position_ids: the shape of ``input_ids`` (positions only; in a packed row each document's own).
            inputs_embeds: ``input_ids``' shape plus ``hidden``, instead of ``input_ids``.
            labels: ``(batch,)``, the index of the right choice of each example.
            output_attentions: also return every layer's attention probabilities.
            output_hidden_states: also return the hidden states after the embeddings and after every layer.
            return_dict: a ``MultipleChoiceModelOutput`` (None: ``config.return_dict``) or a plain tuple.
            num_choices: choices per example of a packed row (None: the number of documents over ``labels``').
            seq_idx: ``(1, total_tokens)``, the document of every token of a packed row.
            **kwargs: the boundaries of a packed row (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`:
                ``cu_seq_lens_q/k`` with ``max_length_q/k``).

        Returns:
            ``MultipleChoiceModelOutput``: ``loss`` (cross-entropy over the choices, with ``labels``), ``logits``
            ``(batch, num_choices)``, ``hidden_states`` and ``attentions`` when asked.
        """
        packing = packing_kwargs(self, kwargs, seq_idx)
        ref = input_ids if input_ids is not None else inputs_embeds
        if labels is not None and ref is not None and ref.dim() == (3 if input_ids is not None else 4):
            check_class_labels(labels, ref.shape[1], "choice indices")
        documents = None
        if ref is not None and ref.dim() == (2 if input_ids is not None else 3):
            documents = self._packed_batch(input_ids, inputs_embeds, position_ids, attention_mask, packing)
        if documents is not None:
            out = self._encode(
                input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states, documents,
                token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
            )  # fmt: skip
            num_choices = self._packed_num_choices(documents, labels, num_choices)
        else:
            if ref is None or ref.dim() != (3 if input_ids is not None else 4):
                raise ValueError(
                    "Multiple-choice inputs must be shaped (batch, num_choices, seq_len); tokenize every "
                    "(context, choice) pair and stack them per example, or pack the pairs into one row with "
                    f"`num_choices` and the row's boundaries: this batch marks no documents; {UNMARKED_DOCUMENTS_FIX}"
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
        loss = None if labels is None else multiple_choice_loss(logits, labels)
        return self._finish(self._head_result(MultipleChoiceModelOutput, out, loss, logits=logits), return_dict)

    def _packed_num_choices(self, documents: PackedBatch, labels: torch.Tensor | None, num_choices: int | None) -> int:
        """The number of choices per example of a packed batch: ``num_choices``, or the number of documents over the
        number of ``labels``; a ``ValueError`` when the documents do not group into examples of that size."""
        count = documents.num_documents(type(self).__name__)
        if num_choices is None and labels is not None and labels.numel() and count % labels.numel() == 0:
            num_choices = count // labels.numel()
        if num_choices is None or count % num_choices or (labels is not None and labels.numel() * num_choices != count):
            raise ValueError(
                f"A packed multiple-choice batch holds {count} (context, choice) documents (padding is never a "
                f"document), which cannot be grouped into "
                f"{'examples' if labels is None else f'{labels.numel()} examples (one label each)'}"
                f"{'' if num_choices is None else f' of num_choices={num_choices}'}; pass `num_choices` and one "
                "label per example (the collator hf_xformers.padding_free.DataCollatorForPackedDocuments adds both)."
            )
        return num_choices


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
        *,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> QuestionAnsweringModelOutput | tuple:
        """Score every token as the start and the end of the answer span: ``start_logits`` and ``end_logits``,
        each ``(batch, seq_len)``, and the loss with ``start_positions`` and ``end_positions``.

        For a packed batch (boundaries in either form of ``DataCollatorWithFlattening``: ``seq_idx``, or ``kwargs``,
        :class:`~hf_xformers.ops.packing.CuSeqLensKwargs`) they are
        ``(num_documents, longest_document)``, one row per document as its own forward gives them (places beyond a
        document's end hold the dtype's lowest value, so no softmax picks them), and ``start_positions`` /
        ``end_positions`` ``(num_documents,)`` count from each document's first token.

        Args:
            input_ids: ``(batch, seq_len)``, question and context as a text pair, or a packed row
                ``(1, total_tokens)``.
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding.
            global_attention_mask: ``(batch, seq_len)`` (Longformer only, the other architectures refuse it; None:
                the task's default, the question's tokens before the first separator).
            token_type_ids: ``(batch, seq_len)`` segment ids.
            position_ids: ``(batch, seq_len)`` (positions only; in a packed row each document's own).
            inputs_embeds: ``(batch, seq_len, hidden)``, instead of ``input_ids``.
            start_positions: ``(batch,)`` index of the answer's first token; a position outside the input is ignored
                in the loss.
            end_positions: ``(batch,)`` index of the answer's last token.
            output_attentions: also return every layer's attention probabilities.
            output_hidden_states: also return the hidden states after the embeddings and after every layer.
            return_dict: a ``QuestionAnsweringModelOutput`` (None: ``config.return_dict``) or a plain tuple.
            seq_idx: ``(batch, seq_len)``, the document of every token of a packed batch.
            **kwargs: the boundaries of a packed row (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`:
                ``cu_seq_lens_q/k`` with ``max_length_q/k``).

        Returns:
            ``QuestionAnsweringModelOutput``: ``loss`` (the mean of the start and end cross-entropies, with both
            positions), ``start_logits`` and ``end_logits``, ``hidden_states`` and ``attentions`` when asked.
        """
        documents, out = self._encode_batch(
            input_ids, attention_mask, global_attention_mask, token_type_ids, position_ids, inputs_embeds,
            output_attentions, output_hidden_states, kwargs, seq_idx,
        )  # fmt: skip
        start_logits, end_logits = self.qa_outputs(out.last_hidden_state).unbind(-1)
        if documents is not None:
            lowest = torch.finfo(start_logits.dtype).min
            start_logits = unpack_document_rows(start_logits, documents, lowest)
            end_logits = unpack_document_rows(end_logits, documents, lowest)
        loss = None
        if start_positions is not None and end_positions is not None:
            start, end = self._span_targets(
                start_positions, end_positions, start_logits.shape[1], documents, start_logits.shape[0]
            )
            loss = span_loss(start_logits, end_logits, start, end)
        result = self._head_result(
            QuestionAnsweringModelOutput, out, loss,
            start_logits=start_logits.contiguous(), end_logits=end_logits.contiguous(),
        )  # fmt: skip
        return self._finish(result, return_dict)

    @staticmethod
    def _span_targets(
        start_positions: torch.Tensor, end_positions: torch.Tensor, ignored: int, documents: PackedBatch | None,
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(n,)`` start and end targets, ``ignored`` (the logits' width) where a position lies outside the input,
        as one past its end is ignored; in a packed batch, outside its document (positions count from the document's
        first token, one per document). ``rows``: the logits' rows (one per row of an ordinary batch)."""
        if documents is None:
            check_row_count("start_positions", start_positions.numel(), rows)
            check_row_count("end_positions", end_positions.numel(), rows)
            return start_positions.view(-1).clamp(0, ignored), end_positions.view(-1).clamp(0, ignored)
        fix = "give one start and one end position per document, counted from the document's first token."
        check_document_count("start_positions", start_positions.numel(), documents, fix)
        check_document_count("end_positions", end_positions.numel(), documents, fix)
        lengths = documents.lengths().to(start_positions.device)
        start = start_positions.view(-1).clamp(min=0)
        end = end_positions.view(-1).clamp(min=0)
        return start.masked_fill(start >= lengths, ignored), end.masked_fill(end >= lengths, ignored)
