"""Multi-hop multiple-choice QA over long contexts (WikiHop) with ``transformers.Trainer``.

The Longformer paper's recipe (Beltagy et al., 2020, section 6), on top of any encoder ``AutoModel`` loads
(``hfx-longformer`` is the one it is meant for):

* input: ``<s> [q] question [/q] [ent] candidate 1 [/ent] ... [ent] candidate N [/ent] </s>`` followed by the
  supporting documents, each ended by ``</s>``; the four markers are added to the tokenizer and the embeddings
  are resized;
* global attention on the question and candidate tokens (the whole prefix) when the model has global attention
  (``hfx-longformer``, transformers' Longformer); other models get no ``global_attention_mask``;
* a candidate's score is a linear layer on the mean hidden state of its tokens (markers included);
* a document longer than ``--max_seq_length`` (default: all the model takes, 4096 for a Longformer-base) is cut
  into chunks, each the same question+candidates prefix followed by the next slice of the supports; the chunk
  scores of each candidate are averaged;
* cross-entropy over the candidates, accuracy as the metric.

Data: WikiHop's JSON (qangaroo ``wikihop/train.json`` and ``dev.json``): a list of objects with ``id``, ``query``
(``"relation subject"``), ``candidates``, ``answer`` (one of the candidates) and ``supports`` (documents).
Outputs in ``--output_dir``: ``eval_results.json`` (``eval_accuracy``), ``train_results.json``, and the
fine-tuned encoder + tokenizer (reloadable with ``AutoModel``) with the candidate scorer in
``wikihop_head.safetensors``; pass that folder as ``--model_name_or_path`` to evaluate it again.

    python -m examples.run_wikihop --model_name_or_path path/to/longformer-base-4096 \\
        --train_file qangaroo_v1.1/wikihop/train.json --validation_file qangaroo_v1.1/wikihop/dev.json \\
        --do_train --do_eval --per_device_train_batch_size 1 --gradient_accumulation_steps 32 \\
        --learning_rate 3e-5 --num_train_epochs 15 --output_dir out/wikihop

Training resumes from the last ``checkpoint-*`` in ``--output_dir`` (or ``--resume_from_checkpoint PATH``)
unless ``--overwrite_output_dir`` is given. ``--padding_free`` packs the chunks of every batch into one row without
padding (hf_xformers encoders except hfx-linformer; every chunk attends only to itself, so the scores are the padded
run's).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import numpy as np
import torch
import torch.nn.functional as F
from datasets import Dataset
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoModel,
    AutoTokenizer,
    EvalPrediction,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.modeling_outputs import MultipleChoiceModelOutput

import hf_xformers  # noqa: F401  (registers the hfx-* model types with the Auto classes)
from examples.utils_examples import (
    RunArguments,
    check_world_size,
    finish_output_dir,
    hub_model_id,
    load_local_file,
    model_max_tokens,
    model_origin,
    packed_collator,
    parse_script_args,
    require_columns,
    resume_checkpoint,
    setup_logging,
    supports_global_attention,
    take,
)
from hf_xformers.padding_free import DataCollatorForPackedDocuments

logger = logging.getLogger("run_wikihop")

QUESTION_MARKERS = ("[q]", "[/q]")
CANDIDATE_MARKERS = ("[ent]", "[/ent]")
REQUIRED_FIELDS = ["query", "candidates", "answer", "supports"]
HEAD_FILE = "wikihop_head.safetensors"


@dataclass
class ModelArguments:
    """Which encoder and tokenizer to start from."""

    model_name_or_path: str = field(
        metadata={"help": "Local folder or Hub id of the encoder (or an output_dir of this script)."}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer to use instead of the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Cache for downloaded models and datasets."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom code from the Hub (trusted repos only)."}
    )


@dataclass
class DataTrainingArguments:
    """Which data, and how to cut it into chunks."""

    train_file: str | None = field(default=None, metadata={"help": "WikiHop JSON training file (train.json)."})
    validation_file: str | None = field(default=None, metadata={"help": "WikiHop JSON evaluation file (dev.json)."})
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens per chunk (default: all the model's position embeddings cover)."}
    )
    max_chunks_per_example: int | None = field(
        default=None, metadata={"help": "Keep only the first N chunks of each example (default: all)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation examples."})
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Pack the chunks of every batch into one row without padding (hf_xformers encoders; not "
            "hfx-linformer): each chunk still attends only to itself, and short last chunks cost only their tokens."
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


class WikiHopModel(nn.Module):
    """An encoder plus a linear candidate scorer, with chunk averaging.

    Inputs (what :class:`WikiHopCollator` builds), with ``B`` examples, ``K`` chunks, ``L`` tokens, ``C``
    candidates:

    * ``input_ids``, ``attention_mask``, ``global_attention_mask``: ``(B, K, L)``;
    * ``chunk_mask``: ``(B, K)``, 1 for real chunks (examples have different numbers of chunks);
    * ``candidate_spans``: ``(B, C, 2)``, ``[start, end)`` token positions of each candidate, the same in every
      chunk since every chunk starts with the same prefix; ``candidate_mask``: ``(B, C)``, 1 for real candidates;
    * ``labels``: ``(B,)``, the index of the answer among the candidates.

    A packed batch (``--padding_free``) holds the real chunks, example by example, in one row: ``input_ids`` and
    ``global_attention_mask`` ``(1, T)``, ``position_ids`` ``(1, T)`` restarting at every chunk, and
    ``chunk_starts`` ``(N,)``, where each of the ``N`` real chunks starts in the row (no ``attention_mask``), and
    the chunks' boundaries ``cu_seq_lens_q/k`` ``(N + 1,)`` and ``max_length_q/k`` (ints), which reach the encoder. The
    encoder attends within each chunk, so the logits are those of the padded batch.

    Returns ``logits`` ``(B, C)`` (padding candidates at the dtype's minimum) and the cross-entropy ``loss``.
    """

    # The loss is a plain mean over the batch. Trainer reads this flag (else it guesses from **kwargs in forward);
    # True would make it multiply the loss by the world size under DDP (see the team notes on transformers v5).
    accepts_loss_kwargs = False

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config  # Trainer reads a few settings (special tokens, ignored output keys) here
        self.uses_global_attention = supports_global_attention(encoder)
        self.dropout = nn.Dropout(getattr(encoder.config, "hidden_dropout_prob", 0.1))
        self.scorer = nn.Linear(encoder.config.hidden_size, 1)
        nn.init.normal_(self.scorer.weight, std=getattr(encoder.config, "initializer_range", 0.02))
        nn.init.zeros_(self.scorer.bias)

    def activation_checkpointing_enable(self, **kwargs) -> None:
        """Lets ``--activation_checkpointing`` reach the encoder (Trainer calls this on the model it gets)."""
        self.encoder.activation_checkpointing_enable(**kwargs)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """The same for transformers < 5.23, whose Trainer calls ``gradient_checkpointing_enable``."""
        self.encoder.gradient_checkpointing_enable(**kwargs)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        chunk_mask: torch.Tensor,
        candidate_spans: torch.Tensor,
        candidate_mask: torch.Tensor,
        global_attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        chunk_starts: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
    ) -> MultipleChoiceModelOutput:
        batch = candidate_spans.shape[0]
        real = chunk_mask.bool()
        # `owner` maps each real chunk back to its example.
        owner = torch.arange(batch, device=real.device)[:, None].expand_as(real)[real]  # (N,)
        prefix = int(candidate_spans[..., 1].max())
        positions = torch.arange(prefix, device=real.device)
        if chunk_starts is None:
            # Encode only the real chunks, as one flat batch.
            inputs = {"input_ids": input_ids[real], "attention_mask": attention_mask[real]}
            if self.uses_global_attention and global_attention_mask is not None:
                inputs["global_attention_mask"] = global_attention_mask[real]
            prefix_states = self.encoder(**inputs, return_dict=True).last_hidden_state[:, :prefix]  # (N, P, H)
        else:
            inputs = {"input_ids": input_ids, "position_ids": position_ids}
            boundaries = dict(
                seq_idx=seq_idx,
                cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, max_length_q=max_length_q,
                max_length_k=max_length_k,
            )  # fmt: skip
            inputs.update({key: value for key, value in boundaries.items() if value is not None})
            if self.uses_global_attention and global_attention_mask is not None:
                inputs["global_attention_mask"] = global_attention_mask
            hidden = self.encoder(**inputs, return_dict=True).last_hidden_state[0]  # (T, H)
            # A chunk shorter than the batch's longest prefix reads on into the next one: those states get weight 0.
            index = (chunk_starts[:, None] + positions).clamp(max=hidden.shape[0] - 1)
            prefix_states = hidden[index]  # (N, P, H)

        # Mean of each candidate's token states. Candidates sit in the prefix, so only its tokens are needed.
        in_span = (positions >= candidate_spans[..., :1]) & (positions < candidate_spans[..., 1:])  # (B, C, P)
        weights = in_span.to(prefix_states.dtype) / in_span.sum(-1, keepdim=True).clamp(min=1)
        candidates = torch.einsum("ncp,nph->nch", weights[owner], prefix_states)  # (N, C, H)
        chunk_scores = self.scorer(self.dropout(candidates)).squeeze(-1)  # (N, C)

        # Average the chunk scores of each example.
        totals = chunk_scores.new_zeros(batch, chunk_scores.shape[-1]).index_add(0, owner, chunk_scores)
        logits = totals / real.sum(-1, keepdim=True).clamp(min=1).to(totals.dtype)
        logits = logits.masked_fill(~candidate_mask.bool(), torch.finfo(logits.dtype).min)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return MultipleChoiceModelOutput(loss=loss, logits=logits)

    def save_pretrained(self, output_dir: str) -> None:
        """The encoder in the usual format (``AutoModel`` reloads it) and the scorer in :data:`HEAD_FILE`."""
        self.encoder.save_pretrained(output_dir)
        head = {name: tensor.detach().cpu().contiguous() for name, tensor in self.scorer.state_dict().items()}
        save_file(head, os.path.join(output_dir, HEAD_FILE))

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> WikiHopModel:
        """An encoder from ``path`` (``AutoModel``), and its scorer when ``path`` has one (an output of this
        script); otherwise the scorer is new."""
        encoder = AutoModel.from_pretrained(path, **kwargs)
        if getattr(encoder, "pooler", None) is not None:
            # Candidates are scored from token states: a pooler would be dead weight, and its parameters would
            # get no gradient (DDP would have to look for unused parameters at every step).
            encoder.pooler = None
        model = cls(encoder)
        head = os.path.join(path, HEAD_FILE)
        if os.path.isfile(head):
            model.scorer.load_state_dict(load_file(head))
        return model


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def check_examples(dataset: Dataset, source: str) -> None:
    """Raise ``ValueError`` for a missing field, an example without candidates, or an answer that is not
    among its candidates (the label must lie in the candidate set)."""
    require_columns(dataset, REQUIRED_FIELDS, source)
    ids = dataset["id"] if "id" in dataset.column_names else list(range(len(dataset)))
    for example_id, candidates, answer in zip(ids, dataset["candidates"], dataset["answer"]):
        if not candidates:
            raise ValueError(f"{source}: example {example_id!r} has no candidates.")
        if answer not in candidates:
            raise ValueError(
                f"{source}: the answer {answer!r} of example {example_id!r} is not among its candidates "
                f"{candidates[:10]}; WikiHop answers must be one of the candidates."
            )


def featurize(examples: dict, tokenizer, max_length: int, max_chunks: int | None) -> dict:
    """Token chunks, candidate spans and labels for a batch of WikiHop examples (a ``datasets`` batched map).

    Returns per example: ``input_ids`` (a list of chunks), ``prefix_length`` (question + candidates tokens,
    the globally attended part), ``candidate_spans`` and ``label``.

    Raises:
        ValueError: the question and candidates alone leave no room for the supports in ``max_length`` tokens.
    """
    start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    q_open, q_close, c_open, c_close = tokenizer.convert_tokens_to_ids([*QUESTION_MARKERS, *CANDIDATE_MARKERS])

    def encode(texts: list[str]) -> list[list[int]]:
        # A leading space tokenizes each piece as mid-sentence words (byte-level BPE tells " word" from "word");
        # WordPiece tokenizers ignore it. Relations are written with underscores ("country_of_citizenship").
        texts = [" " + text.replace("_", " ").strip() for text in texts]
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    queries = encode(examples["query"])
    features = {"input_ids": [], "prefix_length": [], "candidate_spans": [], "label": []}
    for i, query in enumerate(queries):
        candidates = examples["candidates"][i]
        prefix = [start, q_open, *query, q_close]
        spans = []
        for tokens in encode(candidates):
            spans.append([len(prefix), len(prefix) + len(tokens) + 2])
            prefix += [c_open, *tokens, c_close]
        prefix.append(sep)
        room = max_length - len(prefix)
        if room < 1:
            raise ValueError(
                f"Example {examples['id'][i] if 'id' in examples else i!r}: the question and its "
                f"{len(candidates)} candidates take {len(prefix)} tokens, leaving no room for the documents "
                f"in --max_seq_length {max_length}; raise it (up to the model's length)."
            )
        context = [token for support in encode(examples["supports"][i]) for token in (*support, sep)]
        chunks = [prefix + context[s : s + room] for s in range(0, max(len(context), 1), room)]
        features["input_ids"].append(chunks[:max_chunks] if max_chunks else chunks)
        features["prefix_length"].append(len(prefix))
        features["candidate_spans"].append(spans)
        features["label"].append(candidates.index(examples["answer"][i]))
    return features


@dataclass
class WikiHopCollator:
    """Pads a list of featurized examples into the tensors :class:`WikiHopModel` takes (chunks, tokens and
    candidates all padded to the largest in the batch, with masks saying what is real).

    With ``packed`` (``--padding_free``) the real chunks go into one row instead, through
    :class:`~hf_xformers.padding_free.DataCollatorForPackedDocuments` (every chunk a document, its prefix global),
    plus ``chunk_starts``; candidates and chunks are still padded and masked as above.
    """

    pad_token_id: int
    packed: DataCollatorForPackedDocuments | None = None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if self.packed is not None:
            return self.pack(features)
        batch = len(features)
        chunks = max(len(f["input_ids"]) for f in features)
        length = max(len(chunk) for f in features for chunk in f["input_ids"])
        candidates = max(len(f["candidate_spans"]) for f in features)
        out = {
            "input_ids": torch.full((batch, chunks, length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros(batch, chunks, length, dtype=torch.long),
            "global_attention_mask": torch.zeros(batch, chunks, length, dtype=torch.long),
            "chunk_mask": torch.zeros(batch, chunks, dtype=torch.long),
            "candidate_spans": torch.zeros(batch, candidates, 2, dtype=torch.long),
            "candidate_mask": torch.zeros(batch, candidates, dtype=torch.long),
            "labels": torch.tensor([f["label"] for f in features], dtype=torch.long),
        }
        for b, feature in enumerate(features):
            for k, chunk in enumerate(feature["input_ids"]):
                out["input_ids"][b, k, : len(chunk)] = torch.tensor(chunk)
                out["attention_mask"][b, k, : len(chunk)] = 1
                out["global_attention_mask"][b, k, : feature["prefix_length"]] = 1  # question + candidates
            out["chunk_mask"][b, : len(feature["input_ids"])] = 1
            spans = feature["candidate_spans"]
            out["candidate_spans"][b, : len(spans)] = torch.tensor(spans)
            out["candidate_mask"][b, : len(spans)] = 1
        return out

    def pack(self, features: list[dict]) -> dict[str, torch.Tensor]:
        chunks = [chunk for f in features for chunk in f["input_ids"]]
        out = self.packed(
            [{"input_ids": chunk, "global_attention_mask": [1] * f["prefix_length"] + [0] * (len(chunk) - f["prefix_length"])}
             for f in features for chunk in f["input_ids"]]
        )  # fmt: skip
        out["chunk_starts"] = torch.tensor([0, *(len(chunk) for chunk in chunks[:-1])], dtype=torch.long).cumsum(0)
        most_chunks = max(len(f["input_ids"]) for f in features)
        candidates = max(len(f["candidate_spans"]) for f in features)
        out["chunk_mask"] = torch.zeros(len(features), most_chunks, dtype=torch.long)
        out["candidate_spans"] = torch.zeros(len(features), candidates, 2, dtype=torch.long)
        out["candidate_mask"] = torch.zeros(len(features), candidates, dtype=torch.long)
        out["labels"] = torch.tensor([f["label"] for f in features], dtype=torch.long)
        for b, feature in enumerate(features):
            out["chunk_mask"][b, : len(feature["input_ids"])] = 1
            spans = feature["candidate_spans"]
            out["candidate_spans"][b, : len(spans)] = torch.tensor(spans)
            out["candidate_mask"][b, : len(spans)] = 1
        return out


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    """Share of examples whose top-scored candidate is the answer (predictions are already argmaxed)."""
    return {"accuracy": float(np.mean(prediction.predictions == prediction.label_ids))}


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    """``(ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments)`` from the command line
    (``argv``), or from a single ``.json`` file argument."""
    return parse_script_args((ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments), argv, __doc__)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the script; returns the training and evaluation metrics (also written to ``output_dir``)."""
    model_args, data_args, training_args, run_args = parse_args(argv)
    setup_logging(training_args, logger)
    check_world_size(training_args)
    checkpoint = resume_checkpoint(training_args, run_args.overwrite_output_dir)
    set_seed(training_args.seed)

    # Data: read and check first, so a bad file fails before any model is loaded.
    splits = {}
    for name, path, wanted, limit in (
        ("train", data_args.train_file, training_args.do_train, data_args.max_train_samples),
        ("eval", data_args.validation_file, training_args.do_eval, data_args.max_eval_samples),
    ):
        if not wanted:
            continue
        if path is None:
            flag = "--train_file" if name == "train" else "--validation_file"
            raise ValueError(f"--do_{name} needs {flag} (a WikiHop JSON file).")
        splits[name] = take(load_local_file(path, model_args.cache_dir), limit)
        check_examples(splits[name], path)

    tokenizer, model = load_tokenizer_and_model(model_args)
    limit = model_max_tokens(model.encoder)
    max_length = data_args.max_seq_length or limit
    if max_length > limit:
        raise ValueError(f"--max_seq_length {max_length} exceeds the {limit} tokens the model reads.")
    logger.info(
        "Chunks of %d tokens; global attention on question and candidates: %s", max_length, model.uses_global_attention
    )
    # An encoder that cannot take packed batches fails here, before the data are featurized.
    packed = packed_collator(model.encoder, training_args, logger) if data_args.padding_free else None

    def prepare(dataset: Dataset, desc: str) -> Dataset:
        # The main process featurizes first and caches; torchrun replicas then read the cache.
        with training_args.main_process_first(desc=desc):
            return dataset.map(
                featurize,
                batched=True,
                remove_columns=dataset.column_names,
                fn_kwargs={
                    "tokenizer": tokenizer,
                    "max_length": max_length,
                    "max_chunks": data_args.max_chunks_per_example,
                },
                desc=desc,
            )

    train = prepare(splits["train"], "featurizing training data") if "train" in splits else None
    evaluation = prepare(splits["eval"], "featurizing evaluation data") if "eval" in splits else None

    # The collator needs `prefix_length`, which is no argument of the model's forward: Trainer would drop it.
    training_args.remove_unused_columns = False
    if training_args.ddp_find_unused_parameters is None:
        # Every parameter gets a gradient (no pooler; the question and candidates are always global), so DDP
        # need not search for unused ones. Trainer only defaults to this for PreTrainedModels.
        training_args.ddp_find_unused_parameters = False
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=WikiHopCollator(tokenizer.pad_token_id, packed),
        compute_metrics=accuracy,
        # Keep only the predicted candidate per batch: batches have different numbers of candidates.
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )

    metrics = train_and_evaluate(trainer, checkpoint)
    finish(trainer, run_args, model_args, max_length, data_args.max_chunks_per_example)
    return metrics


def load_tokenizer_and_model(model_args: ModelArguments):
    """``(tokenizer, WikiHopModel)``, with the marker tokens added (an output_dir of this script already has them)
    and the encoder's embeddings grown to hold them."""
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    tokenizer.add_tokens([*QUESTION_MARKERS, *CANDIDATE_MARKERS], special_tokens=True)
    model = WikiHopModel.from_pretrained(
        model_args.model_name_or_path, cache_dir=model_args.cache_dir, trust_remote_code=model_args.trust_remote_code
    )
    if len(tokenizer) > model.encoder.get_input_embeddings().num_embeddings:
        model.encoder.resize_token_embeddings(len(tokenizer))
    return tokenizer, model


def train_and_evaluate(trainer: Trainer, checkpoint: str | None) -> dict[str, float]:
    """Train (``--do_train``, resuming from ``checkpoint``; the model and tokenizer saved in ``output_dir``) and
    evaluate (``--do_eval``); returns the metrics, also written to ``output_dir``."""
    training_args, metrics = trainer.args, {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint)
        if trainer.is_world_process_zero():
            trainer.model.save_pretrained(training_args.output_dir)
            trainer.processing_class.save_pretrained(training_args.output_dir)
        train_metrics = {**result.metrics, "train_samples": len(trainer.train_dataset)}
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()
        metrics.update(train_metrics)

    if training_args.do_eval:
        eval_metrics = {**trainer.evaluate(), "eval_samples": len(trainer.eval_dataset)}
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)  # eval_results.json
        metrics.update(eval_metrics)
    return metrics


def finish(
    trainer: Trainer, run_args: RunArguments, model_args: ModelArguments, max_length: int, max_chunks: int | None
) -> None:
    """An upload-ready output_dir: the model card (with --self_contained also the model code); --push_to_hub
    uploads it."""
    finish_output_dir(
        trainer,
        run_args,
        trained=trainer.args.do_train,
        base_model=hub_model_id(model_args.model_name_or_path),
        summary=f"Fine-tuned from {model_origin(model_args.model_name_or_path)} on WikiHop (multi-hop multiple-choice "
        "QA) with `examples/run_wikihop.py` of hf_xformers. The folder holds the encoder (`AutoModel` loads it) and "
        f"the candidate scorer in `{HEAD_FILE}`: a candidate's score is a linear layer on the mean state of its "
        "tokens, averaged over the chunks of a long input (`WikiHopModel` in the script puts them together).",
        dataset_name="WikiHop (qangaroo v1.1)",
        dataset_type="local",
        task_type="multiple-choice",
        extra_hyperparameters={"max_seq_length": max_length, "max_chunks_per_example": max_chunks},
    )


if __name__ == "__main__":
    main()
