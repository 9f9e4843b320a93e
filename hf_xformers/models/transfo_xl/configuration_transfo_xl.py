"""Configuration of ``hfx-transfo-xl``."""

from __future__ import annotations

from transformers import PreTrainedConfig

from ...configs.transformers_checkpoints import IMPORTER, TransformersCheckpointConfig, WeightRenames

# transformers 4.x config keys with no counterpart: recomputed (tie_projs, read first), training-only or constant.
TRANSFORMERS_DROPPED_KEYS = ("tie_projs", "sample_softmax", "adaptive", "attn_type", "untie_r", "init", "init_range")


def validate_cutoffs(cutoffs: list[int], vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``cutoffs`` is strictly increasing inside ``(0, vocab_size)``."""
    bounds = [0, *cutoffs, vocab_size]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cutoffs must be strictly increasing integers between 0 and vocab_size ({vocab_size}), exclusive; "
            f"got {cutoffs}. Use e.g. cutoffs=[{vocab_size // 4}, {vocab_size // 2}], or [] for a single softmax. "
            "When changing vocab_size (e.g. from_pretrained(..., vocab_size=N, ignore_mismatched_sizes=True)), pass "
            "cutoffs that fit it in the same call."
        )


class HfxTransfoXLConfig(TransformersCheckpointConfig, PreTrainedConfig):
    r"""Configuration of a Transformer-XL language model (Dai et al., 2019).

    Field names and defaults follow ``transformers`` 4.x ``TransfoXLConfig`` (the ``transfo-xl-wt103`` model), so
    its checkpoints import by renaming; ``hidden_size``, ``num_attention_heads``, ``num_hidden_layers`` and
    ``intermediate_size`` are aliases of ``d_model``, ``n_head``, ``n_layer`` and ``d_inner``.

    Attributes:
        vocab_size (`int`): vocabulary size.
        cutoffs (`list[int]`): adaptive input / softmax cluster boundaries (``[]`` for one plain softmax).
        d_model (`int`): width of the hidden states (the projection width ``d_proj`` of the adaptive layers).
        d_embed (`int`, *optional*): embedding width of the shortlist cluster (``d_model`` when None).
        n_head (`int`): attention heads.
        d_head (`int`, *optional*): their width (``d_model // n_head`` when None).
        d_inner (`int`): feed-forward width.
        div_val (`int`): cluster ``i`` has embedding width ``d_embed // div_val**i``.
        pre_lnorm (`bool`): LayerNorm before (True) or after (False, the paper) each sub-layer.
        n_layer (`int`): number of layers.
        mem_len (`int`): hidden states kept per layer as memory for the next segment (0: no memory, a plain
            Transformer with relative positions).
        clamp_len (`int`): distances beyond it use the encoding of ``clamp_len`` (<= 0: no clamping).
        same_length (`bool`): every query attends to exactly ``mem_len`` keys (itself included) instead of to all
            earlier ones; needs ``mem_len > 0``.
        proj_share_all_but_first (`bool`): tie the softmax projections of the tail clusters to the input ones
            (when ``tie_word_embeddings``); the shortlist projection stays separate.
        dropout (`float`): dropout on activations.
        dropatt (`float`): dropout on attention probabilities.
        init_std (`float`): initialisation scale of the weights.
        proj_init_std (`float`): initialisation scale of the adaptive projections.
        classifier_dropout (`float`): dropout before the sequence classification layer (``dropout`` when None).

    A transformers 4.x ``transfo-xl`` config (``transfo-xl-wt103``; transformers 5 has no Transformer-XL) loads as
    this one (``configs/transformers_checkpoints.py``), and its checkpoints into our classes with the layer pieces
    renamed.
    """

    model_type = "hfx-transfo-xl"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
        "intermediate_size": "d_inner",
    }
    vocab_size: int = 267735
    cutoffs: list[int] | None = None
    d_model: int = 1024
    d_embed: int | None = None
    n_head: int = 16
    d_head: int | None = None
    d_inner: int = 4096
    div_val: int = 4
    pre_lnorm: bool = False
    n_layer: int = 18
    mem_len: int = 1600
    clamp_len: int = 1000
    same_length: bool = True
    proj_share_all_but_first: bool = True
    dropout: float = 0.1
    dropatt: float = 0.0
    init_std: float = 0.02
    proj_init_std: float = 0.01
    layer_norm_epsilon: float = 1e-5
    classifier_dropout: float | None = None
    eos_token_id: int | None = 0
    # generate() without input_ids starts from this token; None: the eos token, which separates the documents of
    # Transformer-XL's training streams (so "after <eos>" is the start of a document).
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True

    transformers_model_type = "transfo-xl"
    transformers_architectures = {
        "TransfoXLLMHeadModel": "HfxTransfoXLForCausalLM",
        "TransfoXLModel": "HfxTransfoXLModel",
    }

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        if self.cutoffs is None:
            self.cutoffs = [20000, 40000, 200000]
        self.cutoffs = [int(c) for c in self.cutoffs]
        if self.bos_token_id is None:
            self.bos_token_id = self.eos_token_id
        if self.d_embed is None:
            self.d_embed = self.d_model
        if self.d_head is None and self.n_head > 0 and self.d_model % self.n_head == 0:
            self.d_head = self.d_model // self.n_head
        self.validate_transfo_xl()

    @classmethod
    def config_dict_from_transformers(cls, config_dict: dict) -> dict:
        """4.x ``TransfoXLConfig`` -> ours: the same fields, ``tie_projs`` read back as ``proj_share_all_but_first``
        (4.x stores only the per-cluster list), :data:`TRANSFORMERS_DROPPED_KEYS` dropped.

        Raises:
            ValueError: ``attn_type`` other than 0 (the paper's relative attention, the only one in released
                checkpoints), a ``tie_projs`` list 4.x does not write, or a sequence-classification checkpoint (its
                bias-free ``score`` layer has no counterpart).
        """
        if config_dict.get("attn_type", 0) != 0:
            raise ValueError(
                f"Only attn_type=0 (relative positions) Transformer-XL checkpoints convert; got {config_dict['attn_type']}."
            )
        if "TransfoXLForSequenceClassification" in (config_dict.get("architectures") or []):
            raise ValueError(
                "Cannot import TransfoXLForSequenceClassification: its bias-free `score` layer has no counterpart here. "
                "Import the language model (TransfoXLLMHeadModel) or base model checkpoint and fine-tune "
                "HfxTransfoXLForSequenceClassification."
            )
        ours = {k: v for k, v in config_dict.items() if k not in TRANSFORMERS_DROPPED_KEYS}
        tie_projs = config_dict.get("tie_projs")
        if tie_projs is not None and len(tie_projs) > 1:
            if tie_projs[0] or len(set(tie_projs[1:])) != 1:
                raise ValueError(
                    f"tie_projs={tie_projs} is no layout 4.x writes ([False] + [proj_share_all_but_first] * "
                    "len(cutoffs)); this checkpoint cannot be converted."
                )
            ours["proj_share_all_but_first"] = bool(tie_projs[1])
        return super().config_dict_from_transformers(ours)

    @classmethod
    def transformers_weight_renames(cls, config_dict: dict, tensor_names: set[str] | None) -> WeightRenames:
        """4.x names -> ours (``dec_attn.*`` -> ``attention*``, ``pos_ff.CoreNet.{0,3}`` -> ``ff_in`` / ``ff_out``,
        ``crit.`` -> ``adaptive_softmax.``); the ``pos_emb.inv_freq`` buffer is recomputed. ``r_w_bias`` /
        ``r_r_bias`` shared by all layers (``untie_r=False``) are copied into every layer after loading.

        Raises:
            ValueError: ``untie_r=False`` while the checkpoint's tensor names could not be read.
        """
        renames = {
            r"dec_attn\.qkv_net\.": "attention.qkv_net.",
            r"dec_attn\.r_net\.": "attention.r_net.",
            r"dec_attn\.r_w_bias$": "attention.r_w_bias",
            r"dec_attn\.r_r_bias$": "attention.r_r_bias",
            r"dec_attn\.o_net\.": "attention_output.",
            r"dec_attn\.layer_norm\.": "attention_layer_norm.",
            r"pos_ff\.CoreNet\.0\.": "ff_in.",
            r"pos_ff\.CoreNet\.3\.": "ff_out.",
            r"pos_ff\.layer_norm\.": "ff_layer_norm.",
            r"^crit\.": "adaptive_softmax.",
        }
        if tensor_names is None:
            if config_dict.get("untie_r", True) is False:
                raise ValueError(
                    "this checkpoint shares r_w_bias / r_r_bias across layers (untie_r=False) and its tensor names "
                    f"could not be read; convert it once with `{IMPORTER} --source DIR --output DIR` "
                    "(which copies them into every layer) and load the output."
                )
            return WeightRenames(key_mapping=renames, unused=(r"pos_emb\.inv_freq$",))
        shared = {name.removeprefix("transformer."): name for name in tensor_names
                  if name.removeprefix("transformer.") in ("r_w_bias", "r_r_bias")}  # fmt: skip
        layers = int(config_dict.get("n_layer", cls.n_layer))
        copies = {
            f"transformer.layers.{i}.attention.{bias}": name for bias, name in shared.items() for i in range(layers)
        }
        return WeightRenames(
            key_mapping=renames, unused=(r"pos_emb\.inv_freq$", r"^(transformer\.)?r_[wr]_bias$"), copies=copies
        )

    @property
    def tie_projs(self) -> list[bool]:
        """Per cluster: is the softmax projection tied to the input one (shortlist never, tails when sharing)."""
        return [False] + [self.proj_share_all_but_first] * len(self.cutoffs)

    def validate_transfo_xl(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""
        if self.d_head is None:
            raise ValueError(
                f"hidden_size/d_model ({self.d_model}) must be divisible by num_attention_heads/n_head ({self.n_head}), "
                "or set d_head explicitly."
            )
        validate_cutoffs(self.cutoffs, self.vocab_size)
        if self.div_val < 1:
            raise ValueError(f"div_val must be >= 1, got {self.div_val}.")
        if self.div_val > 1 and self.d_embed // self.div_val ** len(self.cutoffs) < 1:
            raise ValueError(
                f"div_val={self.div_val} leaves the last of {len(self.cutoffs) + 1} clusters no embedding width "
                f"(d_embed={self.d_embed}); lower div_val or use fewer cutoffs."
            )
        if self.mem_len < 0:
            raise ValueError(f"mem_len must be >= 0 (0 disables the memory), got {self.mem_len}.")
        if self.same_length and self.mem_len == 0:
            raise ValueError(
                "same_length=True limits attention to the last mem_len keys, so it needs mem_len > 0; "
                "set same_length=False for a model without memory."
            )
        for name in ("dropout", "dropatt"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}.")
