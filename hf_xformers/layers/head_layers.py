"""The layers a task head puts on the base model's hidden states: RoBERTa's vocabulary head and sentence classifier.

An architecture whose head differs (BigBird's LM head activation, Reformer's doubled width) subclasses these or
names its own class on the head mixin (``lm_head_class``, ``head_input_size``; ``layers/head_base.py``).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from transformers.activations import gelu

from ..ops.packing import PackedBatch
from .pooling import classifier_pooling, pool_tokens

logger = logging.getLogger(__name__)


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


class HfxClassificationHead(nn.Module):
    """RoBERTa's sentence head: ``out_proj(dropout(tanh(dense(dropout(pooled)))))``, ``pooled`` the first token or,
    with ``config.classifier_pooling = "mean"``, the mean of the real tokens
    (:func:`~hf_xformers.layers.pooling.pool_tokens`)."""

    def __init__(self, config, in_features: int | None = None) -> None:
        super().__init__()
        self.pooling = classifier_pooling(config)
        self.dense = nn.Linear(in_features or config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(classifier_dropout(config))
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


def classifier_dropout(config) -> float:
    """``config.classifier_dropout``, or ``config.hidden_dropout_prob`` when it is None (as RoBERTa's heads read it)."""
    dropout = getattr(config, "classifier_dropout", None)
    return config.hidden_dropout_prob if dropout is None else dropout


def classifier_from_pooler(class_name: str, base_model_prefix: str, tensor_names: set[str]) -> dict[str, str]:
    """The rename, for ``from_pretrained(key_mapping=...)``, that starts :class:`HfxClassificationHead`'s ``dense``
    from a checkpoint's pooler: ``{pattern of pooler.dense.*: "classifier.dense."}`` when ``tensor_names`` hold a
    pooler (``pooler.dense.weight``, bare or under ``base_model_prefix``) and no ``classifier.dense.weight``, else
    ``{}``.

    BERT's classifier is ``classifier(dropout(tanh(pooler.dense(h_cls))))``, ours
    ``out_proj(dropout(tanh(dense(dropout(h_cls)))))``: with ``dense`` the pooler, the head is BERT's (the extra dropout
    acts in training only), and a base model converted from BERT (``hfx-convert``, which keeps the pooler) classifies
    as ``BertForSequenceClassification`` with the same ``out_proj`` (with ``classifier_pooling = "mean"`` the pooler
    reads the tokens' mean instead: a trained start, not BERT's head). A checkpoint that stores a head keeps it.
    """
    prefix = f"{base_model_prefix}."
    pooler = "pooler.dense.weight"
    if "classifier.dense.weight" in tensor_names or not {pooler, prefix + pooler} & tensor_names:
        return {}
    logger.info(
        "%s: classifier.dense starts from the checkpoint's pooler (pooler.dense), as BERT's classifier reads the "
        "pooler; classifier.out_proj is new.", class_name,
    )  # fmt: skip
    return {rf"^(?:{re.escape(prefix)})?pooler\.dense\.": "classifier.dense."}
