"""Turn a short-context RoBERTa or BERT checkpoint into a long-context hf_xformers model.

The recipe of the Longformer paper (Beltagy, Peters & Cohan, 2020, section 5): keep every pretrained weight,
grow the learned position table to the new length by tiling the pretrained rows (the model then already
"knows" local position patterns everywhere), and start the global-attention projections as copies of the
local ones. The result reproduces the source on inputs the source could handle whenever the attention window
covers the whole input; continued MLM pretraining on long documents is what makes it good beyond that.

Usage (``hfx-convert`` is installed with the package; ``python -m hf_xformers.conversion.convert_roberta_to_long``
runs the same)::

    hfx-convert --source DIR --target longformer --max-length 4096 --attention-window 512 --output DIR

``--target`` picks the architecture from :data:`TARGETS`; later architectures plug in by adding a builder
there. ``linformer`` and ``performer`` map the weights exactly as ``longformer`` does (same Q/K/V and
feed-forward weights, tiled positions) and add their own pieces: Linformer's E and F start as block-averaging
projections (:func:`pooling_projection`), Performer's random features are the seeded draws of a fresh model::

    hfx-convert --source DIR --target linformer --max-length 4096 --linformer-k 256 --output DIR
    hfx-convert --source DIR --target performer --max-length 4096 --num-random-features 256 --output DIR
    hfx-convert --source DIR --target bigbird --max-length 4096 --block-size 64 --num-random-blocks 3 --output DIR
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_xformers import (  # noqa: E402
    HfxBigBirdConfig,
    HfxBigBirdForMaskedLM,
    HfxBigBirdModel,
    HfxLinformerConfig,
    HfxLinformerForMaskedLM,
    HfxLinformerModel,
    HfxLongformerConfig,
    HfxLongformerForMaskedLM,
    HfxLongformerModel,
    HfxPerformerConfig,
    HfxPerformerForMaskedLM,
    HfxPerformerModel,
)

from .common import (  # noqa: E402
    conversion_provenance,
    drop_buffers,
    load_converted_weights,
    load_tokenizer,
    load_weights,
    prepare_output_dir,
    read_config,
    save_model_and_tokenizer,
    split_prefix,
)
from .sentence_transformers_modules import carry_sentence_transformers_modules

logger = logging.getLogger(__name__)

# model_type -> family. The family decides the weight prefix, the position-id convention and the MLM head names.
SOURCE_FAMILIES = {"roberta": "roberta", "bert": "bert"}
ACCEPTED_SOURCES = "a local RoBERTa (model_type 'roberta') or BERT (model_type 'bert') checkpoint directory"


@dataclass
class EncoderSource:
    """A RoBERTa/BERT checkpoint read from disk, with names normalised to the RoBERTa layout.

    Attributes:
        family: ``"roberta"`` (position ids start at ``pad_token_id + 1``) or ``"bert"`` (start at 0).
        config: the source ``config.json`` as a dict.
        base: encoder weights without prefix (``embeddings.*``, ``encoder.*``, ``pooler.*``).
        mlm_head: MLM head under RoBERTa's ``lm_head`` names without the ``lm_head.`` prefix (``dense.*``,
            ``layer_norm.*``, ``decoder.bias`` and ``decoder.weight`` when stored), or None when the source has none.
        tokenizer: the source tokenizer.
        sep_token_id, bos_token_id, eos_token_id: special ids for the new config.
    """

    family: str
    config: dict
    base: dict[str, torch.Tensor]
    mlm_head: dict[str, torch.Tensor] | None
    tokenizer: PreTrainedTokenizerBase
    sep_token_id: int
    bos_token_id: int
    eos_token_id: int

    @property
    def pad_token_id(self) -> int:
        """Padding id; it also fixes the position offset (``pad_token_id + 1``) of the new model."""
        default = 1 if self.family == "roberta" else 0
        return _first_id(self.config.get("pad_token_id"), self.tokenizer.pad_token_id, default)

    @property
    def has_pooler(self) -> bool:
        """Whether the source stores a trained pooler (``pooler.dense.*``)."""
        return "pooler.dense.weight" in self.base

    @property
    def length(self) -> int:
        """Tokens the source accepts: its position rows, less RoBERTa's ``pad_token_id + 1`` special rows."""
        rows = int(self.config.get("max_position_embeddings", 512))
        return rows - (self.pad_token_id + 1 if self.family == "roberta" else 0)


def saved_class(src: EncoderSource, masked_lm: type[PreTrainedModel], base: type[PreTrainedModel]) -> tuple[type, str]:
    """The class a conversion saves and the prefix of its encoder weights.

    A source with an MLM head gives the masked-LM model (``"<arch>."`` prefix); one without gives the base model
    (no prefix), which keeps the source's pooler: a masked-LM model would carry a random, untrained ``lm_head`` and
    drop the trained pooler.
    """
    if src.mlm_head is not None:
        return masked_lm, f"{masked_lm.base_model_prefix}."
    return base, ""


def new_model(model_class: type[PreTrainedModel], config, src: EncoderSource) -> PreTrainedModel:
    """A fresh ``model_class`` for the source's weights: a base model of a source without a pooler has none either, so
    that no untrained pooler is saved as if it were the source's (loading then lists it as missing, and no task head
    starts from it)."""
    if src.mlm_head is None and not src.has_pooler:
        return model_class(config, add_pooling_layer=False)
    return model_class(config)


def _mlm_head_roberta(rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    head = {k[len("lm_head.") :]: v for k, v in rest.items() if k.startswith("lm_head.")}
    if not head:
        return None
    # transformers stores the decoder bias as `lm_head.bias` (tied to `lm_head.decoder.bias`); ours is the latter.
    bias = head.pop("bias", None)
    if bias is not None:
        head.setdefault("decoder.bias", bias)
    return head


def _mlm_head_bert(rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    renames = {
        "cls.predictions.transform.dense.": "dense.",
        "cls.predictions.transform.LayerNorm.": "layer_norm.",
        "cls.predictions.decoder.": "decoder.",
        "cls.predictions.bias": "decoder.bias",
    }
    head = {}
    for key, tensor in rest.items():
        for old, new in renames.items():
            if key.startswith(old):
                head.setdefault(new + key[len(old) :], tensor)
                break
    return head or None


def read_encoder_source(source: str | Path) -> EncoderSource:
    """Read a local RoBERTa/BERT checkpoint (any head, or a bare base model) and its tokenizer.

    Raises:
        ValueError: not a directory, not a RoBERTa/BERT checkpoint, a relative position embedding, no weights
            or no tokenizer. The message says what is accepted.
    """
    try:
        config = read_config(source, SOURCE_FAMILIES)
    except ValueError as error:
        raise ValueError(f"{error} convert_roberta_to_long accepts {ACCEPTED_SOURCES}.") from None
    family = SOURCE_FAMILIES[config["model_type"]]
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(
            f"Source uses position_embedding_type={position_type!r}; only learned absolute positions can be "
            f"tiled to a longer length. convert_roberta_to_long accepts {ACCEPTED_SOURCES} with absolute positions."
        )
    weights = drop_buffers(load_weights(source))
    base, rest = split_prefix(weights, f"{family}.")
    if "embeddings.position_embeddings.weight" not in base:
        raise ValueError(
            f"No encoder weights found in {str(source)!r} (expected '{family}.embeddings.*' or bare 'embeddings.*' "
            f"keys); convert_roberta_to_long accepts {ACCEPTED_SOURCES}."
        )
    mlm_head = _mlm_head_roberta(rest) if family == "roberta" else _mlm_head_bert(rest)
    if mlm_head is not None and config.get("hidden_act", "gelu") != "gelu":
        # Our LM head applies exact GELU, as RoBERTa's does; BERT's applies config.hidden_act.
        logger.warning(
            "Source hidden_act is %r but the converted MLM head uses gelu; MLM logits will differ slightly.",
            config["hidden_act"],
        )
    tokenizer = load_tokenizer(source, required=True)
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != config.get(
        "pad_token_id", tokenizer.pad_token_id
    ):
        logger.warning(
            "Tokenizer pad id %s differs from config pad_token_id %s; position ids follow the config.",
            tokenizer.pad_token_id,
            config.get("pad_token_id"),
        )
    if family == "roberta":
        bos = _first_id(config.get("bos_token_id"), tokenizer.bos_token_id, tokenizer.cls_token_id)
        eos = _first_id(config.get("eos_token_id"), tokenizer.eos_token_id, tokenizer.sep_token_id)
        sep = _first_id(tokenizer.sep_token_id, config.get("sep_token_id"), eos)
    else:
        # BERT has no <s>/</s>: [CLS] opens and [SEP] closes every sequence.
        bos = _first_id(tokenizer.cls_token_id, config.get("bos_token_id"))
        sep = _first_id(tokenizer.sep_token_id, config.get("sep_token_id"))
        eos = sep
    return EncoderSource(family, config, base, mlm_head, tokenizer, sep, bos, eos)


def _first_id(*candidates: int | None) -> int:
    """The first special-token id that is set (tokenizers and configs each leave some unset)."""
    for candidate in candidates:
        if candidate is not None:
            return int(candidate)
    raise ValueError("The source tokenizer/config define no [SEP]/<s>/</s> token id; set them in the tokenizer.")


def extend_position_table(table: torch.Tensor, family: str, pad_token_id: int, max_length: int) -> torch.Tensor:
    """Grow a learned position table to ``max_length`` tokens in RoBERTa's id layout.

    The result has ``max_length + pad_token_id + 1`` rows: rows ``0 .. pad_token_id`` are the special rows
    (copied from RoBERTa; zeros for BERT, which has none), and row ``pad_token_id + 1 + t`` holds the position
    vector of token ``t``, taken from the pretrained rows tiled end to end. For BERT the pretrained rows start
    at 0, so a right-padded BERT input sees exactly BERT's position vectors.

    Args:
        table: the source ``position_embeddings.weight`` ``(rows, hidden)``.
        family: ``"roberta"`` or ``"bert"``.
        pad_token_id: the padding id (RoBERTa's position offset is ``pad_token_id + 1``).
        max_length: tokens the new table must serve.

    Returns:
        ``(max_length + pad_token_id + 1, hidden)`` tensor (a new tensor, not a view of ``table``).
    """
    offset = pad_token_id + 1
    if family == "roberta":
        special, learned = table[:offset], table[offset:]
    else:
        special, learned = torch.zeros(offset, table.shape[1], dtype=table.dtype), table
    repeats = -(-max_length // learned.shape[0])
    tiled = learned.repeat(repeats, 1)[:max_length]
    return torch.cat([special, tiled]).clone()


def build_longformer(src: EncoderSource, max_length: int, attention_window: int) -> PreTrainedModel:
    """The source weights in the Longformer layout (the paper's recipe): an :class:`HfxLongformerForMaskedLM` with
    the source's MLM head when it has one, else an :class:`HfxLongformerModel` with the source's pooler
    (:func:`saved_class`)."""
    cfg = src.config
    num_layers = int(cfg["num_hidden_layers"])
    word_embeddings = src.base["embeddings.word_embeddings.weight"]
    head = dict(src.mlm_head) if src.mlm_head else {}
    decoder_weight = head.pop("decoder.weight", None)
    # Keep an untied source decoder as it is; a tied (or absent) one stays tied to the embeddings.
    untied = decoder_weight is not None and not torch.equal(decoder_weight, word_embeddings)
    optional = {
        key: cfg[key]
        for key in (
            "hidden_act",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "initializer_range",
            "layer_norm_eps",
        )
        if key in cfg
    }
    config = HfxLongformerConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=int(cfg["num_attention_heads"]),
        intermediate_size=int(cfg["intermediate_size"]),
        type_vocab_size=int(cfg.get("type_vocab_size", 1)),
        classifier_dropout=cfg.get("classifier_dropout"),
        attention_window=[attention_window] * num_layers,
        max_position_embeddings=max_length + src.pad_token_id + 1,
        pad_token_id=src.pad_token_id,
        bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id,
        sep_token_id=src.sep_token_id,
        tie_word_embeddings=not untied,
        **optional,
    )
    model_class, prefix = saved_class(src, HfxLongformerForMaskedLM, HfxLongformerModel)
    config.architectures = [model_class.__name__]
    model = new_model(model_class, config, src)

    # A masked-LM model has no pooler (as RoBERTa's has none); the base model keeps the source's.
    keep_pooler = src.mlm_head is None
    state = {prefix + k: v for k, v in src.base.items() if keep_pooler or not k.startswith("pooler.")}
    state[f"{prefix}embeddings.position_embeddings.weight"] = extend_position_table(
        src.base["embeddings.position_embeddings.weight"], src.family, src.pad_token_id, max_length
    )
    for i in range(num_layers):
        layer = f"{prefix}encoder.layer.{i}.attention.self."
        for proj in ("query", "key", "value"):
            for param in ("weight", "bias"):
                # clone(): the global projections must be separate tensors that fine-tuning can move apart.
                state[f"{layer}{proj}_global.{param}"] = state[f"{layer}{proj}.{param}"].clone()
    state.update({f"lm_head.{k}": v for k, v in head.items()})
    if untied:
        state["lm_head.decoder.weight"] = decoder_weight
    load_converted_weights(model, state, may_be_missing=_may_be_missing(src, config))
    return model


def _may_be_missing(src: EncoderSource, config) -> list[str]:
    """Names a target may leave at their initial values: the tied decoder (a base model built for a source without a
    pooler has none to fill, :func:`new_model`)."""
    return ["lm_head.decoder.weight"] if config.tie_word_embeddings and src.mlm_head is not None else []


def copy_proj_layers(model: torch.nn.Module) -> int:
    """Copy every layer's local Q/K/V projections into its global ones (``query`` -> ``query_global`` ...).

    The last step of the Longformer recipe: masked-LM pretraining uses no global attention, so only the local
    projections learn; re-copying them after continued pretraining starts fine-tuning's global attention from the
    trained weights. Works on any module tree that holds hfx-longformer attention layers.

    Returns:
        The number of attention layers copied (0 when the model has no global projections).
    """
    copied = 0
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "query_global"):
                continue
            for name in ("query", "key", "value"):
                local, global_ = getattr(module, name), getattr(module, f"{name}_global")
                global_.weight.copy_(local.weight)
                global_.bias.copy_(local.bias)
            copied += 1
    return copied


def randomize_new_positions(model: PreTrainedModel, source_length: int, max_length: int, seed: int = 0) -> int:
    """Replace the tiled position rows past the source's ``source_length`` tokens by fresh draws from
    ``N(0, initializer_range)`` (seeded): the Longformer paper's "random init" ablation, worse than copying.

    Returns:
        The number of rows redrawn.
    """
    table = model.base_model.embeddings.position_embeddings.weight
    # RoBERTa's layout keeps pad_token_id + 1 unused rows in front; BigBird's table starts at token 0.
    first_new = table.shape[0] - max_length + source_length
    if first_new >= table.shape[0]:
        return 0
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(table.shape[0] - first_new, table.shape[1], generator=generator)
    with torch.no_grad():
        table[first_new:] = (rows * model.config.initializer_range).to(table.dtype)
    return table.shape[0] - first_new


# Config fields a warm start carries over from the Longformer built by build_longformer (everything but the window).
_ENCODER_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "type_vocab_size",
    "classifier_dropout", "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
    "tie_word_embeddings", "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
    "layer_norm_eps",
)  # fmt: skip


def _warm_start_state(src: EncoderSource, max_length: int, prefix: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config fields and weights of the source mapped as :func:`build_longformer` maps them (tiled positions, MLM
    head kept, or the base model's pooler), renamed to the base-model ``prefix`` of another architecture's
    masked-LM model (a base model's keys have none), without Longformer's global projections. Returns
    ``(config fields, state dict)``."""
    longformer = build_longformer(src, max_length, attention_window=2)  # the window plays no part in the weights
    fields = {key: getattr(longformer.config, key) for key in _ENCODER_FIELDS}
    state = {}
    for key, tensor in longformer.state_dict().items():
        if "_global." in key:
            continue
        state[prefix + key.removeprefix("longformer.") if key.startswith("longformer.") else key] = tensor
    return fields, state


def pooling_projection(max_length: int, projected_length: int) -> torch.Tensor:
    """Linformer ``E``/``F`` that average consecutive positions: ``(max_length, projected_length)``.

    Column ``r`` averages positions ``floor(r n / k) .. floor((r + 1) n / k) - 1`` (blocks of ``n / k`` tokens, sizes
    differing by at most one). Projected keys and values are then block means, and attention over them is the
    source's full attention at the resolution of a block: exactly the source's attention when ``k >= n`` (the
    projection is the identity, extra columns zero and masked), and close to it when attention varies little within
    a block. Random (Johnson-Lindenstrauss) projections would instead mix every token into every projected key and
    wipe out the pretrained attention patterns until retrained.
    """
    n, k = max_length, projected_length
    matrix = torch.zeros(n, k)
    if k >= n:
        matrix[:, :n] = torch.eye(n)
        return matrix
    bounds = [r * n // k for r in range(k + 1)]
    for r in range(k):
        matrix[bounds[r] : bounds[r + 1], r] = 1.0 / (bounds[r + 1] - bounds[r])
    return matrix


def build_linformer(
    src: EncoderSource,
    max_length: int,
    attention_window: int,
    linformer_k: int = 256,
    linformer_sharing: str = "headwise",
) -> PreTrainedModel:
    """An :class:`HfxLinformerForMaskedLM` holding the source weights (as :func:`build_longformer`), with every
    ``E`` and ``F`` set to :func:`pooling_projection`. ``attention_window`` is not used."""
    fields, state = _warm_start_state(src, max_length, "linformer.")
    model_class, _ = saved_class(src, HfxLinformerForMaskedLM, HfxLinformerModel)
    config = HfxLinformerConfig(
        **fields, linformer_k=linformer_k, linformer_sharing=linformer_sharing, architectures=[model_class.__name__]
    )
    model = new_model(model_class, config, src)
    pooling = pooling_projection(config.linformer_max_length, linformer_k)
    for name, param in model.named_parameters():
        if "projection" in name:
            state[name] = pooling.expand_as(param).clone()
    load_converted_weights(model, state, may_be_missing=_may_be_missing(src, config))
    return model


def build_performer(
    src: EncoderSource, max_length: int, attention_window: int, num_random_features: int | None = None
) -> PreTrainedModel:
    """An :class:`HfxPerformerForMaskedLM` holding the source weights (as :func:`build_longformer`); FAVOR+ then
    estimates the source's softmax attention with the same Q/K/V, more closely with more features. The random
    projections are the seeded draws of a fresh model. ``attention_window`` is not used."""
    fields, state = _warm_start_state(src, max_length, "performer.")
    model_class, _ = saved_class(src, HfxPerformerForMaskedLM, HfxPerformerModel)
    config = HfxPerformerConfig(**fields, num_random_features=num_random_features, architectures=[model_class.__name__])
    model = new_model(model_class, config, src)
    buffers = [name for name, _ in model.named_buffers() if name.endswith(("projection_matrix", "num_redraws"))]
    load_converted_weights(model, state, may_be_missing=buffers + _may_be_missing(src, config))
    return model


def build_bigbird(
    src: EncoderSource,
    max_length: int,
    attention_window: int,
    block_size: int = 64,
    num_random_blocks: int = 3,
    attention_type: str = "block_sparse",
) -> PreTrainedModel:
    """An :class:`HfxBigBirdForMaskedLM` holding the source weights: BigBird's warm start from RoBERTa (Zaheer et
    al., 2020: block 64, 3 random blocks). Weights are mapped as :func:`build_longformer` maps them; BigBird counts
    positions from 0, so its table is the tiled part of the Longformer table (the special rows are dropped) and a
    right-padded input sees exactly the source's position vectors. The MLM head applies ``hidden_act`` as the
    source's does. ``attention_window`` is not used."""
    fields, state = _warm_start_state(src, max_length, "bigbird.")
    model_class, prefix = saved_class(src, HfxBigBirdForMaskedLM, HfxBigBirdModel)
    offset = src.pad_token_id + 1
    table = state[f"{prefix}embeddings.position_embeddings.weight"]
    state[f"{prefix}embeddings.position_embeddings.weight"] = table[offset:].clone()
    fields["max_position_embeddings"] = max_length
    config = HfxBigBirdConfig(
        **fields,
        attention_type=attention_type,
        block_size=block_size,
        num_random_blocks=num_random_blocks,
        architectures=[model_class.__name__],
    )
    model = new_model(model_class, config, src)
    load_converted_weights(model, state, may_be_missing=_may_be_missing(src, config))
    return model


# --target name -> builder(source, max_length, attention_window, **target_options). BigBird goes here.
TARGETS: dict[str, Callable[[EncoderSource, int, int], PreTrainedModel]] = {
    "longformer": build_longformer,
    "linformer": build_linformer,
    "performer": build_performer,
    "bigbird": build_bigbird,
}


def convert_roberta_to_long(
    source: str | Path,
    target: str = "longformer",
    max_length: int = 4096,
    attention_window: int = 512,
    output_dir: str | Path | None = None,
    target_options: dict | None = None,
    overwrite: bool = False,
    base_model: str | None = None,
    new_positions: str = "copy",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Convert a local RoBERTa/BERT checkpoint into a long-context hf_xformers model.

    What is saved follows the source: a source with an MLM head gives the target's masked-LM model (its
    ``lm_head`` the source's), one without gives the target's base model with the source's pooler (a warning says
    so); task heads (``AutoModelForSequenceClassification`` ...) load from either with new head weights, except that
    from a kept pooler sequence classification starts its ``classifier.dense`` and multiple choice reads it (BERT's
    heads pool so), so only their last layer is new.

    Args:
        source: local directory holding the checkpoint (any RoBERTa/BERT head or a bare base model) and its
            tokenizer.
        target: key of :data:`TARGETS` (``"longformer"``, ``"linformer"``, ``"performer"``, ``"bigbird"``).
        max_length: tokens the converted model accepts, more than the source accepts; the tokenizer's
            ``model_max_length`` is set to it.
        attention_window: full local window width (even; each token sees ``attention_window // 2`` neighbours
            on each side), the same for every layer.
        output_dir: when given, the model and tokenizer are saved there with ``save_pretrained``. It must be new
            or empty, unless ``overwrite`` (see :func:`hf_xformers.conversion.common.prepare_output_dir`).
        target_options: extra keyword arguments of the target's builder: ``linformer_k`` and ``linformer_sharing``
            (:func:`build_linformer`), ``num_random_features`` (:func:`build_performer`), ``block_size``,
            ``num_random_blocks`` and ``attention_type`` (:func:`build_bigbird`).
        overwrite: replace the checkpoint files of a non-empty ``output_dir``.
        base_model: the Hub id ``source`` was downloaded from, named as ``base_model`` in the card written with the
            output (found by itself for a Hub cache folder; see :func:`hf_xformers.conversion.common.conversion_provenance`).
        new_positions: ``"copy"`` (the recipe: the source's position vectors tiled over the new length) or
            ``"random"`` (positions past the source's length drawn afresh, :func:`randomize_new_positions`; the
            paper's ablation, for comparison only).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.

    Raises:
        ValueError: unknown target, unusable source (message says what is accepted), or a ``max_length`` not
            longer than the source's.
    """
    _check_request(target, max_length, new_positions)
    src = read_encoder_source(source)
    source_length = src.length
    if max_length <= source_length:
        raise ValueError(
            f"max_length={max_length} is not longer than the {source_length} tokens the source accepts, so the "
            f"conversion would make no long model (a shorter one would cut the position table). Pass a max_length "
            f"above {source_length} (--max-length, e.g. 4096), or use the source as it is for inputs up to "
            f"{source_length} tokens."
        )
    if output_dir is not None:
        prepare_output_dir(output_dir, overwrite)
    if src.mlm_head is None:
        _warn_base_model(source, src, target)
    model = TARGETS[target](src, max_length, attention_window, **(target_options or {})).eval()
    if new_positions == "random":
        redrawn = randomize_new_positions(model, source_length, max_length)
        logger.info("Drew %d new position rows at random (new_positions='random').", redrawn)

    tokenizer = src.tokenizer
    tokenizer.model_max_length = max_length
    # init_kwargs are what save_pretrained writes, so the new length survives a save/load round trip.
    tokenizer.init_kwargs["model_max_length"] = max_length
    if output_dir is not None:
        how = f"with hf_xformers' `hfx-convert` ({', '.join(_options_text(src, target, max_length, new_positions))})"
        save_model_and_tokenizer(model, tokenizer, output_dir, conversion_provenance(source, base_model, how))
        # A sentence-transformers source keeps its pooling, normalisation ... and embeds up to the new length.
        carry_sentence_transformers_modules(source, output_dir, max_seq_length=max_length)
    return model, tokenizer


def _check_request(target: str, max_length: int, new_positions: str) -> None:
    """Refuse, before reading the source, a request no source can satisfy (``ValueError`` naming the choices)."""
    if target not in TARGETS:
        raise ValueError(f"Unknown target {target!r}; choose one of {sorted(TARGETS)}.")
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}.")
    if new_positions not in ("copy", "random"):
        raise ValueError(f"new_positions must be 'copy' or 'random', got {new_positions!r}.")


def _warn_base_model(source: str | Path, src: EncoderSource, target: str) -> None:
    """Say that a source without an MLM head is saved as the base model, and what its heads start from."""
    logger.warning(
        "Source %s has no MLM head: saving the base model of %s with the source's pooler, not a masked-LM model. "
        "Task heads load from it (AutoModelForSequenceClassification.from_pretrained ...): sequence classification "
        "starts its classifier.dense from the pooler and multiple choice reads the pooler, as BERT's heads do, so "
        "only their last layer is new; token classification and question answering use no pooler and report it "
        "UNEXPECTED, as BERT's do. AutoModelForMaskedLM starts a new, untrained MLM head.",
        source,
        target,
    )
    if not src.has_pooler:
        logger.warning(
            "Source %s has no pooler either: the base model is saved without one (AutoModel starts it untrained and "
            "lists it as missing; the classification heads start their own).",
            source,
        )


def _options_text(src: EncoderSource, target: str, max_length: int, new_positions: str) -> list[str]:
    """How the conversion was made, in words, for the model card's provenance line."""
    options = [f"target {target}", f"max_length {max_length}"]
    if new_positions == "random":
        options.append("new positions drawn at random")
    if src.mlm_head is None:
        pooler = "its pooler kept" if src.has_pooler else "without a pooler (the source has none)"
        options.append(f"no MLM head in the source: saved as the base model, {pooler}")
    return options


CLI_DESCRIPTION = (
    "Convert a local RoBERTa or BERT checkpoint (any head, or a bare encoder, with its tokenizer) into a long-context "
    "hf_xformers model (--target) that accepts --max-length tokens: every pretrained weight is kept, the position "
    "table is tiled to the new length and Longformer's global projections start as copies of the local ones. A "
    "source with an MLM head gives a masked-LM model; a source without one gives the base model (its pooler kept), "
    "from which task heads load with new weights (sequence classification and multiple choice start from the pooler, "
    "as BERT's heads do). The output folder gets the model, the tokenizer and a model card."
)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (``hfx-convert``)."""
    parser = argparse.ArgumentParser(
        description=CLI_DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--source", required=True, help="local RoBERTa/BERT checkpoint directory (with tokenizer)")
    parser.add_argument("--target", default="longformer", choices=sorted(TARGETS), help="architecture to build")
    parser.add_argument("--max-length", type=int, default=4096, help="tokens the new model accepts")
    parser.add_argument("--attention-window", type=int, default=512, help="full local window width (even)")
    parser.add_argument("--output", required=True, help="directory to save the converted model and tokenizer")
    parser.add_argument("--overwrite", action="store_true", help="replace the checkpoint files of a non-empty --output")
    parser.add_argument("--linformer-k", type=int, default=256, help="linformer: projected length k")
    parser.add_argument("--linformer-sharing", default="headwise", help="linformer: none, headwise, kv or layerwise")
    parser.add_argument("--num-random-features", type=int, default=None, help="performer: features per head (d ln d)")
    parser.add_argument("--block-size", type=int, default=64, help="bigbird: tokens per block")
    parser.add_argument("--num-random-blocks", type=int, default=3, help="bigbird: random key blocks per query block")
    parser.add_argument("--base-model", help="Hub id --source was downloaded from (named in the model card)")
    parser.add_argument(
        "--new-positions", default="copy", choices=("copy", "random"),
        help="positions past the source's length: copies of its table (the recipe) or random (an ablation)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = {
        "linformer": {"linformer_k": args.linformer_k, "linformer_sharing": args.linformer_sharing},
        "performer": {"num_random_features": args.num_random_features},
        "bigbird": {"block_size": args.block_size, "num_random_blocks": args.num_random_blocks},
    }.get(args.target)
    try:
        convert_roberta_to_long(
            args.source,
            args.target,
            args.max_length,
            args.attention_window,
            args.output,
            options,
            args.overwrite,
            base_model=args.base_model,
            new_positions=args.new_positions,
        )
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
