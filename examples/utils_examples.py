"""Helpers shared by the Trainer example scripts (``run_glue.py``, ``run_classification.py``, ``run_wikihop.py``,
``run_image_classification.py``, ``run_clm.py``).

The scripts import it as ``examples.utils_examples``. They run as modules from the repository root
(``python -m examples.run_glue ...``) or as files from any folder (``python path/to/examples/run_glue.py ...``: each
script puts the repository root on ``sys.path`` first when it runs without a package).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import torch
import transformers
from datasets import Dataset, load_dataset
from huggingface_hub import try_to_load_from_cache, upload_folder
from transformers import AutoConfig, HfArgumentParser, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from hf_xformers.card import hub_model_id, save_card_data, write_model_card
from hf_xformers.export import export_for_hub
from hf_xformers.ops.compat import checkpointing_argv
from hf_xformers.padding_free import DataCollatorForPackedDocuments, packing_refusal
from hf_xformers.registration import REGISTRY
from hf_xformers.sequence_parallel_data import (
    DataCollatorForSequenceParallel,
    sequence_parallel_size,
    setup_sequence_parallel,
)

logger = logging.getLogger(__name__)

# File extensions load_dataset can read without a loading script, and the builder that reads them.
LOCAL_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json"}


class DataFileError(ValueError):
    """A local data file without rows to read (empty, a header alone): the message names the file and what it
    lacks. Within :func:`data_file_errors` it ends a script with that one line instead of a traceback."""


@contextlib.contextmanager
def data_file_errors(prog: str):
    """Within it, a :class:`DataFileError` ends the script ``prog`` with its one line on stderr, exit status 2, as a
    usage error does (``datasets`` would otherwise end it with a long traceback that names no file)."""
    try:
        yield
    except DataFileError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        raise SystemExit(2) from None


@dataclass
class HubArguments:
    """What makes ``--output_dir`` self-contained for the Hub (see :func:`finish_output_dir`)."""

    self_contained: bool = field(
        default=False,
        metadata={
            "help": "Also write the model's code into output_dir (hf_xformers.export_for_hub), so the folder, and "
            "what --push_to_hub uploads, loads with trust_remote_code=True where hf_xformers is not installed."
        },
    )


@dataclass
class RunArguments(HubArguments):
    """Options about the output directory that ``TrainingArguments`` no longer has in transformers v5."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start training from scratch even if output_dir holds checkpoints (by default training "
            "resumes from the last checkpoint-* folder there)."
        },
    )


class ScriptHelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of the scripts: the description and the notes after the options as written (docstring paragraphs,
    example commands), every option with its default (unless it is None, or its help already says the default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def split_doc(doc: str | None) -> tuple[str | None, str | None]:
    """``(description, epilog)`` of a script's ``--help`` from its docstring: the first paragraph (a one-line title
    joined with the paragraph after it) and the rest."""
    paragraphs = (doc or "").strip().split("\n\n")
    # the paragraph after a one-line title joins it only when it is a whole sentence (not the lead-in of a list)
    lead = 2 if len(paragraphs) > 1 and "\n" not in paragraphs[0] and paragraphs[1].endswith((".", ")")) else 1
    return "\n".join(paragraphs[:lead]) or None, "\n\n".join(paragraphs[lead:]) or None


def script_parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The ``argparse`` parser of an example or benchmark script: its docstring ``doc`` split by :func:`split_doc`
    into the description (shown first) and the epilog (after the options); ``--help`` shows every default."""
    description, epilog = split_doc(doc)
    # A short usage line: argparse's own lists every option before the description.
    kwargs.setdefault("usage", "%(prog)s [options]   (--help lists them)")
    return argparse.ArgumentParser(
        description=description, epilog=epilog, formatter_class=ScriptHelpFormatter, **kwargs
    )


def model_source_error(name_or_path: str, option: str = "--model_name_or_path") -> str | None:
    """Why ``name_or_path`` names no model ``from_pretrained`` could load, in one line naming it and what is expected;
    None when it does: a folder with ``config.json``, or a Hub id (offline: only one in the local cache)."""
    expected = (
        "expected a checkpoint folder with config.json (save_pretrained, a Trainer output_dir, hfx-convert's "
        "--output) or a Hub id such as FacebookAI/roberta-base"
    )
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return (
            None if (path / "config.json").is_file() else f"{option} {name_or_path!r} holds no config.json; {expected}"
        )
    if path.exists():
        return f"{option} {name_or_path!r} is a file; {expected}"
    hub_id = hub_model_id(name_or_path)
    if hub_id is None:
        return f"{option} {name_or_path!r}: no such folder, and not a Hub id; {expected}"
    if huggingface_hub.constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        return (
            f"{option} {name_or_path!r}: no such folder, and the Hub id is not in the local cache while HF_HUB_OFFLINE "
            f"is set; {expected} (download it first, or unset HF_HUB_OFFLINE)"
        )
    return None


def refuse_missing_model(
    parser: argparse.ArgumentParser, name_or_path: str | None, option: str = "--model_name_or_path"
) -> None:
    """End the script with one line naming ``name_or_path`` (exit status 2, no traceback) when it is given and names
    no loadable model (:func:`model_source_error`)."""
    problem = model_source_error(name_or_path, option) if name_or_path else None
    if problem:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")


def parse_script_args(
    dataclass_types: tuple, argv: list[str] | None = None, description: str | None = None, check=None
) -> tuple:
    """A script's argument dataclasses, filled from ``argv`` (default ``sys.argv[1:]``) or from a single ``.json``
    file argument, in the order of ``dataclass_types``.

    ``--help`` shows the description of ``description`` (the script's docstring, :func:`split_doc`), then the
    script's own options with their defaults, then ``TrainingArguments``' (a hundred more), then the rest of the
    docstring. A
    ``--model_name_or_path`` that names no loadable model ends the script with one line that names it
    (:func:`model_source_error`), before anything is loaded. ``check(*arguments)``, when given, may refuse a
    combination of options with a ``ValueError``: a usage error too (e.g. ``--padding_free`` with a model that cannot
    take packed batches, :func:`padding_free_refusal`), before any data are read.
    """
    # TrainingArguments' group last: its hundred options would otherwise bury the script's own.
    order = sorted(range(len(dataclass_types)), key=lambda i: issubclass(dataclass_types[i], TrainingArguments))
    summary, notes = split_doc(description)
    parser = HfArgumentParser(
        [dataclass_types[i] for i in order],
        description=summary,
        epilog=notes,
        formatter_class=ScriptHelpFormatter,
        usage="%(prog)s [options]   (or %(prog)s options.json; --help lists the options)",
    )
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            options = json.loads(Path(argv[0]).read_text())
            if TrainingArguments in dataclass_types and not has_accelerator():
                options.setdefault("use_cpu", True)  # as cpu_argv does on the command line
            parsed = parser.parse_dict(options)
        else:
            if TrainingArguments in dataclass_types:
                argv = cpu_argv(argv)
            parsed = parser.parse_args_into_dataclasses(args=checkpointing_argv(argv))
    except ValueError as error:  # an option the dataclasses refuse (their __post_init__): a usage error, not a crash
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    for arguments in parsed:
        refuse_missing_model(parser, getattr(arguments, "model_name_or_path", None))
    by_type = dict(zip(order, parsed))
    arguments = tuple(by_type[i] for i in range(len(dataclass_types)))
    if check is not None:
        try:
            check(*arguments)
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
    return arguments


def launched_processes() -> int:
    """How many processes the launcher (torchrun, accelerate launch ...) started: ``WORLD_SIZE``, 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_accelerator() -> bool:
    """Whether torch sees an accelerator Trainer would train on (CUDA, XPU, MPS ...)."""
    return torch.accelerator.is_available()


def cpu_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``--use_cpu`` added on a machine without an accelerator, unless ``--use_cpu`` is given.

    ``TrainingArguments`` refuses ``--bf16`` without ``--use_cpu`` when it finds no GPU ("Your setup doesn't
    support bf16/gpu. You need to assign use_cpu ..."), before any training; and accelerate (1.15)
    builds a multi-process CPU (gloo) group under ``torchrun`` only when told to use the CPU: otherwise each process
    silently trains alone on the whole data set. With the flag, the README's commands run as written on a laptop.
    """
    if has_accelerator() or "use_cpu" in explicit_options(argv):
        return list(argv)
    return [*argv, "--use_cpu"]


def check_world_size(training_args: TrainingArguments) -> None:
    """Raise a ``ValueError`` when Trainer would not use all the processes that were launched (each would then
    train alone on all the data and write into the same output_dir)."""
    launched = launched_processes()
    if launched > 1 and training_args.world_size != launched:
        raise ValueError(
            f"{launched} processes were launched but Trainer set up {training_args.world_size} "
            f"(parallel mode {training_args.parallel_mode.value}). On a machine without GPUs pass --use_cpu."
        )


def sequence_parallel_collator(collator, model, training_args: TrainingArguments, max_length: int, packed: bool,
                               script_logger: logging.Logger):  # fmt: skip
    """``collator`` as it is, or, when the run is sequence-parallel (``ParallelismConfig(sp_backend="deepspeed",
    sp_size > 1)`` in the TrainingArguments, or an accelerate config file's ``parallelism_config_sp_size``), wrapped in
    :class:`~hf_xformers.DataCollatorForSequenceParallel` (batches of ``max_length`` rounded up to a multiple of
    ``sp_size``, the model's position ids, sequence-level labels spread over their rows), with DeepSpeed's
    communication set up (:func:`~hf_xformers.setup_sequence_parallel`). docs/training-past-one-device.md."""
    sp_size = sequence_parallel_size(training_args)
    if sp_size < 2:
        return collator
    if packed:
        raise ValueError(
            "--padding_free cannot be combined with sequence parallelism here (DeepSpeed's adapter cuts every tensor "
            "of a batch along its tokens, and a packed batch carries per-document tensors): drop --padding_free."
        )
    setup_sequence_parallel(training_args)
    length = -(-max_length // sp_size) * sp_size
    script_logger.info("Sequence parallelism over %d ranks: every training batch padded to %d tokens.", sp_size, length)
    return DataCollatorForSequenceParallel(collator, model, sp_size=sp_size, max_length=length)


def setup_logging(training_args: TrainingArguments, *script_loggers: logging.Logger) -> None:
    """Log to stdout: the scripts' own messages at INFO on the main process, transformers and datasets at the
    level ``--log_level`` / ``--log_level_replica`` ask for (their defaults keep them at warnings).

    Progress bars are left alone: ``--disable_tqdm`` is the user's choice.
    """
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
        force=True,  # the scripts may run several times in one process (the tests do)
    )
    level = training_args.get_process_log_level()
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    # Replicas under torchrun would repeat every message; only the main process reports progress.
    for script_logger in (logger, *script_loggers):
        script_logger.setLevel(logging.INFO if training_args.should_log else logging.WARNING)


def resume_checkpoint(training_args: TrainingArguments, overwrite_output_dir: bool) -> str | None:
    """The checkpoint to resume training from, or None.

    ``--resume_from_checkpoint PATH`` wins. Otherwise, when training into an ``output_dir`` that already holds
    ``checkpoint-*`` folders, resume from the last one (the convention of transformers' example scripts), unless
    ``--overwrite_output_dir`` asks for a fresh start.

    Raises:
        ValueError: ``--resume_from_checkpoint`` names a folder that does not exist.
    """
    if training_args.resume_from_checkpoint:
        path = training_args.resume_from_checkpoint
        if not os.path.isdir(path):
            raise ValueError(f"--resume_from_checkpoint {path}: no such checkpoint folder.")
        logger.info("Resuming training from %s", path)
        return path
    if not training_args.do_train or overwrite_output_dir or not os.path.isdir(training_args.output_dir):
        return None
    last = get_last_checkpoint(training_args.output_dir)
    if last is not None:
        logger.info("Resuming training from %s; pass --overwrite_output_dir to train from scratch instead.", last)
    return last


def load_local_file(path: str, cache_dir: str | None = None) -> Dataset:
    """Read one csv, json or jsonl file as a ``Dataset`` (a json file may hold a list of objects).

    Raises:
        ValueError: the extension is not one of .csv, .json, .jsonl.
        FileNotFoundError: the file does not exist.
        DataFileError: the file holds no rows of data (:func:`missing_rows`).
    """
    suffix = Path(path).suffix.lower()
    builder = LOCAL_FORMATS.get(suffix)
    if builder is None:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {sorted(LOCAL_FORMATS)}.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file.")
    problem = missing_rows(path, builder)
    if problem is not None:  # datasets would fail with a long traceback that names no file
        raise DataFileError(problem)
    # One file per call, so the splits of a run may mix formats (csv for training, json for evaluation ...).
    dataset = load_dataset(builder, data_files=path, split="train", cache_dir=cache_dir)
    if len(dataset) == 0:
        raise DataFileError(f"{path}: no rows of data.")
    return dataset


def missing_rows(path: str, builder: str) -> str | None:
    """What ``path`` (a ``csv`` or ``json`` builder's file) lacks when it holds no rows of data, in one sentence
    that names it; None when it holds some. Reads at most the first two non-blank lines of a csv file and the
    first 64 KiB of a json one."""
    with open(path, encoding="utf-8", errors="replace") as f:
        if builder == "csv":
            lines = []
            for line in f:
                if line.strip():
                    lines.append(line.strip())
                if len(lines) == 2:
                    return None
            if not lines:
                return (
                    f"{path}: the file is empty; a csv file needs a header row naming the columns, then rows of data."
                )
            return f"{path}: the file has a header row ({lines[0]}) but no rows of data under it."
        head = f.read(1 << 16).strip()
    if head and not re.fullmatch(r"\[\s*\]", head):
        return None
    return (
        f"{path}: the file holds no records; a json file needs a list of objects, a jsonl file one object per line "
        "(each with the columns the script reads)."
    )


def require_columns(dataset: Dataset, columns: list[str], source: str) -> None:
    """Raise a ``ValueError`` naming ``source`` when ``dataset`` lacks any of ``columns``."""
    missing = [name for name in columns if name not in dataset.column_names]
    if missing:
        raise ValueError(f"{source} lacks the column(s) {missing}; it needs {columns} (found {dataset.column_names}).")


def take(dataset: Dataset, limit: int | None) -> Dataset:
    """The first ``limit`` rows of ``dataset`` (all of them when ``limit`` is None)."""
    return dataset if limit is None else dataset.select(range(min(limit, len(dataset))))


def supports_global_attention(model) -> bool:
    """Whether ``model``'s forward accepts a ``global_attention_mask`` that it actually uses.

    hfx models say so on their attention class (every hfx base model *accepts* the argument but refuses it
    with a ValueError when its attention has no global tokens; Reformer's, which has no single attention class,
    refuses it too); other models (e.g. transformers' Longformer) are judged by their forward signature.
    """
    attention_class = getattr(model, "attention_class", None)
    if attention_class is not None or getattr(model.config, "model_type", None) in REGISTRY:
        return bool(getattr(attention_class, "supports_global_attention", False))
    return "global_attention_mask" in inspect.signature(model.forward).parameters


def model_max_tokens(encoder: torch.nn.Module) -> int:
    """How many tokens ``encoder`` reads: hfx models say so; RoBERTa-style position tables (with a
    ``padding_idx``) lose ``padding_idx + 1`` rows to the offset; otherwise ``max_position_embeddings``."""
    embeddings = getattr(encoder, "embeddings", None)
    if hasattr(embeddings, "max_tokens"):
        return int(embeddings.max_tokens)
    limit = encoder.config.max_position_embeddings
    offset = getattr(embeddings, "padding_idx", None)
    return limit - offset - 1 if offset is not None else limit


def padding_free_message(refusal: str) -> str:
    """The error of ``--padding_free`` on a model that :func:`packing_refusal` refuses."""
    return f"--padding_free: {refusal} Run without --padding_free to pad the batches instead."


def padding_free_refusal(name_or_path: str, auto_class, **config_kwargs) -> str | None:
    """Why the ``auto_class`` head (``AutoModelForSequenceClassification`` ...) of the model ``name_or_path``
    cannot take packed batches (``--padding_free``), or None when it can: the head is built from the config on the
    meta device (no weights read, no memory) and asked :func:`~hf_xformers.padding_free.packing_refusal`, so a script
    can refuse before it reads any data (:func:`padding_free_message`). None as well for a config ``auto_class`` has
    no head for (the script says so itself). ``config_kwargs`` go to ``AutoConfig.from_pretrained`` (``cache_dir``,
    ``trust_remote_code``)."""
    config = AutoConfig.from_pretrained(name_or_path, **config_kwargs)
    if type(config) not in auto_class._model_mapping:
        return None
    with torch.device("meta"):
        model = auto_class.from_config(config, trust_remote_code=config_kwargs.get("trust_remote_code", False))
    return packing_refusal(model)


def packed_collator(
    model, training_args: TrainingArguments, log: logging.Logger, **options
) -> DataCollatorForPackedDocuments:
    """The collator of ``--padding_free``: every batch one row of unpadded documents
    (:class:`hf_xformers.padding_free.DataCollatorForPackedDocuments`, ``options`` as its fields), with the model's
    first position and explicit boundaries (``cu_seq_lens_q/k`` and ``max_length_q/k`` beside ``position_ids``). Turns grouping by length off (``--train_sampling_strategy group_by_length``, ``--group_by_length``
    on older transformers): it only served to keep padding small.

    Raises:
        ValueError: the model cannot take packed batches (Linformer, Transformer-XL, transformers' own heads), before
            any training.
    """
    refusal = packing_refusal(model)
    if refusal is not None:
        raise ValueError(padding_free_message(refusal))
    # Recent transformers releases name it train_sampling_strategy="group_by_length", earlier ones group_by_length.
    if getattr(training_args, "train_sampling_strategy", None) == "group_by_length":
        log.info("--padding_free: training batches are drawn at random, not grouped by length (no padding to save).")
        training_args.train_sampling_strategy = "random"
    if getattr(training_args, "group_by_length", False):
        log.info("--padding_free: --group_by_length is off (a packed row has no padding to save).")
        training_args.group_by_length = False
    # Explicit boundaries (cu_seq_lens_q/k, max_length_q/k) beside the restarting positions: the model resolves the
    # documents from them by shape, with no read of the positions, and a varlen kernel takes them as they are.
    options.setdefault("return_flash_attn_kwargs", True)
    collator = DataCollatorForPackedDocuments.for_model(model, **options)
    log.info(
        "--padding_free: each batch is one row of unpadded documents (positions restart at %d in each).",
        collator.position_ids_start,
    )
    return collator


# ---------------------------------------------------------------------------------------------------------------
# An upload-ready output directory: model card, optional self-contained code, push
# ---------------------------------------------------------------------------------------------------------------


def _plain(value):
    """Enum members (optimizer, scheduler ...) as their string value, for the card."""
    return getattr(value, "value", value)


def training_hyperparameters(args: TrainingArguments) -> dict:
    """The hyperparameters of a Trainer run that a model card states."""
    per_device = args.per_device_train_batch_size
    hyper = {
        "learning_rate": args.learning_rate,
        "train_batch_size": per_device,
        "eval_batch_size": args.per_device_eval_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "num_processes": args.world_size,
        "total_train_batch_size": per_device * args.gradient_accumulation_steps * args.world_size,
        "optimizer": _plain(args.optim),
        "weight_decay": args.weight_decay,
        "lr_scheduler_type": _plain(args.lr_scheduler_type),
        "warmup_steps": args.warmup_steps,
        "seed": args.seed,
    }
    if args.max_steps > 0:
        hyper["training_steps"] = args.max_steps
    else:
        hyper["num_epochs"] = args.num_train_epochs
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if precision:
        hyper["mixed_precision"] = precision
    return hyper


def model_origin(name_or_path: str | None) -> str:
    """How a card names the model a run started from: a Hub link, or the local folder's name (and the Hub model
    that folder came from, when it recorded one)."""
    if not name_or_path:
        return "a new model (trained from scratch)"
    if not os.path.exists(name_or_path):
        return f"[`{name_or_path}`](https://huggingface.co/{name_or_path})"
    base = hub_model_id(name_or_path)
    return f"the local checkpoint `{Path(name_or_path).name}`" + (f" (from `{base}`)" if base else "")


def finish_output_dir(
    trainer: Trainer, hub_args: HubArguments, trained: bool, extra_hyperparameters: dict | None = None, **card_data
) -> None:
    """Leave ``trainer.args.output_dir`` ready to upload; call it at the end of a script, on every process.

    On the main process, when the folder holds a saved hf_xformers model (``config.json``): records ``card_data`` (keys in
    :mod:`hf_xformers.card`) and, after training, the run's hyperparameters; with ``--self_contained`` writes the
    model's code into the folder (:func:`hf_xformers.export_for_hub`, in place); writes the model card
    (``README.md``); and with ``--push_to_hub`` uploads the folder (:func:`push_output_dir`).
    """
    if not trainer.is_world_process_zero():
        return
    output_dir = trainer.args.output_dir
    config_file = os.path.join(output_dir, "config.json")
    if not os.path.isfile(config_file):
        logger.info("No model was saved in %s (no training): no model card written.", output_dir)
        return
    with open(config_file, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type not in REGISTRY:
        # A transformers model: its code ships with transformers, and Trainer already wrote (and pushed) its card.
        logger.info("%s is not an hf_xformers model: no hf_xformers card or code export.", model_type)
        return
    if trained:
        card_data["hyperparameters"] = {**training_hyperparameters(trainer.args), **(extra_hyperparameters or {})}
    save_card_data(output_dir, **card_data)
    if hub_args.self_contained:
        export_for_hub(output_dir, output_dir)
    card = write_model_card(output_dir)
    code = " and the model code (it loads without hf_xformers)" if hub_args.self_contained else ""
    logger.info("Wrote the model card %s%s", card, code)
    if trainer.args.push_to_hub:
        push_output_dir(trainer)


def push_output_dir(trainer: Trainer) -> None:
    """Upload ``output_dir`` to the repository Trainer set up for ``--push_to_hub`` (``--hub_model_id``).

    Trainer pushes on its own when the model is saved, with a card of its own making; this upload comes last, so
    the Hub gets our card and, with ``--self_contained``, the code. ``checkpoint-*`` folders stay local, as in
    ``Trainer.push_to_hub``.
    """
    args = trainer.args
    finish = getattr(trainer, "_finish_current_push", None)  # a checkpoint upload Trainer runs in the background
    if finish is not None:
        finish()
    repo_id = getattr(trainer, "hub_model_id", None) or args.hub_model_id
    if repo_id is None:
        raise ValueError("--push_to_hub needs a repository: pass --hub_model_id (or let Trainer create one).")
    upload_folder(
        repo_id=repo_id,
        folder_path=args.output_dir,
        commit_message="Model card and files (hf_xformers example script)",
        token=args.hub_token,
        revision=args.hub_revision,
        ignore_patterns=["_*", "checkpoint-*"],
    )
    logger.info("Uploaded %s to %s", args.output_dir, repo_id)


def explicit_options(argv: list[str] | None) -> set[str]:
    """Names of the options given on the command line (``--learning_rate 1e-3``, ``--learning_rate=1e-3``) or as
    keys of a single ``.json`` arguments file, without the leading dashes."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        return set(json.loads(Path(argv[0]).read_text()))
    return {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}


def apply_scratch_defaults(
    training_args: TrainingArguments,
    argv: list[str] | None,
    defaults: dict,
    log: logging.Logger,
    reason: str = "New model trained from scratch",
) -> dict:
    """Set the ``TrainingArguments`` fields of ``defaults`` that the user did not give, and log them.

    The Trainer's defaults (learning rate 5e-5, no warm-up, 3 epochs) suit fine-tuning a pretrained model; a model
    built from scratch needs a larger learning rate with a warm-up, and more passes over small data. A key
    ``"num_train_epochs"`` is skipped when ``--max_steps`` is given. ``reason`` opens the log line. Returns what
    was applied.
    """
    given = explicit_options(argv)
    applied = {}
    for name, value in defaults.items():
        if name in given or (name == "num_train_epochs" and "max_steps" in given):
            continue
        setattr(training_args, name, value)
        applied[name] = value
    if applied:
        shown = ", ".join(f"--{k} {v}" for k, v in applied.items())
        log.info("%s: using %s (set any of them to override).", reason, shown)
    return applied


# ---------------------------------------------------------------------------------------------------------------
# Documents against the model's length
# ---------------------------------------------------------------------------------------------------------------


def model_max_length(model, tokenizer=None) -> int:
    """The most tokens ``model`` reads at once: its position table (hf_xformers' ``embeddings.max_tokens``; a
    transformers encoder's ``position_embeddings`` less RoBERTa's padding offset), else ``max_position_embeddings``,
    capped by the tokenizer's ``model_max_length`` where that is set (tokenizers without one say 10^30).

    Raises:
        ValueError: neither the model nor the tokenizer states a length.
    """
    embeddings = getattr(model.base_model, "embeddings", None)
    limit = getattr(embeddings, "max_tokens", None)
    positions = getattr(embeddings, "position_embeddings", None)
    if limit is None and isinstance(positions, torch.nn.Embedding):
        # RoBERTa counts positions from padding_idx + 1; BERT has no padding_idx there and starts at 0.
        padding_idx = getattr(embeddings, "padding_idx", None)
        limit = positions.num_embeddings - (padding_idx + 1 if padding_idx is not None else 0)
    if limit is None:
        limit = getattr(model.config, "max_position_embeddings", None)
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer_limit is not None and tokenizer_limit < 1_000_000:
        limit = tokenizer_limit if limit is None else min(limit, tokenizer_limit)
    if limit is None:
        raise ValueError("The model states no maximum length: pass --max_seq_length.")
    return int(limit)


def token_length_report(lengths, max_length: int, window_lengths=None) -> dict:
    """How ``lengths`` (tokens per document, special tokens included) sit against a model of ``max_length``
    tokens: count, median, 90th percentile, longest, how many documents truncation would cut and how many tokens
    that loses; with ``window_lengths`` (the windows the model reads of them), how many windows and tokens it
    reads."""
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths[lengths > max_length]
    report = {
        "documents": int(lengths.size),
        "max_length": int(max_length),
        "median": float(np.median(lengths)) if lengths.size else 0.0,
        "p90": float(np.percentile(lengths, 90)) if lengths.size else 0.0,
        "longest": int(lengths.max()) if lengths.size else 0,
        "tokens": int(lengths.sum()),
        "truncated_documents": int(over.size),
        "tokens_lost_to_truncation": int((over - max_length).sum()),
    }
    if window_lengths is not None:
        report["windows"] = len(window_lengths)
        report["tokens_read"] = int(sum(window_lengths))
    return report


def describe_token_lengths(split: str, report: dict, mode: str = "truncate") -> str:
    """One log line from :func:`token_length_report`."""
    n, tokens = report["documents"], max(report["tokens"], 1)
    line = (
        f"{split}: {n} documents, median {report['median']:,.0f} tokens, 90th percentile {report['p90']:,.0f}, "
        f"longest {report['longest']:,}; {report['truncated_documents']} ({report['truncated_documents'] / max(n, 1):.0%}) "
        f"longer than the model's {report['max_length']:,} tokens"
    )
    if mode == "chunks":
        return line + f": read whole in {report.get('windows', n):,} overlapping windows."
    lost = report["tokens_lost_to_truncation"]
    return line + f": truncation drops {lost:,} of {report['tokens']:,} tokens ({lost / tokens:.0%})."
