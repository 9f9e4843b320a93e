"""Does the generative test of packed batches catch what it guards? Apply known bugs to a copy of the package and run
``tests/test_packing_fuzz.py`` (its ``ci`` profile, what ``make test`` runs) against each: every mutant must fail it.

Each mutant replaces one exact piece of the package's code (the piece must occur once, or the script stops: the code
moved and the mutant must follow it). The package and the tests are copied to a temporary folder per mutant; the
working tree is never touched. The unmutated copy runs first and must pass. Prints a table (mutant, killed, seconds)
and exits 1 when a mutant survives::

    python scripts/mutation_check.py                    # every mutant (about a minute each on two cores)
    python scripts/mutation_check.py --only early-boundary --keep
    make mutation-check
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What the fuzz test needs of the repository: the package, the tests (conformance suites, fixtures, conftest) and the
# pytest configuration.
COPIED = ("hf_xformers", "tests", "pyproject.toml")
FUZZ_TEST = "tests/test_packing_fuzz.py"
PACKING = "hf_xformers/ops/packing.py"


@dataclass(frozen=True)
class Mutant:
    """``old`` (one exact occurrence in ``path``) replaced by ``new``: a plausible bug of the packing code."""

    name: str
    what: str
    path: str
    old: str
    new: str


MUTANTS = (
    Mutant(
        "early-boundary",
        "seq_idx: every document boundary one token early",
        PACKING,
        "    run_starts = torch.cat([torch.ones_like(labels[:, :1], dtype=torch.bool), changes], dim=-1)\n",
        "    first = torch.ones_like(labels[:, :1], dtype=torch.bool)\n"
        "    run_starts = torch.cat([first, changes[:, 1:], torch.zeros_like(first)], dim=-1)\n",
    ),
    Mutant(
        "late-cu-boundary",
        "cu_seq_lens: every boundary after the first one token late",
        PACKING,
        "index_fill(0, cu[:-1], True)",
        "index_fill(0, (cu[:-1] + (cu[:-1] > 0).long()).clamp(max=length - 1), True)",
    ),
    Mutant(
        "positions-not-reset",
        "each document's positions count on from the row's start",
        PACKING,
        "    return index - first\n",
        "    return index\n",
    ),
    Mutant(
        "padding-starts-document",
        "padding after a document starts a document of its own",
        PACKING,
        "    starts = run_starts if real is None else run_starts & real\n",
        "    starts = run_starts\n",
    ),
    Mutant(
        "longformer-globals-first-document",
        "Longformer's default global <s> of the second and later documents dropped (sequence classification)",
        "hf_xformers/models/longformer/modeling_longformer.py",
        "            global_attention_mask = packed.starts\n",
        "            global_attention_mask = packed.starts & (packed.index == 0)\n",
    ),
    Mutant(
        "previous-token-not-previous-real",
        "positions compared with the previous token, not the previous real token (where positions are still read "
        "since issue 51: the warning that a single row's positions restart without boundaries)",
        PACKING,
        "    if real is None:\n"
        "        falls = position_ids[:, 1:] < position_ids[:, :-1]\n"
        "        return torch.cat([torch.zeros_like(falls[:, :1]), falls], dim=-1)\n",
        "    falls = position_ids[:, 1:] < position_ids[:, :-1]\n"
        "    falls = torch.cat([torch.zeros_like(falls[:, :1]), falls], dim=-1)\n"
        "    return falls if real is None else falls & real\n",
    ),
    Mutant(
        "refuse-multi-document",
        "eager mode refuses every packed batch of several documents",
        PACKING,
        "    return _packed_from_runs(document_ids, run_starts, real, cu, count, longest)\n",
        "    packed = _packed_from_runs(document_ids, run_starts, real, cu, count, longest)\n"
        "    if packed is not None and not is_tracing() and (packed.count or 0) > 1:\n"
        '        refuse_packed("This model", "it holds several documents", "Pad the batch instead.")\n'
        "    return packed\n",
    ),
)


def copy_package(into: Path) -> None:
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, into / name)


def apply(mutant: Mutant, root: Path) -> None:
    """Write ``mutant`` into the copy at ``root``; a ``ValueError`` unless its piece occurs exactly once."""
    path = root / mutant.path
    text = path.read_text(encoding="utf-8")
    found = text.count(mutant.old)
    if found != 1:
        raise ValueError(f"mutant {mutant.name}: its code occurs {found} times in {mutant.path} (must be once)")
    path.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")


def run_fuzz_test(root: Path, pytest_args: list[str]) -> tuple[int, float, str]:
    """``tests/test_packing_fuzz.py`` under the ``ci`` profile in the copy at ``root`` (its package imported, not the
    installed one): ``(returncode, seconds, last lines)``."""
    env = dict(os.environ, PYTHONPATH=str(root), HYPOTHESIS_PROFILE="ci", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-x", FUZZ_TEST]
    started = time.perf_counter()
    done = subprocess.run([*command, *pytest_args], cwd=root, env=env, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    # What failed: the first error line of pytest's report (what caught the mutant), else the last lines.
    why = [line for line in lines if line.lstrip("E |+").startswith(("AssertionError", "ValueError", "RuntimeError"))]
    why = why[:1] or lines[-3:]
    return done.returncode, time.perf_counter() - started, "\n".join(why)


def check_imports_the_copy(root: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(root))
    where = subprocess.run(
        [sys.executable, "-c", "import hf_xformers; print(hf_xformers.__file__)"], cwd=root, env=env,
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"the copy imports hf_xformers from {where}, not from {root}")


def trial(mutant: Mutant | None, pytest_args: list[str], keep: bool) -> tuple[int, float, str]:
    """Copy, mutate (None: the unmutated package) and run the fuzz test; the temporary folder is removed unless
    ``keep``."""
    root = Path(tempfile.mkdtemp(prefix=f"mutant-{mutant.name if mutant else 'none'}-"))
    try:
        copy_package(root)
        check_imports_the_copy(root)
        if mutant is not None:
            apply(mutant, root)
        return run_fuzz_test(root, pytest_args)
    finally:
        if keep:
            print(f"  (kept {root})")
        else:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTANTS], help="run these mutants only")
    parser.add_argument("--keep", action="store_true", help="keep each mutated copy (its path is printed)")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run the unmutated copy first")
    args, pytest_args = parser.parse_known_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if not args.skip_baseline:
        code, seconds, tail = trial(None, pytest_args, args.keep)
        print(f"unmutated package: {'passes' if code == 0 else 'FAILS'} ({seconds:.0f} s)")
        if code != 0:
            print(tail)
            return 2
    rows = []
    for mutant in mutants:
        code, seconds, tail = trial(mutant, pytest_args, args.keep)
        killed = "yes" if code == 1 else ("no" if code == 0 else f"error (pytest exit {code})")
        rows.append((mutant.name, killed, seconds))
        print(f"{mutant.name}: {killed} ({seconds:.0f} s)  {mutant.what}\n  {tail.strip()[:300]}", flush=True)
    width = max(len(name) for name, _, _ in rows)
    print(f"\n| {'mutant':{width}} | killed | seconds |\n|{'-' * (width + 2)}|--------|---------|")
    for name, killed, seconds in rows:
        print(f"| {name:{width}} | {killed:6} | {seconds:7.0f} |")
    return 0 if all(killed == "yes" for _, killed, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
