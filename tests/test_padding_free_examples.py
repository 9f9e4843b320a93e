"""Padding-free (packed) batches in training: ``hf_xformers.padding_free`` (the collator for every task head, the
models' first positions, rows of a token budget) and ``--padding_free`` in the example scripts, whose packed runs must
give the padded runs' losses on the same data.

Everything is tiny and offline: models built here (no dropout), the tokenizer of tests/tiny_tokenizers.py.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    DataCollatorWithFlattening,
    RobertaConfig,
    RobertaForSequenceClassification,
    RobertaModel,
    TrainingArguments,
)

import hf_xformers  # noqa: E402
from examples import run_classification, run_clm, run_glue, run_mlm, run_wikihop  # noqa: E402
from hf_xformers.padding_free import (  # noqa: E402
    DataCollatorForPackedDocuments,
    pack_by_token_budget,
    packing_refusal,
    position_ids_start_for,
)
from tests.test_examples import glue_rows, run_args, write_rows  # noqa: E402
from tests.test_run_mlm import documents  # noqa: E402
from tests.tiny_tokenizers import roberta_tokenizer  # noqa: E402
from tests.usage_errors import refused

WIKIHOP = Path(__file__).resolve().parent / "fixtures" / "wikihop"
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
REL = 1e-5


def first_logged_loss(out: Path) -> float:
    state = json.loads((out / "trainer_state.json").read_text())
    return next(entry["loss"] for entry in state["log_history"] if "loss" in entry)


# ---------------------------------------------------------------------------------------------------------------
# The collator, task by task
# ---------------------------------------------------------------------------------------------------------------

DOCS = [[0, 11, 12, 13, 2], [0, 21, 2], [0, 31, 32, 33, 34, 35, 2]]
STARTS = [0, 5, 8]
TOTAL = 15


def collate(features, **options):
    options.setdefault("position_ids_start", 2)
    return DataCollatorForPackedDocuments(**options)(features)


def test_sequence_classification_labels_per_document():
    batch = collate([{"input_ids": d, "attention_mask": [1] * len(d), "label": i % 2, "idx": 7}
                     for i, d in enumerate(DOCS)])  # fmt: skip
    # no attention_mask, no idx: only model inputs, with explicit boundaries (issue 40)
    assert set(batch) == {"input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                          "max_length_k"}  # fmt: skip
    assert batch["input_ids"].tolist() == [sum(DOCS, [])]
    assert batch["position_ids"].tolist() == [[2 + i for d in DOCS for i in range(len(d))]]
    assert batch["labels"].dtype == torch.long and batch["labels"].tolist() == [0, 1, 0]
    # STS-B scores, and multi-label vectors: float, one row per document.
    scores = collate([{"input_ids": d, "labels": 0.5 * i} for i, d in enumerate(DOCS)])["labels"]
    assert scores.dtype == torch.float32 and scores.tolist() == [0.0, 0.5, 1.0]
    multi = collate([{"input_ids": d, "labels": [1.0, 0.0]} for d in DOCS])["labels"]
    assert multi.shape == (3, 2) and multi.dtype == torch.float32
    # Test sets: no labels at all (transformers' collator would copy the ids into `labels`).
    assert "labels" not in collate([{"input_ids": d} for d in DOCS])


def test_per_token_labels_keep_their_tokens_and_causal_lm_is_transformers():
    labels = [[-100] * len(d) for d in DOCS]
    labels[1][0] = 9  # a masked first token (no <s>): its label must survive
    labels[2][3] = 33
    batch = collate([{"input_ids": d, "labels": lab} for d, lab in zip(DOCS, labels)])
    assert batch["labels"].tolist() == [sum(labels, [])]
    # Causal LM: exactly DataCollatorWithFlattening's labels (separator at every document start; ids if no labels).
    reference = DataCollatorWithFlattening(position_ids_start=2, return_flash_attn_kwargs=True)
    for features in ([{"input_ids": d} for d in DOCS], [{"input_ids": d, "labels": d} for d in DOCS]):
        ours = collate(features, causal_lm=True)
        theirs = reference(features)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) if torch.is_tensor(ours[k]) else ours[k] == theirs[k] for k in ours)
        assert (ours["labels"][0, STARTS] == -100).all()
    # Token classification labels with a [CLS]-style -100 first label: the same either way.
    tags = [[-100] + [1] * (len(d) - 1) for d in DOCS]
    assert torch.equal(
        collate([{"input_ids": d, "labels": t} for d, t in zip(DOCS, tags)])["labels"],
        collate([{"input_ids": d, "labels": t} for d, t in zip(DOCS, tags)], causal_lm=True)["labels"],
    )


def test_boundary_forms():
    features = [{"input_ids": d, "label": 1} for d in DOCS]
    batch = collate(features, return_seq_idx=True, return_flash_attn_kwargs=True, position_ids_start=0)
    assert batch["position_ids"].tolist() == [[i for d in DOCS for i in range(len(d))]]
    assert batch["seq_idx"].tolist() == [[k for k, d in enumerate(DOCS) for _ in d]]
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [*STARTS, TOTAL]
    assert batch["max_length_q"] == batch["max_length_k"] == 7
    only_seq_idx = collate(
        features, return_position_ids=False, return_seq_idx=True, return_flash_attn_kwargs=False,
        position_ids_start=None,
    )  # fmt: skip
    assert set(only_seq_idx) == {"input_ids", "seq_idx", "labels"}
    with pytest.raises(ValueError, match="explicit document boundaries"):
        collate(features, return_flash_attn_kwargs=False)
    with pytest.raises(ValueError, match="needs position_ids_start"):
        DataCollatorForPackedDocuments()


def test_question_answering_positions_per_document():
    features = [{"input_ids": d, "start_positions": 1, "end_positions": len(d) - 2} for d in DOCS]
    batch = collate(features)
    assert batch["start_positions"].tolist() == [1, 1, 1]
    assert batch["end_positions"].tolist() == [3, 1, 5]  # inside each document, not shifted into the row
    assert "labels" not in batch


def test_multiple_choice_every_choice_a_document():
    examples = [
        {"input_ids": [[0, 5, 2], [0, 6, 6, 2]], "global_attention_mask": [[1, 0, 0], [1, 1, 0, 0]],
         "token_type_ids": [[0, 0, 0], [0, 0, 0, 0]], "label": 1},
        {"input_ids": [[0, 8, 2], [0, 9, 9, 9, 2]], "global_attention_mask": [[1, 0, 0], [1, 0, 0, 0, 0]],
         "token_type_ids": [[0, 0, 0], [0, 0, 0, 0, 0]], "label": 0},
    ]  # fmt: skip
    batch = collate(examples, return_seq_idx=True)
    assert batch["num_choices"] == 2 and batch["labels"].tolist() == [1, 0]
    assert batch["input_ids"].tolist() == [[0, 5, 2, 0, 6, 6, 2, 0, 8, 2, 0, 9, 9, 9, 2]]
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3]]
    assert batch["global_attention_mask"].tolist() == [[1, 0, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0]]
    assert batch["token_type_ids"].shape == batch["input_ids"].shape
    assert batch["position_ids"][0, [0, 3, 7, 10]].tolist() == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="example 1 has 3 choices"):
        collate([examples[0], {**examples[1], "input_ids": [[0, 2]] * 3, "global_attention_mask": [[1, 0]] * 3,
                               "token_type_ids": [[0, 0]] * 3}])  # fmt: skip


def test_per_token_inputs_and_refusals():
    masks = [[1] + [0] * (len(d) - 1) for d in DOCS]
    batch = collate([{"input_ids": d, "global_attention_mask": m} for d, m in zip(DOCS, masks)])
    assert batch["global_attention_mask"].tolist() == [sum(masks, [])]
    with pytest.raises(ValueError, match="carries padding"):
        collate([{"input_ids": [0, 5, 1], "attention_mask": [1, 1, 0]}])
    with pytest.raises(ValueError, match="no tokens"):
        collate([{"input_ids": [0, 2]}, {"input_ids": []}])
    with pytest.raises(ValueError, match="carry labels and others do not"):
        collate([{"input_ids": [0, 2], "label": 1}, {"input_ids": [0, 2]}])
    with pytest.raises(ValueError, match="global_attention_mask and others do not"):
        collate([{"input_ids": [0, 2], "global_attention_mask": [1, 0]}, {"input_ids": [0, 2]}])
    with pytest.raises(ValueError, match="no features"):
        collate([])


# ---------------------------------------------------------------------------------------------------------------
# First positions, refusals, token budgets
# ---------------------------------------------------------------------------------------------------------------


SMALL = {  # the architectures whose configs do not take TINY
    "hfx-reformer": dict(hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37,
                         attn_layers=["local", "lsh"], local_attn_chunk_length=4, lsh_attn_chunk_length=8,
                         num_buckets=4, axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16],
                         max_position_embeddings=64, pad_token_id=1, hidden_dropout_prob=0.0),
    "hfx-transfo-xl": dict(cutoffs=[], d_model=32, n_head=4, d_inner=37, n_layer=2, mem_len=8, dropout=0.0),
}  # fmt: skip
OPTIONS = {"hfx-bigbird": dict(block_size=4, num_random_blocks=1), "hfx-longformer": dict(attention_window=8),
           "hfx-linformer": dict(linformer_k=8), "hfx-performer": dict(num_random_features=8),
           "hfx-universal": dict(act_max_steps=2)}  # fmt: skip


def tiny_config(model_type: str, **extra):
    config_class = hf_xformers.REGISTRY[model_type][0]
    if model_type in SMALL:
        return config_class(vocab_size=50, **SMALL[model_type], **extra)
    return config_class(vocab_size=50, max_position_embeddings=66, **TINY, **OPTIONS.get(model_type, {}), **extra)


TEXT_TYPES = [t for t in hf_xformers.REGISTRY if t not in ("hfx-swin",)]


@pytest.mark.parametrize("model_type", TEXT_TYPES)
def test_position_ids_start_for_config_matches_the_model(model_type):
    config = tiny_config(model_type)
    model_class = hf_xformers.REGISTRY[model_type][1]["AutoModel"]
    model = model_class(config)
    expected = 0 if model_type in ("hfx-bigbird", "hfx-reformer", "hfx-universal", "hfx-transfo-xl") else 2
    assert position_ids_start_for(config) == position_ids_start_for(model) == expected
    offset = getattr(getattr(model, "embeddings", None), "position_offset", None)
    if offset is not None:  # what the model itself checks packed positions against
        assert offset == expected


def test_position_ids_start_for_transformers_models():
    roberta = RobertaConfig(vocab_size=50, max_position_embeddings=40, **TINY)
    bert = BertConfig(vocab_size=50, max_position_embeddings=40, **TINY)
    assert position_ids_start_for(roberta) == position_ids_start_for(RobertaModel(roberta)) == 2
    assert position_ids_start_for(bert) == position_ids_start_for(BertModel(bert)) == 0


def test_packing_refusals():
    longformer = hf_xformers.HfxLongformerForSequenceClassification(tiny_config("hfx-longformer"))
    assert packing_refusal(longformer) is None
    assert DataCollatorForPackedDocuments.for_model(longformer).position_ids_start == 2
    bigbird = hf_xformers.HfxBigBirdForMaskedLM(tiny_config("hfx-bigbird"))
    assert DataCollatorForPackedDocuments.for_model(bigbird, return_seq_idx=True).position_ids_start == 0
    linformer = hf_xformers.HfxLinformerForSequenceClassification(tiny_config("hfx-linformer"))
    assert "projected along the whole sequence" in packing_refusal(linformer)
    roberta = RobertaForSequenceClassification(RobertaConfig(vocab_size=50, max_position_embeddings=40, **TINY))
    assert "takes no document boundaries" in packing_refusal(roberta)
    with pytest.raises(ValueError, match="RobertaForSequenceClassification cannot take a packed"):
        DataCollatorForPackedDocuments.for_model(roberta)
    transfo_xl = hf_xformers.HfxTransfoXLForCausalLM(tiny_config("hfx-transfo-xl"))
    assert "cannot take a packed" in packing_refusal(transfo_xl)


def test_pack_by_token_budget():
    lengths = [3, 5, 2, 7, 1, 4]
    assert pack_by_token_budget(lengths, 8) == [[3, 4], [0, 1], [2, 5]]  # first fit, longest first
    assert pack_by_token_budget(lengths, 8, decreasing=False) == [[0, 1], [2, 4, 5], [3]]  # first fit, in order
    assert pack_by_token_budget([], 8) == []
    rng = random.Random(0)
    for decreasing in (True, False):
        lengths = [rng.randint(1, 50) for _ in range(500)]
        rows = pack_by_token_budget(lengths, 64, decreasing)
        assert sorted(i for row in rows for i in row) == list(range(500))
        assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
        # The rows of a plain first fit that scans every open row.
        naive: list[list[int]] = []
        for i in sorted(range(500), key=lambda i: -lengths[i]) if decreasing else range(500):
            row = next((r for r in naive if sum(lengths[j] for j in r) + lengths[i] <= 64), None)
            if row is None:
                naive.append(row := [])
            row.append(i)
        assert rows == [sorted(row) for row in naive]
    with pytest.raises(ValueError, match="Document 1 has 9 tokens, more than the 8"):
        pack_by_token_budget([3, 9], 8)
    with pytest.raises(ValueError, match="Document 0 has 0 tokens"):
        pack_by_token_budget([0], 8)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        pack_by_token_budget([1], 0)


# ---------------------------------------------------------------------------------------------------------------
# The collator's rows through the heads: every document as on its own (needs the heads' packing support)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["hfx-longformer", "hfx-bigbird"])
def test_collated_rows_through_the_heads(model_type):
    torch.manual_seed(0)
    config = tiny_config(model_type, num_labels=3)
    docs = [torch.randint(5, 50, (n,)).tolist() for n in (9, 17, 5, 12)]
    for doc in docs:  # <s> question </s></s> context </s>: the question is where QA puts global attention
        doc[0], doc[2], doc[3], doc[-1] = 0, 2, 2, 2
    heads = hf_xformers.REGISTRY[model_type][1]

    def run(auto_name, packed_features, solo_inputs, compare):
        model = heads[auto_name](config).eval()
        batch = DataCollatorForPackedDocuments.for_model(model, return_seq_idx=True)(packed_features)
        with torch.no_grad():
            packed = model(**batch)
            solos = [model(**inputs) for inputs in solo_inputs]
        compare(packed, solos)

    def as_tensors(feature):
        return {k: torch.tensor([v]) for k, v in feature.items()}

    def close(a, b):
        torch.testing.assert_close(a, b, rtol=REL, atol=1e-5)

    # Sequence classification: (num_documents, num_labels), the loss over the documents.
    labels = [0, 2, 1, 1]
    features = [{"input_ids": d, "label": y} for d, y in zip(docs, labels)]
    run("AutoModelForSequenceClassification", features, [as_tensors({"input_ids": d}) for d in docs],
        lambda p, s: close(p.logits, torch.cat([o.logits for o in s])))  # fmt: skip

    # Masked LM: (1, total_tokens, vocab), per-token labels kept on their tokens.
    mlm_labels = [[-100] * len(d) for d in docs]
    for row in mlm_labels:
        row[0], row[2] = 7, 8
    features = [{"input_ids": d, "labels": y} for d, y in zip(docs, mlm_labels)]

    def same_mlm(packed, solos):
        close(packed.logits, torch.cat([o.logits for o in solos], dim=1))
        per_token = torch.stack([o.loss for o in solos]).mean()  # every document has 2 labelled tokens
        close(packed.loss, per_token)

    run("AutoModelForMaskedLM", features, [as_tensors({"input_ids": d, "labels": y})
                                           for d, y in zip(docs, mlm_labels)], same_mlm)  # fmt: skip

    # Extractive QA: (num_documents, longest) start/end logits, positions inside each document.
    features = [{"input_ids": d, "start_positions": 1, "end_positions": 3} for d in docs]

    def same_qa(packed, solos):
        for k, (solo, d) in enumerate(zip(solos, docs)):
            close(packed.start_logits[k, : len(d)], solo.start_logits[0])
            close(packed.end_logits[k, : len(d)], solo.end_logits[0])

    run("AutoModelForQuestionAnswering", features, [as_tensors({"input_ids": d}) for d in docs], same_qa)

    # Multiple choice: two examples of two choices, (num_examples, num_choices).
    examples = [{"input_ids": [docs[0], docs[1]], "label": 1}, {"input_ids": [docs[2], docs[3]], "label": 0}]

    def same_mc(packed, solos):
        assert packed.logits.shape == (2, 2)
        close(packed.logits.reshape(-1), torch.cat([o.logits.reshape(-1) for o in solos]))

    run("AutoModelForMultipleChoice", examples,
        [{"input_ids": torch.tensor([[d]])} for d in docs], same_mc)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Example scripts: --padding_free gives the padded run's losses
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cache")


@pytest.fixture(scope="module")
def linformer_dir(tmp_path_factory) -> Path:
    """A tiny hfx-linformer MaskedLM (a model that refuses packed batches) and its tokenizer."""
    path = tmp_path_factory.mktemp("hfx_linformer")
    tokenizer = roberta_tokenizer()
    config = hf_xformers.HfxLinformerConfig(vocab_size=len(tokenizer), max_position_embeddings=66, linformer_k=8,
                                            **TINY)  # fmt: skip
    hf_xformers.HfxLinformerForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_run_glue_padding_free_equals_padded(longformer_dir, cache_dir, tmp_path):
    """RTE pairs of different lengths: the first training loss, the evaluation loss and the predictions of a packed
    run equal the padded run's (no dropout in the tiny model)."""
    train = write_rows(tmp_path / "train.csv", glue_rows("rte", 8))
    dev = write_rows(tmp_path / "dev.csv", glue_rows("rte", 6))
    test = write_rows(tmp_path / "test.csv", glue_rows("rte", 5, labels=None))
    results = {}
    grouped = (["--train_sampling_strategy", "group_by_length"] if hasattr(TrainingArguments, "train_sampling_strategy")
               else ["--group_by_length"])  # fmt: skip
    for name, extra in (("padded", []), ("packed", ["--padding_free", *grouped])):
        out = tmp_path / name
        metrics = run_glue.main(
            run_args(longformer_dir, out, cache_dir, "--task_name", "rte", "--do_train", "--do_eval", "--do_predict")
            + ["--train_file", train, "--validation_file", dev, "--test_file", test, "--max_steps", "1", *extra]
        )
        results[name] = (first_logged_loss(out), metrics["eval_loss"], (out / "RTE.tsv").read_text())
    (loss, eval_loss, predictions), (packed_loss, packed_eval_loss, packed_predictions) = results.values()
    assert packed_loss == pytest.approx(loss, rel=REL)
    assert packed_eval_loss == pytest.approx(eval_loss, rel=REL)
    assert packed_predictions == predictions


def test_run_glue_padding_free_refusals(roberta_dir, linformer_dir, cache_dir, tmp_path, capsys):
    train = write_rows(tmp_path / "train.csv", glue_rows("sst2", 4))

    def run(model: Path, *extra: str) -> None:
        run_glue.main(run_args(model, tmp_path / "out", cache_dir, "--task_name", "sst2", "--do_train",
                               "--train_file", train, "--padding_free", *extra))  # fmt: skip

    with refused(capsys, "--padding_free packs unpadded examples: drop --pad_to_max_length"):
        run(roberta_dir, "--pad_to_max_length")
    with pytest.raises(ValueError, match="--padding_free: RobertaForSequenceClassification cannot take a packed"):
        run(roberta_dir)
    with pytest.raises(ValueError, match="--padding_free: HfxLinformerForSequenceClassification cannot .* projected"):
        run(linformer_dir)


def test_run_classification_padding_free_refused_before_the_data(
    roberta_dir, linformer_dir, longformer_dir, tmp_path, capsys
):
    """A model that cannot take packed batches (transformers' RoBERTa, the truncated baseline of long_vs_truncated;
    hfx-linformer) is refused while the options are read: the data file named does not even exist."""
    missing = str(tmp_path / "not_written_yet.csv")

    def run(model: Path) -> None:
        run_classification.main(["--model_name_or_path", str(model), "--train_file", missing, "--do_train",
                                 "--output_dir", str(tmp_path / "out"), "--padding_free"])  # fmt: skip

    with refused(capsys, "--padding_free: RobertaForSequenceClassification cannot take a packed .* Run without"):
        run(roberta_dir)
    with refused(capsys, "--padding_free: HfxLinformerForSequenceClassification cannot .* projected"):
        run(linformer_dir)
    with pytest.raises(FileNotFoundError, match="not_written_yet.csv: no such file"):  # a model that packs: the data
        run(longformer_dir)


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("roberta")
    tokenizer = roberta_tokenizer()
    RobertaModel(RobertaConfig(vocab_size=len(tokenizer), type_vocab_size=1, max_position_embeddings=130, **TINY)
                 ).save_pretrained(path)  # fmt: skip
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mlm_corpus(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("packed_mlm_corpus")
    train, valid = folder / "train.txt", folder / "valid.txt"
    # Documents of 1 to 6 sentences: pieces of every length up to the block size.
    rng = np.random.default_rng(0)
    words = documents(30)
    train.write_text("\n".join(" ".join(d.split()[: rng.integers(4, 60)]) for d in words) + "\n", encoding="utf-8")
    valid.write_text("\n".join(" ".join(d.split()[: rng.integers(4, 60)]) for d in words[:10]) + "\n", encoding="utf-8")
    return {"train": train, "valid": valid}


@pytest.fixture(scope="module")
def mlm_model_dir(tmp_path_factory) -> Path:
    """A tiny hfx-longformer MaskedLM (128 tokens, window 8, no dropout) and its tokenizer."""
    path = tmp_path_factory.mktemp("packed_mlm_model")
    tokenizer = roberta_tokenizer()
    torch.manual_seed(0)
    config = hf_xformers.HfxLongformerConfig(vocab_size=len(tokenizer), attention_window=8, max_position_embeddings=130,
                                             **TINY)  # fmt: skip
    hf_xformers.HfxLongformerForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


MLM_COMMON = [
    "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "1",
    "--learning_rate", "1e-3", "--warmup_steps", "0", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
    "--disable_tqdm", "true", "--seed", "0", "--max_seq_length", "32", "--eval_bucket_size", "8", "--max_steps", "1",
    "--logging_steps", "1",
]  # fmt: skip


def test_cut_documents_and_masks_of_pieces(mlm_corpus):
    tokenizer = roberta_tokenizer()
    docs = run_mlm.read_text_file(str(mlm_corpus["valid"]), "text")
    tokens = run_mlm.tokenize_documents(docs, tokenizer)
    pieces = run_mlm.cut_documents(tokens, 32)
    lengths = [len(p) for p in pieces["input_ids"]]
    assert max(lengths) == 32 and min(lengths) < 32  # full pieces and shorter last ones
    assert sum(lengths) == sum(len(t) for t in tokens["input_ids"])  # nothing dropped, nothing run on
    masked = run_mlm.mask_once(pieces, tokenizer, 0.15, seed=0)
    assert [len(ids) for ids in masked["input_ids"]] == lengths == [len(y) for y in masked["labels"]]

    # Training batches: packed, the masks drawn are those of the padded batch, each on its own token.
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    chosen = [order[0], order[-1], order[len(order) // 2], order[1]]  # lengths that differ: padded batches
    features = [{"input_ids": pieces["input_ids"][i]} for i in chosen]
    padded_collator = run_mlm.MaskingCollator(tokenizer, 0.15)
    packed_collator = run_mlm.MaskingCollator(tokenizer, 0.15, DataCollatorForPackedDocuments(position_ids_start=2))
    torch.manual_seed(3)
    padded = padded_collator(features)
    torch.manual_seed(3)
    packed = packed_collator(features)
    real = padded["attention_mask"].bool()
    assert torch.equal(packed["input_ids"][0], padded["input_ids"][real])
    assert torch.equal(packed["labels"][0], padded["labels"][real])
    assert (packed["labels"] != -100).any()
    assert packed["position_ids"].tolist() == [[2 + i for f in features for i in range(len(f["input_ids"]))]]
    # Evaluation pieces of different lengths: padded with an attention mask, or packed as they are.
    eval_features = [{"input_ids": masked["input_ids"][i], "labels": masked["labels"][i]} for i in chosen]
    padded_eval = padded_collator(eval_features)
    assert torch.equal(padded_eval["labels"][padded_eval["attention_mask"].bool()],
                       packed_collator(eval_features)["labels"][0])  # fmt: skip


def test_bucket_metrics_by_positions():
    """Packed rows: buckets follow each token's position in its piece, not its column."""
    losses = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
    labels = np.array([[7, 7, 7, 7, 7]])
    positions = np.array([[0, 1, 0, 1, 2]])
    metrics = run_mlm.mlm_metrics(losses, labels, 2, None, positions, length=4)
    assert metrics["loss_0_1"] == pytest.approx((1 + 2 + 3 + 4) / 4) and metrics["loss_2_3"] == 5.0


def test_run_mlm_padding_free_equals_padded(mlm_model_dir, mlm_corpus, tmp_path):
    """Documents kept apart: the packed run's first training loss and its evaluation (overall and per bucket) equal
    the padded run's (--line_by_line), token for token."""
    results = {}
    for name, flag in (("padded", "--line_by_line"), ("packed", "--padding_free")):
        out = tmp_path / name
        results[name] = run_mlm.main(["--model_name_or_path", str(mlm_model_dir), "--train_file",
                                      str(mlm_corpus["train"]), "--validation_file", str(mlm_corpus["valid"]),
                                      "--output_dir", str(out), flag, *MLM_COMMON])  # fmt: skip
        results[name]["first_loss"] = first_logged_loss(out)
    padded, packed = results["padded"], results["packed"]
    assert packed["first_loss"] == pytest.approx(padded["first_loss"], rel=REL)
    buckets = sorted(k for k in padded if k.startswith("eval_loss_"))
    assert buckets == sorted(k for k in packed if k.startswith("eval_loss_")) and len(buckets) == 4
    for key in ("eval_mlm_loss", "eval_loss", *buckets):
        assert packed[key] == pytest.approx(padded[key], rel=REL), key
    assert packed["eval_masked_tokens"] == padded["eval_masked_tokens"]


def test_run_mlm_padding_free_refused_early(linformer_dir, mlm_corpus, tmp_path):
    with pytest.raises(ValueError, match="--padding_free: HfxLinformerForMaskedLM cannot take a packed"):
        run_mlm.main(["--model_name_or_path", str(linformer_dir), "--train_file", str(mlm_corpus["train"]),
                      "--output_dir", str(tmp_path), "--padding_free", *MLM_COMMON])  # fmt: skip


def test_run_clm_padding_free_refused(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("hello world\n" * 20)
    with pytest.raises(ValueError, match="--padding_free: run_clm.py trains Transformer-XL"):
        run_clm.main(["--train_file", str(text), "--output_dir", str(tmp_path / "out"), "--padding_free"])


def test_wikihop_packed_chunks_equal_padded(longformer_dir):
    tokenizer = roberta_tokenizer()
    tokenizer = type(tokenizer).from_pretrained(longformer_dir)
    tokenizer.add_tokens([*run_wikihop.QUESTION_MARKERS, *run_wikihop.CANDIDATE_MARKERS], special_tokens=True)
    model = run_wikihop.WikiHopModel.from_pretrained(str(longformer_dir))
    model.encoder.resize_token_embeddings(len(tokenizer))
    model.eval()
    examples = json.loads((WIKIHOP / "train.json").read_text())[1:4]
    batch = {key: [example[key] for example in examples] for key in examples[0]}
    features = run_wikihop.featurize(batch, tokenizer, max_length=96, max_chunks=3)
    rows = [{key: features[key][i] for key in features} for i in range(len(examples))]
    padded_batch = run_wikihop.WikiHopCollator(tokenizer.pad_token_id)(rows)
    packed_batch = run_wikihop.WikiHopCollator(
        tokenizer.pad_token_id, DataCollatorForPackedDocuments.for_model(model.encoder)
    )(rows)
    chunks = [chunk for row in rows for chunk in row["input_ids"]]
    assert packed_batch["input_ids"].shape == (1, sum(len(c) for c in chunks)) and "attention_mask" not in packed_batch
    assert packed_batch["global_attention_mask"].sum() == sum(r["prefix_length"] * len(r["input_ids"]) for r in rows)
    with torch.no_grad():
        padded, packed = model(**padded_batch), model(**packed_batch)
    torch.testing.assert_close(packed.logits, padded.logits, rtol=REL, atol=1e-5)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=REL, atol=1e-6)


def test_padding_free_scripts_send_explicit_boundaries(longformer_dir, tmp_path):
    """The scripts' packed rows carry cu_seq_lens_q/k and max_length_q/k beside the restarting positions (the model
    then resolves documents by shape, without reading the positions), and WikiHop's wrapper hands them on to its
    encoder; the logits are those of the seq_idx form."""
    import logging

    from examples.utils_examples import packed_collator

    model = run_wikihop.WikiHopModel.from_pretrained(str(longformer_dir)).eval()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    collator = packed_collator(model.encoder, args, logging.getLogger(__name__))
    rows = collator([{"input_ids": doc} for doc in DOCS])
    assert rows["cu_seq_lens_q"].tolist() == rows["cu_seq_lens_k"].tolist() == [*STARTS, TOTAL]
    assert rows["max_length_q"] == rows["max_length_k"] == 7
    assert rows["position_ids"].shape == (1, TOTAL)

    features = [{"input_ids": [doc], "prefix_length": 2, "candidate_spans": [[0, 2]], "label": 0} for doc in DOCS]
    seen = {}
    model.encoder.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        explicit = model(**run_wikihop.WikiHopCollator(1, collator)(features)).logits
        assert seen["cu_seq_lens_q"].tolist() == [*STARTS, TOTAL] and seen["max_length_k"] == 7
        # The other explicit form (seq_idx, no cu_seq_lens): the same logits.
        seq_idx_form = DataCollatorForPackedDocuments.for_model(
            model.encoder, return_flash_attn_kwargs=False, return_seq_idx=True
        )
        assert "cu_seq_lens_q" not in seq_idx_form([{"input_ids": doc} for doc in DOCS])
        torch.testing.assert_close(explicit, model(**run_wikihop.WikiHopCollator(1, seq_idx_form)(features)).logits)


def test_run_wikihop_padding_free_equals_padded(longformer_dir, cache_dir, tmp_path):
    losses = {}
    for name, extra in (("padded", []), ("packed", ["--padding_free"])):
        out = tmp_path / name
        args = run_args(longformer_dir, out, cache_dir, "--do_train", "--do_eval", "--max_steps", "1")
        metrics = run_wikihop.main(args + ["--train_file", str(WIKIHOP / "train.json"), "--validation_file",
                                           str(WIKIHOP / "dev.json"), "--max_seq_length", "96",
                                           "--max_chunks_per_example", "3", *extra])  # fmt: skip
        losses[name] = (first_logged_loss(out), metrics["eval_loss"])
    assert losses["packed"] == pytest.approx(losses["padded"], rel=REL)
