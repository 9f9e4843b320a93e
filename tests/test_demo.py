"""Smoke test of examples/run_long_demo.py: convert a tiny RoBERTa, fine-tune a few steps, write metrics."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import csv  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
from transformers import RobertaConfig, RobertaForMaskedLM  # noqa: E402

from examples import run_long_demo as demo  # noqa: E402
from tests.test_conversion import TINY, perturb_  # noqa: E402
from tests.tiny_tokenizers import SENTENCES, roberta_tokenizer  # noqa: E402


def test_demo_main_on_local_csv(tmp_path):
    tokenizer = roberta_tokenizer()
    torch.manual_seed(0)
    source = tmp_path / "roberta"
    config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=34, **TINY)
    perturb_(RobertaForMaskedLM(config)).save_pretrained(source)
    tokenizer.save_pretrained(source)

    for name, rows in (("train.csv", 16), ("dev.csv", 8)):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            for i in range(rows):
                # Label 1 texts are long enough (> window / 2 tokens) to take the banded attention path.
                text = SENTENCES[i % len(SENTENCES)] if i % 2 else " ".join(SENTENCES)
                writer.writerow([text, int(i % 2 == 0)])

    out = tmp_path / "demo"
    argv = (
        ["--source", str(source), "--max-length", "64", "--attention-window", "8", "--train_file", str(tmp_path / "train.csv")]
        + ["--validation_file", str(tmp_path / "dev.csv"), "--max_seq_length", "48", "--max_steps", "3"]
        + ["--per_device_train_batch_size", "4", "--output_dir", str(out)]
    )  # fmt: skip
    demo.main(argv)
    metrics = demo.main(argv)  # a second `make demo` into the same folder replaces its earlier output
    written = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= written["eval_accuracy"] <= 1.0 and 0.0 <= written["eval_f1"] <= 1.0
    assert written["eval_accuracy"] == metrics["eval_accuracy"]
    assert written["train_samples"] == 16 and written["eval_samples"] == 8
    assert (out / "converted" / "config.json").is_file()
