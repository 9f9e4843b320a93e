"""Command lines that help: every CLI's ``--help`` opens with a one-paragraph description and shows the defaults, the
Trainer scripts list their own options before ``TrainingArguments``' hundred, and a wrong ``--model_name_or_path``
ends a script with one line that names it (no traceback).

Everything runs in this process through each module's ``main`` (``sys.argv`` patched), so no model is built.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from examples.utils_examples import model_source_error  # noqa: E402

# Every command line of the package and of the repository.
PACKAGE_CLIS = [
    "hf_xformers.conversion.convert_roberta_to_long",
    "hf_xformers.conversion.convert_from_transformers",
    "hf_xformers.export",
    "hf_xformers.card",
]
EXAMPLE_CLIS = [
    "examples.run_glue",
    "examples.run_wikihop",
    "examples.run_mlm",
    "examples.run_clm",
    "examples.run_image_classification",
    "examples.embed_long_documents",
    "examples.run_algorithmic_task",
    "examples.run_long_demo",
]
BENCHMARK_CLIS = [
    "benchmarks.benchmark_attention_switch",
    "benchmarks.benchmark_long_context",
    "benchmarks.benchmark_packing",
    "benchmarks.benchmark_performer_decoding",
    "benchmarks.benchmark_reformer_depth",
    "benchmarks.benchmark_swin",
    "benchmarks.benchmark_transfo_xl",
    "benchmarks.continued_pretraining",
    "benchmarks.lra.run",
]
# The Trainer scripts (HfArgumentParser): an option of their own, which --help lists before TrainingArguments'.
TRAINER_SCRIPTS = {
    "examples.run_glue": "--task_name",
    "examples.run_wikihop": "--max_chunks_per_example",
    "examples.run_mlm": "--model_name_or_path",
    "examples.run_clm": "--model_name_or_path",
    "examples.run_image_classification": "--model_name_or_path",
}
# What each Trainer script needs besides the model for its options to parse (the model is checked after that).
REQUIRED = {"examples.run_glue": ["--task_name", "rte"], "examples.run_clm": ["--train_file", "train.txt"]}


def run_main(module: str, argv: list[str], monkeypatch) -> int:
    """``module.main()`` with ``sys.argv`` set to ``argv``; the exit status it ends with (0 if it returns)."""
    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module.rpartition(".")[2], *argv])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code or 0


def help_sections(text: str) -> list[str]:
    """The blank-line-separated blocks of a ``--help`` text."""
    return [block for block in re.split(r"\n\s*\n", text.strip()) if block.strip()]


@pytest.mark.parametrize("module", PACKAGE_CLIS + EXAMPLE_CLIS + BENCHMARK_CLIS)
def test_help_starts_with_a_description_and_shows_defaults(module, monkeypatch, capsys):
    assert run_main(module, ["--help"], monkeypatch) == 0
    text = capsys.readouterr().out
    blocks = help_sections(text)
    assert blocks[0].startswith("usage:") and len(blocks[0].splitlines()) <= 12, "a usage line, not a wall of options"
    description = " ".join(blocks[1].split())
    assert not description.startswith(("options:", "-")), f"{module} --help shows no description:\n{text[:800]}"
    assert len(description.split()) >= 8 and description.endswith((".", ")", ":")), description
    assert "(default: " in text, f"{module} --help shows no defaults"


@pytest.mark.parametrize("module", sorted(TRAINER_SCRIPTS))
def test_trainer_scripts_list_their_own_options_first(module, monkeypatch, capsys):
    run_main(module, ["--help"], monkeypatch)
    text = capsys.readouterr().out
    own, trainer = text.index(f"  {TRAINER_SCRIPTS[module]} "), text.index("  --learning_rate ")
    assert own < trainer, f"{module}: the script's options come after TrainingArguments'"
    # The description opens with the docstring's first paragraph; the rest of the docstring follows the options.
    first = " ".join(importlib.import_module(module).__doc__.strip().split("\n\n")[0].split())
    assert " ".join(help_sections(text)[1].split()).startswith(first)


@pytest.mark.parametrize("module", sorted(TRAINER_SCRIPTS))
def test_a_wrong_model_path_is_one_line_naming_it(module, tmp_path, monkeypatch, capsys):
    for wrong, says in [("no/such/folder", "no such folder"), (str(tmp_path), "holds no config.json")]:
        argv = ["--model_name_or_path", wrong, "--output_dir", str(tmp_path / "out"), *REQUIRED.get(module, [])]
        assert run_main(module, argv, monkeypatch) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "Traceback" not in error, error
        assert repr(wrong) in error and says in error and "expected a checkpoint folder" in error, error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("module", "option"), [("examples.embed_long_documents", "--model"),
                                                ("examples.run_long_demo", "--source")])  # fmt: skip
def test_a_wrong_model_folder_of_the_argparse_examples(module, option, monkeypatch, capsys):
    assert run_main(module, [option, "no/such/folder"], monkeypatch) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"{option} 'no/such/folder': no such folder" in error


def test_model_source_error(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert model_source_error(str(tmp_path / "model")) is None
    assert "is a file" in model_source_error(str(tmp_path / "model" / "config.json"))
    # Offline, a Hub id counts only when its config is in the local cache.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert "not in the local cache while HF_HUB_OFFLINE" in model_source_error("some-org/some-model")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    assert model_source_error("some-org/some-model") is None
