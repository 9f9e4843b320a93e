"""A module fixture's expensive work done once per test run, however pytest-xdist spreads the module's tests.

pytest-xdist sets a module fixture up in every worker that runs one of its tests, so a fixture that launches
processes for a minute or two (tests/test_sequence_parallel.py's torchrun launches, tests/test_gpu_check.py's dry run)
ran once per worker: measured on 2 workers, 190 s of launches where 100 s do. :func:`once_per_run` runs the work in
the first worker that asks and lets the others wait for its JSON result (xdist's documented pattern: a file lock in the
folder its workers share). Without xdist it is a plain call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def once_per_run(tmp_path_factory, name: str, compute: Callable[[Path], dict]) -> dict:
    """``compute(folder)`` once per run, its result read back as JSON in every worker.

    ``folder`` is ``name``'s own folder, shared by the run's workers; a ``compute`` that raises stores nothing, so the
    next worker that asks tries again (and fails the same way, with its own message).
    """
    base = tmp_path_factory.getbasetemp()
    # xdist: each worker's base is <run>/popen-gwN, and <run> belongs to this run only.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, result = shared / name, shared / name / "result.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not result.is_file():
            folder.mkdir(exist_ok=True)
            value = compute(folder)
            result.write_text(json.dumps(value))
    return json.loads(result.read_text())
