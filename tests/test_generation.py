"""generate() and pipeline("text-generation") for every generating head in the registry.

Every class registered as ``AutoModelForCausalLM`` or ``AutoModelForSeq2SeqLM`` must generate (greedy, a few
tokens) with its cache, give the same tokens without it (``use_cache=False``) and, for causal LMs, the same tokens as
an argmax loop over full forward passes; causal LMs must also work in ``pipeline("text-generation")``. A head
registered later without an entry in :data:`TINY_CONFIGS` fails here instead of going untested.
"""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline

from hf_xformers.registration import REGISTRY

from .generation_checks import greedy_by_hand
from .tiny_tokenizers import roberta_tokenizer

GENERATING = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM")
VOCAB = 300  # covers the tiny tokenizer's ids

# The smallest configs that still exercise each cache (Reformer: a local and an LSH layer; Transformer-XL: memories
# as long as the whole generation, so that carrying them is exact).
TINY_CONFIGS = {
    "hfx-performer": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        num_random_features=16,
    ),
    "hfx-reformer": dict(
        hidden_size=32,
        num_attention_heads=2,
        attention_head_size=8,
        feed_forward_size=37,
        attn_layers=["local", "lsh"],
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=8,
        num_buckets=4,
        axial_pos_shape=[8, 8],
        axial_pos_embds_dim=[16, 16],
        max_position_embeddings=64,
        pad_token_id=1,
        eos_token_id=None,
        hash_seed=3,
    ),
    "hfx-transfo-xl": dict(cutoffs=[20, 50], d_model=32, n_head=4, d_inner=37, n_layer=2, div_val=2, mem_len=32),
    "hfx-universal": dict(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        act_max_steps=3,
    ),
}
CASES = [
    (model_type, task, model_class)
    for model_type, (_, heads) in REGISTRY.items()
    for task, model_class in heads.items()
    if task in GENERATING
]


def _model(model_type: str, model_class):
    config_class = REGISTRY[model_type][0]
    assert model_type in TINY_CONFIGS, f"add a tiny config for {model_type} to TINY_CONFIGS"
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=VOCAB, **TINY_CONFIGS[model_type])).eval()
    with torch.no_grad():  # default inits leave biases at 0: make every parameter matter, so tokens vary
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _prompt(batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(5, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def test_every_generating_head_is_covered():
    assert {t for t, _, _ in CASES} >= {"hfx-performer", "hfx-reformer", "hfx-transfo-xl", "hfx-universal"}


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=[f"{t}-{c.__name__}" for t, _, c in CASES])
def test_generate_cached_equals_uncached(model_type, task, model_class):
    model = _model(model_type, model_class)
    prompt = _prompt()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=1, eos_token_id=None)
    cached = model.generate(prompt, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    if task == "AutoModelForSeq2SeqLM":
        assert cached.shape[0] == 2 and cached.shape[1] > 1
        return
    assert cached.shape == (2, 14)
    assert torch.equal(cached, greedy_by_hand(model, prompt, 6))


CAUSAL = [case for case in CASES if case[1] == "AutoModelForCausalLM"]


@pytest.mark.parametrize(("model_type", "task", "model_class"), CAUSAL, ids=[t for t, _, _ in CAUSAL])
def test_text_generation_pipeline(model_type, task, model_class):
    model = _model(model_type, model_class)
    generator = pipeline("text-generation", model=model, tokenizer=roberta_tokenizer())
    out = generator("the quick brown fox", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("the quick brown fox")
    tokens = generator("the quick brown fox", max_new_tokens=4, do_sample=False, return_tensors=True)
    assert len(tokens[0]["generated_token_ids"]) >= 4
