"""Run transformers' own common model tests and generation tests on every hf_xformers class.

transformers' wheel ships no tests, so this needs a transformers checkout at the tag of the installed release::

    git clone --depth 1 --branch v5.23.0 https://github.com/huggingface/transformers /tmp/transformers-5.23.0
    pip install pytest parameterized
    python scripts/run_transformers_tests.py /tmp/transformers-5.23.0                     # every class
    python scripts/run_transformers_tests.py /tmp/transformers-5.23.0 -k HfxTransfoXLTest  # pytest arguments pass on

The harness (``scripts/transformers_tests/test_hfx_models.py``) imports ``tests.test_modeling_common`` and
``tests.generation.test_utils`` from the checkout, so it stays out of this project's suite. It runs under the
checkout's pytest configuration, with the checkout's ``tests`` package and this repository's ``hf_xformers`` first on
the path; the summary gives, per test class, the tests run, passed, skipped and failed (from pytest's JUnit report).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import transformers

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "scripts" / "transformers_tests" / "test_hfx_models.py"
NEEDED = ("tests/__init__.py", "tests/test_modeling_common.py", "tests/generation/test_utils.py", "pyproject.toml")


def check_checkout(checkout: Path) -> None:
    """A ``ValueError`` naming what is missing from ``checkout``."""
    missing = [name for name in NEEDED if not (checkout / name).is_file()]
    if missing:
        raise ValueError(
            f"{checkout} lacks {', '.join(missing)}: pass a git checkout of huggingface/transformers at the tag of "
            f"the installed release (v{transformers.__version__}); the PyPI sdist lacks tests/generation/."
        )


def summarise(junit: Path) -> dict[str, collections.Counter]:
    """Per test class: how many tests ran, passed, were skipped and failed (errors count as failures)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        if case.find("skipped") is not None:
            outcome = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        test_class = case.get("classname", "").rsplit(".", 1)[-1]
        counts[test_class]["run"] += 1
        counts[test_class][outcome] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a transformers git checkout at the installed release's tag")
    args, pytest_args = parser.parse_known_args(argv)
    checkout = args.checkout.resolve()
    check_checkout(checkout)
    path = [str(checkout), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(path))
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable, "-m", "pytest", str(HARNESS), "--rootdir", str(checkout), "-c", str(checkout / "pyproject.toml"),
            "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={junit}", *pytest_args,
        ]  # fmt: skip
        returncode = subprocess.call(command, cwd=checkout, env=env)
        if not junit.is_file():
            return returncode
        counts = summarise(junit)
    print(f"\ntransformers {transformers.__version__}, tests of {checkout}")
    print(f"{'test class':32} {'run':>5} {'passed':>7} {'skipped':>8} {'failed':>7}")
    for test_class, c in sorted(counts.items()):
        print(f"{test_class:32} {c['run']:5} {c['passed']:7} {c['skipped']:8} {c['failed']:7}")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
