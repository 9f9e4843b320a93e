"""The single-process pieces of sequence parallelism: the collator for DeepSpeed's adapter, what the model reads back
from its batches, the config field DeepSpeed reads, and a script's settings. (The ranks themselves:
tests/test_sequence_parallel.py.)"""

from __future__ import annotations

import types

import pytest
import torch

from hf_xformers import (
    DataCollatorForSequenceParallel,
    HfxBigBirdConfig,
    HfxLongformerConfig,
    HfxLongformerForSequenceClassification,
    HfxReformerConfig,
    HfxUniversalConfig,
    HfxUniversalForMaskedLM,
    sequence_label_ids,
    sequence_parallel_size,
)
from hf_xformers.ops.sequence_parallel import PER_SEQUENCE_KEY, restore_per_sequence

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=40, attention_window=[4])  # fmt: skip


def padded(features: list[dict]) -> dict:
    """A task collator: pads to the longest row (pad id 1), one class label per example."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.ones(len(features), width, dtype=torch.long)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([f["label"] for f in features])}


FEATURES = [{"input_ids": [0, 5, 6, 7, 2], "label": 2}, {"input_ids": [0, 8, 2], "label": 0}]


def test_collator_pads_adds_the_models_positions_and_spreads_sequence_labels():
    config = HfxLongformerConfig(**TINY)
    batch = DataCollatorForSequenceParallel(padded, config, sp_size=4, max_length=8)(FEATURES)
    assert batch["input_ids"].tolist() == [[0, 5, 6, 7, 2, 1, 1, 1], [0, 8, 2, 1, 1, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]
    # RoBERTa-style: real tokens from pad_token_id + 1 = 2, padding at pad_token_id = 1.
    assert batch["position_ids"].tolist() == [[2, 3, 4, 5, 6, 1, 1, 1], [2, 3, 4, 1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[2] * 8, [0] * 8]
    assert batch[PER_SEQUENCE_KEY] == {"per_sequence": ["labels"], "added": []}
    # BigBird numbers from 0, padding included.
    bigbird = DataCollatorForSequenceParallel(padded, HfxBigBirdConfig(**TINY), sp_size=2, max_length=6)(FEATURES)
    assert bigbird["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 0, 0]]


def test_the_model_reads_the_spread_labels_back_as_one_process_does():
    torch.manual_seed(0)
    model = HfxLongformerForSequenceClassification(HfxLongformerConfig(**TINY, num_labels=3)).eval()
    plain = padded(FEATURES)
    spread = DataCollatorForSequenceParallel(padded, model, sp_size=2, max_length=8)(FEATURES)
    # What DeepSpeed's adapter and Trainer do to labels: shift_labels, and labels = shift_labels.
    shifted = torch.nn.functional.pad(spread["labels"], (0, 1), value=-100)[:, 1:]
    expected = model(**plain)
    got = model(**{**spread, "labels": spread["labels"]})
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, expected.loss)
    assert sequence_label_ids(spread["labels"]).tolist() == [2, 0] == sequence_label_ids(shifted[:, :-1]).tolist()


def test_question_answering_batches_get_a_stand_in_labels_the_model_drops():
    features = [{"input_ids": [0, 5, 2], "start_positions": 1, "end_positions": 1}]

    def qa(fs):
        return {"input_ids": torch.tensor([f["input_ids"] for f in fs]),
                "start_positions": torch.tensor([f["start_positions"] for f in fs]),
                "end_positions": torch.tensor([f["end_positions"] for f in fs])}  # fmt: skip

    batch = DataCollatorForSequenceParallel(qa, HfxLongformerConfig(**TINY), sp_size=2, max_length=4)(features)
    # Not -100: transformers' deepspeed_sp_compute_loss zeroes the loss of a batch whose labels count no token.
    assert batch["labels"].tolist() == [[0, 0, 0, 0]]
    assert batch["start_positions"].tolist() == [[1, 1, 1, 1]]
    restored = restore_per_sequence(dict(batch))
    assert "labels" not in restored and restored["start_positions"].tolist() == [1]


def test_collator_refuses_what_the_adapter_cannot_cut():
    config = HfxLongformerConfig(**TINY)
    with pytest.raises(ValueError, match="must be a multiple of sp_size"):
        DataCollatorForSequenceParallel(padded, config, sp_size=4, max_length=10)
    with pytest.raises(ValueError, match="longer than max_length=4"):
        DataCollatorForSequenceParallel(padded, config, sp_size=2, max_length=4)(FEATURES)

    def multi_label(fs):
        return {**padded(fs), "labels": torch.zeros(len(fs), 3)}

    with pytest.raises(ValueError, match="multi-label classes"):
        DataCollatorForSequenceParallel(multi_label, config, sp_size=2, max_length=8)(FEATURES)
    # At set-up: a model sp_size cannot serve.
    model = HfxLongformerForSequenceClassification(config)
    with pytest.raises(ValueError, match="choose an sp_size that divides 4"):
        DataCollatorForSequenceParallel(padded, model, sp_size=8, max_length=8)
    universal = HfxUniversalForMaskedLM(HfxUniversalConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                           num_attention_heads=4, intermediate_size=37))  # fmt: skip
    with pytest.raises(ValueError, match="HfxUniversalForMaskedLM cannot train with sequence parallelism"):
        DataCollatorForSequenceParallel(padded, universal, sp_size=2, max_length=8)


def test_num_key_value_heads_is_the_head_count_and_never_saved(tmp_path):
    for config in (HfxLongformerConfig(**TINY), HfxReformerConfig(num_attention_heads=2)):
        assert config.num_key_value_heads == config.num_attention_heads
        assert "num_key_value_heads" not in config.to_dict()
    config = HfxLongformerConfig(**TINY)
    config.save_pretrained(tmp_path)
    assert "num_key_value_heads" not in (tmp_path / "config.json").read_text()
    assert HfxLongformerConfig(**TINY, num_key_value_heads=4).num_key_value_heads == 4  # the same value: accepted
    with pytest.raises(ValueError, match="no grouped-query attention"):
        HfxLongformerConfig(**TINY, num_key_value_heads=2)


def test_sequence_parallel_size_from_the_arguments_or_accelerate(monkeypatch):
    assert sequence_parallel_size(types.SimpleNamespace(parallelism_config=None)) == 1
    pc = types.SimpleNamespace(sp_backend="deepspeed", sp_size=4)
    assert sequence_parallel_size(types.SimpleNamespace(parallelism_config=pc)) == 4
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    assert sequence_parallel_size(types.SimpleNamespace(parallelism_config=None)) == 2
