"""Configuration of ``hfx-longformer``."""

from __future__ import annotations

from transformers import PreTrainedConfig


class HfxLongformerConfig(PreTrainedConfig):
    r"""Configuration of a Longformer (RoBERTa encoder with sliding-window + global attention).

    Field names and defaults follow ``transformers.LongformerConfig`` so its checkpoints convert by renaming.

    Args:
        attention_window (`int` or `list[int]`, defaults to 512): full width of the local window (tokens
            attend to ``attention_window // 2`` neighbours on each side). One even value, or one per layer.
        max_position_embeddings (`int`, defaults to 4098): rows of the position table; with RoBERTa's offset
            the model takes ``max_position_embeddings - pad_token_id - 1`` tokens (4096 by default).
        Other fields as in ``RobertaConfig``.
    """

    model_type = "hfx-longformer"
    attention_window: list[int] | int = 512
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

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        self.validate_longformer()

    def validate_longformer(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})."
            )
        windows = self.attention_window
        if isinstance(windows, (list, tuple)):
            if len(windows) != self.num_hidden_layers:
                raise ValueError(
                    f"attention_window has {len(windows)} entries but num_hidden_layers is "
                    f"{self.num_hidden_layers}; give one window per layer or a single int."
                )
        else:
            windows = [windows]
        for w in windows:
            if not isinstance(w, int) or w < 2 or w % 2:
                raise ValueError(
                    f"attention_window values must be positive even integers (the window spans w/2 tokens on "
                    f"each side), got {w}; use e.g. {max(2, int(w) + 1 if isinstance(w, int) else 512)}."
                )
        if self.pad_token_id is None or self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError(
                "max_position_embeddings must exceed pad_token_id + 1 (RoBERTa position offset); "
                f"got max_position_embeddings={self.max_position_embeddings}, pad_token_id={self.pad_token_id}."
            )
