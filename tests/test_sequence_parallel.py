"""Sequence parallelism (DeepSpeed Ulysses) on the CPU: 2 and 4 gloo ranks give one process's loss, logits and gradients.

One ``torchrun`` launch of ``tests/sequence_parallel_worker.py`` per group size runs every case (starting processes
costs more than the tiny models): hfx-longformer, hfx-bigbird (seeded random blocks), hfx-performer (bidirectional
and causal) and hfx-linformer, with every token-sequence head, on a padded batch (one row's last shard pure padding)
and on a packed row (``seq_idx``; Linformer refuses packing), one case per type under bfloat16 autocast (what
``Trainer(bf16=True)`` runs), three cases through DeepSpeed's own data-loader adapter and transformers'
``deepspeed_sp_compute_loss`` (what Trainer runs), and the set-up refusals.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="sequence parallelism runs on DeepSpeed (pip install -e .[test])")

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5  # relative to the largest reference value (at least 1), float32
# Under bfloat16 autocast: bfloat16's machine epsilon. The ranks sum a weight's gradient over their tokens in other
# 16-bit partial sums than one process does (measured: up to 5.5e-4 on 2 ranks); logits and loss are within 3e-7.
BF16_TOLERANCE = 2**-8
TIMEOUT_S = 420

sys.path.insert(0, str(ROOT))
from tests.once_per_run import once_per_run  # noqa: E402
from tests.sequence_parallel_worker import cases  # noqa: E402

CASES = ["/".join(case) for case in cases()]


def _launch(folder: Path, ranks: int) -> dict:
    out = folder / "results.json"
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
    }  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        "-m", "tests.sequence_parallel_worker", str(out),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:  # a collective that never pairs up hangs rather than fails
        pytest.fail(
            f"{ranks} sequence-parallel ranks did not finish in {TIMEOUT_S} s:\n{(error.stdout or b'')[-4000:]!r}"
        )
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(out.read_text())
    assert results["world_size"] == ranks
    return results["cases"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return once_per_run(tmp_path_factory, "sequence_parallel_two_ranks", lambda folder: _launch(folder, 2))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    return once_per_run(tmp_path_factory, "sequence_parallel_four_ranks", lambda folder: _launch(folder, 4))


def _check_exact(result: dict, ranks: int, case: str) -> None:
    assert "error" not in result, result["error"]
    # The encoder really ran on shards (otherwise every rank computing the whole batch would pass too).
    # (Reformer's packed row is its internal layout of the documents, longer than the 32 tokens.)
    (tokens,) = result["encoder_tokens"]
    assert tokens * ranks >= 32 and tokens < 32
    if case.split("/")[1] in ("masked_lm", "causal_lm", "token_classification") and "reformer" not in case:
        # Token heads score this rank's tokens only: the logits never exist whole on a rank (Reformer gathers).
        assert result["logits_tokens"] == 32 // ranks
    tolerance = BF16_TOLERANCE if case.endswith("/bf16") else TOLERANCE
    assert result["loss_rel_diff"] <= tolerance, (result["loss"], result["reference_loss"])
    assert result["logits_rel_diff"] <= tolerance
    assert result["grads_rel_diff"] <= tolerance
    assert result["grads_max_abs"] > 1e-3  # gradients that are not all zero: the comparison proves something
    # Every rank computed the same loss (Trainer and DeepSpeed average what the ranks report).
    assert len({rank["loss"] for rank in result["ranks"]}) == 1


@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_two_ranks_equal_one_process(two_ranks, case):
    _check_exact(two_ranks[case], 2, case)


@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_four_ranks_equal_one_process(four_ranks, case):
    _check_exact(four_ranks[case], 4, case)


def test_sequence_parallel_hashes_lsh_as_one_process_under_bf16(two_ranks, four_ranks):
    """LSH under bfloat16 autocast with seeded rotations hashes a float32 re-projection; the head shards receive it
    from the ranks (a flipped bucket moves a context by tens of percent, far beyond bfloat16's rounding)."""
    for results in (two_ranks, four_ranks):
        result = results["lsh_float32_hash"]
        assert "error" not in result, result.get("error")
        assert result["context_rel_diff"] <= BF16_TOLERANCE  # measured 0 (hashing the bfloat16 query-keys: 0.38)
        # The weights' gradients sum 512 tokens' bfloat16 products, in other partial sums on each rank than in one
        # process (measured 3.2e-3 on 2 ranks; hashing the bfloat16 query-keys: 0.10).
        assert result["grads_rel_diff"] <= 2e-2


@pytest.mark.parametrize(
    "refusal, words",
    [
        ("heads_not_divisible", "choose an sp_size that divides"),
        ("output_attentions", "pass output_attentions=False"),
        ("unsupported_architecture", "HfxUniversalForMaskedLM cannot train with sequence parallelism"),
    ],
)
def test_sequence_parallel_refuses_what_it_cannot_serve(two_ranks, four_ranks, refusal, words):
    for results in (two_ranks, four_ranks):
        assert words in results[f"refusal/{refusal}"]["message"]


@pytest.mark.parametrize("task", ["masked_lm", "sequence_classification"])
def test_sequence_parallel_trainer_equals_one_process(tmp_path, task):
    """The stock Trainer with ParallelismConfig(sp_backend="deepspeed", sp_size=2) and a ZeRO-0 DeepSpeed config, on
    2 gloo ranks (tests/sequence_parallel_trainer_worker.py), batches from DataCollatorForSequenceParallel, logs the
    losses and ends with the weights of a one-process Trainer run on the same batches in the same order. SGD with
    gradient clipping: a gradient off by a factor (DeepSpeed sums the ranks' gradients) would show in the weights,
    which AdamW would hide."""
    import torch

    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
    }  # fmt: skip
    worker = ["-m", "tests.sequence_parallel_trainer_worker"]
    runs = {
        "sp": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *worker],
        "single": [sys.executable, *worker],
    }
    for mode, cmd in runs.items():  # the one-process run reads the order of batches the SP run trained on
        try:
            proc = subprocess.run(
                [*cmd, mode, str(tmp_path), task], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
            )
        except subprocess.TimeoutExpired as error:
            pytest.fail(f"the {mode} Trainer run did not finish in 240 s:\n{(error.stdout or b'')[-4000:]!r}")
        assert proc.returncode == 0, f"{mode} Trainer run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    sp = json.loads((tmp_path / "sp.json").read_text())
    single = json.loads((tmp_path / "single.json").read_text())
    assert sp["world_size"] == sp["accelerate_num_processes"] == 2
    # Each rank read its own share of the examples, and the group trained on every example once.
    assert sorted(i for batch in sp["order"] for i in batch) == list(range(8))
    # DeepSpeed's adapter: one batch per step for the whole group, every rank's batch in turn (len(dataloader) * 2).
    assert sp["steps"] == single["steps"] == len(sp["order"]) == 2 * len(sp["batches"]) > 0
    assert single["batches"] == sp["order"]
    # The encoder ran on half of each padded row (not every rank on the whole batch).
    assert max(sp["encoder_tokens"]) * 2 == max(single["encoder_tokens"])
    assert all(losses == sp["losses"] for losses in sp["rank_losses"])
    assert len(sp["losses"]) == sp["steps"]
    for step, (a, b) in enumerate(zip(sp["losses"], single["losses"], strict=True)):
        assert abs(a - b) <= TOLERANCE * max(1.0, abs(b)), (step, sp["losses"], single["losses"])
    trained, reference = torch.load(tmp_path / "sp.pt"), torch.load(tmp_path / "single.pt")
    initial = torch.load(tmp_path / "initial.pt")
    assert trained.keys() == reference.keys() == initial.keys()
    moved = max(float((reference[k] - initial[k]).abs().max()) for k in reference)
    diff = max(float((trained[k] - reference[k]).abs().max()) for k in reference)
    assert moved > 1e-2  # training changed the weights: their agreement proves something
    assert diff <= 1e-5, (diff, moved)
    if task == "masked_lm":
        # Clipping acted on some step (max_grad_norm=3.0), not on all (a clipped step hides the gradient's scale).
        assert max(single["grad_norms"]) > 3.0 > min(single["grad_norms"])


# ----- the example scripts under `accelerate launch`, on a converted long model -----------------------------------


@pytest.fixture(scope="module")
def launch_setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny RoBERTa converted to a 128-token hfx-longformer, a masked-LM corpus, a classification CSV, a ZeRO-0
    DeepSpeed config and an accelerate config file that asks for sequence parallelism over 2 CPU processes."""
    import csv

    import numpy as np

    from hf_xformers.conversion.convert_roberta_to_long import convert_roberta_to_long
    from tests.test_examples_readme import _tiny_roberta_mlm
    from tests.test_run_qa import squad_file
    from tests.tiny_tokenizers import SENTENCES

    folder = tmp_path_factory.mktemp("sp_launch")
    _tiny_roberta_mlm(folder / "source")
    convert_roberta_to_long(folder / "source", "longformer", 128, 32, folder / "long", None, overwrite=True)
    rng = np.random.default_rng(0)
    docs = [" ".join(SENTENCES[i] for i in rng.integers(0, len(SENTENCES), 12)) for _ in range(24)]
    (folder / "train.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    (folder / "valid.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:8]), encoding="utf-8")
    with open(folder / "classes.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows([d[:200], "abc"[i % 3]] for i, d in enumerate(docs))
    deepspeed_config = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 0},
    }  # fmt: skip
    (folder / "ds.json").write_text(json.dumps(deepspeed_config))
    squad_file(folder / "squad.json", 8, n_sentences=10)
    (folder / "sp.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        f"deepspeed_config:\n  deepspeed_config_file: {folder / 'ds.json'}\n"
        "num_machines: 1\nnum_processes: 2\nuse_cpu: true\n"
        "parallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: deepspeed\n"
        "  parallelism_config_sp_seq_length_is_variable: true\n  parallelism_config_sp_attn_implementation: sdpa\n"
    )
    return {"folder": folder}


@pytest.mark.parametrize("script", ["run_mlm", "run_classification", "run_qa"])
def test_sequence_parallel_accelerate_launch_trains_a_converted_model(launch_setup, script, tmp_path):
    """`accelerate launch --config_file sp.yaml examples/<script>.py ...`: the config file's parallelism_config (sp_size
    2, DeepSpeed) reaches Trainer, the script wraps its collator (DataCollatorForSequenceParallel), and a converted
    hfx-longformer trains three steps and evaluates, on 2 CPU processes."""
    folder = launch_setup["folder"]
    data = {
        "run_mlm": ["--train_file", folder / "train.txt", "--validation_file", folder / "valid.jsonl",
                    "--eval_bucket_size", "32", "--gradient_accumulation_steps", "1", "--warmup_steps", "0"],
        "run_classification": ["--train_file", folder / "classes.csv", "--validation_file", folder / "classes.csv",
                               "--do_train", "--do_eval"],
        "run_qa": ["--train_file", folder / "squad.json", "--validation_file", folder / "squad.json", "--do_train",
                   "--do_eval", "--doc_stride", "32"],
    }[script]  # fmt: skip
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", folder / "sp.yaml", f"examples/{script}.py",
        "--model_name_or_path", folder / "long", *data, "--max_seq_length", "128", "--per_device_train_batch_size",
        "2", "--per_device_eval_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-3", "--use_cpu",
        "--report_to", "none", "--save_strategy", "no", "--output_dir", tmp_path / "out", "--logging_steps", "1",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert "Sequence parallelism over 2 ranks: every training batch padded to 128 tokens." in proc.stdout
    losses = [float(x) for x in re.findall(r"\{'loss': '([0-9.]+)'", proc.stdout)]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), proc.stdout[-3000:]
    metrics = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert metrics["eval_loss"] > 0
