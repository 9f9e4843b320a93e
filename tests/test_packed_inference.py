"""Ragged documents classified and embedded in packed rows of a token budget (hf_xformers/packed_inference.py): the
results of each document's own forward, in input order."""

from __future__ import annotations

import pytest
import torch

from hf_xformers import HfxLongformerConfig, HfxLongformerForSequenceClassification, HfxLongformerModel
from hf_xformers.packed_inference import classify_documents, embed_documents
from hf_xformers.padding_free import pack_by_token_budget

TINY = dict(
    vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
    max_position_embeddings=64, attention_window=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    num_labels=3,
)  # fmt: skip
LENGTHS = [12, 40, 5, 33, 21, 9, 17]


def _documents() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    docs = []
    for n in LENGTHS:
        ids = torch.randint(5, 60, (n,), generator=g)
        ids[0], ids[-1] = 0, 2
        docs.append(ids.tolist())
    return docs


def test_plan_rows_fits_the_budget_and_keeps_every_document():
    rows = pack_by_token_budget(LENGTHS, 48)
    assert sorted(i for row in rows for i in row) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in row) <= 48 for row in rows)
    assert len(rows) == 3  # 137 tokens: first-fit decreasing needs 3 rows of 48
    with pytest.raises(ValueError, match="more than the 30"):
        pack_by_token_budget(LENGTHS, 30)


def test_classify_documents_equals_each_documents_own_forward():
    torch.manual_seed(0)
    model = HfxLongformerForSequenceClassification(HfxLongformerConfig(**TINY)).eval()
    docs = _documents()
    logits = classify_documents(model, docs, max_tokens=48)
    with torch.no_grad():
        solo = torch.cat([model(input_ids=torch.tensor([d])).logits for d in docs])
    assert logits.shape == (len(docs), 3)
    torch.testing.assert_close(logits, solo, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["mean", "first", "pooler"])
def test_embed_documents_equals_each_documents_own_forward(pooling):
    torch.manual_seed(0)
    model = HfxLongformerModel(HfxLongformerConfig(**TINY)).eval()
    docs = _documents()
    vectors = embed_documents(model, docs, max_tokens=64, pooling=pooling, normalize=True)
    with torch.no_grad():
        outs = [model(input_ids=torch.tensor([d])) for d in docs]
    if pooling == "mean":
        solo = torch.cat([o.last_hidden_state.mean(1) for o in outs])
    elif pooling == "first":
        solo = torch.cat([o.last_hidden_state[:, 0] for o in outs])
    else:
        solo = torch.cat([o.pooler_output for o in outs])
    torch.testing.assert_close(vectors, torch.nn.functional.normalize(solo, dim=-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("aggregation", ["mean", "max"])
def test_classify_documents_reads_long_documents_in_chunks(aggregation, caplog):
    torch.manual_seed(0)
    model = HfxLongformerForSequenceClassification(HfxLongformerConfig(**TINY)).eval()
    limit = model.base_model.embeddings.max_tokens
    g = torch.Generator().manual_seed(1)
    docs = []
    for n in (150, 20, 97):  # two documents longer than the model's 62 tokens
        ids = torch.randint(5, 60, (n,), generator=g)
        ids[0], ids[-1] = 0, 2
        docs.append(ids.tolist())
    chunked = classify_documents(model, docs, max_tokens=128, long_documents="chunks", stride=10,
                                 aggregation=aggregation)  # fmt: skip
    # By hand: windows of `limit` tokens (<s> and </s> kept, 10 text tokens of overlap), each on its own.
    with torch.no_grad():
        expected = []
        for ids in docs:
            body, room = ids[1:-1], limit - 2
            starts = range(0, max(len(body) - 10, 1), room - 10)
            windows = [[0, *body[s : s + room], 2] for s in starts]
            logits = torch.cat([model(input_ids=torch.tensor([w])).logits for w in windows])
            expected.append(logits.mean(0) if aggregation == "mean" else logits.amax(0))
    torch.testing.assert_close(chunked, torch.stack(expected), atol=1e-5, rtol=0)
    with caplog.at_level("WARNING", logger="hf_xformers.packed_inference"):
        truncated = classify_documents(model, docs, max_tokens=128)
    assert "2 of 3 documents are longer than the model's 62 tokens" in caplog.text
    torch.testing.assert_close(truncated[1], chunked[1], atol=1e-5, rtol=0)  # a short document is one window
    with torch.no_grad():
        first = model(input_ids=torch.tensor([docs[0][: limit - 1] + [2]])).logits[0]
    torch.testing.assert_close(truncated[0], first, atol=1e-5, rtol=0)
