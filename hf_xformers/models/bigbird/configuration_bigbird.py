"""Configuration of ``hfx-bigbird``."""

from __future__ import annotations

from ...configs.text_config import HfxTextConfig
from ...configs.transformers_checkpoints import (
    SAVED_BUFFERS,
    UNUSED_POOLER,
    TransformersCheckpointConfig,
    WeightRenames,
)

# "original_full" is BigBird with dense softmax attention (transformers' name), the reference for the sparse pattern.
ATTENTION_TYPES = ("block_sparse", "original_full")

# transformers' BigBird heads whose layout differs from ours: importing them would change their outputs.
TRANSFORMERS_UNSUPPORTED_HEADS = {
    "BigBirdForSequenceClassification": "its classifier applies config.hidden_act where ours applies tanh",
    "BigBirdForQuestionAnswering": "it has an extra feed-forward block and question-length masking",
    "BigBirdForCausalLM": "hfx-bigbird is an encoder",
}
# BigBirdConfig fields with no counterpart here; a checkpoint with other values is refused.
TRANSFORMERS_FIXED_CONFIG = {"use_bias": True, "is_decoder": False, "add_cross_attention": False}


class HfxBigBirdConfig(TransformersCheckpointConfig, HfxTextConfig):
    r"""Configuration of a BigBird encoder (BERT/RoBERTa layout with block-sparse attention).

    Field names and defaults follow ``transformers.BigBirdConfig`` so its checkpoints convert by renaming.

    Attributes:
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

    A transformers ``big_bird`` config loads as this one (``configs/transformers_checkpoints.py``), and its
    checkpoints into our classes: ``bert.`` becomes ``bigbird.``, the pooler's Linear gets our ``dense`` name,
    ``cls.predictions.*`` becomes ``lm_head.*``. With the same weights ``"original_full"`` gives transformers'
    outputs; ``"block_sparse"`` outputs differ by the random-block draw (ours seeded by ``random_seed`` in eval,
    transformers' pointing every random block at block 0 in eval).
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

    transformers_model_type = "big_bird"
    transformers_architectures = {
        "BigBirdModel": "HfxBigBirdModel",
        "BigBirdForMaskedLM": "HfxBigBirdForMaskedLM",
        # google/bigbird-roberta-base is saved as a pretraining model: MLM head plus a next-sentence head (dropped).
        "BigBirdForPreTraining": "HfxBigBirdForMaskedLM",
        "BigBirdForTokenClassification": "HfxBigBirdForTokenClassification",
        "BigBirdForMultipleChoice": "HfxBigBirdForMultipleChoice",
    }

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        self.validate_bigbird()

    @classmethod
    def config_dict_from_transformers(cls, config_dict: dict) -> dict:
        """BigBirdConfig's fields are ours (``attention_type``, ``block_size``, ``num_random_blocks`` carry over);
        the fixed ones (:data:`TRANSFORMERS_FIXED_CONFIG`) and ``use_cache`` are dropped.

        Raises:
            ValueError: a head whose layout differs from ours (sequence classification, question answering, causal
                LM), or a fixed field with another value (``use_bias=False``, a decoder).
        """
        for name in config_dict.get("architectures") or []:
            if name in TRANSFORMERS_UNSUPPORTED_HEADS:
                raise ValueError(
                    f"Cannot import {name}: {TRANSFORMERS_UNSUPPORTED_HEADS[name]}. Import the base model or the MLM "
                    f"checkpoint instead (accepted: {sorted(cls.transformers_architectures)}) and fine-tune an "
                    "hfx-bigbird head."
                )
        for key, expected in TRANSFORMERS_FIXED_CONFIG.items():
            if config_dict.get(key, expected) != expected:
                raise ValueError(
                    f"hfx-bigbird supports only {key}={expected!r}; this checkpoint has {config_dict[key]!r}."
                )
        skip = (*TRANSFORMERS_FIXED_CONFIG, "use_cache")
        return super().config_dict_from_transformers({k: v for k, v in config_dict.items() if k not in skip})

    @classmethod
    def transformers_weight_renames(cls, config_dict: dict, tensor_names: set[str] | None) -> WeightRenames:
        """``bert.`` -> ``bigbird.``, ``pooler.weight`` -> ``pooler.dense.weight``, ``cls.predictions.*`` ->
        ``lm_head.*``; the next-sentence head and saved buffers are dropped. transformers keeps the decoder bias
        twice when it saves both copies (tied, equal): ``cls.predictions.bias`` is the one read then."""
        key_mapping = {
            r"^bert\.": "bigbird.",
            r"pooler\.weight$": "pooler.dense.weight",
            r"pooler\.bias$": "pooler.dense.bias",
            r"^cls\.predictions\.transform\.dense\.": "lm_head.dense.",
            r"^cls\.predictions\.transform\.LayerNorm\.": "lm_head.layer_norm.",
            r"^cls\.predictions\.decoder\.weight$": "lm_head.decoder.weight",
            r"^cls\.predictions\.bias$": "lm_head.decoder.bias",
        }
        unused = [r"^cls\.seq_relationship\.", UNUSED_POOLER, *SAVED_BUFFERS]
        if tensor_names is None or "cls.predictions.bias" not in tensor_names:
            key_mapping[r"^cls\.predictions\.decoder\.bias$"] = "lm_head.decoder.bias"
        else:
            unused.append(r"^cls\.predictions\.decoder\.bias$")
        return WeightRenames(key_mapping=key_mapping, unused=tuple(unused))

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
