"""``hfx-longformer``: RoBERTa with sliding-window + global attention (Beltagy et al., 2020).

The attention itself lives in ``hf_xformers/attention/sliding_window.py``; this file wires it into the shared
encoder and heads and chooses the default global tokens of each task (the paper's recipe).
"""

from __future__ import annotations

import torch

from ...attention.sliding_window import HfxSlidingWindowSelfAttention, varlen_boundaries
from ...attention.sliding_window_layout import first_token_sizes
from ...layers.heads import (
    HfxMaskedLMHeadMixin,
    HfxMultipleChoiceHeadMixin,
    HfxQuestionAnsweringHeadMixin,
    HfxSequenceClassificationHeadMixin,
    HfxTokenClassificationHeadMixin,
)
from ...layers.pretrained import HfxPreTrainedModel
from ...layers.text_model import HfxTextModel
from ...ops.input_checks import is_tracing, reads_values, refuse
from ...ops.packing import PackedBatch, document_starts
from .configuration_longformer import HfxLongformerConfig


class HfxLongformerPreTrainedModel(HfxPreTrainedModel):
    config_class = HfxLongformerConfig
    base_model_prefix = "longformer"
    sequence_parallel_refusal = None  # Ulysses: each rank runs the whole sequence on heads / sp_size heads
    _no_split_modules = ["HfxEncoderLayer"]
    # Its band, global tokens and padding as FlexAttention's BlockMask (sliding_window_layout.band_block_mask).
    _supports_flex_attn = True

    def default_global_attention_mask(
        self,
        task: str,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The paper's defaults, as in transformers' Longformer heads:

        * sequence classification: ``<s>`` is global;
        * question answering: the question, i.e. every token before the first ``sep_token_id``;
        * multiple choice: the choice, i.e. every token after the first ``</s></s>`` pair;
        * masked LM and token classification: no global token.

        ``input_ids`` / ``attention_mask``: ``(batch, seq_len)``. With ``document_ids`` ``(batch, seq_len)`` (a packed
        batch, :mod:`~hf_xformers.ops.packing`) each rule applies to every document: its first token, the tokens before
        its first separator, the tokens after its first separator pair. Returns ``(batch, seq_len)`` bool or None.

        Given ``inputs_embeds`` ``(batch, seq_len, hidden)`` instead of ids (PEFT's prompt tuning calls a model so),
        sequence classification still makes the first token of every sequence (document) global: positions alone say
        where it is. The question and the choice are found by separator ids, which embeddings do not carry.

        Raises:
            ValueError: question answering or multiple choice given ``inputs_embeds`` (pass `global_attention_mask`),
                or on a sequence (document) without a separator; the latter checked where values may be read
                (:func:`~hf_xformers.ops.input_checks.reads_values`), not in an accelerator's training step or a traced
                graph.
        """
        if task in ("masked_lm", "token_classification"):
            return None
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens is None:
            return None
        if input_ids is None and task != "sequence_classification":
            refuse(
                "global_default_needs_ids",
                f"{task} puts global attention on the {'question' if task == 'question_answering' else 'choice'}, "
                f"found through the separator ids (sep_token_id={self.config.sep_token_id}), which `inputs_embeds` "
                "do not carry",
            )
        if document_ids is not None:
            if input_ids is None:
                return document_starts(document_ids)
            return self._packed_default_global_attention_mask(task, input_ids, attention_mask, document_ids)
        if task == "sequence_classification":
            mask = torch.zeros(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
            mask[:, 0] = True
            return mask
        is_sep = input_ids == self.config.sep_token_id
        if reads_values(input_ids) and not bool(is_sep.any(-1).all()):  # a value check: only where a read is free
            self._missing_separator(task, "inputs")
        first_sep = is_sep.int().argmax(-1, keepdim=True)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        if task == "question_answering":
            return positions < first_sep
        mask = positions > first_sep + 1
        return mask if attention_mask is None else mask & attention_mask.bool()

    def _packed_default_global_attention_mask(
        self, task: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, document_ids: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`default_global_attention_mask` per document of a packed batch, with running sums along each row
        (documents are contiguous runs): ``(batch, seq_len)`` bool."""
        starts = document_starts(document_ids)
        if task == "sequence_classification":
            return starts
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        first_token = torch.where(starts, positions, torch.zeros_like(positions)).cummax(-1).values
        is_sep = (input_ids == self.config.sep_token_id).long()
        running = is_sep.cumsum(-1)
        # separators of a token's own document up to and including the token
        seen = running - (running - is_sep).gather(1, first_token)
        last_token = torch.ones_like(starts)
        last_token[:, :-1] = starts[:, 1:]
        has_separator = (seen > 0) | ~last_token
        if attention_mask is not None:
            has_separator = has_separator | ~attention_mask.bool()  # a run of padding is no document
        if reads_values(input_ids) and not bool(has_separator.all()):
            self._missing_separator(task, "documents of the packed batch")
        if task == "question_answering":
            return seen == 0
        # each document's first separator, carried forward from where it is (later documents' lie further on)
        first_sep = torch.where((is_sep == 1) & (seen == 1), positions, -1).cummax(-1).values
        mask = (seen > 0) & (positions > first_sep + 1)
        return mask if attention_mask is None else mask & attention_mask.bool()

    def _missing_separator(self, task: str, what: str) -> None:
        part = "question" if task == "question_answering" else "choice"
        refuse(
            "global_default_needs_separator",
            f"{task} puts global attention on the {part}, found through the first separator "
            f"(sep_token_id={self.config.sep_token_id}), but some {what} have none",
        )


class HfxLongformerModel(HfxTextModel, HfxLongformerPreTrainedModel):
    """Longformer encoder: RoBERTa's embeddings and layers with sliding-window attention plus global tokens, and a
    pooler (``add_pooling_layer``). Its inputs and outputs: ``forward``.

    Inputs of any length up to the position table work: each layer pads internally to its block size and
    cuts the result back, so no caller-side padding to the window is needed.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLongformerConfig, HfxLongformerModel
        >>> config = HfxLongformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, attention_window=8,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxLongformerModel(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> attention_mask = torch.ones(2, 40, dtype=torch.long)
        >>> attention_mask[1, 30:] = 0  # the second sequence: 30 tokens, then padding
        >>> out = model(input_ids, attention_mask=attention_mask)
        >>> out.last_hidden_state.shape, out.pooler_output.shape
        (torch.Size([2, 40, 32]), torch.Size([2, 32]))
    """

    attention_class = HfxSlidingWindowSelfAttention

    def prepare_attention_inputs(
        self,
        attention_mask: torch.Tensor | None,
        global_attention_mask: torch.Tensor | None,
        length: int,
        packed: PackedBatch | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """As :meth:`HfxTextModel.prepare_attention_inputs`, plus the layers' shared
        :class:`~hf_xformers.attention.sliding_window_layout.LongformerLayout` (``layout``), built once for all layers
        by :meth:`~hf_xformers.attention.sliding_window.HfxSlidingWindowSelfAttention.shared_layout`: where the global
        tokens are, in a packed batch which documents they belong to, FlexAttention's block masks, the varlen kernel's
        boundaries. All layers use it; none works anything out again.

        Host reads: the sizes of the global layouts (how many global tokens a row holds, and in a packed batch how
        many per document, how long their documents are, how many a query block meets) are one device-to-host read for
        an arbitrary ``global_attention_mask`` (eager mode; a traced graph takes whole-row layouts instead). The
        sequence-classification default of a packed batch, the first token of every document, arrives as
        ``packed.starts`` itself (:class:`HfxLongformerForSequenceClassification`): its sizes are known from the batch
        (``packed.count`` documents, the longest ``packed.longest``), so it makes no read, also when compiled. A packed
        row without global tokens makes none either.
        """
        first_tokens = packed is not None and global_attention_mask is packed.starts and packed.count is not None
        attention_mask, _, kwargs = super().prepare_attention_inputs(attention_mask, None, length, packed)
        layers = [layer.attention.self for layer in self.encoder.layer]
        sizes = varlen = None
        if first_tokens:
            longest = packed.longest
            if longest is None and not is_tracing():
                longest = packed.longest_document()  # one read (the batch did not say); spares a quadratic layout
            elif longest is not None:
                # The global rows see `longest` keys of their document: an understated `max_length_q` (unchecked
                # where values cannot be read) fails here instead of cutting the longer documents' rows.
                packed.assert_within(longest)
            sizes = first_token_sizes(packed.count, longest, length, {layer.query_block for layer in layers})
        weight = self.embeddings.word_embeddings.weight
        if packed is not None:
            varlen = varlen_boundaries(packed, weight.device)
        # The layers' kernel choice, asked of one of them, decides which extras to build (FlexAttention's block masks
        # only where the layers will run it); the layout is built by the attention class, for all layers at once.
        attention = layers[0]
        kwargs["layout"] = attention.shared_layout(
            attention.kernel_choice(weight), weight, length, attention_mask, global_attention_mask,
            None if packed is None else packed.document_ids, sizes, varlen, layers,
        )  # fmt: skip
        return attention_mask, kwargs["layout"].is_global, kwargs


class HfxLongformerForMaskedLM(HfxMaskedLMHeadMixin, HfxLongformerPreTrainedModel):
    """Longformer with a masked-language-modelling head, its decoder tied to the input embeddings.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLongformerConfig, HfxLongformerForMaskedLM
        >>> config = HfxLongformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, attention_window=8,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxLongformerForMaskedLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> labels = torch.full_like(input_ids, -100)  # -100: no loss
        >>> labels[:, 7] = input_ids[:, 7]
        >>> input_ids[:, 7] = 4  # <mask> in RoBERTa's vocabulary
        >>> out = model(input_ids, labels=labels)
        >>> out.logits.shape, out.loss.dim()
        (torch.Size([2, 40, 100]), 0)
    """

    base_model_class = HfxLongformerModel
    _tied_weights_keys = {"lm_head.decoder.weight": "longformer.embeddings.word_embeddings.weight"}


class HfxLongformerForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxLongformerPreTrainedModel):
    """Longformer with a classification or regression head on the first token (``<s>``), or on the mean of the tokens
    with ``config.classifier_pooling = "mean"``; the loss follows ``config.problem_type``. A packed batch is classified
    per document. ``<s>`` (each document's first token) is global unless a ``global_attention_mask`` is given.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLongformerConfig
        >>> from hf_xformers import HfxLongformerForSequenceClassification
        >>> config = HfxLongformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, attention_window=8,
        ...     max_position_embeddings=66, num_labels=3,
        ... )
        >>> model = HfxLongformerForSequenceClassification(config).eval()
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

    base_model_class = HfxLongformerModel

    def _encode(
        self, input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states,
        packed=None, **kw,
    ):  # fmt: skip
        """The head's encoding (:meth:`HfxHeadMixin._encode`); in a packed batch without a caller's
        ``global_attention_mask`` the task's default, the first token of every document, goes to the base model as
        ``packed.starts`` itself, by which :meth:`HfxLongformerModel.prepare_attention_inputs` knows its sizes without a
        device-to-host read."""
        if global_attention_mask is None and packed is not None:
            global_attention_mask = packed.starts
        return super()._encode(
            input_ids, attention_mask, global_attention_mask, output_attentions, output_hidden_states, packed, **kw
        )


class HfxLongformerForMultipleChoice(HfxMultipleChoiceHeadMixin, HfxLongformerPreTrainedModel):
    """Longformer for multiple choice: every (context, choice) pair of ``(batch, num_choices, seq_len)`` inputs is
    scored from its pooled first token. The choice's tokens (after the first separator pair) are global by default.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLongformerConfig
        >>> from hf_xformers import HfxLongformerForMultipleChoice
        >>> config = HfxLongformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, attention_window=8,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxLongformerForMultipleChoice(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 4, 24))  # 2 examples, 4 choices
        >>> input_ids[..., 16:18] = config.sep_token_id  # context </s></s> choice
        >>> model(input_ids, labels=torch.tensor([3, 0])).logits.shape
        torch.Size([2, 4])
    """

    base_model_class = HfxLongformerModel


class HfxLongformerForQuestionAnswering(HfxQuestionAnsweringHeadMixin, HfxLongformerPreTrainedModel):
    """Longformer for extractive question answering: a start and an end logit for every token. The question's tokens
    (before the first separator) are global by default.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLongformerConfig
        >>> from hf_xformers import HfxLongformerForQuestionAnswering
        >>> config = HfxLongformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, attention_window=8,
        ...     max_position_embeddings=66,
        ... )
        >>> model = HfxLongformerForQuestionAnswering(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> input_ids[:, 6:8] = config.sep_token_id  # question </s></s> context
        >>> start, end = torch.tensor([12, 20]), torch.tensor([14, 25])
        >>> out = model(input_ids, start_positions=start, end_positions=end)
        >>> out.start_logits.shape, out.end_logits.shape
        (torch.Size([2, 40]), torch.Size([2, 40]))
    """

    base_model_class = HfxLongformerModel


class HfxLongformerForTokenClassification(HfxTokenClassificationHeadMixin, HfxLongformerPreTrainedModel):
    """Longformer with a per-token classification head (named entities, parts of speech).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxLongformerConfig
        >>> from hf_xformers import HfxLongformerForTokenClassification
        >>> config = HfxLongformerConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, attention_window=8,
        ...     max_position_embeddings=66, num_labels=5,
        ... )
        >>> model = HfxLongformerForTokenClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> model(input_ids, labels=torch.randint(0, 5, (2, 40))).logits.shape
        torch.Size([2, 40, 5])
    """

    base_model_class = HfxLongformerModel
