"""Padding-free (packed) batches for training: a collator for every task head, and rows of a token budget.

transformers' :class:`~transformers.DataCollatorWithFlattening` concatenates a batch of documents into one row
``(1, total_tokens)`` with no padding, and marks where each document starts (``seq_idx`` or ``cu_seq_lens_q/k``; its
restarting ``position_ids`` are positions only, :mod:`hf_xformers.ops.packing`). Every hf_xformers text model attends
within the documents of such a row, and its heads answer per document: sequence classification ``(num_documents,
num_labels)``, multiple choice ``(num_examples, num_choices)``, extractive QA ``(num_documents, longest_document)``
start / end logits; the token heads (masked LM, causal LM, token classification) keep the row, ``(1, total_tokens,
...)``.

transformers' collator serves the per-token tasks; :class:`DataCollatorForPackedDocuments` delegates those to it and
adds what it cannot serve: per-document labels, multiple choice, ``global_attention_mask`` / ``token_type_ids``
carried along, and the right first position for the model (:func:`position_ids_start_for`)::

    collator = DataCollatorForPackedDocuments.for_model(model)        # refuses a model that cannot pack
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)

The batch size then counts documents per row; :func:`pack_by_token_budget` groups documents into rows of at most a
given number of tokens instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DataCollatorWithFlattening

from .ops.packing import PACKING_KWARGS, forward_keywords

# Model types whose positions count from 0 (no RoBERTa offset): BigBird's table, Reformer's axial or learned
# positions, the Universal Transformer's learned or sinusoidal positions; Transformer-XL has relative positions only.
POSITIONS_FROM_ZERO = frozenset({"hfx-bigbird", "hfx-reformer", "hfx-universal", "hfx-transfo-xl"})
# transformers models that number positions from ``pad_token_id + 1`` as RoBERTa does (the others count from 0).
ROBERTA_STYLE_POSITIONS = frozenset(
    {"roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "esm", "longformer",
     "data2vec-text", "xmod", "ibert", "luke"}
)  # fmt: skip
# Per-token inputs a feature may carry besides ``input_ids``; they are concatenated like the ids.
PER_TOKEN_INPUTS = ("token_type_ids", "global_attention_mask")
# Per-document targets of extractive QA: positions counted from the document's first token.
QA_TARGETS = ("start_positions", "end_positions")
LABEL_KEYS = ("labels", "label", "label_ids")


def position_ids_start_for(model_or_config) -> int:
    """The position id of a document's first token for ``model_or_config``: the ``position_ids_start`` its packed
    batches need.

    A model answers from its embeddings: hf_xformers text models state it (``embeddings.position_offset``: 0 for
    BigBird, ``pad_token_id + 1`` for the RoBERTa-style others), RoBERTa-style transformers embeddings keep a
    ``padding_idx`` (``padding_idx + 1``), anything else counts from 0 (BERT, Reformer's axial or learned positions,
    the Universal Transformer). A config answers from its ``model_type``: BigBird, Reformer, the Universal Transformer
    and Transformer-XL count from 0, the other hf_xformers models and transformers' RoBERTa family from
    ``pad_token_id + 1``, other transformers models from 0.

    A RoBERTa-style model given positions from 0 silently reads every token at the wrong position (hf_xformers models
    refuse such a batch with a ``ValueError``; transformers' do not).
    """
    if hasattr(model_or_config, "forward"):
        model = model_or_config.get_base_model() if hasattr(model_or_config, "get_base_model") else model_or_config
        base = getattr(model, "base_model", model)
        embeddings = getattr(base, "embeddings", None)
        offset = getattr(embeddings, "position_offset", None)
        if offset is not None:
            return int(offset)
        padding_idx = getattr(embeddings, "padding_idx", None)
        return int(padding_idx) + 1 if padding_idx is not None else 0
    model_type = getattr(model_or_config, "model_type", "")
    if model_type in POSITIONS_FROM_ZERO:
        return 0
    if model_type.startswith("hfx-") or model_type in ROBERTA_STYLE_POSITIONS:
        pad = getattr(model_or_config, "pad_token_id", None)
        return (1 if pad is None else int(pad)) + 1
    return 0


def packing_refusal(model) -> str | None:
    """Why ``model`` cannot train on packed batches, or None when it can.

    A model can when its forward takes the collator's boundaries (``seq_idx`` ..., as every hf_xformers head does)
    and its base model does not refuse them (Linformer projects keys and values along the whole row;
    Transformer-XL's memories and relative positions run across it). transformers' own heads are refused: their
    sequence classification pools one vector per row, whatever it holds.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper
    name = type(inner).__name__
    if "seq_idx" not in forward_keywords(inner.forward):
        return (
            f"{name} cannot take a packed (padding-free) batch: its forward takes no document boundaries "
            f"({', '.join(PACKING_KWARGS[:3])}), so the documents of a row would attend to one another. Packed "
            "batches need an hf_xformers model (hfx-longformer, hfx-bigbird, hfx-performer, hfx-reformer, ...)."
        )
    base = getattr(inner, "base_model", inner)
    refusal = getattr(base, "packing_refusal", None) or getattr(inner, "packing_refusal", None)
    if refusal is not None:
        reason, instead = refusal if isinstance(refusal, tuple) else (refusal, "Pad the batch instead.")
        return f"{name} cannot take a packed (padding-free) batch: {reason}. {instead}"
    if getattr(inner.config, "model_type", None) == "hfx-transfo-xl":
        return (
            f"{name} cannot take a packed (padding-free) batch: its memories and relative positions run across the "
            "whole segment, so the documents of a row would see one another. Train on stream segments "
            "(HfxStreamSegments), which have no padding to remove."
        )
    return None


def _as_list(value) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _is_nested(ids) -> bool:
    """Whether a feature's ``input_ids`` is a list of choices (each a list of ids) rather than a list of ids."""
    ndim = getattr(ids, "ndim", None)
    if ndim is not None:
        return ndim == 2
    return len(ids) > 0 and not isinstance(ids[0], int) and hasattr(ids[0], "__len__")


def _label_of(feature: Mapping) -> Any:
    for key in LABEL_KEYS:
        if key in feature and feature[key] is not None:
            return feature[key]
    return None


@dataclass
class DataCollatorForPackedDocuments:
    """Packs a list of features into one row ``(1, total_tokens)``, every feature a document, for every task head.

    Per feature kind (found from the features themselves):

    * per-token ``labels`` (masked LM, token classification; causal LM with ``causal_lm=True``), or none: the row is
      :class:`~transformers.DataCollatorWithFlattening`'s own (``input_ids``, ``labels``, boundaries);
    * a scalar label (``labels``, ``label`` or ``label_ids``; sequence classification, regression) or a vector of
      floats (multi-label): ``labels`` ``(num_documents,)`` (long for class ids, float for scores) or
      ``(num_documents, num_labels)``;
    * ``start_positions`` / ``end_positions`` (extractive QA; positions inside the document): each
      ``(num_documents,)``;
    * ``input_ids`` a list of choices, each a list of ids (multiple choice): every choice is a document of the row,
      example by example and choice by choice; ``labels`` ``(num_examples,)`` and ``num_choices`` (int) are added.
      Every example must have the same number of choices.

    ``token_type_ids`` and ``global_attention_mask``, when the features carry them (per choice for multiple choice),
    are concatenated like ``input_ids`` into ``(1, total_tokens)``. ``attention_mask`` is dropped (a packed row has
    no padding; a feature whose mask holds a 0 is refused), and so is every other key: only what the model's forward
    takes is returned.

    Boundaries, as transformers' collator gives them: ``position_ids`` ``(1, total_tokens)`` restarting at
    ``position_ids_start`` (``return_position_ids``; use :func:`position_ids_start_for`, or
    :meth:`for_model`), ``seq_idx`` ``(1, total_tokens)`` int32 (``return_seq_idx``), ``cu_seq_lens_q/k``
    ``(num_documents + 1,)`` int32 and ``max_length_q/k`` (ints; ``return_flash_attn_kwargs``, the default).
    Explicit boundaries always travel (positions never mark documents): ``cu_seq_lens`` give the model the number of
    documents by their shape and ``max_length`` the longest as an int, so a training step on a GPU reads nothing back
    from the device, also compiled.

    Args:
        position_ids_start: the first position of every document (required with ``return_position_ids``).
        return_position_ids: return restarting ``position_ids``.
        return_seq_idx: return ``seq_idx``.
        return_flash_attn_kwargs: return ``cu_seq_lens_q/k`` and ``max_length_q/k``. At least one of
            ``return_seq_idx`` and ``return_flash_attn_kwargs`` must be set (positions alone mark no documents).
        causal_lm: per-token labels for a causal LM, exactly as transformers' collator makes them: the input ids
            when the features carry no labels, and ``separator_id`` over each document's first label (the model
            shifts labels, so that label would be scored as the next token of the document before it). Otherwise
            (the default) labels are returned only when the features carry them, and per-token labels are kept as
            given: a masked LM or token classifier scores each token against its own label, which no boundary
            separates.
        separator_id: the label written at document starts with ``causal_lm``.
        per_document_labels: force list-valued labels to be read as per-document (True) or per-token (False);
            None decides per feature: a list of integers as long as ``input_ids`` is per-token, anything else
            per-document.

    Raises (on a call):
        ValueError: no features, an empty document, a feature with padding, examples with different numbers of
            choices, or labels on some features only.

    Examples:
        >>> from hf_xformers import DataCollatorForPackedDocuments
        >>> collator = DataCollatorForPackedDocuments(position_ids_start=2)  # RoBERTa-style
        >>> features = [{"input_ids": [0, 5, 6, 2], "label": 1}, {"input_ids": [0, 7, 2], "label": 0}]
        >>> batch = collator(features)
        >>> batch["input_ids"].shape, batch["labels"].tolist()
        (torch.Size([1, 7]), [1, 0])
        >>> batch["position_ids"].tolist(), batch["cu_seq_lens_q"].tolist(), batch["max_length_q"]
        ([[2, 3, 4, 5, 2, 3, 4]], [0, 4, 7], 4)
    """

    position_ids_start: int | None = None
    return_position_ids: bool = True
    return_seq_idx: bool = False
    return_flash_attn_kwargs: bool = True
    causal_lm: bool = False
    separator_id: int = -100
    per_document_labels: bool | None = None

    def __post_init__(self) -> None:
        if not (self.return_seq_idx or self.return_flash_attn_kwargs):
            raise ValueError(
                "DataCollatorForPackedDocuments sends explicit document boundaries: keep return_flash_attn_kwargs=True "
                "(cu_seq_lens_q/k + max_length_q/k, the default) or set return_seq_idx=True; position_ids never mark "
                "documents (restarting positions alone make one sequence whose documents see each other)."
            )
        if self.return_position_ids and self.position_ids_start is None:
            raise ValueError(
                "DataCollatorForPackedDocuments needs position_ids_start, the position of a document's first token: "
                "pad_token_id + 1 for RoBERTa-style models (2 for RoBERTa, 1 for a converted BERT), 0 for BigBird; "
                "position_ids_start_for(model) reads "
                "it from the model, or use DataCollatorForPackedDocuments.for_model(model)."
            )

    @classmethod
    def for_model(cls, model, **options) -> DataCollatorForPackedDocuments:
        """The collator for ``model``: its ``position_ids_start`` (:func:`position_ids_start_for`), ``options`` as
        the fields.

        Raises:
            ValueError: the model cannot take packed batches (:func:`packing_refusal` says why).
        """
        refusal = packing_refusal(model)
        if refusal is not None:
            raise ValueError(refusal)
        options.setdefault("position_ids_start", position_ids_start_for(model))
        return cls(**options)

    def _flattening(self) -> DataCollatorWithFlattening:
        return DataCollatorWithFlattening(
            return_position_ids=self.return_position_ids,
            separator_id=self.separator_id,
            return_flash_attn_kwargs=self.return_flash_attn_kwargs,
            return_seq_idx=self.return_seq_idx,
            position_ids_start=self.position_ids_start or 0,
        )

    def _is_per_token(self, label, ids: list) -> bool:
        if self.per_document_labels is not None:
            return not self.per_document_labels
        if not isinstance(label, (Sequence, torch.Tensor)) and not hasattr(label, "tolist"):
            return False
        values = _as_list(label)
        return isinstance(values, list) and len(values) == len(ids) and all(isinstance(v, int) for v in values)

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        """``features`` -> the packed batch (tensors, and ints for ``max_length_q/k`` and ``num_choices``)."""
        if not features:
            raise ValueError("DataCollatorForPackedDocuments got no features to pack.")
        multiple_choice = _is_nested(features[0]["input_ids"])
        documents = _choice_documents(features) if multiple_choice else _plain_documents(features)
        example_labels = [_label_of(f) for f in features]
        has_labels = [label is not None for label in example_labels]
        if any(has_labels) and not all(has_labels):
            raise ValueError("Some features of the batch carry labels and others do not; give every feature one.")
        per_token = (
            not multiple_choice and all(has_labels) and self._is_per_token(example_labels[0], documents[0]["input_ids"])
        )
        batch = self._flatten(documents, example_labels if per_token else None)
        if not per_token and not (self.causal_lm and not any(has_labels)):
            del batch["labels"]  # transformers' collator copies input_ids into labels: only a causal LM wants that
        _add_per_token_inputs(batch, documents)
        if any(has_labels) and not per_token:
            batch["labels"] = _example_labels_tensor(example_labels)
        for key in QA_TARGETS:
            if key in features[0]:
                batch[key] = torch.tensor([int(f[key]) for f in features], dtype=torch.long)
        if multiple_choice:
            batch["num_choices"] = len(features[0]["input_ids"])
        return batch

    def _flatten(self, documents: list[dict], token_labels: list | None) -> dict[str, Any]:
        """transformers' collator over the documents' ``input_ids``, with their per-token ``token_labels`` (one list
        per document) as ``labels`` when given."""
        flat_features = [{"input_ids": d["input_ids"]} for d in documents]
        if token_labels is None:
            return self._flattening()(flat_features)
        for flat, label, document in zip(flat_features, token_labels, documents):
            label = _as_list(label)
            if len(label) != len(document["input_ids"]):
                raise ValueError(
                    f"Per-token labels of length {len(label)} for a document of {len(document['input_ids'])} "
                    "tokens; give one label per token (-100 where no loss is wanted)."
                )
            flat["labels"] = label
        batch = self._flattening()(flat_features)
        if not self.causal_lm:
            # Each token keeps its own label: the separator of transformers' collator would drop the first one.
            starts = torch.tensor([0, *[len(d["input_ids"]) for d in documents[:-1]]]).cumsum(0)
            first = torch.tensor([_as_list(f["labels"])[0] for f in flat_features], dtype=batch["labels"].dtype)
            batch["labels"][0, starts] = first
        return batch


def _plain_documents(features: list[Mapping[str, Any]]) -> list[dict]:
    """One document per feature, ``input_ids`` as a list; refuses empty or padded ones."""
    return _checked([{**f, "input_ids": _as_list(f["input_ids"])} for f in features])


def _choice_documents(features: list[Mapping[str, Any]]) -> list[dict]:
    """One document per (context, choice) pair, example by example and choice by choice, with its per-token inputs
    and mask; refuses examples with another number of choices than the first, and empty or padded documents."""
    num_choices = len(features[0]["input_ids"])
    documents = []
    for i, feature in enumerate(features):
        choices = [_as_list(c) for c in feature["input_ids"]]
        if len(choices) != num_choices:
            raise ValueError(
                f"Multiple-choice example {i} has {len(choices)} choices and example 0 has {num_choices}; a "
                "packed batch groups the documents into examples of one size (pad the choice lists, or "
                "batch examples with equal numbers of choices)."
            )
        for c, ids in enumerate(choices):
            document = {"input_ids": ids}
            for key in (*PER_TOKEN_INPUTS, "attention_mask"):
                if key in feature:
                    document[key] = _as_list(feature[key][c])
            documents.append(document)
    return _checked(documents)


def _checked(documents: list[dict]) -> list[dict]:
    """``documents``, after a ``ValueError`` for an empty one or one that carries padding."""
    for i, document in enumerate(documents):
        if not document["input_ids"]:
            raise ValueError(f"Document {i} of the batch has no tokens; drop empty documents before packing.")
        mask = document.get("attention_mask")
        if mask is not None and not all(_as_list(mask)):
            raise ValueError(
                f"Document {i} of the batch carries padding (its attention_mask holds 0s); a packed batch needs "
                "unpadded features: tokenize with padding=False."
            )
    return documents


def _add_per_token_inputs(batch: dict[str, Any], documents: list[dict]) -> None:
    """Concatenate the documents' :data:`PER_TOKEN_INPUTS` into ``batch`` ``(1, total_tokens)``, like the ids."""
    for key in PER_TOKEN_INPUTS:
        present = [key in d for d in documents]
        if not any(present):
            continue
        if not all(present):
            raise ValueError(f"Some features carry {key} and others do not; give every feature one.")
        values = [v for d in documents for v in _as_list(d[key])]
        if len(values) != batch["input_ids"].shape[1]:
            raise ValueError(f"{key} must have one value per token, like input_ids.")
        batch[key] = torch.tensor([values], dtype=torch.long)


def _example_labels_tensor(example_labels: list) -> torch.Tensor:
    """Per-document (or per-example) labels as one tensor: float when any value is (regression, multi-label)."""
    labels = [_as_list(label) if hasattr(label, "tolist") else label for label in example_labels]
    is_float = any(isinstance(v, float) for v in labels) or any(
        isinstance(v, list) and any(isinstance(x, float) for x in v) for v in labels
    )
    return torch.tensor(labels, dtype=torch.float32 if is_float else torch.long)


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int, decreasing: bool = True) -> list[list[int]]:
    """Group documents into rows of at most ``max_tokens`` tokens.

    First fit: each document goes to the first row that still has room for it, a new row when none has. With
    ``decreasing`` (the default: first-fit decreasing, at most 11/9 of the fewest possible rows, plus one) the
    documents are placed longest first (ties in the given order); otherwise in the given order. O(n log n).

    Args:
        lengths: the token count of every document.
        max_tokens: the budget of a row.
        decreasing: place the longest documents first.
    Returns:
        The rows, in the order they were opened, each the ascending indices of its documents into ``lengths``.
    Raises:
        ValueError: ``max_tokens`` below 1, an empty document, or a document longer than ``max_tokens`` (cut it
            first: a document never spans two rows).

    Examples:
        >>> from hf_xformers import pack_by_token_budget
        >>> pack_by_token_budget([300, 100, 250, 60], max_tokens=400)
        [[0, 1], [2, 3]]
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"Document {i} has {n} tokens; drop empty documents before packing.")
        if n > max_tokens:
            raise ValueError(
                f"Document {i} has {n} tokens, more than the {max_tokens} of a row; cut long documents to "
                f"max_tokens first (tokenizer truncation, or into pieces), or raise max_tokens."
            )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if decreasing else range(len(lengths))
    # A max-tree over the free tokens of (at most len(lengths)) rows, unopened ones full: the leftmost leaf with room
    # is the first open row that fits, or else the next row to open.
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    free = [max_tokens] * (2 * size)
    rows: list[list[int]] = []
    for i in order:
        need, node = lengths[i], 1
        while node < size:
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return [sorted(row) for row in rows]


__all__ = [
    "DataCollatorForPackedDocuments",
    "pack_by_token_budget",
    "packing_refusal",
    "position_ids_start_for",
]
