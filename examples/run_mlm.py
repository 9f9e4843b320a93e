"""Masked-language-model (continued) pretraining with ``transformers.Trainer``.

The Longformer paper's recipe for a converted model (``hfx-convert``): continue MLM
pretraining on long documents so the new positions and the long attention patterns are learned. Works with every
hf_xformers MaskedLM model (``hfx-longformer``, ``hfx-bigbird``, ``hfx-linformer``, ``hfx-performer``,
``hfx-reformer``, ``hfx-universal``) and any ``transformers`` model ``AutoModelForMaskedLM`` loads (RoBERTa, BERT).

Data: text files (``.txt``: one document per line; ``.csv``/``.json``/``.jsonl``: the ``--text_column_name``
column), or a Hub dataset (``--dataset_name``, a local folder also works). Documents are tokenized, concatenated
and cut into blocks of ``--max_seq_length`` tokens (default: all the model's positions); the last partial block is
dropped; with ``--line_by_line`` every document is cut into pieces of its own instead, and ``--padding_free`` packs
each batch of pieces into one row without padding (hf_xformers models except hfx-linformer; the losses are those of
the padded ``--line_by_line`` run). ``DataCollatorForLanguageModeling`` masks 15 % of the tokens of every training
batch. The evaluation blocks are masked once, with ``--seed``, so every evaluation (and every model) is scored on the
same masked tokens.

Defaults. With ``--model_name_or_path`` (a pretrained or converted model) the recipe of the Longformer paper and its
conversion notebook applies to every option you do not set::

    --learning_rate 3e-5 --warmup_steps 500 --weight_decay 0.01 --adam_epsilon 1e-6 --max_grad_norm 5.0
    --per_device_train_batch_size 2 --gradient_accumulation_steps 32

(batch 2 x 32 = 64 blocks per update, 2^18 tokens at 4,096). Without it (``--model_type`` and ``--tokenizer_name``,
a model trained from scratch)::

    --learning_rate 5e-4 --warmup_steps 0.06 --weight_decay 0.01 --adam_epsilon 1e-6 --adam_beta2 0.98

(RoBERTa's pretraining settings; warm-up over 6 % of the steps). The log lists what was applied.

Metrics (``eval_results.json``): ``eval_mlm_loss`` (nats per masked token, averaged over tokens), ``eval_bits_per_token``,
``eval_bpc`` (bits per character: bits per token divided by the evaluation text's characters per token) and, per
bucket of ``--eval_bucket_size`` positions, ``eval_loss_<first>_<last>`` (e.g. ``eval_loss_0_511``,
``eval_loss_512_1023``): whether the positions past the source model's length learned.

``--copy_proj_layers`` (hfx-longformer) copies the trained local Q/K/V projections into the global ones after
training, as the recipe does: MLM pretraining uses no global attention, so the global projections would otherwise
stay at the values of the conversion.

Examples (see examples/README.md)::

    hfx-convert --source roberta-base --target longformer --max-length 4096 \\
        --attention-window 512 --output roberta-base-4096
    python -m examples.run_mlm --model_name_or_path roberta-base-4096 --train_file train.txt \\
        --validation_file valid.txt --max_steps 3000 --copy_proj_layers --output_dir roberta-base-4096-mlm
    python -m examples.run_mlm --model_type hfx-reformer --tokenizer_name my_tokenizer \\
        --config_overrides "hidden_size=256,num_hidden_layers=6,max_position_embeddings=4096" \\
        --train_file train.txt --max_steps 20000 --output_dir reformer-mlm

Writes the model, tokenizer, ``train_results.json``, ``eval_results.json`` and a model card (``README.md``) to
``--output_dir``; ``--self_contained`` adds the model's code and ``--push_to_hub`` uploads the folder. Training resumes
from the last ``checkpoint-*`` in ``--output_dir`` unless ``--overwrite_output_dir`` is given.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset, load_dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    EvalPrediction,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    set_seed,
)

import hf_xformers  # noqa: E402, F401  (registers the hfx-* model types with the Auto classes)
from examples.utils_examples import (  # noqa: E402
    LOCAL_FORMATS,
    RunArguments,
    apply_scratch_defaults,
    check_world_size,
    finish_output_dir,
    hub_model_id,
    load_local_file,
    model_origin,
    packed_collator,
    parse_script_args,
    resume_checkpoint,
    sequence_parallel_collator,
    setup_logging,
)
from hf_xformers.conversion.convert_roberta_to_long import copy_proj_layers  # noqa: E402
from hf_xformers.padding_free import DataCollatorForPackedDocuments  # noqa: E402

logger = logging.getLogger("run_mlm")

# Continued pretraining of a converted model: the Longformer paper (section 5) and its conversion notebook.
RECIPE = dict(
    learning_rate=3e-5,
    warmup_steps=500,
    weight_decay=0.01,
    adam_epsilon=1e-6,
    max_grad_norm=5.0,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=32,
)
# A model trained from scratch: RoBERTa's pretraining settings (peak lr scaled to a small model, 6 % warm-up).
SCRATCH = dict(learning_rate=5e-4, warmup_steps=0.06, weight_decay=0.01, adam_epsilon=1e-6, adam_beta2=0.98)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "pretrained or converted MaskedLM checkpoint (local folder or Hub id) to train further"},
    )
    model_type: str | None = field(
        default=None,
        metadata={"help": "train a new model of this type from scratch (e.g. hfx-reformer, roberta); needs "
                  "--tokenizer_name"},
    )  # fmt: skip
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "with --model_type: config fields 'name=value,...' (e.g. 'hidden_size=128,num_hidden_layers=2')"
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer (default: the model's)"})
    copy_proj_layers: bool = field(
        default=False,
        metadata={"help": "hfx-longformer: after training, copy the local Q/K/V projections into the global ones "
                  "(the recipe's copy_proj_layers)"},
    )  # fmt: skip
    cache_dir: str | None = None
    trust_remote_code: bool = False


@dataclass
class DataArguments:
    train_file: str | None = field(
        default=None, metadata={"help": ".txt (one document per line), .csv, .json or .jsonl"}
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "evaluation text (default: --validation_split_percentage of the training data)"}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset (or a local dataset folder)"})
    dataset_config_name: str | None = None
    text_column_name: str = field(default="text", metadata={"help": "column holding the documents"})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "documents held out for evaluation when there is no validation file or split"}
    )
    max_seq_length: int | None = field(
        default=None, metadata={"help": "tokens per block (default: all the positions of the model)"}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "fraction of tokens masked"})
    line_by_line: bool = field(
        default=False,
        metadata={"help": "keep every document apart (a line of a .txt file, a row of a dataset): each one is cut "
                  "into pieces of at most --max_seq_length tokens instead of running on into the next one's block; "
                  "batches are padded (or packed, with --padding_free)"},
    )  # fmt: skip
    padding_free: bool = field(
        default=False,
        metadata={"help": "implies --line_by_line: pack every batch of pieces into one row without padding "
                  "(hf_xformers models; not hfx-linformer); every piece attends only to itself, as when padded"},
    )  # fmt: skip
    eval_bucket_size: int = field(
        default=512, metadata={"help": "positions per bucket of the per-position evaluation (e.g. the source length)"}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "use at most this many training blocks"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "use at most this many evaluation blocks"})


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def read_text_file(path: str, text_column: str, cache_dir: str | None = None) -> Dataset:
    """Documents of one local file as a ``text`` column: ``.txt`` one per non-empty line, csv/json/jsonl the
    ``text_column``.

    Raises:
        ValueError: the file is missing, of another type, lacks ``text_column`` or holds no text.
    """
    suffix = Path(path).suffix.lower()
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file.")
    if suffix in (".txt", ".text", ".raw"):
        with open(path, encoding="utf-8") as f:
            documents = [line.strip() for line in f]
        data = Dataset.from_dict({"text": [d for d in documents if d]})
    elif suffix in LOCAL_FORMATS:
        if os.path.getsize(path) == 0:
            raise ValueError(f"{path} is empty: it holds no text to train or evaluate on.")
        data = select_text(load_local_file(path, cache_dir), text_column, path)
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .txt or one of {sorted(LOCAL_FORMATS)}.")
    if len(data) == 0:
        raise ValueError(f"{path} holds no text (no non-empty document): give a file with text to train on.")
    return data


def select_text(data: Dataset, text_column: str, source: str) -> Dataset:
    """Only the non-empty documents of ``text_column``, renamed ``text``.

    Raises:
        ValueError: the column is missing or every document is empty.
    """
    if text_column not in data.column_names:
        raise ValueError(
            f"{source} has no column {text_column!r} (found {data.column_names}); pass --text_column_name."
        )
    data = data.select_columns([text_column])
    if text_column != "text":
        data = data.rename_column(text_column, "text")
    data = data.filter(lambda row: bool(row["text"] and row["text"].strip()))
    if len(data) == 0:
        raise ValueError(f"{source} holds no text (every {text_column!r} is empty).")
    return data


def load_documents(args: DataArguments, cache_dir: str | None = None) -> tuple[Dataset | None, Dataset]:
    """``(train, validation)`` documents (a ``text`` column); train is None for an evaluation-only run.

    Raises:
        ValueError: no data given, or a file/dataset without text.
    """
    if args.dataset_name:
        splits = load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=cache_dir)
        train = select_text(splits["train"], args.text_column_name, args.dataset_name) if "train" in splits else None
        valid = next((splits[s] for s in ("validation", "valid", "test") if s in splits), None)
        valid = select_text(valid, args.text_column_name, args.dataset_name) if valid is not None else None
    elif args.train_file or args.validation_file:
        train = read_text_file(args.train_file, args.text_column_name, cache_dir) if args.train_file else None
        valid = read_text_file(args.validation_file, args.text_column_name, cache_dir) if args.validation_file else None
    else:
        raise ValueError("No data: pass --train_file (and --validation_file) or --dataset_name.")
    if valid is None:
        if train is None or len(train) < 2:
            raise ValueError(
                "Evaluation needs a --validation_file (or a validation split), or at least two training documents "
                "to hold some out with --validation_split_percentage."
            )
        held_out = max(1, len(train) * args.validation_split_percentage // 100)
        # The last documents, not a random draw: neighbouring lines of a corpus often continue one another.
        train, valid = (
            train.select(range(len(train) - held_out)),
            train.select(range(len(train) - held_out, len(train))),
        )
    return train, valid


def tokenize_documents(data: Dataset, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """Each document's token ids with the tokenizer's special tokens (``<s> ... </s>``) and their mask."""

    def tokenize(batch: dict) -> dict:
        # verbose=False: long documents exceed model_max_length on purpose; they are cut into blocks next.
        return tokenizer(batch["text"], return_special_tokens_mask=True, verbose=False)

    return data.map(tokenize, batched=True, remove_columns=data.column_names, desc="tokenizing")


def group_into_blocks(data: Dataset, block_size: int) -> Dataset:
    """Concatenate the tokenized documents and cut them into ``block_size`` tokens (the partial last block is
    dropped). Only ``input_ids`` and ``special_tokens_mask`` are kept: the blocks have no padding."""
    columns = ["input_ids", "special_tokens_mask"]

    def group(batch: dict) -> dict:
        out = {}
        for name in columns:
            flat = [token for row in batch[name] for token in row]
            usable = len(flat) // block_size * block_size
            out[name] = [flat[i : i + block_size] for i in range(0, usable, block_size)]
        return out

    # One batch of 1,000 documents at a time: a document's tail runs on into the next one's head within it.
    return data.map(group, batched=True, batch_size=1000, remove_columns=data.column_names, desc="grouping")


def cut_documents(data: Dataset, block_size: int) -> Dataset:
    """Every tokenized document on its own (``--line_by_line``), cut into pieces of at most ``block_size`` tokens (the
    last piece of a document may be shorter). Keeps ``input_ids`` and ``special_tokens_mask``."""
    columns = ["input_ids", "special_tokens_mask"]

    def cut(batch: dict) -> dict:
        out = {name: [] for name in columns}
        for row in range(len(batch["input_ids"])):
            for start in range(0, len(batch["input_ids"][row]), block_size):
                for name in columns:
                    out[name].append(batch[name][row][start : start + block_size])
        return out

    return data.map(cut, batched=True, remove_columns=data.column_names, desc="cutting documents")


def unpadded(rows: torch.Tensor, lengths: list[int], padding_side: str) -> list[list[int]]:
    """The first (right padding) or last (left padding) ``lengths[i]`` values of every row of ``rows``."""
    if padding_side == "left":
        return [row[len(row) - n :].tolist() for row, n in zip(rows, lengths)]
    return [row[:n].tolist() for row, n in zip(rows, lengths)]


def mask_once(blocks: Dataset, tokenizer: PreTrainedTokenizerBase, probability: float, seed: int) -> Dataset:
    """The evaluation blocks with their masks drawn once (``input_ids``, ``labels``): every evaluation and every
    model sees the same masked tokens, so their losses compare token for token. Blocks of different lengths
    (``--line_by_line``) keep their own lengths."""
    if len(blocks) == 0:
        return Dataset.from_dict({"input_ids": [], "labels": []})
    # One call over all the blocks: the collator's own generator, seeded, draws every mask.
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=probability, seed=seed)
    # transformers < 5.19 skips seeding for seed=0 (`if self.seed and ...`) and draws from the global RNG: set the
    # generator its create_rng() would make (the same numbers on every release).
    collator.generator = torch.Generator().manual_seed(seed)
    batch = collator([{"input_ids": ids, "special_tokens_mask": special}
                      for ids, special in zip(blocks["input_ids"], blocks["special_tokens_mask"])])  # fmt: skip
    lengths = [len(ids) for ids in blocks["input_ids"]]
    return Dataset.from_dict({key: unpadded(batch[key], lengths, tokenizer.padding_side)
                              for key in ("input_ids", "labels")})  # fmt: skip


class MaskingCollator:
    """``DataCollatorForLanguageModeling`` for training blocks; evaluation blocks that already carry ``labels``
    (:func:`mask_once`) are only stacked (padded, with an ``attention_mask``, when their lengths differ).

    With ``packed`` (``--padding_free``) every batch becomes one row of unpadded blocks: training blocks are masked
    first, exactly as a padded batch of them would be (the same random draws over the padded shape), then cut back
    to their lengths and packed, each block's labels aligned with its own tokens.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        probability: float,
        packed: DataCollatorForPackedDocuments | None = None,
    ) -> None:
        self.mlm = DataCollatorForLanguageModeling(tokenizer, mlm_probability=probability)
        self.pad_token_id = tokenizer.pad_token_id
        self.packed = packed

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        if self.packed is not None:
            if "labels" not in features[0]:
                batch = self.mlm(features)
                side = self.mlm.tokenizer.padding_side
                features = [{"input_ids": ids, "labels": labels} for ids, labels in
                            zip(unpadded(batch["input_ids"], lengths, side), unpadded(batch["labels"], lengths, side))]  # fmt: skip
            return self.packed([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features])
        if "labels" not in features[0]:
            return self.mlm(features)
        if len(set(lengths)) == 1:
            return {key: torch.tensor([f[key] for f in features], dtype=torch.long) for key in ("input_ids", "labels")}
        longest = max(lengths)
        batch = {
            "input_ids": torch.full((len(features), longest), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(features), longest), -100, dtype=torch.long),
            "attention_mask": torch.zeros(len(features), longest, dtype=torch.long),
        }
        for row, (feature, n) in enumerate(zip(features, lengths)):
            batch["input_ids"][row, :n] = torch.tensor(feature["input_ids"])
            batch["labels"][row, :n] = torch.tensor(feature["labels"])
            batch["attention_mask"][row, :n] = 1
        return batch


def characters_per_token(documents: Dataset, tokenized: Dataset) -> float:
    """Characters of the text per (non-special) token: turns bits per token into bits per character."""
    characters = sum(len(text) for text in documents["text"])
    tokens = sum(len(mask) - sum(mask) for mask in tokenized["special_tokens_mask"])
    return characters / max(tokens, 1)


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------


def token_losses(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood ``(batch, seq_len)`` in nats, 0 where ``labels`` is -100.

    Used as Trainer's ``preprocess_logits_for_metrics``: evaluation keeps one number per token, not the
    ``(batch, seq_len, vocab)`` logits.
    """
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none"
    )


def mlm_metrics(
    losses: np.ndarray,
    labels: np.ndarray,
    bucket_size: int,
    chars_per_token: float | None,
    positions: np.ndarray | None = None,
    length: int | None = None,
) -> dict:
    """Token-averaged MLM metrics of per-token ``losses`` ``(blocks, seq_len)`` (nats) over the masked positions
    (``labels != -100``), overall and per bucket of ``bucket_size`` positions.

    ``positions`` ``(blocks, seq_len)``: each token's position in its block (packed rows, ``--padding_free``); by
    default its column. ``length``: the block length the buckets cover (default ``seq_len``).

    Returns:
        ``mlm_loss``, ``bits_per_token``, ``bpc`` (when ``chars_per_token`` is given), ``masked_tokens`` and
        ``loss_<first>_<last>`` for every bucket with a masked token.
    """
    masked = labels != -100
    count = int(masked.sum())
    if count == 0:
        raise ValueError("The evaluation blocks have no masked token: give more evaluation text.")
    loss = float(losses[masked].sum() / count)
    metrics = {"mlm_loss": loss, "bits_per_token": loss / math.log(2), "masked_tokens": count}
    if chars_per_token:
        metrics["bpc"] = metrics["bits_per_token"] / chars_per_token
    length = labels.shape[1] if length is None else length
    if positions is None:
        positions = np.broadcast_to(np.arange(labels.shape[1]), labels.shape)
    for start in range(0, length, bucket_size):
        end = min(start + bucket_size, length)
        in_bucket = masked & (positions >= start) & (positions < end)
        if in_bucket.any():
            metrics[f"loss_{start}_{end - 1}"] = float(losses[in_bucket].sum() / in_bucket.sum())
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


def parse_overrides(text: str | None) -> dict:
    """``'hidden_size=128,hidden_act=gelu'`` -> ``{'hidden_size': 128, 'hidden_act': 'gelu'}`` (ints, floats,
    booleans and ``a;b`` lists of them are converted).

    Raises:
        ValueError: an item is not ``name=value``.
    """

    def value_of(raw: str):
        if ";" in raw:
            return [value_of(part) for part in raw.split(";") if part]
        if raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        for kind in (int, float):
            try:
                return kind(raw)
            except ValueError:
                pass
        return raw

    overrides = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        if "=" not in item:
            raise ValueError(f"--config_overrides: {item!r} is not name=value (e.g. 'hidden_size=128').")
        name, raw = item.split("=", 1)
        overrides[name.strip()] = value_of(raw.strip())
    return overrides


def load_config(args: ModelArguments):
    """The model's config, checked to have a masked-LM head.

    Raises:
        ValueError: neither or both of --model_name_or_path/--model_type, an unknown field in --config_overrides,
            or a model type without a MaskedLM head.
    """
    if bool(args.model_name_or_path) == bool(args.model_type):
        raise ValueError(
            "Pass --model_name_or_path (a pretrained or converted model to train further) or --model_type with "
            "--tokenizer_name (a new model), not both or neither."
        )
    source = args.model_name_or_path or args.model_type
    if args.model_name_or_path:
        if args.config_overrides:
            raise ValueError("--config_overrides applies to a new model (--model_type), not to --model_name_or_path.")
        config = AutoConfig.from_pretrained(source, cache_dir=args.cache_dir, trust_remote_code=args.trust_remote_code)
    else:
        if not args.tokenizer_name:
            raise ValueError("A new model (--model_type) needs --tokenizer_name: the tokenizer fixes its vocabulary.")
        config = AutoConfig.for_model(args.model_type)
        overrides = parse_overrides(args.config_overrides)
        unknown = [name for name in overrides if not hasattr(config, name)]
        if unknown:
            raise ValueError(f"--config_overrides: {args.model_type} configs have no field(s) {unknown}.")
        config = AutoConfig.for_model(args.model_type, **overrides)
    if type(config) not in AutoModelForMaskedLM._model_mapping:
        raise ValueError(
            f"{source!r} is a {config.model_type!r} model, which has no masked-LM head: run_mlm.py trains "
            "hfx-longformer, hfx-bigbird, hfx-linformer, hfx-performer, hfx-reformer, hfx-universal, RoBERTa, BERT "
            "and other AutoModelForMaskedLM models. For Transformer-XL language modelling use examples/run_clm.py."
        )
    return config


def model_positions(model: PreTrainedModel) -> int | None:
    """How many tokens the model's position table serves (None when it has no limit we know of)."""
    embeddings = getattr(model.base_model, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "max_tokens"):
        return int(embeddings.max_tokens)  # hf_xformers text models
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return None
    table = getattr(embeddings, "position_embeddings", None)
    padding_idx = getattr(table, "padding_idx", None)
    # RoBERTa-style tables number tokens from padding_idx + 1: the first rows serve no token.
    return int(limit) - (padding_idx + 1 if padding_idx is not None else 0)


def block_size_for(requested: int | None, model: PreTrainedModel) -> int:
    """The block length: ``requested`` or all the model's positions.

    Raises:
        ValueError: the requested length exceeds the positions, or neither is known.
    """
    positions = model_positions(model)
    if requested is None:
        if positions is None:
            raise ValueError(
                f"{model.config.model_type} models have no position limit to default to: pass --max_seq_length."
            )
        return positions
    if requested < 1:
        raise ValueError(f"--max_seq_length must be positive, got {requested}.")
    if positions is not None and requested > positions:
        raise ValueError(
            f"--max_seq_length {requested} exceeds the {positions} tokens the model's positions cover. Use "
            f"--max_seq_length {positions} or less, or make a longer model with hfx-convert "
            "--max-length."
        )
    return requested


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    """``(ModelArguments, DataArguments, TrainingArguments, RunArguments)`` from ``argv`` or a single ``.json``
    file argument."""
    return parse_script_args((ModelArguments, DataArguments, TrainingArguments, RunArguments), argv, __doc__)


def configure(data_args: DataArguments, training_args: TrainingArguments, argv: list[str] | None, new_model: bool):
    """The optimisation defaults of a new model or of continued pretraining where the command line sets none
    (logged), and the data options that follow from others; refuses a non-positive ``--eval_bucket_size``."""
    defaults = SCRATCH if new_model else RECIPE
    reason = "New model trained from scratch" if new_model else "Continued pretraining (the Longformer recipe)"
    apply_scratch_defaults(training_args, argv, defaults, logger, reason)
    logger.info(
        "Optimisation: lr %g, warm-up %s, weight decay %g, adam epsilon %g, gradient clipping %g, batch %d x %d "
        "accumulation x %d process(es)",
        training_args.learning_rate, training_args.warmup_steps, training_args.weight_decay,
        training_args.adam_epsilon, training_args.max_grad_norm, training_args.per_device_train_batch_size,
        training_args.gradient_accumulation_steps, training_args.world_size,
    )  # fmt: skip
    if data_args.eval_bucket_size < 1:
        raise ValueError(f"--eval_bucket_size must be positive, got {data_args.eval_bucket_size}.")
    if data_args.padding_free and not data_args.line_by_line:
        logger.info("--padding_free: documents are kept apart (--line_by_line) and packed, not run on into blocks.")
        data_args.line_by_line = True


def load_tokenizer_and_model(model_args: ModelArguments, new_model: bool):
    """``(tokenizer, masked-LM model)``: the checkpoint's, or a new model of ``--config_name`` sized to the
    tokenizer and given its special ids. Refuses a tokenizer without a mask token, and ``--copy_proj_layers`` for a
    model without global projections."""
    config = load_config(model_args)
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    if tokenizer.mask_token is None:
        raise ValueError(
            f"The tokenizer of {model_args.tokenizer_name or model_args.model_name_or_path!r} has no mask token."
        )
    if new_model:
        if len(tokenizer) > config.vocab_size:
            config.vocab_size = len(tokenizer)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id"):
            token_id = getattr(tokenizer, name, None)
            if token_id is not None and hasattr(config, name):
                setattr(config, name, token_id)
        model = AutoModelForMaskedLM.from_config(config, trust_remote_code=model_args.trust_remote_code)
    else:
        model = AutoModelForMaskedLM.from_pretrained(
            model_args.model_name_or_path,
            config=config,
            cache_dir=model_args.cache_dir,
            trust_remote_code=model_args.trust_remote_code,
        )
    if model_args.copy_proj_layers and not any(hasattr(m, "query_global") for m in model.modules()):
        raise ValueError(
            f"--copy_proj_layers: a {config.model_type!r} model has no global Q/K/V projections (only hfx-longformer has)."
        )
    return tokenizer, model


def make_blocks(data_args: DataArguments, training_args: TrainingArguments, tokenizer, train_docs, valid_docs,
                block_size: int):  # fmt: skip
    """``(train, valid_blocks, valid_tokens)``: the documents tokenized and cut into blocks of ``block_size`` tokens
    (run on, or one document a block with ``--line_by_line``), at most ``--max_*_samples`` blocks; ``train`` is None
    without ``train_docs``. Refuses a text shorter than one block."""
    blocks_of = cut_documents if data_args.line_by_line else group_into_blocks
    with training_args.main_process_first(desc="tokenizing"):
        train = None
        if train_docs is not None:
            train = blocks_of(tokenize_documents(train_docs, tokenizer), block_size)
            if data_args.max_train_samples is not None:
                train = train.select(range(min(data_args.max_train_samples, len(train))))
        valid_tokens = tokenize_documents(valid_docs, tokenizer)
        valid_blocks = blocks_of(valid_tokens, block_size)
    if data_args.max_eval_samples is not None:
        valid_blocks = valid_blocks.select(range(min(data_args.max_eval_samples, len(valid_blocks))))
    for name, blocks in (("training", train), ("evaluation", valid_blocks)):
        if blocks is not None and len(blocks) == 0:
            raise ValueError(
                f"The {name} text is shorter than one block of {block_size} tokens: give more text or a smaller "
                "--max_seq_length."
            )
    return train, valid_blocks, valid_tokens


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the script; returns the training and evaluation metrics (also written to ``output_dir``)."""
    model_args, data_args, training_args, run_args = parse_args(argv)
    setup_logging(training_args, logger)
    check_world_size(training_args)
    new_model = not model_args.model_name_or_path
    configure(data_args, training_args, argv, new_model)
    checkpoint = resume_checkpoint(training_args, run_args.overwrite_output_dir)
    set_seed(training_args.seed)
    do_train = training_args.do_train or not training_args.do_eval

    # Everything that can be wrong with the data or the model fails here, before any training.
    train_docs, valid_docs = load_documents(data_args, model_args.cache_dir)
    if do_train and train_docs is None:
        raise ValueError(
            "Training needs --train_file (or a dataset with a train split); pass --do_eval alone to evaluate."
        )
    tokenizer, model = load_tokenizer_and_model(model_args, new_model)
    block_size = block_size_for(data_args.max_seq_length, model)
    # A model that cannot take packed batches fails here, before the data are tokenized.
    packed = packed_collator(model, training_args, logger) if data_args.padding_free else None
    train, valid_blocks, valid_tokens = make_blocks(
        data_args, training_args, tokenizer, train_docs if do_train else None, valid_docs, block_size
    )
    evaluation = mask_once(valid_blocks, tokenizer, data_args.mlm_probability, training_args.seed)
    chars_per_token = characters_per_token(valid_docs, valid_tokens)
    logger.info(
        "%s blocks of %d tokens to train on, %d to evaluate on (%.2f characters per token)",
        len(train) if train is not None else 0, block_size, len(evaluation), chars_per_token,
    )  # fmt: skip

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        labels, positions = prediction.label_ids, None
        if packed is not None:  # (labels, position_ids) of packed rows: buckets by position in the block
            labels, positions = labels[0], labels[1] - packed.position_ids_start
        return mlm_metrics(
            prediction.predictions, labels, data_args.eval_bucket_size, chars_per_token, positions, block_size
        )

    def packed_token_losses(logits: torch.Tensor | tuple, labels: tuple) -> torch.Tensor:
        return token_losses(logits, labels[0])

    training_args.prediction_loss_only = False  # the per-token losses reach compute_metrics
    if packed is not None and training_args.label_names is None:
        # A packed row's columns are no positions: its position_ids reach compute_metrics beside the labels.
        training_args.label_names = ["labels", "position_ids"]
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=sequence_parallel_collator(
            MaskingCollator(tokenizer, data_args.mlm_probability, packed),
            model,
            training_args,
            block_size,
            packed is not None,
            logger,
        ),
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=token_losses if packed is None else packed_token_losses,
    )

    metrics: dict[str, float] = {}
    if do_train:
        metrics.update(train_model(trainer, checkpoint, model_args.copy_proj_layers, block_size))
    eval_metrics = trainer.evaluate()
    eval_metrics["eval_samples"] = len(evaluation)
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    metrics.update(eval_metrics)
    finish(trainer, run_args, model_args, data_args, trained=do_train, block_size=block_size)
    return metrics


def train_model(trainer: Trainer, checkpoint: str | None, copy_projections: bool, block_size: int) -> dict[str, float]:
    """Train (resuming from ``checkpoint``), then with ``copy_projections`` copy the trained local Q/K/V projections
    into the global ones (the recipe's last step); save the model, state and metrics; returns the metrics."""
    result = trainer.train(resume_from_checkpoint=checkpoint)
    if copy_projections:
        copied = copy_proj_layers(trainer.model)
        logger.info("Copied the local Q/K/V projections into the global ones in %d layers.", copied)
    trainer.save_model()
    train_metrics = {**result.metrics, "train_samples": len(trainer.train_dataset), "block_size": block_size}
    trainer.log_metrics("train", train_metrics)
    trainer.save_metrics("train", train_metrics)
    trainer.save_state()
    return train_metrics


def finish(
    trainer: Trainer, run_args: RunArguments, model_args: ModelArguments, data_args: DataArguments, *, trained: bool,
    block_size: int,
) -> None:  # fmt: skip
    """An upload-ready output_dir: the model card (with --self_contained also the model code); --push_to_hub
    uploads it."""
    new_model = not model_args.model_name_or_path
    source = f"`{data_args.dataset_name}`" if data_args.dataset_name else f"`{Path(data_args.train_file or '').name}`"
    start = f"continued from {model_origin(model_args.model_name_or_path)}" if not new_model else "trained from scratch"
    finish_output_dir(
        trainer,
        run_args,
        trained=trained,
        base_model=hub_model_id(model_args.model_name_or_path),
        summary=f"Masked-LM pretraining {start} on {source} with `examples/run_mlm.py` of hf_xformers, in blocks of "
        f"{block_size} tokens. `eval_mlm_loss` is in nats per masked token, `eval_loss_<first>_<last>` per position "
        "bucket.",
        datasets=[data_args.dataset_name] if data_args.dataset_name else None,
        dataset_name=data_args.dataset_name or Path(data_args.train_file or data_args.validation_file).name,
        dataset_type=data_args.dataset_name or "local",
        task_type="fill-mask",
        extra_hyperparameters={"block_size": block_size, "mlm_probability": data_args.mlm_probability,
                               "copy_proj_layers": model_args.copy_proj_layers},
    )  # fmt: skip


if __name__ == "__main__":
    main()
