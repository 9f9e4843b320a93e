"""The documentation's examples run, so the reference and the guides cannot drift from the code.

* Every ``>>>`` example in a docstring of ``hf_xformers`` (``doctest``, one test per docstring): the API pages render
  these docstrings, so what a page shows is what this test ran. Every public model and head class has one.
* Every Python block of a ``docs/`` page marked runnable: an HTML comment ``<!-- runnable -->`` on the line before the
  opening fence (invisible on the site). Such a block must stand alone (no files, no Hub): it runs in a fresh
  namespace in an empty working directory.

Each example builds a tiny model from a config (hidden size <= 64), so all of them together take seconds.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import time
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

import hf_xformers

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RUNNABLE = "<!-- runnable -->"
# CPU seconds one docstring's examples may take: a tiny config runs in well under a second, a forgotten default
# (a 4,096-position table, 12 layers) takes far longer and would slow the suite for every run.
EXAMPLE_CPU_SECONDS = 10.0
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
MARKED_BLOCK = re.compile(rf"{re.escape(RUNNABLE)}[ \t]*\n```python\n(.*?)^```", re.S | re.M)


def package_modules() -> list:
    """Every module of the package (the old module paths of ``moved_modules`` are the same objects)."""
    names = sorted(info.name for info in pkgutil.walk_packages(hf_xformers.__path__, "hf_xformers."))
    return [importlib.import_module(name) for name in names]


def docstring_examples() -> dict[str, doctest.DocTest]:
    """``{qualified name: DocTest}`` of every docstring in the package that holds a ``>>>`` example."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {}
    for module in package_modules():
        for test in finder.find(module):
            if test.examples:
                found.setdefault(test.name, test)
    return found


def runnable_blocks() -> dict[str, str]:
    """``{"page.md:line": code}`` of every Python block marked runnable in ``docs/``."""
    blocks = {}
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        marked = list(MARKED_BLOCK.finditer(text))
        assert len(marked) == text.count(RUNNABLE), (
            f"{page.relative_to(REPO)}: every {RUNNABLE} marker must sit on the line before a ```python fence"
        )
        for match in marked:
            line = text[: match.start()].count("\n") + 2  # the fence's line
            blocks[f"{page.relative_to(DOCS).as_posix()}:{line}"] = match.group(1)
    return blocks


EXAMPLES = docstring_examples()
BLOCKS = runnable_blocks()


def public_model_classes() -> list[type]:
    """The exported classes users call: every model and head (``PreTrainedModel`` subclasses other than the
    ``*PreTrainedModel`` bases, which only hold what their models share)."""
    return [
        obj
        for name in hf_xformers.__all__
        if isinstance(obj := getattr(hf_xformers, name), type)
        and issubclass(obj, PreTrainedModel)
        and not name.endswith("PreTrainedModel")
    ]


def test_every_public_model_and_head_has_an_example():
    classes = public_model_classes()
    assert len(classes) >= 40
    missing = [cls.__name__ for cls in classes if f"{cls.__module__}.{cls.__qualname__}" not in EXAMPLES]
    assert not missing, f"model and head classes without an Examples section (>>>) in their docstring: {missing}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example(name):
    test = EXAMPLES[name]
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    report: list[str] = []
    torch.manual_seed(0)
    start = time.process_time()
    result = runner.run(test, out=report.append)
    seconds = time.process_time() - start
    assert result.failed == 0, "".join(report)
    assert result.attempted > 0
    assert seconds < EXAMPLE_CPU_SECONDS, f"{name}: its examples took {seconds:.1f} s of CPU; shrink the config"


@pytest.mark.parametrize("where", sorted(BLOCKS))
def test_runnable_guide_block(where, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    exec(compile(BLOCKS[where], str(DOCS / where.split(":")[0]), "exec"), {"__name__": "guide_block"})


def test_runnable_markers_are_found():
    """The guide pages hold runnable blocks, and a failing example fails its test (the runner is not a no-op)."""
    assert BLOCKS, f"no docs/ page marks a block {RUNNABLE}"
    broken = doctest.DocTestParser().get_doctest(">>> 1 + 1\n3\n", {}, "broken", None, 0)
    assert doctest.DocTestRunner(optionflags=OPTIONS).run(broken, out=lambda text: None).failed == 1
