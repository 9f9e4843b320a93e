"""Configuration of ``hfx-longformer``."""

from __future__ import annotations

from ...configs.text_config import HfxTextConfig
from ...configs.transformers_checkpoints import (
    SAVED_BUFFERS,
    UNUSED_POOLER,
    TransformersCheckpointConfig,
    WeightRenames,
)


class HfxLongformerConfig(TransformersCheckpointConfig, HfxTextConfig):
    r"""Configuration of a Longformer (RoBERTa encoder with sliding-window + global attention).

    Field names follow ``transformers.LongformerConfig`` so its checkpoints convert by renaming; the defaults are
    those of ``allenai/longformer-base-4096`` (RoBERTa vocabulary and layout, 4096 tokens), not LongformerConfig's
    BERT-sized ones.

    Attributes:
        attention_window (`int` or `list[int]`, defaults to 512): full width of the local window (tokens
            attend to ``attention_window // 2`` neighbours on each side). One even value, or one per layer.
        max_position_embeddings (`int`, defaults to 4098): rows of the position table; with RoBERTa's offset
            the model takes ``max_position_embeddings - pad_token_id - 1`` tokens (4096 by default).

    Other fields as in ``RobertaConfig``.

    A transformers ``longformer`` config (``LongformerConfig.save_pretrained``) loads as this one
    (``configs/transformers_checkpoints.py``); its checkpoints load into our classes with the MLM bias renamed.
    """

    model_type = "hfx-longformer"
    attention_window: list[int] | int = 512

    transformers_model_type = "longformer"
    transformers_architectures = {
        "LongformerModel": "HfxLongformerModel",
        "LongformerForMaskedLM": "HfxLongformerForMaskedLM",
        "LongformerForSequenceClassification": "HfxLongformerForSequenceClassification",
        "LongformerForMultipleChoice": "HfxLongformerForMultipleChoice",
        "LongformerForQuestionAnswering": "HfxLongformerForQuestionAnswering",
        "LongformerForTokenClassification": "HfxLongformerForTokenClassification",
    }

    @classmethod
    def transformers_weight_renames(cls, config_dict: dict, tensor_names: set[str] | None) -> WeightRenames:
        """Names are ours but for the MLM decoder bias: transformers 5.x ties ``lm_head.decoder.bias`` to
        ``lm_head.bias`` and saves only the latter; 4.x saved both (equal), and then the decoder's is kept."""
        if tensor_names is not None and "lm_head.decoder.bias" in tensor_names:
            return WeightRenames(unused=(r"^lm_head\.bias$", UNUSED_POOLER, *SAVED_BUFFERS))
        return WeightRenames(
            key_mapping={r"^lm_head\.bias$": "lm_head.decoder.bias"}, unused=(UNUSED_POOLER, *SAVED_BUFFERS)
        )

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        self.validate_longformer()

    def validate_longformer(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""
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
        self.check_roberta_positions()
