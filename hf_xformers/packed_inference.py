"""Classify or embed a list of documents of mixed lengths without padding: the documents are packed into rows of at
most ``max_tokens`` tokens (first-fit, longest first), each row runs once as a packed batch (every document attends to
itself only, ops/packing.py), and the results come back in the input order.

    from hf_xformers.packed_inference import classify_documents, embed_documents

    logits = classify_documents(model, texts, tokenizer=tok, max_tokens=16384)       # (num_documents, num_labels)
    logits = classify_documents(model, texts, tokenizer=tok, long_documents="chunks", stride=128, aggregation="mean")
    vectors = embed_documents(model, texts, tokenizer=tok, pooling="mean")            # (num_documents, hidden)

A padded batch of the same documents computes ``batch x longest`` tokens (and Longformer rounds up to its window); a
packed row computes the real tokens only.

Documents longer than the model are an explicit choice (``long_documents``): ``"truncate"`` keeps each document's
first window (and logs how many were cut), ``"chunks"`` reads every document in overlapping windows and aggregates
their logits. The window helpers (:func:`special_token_layout`, :func:`chunk_token_ids`, :func:`document_windows`,
:func:`aggregate_chunks`) are public: the example scripts split and aggregate with the same code.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from .layers.pooling import pool_tokens
from .ops.packing import resolve_packed_batch
from .padding_free import pack_by_token_budget, position_ids_start_for

logger = logging.getLogger(__name__)

POOLINGS = ("mean", "first", "pooler")
LONG_DOCUMENTS = ("truncate", "chunks")
AGGREGATIONS = ("mean", "max")


def special_token_layout(tokenizer) -> tuple[int, int]:
    """How many special tokens ``tokenizer`` puts before and after one encoded text: ``(1, 1)`` for BERT's
    ``[CLS] ... [SEP]`` and RoBERTa's ``<s> ... </s>``, ``(0, 0)`` for a tokenizer that adds none."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return start, len(full) - start - len(plain)
    raise ValueError(f"{type(tokenizer).__name__} changes the text's own tokens when it adds its special tokens.")


def chunk_token_ids(
    ids: Sequence[int], max_length: int, stride: int = 0, num_prefix: int = 1, num_suffix: int = 1
) -> list[list[int]]:
    """Overlapping windows of at most ``max_length`` tokens that together cover one encoded document.

    ``ids`` is the document as its tokenizer encodes it, ``num_prefix`` special tokens first and ``num_suffix`` last
    (:func:`special_token_layout`). Every window keeps those special tokens, so each reads as a document of its own;
    the text between them is cut into pieces of ``max_length - num_prefix - num_suffix`` tokens, each piece starting
    ``stride`` tokens before the previous one ends (``stride`` is the overlap, as in transformers' tokenizers). A
    document that fits is one window, itself; the first window is what truncation to ``max_length`` keeps.

    Raises:
        ValueError: ``max_length`` leaves no room for text, or ``stride`` is not below the room left.
    """
    room = max_length - num_prefix - num_suffix
    if room < 1:
        raise ValueError(
            f"max_length {max_length} leaves no room for text beside {num_prefix + num_suffix} special tokens."
        )
    if not 0 <= stride < room:
        raise ValueError(
            f"stride {stride} must lie in [0, {room}): the overlap of two windows must be shorter than a window's "
            f"{room} text tokens (max_length {max_length}); lower the stride."
        )
    ids = list(ids)
    if len(ids) <= max_length:
        return [ids]
    prefix, body = ids[:num_prefix], ids[num_prefix : len(ids) - num_suffix]
    suffix = ids[len(ids) - num_suffix :]
    windows, start = [], 0
    while True:
        windows.append(prefix + body[start : start + room] + suffix)
        if start + room >= len(body):
            return windows
        start += room - stride


def document_windows(
    documents: Sequence[Sequence[int]],
    max_length: int,
    long_documents: str = "truncate",
    stride: int = 0,
    num_prefix: int = 1,
    num_suffix: int = 1,
) -> tuple[list[list[int]], list[int]]:
    """The windows a model of ``max_length`` tokens reads of each encoded document, and the document each came
    from: ``(windows, document_index)``, in document order.

    ``long_documents="truncate"`` keeps one window per document, its first ``max_length`` tokens (the special tokens
    kept; ``stride`` plays no part); ``"chunks"`` keeps all of :func:`chunk_token_ids`'s windows, to be aggregated with
    :func:`aggregate_chunks`.
    """
    if long_documents not in LONG_DOCUMENTS:
        raise ValueError(f"long_documents must be one of {LONG_DOCUMENTS}, got {long_documents!r}.")
    windows: list[list[int]] = []
    document_index: list[int] = []
    for i, ids in enumerate(documents):
        if long_documents == "truncate":
            # The first window: the first tokens and the closing special tokens.
            cut = len(ids) > max_length
            chunks = [list(ids[: max_length - num_suffix]) + list(ids[len(ids) - num_suffix :]) if cut else list(ids)]
        else:
            chunks = chunk_token_ids(ids, max_length, stride, num_prefix, num_suffix)
        windows.extend(chunks)
        document_index.extend([i] * len(chunks))
    return windows, document_index


def aggregate_chunks(
    logits: torch.Tensor, document_index: torch.Tensor | Sequence[int], num_documents: int, aggregation: str = "mean"
) -> torch.Tensor:
    """One row of logits per document from its windows' rows.

    Args:
        logits: ``(num_windows, num_labels)`` (or ``(num_windows,)`` for a regression head), the windows' logits.
        document_index: ``(num_windows,)``, the document each window belongs to (:func:`document_windows`).
        num_documents: how many documents there are; each must own at least one window.
        aggregation: ``"mean"`` (every part of the document counts alike) or ``"max"`` (the strongest evidence
            anywhere wins; suits multi-label classification, where a label may rest on one passage).

    Returns:
        ``(num_documents, num_labels)`` (``(num_documents,)`` for 1-D ``logits``), in the logits' dtype.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
    index = torch.as_tensor(document_index, dtype=torch.long, device=logits.device)
    counts = torch.bincount(index, minlength=num_documents)
    if index.numel() != logits.shape[0] or counts.numel() != num_documents or bool((counts == 0).any()):
        raise ValueError(
            f"document_index must give each of the {num_documents} documents at least one of the {logits.shape[0]} "
            "windows, and name no other document."
        )
    out = torch.zeros((num_documents, *logits.shape[1:]), dtype=torch.float32, device=logits.device)
    spread = index.reshape(-1, *([1] * (logits.dim() - 1))).expand(logits.shape)
    reduce = "mean" if aggregation == "mean" else "amax"
    # float32 while reducing: a mean of many bfloat16 windows would round at every addition.
    return out.scatter_reduce_(0, spread, logits.float(), reduce, include_self=False).to(logits.dtype)


def _encode(documents, tokenizer) -> list[list[int]]:
    """Each document as token ids, uncut: texts through ``tokenizer``, token-id lists as they are."""
    if len(documents) and isinstance(documents[0], str):
        if tokenizer is None:
            raise ValueError("Documents given as text need the model's `tokenizer`; or pass token ids.")
        # verbose=False: a document longer than the model is expected here; the caller decides what to do with it.
        return tokenizer(list(documents), verbose=False)["input_ids"]
    return [torch.as_tensor(ids, dtype=torch.long).reshape(-1).tolist() for ids in documents]


def _model_max_tokens(model) -> int | None:
    """The longest input ``model``'s position table serves, None where the model does not say."""
    embeddings = getattr(model.base_model, "embeddings", None)
    return getattr(embeddings, "max_tokens", None)


def _token_ids(documents, tokenizer, model) -> list[torch.Tensor]:
    """Each document as a tensor of token ids; texts truncated to the model's length, token ids as given."""
    ids = _encode(documents, tokenizer)
    limit = _model_max_tokens(model)
    if limit is not None and tokenizer is not None and len(documents) and isinstance(documents[0], str):
        prefix, suffix = special_token_layout(tokenizer)
        ids = document_windows(ids, limit, "truncate", 0, prefix, suffix)[0]
    return [torch.tensor(x, dtype=torch.long) for x in ids]


@torch.inference_mode()
def _run_packed(model, ids: list[torch.Tensor], max_tokens: int, read) -> torch.Tensor:
    """Run ``model`` on the token-id tensors ``ids`` packed into rows; ``read(output, packed)`` gives one row of
    results per sequence of a row; returns them stacked in input order."""
    if not ids:
        raise ValueError("No documents given.")
    device = next(model.parameters()).device
    results: list[torch.Tensor | None] = [None] * len(ids)
    for row in pack_by_token_budget([t.numel() for t in ids], max_tokens):
        input_ids = torch.cat([ids[i] for i in row])[None].to(device)
        lengths = [ids[i].numel() for i in row]
        # The boundaries as the flash-attention form: the number of documents by shape, the longest as an int.
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        packing = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        packed = resolve_packed_batch(tuple(input_ids.shape), device, **packing)
        position_ids = packed.positions + position_ids_start_for(model) if packed is not None else None
        out = model(input_ids=input_ids, position_ids=position_ids, return_dict=True, **packing)
        for i, value in zip(row, read(out, packed)):
            results[i] = value
    return torch.stack(results)


def classify_documents(
    model,
    documents: Sequence[str] | Sequence[Sequence[int]],
    tokenizer=None,
    max_tokens: int = 16384,
    long_documents: str = "truncate",
    stride: int = 128,
    aggregation: str = "mean",
) -> torch.Tensor:
    """Logits ``(num_documents, num_labels)`` of a sequence-classification model, in the order of ``documents``
    (texts with their ``tokenizer``, or token-id lists, each with its special tokens), packed into rows of at most
    ``max_tokens`` tokens.

    A document longer than the model's position table is, by ``long_documents``: ``"truncate"``d to its first
    window (a warning counts the documents cut and the tokens lost), or read in overlapping ``"chunks"`` of the
    model's length, ``stride`` tokens of overlap, whose logits are aggregated (``aggregation``: ``"mean"`` or
    ``"max"``, :func:`aggregate_chunks`). Windows keep the document's special tokens: as the ``tokenizer`` adds
    them, or one first and one last for token ids without a tokenizer (BERT's and RoBERTa's layout).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
    model.eval()
    encoded = _encode(documents, tokenizer)
    if not encoded:
        raise ValueError("No documents given.")
    limit = _model_max_tokens(model) or max(len(ids) for ids in encoded)
    prefix, suffix = special_token_layout(tokenizer) if tokenizer is not None else (1, 1)
    windows, document_index = document_windows(encoded, limit, long_documents, stride, prefix, suffix)
    if long_documents == "truncate":
        cut = [len(ids) - limit for ids in encoded if len(ids) > limit]
        if cut:
            logger.warning(
                "%d of %d documents are longer than the model's %d tokens and were truncated (%d tokens not read); "
                "pass long_documents='chunks' to read them whole.",
                len(cut), len(encoded), limit, sum(cut),
            )  # fmt: skip
    ids = [torch.tensor(window, dtype=torch.long) for window in windows]
    logits = _run_packed(model, ids, max_tokens, lambda out, _: out.logits)
    return aggregate_chunks(logits, document_index, len(encoded), aggregation)


def embed_documents(
    model,
    documents: Sequence[str] | Sequence[Sequence[int]],
    tokenizer=None,
    max_tokens: int = 16384,
    pooling: str = "mean",
    normalize: bool = False,
) -> torch.Tensor:
    """One vector per document, ``(num_documents, hidden)``, in the order of ``documents``, from a base model
    (``AutoModel``): the mean of the document's last hidden states (``pooling="mean"``, what sentence-transformers'
    default pooling gives), its first token's (``"first"``) or the pooler's (``"pooler"``); L2-normalised with
    ``normalize=True``. Documents are packed into rows of at most ``max_tokens`` tokens."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}.")
    model.eval()

    def read(out, packed):
        if pooling == "pooler":
            if out.pooler_output is None:
                raise ValueError("This model has no pooler; use pooling='mean' or 'first'.")
            return out.pooler_output
        if packed is None:  # a single document
            return pool_tokens(out.last_hidden_state, None, pooling)
        return pool_tokens(out.last_hidden_state, None, pooling, packed)

    vectors = _run_packed(model, _token_ids(documents, tokenizer, model), max_tokens, read)
    return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors


__all__ = [
    "aggregate_chunks",
    "chunk_token_ids",
    "classify_documents",
    "document_windows",
    "embed_documents",
    "special_token_layout",
]
