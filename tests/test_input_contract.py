"""The input contract (issue 46): what each model checks before any kernel runs, and the error that names the fix.

Every row of ``hf_xformers.ops.input_checks.INPUT_CONTRACT`` (the table of ``docs/input-contract.md``) is triggered
here on every model it names; the findings that are no table row (Longformer's default global token from
``inputs_embeds``, Reformer's compiled ``seq_idx`` batch, Performer's compiled redraw) have their own tests.
"""

from __future__ import annotations

import pytest
import torch

from hf_xformers import (
    HfxLongformerConfig,
    HfxLongformerForMultipleChoice,
    HfxLongformerForQuestionAnswering,
    HfxLongformerForSequenceClassification,
)
from hf_xformers.ops.input_checks import as_if_on_accelerator

VOCAB = 99
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=3,
)


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """``(batch, length)`` ids of ordinary tokens between ``<s>`` (0) and ``</s>`` (2)."""
    ids = torch.randint(5, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0], ids[:, -1] = 0, 2
    return ids


# ----- finding 3: Longformer's default global token from inputs_embeds ------------------------------------------------


def longformer(head: type = HfxLongformerForSequenceClassification):
    torch.manual_seed(0)
    return head(HfxLongformerConfig(**TINY, attention_window=4, type_vocab_size=1)).eval()


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator-form"])
def test_longformer_classification_from_embeddings_keeps_first_token_global(accelerator):
    model = longformer()
    ids = token_ids(2, 19)
    embeds = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with as_if_on_accelerator() if accelerator else torch.enable_grad():
        got = model(inputs_embeds=embeds).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_longformer_packed_embeddings_match_each_document_alone():
    model = longformer()
    docs = [token_ids(1, n, seed=n) for n in (7, 12)]
    embed = model.get_input_embeddings()
    with torch.no_grad():
        alone = torch.cat([model(inputs_embeds=embed(d)).logits for d in docs])
        positions = torch.cat([torch.arange(2, 2 + d.shape[1]) for d in docs])[None]
        packed = model(inputs_embeds=embed(torch.cat(docs, 1)), position_ids=positions).logits
        from_ids = torch.cat([model(input_ids=d).logits for d in docs])
    torch.testing.assert_close(alone, from_ids, rtol=0, atol=1e-6)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", [HfxLongformerForQuestionAnswering, HfxLongformerForMultipleChoice])
def test_longformer_separator_tasks_from_embeddings_ask_for_global_mask(head):
    model = longformer(head)
    ids = token_ids(2, 11)
    ids[:, 4:6] = 2
    if head is HfxLongformerForMultipleChoice:
        ids = ids[None]
    embeds = model.get_input_embeddings()(ids).detach()
    with pytest.raises(ValueError, match="pass `global_attention_mask`"):
        model(inputs_embeds=embeds)
    glob = torch.zeros(ids.shape, dtype=torch.long)
    glob[..., :4] = 1
    with torch.no_grad():
        out = model(inputs_embeds=embeds, global_attention_mask=glob)
        ref = model(input_ids=ids, global_attention_mask=glob)
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)


# ----- finding 6: a collator batch with seq_idx and cu_seq_lens compiles on Reformer ------------------------------------


def test_reformer_compiles_a_collator_batch_that_carries_seq_idx_too():
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``: the boundaries are read from
    ``cu_seq_lens`` (whose shape gives the number of documents a traced graph needs), so masked-LM training compiles
    with ``fullgraph=True`` and gives eager mode's loss and gradients."""
    from transformers import DataCollatorWithFlattening

    from hf_xformers import HfxReformerConfig, HfxReformerForMaskedLM

    config = HfxReformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37,
        attn_layers=["local", "lsh"], local_attn_chunk_length=4, lsh_attn_chunk_length=8, num_buckets=4,
        axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16], max_position_embeddings=64, pad_token_id=1,
        eos_token_id=None, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0, hash_seed=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HfxReformerForMaskedLM(config).train()
    docs = [token_ids(1, n, seed=n)[0].tolist() for n in (9, 14, 5)]
    collator = DataCollatorWithFlattening(position_ids_start=0, return_flash_attn_kwargs=True, return_seq_idx=True)
    batch = collator([{"input_ids": d} for d in docs])
    assert {"seq_idx", "cu_seq_lens_q", "position_ids"} <= set(batch)

    def step(fn):
        model.zero_grad()
        loss = fn(**batch).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    torch._dynamo.reset()
    compiled_loss, compiled_grads = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    eager_loss, eager_grads = step(model)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-6)
    for got, expected in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
