"""Run transformers' own common model tests and generation tests on every hf_xformers class.

transformers' wheel ships no tests. Its PyPI sdist has ``tests/test_modeling_common.py`` but no ``tests/__init__.py``,
``tests/generation/`` nor ``tests/exporters/``, which ``test_modeling_common`` imports; a copy of transformers'
``tests/generation/test_utils.py`` (``GenerationTesterMixin``) and a stub of ``tests/exporters/test_export.py`` lie in
the team's ``shared/transformers-tests/`` (its README says which upstream file). Assemble a "checkout" from the sdist
of the installed release and that folder, then run::

    pip download --no-binary :all: --no-deps transformers==5.23.0 -d /tmp
    tar xzf /tmp/transformers-5.23.0.tar.gz -C /tmp
    cp -r ../shared/transformers-tests/. /tmp/transformers-5.23.0/tests/   # __init__.py, generation/, exporters/
    pip install pytest parameterized
    python scripts/run_transformers_tests.py /tmp/transformers-5.23.0 -p no:xdist                     # every class
    python scripts/run_transformers_tests.py /tmp/transformers-5.23.0 -p no:xdist -k HfxTransfoXLTest  # pytest args

(A git checkout of huggingface/transformers at the release's tag has all of it and works as it is.) For another
release, run it from a virtual environment holding that release (the checkout's tests must match the installed
transformers), e.g. 5.24.0 as ``make test-newest`` installs it::

    python3 -m venv /tmp/venv-524 && /tmp/venv-524/bin/pip install torch==2.13.0   # the CPU build
    echo torch==2.13.0 > /tmp/venv-524/torch-pin.txt
    /tmp/venv-524/bin/pip install -c /tmp/venv-524/torch-pin.txt -e ".[test]" transformers==5.24.0 parameterized
    /tmp/venv-524/bin/python scripts/run_transformers_tests.py /tmp/transformers-5.24.0 -p no:xdist

The harness (``scripts/transformers_tests/test_hfx_models.py``) imports ``tests.test_modeling_common`` and
``tests.generation.test_utils`` from the checkout, so it stays out of this project's suite (and out of ``make test``).
It runs under the checkout's pytest configuration, with the checkout's ``tests`` package and this repository's
``hf_xformers`` first on the path; the summary gives, per test class, the tests run, passed, skipped and failed (from
pytest's JUnit report).
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
NEEDED = (
    "pyproject.toml",
    "tests/test_modeling_common.py",
    "tests/__init__.py",
    "tests/generation/test_utils.py",
    "tests/exporters/test_export.py",
)


def check_checkout(checkout: Path) -> None:
    """A ``ValueError`` naming what is missing from ``checkout`` and how to complete it."""
    missing = [name for name in NEEDED if not (checkout / name).is_file()]
    if missing:
        raise ValueError(
            f"{checkout} lacks {', '.join(missing)}. Pass transformers' sdist of the installed release "
            f"(v{transformers.__version__}), unpacked, with the shared generation tests copied into its tests/ "
            f"(cp -r shared/transformers-tests/. {checkout}/tests/: __init__.py, generation/, exporters/), or a git "
            "checkout of huggingface/transformers at that tag; see this script's docstring."
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
    parser.add_argument(
        "checkout",
        type=Path,
        help="transformers' sdist with the shared generation tests in tests/, or a git checkout (see above)",
    )
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
    print(f"{'test class':36} {'run':>5} {'passed':>7} {'skipped':>8} {'failed':>7}")
    for test_class, c in sorted(counts.items()):
        print(f"{test_class:36} {c['run']:5} {c['passed']:7} {c['skipped']:8} {c['failed']:7}")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
