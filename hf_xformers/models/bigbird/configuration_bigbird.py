"""Configuration of ``hfx-bigbird``."""

from __future__ import annotations

from ...configs.text_config import HfxTextConfig

# "original_full" is BigBird with dense softmax attention (transformers' name), the reference for the sparse pattern.
ATTENTION_TYPES = ("block_sparse", "original_full")


class HfxBigBirdConfig(HfxTextConfig):
    r"""Configuration of a BigBird encoder (BERT/RoBERTa layout with block-sparse attention).

    Field names and defaults follow ``transformers.BigBirdConfig`` so its checkpoints convert by renaming.

    Args:
        attention_type (`str`, defaults to `"block_sparse"`): ``"block_sparse"`` (global first/last block, a window
            of 3 blocks, ``num_random_blocks`` random blocks) or ``"original_full"`` (full attention). Short inputs
            are never switched silently: block-sparse attention of an input whose pattern covers every key is
            exactly full attention (see ``hf_xformers/attention/block_sparse.py``).
        block_size (`int`, defaults to 64): tokens per block; inputs of any length are padded inside the layer.
        num_random_blocks (`int`, defaults to 3): random key blocks per query block (0 allowed).
        random_seed (`int`, defaults to 0): seeds the random blocks, drawn per layer and per number of blocks,
            so eval-mode outputs are the same at every call and after every reload.
        fixed_random_blocks (`bool`, defaults to `False`): also use the seeded blocks in training; otherwise
            training redraws them at every call from torch's global RNG.
        max_position_embeddings (`int`, defaults to 4096): tokens the model accepts (positions start at 0, as in
            transformers' BigBird; there is no RoBERTa offset).
        rescale_embeddings (`bool`, defaults to `False`): multiply word embeddings by ``sqrt(hidden_size)``.
        Other fields as in ``BigBirdConfig``.
    """

    model_type = "hfx-bigbird"
    attention_type: str = "block_sparse"
    block_size: int = 64
    num_random_blocks: int = 3
    random_seed: int = 0
    fixed_random_blocks: bool = False
    rescale_embeddings: bool = False
    # BigBirdConfig's defaults where they differ from the RoBERTa ones of HfxTextConfig.
    vocab_size: int = 50358
    hidden_act: str = "gelu_new"
    max_position_embeddings: int = 4096
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    sep_token_id: int | None = 66

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        self.validate_bigbird()

    def validate_bigbird(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(f"attention_type must be one of {ATTENTION_TYPES}, got {self.attention_type!r}.")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer (e.g. 64), got {self.block_size!r}.")
        if not isinstance(self.num_random_blocks, int) or self.num_random_blocks < 0:
            raise ValueError(f"num_random_blocks must be an integer >= 0 (e.g. 3), got {self.num_random_blocks!r}.")
        if not isinstance(self.random_seed, int) or self.random_seed < 0:
            raise ValueError(f"random_seed must be an integer >= 0, got {self.random_seed!r}.")
        if self.pad_token_id is None or not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id must be a token id below vocab_size, got {self.pad_token_id!r}.")
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be positive, got {self.max_position_embeddings}.")
