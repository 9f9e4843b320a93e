"""``make gpu-check`` (scripts/gpu_check.py): the dry run on the CPU runs every step to the end, and the machinery
around the steps (wheels on the path, time limits, a failing step, the summary) does what it says.

The dry run is the same script with the same steps at tiny sizes (``--device cpu``), so that the GPU run cannot rot
unseen between the rare sessions on a GPU machine. Its limits are raised here (``--limit-scale``, ``--budget-s``):
this machine is shared, and a busy minute must not fail a test about plumbing; the real caps are checked by the
orchestration tests below.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from tests.once_per_run import once_per_run

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load_script()


# ----- the dry run ---------------------------------------------------------------------------------------------------


def _dry_run(out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    command = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--out", str(out)]
    command += ["--limit-scale", "8", "--budget-s", "1200"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    runs = list(out.glob("*-cpu"))
    assert len(runs) == 1, (runs, done.stdout[-3000:], done.stderr[-3000:])
    return {"run_dir": str(runs[0]), "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, dict, subprocess.CompletedProcess]:
    """``scripts/gpu_check.py --device cpu`` once for the test run: its run folder, summary.json and the process."""
    run = once_per_run(tmp_path_factory, "gpu_check_dry_run", _dry_run)
    run_dir = Path(run["run_dir"])
    done = subprocess.CompletedProcess("scripts/gpu_check.py", run["returncode"], run["stdout"], run["stderr"])
    return run_dir, json.loads((run_dir / "summary.json").read_text()), done


def test_dry_run_runs_every_step_ok(dry_run):
    run_dir, summary, done = dry_run
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == [s.name for s in gpu_check.STEPS]
    bad = {name: (s["status"], s["note"], s["log_tail"][-5:]) for name, s in steps.items() if s["status"] != "ok"}
    assert not bad, bad
    assert done.returncode == 0, done.stdout[-3000:]
    for name, step in steps.items():
        assert (run_dir / f"{name}.log").exists(), name
        assert step["figures"], f"{name}: no key figures in the summary"
    text = (run_dir / "summary.md").read_text()
    for name in steps:
        assert f"| {name} | ok |" in text and f"## {name}:" in text, name


def test_dry_run_figures_come_from_each_step(dry_run):
    run_dir, summary, _ = dry_run
    env = json.loads((run_dir / "environment" / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and not env["problems"], env
    assert env["torch_floor"] == gpu_check.pyproject_floor("torch")
    figures = {s["name"]: "\n".join(s["figures"]) for s in summary["steps"]}
    assert figures["conformance"].startswith("2 passed") and " 0 failed" in figures["conformance"]
    sweep = json.loads((run_dir / "attention_implementations" / "attention_implementations.json").read_text())
    cells = {(c["arch"], c["implementation"]) for c in sweep["cells"] if c["status"] == "ok"}
    archs = {"longformer", "bigbird", "linformer", "performer", "reformer", "transfo_xl", "universal", "swin"}
    assert {a for a, i in cells if i == "eager"} == archs
    assert {a for a, i in cells if i == "sdpa"} == archs
    flex = {"longformer", "bigbird", "reformer", "universal", "swin"}
    assert {a for a, i in cells if i == "flex_attention"} == flex
    # FlexAttention also on float32 inputs and at twice the head dim (the GPU kernels' shared-memory cases).
    ok = {(c["arch"], c["implementation"], c["precision"], c["head_dim"]) for c in sweep["cells"] if c["status"] == "ok"}  # fmt: skip
    head_dim = 32 // 4
    assert {(a, "flex_attention", "fp32", head_dim) for a in flex} <= ok
    assert {(a, "flex_attention", p, 2 * head_dim) for a in ("longformer", "bigbird") for p in ("bf16", "fp32")} <= ok
    assert "| longformer | train | 128 |" in figures["attention_switch"] and "MFU sdpa" in figures["attention_switch"]
    assert "| hfx|128|backward | ok |" in figures["long_context"] and "| MFU |" in figures["long_context"]
    assert "| packed | ok |" in figures["packing"] and "| padded | ok |" in figures["packing"]
    assert "| hfx-longformer |" in figures["learning"] and "| yes |" in figures["learning"]
    assert figures["sequence_parallel"].startswith("2 ranks on cpu: 1 of 1 (type, head, batch) cases ran")
    assert "LSH layer under bfloat16 autocast, seeded rotations: context " in figures["sequence_parallel"]
    assert "figures unreadable" not in (run_dir / "summary.md").read_text()
    learning = json.loads((run_dir / "learning" / "learning.json").read_text())
    assert learning["threshold"] == gpu_check.LEARNING_THRESHOLD
    assert all(c["accuracy"] >= learning["threshold"] for c in learning["cells"])
    # The summary's MFU column: the best cell of each step that times training steps.
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["attention_switch"]["mfu"].endswith("(longformer sdpa 128)"), steps["attention_switch"]["mfu"]
    assert steps["long_context"]["mfu"].endswith("(hfx|128|backward)") and steps["packing"]["mfu"] == "-"
    assert "| MFU (best cell) |" in (run_dir / "summary.md").read_text()


# ----- the machinery around the steps ------------------------------------------------------------------------------


def _fake_wheel(folder: Path, name: str, version: str, tags: str = "py3-none-any") -> Path:
    """A wheel of package ``name`` whose ``__version__`` is ``version``, with its dist-info."""
    path = folder / f"{name}-{version}-{tags}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", f"__version__ = {version!r}\n")
        archive.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")  # fmt: skip
        archive.writestr(f"{name}-{version}.dist-info/RECORD", "")
    return path


def test_newer_wheels_go_on_the_path_ahead_of_site_packages(tmp_path):
    """A wheel newer than what is installed (or not installed at all) is unpacked and imported instead; an older one,
    or one built for another interpreter, is left out."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "transformers", "999.0.0")
    _fake_wheel(wheels, "hfx_absent_package", "1.0")
    _fake_wheel(wheels, "torch", "1.0.0")
    _fake_wheel(wheels, "tokenizers", "999.0", "cp27-cp27mu-manylinux1_x86_64")
    choices = {c.name: c for c in gpu_check.choose_wheels(wheels)}
    assert choices["transformers"].used and choices["hfx_absent_package"].used
    assert not choices["torch"].used and "as new" in choices["torch"].reason
    assert not choices["tokenizers"].used and "not this interpreter" in choices["tokenizers"].reason
    unpacked = [gpu_check.unpack_wheel(c.path, tmp_path / "cache") for c in choices.values() if c.used]
    env = gpu_check.step_environment(unpacked)
    # The module and its metadata (what transformers' own version checks read) both come from the wheel.
    code = "import importlib.metadata as m, transformers; print(transformers.__version__, m.version('transformers'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["999.0.0", "999.0.0"], out.stderr[-2000:]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)


def test_unmet_requirements_name_the_library(tmp_path, monkeypatch):
    dist = tmp_path / "hfx_needy-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: hfx_needy\nVersion: 1.0\nRequires-Dist: torch>=999\nRequires-Dist: packaging>=1\n"
        'Requires-Dist: hfx-never-installed; extra == "docs"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gpu_check.unmet_requirements("hfx_needy") == [f"hfx_needy 1.0 needs torch>=999, found {torch.__version__}"]


def test_version_tuple_and_floors():
    assert gpu_check.version_tuple("2.11.0+cu128") == (2, 11, 0)
    assert gpu_check.version_tuple("5.18.0rc1") == (5, 18, 0)
    assert gpu_check.version_tuple("2.11.0") >= gpu_check.version_tuple(gpu_check.pyproject_floor("torch"))
    assert gpu_check.pyproject_floor("transformers") == "5.18"
    with pytest.raises(ValueError, match="no floor"):
        gpu_check.pyproject_floor("hfx-not-a-dependency")


def _python_step(name: str, code: str, limit: float, module: str | None = None, flags: tuple = ()):
    return gpu_check.Step(
        name, f"test step {name}", {"cpu": limit, "cuda": limit}, lambda ctx, d: [ctx.python, "-c", code],
        lambda d, log: [line for line in log.splitlines() if line.startswith("figure")], module=module, flags=flags,
    )  # fmt: skip


def test_a_failing_or_slow_step_does_not_stop_the_others(tmp_path, monkeypatch):
    """A step that fails, one past its limit (killed with the processes it started), one whose benchmark lacks a flag
    it needs, and one that works: each is reported, in order, and the run exits 1."""
    marker = tmp_path / "grandchild.pid"
    slow = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); open({str(marker)!r}, 'w').write(str(p.pid)); "
        "print('figure: started', flush=True); time.sleep(60)"
    )  # fmt: skip
    steps = [
        _python_step("fails", "import sys; print('figure: before failing'); sys.exit(3)", 20),
        _python_step("slow", slow, 5),
        _python_step(
            "lacks_flag", "print('never runs')", 20, "benchmarks/benchmark_packing.py", ("--hfx-no-such-flag",)
        ),
        _python_step("works", "print('figure: 42')", 20),
    ]
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    start = time.perf_counter()
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--budget-s", "60"])
    assert code == 1 and time.perf_counter() - start < 30
    (run_dir,) = tmp_path.glob("*-cpu")
    summary = json.loads((run_dir / "summary.json").read_text())
    results = {s["name"]: s for s in summary["steps"]}
    assert [s["name"] for s in summary["steps"]] == ["fails", "slow", "lacks_flag", "works"]
    assert results["fails"]["status"] == "failed" and results["fails"]["returncode"] == 3
    assert results["fails"]["figures"] == ["figure: before failing"]
    assert results["slow"]["status"] == "timeout" and results["slow"]["figures"] == ["figure: started"]
    assert results["lacks_flag"]["status"] == "not run" and "--hfx-no-such-flag" in results["lacks_flag"]["note"]
    assert results["works"]["status"] == "ok" and results["works"]["figures"] == ["figure: 42"]
    grandchild = int(marker.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    assert "| slow | timeout |" in (run_dir / "summary.md").read_text()


def test_the_global_cap_leaves_later_steps_their_share(tmp_path, monkeypatch):
    """Under a cap that cannot hold every step's own limit, a step gets what is left after the minimum kept for each
    later one, and a step the cap leaves no time for is reported as not run."""
    steps = [_python_step(f"s{i}", "print('figure: ran')", 100) for i in range(3)]
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    monkeypatch.setitem(gpu_check.MIN_STEP_S, "cpu", 4.0)
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--budget-s", "11"]) == 0
    (run_dir,) = tmp_path.glob("*-cpu")
    limits = [s["limit_s"] for s in json.loads((run_dir / "summary.json").read_text())["steps"]]
    assert 2.0 <= limits[0] <= 11 - 2 * 4.0 and all(limit >= 2.0 for limit in limits), limits
    monkeypatch.setitem(gpu_check.MIN_STEP_S, "cpu", 40.0)
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path / "b"), "--budget-s", "10"]) == 1
    (run_dir,) = (tmp_path / "b").glob("*-cpu")
    statuses = {
        s["name"]: (s["status"], s["note"]) for s in json.loads((run_dir / "summary.json").read_text())["steps"]
    }
    assert statuses["s0"] == ("not run", "global time cap reached"), statuses


def test_a_step_that_ends_early_leaves_its_time_to_the_next(tmp_path, monkeypatch):
    """Each step's command sees its own limit (the budget of its cells); seconds a step leaves unused go to the next."""

    def step(name: str, limit: float):
        code = lambda ctx, d: [ctx.python, "-c", f"print('figure: limit {ctx.limit_s:.0f}')"]  # noqa: E731
        return gpu_check.Step(name, name, {"cpu": limit, "cuda": limit}, code,
                              lambda d, log: [x for x in log.splitlines() if x.startswith("figure")])  # fmt: skip

    monkeypatch.setattr(gpu_check, "STEPS", [step("quick", 60), step("next", 20)])
    monkeypatch.setitem(gpu_check.MIN_STEP_S, "cpu", 1.0)
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--budget-s", "200"]) == 0
    (run_dir,) = tmp_path.glob("*-cpu")
    steps = {s["name"]: s for s in json.loads((run_dir / "summary.json").read_text())["steps"]}
    assert steps["quick"]["figures"] == ["figure: limit 60"]
    assert steps["next"]["limit_s"] > 20 + 60 - steps["quick"]["seconds"] - 5, steps
    assert steps["next"]["figures"] == [f"figure: limit {steps['next']['limit_s']:.0f}"]


def test_gpu_steps_fit_the_cap_and_pass_budgets_to_their_cells():
    """On CUDA the steps' own limits fit the global cap, and every step that runs a list of cells gets a budget
    inside its limit (it then skips and reports the cells it cannot start, rather than being killed)."""
    assert sum(step.limit_s["cuda"] for step in gpu_check.STEPS) <= gpu_check.GLOBAL_CAP_S["cuda"]
    ctx = gpu_check.Context("cuda", Path("/nonexistent"), sys.executable, 90.0)
    budgets = {}
    for step in gpu_check.STEPS:
        argv = step.argv(ctx, Path("/nonexistent/step"))
        if "--budget-s" in argv:
            budgets[step.name] = float(argv[argv.index("--budget-s") + 1])
    assert {"attention_implementations", "attention_switch", "long_context", "learning"} <= set(budgets)
    assert all(90 / 3 <= b <= 90 - gpu_check.CELL_MARGIN_S["cuda"] for b in budgets.values()), budgets
    argv = gpu_check.long_context_argv(ctx, Path("x"))
    assert argv[argv.index("--lengths") + 1 : argv.index("--lengths") + 3] == ["32768", "--impls"]  # 32k only


def test_sweep_cells_put_the_new_flex_cases_last():
    supporting = {"longformer": (True, True), "linformer": (True, False), "swin": (True, True)}
    cells = gpu_check.sweep_cells(supporting)
    assert cells[:3] == [(a, "eager", "bf16", 1) for a in supporting]
    assert cells[-4:] == [
        ("longformer", "flex_attention", "fp32", 1), ("swin", "flex_attention", "fp32", 1),
        ("longformer", "flex_attention", "bf16", 2), ("longformer", "flex_attention", "fp32", 2),
    ]  # fmt: skip
    assert not any(a == "linformer" and i == "flex_attention" for a, i, _, _ in cells)


def test_learning_check_fails_below_its_threshold(tmp_path, monkeypatch):
    """The threshold is asserted: a model that cannot learn (learning rate 0) stays near chance and fails the step."""
    ids, labels = gpu_check.learning_batch(400, 64, torch.Generator().manual_seed(0))
    assert ids.shape == (400, 64) and set(labels.tolist()) == set(range(gpu_check.LEARNING_CLASSES))
    marked = ids >= 100
    assert 0.2 < marked.float().mean() < 0.3 and torch.equal(ids.max(1).values, 100 + 50 * labels)
    sizes = dict(gpu_check.LEARNING_SIZES["cpu"], steps=2, lr=0.0, eval=64)
    monkeypatch.setitem(gpu_check.LEARNING_SIZES, "cpu", sizes)
    assert gpu_check.learning_worker("cpu", tmp_path) == 1
    (cell,) = json.loads((tmp_path / "learning.json").read_text())["cells"]
    assert cell["status"] == "below threshold" and cell["accuracy"] < gpu_check.LEARNING_THRESHOLD
    (tmp_path / "none").mkdir()
    assert gpu_check.learning_worker("cpu", tmp_path / "none", budget_s=-1) == 0  # nothing started: nothing failed
    (skipped,) = json.loads((tmp_path / "none" / "learning.json").read_text())["cells"]
    assert skipped["status"] == gpu_check.SKIPPED
