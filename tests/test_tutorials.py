"""The tutorials (docs/tutorials/*.md) run as written: every ``python`` block of a page, in order, in one namespace,
on a tiny local RoBERTa in place of ``path/to/roberta-base``, with the real-size values of the page (lengths,
data-set sizes, epochs) replaced by small ones. Each replacement must find its text, so a tutorial that changes
its code changes this test too."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import RobertaConfig, RobertaForMaskedLM  # noqa: E402

from tests.test_conversion import TINY, perturb_  # noqa: E402
from tests.tiny_tokenizers import roberta_tokenizer  # noqa: E402

TUTORIALS = Path(__file__).resolve().parents[1] / "docs" / "tutorials"
SOURCE = '"path/to/roberta-base"'
# Real-size value -> tiny value, per page (besides the source folder).
SMALLER = {
    "classify-long-documents.md": {
        "max_length=4096": "max_length=512",
        "attention_window=512": "attention_window=16",
        "random.randint(60, 120)": "random.randint(2, 4)",
        "range(48)": "range(12)",
        "num_train_epochs=3": "num_train_epochs=1",
    },
    "question-answering.md": {
        "max_length=4096": "max_length=512",
        "random.randint(20, 80)": "random.randint(1, 2)",
        "range(40)": "range(10)",
        "num_train_epochs=3": "num_train_epochs=1",
    },
    "convert-and-pretrain.md": {
        "max_length=4096": "max_length=256",
        "range(400)": "range(30)",
        "range(40)": "range(8)",
        "max_steps=100": "max_steps=2",
        "warmup_steps=10": "warmup_steps=0",
        "gradient_accumulation_steps=8": "gradient_accumulation_steps=1",
        "[:2000]": "[:150]",
    },
    "packed-batches.md": {
        "max_length=4096": "max_length=512",
        "random.uniform(5, 11)": "random.uniform(2, 5)",
        "range(64)": "range(16)",
        "num_train_epochs=2": "num_train_epochs=1",
    },
}


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)


def test_every_tutorial_is_tested():
    pages = {p.name for p in TUTORIALS.glob("*.md")} - {"index.md"}
    assert pages == set(SMALLER), "a tutorial page without an entry in SMALLER (or an entry without its page)"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny RoBERTa masked-LM checkpoint with its tokenizer (the tutorials' ``path/to/roberta-base``)."""
    tokenizer = roberta_tokenizer()
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("roberta")
    config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=34, **TINY)
    perturb_(RobertaForMaskedLM(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_tutorial(name: str, source: Path, workdir: Path, monkeypatch) -> dict:
    code = "\n".join(python_blocks(TUTORIALS / name))
    assert code.count(SOURCE) == 1, f"{name} converts from {SOURCE} once"
    code = code.replace(SOURCE, repr(str(source)))
    for real, tiny in SMALLER[name].items():
        assert real in code, f"{name} no longer holds {real!r}; update SMALLER"
        code = code.replace(real, tiny)
    monkeypatch.chdir(workdir)  # the tutorials write their checkpoints into the working directory
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        namespace: dict = {"__name__": f"tutorial_{name}"}
        exec(compile(code, str(TUTORIALS / name), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    return namespace


def test_classify_long_documents(source, tmp_path, monkeypatch, capsys):
    ns = run_tutorial("classify-long-documents.md", source, tmp_path, monkeypatch)
    assert 0.0 <= ns["metrics"]["eval_accuracy"] <= 1.0
    assert ns["logits"].shape == (3, 2)
    assert ns["trainer"].state.global_step > 0
    assert json.loads((tmp_path / "long-classifier" / "config.json").read_text())["model_type"] == "hfx-longformer"


def test_question_answering(source, tmp_path, monkeypatch, capsys):
    ns = run_tutorial("question-answering.md", source, tmp_path, monkeypatch)
    assert ns["trainer"].state.global_step > 0
    # The answer is a span of the context, and the token positions the tutorial computed point at the answer.
    example = ns["data"]["test"][0]
    assert ns["answer"](example["question"], example["context"]) in example["context"]
    encoded = ns["tokenized"]["train"][0]
    original = ns["data"]["train"][0]
    assert encoded["start_positions"] > 0, "the tiny contexts fit: the answer is in the tokens"
    span = ns["tokenizer"].decode(encoded["input_ids"][encoded["start_positions"] : encoded["end_positions"] + 1])
    assert span.strip() == original["answer"]


def test_convert_and_continue_pretraining(source, tmp_path, monkeypatch, capsys):
    ns = run_tutorial("convert-and-pretrain.md", source, tmp_path, monkeypatch)
    assert torch.isfinite(torch.tensor([ns["before"], ns["after"]])).all()
    assert ns["trainer"].state.global_step == 2
    layer = ns["model"].longformer.encoder.layer[0].attention.self
    assert torch.equal(layer.query.weight, layer.query_global.weight)  # copy_proj_layers ran
    assert "masked-LM loss" in capsys.readouterr().out
    assert (tmp_path / "long-mlm" / "tokenizer_config.json").is_file()


def test_train_with_packed_batches(source, tmp_path, monkeypatch, capsys):
    ns = run_tutorial("packed-batches.md", source, tmp_path, monkeypatch)
    packed, padded = ns["packed"], ns["padded"]
    assert packed["input_ids"].shape[0] == 1
    assert packed["input_ids"].shape[1] == int(padded["attention_mask"].sum())  # only the real tokens
    torch.testing.assert_close(ns["packed_loss"], ns["padded_loss"], atol=1e-5, rtol=1e-5)
    assert ns["trainer"].state.global_step > 0
