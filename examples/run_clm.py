"""Language modelling on a plain text file with Transformer-XL (``hfx-transfo-xl``) and the Trainer.

The text is tokenised by characters (``--level char``, reports bits per character) or by whitespace-separated
words with an ``<eos>`` at each line end (``--level word``, reports perplexity). Training and evaluation both run
over parallel streams, segment by segment, with the memories carried from one step to the next
(``HfxStreamSegments`` + ``HfxRecurrentTrainer``): every evaluated token is scored once, with up to ``mem_len``
tokens of context per layer from earlier segments.

Example::

    python -m examples.run_clm --train_file train.txt --validation_file valid.txt --level char \\
        --output_dir out --max_steps 2000 --per_device_train_batch_size 16 --segment_length 128 --mem_len 128

Writes the model, ``vocab.json``, ``eval_results.json`` (``eval_loss`` in nats per token, plus
``eval_bpc`` or ``eval_perplexity``) and a model card (``README.md``) to ``--output_dir``; ``--self_contained`` adds
the model's code (the folder then loads with ``trust_remote_code=True`` where hf_xformers is not installed) and
``--push_to_hub`` uploads the folder. ``--model_name_or_path`` continues from a saved hfx-transfo-xl model (its
``vocab.json`` is reused) instead of building one from the size options. A new model is trained with
``--learning_rate 1e-3 --warmup_steps 0.1`` (10 % of the steps) unless those are given: the Trainer's defaults suit
fine-tuning, not training from scratch. The log says which were applied.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TrainingArguments, set_seed  # noqa: E402

from examples.utils_examples import (  # noqa: E402
    HubArguments,
    apply_scratch_defaults,
    finish_output_dir,
    hub_model_id,
    model_origin,
    parse_script_args,
)
from hf_xformers import (  # noqa: E402
    HfxRecurrentTrainer,
    HfxStreamSegments,
    HfxTransfoXLConfig,
    HfxTransfoXLForCausalLM,
)

logger = logging.getLogger(__name__)
UNK, EOS = "<unk>", "<eos>"
# The Trainer's learning rate (5e-5, no warm-up) suits fine-tuning; a new model trained with it stays at the
# letter-frequency entropy (4.85 bits per character after 300 steps on Hamlet; 4.80 for unigram frequencies), with
# these it reaches 3.36 in the same steps.
SCRATCH_TRAINING = dict(learning_rate=1e-3, warmup_steps=0.1)


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "plain UTF-8 text file to train on"})
    validation_file: str | None = field(
        default=None, metadata={"help": "text file to evaluate on (default: the last 10%% of the training text)"}
    )
    level: str = field(default="char", metadata={"help": "'char' (bits per character) or 'word' (perplexity)"})
    segment_length: int = field(default=64, metadata={"help": "tokens per segment (the paper's tgt_len)"})
    padding_free: bool = field(
        default=False,
        metadata={"help": "refused: Transformer-XL takes no packed batches; its stream segments hold no padding"},
    )


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "saved hfx-transfo-xl directory; without it a new model is built from the size options and trained "
            "with --learning_rate 1e-3 --warmup_steps 0.1 unless you set them"
        },
    )
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_inner: int = 512
    mem_len: int = field(default=64, metadata={"help": "memory length per layer (0: no recurrence)"})
    clamp_len: int = 0
    same_length: bool = False
    cutoffs: str = field(default="", metadata={"help": "adaptive softmax cutoffs, comma separated ('' for none)"})
    div_val: int = 1
    dropout: float = 0.1


def tokenize(text: str, level: str) -> list[str]:
    """Characters, or whitespace-separated words with ``<eos>`` closing every line."""
    if level == "char":
        return list(text)
    return [token for line in text.splitlines() for token in (*line.split(), EOS)]


def build_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id by decreasing frequency (so adaptive-softmax cutoffs put frequent tokens in the head), ``<unk>`` last."""
    ordered = [token for token, _ in Counter(tokens).most_common()]
    return {token: i for i, token in enumerate([*ordered, UNK])}


def encode(tokens: list[str], vocab: dict[str, int]) -> torch.Tensor:
    unk = vocab[UNK]
    return torch.tensor([vocab.get(token, unk) for token in tokens], dtype=torch.long)


def load_saved_model(source: Path) -> tuple[HfxTransfoXLForCausalLM, dict[str, int]]:
    """The hfx-transfo-xl model and ``vocab.json`` that this script saved in ``source``.

    Raises:
        ValueError: ``source`` is not such a folder (missing or damaged files, another model type), with what to do.
    """
    config_file, vocab_file = source / "config.json", source / "vocab.json"
    if not config_file.is_file():
        raise ValueError(f"--model_name_or_path {str(source)!r} has no config.json: pass a folder this script saved.")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error.msg} at line {error.lineno}).") from error
    if model_type != "hfx-transfo-xl":
        raise ValueError(
            f"--model_name_or_path {str(source)!r} holds a {model_type!r} model; run_clm.py trains hfx-transfo-xl "
            "language models. Pass a folder this script saved, or leave --model_name_or_path out to train a new model."
        )
    if not vocab_file.is_file():
        raise ValueError(
            f"--model_name_or_path {str(source)!r} has no vocab.json (the vocabulary run_clm.py writes next to the "
            "model): pass a folder this script saved."
        )
    return HfxTransfoXLForCausalLM.from_pretrained(source), json.loads(vocab_file.read_text())


def parse_args(argv: list[str] | None = None):
    """``(ModelArguments, DataArguments, TrainingArguments, HubArguments)`` from the command line (``argv``), or from
    a single ``.json`` file argument."""
    return parse_script_args((ModelArguments, DataArguments, TrainingArguments, HubArguments), argv, __doc__)


def main(argv: list[str] | None = None) -> dict[str, float]:
    model_args, data_args, training_args, hub_args = parse_args(argv)
    if not model_args.model_name_or_path:
        apply_scratch_defaults(training_args, argv, SCRATCH_TRAINING, logger)
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING)
    if data_args.level not in ("char", "word"):
        raise ValueError(f"--level must be 'char' or 'word', got {data_args.level!r}.")
    if data_args.padding_free:
        raise ValueError(
            "--padding_free: run_clm.py trains Transformer-XL (hfx-transfo-xl), which cannot take packed "
            "(padding-free) batches: its memories and relative positions run across the whole segment, so packed "
            "documents would see one another. Its segments are cut from continuous streams and hold no padding to "
            "remove: run without --padding_free."
        )
    set_seed(training_args.seed)

    train_path = Path(data_args.train_file)
    if not train_path.is_file():
        raise ValueError(f"--train_file {str(train_path)!r} does not exist.")
    train_tokens = tokenize(train_path.read_text(encoding="utf-8"), data_args.level)
    if data_args.validation_file:
        valid_tokens = tokenize(Path(data_args.validation_file).read_text(encoding="utf-8"), data_args.level)
    else:
        split = int(len(train_tokens) * 0.9)
        train_tokens, valid_tokens = train_tokens[:split], train_tokens[split:]

    if model_args.model_name_or_path:
        model, vocab = load_saved_model(Path(model_args.model_name_or_path))
    else:
        vocab = build_vocab(train_tokens)
        cutoffs = [int(c) for c in model_args.cutoffs.split(",") if c.strip()]
        config = HfxTransfoXLConfig(
            vocab_size=len(vocab), cutoffs=cutoffs, div_val=model_args.div_val, d_model=model_args.d_model,
            n_layer=model_args.n_layer, n_head=model_args.n_head, d_inner=model_args.d_inner,
            mem_len=model_args.mem_len, clamp_len=model_args.clamp_len, same_length=model_args.same_length,
            dropout=model_args.dropout, eos_token_id=vocab.get(EOS, 0),
        )  # fmt: skip
        model = HfxTransfoXLForCausalLM(config)

    length = data_args.segment_length
    train_data = HfxStreamSegments(encode(train_tokens, vocab), training_args.per_device_train_batch_size, length)
    valid_data = HfxStreamSegments(encode(valid_tokens, vocab), training_args.per_device_eval_batch_size, length)
    training_args.prediction_loss_only = True  # the metrics come from the loss; logits would only fill memory
    trainer = HfxRecurrentTrainer(model=model, args=training_args, train_dataset=train_data, eval_dataset=valid_data)

    do_train = training_args.do_train or not training_args.do_eval
    if do_train:
        trainer.train()
        trainer.save_model()
        trainer.save_state()  # trainer_state.json: the logged losses and learning rates
        Path(training_args.output_dir, "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    metrics = trainer.evaluate()
    loss = metrics["eval_loss"]
    if data_args.level == "char":
        metrics["eval_bpc"] = loss / math.log(2)
    else:
        metrics["eval_perplexity"] = math.exp(loss)
    metrics["eval_tokens"] = len(valid_data) * length
    trainer.save_metrics("eval", metrics)
    logger.info("Evaluation: %s", metrics)

    # An upload-ready output_dir: the model card (with --self_contained also the model code); --push_to_hub uploads it.
    units = "characters" if data_args.level == "char" else "whitespace-separated words, with `<eos>` ending each line"
    origin = model_args.model_name_or_path
    start = f"trained further from {model_origin(origin)}" if origin else "trained from scratch"
    finish_output_dir(
        trainer,
        hub_args,
        trained=do_train,
        base_model=hub_model_id(model_args.model_name_or_path),
        summary=f"A Transformer-XL language model {start} on `{train_path.name}` with `examples/run_clm.py` of "
        "hf_xformers: parallel streams, segment by segment, with the memories carried across segments. Its tokens are "
        f"{units}; `vocab.json` maps them to ids (there are no tokenizer files). `eval_loss` is in nats per token.",
        dataset_name=train_path.name,
        dataset_type="local",
        task_type="text-generation",
        extra_hyperparameters={"level": data_args.level, "segment_length": length, "mem_len": model.config.mem_len},
    )
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
