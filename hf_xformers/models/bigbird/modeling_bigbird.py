"""``hfx-bigbird``: BERT/RoBERTa encoder with BigBird's block-sparse attention (Zaheer et al., 2020).

The attention lives in ``hf_xformers/attention/block_sparse.py``. What else differs from the shared RoBERTa-style
pieces, to match transformers' ``BigBirdModel`` weight for weight: positions start at 0 (no RoBERTa offset) and
the position table has no padding row, word embeddings may be rescaled by ``sqrt(hidden)``, and the MLM head
applies ``config.hidden_act`` (``gelu_new`` by default) instead of exact GELU.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ...attention.block_sparse import HfxBlockSparseSelfAttention
from ...layers.heads import (
    HfxLMHead,
    HfxMaskedLMHeadMixin,
    HfxMultipleChoiceHeadMixin,
    HfxQuestionAnsweringHeadMixin,
    HfxSequenceClassificationHeadMixin,
    HfxTokenClassificationHeadMixin,
)
from ...layers.pretrained import HfxPreTrainedModel
from ...layers.text_model import HfxTextModel
from ...ops.attention_switch import FLEX
from ...ops.fast_dropout import HfxDropout
from ...ops.packing import PackedBatch
from .configuration_bigbird import HfxBigBirdConfig


class HfxBigBirdEmbeddings(nn.Module):
    """Word (optionally times ``sqrt(hidden)``) + absolute position (from 0) + token type embeddings, then
    dropout and LayerNorm (in that order, as transformers' BigBird). Parameter names as in BigBird checkpoints."""

    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = HfxDropout(config.hidden_dropout_prob)
        self.scale = config.hidden_size**0.5 if config.rescale_embeddings else None

    # Positions count from 0 (a packed batch: DataCollatorWithFlattening(position_ids_start=0)).
    position_offset = 0

    @property
    def max_tokens(self) -> int:
        """Longest sequence the position table can serve."""
        return self.position_embeddings.num_embeddings

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns ``(batch, seq_len, hidden)``."""
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if self.scale is not None:
            inputs_embeds = inputs_embeds * self.scale
        batch, seq_len = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=inputs_embeds.device).expand(batch, -1)
        if token_type_ids is None:
            token_type_ids = torch.zeros((batch, seq_len), dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return self.LayerNorm(self.dropout(embeddings))


class HfxBigBirdLMHead(HfxLMHead):
    """``decoder(LayerNorm(act(dense(h))))`` with ``act = config.hidden_act``, BigBird's MLM head (transformers
    names it ``cls.predictions``). ``(batch, seq_len, hidden)`` -> ``(batch, seq_len, vocab)``."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(self.act(self.dense(hidden_states))))


class HfxBigBirdPreTrainedModel(HfxPreTrainedModel):
    # The block table (global, window, seeded random blocks) and padding as FlexAttention's BlockMask.
    _supports_flex_attn = True
    config_class = HfxBigBirdConfig
    sequence_parallel_refusal = None  # Ulysses: each rank runs the whole sequence on heads / sp_size heads
    base_model_prefix = "bigbird"
    _no_split_modules = ["HfxEncoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxBlockSparseSelfAttention):
            # A non-persistent buffer (never in a checkpoint): models built on the meta device get it here.
            module.random_block_table.copy_(module.seeded_block_table())


class HfxBigBirdModel(HfxTextModel, HfxBigBirdPreTrainedModel):
    """BigBird encoder: embeddings and layers with block-sparse attention (a window of blocks, global first and last
    blocks, random blocks), and a pooler (``add_pooling_layer``). Its inputs and outputs: ``forward``.

    Any length up to ``max_position_embeddings`` works: each layer pads to its block size and cuts back. With
    ``output_attentions=True`` the block-sparse layers return ``(batch, heads, seq_len, seq_len)`` probabilities
    (zero outside the pattern) from their dense masked path, which gives the same outputs.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxBigBirdConfig, HfxBigBirdModel
        >>> config = HfxBigBirdConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, block_size=4,
        ...     num_random_blocks=1, max_position_embeddings=64,
        ... )
        >>> model = HfxBigBirdModel(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> attention_mask = torch.ones(2, 40, dtype=torch.long)
        >>> attention_mask[1, 30:] = 0  # the second sequence: 30 tokens, then padding
        >>> out = model(input_ids, attention_mask=attention_mask)
        >>> out.last_hidden_state.shape, out.pooler_output.shape
        (torch.Size([2, 40, 32]), torch.Size([2, 32]))
    """

    attention_class = HfxBlockSparseSelfAttention
    embeddings_class = HfxBigBirdEmbeddings

    def prepare_attention_inputs(
        self,
        attention_mask: torch.Tensor | None,
        global_attention_mask: torch.Tensor | None,
        length: int,
        packed: PackedBatch | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """As :meth:`HfxTextModel.prepare_attention_inputs`; for a packed batch also ``document_blocks``, where its
        documents lie on the block grid, made once and shared by every layer
        (:meth:`~hf_xformers.attention.block_sparse_packed.PackedBlockSparse.document_layout`, asked of the first
        layer's attention, as is the kernel choice). Its sizes come from host ints: the number of documents and the
        longest one, which the collator's flash form carries (``cu_seq_lens`` by its shape, ``max_length``), so a
        training step reads nothing back from the device; otherwise eager mode reads them once per forward, and a
        traced graph without them takes the dense pattern path. Under ``"flex_attention"`` the part of the block
        pattern that every layer shares is built here too."""
        attention_mask, global_attention_mask, kwargs = super().prepare_attention_inputs(
            attention_mask, global_attention_mask, length, packed
        )
        if packed is not None and self.config.attention_type == "block_sparse":
            attention = self.encoder.layer[0].attention.self
            flex = attention.kernel_choice(packed.document_ids) == FLEX
            kwargs["document_blocks"] = attention.document_layout(
                packed.document_ids, attention_mask, flex, count=packed.count, longest=packed.longest,
                spans=None if flex else packed.host_spans(),
            )  # fmt: skip
        return attention_mask, global_attention_mask, kwargs


class HfxBigBirdForMaskedLM(HfxMaskedLMHeadMixin, HfxBigBirdPreTrainedModel):
    """BigBird with a masked-language-modelling head, its decoder tied to the input embeddings.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxBigBirdConfig, HfxBigBirdForMaskedLM
        >>> config = HfxBigBirdConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, block_size=4,
        ...     num_random_blocks=1, max_position_embeddings=64,
        ... )
        >>> model = HfxBigBirdForMaskedLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> labels = torch.full_like(input_ids, -100)  # -100: no loss
        >>> labels[:, 7] = input_ids[:, 7]
        >>> input_ids[:, 7] = 4  # <mask> in RoBERTa's vocabulary
        >>> out = model(input_ids, labels=labels)
        >>> out.logits.shape, out.loss.dim()
        (torch.Size([2, 40, 100]), 0)
    """

    base_model_class = HfxBigBirdModel
    lm_head_class = HfxBigBirdLMHead
    _tied_weights_keys = {"lm_head.decoder.weight": "bigbird.embeddings.word_embeddings.weight"}


class HfxBigBirdForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxBigBirdPreTrainedModel):
    """BigBird with a classification or regression head on the first token (``<s>``), or on the mean of the tokens with
    ``config.classifier_pooling = "mean"``; the loss follows ``config.problem_type``. A packed batch is classified per
    document.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxBigBirdConfig
        >>> from hf_xformers import HfxBigBirdForSequenceClassification
        >>> config = HfxBigBirdConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, block_size=4,
        ...     num_random_blocks=1, max_position_embeddings=64, num_labels=3,
        ... )
        >>> model = HfxBigBirdForSequenceClassification(config).eval()
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

    base_model_class = HfxBigBirdModel


class HfxBigBirdForMultipleChoice(HfxMultipleChoiceHeadMixin, HfxBigBirdPreTrainedModel):
    """BigBird for multiple choice: every (context, choice) pair of ``(batch, num_choices, seq_len)`` inputs is scored
    from its pooled first token.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxBigBirdConfig, HfxBigBirdForMultipleChoice
        >>> config = HfxBigBirdConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, block_size=4,
        ...     num_random_blocks=1, max_position_embeddings=64,
        ... )
        >>> model = HfxBigBirdForMultipleChoice(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 4, 24))  # 2 examples, 4 choices
        >>> input_ids[..., 16:18] = config.sep_token_id  # context </s></s> choice
        >>> model(input_ids, labels=torch.tensor([3, 0])).logits.shape
        torch.Size([2, 4])
    """

    base_model_class = HfxBigBirdModel


class HfxBigBirdForQuestionAnswering(HfxQuestionAnsweringHeadMixin, HfxBigBirdPreTrainedModel):
    """BigBird for extractive question answering: a start and an end logit for every token.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxBigBirdConfig, HfxBigBirdForQuestionAnswering
        >>> config = HfxBigBirdConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, block_size=4,
        ...     num_random_blocks=1, max_position_embeddings=64,
        ... )
        >>> model = HfxBigBirdForQuestionAnswering(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> input_ids[:, 6:8] = config.sep_token_id  # question </s></s> context
        >>> start, end = torch.tensor([12, 20]), torch.tensor([14, 25])
        >>> out = model(input_ids, start_positions=start, end_positions=end)
        >>> out.start_logits.shape, out.end_logits.shape
        (torch.Size([2, 40]), torch.Size([2, 40]))
    """

    base_model_class = HfxBigBirdModel


class HfxBigBirdForTokenClassification(HfxTokenClassificationHeadMixin, HfxBigBirdPreTrainedModel):
    """BigBird with a per-token classification head (named entities, parts of speech).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxBigBirdConfig, HfxBigBirdForTokenClassification
        >>> config = HfxBigBirdConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, block_size=4,
        ...     num_random_blocks=1, max_position_embeddings=64, num_labels=5,
        ... )
        >>> model = HfxBigBirdForTokenClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 40))
        >>> model(input_ids, labels=torch.randint(0, 5, (2, 40))).logits.shape
        torch.Size([2, 40, 5])
    """

    base_model_class = HfxBigBirdModel
