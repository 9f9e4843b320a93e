"""``from_pretrained`` of checkpoints saved by transformers' own classes (Longformer, BigBird, Reformer, Swin, and
Transformer-XL as transformers 4.x saved it): every one of our classes, base model and heads, loads them as the model
``conversion.convert_from_transformers`` imports, converted on the fly (config translated, tensors renamed through
transformers' ``key_mapping``), with one info line instead of transformers' warning that the model types differ.

The oracle is the importer: its output folder loaded into the same class with the same seed (heads the checkpoint
lacks start from the same draw). Tiny transformers models are built and saved here; the Transformer-XL checkpoints
come from the committed 4.37.2 fixture (tests/fixtures/transfo_xl, scripts/make_transfo_xl_fixture.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import hf_xformers  # noqa: E402
from hf_xformers.conversion.convert_from_transformers import convert_from_transformers  # noqa: E402
from hf_xformers.models import ARCHITECTURES  # noqa: E402

from .test_conversion import perturb_  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "transfo_xl"
IMPORTER = "hfx-import"
TYPE_MISMATCH = "You are using a model of type"

TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
REFORMER = dict(vocab_size=50, hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37,
                attn_layers=["local", "lsh"], local_attn_chunk_length=4, lsh_attn_chunk_length=8, num_buckets=4,
                axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16], max_position_embeddings=64, pad_token_id=1,
                eos_token_id=None, hash_seed=3, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
                lsh_attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
SWIN = dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, encoder_stride=4,
            drop_path_rate=0.0, num_labels=3)  # fmt: skip


def longformer_config(**kw):
    kw = {**TEXT, **kw}
    return transformers.LongformerConfig(**kw, vocab_size=60, attention_window=[8, 6], max_position_embeddings=40)


def bigbird_config(**kw):
    kw = {"attention_type": "block_sparse", **kw}
    return transformers.BigBirdConfig(**TEXT, vocab_size=60, max_position_embeddings=40, block_size=4,
                                      num_random_blocks=2, sep_token_id=2, **kw)  # fmt: skip


# Source checkpoints: transformers class and config. BigBird runs block-sparse (29 tokens: 8 blocks of 4, so random
# blocks are drawn; both sides are ours) and original_full.
SOURCES = {
    "longformer-mlm": ("longformer", lambda: transformers.LongformerForMaskedLM(longformer_config())),
    "longformer-classifier": (
        "longformer",
        lambda: transformers.LongformerForSequenceClassification(longformer_config()),
    ),
    "longformer-qa": (
        "longformer",
        lambda: transformers.LongformerForQuestionAnswering(longformer_config(num_labels=2)),
    ),
    "bigbird-base": ("bigbird", lambda: transformers.BigBirdModel(bigbird_config(attention_type="original_full"))),
    "bigbird-pretraining": ("bigbird", lambda: transformers.BigBirdForPreTraining(bigbird_config())),
    # Saved in shards (model.safetensors.index.json): the tensor names come from the index.
    "bigbird-pretraining-sharded": ("bigbird", lambda: transformers.BigBirdForPreTraining(bigbird_config())),
    "bigbird-multiple-choice": ("bigbird", lambda: transformers.BigBirdForMultipleChoice(bigbird_config())),
    "reformer-lm": (
        "reformer",
        lambda: transformers.ReformerModelWithLMHead(transformers.ReformerConfig(**REFORMER, is_decoder=True)),
    ),
    "reformer-mlm": ("reformer", lambda: transformers.ReformerForMaskedLM(transformers.ReformerConfig(**REFORMER))),
    "reformer-classifier": (
        "reformer",
        lambda: transformers.ReformerForSequenceClassification(transformers.ReformerConfig(**REFORMER)),
    ),
    "swin-classifier": ("swin", lambda: transformers.SwinForImageClassification(transformers.SwinConfig(**SWIN))),
    "swin-simmim": ("swin", lambda: transformers.SwinForMaskedImageModeling(transformers.SwinConfig(**SWIN))),
    "swin-backbone": (
        "swin",
        lambda: transformers.SwinBackbone(transformers.SwinConfig(**SWIN, out_features=["stage1", "stage2"])),
    ),
    "transfo-xl-lm": ("transfo_xl", None),  # the fixture: pytorch_model.bin with the tied tensors, as transfo-xl-wt103
    "transfo-xl-lm-safetensors": ("transfo_xl", None),  # tied tensors left out, as 4.x safetensors saves wrote it
    "transfo-xl-base": ("transfo_xl", None),  # a TransfoXLModel: no prefix, no softmax
}


def write_transfo_xl(name: str, path: Path) -> None:
    """4.x Transformer-XL checkpoints made from the committed 4.37.2 fixture, in the layouts 4.x saved."""
    if name == "transfo-xl-lm":
        shutil.copytree(FIXTURE, path, ignore=shutil.ignore_patterns("expected.safetensors"))
        return
    path.mkdir()
    weights = torch.load(FIXTURE / "pytorch_model.bin", weights_only=True)
    config = json.loads((FIXTURE / "config.json").read_text())
    if name == "transfo-xl-lm-safetensors":
        tied = [f"crit.out_layers.{i}.weight" for i in range(3)] + ["crit.out_projs.1", "crit.out_projs.2"]
        weights = {k: v for k, v in weights.items() if k not in tied}
    else:
        weights = {k.removeprefix("transformer."): v for k, v in weights.items() if k.startswith("transformer.")}
        config["architectures"] = ["TransfoXLModel"]
    save_file({k: v.clone().contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path, torch.nn.Module]]:
    """``{source name: (transformers checkpoint folder, importer output folder, importer's model)}``."""
    root = tmp_path_factory.mktemp("transformers_checkpoints")
    made = {}
    for name, (_, build) in SOURCES.items():
        source = root / name
        if build is None:
            write_transfo_xl(name, source)
        else:
            torch.manual_seed(0)
            perturb_(build()).save_pretrained(source, max_shard_size="40KB" if name.endswith("-sharded") else "5GB")
        imported, _ = convert_from_transformers(source, root / f"{name}-imported")
        made[name] = (source, root / f"{name}-imported", imported)
    return made


def our_classes(arch: str) -> list[type]:
    """Our base model and every head of ``arch`` (the Auto classes it registers; not the image processor)."""
    architecture = next(a for a in ARCHITECTURES if a.model_type == f"hfx-{arch.replace('_', '-')}")
    return [cls for name, cls in architecture.auto_classes.items() if name != "AutoImageProcessor"]


def model_inputs(arch: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if arch == "swin":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    vocab = {"longformer": 60, "bigbird": 60, "reformer": 50, "transfo_xl": 40}[arch]
    ids = torch.randint(3, vocab, (2, 29), generator=g)
    ids[:, 4] = 2  # a separator (Longformer's and BigBird's sep_token_id): question answering finds the question
    inputs = {"input_ids": ids}
    if arch in ("longformer", "bigbird"):
        mask = torch.ones_like(ids)
        mask[1, 20:] = 0
        inputs["attention_mask"] = mask
    if type(model).__name__.endswith("ForMultipleChoice"):
        inputs = {k: torch.stack([v, v.flip(0)], dim=1) for k, v in inputs.items()}
    return inputs


def tensors_of(output) -> list[torch.Tensor]:
    """Every tensor of a model output (nested tuples such as Transformer-XL's memories included), in order; a
    decoding cache object is left out."""
    if isinstance(output, torch.Tensor):
        return [output]
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    if not isinstance(output, (tuple, list)):
        return []
    return [t for item in output if item is not None for t in tensors_of(item)]


def max_output_diff(a, b) -> float:
    ta, tb = tensors_of(a), tensors_of(b)
    assert len(ta) == len(tb) and all(x.shape == y.shape for x, y in zip(ta, tb))
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(ta, tb))


@contextlib.contextmanager
def captured_logs():
    """Records of transformers' loggers (warnings, as configured by default) and ours (info and up)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    ours = logging.getLogger("hf_xformers")
    loggers = [logging.getLogger("transformers"), ours]
    level = ours.level
    for logger in loggers:
        logger.addHandler(handler)
    ours.setLevel(logging.INFO)
    try:
        yield records
    finally:
        ours.setLevel(level)
        for logger in loggers:
            logger.removeHandler(handler)


def conversion_lines(records) -> list[str]:
    return [r.getMessage() for r in records if r.name.startswith("hf_xformers") and "on the fly" in r.getMessage()]


def load_seeded(cls, path, **kwargs):
    torch.manual_seed(1234)  # the tensors a checkpoint lacks draw the same values on both sides
    return cls.from_pretrained(path, output_loading_info=True, **kwargs)


@pytest.mark.parametrize("name", list(SOURCES))
def test_every_class_loads_the_transformers_checkpoint_as_the_importer_does(checkpoints, name):
    arch = SOURCES[name][0]
    source, imported_dir, imported = checkpoints[name]
    for cls in our_classes(arch):
        try:
            reference, reference_info = load_seeded(cls, imported_dir)
        except (ValueError, RuntimeError) as error:
            # The importer's model does not fit this class either (e.g. a one-logit multiple-choice classifier as a
            # three-label token classifier): neither does the checkpoint.
            with pytest.raises(type(error)):
                cls.from_pretrained(source)
            continue
        with captured_logs() as records:
            model, info = load_seeded(cls, source)
        messages = [r.getMessage() for r in records]
        assert not any(TYPE_MISMATCH in m for m in messages), messages
        assert len(conversion_lines(records)) == 1, messages
        assert type(model) is cls and model.config.model_type == imported.config.model_type
        # It loads at least what the importer carried: a fresh tensor here is fresh in the importer's output too.
        assert set(info["missing_keys"]) <= set(reference_info["missing_keys"]), cls.__name__
        own_class = cls is type(imported)
        if own_class:  # the importer's own class: nothing fresh, nothing left over
            assert not info["missing_keys"] and not info["unexpected_keys"], info
        loaded, expected = model.state_dict(), reference.state_dict()
        assert loaded.keys() == expected.keys()
        compared = expected.keys() - set(reference_info["missing_keys"]) - set(info["missing_keys"])
        assert compared and (not own_class or compared == expected.keys())
        for key in compared:
            assert torch.equal(loaded[key], expected[key]), (cls.__name__, key)
        inputs = model_inputs(arch, model)
        with torch.no_grad():
            if own_class:
                assert max_output_diff(model(**inputs), imported(**inputs)) <= 1e-6, cls.__name__
            elif info["missing_keys"] == reference_info["missing_keys"] and not cls.__name__.endswith("MultipleChoice"):
                # Another class: the base model's outputs (where the importer dropped a tensor this class reads,
                # e.g. the final LayerNorm of a SwinBackbone checkpoint, ours has it and the outputs differ).
                diff = (model.base_model(**inputs)[0] - reference.base_model(**inputs)[0]).abs().max()
                assert diff.item() <= 1e-6, cls.__name__


def auto_class_of(model: torch.nn.Module) -> type:
    architecture = next(a for a in ARCHITECTURES if a.model_type == model.config.model_type)
    name = next(name for name, cls in architecture.auto_classes.items() if cls is type(model))
    return getattr(transformers, name)


# (Not AutoBackbone: in transformers 5.23 it takes any local folder for a timm model name.)
@pytest.mark.parametrize(
    "name", ["longformer-mlm", "bigbird-pretraining", "reformer-lm", "swin-classifier", "transfo-xl-lm"]
)
def test_auto_classes_config_and_save_round_trip(checkpoints, name, tmp_path):
    """Our config class reads transformers' config.json (no type warning); an Auto class given that config builds
    our class from the transformers checkpoint; ``save_pretrained`` then writes our format, which reloads as is."""
    source, imported_dir, imported = checkpoints[name]
    config_class = type(imported.config)
    with captured_logs() as records:
        config = config_class.from_pretrained(source)
    assert not any(TYPE_MISMATCH in r.getMessage() for r in records)
    skip = {"architectures", "_name_or_path", "transformers_version"}
    ours = {k: v for k, v in config.to_dict().items() if k not in skip}
    assert ours == {k: v for k, v in imported.config.to_dict().items() if k not in skip}

    auto = auto_class_of(imported)
    model = auto.from_pretrained(str(source), config=config)
    assert type(model) is type(imported)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == imported.config.model_type
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as mine, \
            safe_open(str(imported_dir / "model.safetensors"), "pt") as theirs:  # fmt: skip
        assert set(mine.keys()) == set(theirs.keys())
    with captured_logs() as records:
        reloaded = auto.from_pretrained(tmp_path)
    assert not conversion_lines(records)  # our own format: nothing to convert
    inputs = model_inputs(SOURCES[name][0], imported)
    with torch.no_grad():
        assert max_output_diff(reloaded(**inputs), imported(**inputs)) <= 1e-6


def fake_hub_cache(cache: Path, repo_id: str, files: Path) -> None:
    """A Hugging Face cache holding ``repo_id`` at ``main`` with the files of the folder ``files`` (what a download
    leaves behind), so a Hub id resolves offline."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(files, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@pytest.mark.parametrize("name", ["bigbird-pretraining", "transfo-xl-lm"])
def test_hub_id(checkpoints, name, tmp_path):
    """A Hub id goes through transformers' file lookup (here its offline cache): config, tensor names and weights."""
    source, _, imported = checkpoints[name]
    fake_hub_cache(tmp_path, f"someone/{name}", source)
    with captured_logs() as records:
        model = type(imported).from_pretrained(f"someone/{name}", cache_dir=str(tmp_path))
    assert conversion_lines(records) and f"someone/{name}" in conversion_lines(records)[0]
    inputs = model_inputs(SOURCES[name][0], imported)
    with torch.no_grad():
        assert max_output_diff(model(**inputs), imported(**inputs)) <= 1e-6


def test_bigbird_pooler_is_no_longer_silently_fresh(checkpoints):
    """Before: ``pooler.weight`` / ``pooler.bias`` were unexpected and ``pooler.dense.*`` newly initialised."""
    source, _, imported = checkpoints["bigbird-base"]
    model, info = hf_xformers.HfxBigBirdModel.from_pretrained(source, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.pooler.dense.weight, imported.pooler.dense.weight)
    inputs = model_inputs("bigbird", model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).pooler_output, imported(**inputs).pooler_output)


def test_older_layouts_with_both_bias_copies(tmp_path):
    """Longformer as allenai saved it (pytorch_model.bin, position_ids buffers, both MLM bias copies) and Reformer as
    transformers 5.24 saves it (the applied ``lm_head.decoder.bias`` next to a stale ``lm_head.bias``): the copy the
    importer reads is the one loaded, and nothing is reported unexpected."""
    torch.manual_seed(0)
    longformer = perturb_(transformers.LongformerForMaskedLM(longformer_config()))
    state = dict(longformer.state_dict())
    state["longformer.embeddings.position_ids"] = torch.arange(40)[None]
    state["lm_head.decoder.bias"] = state["lm_head.bias"]
    (tmp_path / "longformer").mkdir()
    torch.save(state, tmp_path / "longformer" / "pytorch_model.bin")
    raw = longformer.config.to_dict()
    raw.update(architectures=["LongformerForMaskedLM"], attention_mode="longformer")
    (tmp_path / "longformer" / "config.json").write_text(json.dumps(raw))

    reformer = perturb_(transformers.ReformerModelWithLMHead(transformers.ReformerConfig(**REFORMER, is_decoder=True)))
    state = {k: v.clone().contiguous() for k, v in reformer.state_dict().items()}
    state["lm_head.decoder.bias"] = torch.randn(REFORMER["vocab_size"])  # the applied one; lm_head.bias is stale
    (tmp_path / "reformer").mkdir()
    save_file(state, str(tmp_path / "reformer" / "model.safetensors"))
    reformer.config.architectures = ["ReformerModelWithLMHead"]
    reformer.config.save_pretrained(tmp_path / "reformer")

    for name, cls, bias in [("longformer", hf_xformers.HfxLongformerForMaskedLM, "lm_head.decoder.bias"),
                            ("reformer", hf_xformers.HfxReformerForCausalLM, "lm_head.bias")]:  # fmt: skip
        imported, _ = convert_from_transformers(tmp_path / name)
        model, info = cls.from_pretrained(tmp_path / name, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert torch.equal(model.get_parameter(bias), imported.get_parameter(bias))
        inputs = model_inputs(name, model)
        with torch.no_grad():
            assert max_output_diff(model(**inputs), imported(**inputs)) <= 1e-6
    assert torch.equal(model.lm_head.bias, state["lm_head.decoder.bias"])


def test_checkpoints_that_do_not_convert_exactly_are_refused(tmp_path):
    """Refused with a ValueError that names the importer, before any tensor is loaded."""
    transformers.BigBirdModel(bigbird_config(use_bias=False)).save_pretrained(tmp_path / "bias-free")
    transformers.BigBirdForSequenceClassification(bigbird_config()).save_pretrained(tmp_path / "bigbird-classifier")
    config = json.loads((FIXTURE / "config.json").read_text())
    for name, changes in [
        ("attn-type-1", {"attn_type": 1}),
        ("untied-projections", {"tie_projs": [False, True, False]}),
    ]:
        shutil.copytree(FIXTURE, tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **changes}))
    cases = [
        (hf_xformers.HfxBigBirdModel, "bias-free", "use_bias=True"),
        (hf_xformers.HfxBigBirdForSequenceClassification, "bigbird-classifier", "BigBirdForSequenceClassification"),
        (hf_xformers.HfxTransfoXLForCausalLM, "attn-type-1", "attn_type=0"),
        (hf_xformers.HfxTransfoXLForCausalLM, "untied-projections", "tie_projs"),
    ]
    for cls, name, reason in cases:
        with pytest.raises(ValueError, match=rf"(?s){reason}.*{IMPORTER}") as caught:
            cls.from_pretrained(tmp_path / name)
        assert name in str(caught.value)
    for name in ("bias-free", "bigbird-classifier", "attn-type-1", "untied-projections"):
        with pytest.raises(ValueError):
            convert_from_transformers(tmp_path / name)


def test_transfo_xl_biases_shared_by_all_layers(tmp_path):
    """untie_r=False: one ``r_w_bias`` / ``r_r_bias`` for all layers (4.x's ``transformer.r_w_bias``), which no rename
    places in every layer: they are copied there after loading, as the importer does, and not reported as missing."""
    config = json.loads((FIXTURE / "config.json").read_text())
    weights = torch.load(FIXTURE / "pytorch_model.bin", weights_only=True)
    for bias in ("r_w_bias", "r_r_bias"):
        weights[f"transformer.{bias}"] = weights.pop(f"transformer.layers.0.dec_attn.{bias}")
        del weights[f"transformer.layers.1.dec_attn.{bias}"]
    torch.save(weights, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({**config, "untie_r": False}))
    inputs = model_inputs("transfo_xl", None)
    imported, _ = convert_from_transformers(tmp_path)
    for cls, reference in [(hf_xformers.HfxTransfoXLForCausalLM, imported),
                           (hf_xformers.HfxTransfoXLModel, imported.transformer)]:  # fmt: skip
        with captured_logs() as records:
            model, info = cls.from_pretrained(tmp_path, output_loading_info=True)
        line = conversion_lines(records)[0]
        assert "copied: transformer.r_w_bias" in line or "copied: transformer.r_r_bias" in line, line
        assert not info["missing_keys"], info  # the per-layer biases are filled, not fresh
        assert not [k for k in info["unexpected_keys"] if k.endswith(("r_w_bias", "r_r_bias"))], info
        for layer in model.base_model.layers:
            assert torch.equal(layer.attention.r_w_bias, weights["transformer.r_w_bias"])
            assert torch.equal(layer.attention.r_r_bias, weights["transformer.r_r_bias"])
        with torch.no_grad():
            assert max_output_diff(model(**inputs), reference(**inputs)) <= 1e-6
