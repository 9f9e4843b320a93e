"""Import a checkpoint of one of ``transformers``' own architectures into the matching hf_xformers class.

For example ``allenai/longformer-base-4096``, saved locally with ``save_pretrained``, becomes an
``hfx-longformer`` checkpoint with the same weights, config values (attention windows, labels ...) and
tokenizer, and gives the same outputs.

Usage::

    hfx-import --source DIR --output DIR      # or python -m hf_xformers.conversion.convert_from_transformers

:data:`IMPORTERS` maps the source ``model_type`` to its importer; BigBird, Swin, Reformer and Transformer-XL
plug in there.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_xformers import (  # noqa: E402
    HfxBigBirdConfig,
    HfxBigBirdForMaskedLM,
    HfxBigBirdForMultipleChoice,
    HfxBigBirdForTokenClassification,
    HfxBigBirdModel,
    HfxLongformerConfig,
    HfxLongformerForMaskedLM,
    HfxLongformerForMultipleChoice,
    HfxLongformerForQuestionAnswering,
    HfxLongformerForSequenceClassification,
    HfxLongformerForTokenClassification,
    HfxLongformerModel,
    HfxSwinBackbone,
    HfxSwinConfig,
    HfxSwinForImageClassification,
    HfxSwinForMaskedImageModeling,
    HfxSwinImageProcessor,
    HfxSwinModel,
    HfxTransfoXLConfig,
    HfxTransfoXLForCausalLM,
    HfxTransfoXLModel,
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

# Each importer builds its config with the translation from_pretrained uses on the fly
# (`config_dict_from_transformers`, hf_xformers/configs/transformers_checkpoints.py): one set of rules and refusals.

LONGFORMER_CLASSES: dict[str, type[PreTrainedModel]] = {
    "LongformerModel": HfxLongformerModel,
    "LongformerForMaskedLM": HfxLongformerForMaskedLM,
    "LongformerForSequenceClassification": HfxLongformerForSequenceClassification,
    "LongformerForMultipleChoice": HfxLongformerForMultipleChoice,
    "LongformerForQuestionAnswering": HfxLongformerForQuestionAnswering,
    "LongformerForTokenClassification": HfxLongformerForTokenClassification,
}


def _pick_class(
    config: dict,
    rest: dict[str, torch.Tensor],
    classes: dict[str, type[PreTrainedModel]],
    base_name: str,
    mlm_name: str,
) -> type[PreTrainedModel]:
    """Target class from ``config.architectures`` (``base_name`` when absent). A base-model checkpoint that also
    holds an MLM head becomes ``mlm_name``, so the pretrained head is not thrown away.

    Raises:
        ValueError: ``architectures`` names only classes missing from ``classes``.
    """
    architectures = config.get("architectures") or []
    known = [name for name in architectures if name in classes]
    if architectures and not known:
        raise ValueError(f"Unsupported architectures {architectures}; accepted: {sorted(classes)}.")
    name = known[0] if known else base_name
    if name == base_name and any(k.startswith("lm_head.") for k in rest):
        logger.info("%s checkpoint carries an MLM head: importing it as %s.", name, mlm_name)
        name = mlm_name
    return classes[name]


def import_longformer(source: Path, config: dict) -> PreTrainedModel:
    """``transformers`` Longformer (any head) -> the matching ``HfxLongformer*`` class with the same weights.

    Names are already ours except: the ``*.position_ids`` buffers are dropped and the MLM decoder bias, stored as
    ``lm_head.bias``, becomes ``lm_head.decoder.bias``.
    """
    weights = drop_buffers(load_weights(source))
    base, rest = split_prefix(weights, "longformer.")
    model_class = _pick_class(config, rest, LONGFORMER_CLASSES, "LongformerModel", "LongformerForMaskedLM")

    kwargs = HfxLongformerConfig.config_dict_from_transformers(config)
    kwargs["architectures"] = [model_class.__name__]
    hfx_config = HfxLongformerConfig(**kwargs)
    model = model_class(hfx_config)

    if "lm_head.bias" in rest:
        rest.setdefault("lm_head.decoder.bias", rest["lm_head.bias"])
        del rest["lm_head.bias"]
    load_base_and_head(model, base, rest)
    return model


def load_base_and_head(model: PreTrainedModel, base: dict[str, torch.Tensor], rest: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's encoder weights ``base`` (without prefix) and its head weights ``rest`` (our names) into
    ``model``: the encoder's under ``model.base_model_prefix`` unless ``model`` is the base model; a tied decoder is
    left to the tie, and a pooler (or an MLM head) saved with a class that does not use it has nowhere to go."""
    prefix = model.base_model_prefix
    state = dict(base) if model.base_model is model else {f"{prefix}.{k}": v for k, v in base.items()}
    state.update(rest)
    may_be_missing = []
    if getattr(model.config, "tie_word_embeddings", True):
        state.pop("lm_head.decoder.weight", None)
        may_be_missing.append("lm_head.decoder.weight")
    load_converted_weights(
        model, state, may_be_missing=may_be_missing, may_be_unused=("pooler.", f"{prefix}.pooler.", "lm_head.")
    )


SWIN_CLASSES: dict[str, type[PreTrainedModel]] = {
    "SwinModel": HfxSwinModel,
    "SwinForImageClassification": HfxSwinForImageClassification,
    "SwinForMaskedImageModeling": HfxSwinForMaskedImageModeling,
    "SwinBackbone": HfxSwinBackbone,
}
# hfx-swin uses the names of the Swin checkpoints on the Hub, which transformers 5.x also writes on save; its
# in-memory modules (what `state_dict()` returns) use these newer names instead.
_SWIN_RENAMES = (
    ("attention.q_proj.", "attention.self.query."),
    ("attention.k_proj.", "attention.self.key."),
    ("attention.v_proj.", "attention.self.value."),
    ("attention.relative_position_bias.relative_position_bias_table", "attention.self.relative_position_bias_table"),
    ("attention.o_proj.", "attention.output.dense."),
    ("mlp.fc1.", "intermediate.dense."),
    ("mlp.fc2.", "output.dense."),
)
# Image processor settings that carry over from a Swin checkpoint's preprocessor_config.json.
_IMAGE_PROCESSOR_KEYS = (
    "do_resize", "size", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
    "do_center_crop", "crop_size", "do_convert_rgb",
)  # fmt: skip


def rename_swin_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers Swin tensor names (saved Hub layout or 5.x in-memory layout) -> hfx-swin's; the recomputed
    ``relative_position_index`` buffers of older checkpoints are dropped."""
    renamed = {}
    for key, tensor in weights.items():
        if key.endswith("relative_position_index"):
            continue
        for old, new in _SWIN_RENAMES:
            key = key.replace(old, new)
        renamed[key] = tensor
    return renamed


def import_swin(source: Path, config: dict) -> PreTrainedModel:
    """``transformers`` Swin (model, classifier, SimMIM or backbone) -> the matching ``HfxSwin*`` class.

    Names are ours already in saved checkpoints (see :func:`rename_swin_weights`); base-model tensors saved
    without the ``swin.`` prefix (SwinModel, SwinBackbone) get it, and the backbone drops the unused final LayerNorm.
    """
    weights = rename_swin_weights(load_weights(source))
    architectures = config.get("architectures") or []
    known = [name for name in architectures if name in SWIN_CLASSES]
    if architectures and not known:
        raise ValueError(f"Unsupported architectures {architectures}; accepted: {sorted(SWIN_CLASSES)}.")
    model_class = SWIN_CLASSES[known[0] if known else "SwinModel"]

    kwargs = HfxSwinConfig.config_dict_from_transformers(config)
    kwargs["architectures"] = [model_class.__name__]
    model = model_class(HfxSwinConfig(**kwargs))

    state = {}
    for key, tensor in weights.items():
        # Base-model tensors: `swin.*`, or unprefixed in SwinModel checkpoints and (partly) in SwinBackbone ones.
        if key.startswith("swin.") or key.startswith(("embeddings.", "encoder.", "layernorm.")):
            key = key.removeprefix("swin.")
            key = key if model_class is HfxSwinModel else f"swin.{key}"
        state[key] = tensor
    load_converted_weights(model, state, may_be_unused=("swin.layernorm.",) if model_class is HfxSwinBackbone else ())
    return model


def convert_image_processor(source: Path) -> HfxSwinImageProcessor | None:
    """The source's ``preprocessor_config.json`` (ViT-style, as the Swin checkpoints ship it) as an
    :class:`HfxSwinImageProcessor`, or None when the source has none."""
    path = Path(source) / "preprocessor_config.json"
    if not path.is_file():
        return None
    settings = {k: v for k, v in json.loads(path.read_text()).items() if k in _IMAGE_PROCESSOR_KEYS}
    for key in ("size", "crop_size"):
        if isinstance(settings.get(key), int):  # old feature extractors store one side for a square
            settings[key] = {"height": settings[key], "width": settings[key]}
    return HfxSwinImageProcessor(**settings)


# transformers 4.x Transformer-XL tensor names -> hfx-transfo-xl's (the layer pieces are renamed; the rest is kept).
_TRANSFO_XL_RENAMES = (
    ("dec_attn.qkv_net.", "attention.qkv_net."),
    ("dec_attn.r_net.", "attention.r_net."),
    ("dec_attn.r_w_bias", "attention.r_w_bias"),
    ("dec_attn.r_r_bias", "attention.r_r_bias"),
    ("dec_attn.o_net.", "attention_output."),
    ("dec_attn.layer_norm.", "attention_layer_norm."),
    ("pos_ff.CoreNet.0.", "ff_in."),
    ("pos_ff.CoreNet.3.", "ff_out."),
    ("pos_ff.layer_norm.", "ff_layer_norm."),
    ("crit.", "adaptive_softmax."),
)


def import_transfo_xl(source: Path, config: dict) -> PreTrainedModel:
    """``transformers`` 4.x ``TransfoXLLMHeadModel`` / ``TransfoXLModel`` (e.g. ``transfo-xl-wt103`` saved locally,
    ``pytorch_model.bin`` included) -> ``HfxTransfoXLForCausalLM`` / ``HfxTransfoXLModel`` with the same outputs.

    Tensors are renamed (:data:`_TRANSFO_XL_RENAMES`); the ``pos_emb.inv_freq`` buffer is recomputed; shared
    ``r_w_bias``/``r_r_bias`` (``untie_r=False``) are copied into every layer; tied softmax tensors that
    safetensors checkpoints leave out are re-tied. Only ``attn_type=0`` (the paper's relative attention) exists
    in released checkpoints and here. Note: 4.x starts from ``mem_len`` zero memories when ``mems=None``; pass
    ``model.zero_memories(batch)`` to reproduce its first segment exactly.
    """
    kwargs = HfxTransfoXLConfig.config_dict_from_transformers(config)  # refuses attn_type != 0 first
    weights = load_weights(source)
    architectures = config.get("architectures") or []
    with_head = any(k.startswith("crit.") for k in weights) or "TransfoXLLMHeadModel" in architectures
    model_class = HfxTransfoXLForCausalLM if with_head else HfxTransfoXLModel
    kwargs["architectures"] = [model_class.__name__]
    hfx_config = HfxTransfoXLConfig(**kwargs)
    model = model_class(hfx_config)

    state = {}
    shared_biases = {}
    for key, tensor in weights.items():
        if key.endswith("pos_emb.inv_freq"):
            continue
        if key.removeprefix("transformer.") in ("r_w_bias", "r_r_bias"):
            shared_biases[key.removeprefix("transformer.")] = tensor
            continue
        for old, new in _TRANSFO_XL_RENAMES:
            key = key.replace(old, new)
        if model_class is HfxTransfoXLModel:
            key = key.removeprefix("transformer.")
        elif not key.startswith(("transformer.", "adaptive_softmax.")):
            key = f"transformer.{key}"
        state[key] = tensor
    prefix = "" if model_class is HfxTransfoXLModel else "transformer."
    for name, tensor in shared_biases.items():
        for i in range(hfx_config.n_layer):
            state[f"{prefix}layers.{i}.attention.{name}"] = tensor
    tied = list(model.get_expanded_tied_weights_keys()) if with_head else []
    for key in tied:
        state.pop(key, None)
    load_converted_weights(model, state, may_be_missing=tied)
    model.tie_weights()
    return model


BIGBIRD_CLASSES: dict[str, type[PreTrainedModel]] = {
    "BigBirdModel": HfxBigBirdModel,
    "BigBirdForMaskedLM": HfxBigBirdForMaskedLM,
    # google/bigbird-roberta-base is saved as a pretraining model: MLM head plus a next-sentence head (dropped).
    "BigBirdForPreTraining": HfxBigBirdForMaskedLM,
    "BigBirdForTokenClassification": HfxBigBirdForTokenClassification,
    "BigBirdForMultipleChoice": HfxBigBirdForMultipleChoice,
}
_BIGBIRD_RENAMES = (
    ("cls.predictions.transform.dense.", "lm_head.dense."),
    ("cls.predictions.transform.LayerNorm.", "lm_head.layer_norm."),
    ("cls.predictions.decoder.", "lm_head.decoder."),
    ("cls.predictions.bias", "lm_head.decoder.bias"),
)


def rename_bigbird_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers BigBird tensor names -> hfx-bigbird's: ``bert.`` -> ``bigbird.``, the pooler's Linear gets the
    ``dense`` name of ours, ``cls.predictions.*`` becomes ``lm_head.*``; buffers and the next-sentence head
    (``cls.seq_relationship``) are dropped."""
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in drop_buffers(weights).items():
        if key.startswith("cls.seq_relationship."):
            continue
        if key.startswith("bert."):
            key = "bigbird." + key.removeprefix("bert.")
        if key.removeprefix("bigbird.") in ("pooler.weight", "pooler.bias"):
            key = key.replace("pooler.", "pooler.dense.")
        for old, new in _BIGBIRD_RENAMES:
            if key.startswith(old):
                key = new + key.removeprefix(old)
                break
        # transformers stores the decoder bias twice (tied): both copies are the same tensor.
        renamed.setdefault(key, tensor)
    return renamed


def import_bigbird(source: Path, config: dict) -> PreTrainedModel:
    """``transformers`` BigBird -> the matching ``HfxBigBird*`` class with the same weights and attention settings
    (``attention_type``, ``block_size``, ``num_random_blocks`` are carried over as they are).

    Raises:
        ValueError: a head whose layout differs from ours (sequence classification, question answering, causal
            LM), or config values hfx-bigbird does not implement (``use_bias=False``, a decoder).
    """
    kwargs = HfxBigBirdConfig.config_dict_from_transformers(config)  # refuses the heads and settings above
    base, rest = split_prefix(rename_bigbird_weights(load_weights(source)), "bigbird.")
    model_class = _pick_class(config, rest, BIGBIRD_CLASSES, "BigBirdModel", "BigBirdForMaskedLM")

    kwargs["architectures"] = [model_class.__name__]
    hfx_config = HfxBigBirdConfig(**kwargs)
    model = model_class(hfx_config)
    load_base_and_head(model, base, rest)
    return model


# ALBERT -> hfx-universal: ALBERT's single shared layer is the Universal Transformer's block in fixed-step mode.
_ALBERT_LAYER = "encoder.albert_layer_groups.0.albert_layers.0."
_ALBERT_RENAMES = (
    ("encoder.embedding_hidden_mapping_in.", "embeddings.embedding_hidden_mapping_in."),
    (_ALBERT_LAYER + "attention.query.", "encoder.layer.attention.self.query."),
    (_ALBERT_LAYER + "attention.key.", "encoder.layer.attention.self.key."),
    (_ALBERT_LAYER + "attention.value.", "encoder.layer.attention.self.value."),
    (_ALBERT_LAYER + "attention.dense.", "encoder.layer.attention.output.dense."),
    (_ALBERT_LAYER + "attention.LayerNorm.", "encoder.layer.attention.output.LayerNorm."),
    (_ALBERT_LAYER + "ffn.", "encoder.layer.intermediate.dense."),
    (_ALBERT_LAYER + "ffn_output.", "encoder.layer.output.dense."),
    (_ALBERT_LAYER + "full_layer_layer_norm.", "encoder.layer.output.LayerNorm."),
    ("pooler.", "pooler.dense."),
)
_ALBERT_HEAD_RENAMES = (
    ("predictions.dense.", "lm_head.dense."),
    ("predictions.LayerNorm.", "lm_head.layer_norm."),
    ("predictions.decoder.", "lm_head.decoder."),
    ("predictions.bias", "lm_head.decoder.bias"),
)
# AlbertConfig fields that carry over unchanged (missing ones take AlbertConfig's defaults, which differ from ours).
_ALBERT_CONFIG_KEYS = (
    "vocab_size", "embedding_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "initializer_range", "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "id2label", "label2id", "problem_type",
)  # fmt: skip


def import_albert(source: Path, config: dict) -> PreTrainedModel:
    """``transformers`` ALBERT (``AlbertModel``, ``AlbertForMaskedLM``, ``AlbertForPreTraining`` without its
    sentence-order head, ``AlbertForSequenceClassification``, ``AlbertForTokenClassification``) -> the matching
    ``hfx-universal`` class with the same outputs.

    The result runs in fixed-step mode: ``num_hidden_layers`` steps of the shared layer, learned absolute positions,
    no timestep signal, factorised embeddings (``embedding_size`` and ``embedding_hidden_mapping_in``). Loading it with
    ``use_act=True`` (``from_pretrained(dir, use_act=True, act_max_steps=...)``) adds the halting unit as the only new
    parameter. ALBERT's pooler + classifier become our classification head's ``dense`` + ``out_proj``.

    Raises:
        ValueError: several layer groups or inner layers (not one shared layer), or a relative position type.
    """
    from transformers import AlbertConfig

    from hf_xformers.models.universal import (
        HfxUniversalConfig,
        HfxUniversalForMaskedLM,
        HfxUniversalForSequenceClassification,
        HfxUniversalForTokenClassification,
        HfxUniversalModel,
    )

    albert_classes: dict[str, type[PreTrainedModel]] = {
        "AlbertModel": HfxUniversalModel,
        "AlbertForMaskedLM": HfxUniversalForMaskedLM,
        "AlbertForPreTraining": HfxUniversalForMaskedLM,
        "AlbertForSequenceClassification": HfxUniversalForSequenceClassification,
        "AlbertForTokenClassification": HfxUniversalForTokenClassification,
    }
    full = {**AlbertConfig().to_dict(), **config}
    for key in ("num_hidden_groups", "inner_group_num"):
        if full[key] != 1:
            raise ValueError(
                f"Only ALBERT checkpoints with one shared layer convert (num_hidden_groups = inner_group_num = 1); this "
                f"one has {key}={full[key]}."
            )
    if full.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"Only absolute position embeddings convert, got {full['position_embedding_type']!r}.")

    renamed = {}
    for key, tensor in drop_buffers(load_weights(source)).items():
        if key.startswith("sop_classifier."):
            continue  # AlbertForPreTraining's sentence-order head has no counterpart
        for old, new in _ALBERT_HEAD_RENAMES:
            if key.startswith(old):
                key = new + key.removeprefix(old)
                break
        # transformers stores the tied decoder bias twice (predictions.bias and predictions.decoder.bias).
        renamed.setdefault(key, tensor)
    base, rest = split_prefix(renamed, "albert.")
    base = {_rename_albert(key): tensor for key, tensor in base.items()}
    model_class = _pick_class(config, rest, albert_classes, "AlbertModel", "AlbertForMaskedLM")

    kwargs = {key: full[key] for key in _ALBERT_CONFIG_KEYS if key in full}
    kwargs.update(
        classifier_dropout=full.get("classifier_dropout_prob"), use_act=False, add_timestep_signal=False,
        position_embedding_type="absolute", transition="ffn", architectures=[model_class.__name__],
    )  # fmt: skip
    hfx_config = HfxUniversalConfig(**kwargs)
    model = model_class(hfx_config)

    if model_class is HfxUniversalForSequenceClassification:
        # BERT-style pooler + classifier = RoBERTa-style head: tanh(dense(h[:, 0])) then out_proj.
        for name in ("weight", "bias"):
            if f"pooler.dense.{name}" in base:
                rest[f"classifier.dense.{name}"] = base.pop(f"pooler.dense.{name}")
            if f"classifier.{name}" in rest:
                rest[f"classifier.out_proj.{name}"] = rest.pop(f"classifier.{name}")
    load_base_and_head(model, base, rest)
    return model


def _rename_albert(key: str) -> str:
    for old, new in _ALBERT_RENAMES:
        if key.startswith(old):
            return new + key.removeprefix(old)
    return key


# Source model_type -> importer(source dir, source config dict). BigBird, Swin, Reformer, Transformer-XL go here.
REFORMER_CLASSES: dict[str, str] = {
    "ReformerModel": "HfxReformerModel",
    "ReformerModelWithLMHead": "HfxReformerForCausalLM",
    "ReformerForMaskedLM": "HfxReformerForMaskedLM",
    "ReformerForSequenceClassification": "HfxReformerForSequenceClassification",
    "ReformerForQuestionAnswering": "HfxReformerForQuestionAnswering",
}


def reformer_lm_bias_as_ours(weights: dict) -> dict:
    """transformers Reformer tensors with the LM bias where ours is: ``lm_head.decoder.bias`` (4.x, where it equals
    ``lm_head.bias``, and 5.24+, where it is the one applied) becomes ``lm_head.bias``."""
    weights = dict(weights)
    if "lm_head.decoder.bias" in weights:
        weights["lm_head.bias"] = weights.pop("lm_head.decoder.bias")
    return weights


def import_reformer(source: Path, config: dict) -> PreTrainedModel:
    """``transformers`` Reformer (any head; e.g. ``google/reformer-crime-and-punishment`` or
    ``google/reformer-enwik8`` saved locally) -> the matching ``HfxReformer*`` class with the same weights and config.

    Tensor names are already ours, but for the LM bias: 4.x checkpoints store it twice (``lm_head.decoder.bias`` tied
    to ``lm_head.bias``); transformers 5.0-5.23 keep only ``lm_head.bias`` (and no longer add it); transformers 5.24
    adds ``lm_head.decoder.bias`` (and leaves ``lm_head.bias`` unused). Ours is ``lm_head.bias``, taken from
    ``lm_head.decoder.bias`` wherever that exists. ``google/reformer-enwik8`` has no tokenizer: its inputs are UTF-8 bytes
    shifted by 2; :func:`convert_from_transformers` saves :func:`byte_tokenizer` with such a checkpoint (no tokenizer,
    258 ids).

    Differences that remain: with ``hash_seed`` unset, transformers draws new rotations on every call, ours draw
    fixed ones in eval (deterministic outputs); with ``num_buckets`` unset, ours derive it from
    ``max_position_embeddings`` where transformers uses the first input's length.
    """
    import hf_xformers

    architectures = config.get("architectures") or ["ReformerModel"]
    unknown = [name for name in architectures if name not in REFORMER_CLASSES]
    if unknown:
        raise ValueError(f"Unsupported architectures {unknown}; accepted: {sorted(REFORMER_CLASSES)}.")
    model_class = getattr(hf_xformers, REFORMER_CLASSES[architectures[0]])
    kwargs = hf_xformers.HfxReformerConfig.config_dict_from_transformers(config)
    kwargs["architectures"] = [model_class.__name__]
    model = model_class(hf_xformers.HfxReformerConfig(**kwargs))
    weights = reformer_lm_bias_as_ours(load_weights(source))
    if model_class is hf_xformers.HfxReformerModel:
        weights = {k.removeprefix("reformer."): v for k, v in weights.items() if not k.startswith("lm_head.")}
    load_converted_weights(model, weights)
    return model


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """The input code of ``google/reformer-enwik8`` as a tokenizer: UTF-8 byte ``b`` is id ``b + 2`` (0 is padding,
    1 end of text), so ``tokenizer(text).input_ids == [b + 2 for b in text.encode()]`` and ``decode`` inverts it.

    Built from ``tokenizers`` pieces: the byte-level pre-tokenizer (one printable character per byte), a split into
    single characters and a 258-entry word-level vocabulary.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The byte-level alphabet in byte order: GPT-2's map of bytes to printable characters.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {"<pad>": 0, "</s>": 1} | {char_of[b]: b + 2 for b in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex("."), "isolated"),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")


IMPORTERS: dict[str, Callable[[Path, dict], PreTrainedModel]] = {
    "reformer": import_reformer,
    "longformer": import_longformer,
    "big_bird": import_bigbird,
    "swin": import_swin,
    "transfo-xl": import_transfo_xl,
    "albert": import_albert,
}


def convert_from_transformers(
    source: str | Path, output_dir: str | Path | None = None, overwrite: bool = False, base_model: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Import a local ``transformers`` checkpoint into hf_xformers.

    Args:
        source: directory saved with ``save_pretrained`` (config, weights, optionally the tokenizer).
        output_dir: when given, the converted model (and tokenizer) are saved there. It must be new or empty,
            unless ``overwrite`` (see :func:`hf_xformers.conversion.common.prepare_output_dir`).
        overwrite: replace the checkpoint files of a non-empty ``output_dir``.
        base_model: the Hub id ``source`` was downloaded from, named as ``base_model`` in the card written with the
            output (found by itself for a Hub cache folder; see :func:`hf_xformers.conversion.common.conversion_provenance`).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode, ``tokenizer`` is None when the source has none.

    Raises:
        ValueError: the source is not a local directory of one of the :data:`IMPORTERS` model types.
    """
    path = Path(source)
    config = read_config(path, IMPORTERS)
    if output_dir is not None:  # before the work: a refused folder should not cost a conversion
        prepare_output_dir(output_dir, overwrite)
    model = IMPORTERS[config["model_type"]](path, config).eval()
    tokenizer = load_tokenizer(path, required=False)
    if tokenizer is None and config["model_type"] == "reformer" and config.get("vocab_size") == 258:
        logger.info("No tokenizer and 258 ids (google/reformer-enwik8's bytes + 2): writing the byte tokenizer.")
        tokenizer = byte_tokenizer()
    if output_dir is not None:
        how = f"from transformers' `{config['model_type']}` with hf_xformers' `hfx-import`"
        save_model_and_tokenizer(model, tokenizer, output_dir, conversion_provenance(path, base_model, how))
        image_processor = convert_image_processor(path) if config["model_type"] == "swin" else None
        if image_processor is not None:
            image_processor.save_pretrained(str(output_dir))
        # A sentence-transformers source keeps its pooling, normalisation ... (same length: max_seq_length kept).
        carry_sentence_transformers_modules(path, output_dir)
    return model, tokenizer


CLI_DESCRIPTION = (
    "Import a local checkpoint of one of transformers' own architectures (model_type "
    + ", ".join(sorted(IMPORTERS))
    + ") into the matching hf_xformers class, with the same weights and outputs: the config is translated, tensors "
    "are renamed, the tokenizer (and Swin's image processor) are carried over and a model card is written."
)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (``hfx-import``)."""
    parser = argparse.ArgumentParser(
        description=CLI_DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--source", required=True, help=f"local checkpoint directory, model_type in {sorted(IMPORTERS)}"
    )
    parser.add_argument("--output", required=True, help="directory to save the converted model and tokenizer")
    parser.add_argument("--overwrite", action="store_true", help="replace the checkpoint files of a non-empty --output")
    parser.add_argument("--base-model", help="Hub id --source was downloaded from (named in the model card)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        convert_from_transformers(args.source, args.output, overwrite=args.overwrite, base_model=args.base_model)
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
