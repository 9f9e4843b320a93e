"""Configuration of ``hfx-linformer``."""

from __future__ import annotations

from ...configs.choices import LINFORMER_SHARING_MODES
from ...configs.text_config import HfxTextConfig


class HfxLinformerConfig(HfxTextConfig):
    r"""Configuration of a Linformer (RoBERTa encoder whose attention projects keys and values along the sequence).

    Attributes:
        linformer_k (`int`, defaults to 256): ``k``, the length keys and values are projected to (the paper's ``k``).
        linformer_sharing (`str`, defaults to ``"headwise"``): which projections are shared:

            * ``"none"``: every head of every layer has its own ``E`` (keys) and ``F`` (values);
            * ``"headwise"``: one ``E`` and one ``F`` per layer, shared by the heads of that layer;
            * ``"kv"``: one matrix per layer, used for keys and values, shared by its heads;
            * ``"layerwise"``: a single matrix for all layers, heads, keys and values.
        max_position_embeddings (`int`, defaults to 4098): rows of the position table. The model takes
            ``n = max_position_embeddings - pad_token_id - 1`` tokens (4096 by default), and ``E``, ``F`` have ``n``
            rows: shorter inputs use the leading rows, longer ones are rejected.

    Other fields as in ``RobertaConfig``.
    """

    model_type = "hfx-linformer"
    linformer_k: int = 256
    linformer_sharing: str = "headwise"

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        self.validate_linformer()

    def validate_linformer(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""
        if isinstance(self.linformer_k, bool) or not isinstance(self.linformer_k, int) or self.linformer_k < 1:
            raise ValueError(
                f"linformer_k (the projected length) must be a positive integer, got {self.linformer_k!r}."
            )
        if self.linformer_sharing not in LINFORMER_SHARING_MODES:
            raise ValueError(
                f"linformer_sharing must be one of {LINFORMER_SHARING_MODES}, got {self.linformer_sharing!r}."
            )
        self.check_roberta_positions()

    @property
    def linformer_max_length(self) -> int:
        """``n``: rows of ``E`` and ``F``, the longest input (``max_position_embeddings - pad_token_id - 1``)."""
        return self.max_position_embeddings - self.pad_token_id - 1
