"""The configuration fields every RoBERTa-style text architecture shares.

``HfxTextConfig`` holds the encoder's size, dropout, embedding and special-token fields with ``RobertaConfig``'s
names and defaults; an architecture's config subclasses it, adds its attention fields, overrides the defaults that
differ (BigBird's vocabulary and positions, say) and validates its own fields in ``__post_init__`` after calling
``super().__post_init__``. It has no ``model_type`` and is not registered: only the architectures are.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

# Attributes whose names start with this are run-time state the models keep on their config (whether the user chose
# an attn_implementation, ops/attention_switch.py): never written to config.json, as transformers keeps its own
# `_attn_implementation_internal` out of it.
RUNTIME_ONLY_PREFIX = "_hfx_"


def drop_runtime_keys(d: dict[str, Any]) -> None:
    """Remove the :data:`RUNTIME_ONLY_PREFIX` keys from a config's dict (in place, nested configs too)."""
    for key in [k for k in d if isinstance(k, str) and k.startswith(RUNTIME_ONLY_PREFIX)]:
        del d[key]
    for value in d.values():
        if isinstance(value, dict):
            drop_runtime_keys(value)


class KeyValueHeadsMixin:
    """``num_key_value_heads`` for configs whose attention has one key/value head per query head (no grouped-query
    attention): equal to ``num_attention_heads``, never serialized.

    DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers``, which accelerate calls when
    ``ParallelismConfig(sp_backend="deepspeed")`` prepares a model (Trainer does), reads ``config.num_key_value_heads``
    and fails without it; our models shard their own attention (ops/sequence_parallel.py) and never call the
    attention function it wraps.
    """

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @num_key_value_heads.setter
    def num_key_value_heads(self, value: int) -> None:
        # A config.json that names it (written by other code): the same value is accepted and not stored.
        heads = self.__dict__.get("num_attention_heads")
        if heads is not None and value is not None and value != heads:
            raise ValueError(
                f"num_key_value_heads={value} differs from num_attention_heads={heads}: these models have one key/value "
                "head per query head (no grouped-query attention); drop num_key_value_heads from the config."
            )


class HfxTextConfig(KeyValueHeadsMixin, PreTrainedConfig):
    r"""Fields shared by the hf_xformers text configs (names and defaults as in ``RobertaConfig``).

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, hidden_act,
        hidden_dropout_prob, attention_probs_dropout_prob, type_vocab_size, initializer_range, layer_norm_eps,
        classifier_dropout, pad_token_id, bos_token_id, eos_token_id, sep_token_id, tie_word_embeddings: as in
            ``RobertaConfig``.
        max_position_embeddings (`int`, defaults to 4098): rows of the position table; with RoBERTa's offset the
            model takes ``max_position_embeddings - pad_token_id - 1`` tokens (4096 by default).
        classifier_pooling (`str`, defaults to ``"first"``): what the sequence-classification head reads, the first
            token (RoBERTa) or ``"mean"``, the mean of the real tokens (the Long Range Arena's models).
    """

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 4098
    type_vocab_size: int = 1
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    classifier_dropout: float | None = None
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2
    sep_token_id: int | None = 2
    tie_word_embeddings: bool = True
    classifier_pooling: str = "first"

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        if self.classifier_pooling not in ("first", "mean"):
            raise ValueError(f"classifier_pooling must be 'first' or 'mean', got {self.classifier_pooling!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})."
            )

    def _remove_keys_not_serialized(self, d: dict[str, Any]) -> None:
        super()._remove_keys_not_serialized(d)
        drop_runtime_keys(d)

    def check_roberta_positions(self) -> None:
        """Raise unless the position table leaves room for RoBERTa's offset (positions start at pad_token_id + 1)."""
        if self.pad_token_id is None or self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError(
                "max_position_embeddings must exceed pad_token_id + 1 (RoBERTa position offset); "
                f"got max_position_embeddings={self.max_position_embeddings}, pad_token_id={self.pad_token_id}."
            )
