"""The commands of examples/README.md, run as a new user runs them on a machine without a GPU.

Every fenced shell command of the README that runs an example script (``python -m examples.<script>``, and the
conversion one of them builds on, ``hfx-convert``: a console entry point, run through the module it names) is parsed from the README itself and either

* run as written, in-process through the script's ``main(argv)``, from a sandbox folder in which every path the
  command names exists as a tiny stand-in (models of hidden size 32, a few rows of data), with size flags appended
  (argparse keeps an option's last value, so ``--max_steps 1`` overrides what the README trains for, and
  ``--gradient_accumulation_steps 1`` its accumulation); a command that reads an earlier command's output (the
  WikiHop evaluation, MLM on the converted model) runs that command first; or
* skipped, for the reason :func:`why_not_here` gives (it downloads from the Hub, needs a launcher, or another test
  already runs it at tiny size).

Nothing adds ``--use_cpu``: the scripts find out themselves that there is no GPU, so the WikiHop command's ``--bf16``
trains on the CPU. A README command that names a path without a stand-in here fails until it gets one
(:func:`build_stand_ins`).
"""

from __future__ import annotations

import importlib
import os
import shlex
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import RobertaConfig, RobertaForMaskedLM  # noqa: E402

from tests.test_examples import glue_rows, write_rows  # noqa: E402
from tests.test_run_classification import classification_files  # noqa: E402
from tests.test_run_mlm import NEW_MODELS, documents  # noqa: E402
from tests.test_run_qa import squad_file  # noqa: E402
from tests.tiny_tokenizers import roberta_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
README = REPO / "examples" / "README.md"
SCRIPT_PREFIXES = ("examples.", "conversion.")
# The package's console entry points (pyproject.toml's [project.scripts]) and the modules whose main() they run.
ENTRY_POINTS = {
    "hfx-convert": "hf_xformers.conversion.convert_roberta_to_long",
    "hfx-import": "hf_xformers.conversion.convert_from_transformers",
    "hfx-export": "hf_xformers.export",
}
# The options that name what a command writes (the sandbox's "out/..." folders): not stand-ins.
OUTPUT_OPTIONS = {"--output_dir", "--output", "--output-dir"}

# Appended to each script's command: the smallest run that still trains, evaluates and saves.
TRAINER_QUIET = ["--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0"]
SIZE_FLAGS = {
    "examples.run_glue": ["--max_steps", "1", "--max_seq_length", "32", "--per_device_train_batch_size", "2",
                          "--per_device_eval_batch_size", "4", *TRAINER_QUIET],
    "examples.run_wikihop": ["--max_steps", "1", "--per_device_train_batch_size", "1",
                             "--gradient_accumulation_steps", "1", "--max_chunks_per_example", "2",
                             "--max_eval_samples", "2", *TRAINER_QUIET],
    "examples.run_mlm": ["--max_steps", "1", "--max_seq_length", "64", "--per_device_train_batch_size", "2",
                         "--gradient_accumulation_steps", "1", "--per_device_eval_batch_size", "4", *TRAINER_QUIET],
    "examples.run_image_classification": ["--max_steps", "1", "--per_device_train_batch_size", "8",
                                          "--per_device_eval_batch_size", "16", "--max_train_samples", "16",
                                          "--max_eval_samples", "16", *TRAINER_QUIET],
    "examples.run_classification": ["--max_steps", "1", "--max_seq_length", "64", "--doc_stride", "8",
                                    "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4",
                                    *TRAINER_QUIET],
    "examples.run_qa": ["--max_steps", "1", "--max_seq_length", "128", "--doc_stride", "32",
                        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                        "--per_device_eval_batch_size", "8", "--max_train_samples", "2", "--max_eval_samples", "3",
                        *TRAINER_QUIET],
    "hf_xformers.conversion.convert_roberta_to_long": ["--max-length", "128", "--attention-window", "16"],
}  # fmt: skip
# A new model from scratch (--model_type): the README's sizes give way to the tiny ones of tests/test_run_mlm.py.
TINY_NEW_MODEL = {"hfx-reformer": NEW_MODELS["hfx-reformer"]}


def readme_commands() -> list[str]:
    """The shell commands of the README's fenced ``bash`` (or unlabelled) blocks that run a script module, one
    string each (continuation lines joined, comments dropped), in README order."""
    commands, inside, language, pending = [], False, "", ""
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            inside, language = not inside, line.strip()[3:]
            continue
        if not inside or language not in ("bash", "sh", ""):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        command, pending = " ".join(shlex.split(pending, comments=True)), ""
        runs_script = any(f"-m {prefix}" in command for prefix in SCRIPT_PREFIXES)
        if runs_script or command.split(" ", 1)[0] in ENTRY_POINTS:
            commands.append(command)
    return commands


def parse(command: str) -> tuple[str, str, list[str]]:
    """``(launcher, module, argv)`` of a README command: the launcher is ``python`` or, e.g., ``torchrun``;
    environment assignments in front (``HF_HUB_OFFLINE=1``) are dropped (the tests run offline anyway)."""
    words = shlex.split(command)
    while "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]
    if words[0] in ENTRY_POINTS:
        return "python", ENTRY_POINTS[words[0]], words[1:]
    at = words.index("-m", 1 if words[0] == "python" else 0)
    return words[0], words[at + 1], words[at + 2 :]


def why_not_here(command: str) -> str | None:
    """Why a README command cannot run in the test suite (offline, one process), or None."""
    launcher, module, argv = parse(command)
    if launcher != "python":
        return f"{launcher}: tests/test_examples.py runs run_glue and run_wikihop under torchrun (2 processes)"
    if any("$" in arg for arg in argv):
        return "a shell loop (over the nine GLUE tasks of the Hub)"
    if module == "examples.run_algorithmic_task":
        # Plain argparse, no TrainingArguments: what the README shows adds nothing to the tiny run of that test.
        return "tests/test_universal.py::test_algorithmic_task_script_tiny_run runs this script at tiny size"
    if module == "examples.run_glue" and not {"--train_file", "--validation_file", "--test_file"} & set(argv):
        return "reads nyu-mll/glue from the Hub (tests/test_examples.py::test_run_glue_hub_dataset_layout runs it)"
    if module == "examples.run_classification" and "--dataset_name" in argv:
        return "reads a dataset from the Hub"
    if module == "examples.long_vs_truncated":
        # Four fine-tunings and evaluations, each a process of its own, of a real 22M-parameter encoder.
        return "tests/test_run_classification.py::test_long_vs_truncated_end_to_end runs this script at tiny size"
    if module == "examples.run_qa" and "--dataset_name" in argv:
        return "reads SQuAD from the Hub (tests/test_run_qa.py::test_run_qa_v2_with_unanswerable_questions reads its layout)"
    return None


def input_paths(argv: list[str]) -> list[str]:
    """The paths a command reads (values that name a file or folder), outputs excluded."""
    paths = []
    for option, value in zip(argv, argv[1:]):
        if option.startswith("--") and option not in OUTPUT_OPTIONS and not value.startswith("--"):
            if "/" in value or Path(value).suffix in (".txt", ".json", ".csv"):
                paths.append(value)
            elif option in ("--model_name_or_path", "--source", "--tokenizer_name"):
                paths.append(value)
    return paths


def output_path(argv: list[str]) -> str | None:
    return next((value for option, value in zip(argv, argv[1:]) if option in OUTPUT_OPTIONS), None)


COMMANDS = readme_commands()
IDS = [f"{i}-{parse(command)[1].rsplit('.', 1)[-1]}" for i, command in enumerate(COMMANDS)]


# ---------------------------------------------------------------------------------------------------------------
# The sandbox: every path the README names, tiny
# ---------------------------------------------------------------------------------------------------------------


def _tiny_roberta_mlm(path: Path) -> None:
    """A RoBERTa MLM checkpoint of 32 positions with its tokenizer (what convert_roberta_to_long starts from)."""
    tokenizer = roberta_tokenizer()
    config = RobertaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=34, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    RobertaForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _image_folder(path: Path, images_per_class: int) -> None:
    """Two classes of 16 x 16 RGB images (dark and bright), ``path/<class>/<i>.png``."""
    rng = np.random.default_rng(0)
    for label, (low, high) in {"dark": (0, 100), "bright": (150, 256)}.items():
        (path / label).mkdir(parents=True)
        for i in range(images_per_class):
            pixels = rng.integers(low, high, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path / label / f"{i}.png")


def _glue_files(folder: Path, task: str, names: dict[str, str | None]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, labels in names.items():
        write_rows(folder / name, glue_rows(task, 6, labels=labels))


def build_stand_ins(root: Path, longformer_dir: Path) -> None:
    """Every input the README's runnable commands name, under ``root``, tiny."""
    for name in ("path/to/roberta-base-4096", "path/to/model"):
        shutil.copytree(longformer_dir, root / name)
    _tiny_roberta_mlm(root / "path/to/roberta-base")
    roberta_tokenizer().save_pretrained(root / "path/to/tokenizer")
    _glue_files(root / "data/sst2", "sst2", {"train.csv": "ids", "dev.csv": "ids", "test.csv": None})
    _glue_files(
        root / "mnli", "mnli",
        {"train.json": "ids", "dev_matched.json": "names", "dev_mismatched.json": "ids", "test_matched.json": None,
         "test_mismatched.json": None, "ax.json": None},
    )  # fmt: skip
    fixtures = REPO / "tests" / "fixtures" / "wikihop"
    shutil.copytree(fixtures, root / "qangaroo_v1.1" / "wikihop")
    shutil.copytree(fixtures, root / "tests" / "fixtures" / "wikihop")
    for version, unanswerable in (("v1.1", 0), ("v2.0", 2)):
        for split in ("train", "dev"):
            squad_file(root / "squad" / f"{split}-{version}.json", 3, unanswerable, n_sentences=12, nested=True)
    (root / "train.txt").write_text("\n".join(documents(40)) + "\n", encoding="utf-8")
    (root / "valid.txt").write_text("\n".join(documents(12, seed=1)) + "\n", encoding="utf-8")
    _image_folder(root / "data/train", 8)
    _image_folder(root / "data/val", 4)
    classification_files(root / "data")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, longformer_dir) -> dict:
    root = tmp_path_factory.mktemp("readme_sandbox")
    build_stand_ins(root, longformer_dir)
    return {"root": root, "done": {}}


def run_command(index: int, sandbox: dict) -> dict:
    """Run README command ``index`` in the sandbox (first any earlier command whose output it reads); returns what
    its ``main`` returned. Runs each command once per module."""
    if index in sandbox["done"]:
        return sandbox["done"][index]
    _, module, argv = parse(COMMANDS[index])
    root = sandbox["root"]
    for path in input_paths(argv):
        producers = [i for i in range(index) if output_path(parse(COMMANDS[i])[2]) == path]
        if producers:
            run_command(producers[-1], sandbox)
        assert (root / path).exists(), (
            f"examples/README.md command {index} reads {path!r}: add a stand-in to build_stand_ins in {__file__}"
        )
    argv = list(argv) + SIZE_FLAGS.get(module, [])
    if "--model_type" in argv and "--config_overrides" in argv:
        argv += ["--config_overrides", TINY_NEW_MODEL[argv[argv.index("--model_type") + 1]]]
    cwd = os.getcwd()
    os.chdir(root)
    try:
        sandbox["done"][index] = importlib.import_module(module).main(argv)
    finally:
        os.chdir(cwd)
    return sandbox["done"][index]


# ---------------------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------------------


def test_the_readme_shows_the_commands_the_tests_run():
    """The parser finds the README's commands (a README rewritten into another form would otherwise test nothing),
    and every script module they name has size flags here."""
    modules = {parse(command)[1] for command in COMMANDS if why_not_here(command) is None}
    assert {"examples.run_glue", "examples.run_wikihop", "examples.run_mlm", "examples.run_image_classification",
            "examples.run_qa", "hf_xformers.conversion.convert_roberta_to_long"} <= modules  # fmt: skip
    assert modules <= set(SIZE_FLAGS), f"add size flags for {modules - set(SIZE_FLAGS)}"
    assert any("--bf16" in command and why_not_here(command) is None for command in COMMANDS)


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=IDS)
def test_readme_command(index, sandbox):
    reason = why_not_here(COMMANDS[index])
    if reason is not None:
        pytest.skip(reason)
    result = run_command(index, sandbox)
    _, module, argv = parse(COMMANDS[index])
    output = output_path(argv)
    if module.startswith("examples.run_"):
        assert isinstance(result, dict) and result, result
        assert all(np.isfinite(v) for k, v in result.items() if "loss" in k and isinstance(v, float)), result
    if output is not None:
        assert (sandbox["root"] / output).is_dir()
