"""The Long Range Arena harness (benchmarks/lra): every task with every architecture in smoke mode, the table and
plot, resuming, and bad command lines. The data generators and readers are tested in tests/test_lra_data.py."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.lra import run as lra
from benchmarks.lra.data import TASKS
from benchmarks.lra.models import ARCHS, VISION_ARCHS, build_model

# The smoke run in two halves, so that two test workers share it (about three minutes in one).
SMOKE_GROUPS = {"sequences": ("listops", "text", "retrieval"), "images": ("image", "pathfinder")}


@pytest.mark.parametrize("group", list(SMOKE_GROUPS))
def test_smoke_every_task_with_every_architecture(group, tmp_path, monkeypatch):
    """One CLI call trains and evaluates every task of ``group`` with all 8 architectures (Swin only on the two image
    tasks), writes one JSON per cell, the table and the plot; a second call reruns nothing."""
    tasks = SMOKE_GROUPS[group]
    assert set().union(*SMOKE_GROUPS.values()) == set(TASKS)
    out = tmp_path / "lra"
    assert lra.main(["--smoke", "--task", *tasks, "--arch", "all", "--out", str(out), "--no_progress"]) == 0
    cells = {p.stem: json.loads(p.read_text()) for p in (out / "cells").glob("*.json")}
    assert len(cells) == len(tasks) * len(ARCHS)
    for task in tasks:
        for arch in ARCHS:
            cell = cells[f"{task}__{arch}"]
            if arch in VISION_ARCHS and task not in ("image", "pathfinder"):
                assert "vision model" in cell["skipped"]
                continue
            assert 0.0 <= cell["test_accuracy"] <= 1.0 and cell["steps"] == 2, (task, arch)
            assert cell["steps_per_second"] > 0 and cell["peak_rss_mib"] > 0 and cell["parameters"] > 0
    table = (out / "lra_results.md").read_text()
    assert "majority class" in table and "LRA Table 1" in table and (out / "lra_results.png").stat().st_size > 1000
    # Swin (a vision model) has a row where an image task ran, none where it ran none.
    assert ("| hfx-swin (2-D image) |" in table) == (group == "images")
    if group != "sequences":
        return

    calls = []
    monkeypatch.setattr(lra, "run_cell", lambda task, arch, args: calls.append(arch) or {"task": task, "arch": arch, "skipped": "-"})
    lra.main(["--smoke", "--task", "listops", "--arch", "hfx-bigbird", "--out", str(out), "--no_progress"])
    assert calls == []  # finished with the same settings: not rerun
    lra.main(["--smoke", "--task", "listops", "--arch", "hfx-bigbird", "--out", str(out), "--no_progress", "--seed", "1"])
    assert len(calls) == 1  # other settings: rerun


def test_same_seed_same_model_and_every_knob_listed():
    a, settings = build_model("hfx-longformer", "listops", vocab_size=20, length=1000, num_labels=10)
    b, _ = build_model("hfx-longformer", "listops", vocab_size=20, length=1000, num_labels=10)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert settings["attention_window"] < 1000 and settings["layers"] == 2 and settings["hidden"] == 64
    lra_size = build_model("hfx-bigbird", "retrieval", vocab_size=257, length=512, num_labels=2, two_tower=True,
                           setting="lra")[1]  # fmt: skip
    assert (lra_size["layers"], lra_size["hidden"], lra_size["heads"]) == (4, 128, 4)


def test_bad_command_lines_and_inputs_are_refused(capsys):
    for argv, message in (
        (["--task", "sudoku"], "unknown task"),
        (["--arch", "hfx-gpt"], "unknown architecture"),
        (["--data_dir", "lra_release/listops"], "TASK=DIR"),
        (["--option", "hub_dataset=imdb"], "TASK.KEY=VALUE"),
    ):
        with pytest.raises(SystemExit):
            lra.parse_args(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="vision model"):
        build_model("hfx-swin", "listops", vocab_size=20, length=100, num_labels=10)
    with pytest.raises(ValueError, match="setting"):
        build_model("hfx-bigbird", "listops", vocab_size=20, length=100, num_labels=10, setting="huge")


def test_bf16_flags_train_and_evaluate_in_the_asked_precision(tmp_path, monkeypatch):
    """--dtype bfloat16 trains bfloat16 weights; --autocast keeps float32 weights under Trainer's bf16 autocast. Each
    cell records its precision, the table states it, and the cells are not mistaken for float32 ones."""
    import transformers

    seen = []
    real_trainer = transformers.Trainer

    def watching_trainer(*args, **kwargs):
        model = kwargs["model"]
        seen.append((next(model.parameters()).dtype, kwargs["args"].bf16))
        return real_trainer(*args, **kwargs)

    monkeypatch.setattr(transformers, "Trainer", watching_trainer)
    for extra, expected in (([], (torch.bfloat16, False)), (["--autocast"], (torch.float32, True))):
        out = tmp_path / ("autocast" if extra else "pure")
        argv = ["--smoke", "--task", "image", "--arch", "hfx-swin", "--out", str(out), "--no_progress",
                "--dtype", "bfloat16", *extra]  # fmt: skip
        assert lra.main(argv) == 0
        assert seen[-1] == expected
        cell = json.loads((out / "cells" / "image__hfx-swin.json").read_text())
        assert (cell["dtype"], cell["autocast"]) == ("bfloat16", bool(extra)) and 0.0 <= cell["test_accuracy"] <= 1.0
        table = (out / "lra_results.md").read_text()
        training = "autocast bfloat16, fp32 weights" if extra else "pure bfloat16: bfloat16 weights, no autocast"
        assert f"Precision: dtype: {training} (training and evaluation)." in table
    fp32, bf16 = lra.parse_args(["--smoke"]), lra.parse_args(["--smoke", "--dtype", "bfloat16", "--autocast"])
    assert lra.cell_key("listops", "hfx-bigbird", fp32) != lra.cell_key("listops", "hfx-bigbird", bf16)
    assert lra.parse_args(["--dtype", "bfloat16", "--autocast"]).out == lra.RESULTS.with_name("lra_bf16_autocast")
    assert lra.parse_args([]).out == lra.RESULTS
    with pytest.raises(SystemExit):
        lra.parse_args(["--autocast"])  # autocast to float32 means nothing
