"""Classify or embed a list of documents of mixed lengths without padding: the documents are packed into rows of at
most ``max_tokens`` tokens (first-fit, longest first), each row runs once as a packed batch (every document attends to
itself only, ops/packing.py), and the results come back in the input order.

    from hf_xformers.packed_inference import classify_documents, embed_documents

    logits = classify_documents(model, texts, tokenizer=tok, max_tokens=16384)       # (num_documents, num_labels)
    vectors = embed_documents(model, texts, tokenizer=tok, pooling="mean")            # (num_documents, hidden)

A padded batch of the same documents computes ``batch x longest`` tokens (and Longformer rounds up to its window); a
packed row computes the real tokens only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .layers.pooling import pool_tokens
from .ops.packing import resolve_packed_batch
from .padding_free import pack_by_token_budget, position_ids_start_for

POOLINGS = ("mean", "first", "pooler")


def _token_ids(documents, tokenizer, model) -> list[torch.Tensor]:
    if len(documents) and isinstance(documents[0], str):
        if tokenizer is None:
            raise ValueError("Documents given as text need the model's `tokenizer`; or pass token ids.")
        limit = model.base_model.embeddings.max_tokens if hasattr(model.base_model, "embeddings") else None
        encoded = tokenizer(list(documents), truncation=limit is not None, max_length=limit)["input_ids"]
        return [torch.tensor(ids, dtype=torch.long) for ids in encoded]
    return [torch.as_tensor(ids, dtype=torch.long).reshape(-1) for ids in documents]


@torch.inference_mode()
def _run_packed(model, documents, tokenizer, max_tokens: int, read) -> torch.Tensor:
    """Run ``model`` on ``documents`` packed into rows; ``read(output, packed)`` gives one row of results per
    document of a row; returns them stacked in input order."""
    ids = _token_ids(documents, tokenizer, model)
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
    model, documents: Sequence[str] | Sequence[Sequence[int]], tokenizer=None, max_tokens: int = 16384
) -> torch.Tensor:
    """Logits ``(num_documents, num_labels)`` of a sequence-classification model, in the order of ``documents``
    (texts with their ``tokenizer``, or token-id lists), packed into rows of at most ``max_tokens`` tokens."""
    model.eval()
    return _run_packed(model, documents, tokenizer, max_tokens, lambda out, _: out.logits)


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

    vectors = _run_packed(model, documents, tokenizer, max_tokens, read)
    return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors


__all__ = ["classify_documents", "embed_documents"]
