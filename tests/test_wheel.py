"""What a user gets from ``pip install``: the wheel, built here from the sdist as ``python -m build`` builds it.

It must hold every module of the package (the converters of ``hf_xformers/conversion/`` among them), the model-card
templates ``hf_xformers/model_cards/*.md`` that ``hf_xformers.card`` reads, and the console entry points of
pyproject.toml's ``[project.scripts]``, each naming a ``main`` that exists. ``make test-wheel`` goes further: it
installs the wheel into a clean virtual environment and runs the quickstart and every entry point from outside the
repository.
"""

from __future__ import annotations

import configparser
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hf_xformers"


def _missing_build_tools() -> str | None:
    for name in ("build", "setuptools"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install build setuptools)"
    return None


def source_copy(tmp_path_factory) -> Path:
    """The repository's files in a folder of this test's own: setuptools writes the sdist's tree
    (``hf_xformers-<version>/``) beside ``setup.py`` and deletes it after archiving, so two builds of one folder at once
    (this module's fixture on two pytest-xdist workers) delete each other's trees."""
    copy = tmp_path_factory.mktemp("source") / "hf_xformers"
    skip = shutil.ignore_patterns(".git", ".venv*", "site", "dist", "build", "*.egg-info", "hf_xformers-*", "__pycache__",
                                  ".hypothesis", ".pytest_cache", ".ruff_cache")  # fmt: skip
    shutil.copytree(REPO, copy, ignore=skip)
    return copy


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """``{"wheel": path, "sdist": path}``: the sdist, then the wheel built from it (about 4 s).

    ``--no-isolation`` builds with this environment's setuptools instead of downloading one.
    """
    reason = _missing_build_tools()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source_copy(tmp_path_factory))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_wheel_holds_every_module_and_the_card_templates(built):
    names = wheel_names(built["wheel"])
    modules = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert modules, "no package modules found"
    missing = sorted(modules - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    converters = {
        "hf_xformers/conversion/convert_roberta_to_long.py",
        "hf_xformers/conversion/convert_from_transformers.py",
    }
    assert converters <= names
    cards = {f"hf_xformers/model_cards/{p.name}" for p in (REPO / "model_cards").glob("*.md")}
    assert len(cards) == 8 and cards <= names, f"card templates missing: {sorted(cards - names)}"
    # Nothing of the repository's scripts or tests travels with the package.
    assert not [n for n in names if n.split("/")[0] in ("tests", "examples", "benchmarks", "conversion", "scripts")]


def test_wheel_declares_the_entry_points(built):
    with zipfile.ZipFile(built["wheel"]) as archive:
        (entry_file,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(entry_file).decode())
    scripts = dict(parser["console_scripts"])
    # tomllib is 3.11+; the [project.scripts] table is plain `name = "module:function"` lines.
    table = (REPO / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    declared = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', table, re.M))
    assert scripts == declared
    assert set(scripts) == {"hfx-convert", "hfx-import", "hfx-export"}
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), f"{name}: {target} is not callable"


def test_sdist_carries_what_the_wheel_is_built_from(built):
    with tarfile.open(built["sdist"]) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"setup.py", "pyproject.toml", "README.md"} <= names
    assert {f"model_cards/{p.name}" for p in (REPO / "model_cards").glob("*.md")} <= names
