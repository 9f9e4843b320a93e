"""Configuration of ``hfx-reformer``."""

from __future__ import annotations

import math

from transformers import PreTrainedConfig

from ...configs.text_config import KeyValueHeadsMixin
from ...configs.transformers_checkpoints import TransformersCheckpointConfig, WeightRenames

ATTENTION_TYPES = ("local", "lsh")


def default_num_buckets(max_length: int, chunk_length: int) -> int | list[int]:
    """Buckets for LSH attention when the config gives none: about ``2 * max_length / chunk_length`` rounded down to a
    power of two (the paper's advice), factorised into two powers of two when that exceeds
    ``2 * max(sqrt(max_length / chunk_length), chunk_length)`` (the rule transformers applies on the first call, here
    applied once to the longest input so that the number never depends on the length of a batch)."""
    power = max((2 * (max_length // chunk_length)).bit_length() - 1, 1)
    limit = 2 * max(int((max_length // chunk_length) ** 0.5), chunk_length)
    if 2**power > limit:
        return [2 ** (power // 2), 2 ** (power - power // 2)]
    return 2**power


class HfxReformerConfig(KeyValueHeadsMixin, TransformersCheckpointConfig, PreTrainedConfig):
    r"""Configuration of a Reformer (Kitaev et al., 2020): reversible layers with LSH or chunked local self-attention.

    Field names and defaults are those of ``transformers.ReformerConfig``, so its checkpoints import unchanged.

    Attributes:
        attn_layers (`list[str]`, defaults to ``["local", "lsh"] * 3``): attention type of each layer, ``"local"``
            (chunked local attention) or ``"lsh"`` (locality-sensitive hashing attention); its length is the number
            of layers (``num_hidden_layers`` is derived from it).
        hidden_size (`int`, defaults to 256): width of each of the two residual streams.
        num_attention_heads (`int`, defaults to 12): attention heads.
        attention_head_size (`int`, defaults to 64): their width; ``num_attention_heads * attention_head_size`` need
            not equal ``hidden_size``.
        feed_forward_size (`int`, defaults to 512): width of the feed-forward block.
        hidden_act (`str`, defaults to ``"relu"``): its activation.
        chunk_size_feed_forward (`int`, defaults to 0): apply the feed-forward block to this many positions at a time
            (0: all at once). Same result, less memory.
        chunk_size_lm_head (`int`, defaults to 0): the same for the LM head.
        local_attn_chunk_length (`int`, defaults to 64): positions per chunk of local attention, which sees its own
            chunk and its neighbours.
        local_num_chunks_before (`int`, defaults to 1): neighbouring chunks before it.
        local_num_chunks_after (`int`, defaults to 0): neighbouring chunks after it.
        lsh_attn_chunk_length (`int`, defaults to 64): the same for LSH attention, in bucket-sorted order.
        lsh_num_chunks_before (`int`, defaults to 1): the same for LSH attention.
        lsh_num_chunks_after (`int`, defaults to 0): the same for LSH attention.
        num_hashes (`int`, defaults to 1): hashing rounds; more rounds approximate full attention better.
        num_buckets (`int` or `list[int]`, *optional*): LSH buckets, even, or a pair of even factors (factorised
            hashing, fewer random rotations). None: :func:`default_num_buckets` of ``max_position_embeddings``,
            stored in the config (transformers instead picks it from the first batch it sees).
        hash_seed (`int`, *optional*): seed of the random rotations. When set, every layer uses the rotations drawn
            from it, in training and in eval, as transformers does. When None, training draws fresh rotations every
            call and eval uses fixed rotations seeded by the layer index, so eval outputs are deterministic and
            survive ``save_pretrained`` / ``from_pretrained``.
        axial_pos_embds (`bool`, defaults to True): axial position embeddings (two small tables whose outer
            concatenation covers ``prod(axial_pos_shape)`` positions); False: one learned row per position.
        axial_pos_shape (`list[int]`, defaults to ``[64, 64]``): the two factors of the position grid (their product
            must cover ``max_position_embeddings``). Shorter inputs use the first positions of the grid; training
            needs no particular length.
        axial_pos_embds_dim (`list[int]`, defaults to ``[64, 192]``): the widths of the two tables (they must sum to
            ``hidden_size``).
        axial_norm_std (`float`, defaults to 1.0): initial standard deviation of the axial tables.
        max_position_embeddings (`int`, defaults to 4096): the longest input.
        reversible (`bool`, defaults to True): in training, run the layers as reversible residual blocks whose
            activations are recomputed from the outputs in the backward pass (memory independent of depth). False:
            ordinary autograd with stored activations (the same numbers; the reference of the gradient tests).
        is_decoder (`bool`, defaults to False): causal attention (``HfxReformerForCausalLM`` sets it).

    ``hidden_dropout_prob``, ``local_attention_probs_dropout_prob``, ``lsh_attention_probs_dropout_prob``,
    ``layer_norm_eps``, ``initializer_range``, ``vocab_size``, ``pad_token_id``, ``eos_token_id``,
    ``classifier_dropout`` and ``use_cache`` are as in ``ReformerConfig``.

    A transformers ``reformer`` config loads as this one (``configs/transformers_checkpoints.py``); its checkpoints
    load into our classes with the LM bias where ours is.
    """

    model_type = "hfx-reformer"
    keys_to_ignore_at_inference = ["past_buckets_states"]

    attention_head_size: int = 64
    attn_layers: list[str] | tuple[str, ...] = ("local", "lsh", "local", "lsh", "local", "lsh")
    axial_norm_std: float = 1.0
    axial_pos_embds: bool = True
    axial_pos_shape: list[int] | tuple[int, ...] = (64, 64)
    axial_pos_embds_dim: list[int] | tuple[int, ...] = (64, 192)
    chunk_size_lm_head: int = 0
    eos_token_id: int | None = 2
    feed_forward_size: int = 512
    hash_seed: int | None = None
    hidden_act: str = "relu"
    hidden_dropout_prob: float = 0.05
    hidden_size: int = 256
    initializer_range: float = 0.02
    is_decoder: bool = False
    layer_norm_eps: float = 1e-12
    local_num_chunks_before: int = 1
    local_num_chunks_after: int = 0
    local_attention_probs_dropout_prob: float = 0.05
    local_attn_chunk_length: int = 64
    lsh_attn_chunk_length: int = 64
    lsh_attention_probs_dropout_prob: float = 0.0
    lsh_num_chunks_before: int = 1
    lsh_num_chunks_after: int = 0
    max_position_embeddings: int = 4096
    num_attention_heads: int = 12
    num_buckets: int | list[int] | None = None
    num_hashes: int = 1
    vocab_size: int = 320
    tie_word_embeddings: bool = False
    use_cache: bool = True
    classifier_dropout: float | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = 0
    reversible: bool = True

    transformers_model_type = "reformer"
    transformers_architectures = {
        "ReformerModel": "HfxReformerModel",
        "ReformerModelWithLMHead": "HfxReformerForCausalLM",
        "ReformerForMaskedLM": "HfxReformerForMaskedLM",
        "ReformerForSequenceClassification": "HfxReformerForSequenceClassification",
        "ReformerForQuestionAnswering": "HfxReformerForQuestionAnswering",
    }

    def __post_init__(self, **kwargs) -> None:
        self.attn_layers = list(self.attn_layers)
        # Derived: a `num_hidden_layers` passed along (a shared base config, a saved config.json) must not override it.
        kwargs.pop("num_hidden_layers", None)
        self.num_hidden_layers = len(self.attn_layers)
        self.axial_pos_shape = tuple(self.axial_pos_shape)
        self.axial_pos_embds_dim = tuple(self.axial_pos_embds_dim)
        super().__post_init__(**kwargs)
        self.validate_reformer()
        if self.num_buckets is None and "lsh" in self.attn_layers:
            self.num_buckets = default_num_buckets(self.max_position_embeddings, self.lsh_attn_chunk_length)
        if isinstance(self.num_buckets, tuple):
            self.num_buckets = list(self.num_buckets)

    @classmethod
    def transformers_weight_renames(cls, config_dict: dict, tensor_names: set[str] | None) -> WeightRenames:
        """Names are ours but for the LM bias, ``lm_head.bias`` here: where a checkpoint has
        ``lm_head.decoder.bias`` (4.x, where it equals ``lm_head.bias``; 5.24+, where it is the one applied and a
        saved ``lm_head.bias`` may be stale), that one is read, as the importer does."""
        if tensor_names is None or "lm_head.decoder.bias" not in tensor_names:
            return WeightRenames()
        if "lm_head.bias" not in tensor_names:
            return WeightRenames(key_mapping={r"^lm_head\.decoder\.bias$": "lm_head.bias"})
        # Both saved: transformers keeps the first of two tensors renamed to one name (lm_head.bias), so the applied
        # copy is set after loading instead.
        return WeightRenames(unused=(r"^lm_head\.decoder\.bias$",), copies={"lm_head.bias": "lm_head.decoder.bias"})

    # ----- derived sizes ---------------------------------------------------------------------------------
    @property
    def chunk_multiple(self) -> int:
        """Inputs longer than :attr:`min_chunk_length` are padded inside the model to a multiple of this (the least
        common multiple of the chunk lengths in use), as transformers pads in eval."""
        lengths = self._chunk_lengths()
        return math.lcm(*lengths)

    @property
    def min_chunk_length(self) -> int:
        return min(self._chunk_lengths())

    def _chunk_lengths(self) -> list[int]:
        lengths = []
        if "local" in self.attn_layers:
            lengths.append(self.local_attn_chunk_length)
        if "lsh" in self.attn_layers:
            lengths.append(self.lsh_attn_chunk_length)
        return lengths

    # ----- validation ------------------------------------------------------------------------------------
    def validate_reformer(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""

        def is_int(value, low: int) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= low

        if not self.attn_layers or any(kind not in ATTENTION_TYPES for kind in self.attn_layers):
            raise ValueError(
                f"attn_layers must be a non-empty list of {ATTENTION_TYPES} (one entry per layer), "
                f"got {self.attn_layers!r}."
            )
        positive = (
            "hidden_size", "num_attention_heads", "attention_head_size", "feed_forward_size", "num_hashes",
            "local_attn_chunk_length", "lsh_attn_chunk_length", "max_position_embeddings", "vocab_size",
        )  # fmt: skip
        non_negative = (
            "local_num_chunks_before", "local_num_chunks_after", "lsh_num_chunks_before", "lsh_num_chunks_after",
            "chunk_size_lm_head", "chunk_size_feed_forward",
        )  # fmt: skip
        for names, least, kind in ((positive, 1, "a positive"), (non_negative, 0, "a non-negative")):
            for name in names:
                if not is_int(getattr(self, name), least):
                    raise ValueError(f"{name} must be {kind} integer, got {getattr(self, name)!r}.")
        if self.num_buckets is not None:
            factors = [self.num_buckets] if isinstance(self.num_buckets, int) else list(self.num_buckets)
            if not factors or len(factors) > 2 or any(not is_int(f, 2) or f % 2 for f in factors):
                raise ValueError(
                    "num_buckets must be an even integer >= 2 or a pair of them (factorised hashing), or None to "
                    f"derive it from max_position_embeddings; got {self.num_buckets!r}."
                )
        if self.axial_pos_embds:
            if len(self.axial_pos_shape) != 2 or len(self.axial_pos_embds_dim) != 2:
                raise ValueError(
                    "axial_pos_shape and axial_pos_embds_dim must each have two entries (a 2-D position grid); "
                    f"got {self.axial_pos_shape} and {self.axial_pos_embds_dim}."
                )
            if sum(self.axial_pos_embds_dim) != self.hidden_size:
                raise ValueError(
                    f"axial_pos_embds_dim {self.axial_pos_embds_dim} must sum to hidden_size ({self.hidden_size})."
                )
            if math.prod(self.axial_pos_shape) < self.max_position_embeddings:
                raise ValueError(
                    f"axial_pos_shape {self.axial_pos_shape} covers {math.prod(self.axial_pos_shape)} positions, fewer "
                    f"than max_position_embeddings ({self.max_position_embeddings}): enlarge a factor of "
                    "axial_pos_shape or lower max_position_embeddings."
                )
        if self.hash_seed is not None and not is_int(self.hash_seed, 0):
            raise ValueError(f"hash_seed must be a non-negative integer or None, got {self.hash_seed!r}.")
        if self.is_decoder and (
            ("local" in self.attn_layers and self.local_num_chunks_after)
            or ("lsh" in self.attn_layers and self.lsh_num_chunks_after)
        ):
            raise ValueError(
                "A causal (is_decoder=True) Reformer cannot look at later chunks: set local_num_chunks_after and "
                "lsh_num_chunks_after to 0."
            )


__all__ = ["HfxReformerConfig", "default_num_buckets"]
