"""Tests of hfx-reformer: conformance, parity with transformers' Reformer (models, LM heads, greedy generation),
reversible gradients, any-length training, padding invariance, hashing and the checkpoint importer."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib  # noqa: E402
import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_xformers import (  # noqa: E402
    HfxReformerConfig,
    HfxReformerForCausalLM,
    HfxReformerForMaskedLM,
    HfxReformerForQuestionAnswering,
    HfxReformerForSequenceClassification,
    HfxReformerModel,
)
from hf_xformers.attention.chunked_local import HfxLocalSelfAttention, decode_padded_length  # noqa: E402
from hf_xformers.attention.lsh import SELF_MASK_VALUE, HfxLSHSelfAttention, self_mask_value  # noqa: E402
from hf_xformers.attention.lsh_hashing import draw_rotations, hash_buckets  # noqa: E402
from hf_xformers.conversion.convert_from_transformers import convert_from_transformers, reformer_lm_bias_as_ours  # noqa: E402
from hf_xformers.models.reformer import reversible as reversible_module  # noqa: E402
from hf_xformers.ops.fast_dropout import fast_dropout  # noqa: E402
from hf_xformers.ops.precision import mask_value  # noqa: E402
from tests.conformance import VOCAB, HostReadCounter, TextModelConformance, _ids  # noqa: E402
from tests.generation_checks import greedy_by_hand  # noqa: E402

ATOL = 1e-5
# Tiny Reformer: local chunks of 4 and LSH chunks of 8 (inputs of SEQ_LEN=24 use several chunks of both).
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37,
    attn_layers=["local", "lsh"], local_attn_chunk_length=4, lsh_attn_chunk_length=8, num_buckets=4,
    axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16], max_position_embeddings=64, pad_token_id=1,
    eos_token_id=None, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
    lsh_attention_probs_dropout_prob=0.0,
)  # fmt: skip


def configs(**overrides) -> tuple[transformers.ReformerConfig, HfxReformerConfig]:
    kwargs = {**TINY, "hash_seed": 3, **overrides}
    return transformers.ReformerConfig(**kwargs), HfxReformerConfig(**kwargs)


def pair(ref_class, our_class, **overrides):
    """A transformers model with perturbed weights (every tensor matters) and ours loaded with the same weights."""
    ref_config, our_config = configs(**overrides)
    torch.manual_seed(0)
    ref = ref_class(ref_config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # transformers 5.0-5.23 do not add lm_head.bias (see HfxReformerLMHead): keep it at 0 for the comparison
            # (5.24 adds lm_head.decoder.bias instead, which becomes ours).
            if name != "lm_head.bias":
                p.add_(0.2 * torch.randn_like(p))
    ours = our_class(our_config).eval()
    result = ours.load_state_dict(reformer_lm_bias_as_ours(ref.state_dict()), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return ref, ours


# ----- conformance ---------------------------------------------------------------------------------------------


class TestReformerConformance(TextModelConformance):
    config_class = HfxReformerConfig
    base_config = {k: v for k, v in TINY.items() if k != "vocab_size"}
    heads = {
        "AutoModel": HfxReformerModel,
        "AutoModelForMaskedLM": HfxReformerForMaskedLM,
        "AutoModelForSequenceClassification": HfxReformerForSequenceClassification,
        "AutoModelForQuestionAnswering": HfxReformerForQuestionAnswering,
    }
    first_layer_key = "encoder.layers.0"
    dropout_config = dict(
        hidden_dropout_prob=0.1, local_attention_probs_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.1
    )

    def depth_config(self, num_layers: int) -> dict:
        return {"attn_layers": (["local", "lsh"] * num_layers)[:num_layers]}

    bad_configs = [
        (dict(attn_layers=["local", "full"]), "attn_layers"),
        (dict(attn_layers=[]), "attn_layers"),
        (dict(num_buckets=3), "num_buckets"),
        (dict(num_buckets=[4, 4, 4]), "num_buckets"),
        (dict(axial_pos_embds_dim=[16, 8]), "hidden_size"),
        (dict(axial_pos_shape=[4, 8]), "axial_pos_shape"),
        (dict(axial_pos_shape=[4, 4, 4]), "axial_pos_shape"),
        (dict(lsh_attn_chunk_length=0), "lsh_attn_chunk_length"),
        (dict(local_num_chunks_before=-1), "local_num_chunks_before"),
        (dict(num_hashes=0), "num_hashes"),
        (dict(is_decoder=True, lsh_num_chunks_after=1), "lsh_num_chunks_after"),
        (dict(hash_seed=-1), "hash_seed"),
    ]

    def expected_shape(self, auto_name: str, batch: int, length: int) -> tuple:
        if auto_name == "AutoModel":  # [y1; y2]: twice the hidden size
            return (batch, length, 2 * self.make_config().hidden_size)
        return super().expected_shape(auto_name, batch, length)

    def test_base_model_pooler_and_tuple_output(self):
        model = self.make_model("AutoModel")
        inputs = self.inputs_for("AutoModel")
        out = model(**inputs)
        assert "pooler_output" not in out  # Reformer has no pooler
        assert torch.equal(model(**inputs, return_dict=False)[0], out.last_hidden_state)

    def test_masked_lm_weights_tied(self, tmp_path):
        # The MLM decoder reads [y1; y2] (2 * hidden): it cannot be tied to the (hidden-wide) input embeddings.
        model = self.make_model("AutoModelForMaskedLM")
        assert model.get_output_embeddings().weight.shape == (VOCAB, 2 * model.config.hidden_size)
        assert not model.config.tie_word_embeddings

    def test_invalid_config_values_raise(self):
        for overrides, pattern in self.bad_configs:
            with pytest.raises(ValueError, match=pattern):
                self.make_config(**overrides)

    def test_compiled_packed_training_is_exact_and_does_not_recompile(self):
        # With fixed rotations: a compiled graph draws fresh training rotations from inductor's generator, other
        # numbers than eager mode's for the same seed (only their distribution is specified; see HfxLSHSelfAttention).
        self.packing_config = {**self.packing_config, "hash_seed": 5}
        super().test_compiled_packed_training_is_exact_and_does_not_recompile()


# ----- parity with transformers --------------------------------------------------------------------------------

LAYER_STACKS = {"local": ["local", "local"], "lsh": ["lsh", "lsh"], "mixed": ["local", "lsh", "lsh", "local"]}
VARIANTS = {
    "plain": {},
    "two_rounds": dict(num_hashes=2),
    "factorised": dict(num_buckets=[2, 4]),
    "look_ahead": dict(local_num_chunks_after=1, lsh_num_chunks_after=1, lsh_num_chunks_before=0),
    "learned_positions": dict(axial_pos_embds=False),
}


@pytest.mark.parametrize("stack", sorted(LAYER_STACKS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_matches_transformers(stack, variant, device, device_atol):
    ref, ours = pair(transformers.ReformerModel, HfxReformerModel, attn_layers=LAYER_STACKS[stack], **VARIANTS[variant])
    ref, ours = ref.to(device), ours.to(device)
    # 24 and 32: chunk multiples; 21 and 13: padded inside both models; 6: no longer than a chunk.
    for length in (24, 32, 21, 13, 6):
        ids = _ids(2, length, seed=length).to(device)
        with torch.no_grad():
            expected = ref(ids).last_hidden_state
            got = ours(ids).last_hidden_state
        torch.testing.assert_close(got, expected, atol=device_atol, rtol=0, msg=f"length {length}")


@pytest.mark.parametrize("stack", sorted(LAYER_STACKS))
@pytest.mark.parametrize("num_hashes", [1, 2])
def test_padded_batch_matches_transformers(stack, num_hashes):
    """With an attention mask: equal wherever transformers' result does not depend on the amount of padding (the
    batch is padded no further than each example's own chunk multiple)."""
    ref, ours = pair(transformers.ReformerModel, HfxReformerModel, attn_layers=LAYER_STACKS[stack], num_hashes=num_hashes)
    ids = _ids(2, 24, seed=1)
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0  # 21 real tokens: padded alone to 24 as well
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).last_hidden_state
        got = ours(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("head", ["causal", "masked"])
def test_lm_heads_match_transformers(head):
    # One hashing round for the decoder: where a causal query may attend to nothing but copies of itself, transformers
    # weighs its rounds by exp(logit - logsumexp) at logits near -1e5, where float32 steps are 0.008 apart, and its
    # output is off by up to 1 % (ours normalises the round weights: exactly the query's value).
    if head == "causal":
        ref, ours = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True,
                         attn_layers=["local", "lsh", "lsh"])  # fmt: skip
    else:
        ref, ours = pair(transformers.ReformerForMaskedLM, HfxReformerForMaskedLM, attn_layers=["lsh", "local"],
                         num_hashes=2)  # fmt: skip
    ids = _ids(2, 29, seed=4)
    labels = ids.clone()
    with torch.no_grad():
        expected = ref(ids, labels=labels)
        got = ours(ids, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.loss, expected.loss, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(attn_layers=["lsh", "lsh"]), dict(attn_layers=["local", "local"]), dict(num_hashes=2)],
    ids=["mixed", "lsh", "local", "two_rounds"],
)
def test_greedy_generation_matches_transformers(overrides):
    """Greedy decoding gives the tokens of transformers' full forwards (its ``use_cache=False``), for prompts no
    longer than a chunk (full attention until the sequence outgrows it) and longer ones, of any length: uncached
    always, and cached wherever the earlier positions' layer inputs do not depend on the length (local layers, and
    LSH layers that follow only local ones).

    transformers' own cached steps differ from its forward (they sort each round without the padding the forward
    adds and wrap around within the round), so they are not the reference. Two LSH layers are not cached exactly
    by any cache: inserting a position into the sorted buckets moves the chunks of earlier positions, whose outputs
    (the next layer's cached inputs) a longer full forward computes differently."""
    ref, ours = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True, **overrides)
    for length in (3, 5, 8, 13, 16):
        prompt = _ids(1, length, seed=length)
        with torch.no_grad():
            expected = ref.generate(prompt, max_new_tokens=14, do_sample=False, pad_token_id=1, use_cache=False)
            uncached = ours.generate(prompt, max_new_tokens=14, do_sample=False, pad_token_id=1, use_cache=False)
            cached = ours.generate(prompt, max_new_tokens=14, do_sample=False, pad_token_id=1)
        assert torch.equal(uncached, expected), (length, uncached, expected)
        if overrides.get("attn_layers") != ["lsh", "lsh"]:
            assert torch.equal(cached, expected), (length, cached, expected)


def test_cached_decoding_reuses_states_and_buckets():
    _, model = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True, num_hashes=2)
    ids = _ids(1, 19, seed=2)
    with torch.no_grad():
        out = model(ids[:, :16], use_cache=True)
        cache = out.past_buckets_states
        assert [s.shape[1] for s in cache.states] == [16, 16]
        assert cache.buckets[0] is None and cache.buckets[1].shape == (1, 2, 2, 16)  # local layer: no buckets
        for t in range(16, 19):
            out = model(ids[:, t : t + 1], past_buckets_states=cache, use_cache=True)
        assert cache.get_seq_length() == 19 and cache.buckets[1].shape[-1] == 19
    with pytest.raises(ValueError, match="one position at a time"):
        model(ids[:, :2], past_buckets_states=cache)


def test_generation_with_padding_follows_the_mask():
    """A left-padded batch decodes with the cache, under its mask: one new position per step, the tokens of an argmax
    loop over full masked forwards, and the ids under the mask do not matter."""
    _, model = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True)
    ids = _ids(2, 8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=1,
                         return_dict_in_generate=True, output_hidden_states=True)  # fmt: skip
    assert [tuple(step[0].shape) for step in out.hidden_states] == [(2, 8, 32)] + [(2, 1, 32)] * 11
    assert torch.equal(out.sequences, greedy_by_hand(model, ids, 12, attention_mask=mask))
    other = ids.clone()
    other[0, :3] = 5
    again = model.generate(other, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=1)
    assert torch.equal(again[:, 8:], out.sequences[:, 8:])


# Stacks whose earlier positions' layer inputs do not depend on the sequence length, so that a cached step can give the
# full forward's numbers (see test_greedy_generation_matches_transformers): local layers with a one-chunk look-back,
# and LSH layers (one or several hashing rounds, chunks shorter than the prompt) after local ones.
EXACT_CACHE_STACKS = {
    "local_lsh": dict(),
    "local_lsh_rounds": dict(num_hashes=2, lsh_attn_chunk_length=4, num_buckets=2),
    "local_local": dict(attn_layers=["local", "local"]),
}


@pytest.mark.parametrize("overrides", EXACT_CACHE_STACKS.values(), ids=EXACT_CACHE_STACKS.keys())
@pytest.mark.parametrize("step_mask", ["whole", "new"], ids=["mask_so_far", "mask_of_new_position"])
def test_padded_cached_steps_give_the_full_forward_logits(overrides, step_mask):
    """Left padding (as generate() pads) and none: every cached step's logits equal the last row of a full forward
    over the sequence so far under its mask, through lengths that change the internal padding and the chunk count.
    A step given only its own position's mask uses the padded keys the cache kept."""
    _, model = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True, **overrides)
    ids = _ids(3, 22, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    prompt = 8  # every row ends in a real token, as generate() continues it
    with torch.no_grad():
        out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], use_cache=True)
        cache = out.past_buckets_states
        full = model(ids[:, :prompt], attention_mask=mask[:, :prompt]).logits
        torch.testing.assert_close(out.logits, full, atol=ATOL, rtol=0)
        for t in range(prompt, ids.shape[1]):
            step = mask[:, : t + 1] if step_mask == "whole" else mask[:, t : t + 1]
            out = model(ids[:, t : t + 1], attention_mask=step, past_buckets_states=cache, use_cache=True)
            full = model(ids[:, : t + 1], attention_mask=mask[:, : t + 1]).logits[:, -1:]
            torch.testing.assert_close(out.logits, full, atol=ATOL, rtol=0, msg=f"length {t + 1}")
        assert torch.equal(cache.key_mask, mask.bool())


@pytest.mark.parametrize(
    ("kind", "num_hashes"), [("local", 1), ("lsh", 1), ("lsh", 3)], ids=["local", "lsh", "lsh_3_rounds"]
)
@pytest.mark.parametrize("before", [1, 2, 3])
def test_decode_step_is_the_last_row_of_the_full_attention(kind, num_hashes, before):
    """One attention layer: the cached step of a new position equals the last row (context and probabilities) of the
    layer's forward over every position, padded by the model to its chunk multiple and masked, for lengths around
    the chunk and windows wider than the chunk count (repeated chunks) and across hashing rounds."""
    _, config = configs(is_decoder=True, attn_layers=[kind], local_attn_chunk_length=4, lsh_attn_chunk_length=4,
                        local_num_chunks_before=before, lsh_num_chunks_before=before, num_hashes=num_hashes)  # fmt: skip
    attention = (HfxLSHSelfAttention if kind == "lsh" else HfxLocalSelfAttention)(config, 0).eval()
    generator = torch.Generator().manual_seed(before * 10 + num_hashes)
    for length in range(2, 22):
        states = torch.randn(2, length, config.hidden_size, generator=generator)
        mask = torch.ones(2, length, dtype=torch.bool)
        mask[1, : min(3, length - 1)] = False
        padded = decode_padded_length(length, config.chunk_multiple, config.min_chunk_length)
        with torch.no_grad():
            full = attention(nn.functional.pad(states, (0, 0, 0, padded - length)),
                             nn.functional.pad(mask, (0, padded - length)), None, True,
                             torch.full((2,), padded))  # fmt: skip
            # Both kinds decode through the same call; local attention has no buckets.
            context, buckets, probs = attention.decode_step(
                states[:, -1:], states[:, :-1], None, None, True, key_mask=mask, padded_length=padded
            )
            if kind == "lsh":
                assert buckets is None if padded <= 4 else buckets.shape == (2, 2, num_hashes, length)
            else:
                assert buckets is None
        torch.testing.assert_close(context, full.context[:, length - 1 : length], atol=ATOL, rtol=0)
        torch.testing.assert_close(probs, full.attentions[:, :, length - 1 : length, :length], atol=ATOL, rtol=0)


def test_explicit_positions_under_left_padding_cached_and_uncached():
    """Positions are counted from the first slot, padding included, as in transformers' Reformer; ``position_ids``
    given to generate() (here counted over the mask) are used instead, with the cache as without it."""
    _, model = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True)
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=1)
    cached = model.generate(ids, position_ids=positions, **kwargs)
    assert torch.equal(cached, model.generate(ids, position_ids=positions, use_cache=False, **kwargs))
    assert not torch.equal(cached, model.generate(ids, **kwargs))  # the first-slot positions are other inputs


# ----- any length, padding, determinism --------------------------------------------------------------------------


def test_odd_lengths_train():
    """transformers refuses to train on lengths that are not chunk multiples; ours pads inside."""
    ref_config, config = configs(attn_layers=["local", "lsh"], hidden_dropout_prob=0.1)
    with pytest.raises(ValueError, match="multiple"):
        transformers.ReformerForMaskedLM(ref_config).train()(_ids(2, 13), labels=_ids(2, 13))
    torch.manual_seed(0)
    model = HfxReformerForMaskedLM(config).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for length in (13, 5, 27, 64):
        ids = _ids(2, length, seed=length)
        out = model(input_ids=ids, labels=ids)
        assert out.logits.shape == (2, length, VOCAB) and torch.isfinite(out.loss)
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()


def test_trainer_causal_lm_odd_length(tmp_path):
    _, config = configs(is_decoder=True)
    torch.manual_seed(0)
    model = HfxReformerForCausalLM(config)
    rows = [{"input_ids": ids, "labels": ids} for ids in _ids(6, 19, seed=9)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=3, learning_rate=1e-3,
                             use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)  # fmt: skip
    result = Trainer(model=model, args=args, train_dataset=rows).train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))


@pytest.mark.parametrize("num_hashes", [1, 2])
@pytest.mark.parametrize("is_decoder", [False, True])
def test_padding_beyond_the_chunk_multiple_changes_nothing(num_hashes, is_decoder):
    """An example's output is the one it gets alone, however far its batch is padded (also for examples no longer
    than a chunk, which alone take the full-attention path)."""
    _, config = configs(attn_layers=["lsh", "local", "lsh"], num_hashes=num_hashes, is_decoder=is_decoder,
                        local_num_chunks_after=0 if is_decoder else 1)  # fmt: skip
    torch.manual_seed(0)
    model = HfxReformerModel(config).eval()
    lengths = (7, 17, 40)
    batch = torch.full((3, 45), 1)
    for row, length in enumerate(lengths):
        batch[row, :length] = _ids(1, length, seed=length)[0]
    with torch.no_grad():
        together = model(batch, attention_mask=(batch != 1).long()).last_hidden_state
        for row, length in enumerate(lengths):
            alone = model(batch[row : row + 1, :length]).last_hidden_state
            torch.testing.assert_close(together[row, :length], alone[0], atol=ATOL, rtol=0)


def test_eval_is_deterministic_and_training_rehashes():
    _, config = configs(attn_layers=["lsh", "lsh"], hash_seed=None)
    torch.manual_seed(0)
    model = HfxReformerModel(config)
    ids = _ids(1, 32)
    model.eval()
    with torch.no_grad():
        first, second = model(ids).last_hidden_state, model(ids).last_hidden_state
    assert torch.equal(first, second)
    torch.manual_seed(0)
    other = HfxReformerModel(config).eval()  # same seed, same config -> same rotations
    with torch.no_grad():
        assert torch.equal(other(ids).last_hidden_state, first)
    model.train()  # no dropout in TINY: only the fresh rotations of each training call change the result
    with torch.no_grad():
        outs = [model(ids).last_hidden_state for _ in range(4)]
    assert any(not torch.allclose(outs[0], o) for o in outs[1:])


def test_num_hashes_argument_overrides_the_config():
    _, config = configs(attn_layers=["lsh"], num_hashes=1)
    model = HfxReformerModel(config).eval()
    ids = _ids(1, 32)
    with torch.no_grad():
        one = model(ids).last_hidden_state
        four = model(ids, num_hashes=4).last_hidden_state
        assert torch.equal(model(ids, num_hashes=1).last_hidden_state, one)
    assert not torch.allclose(one, four)


def test_lsh_with_one_bucket_per_chunk_is_full_attention_minus_self():
    """Hand-checkable limit: an input no longer than a chunk attends to every other position with unit-RMS keys
    scaled by 1/sqrt(d), its own position masked (logit -1e5)."""
    _, config = configs(attn_layers=["lsh"], lsh_attn_chunk_length=16)
    model = HfxReformerModel(config).eval()
    attention = model.encoder.layers[0].attention
    hidden = torch.randn(2, 10, 32)
    with torch.no_grad():
        got = attention.self_attention(attention.layer_norm(hidden)).context
        x = attention.layer_norm(hidden)
        qk = (x @ attention.self_attention.query_key.weight.T).view(2, 10, 2, 8).transpose(1, 2)
        v = (x @ attention.self_attention.value.weight.T).view(2, 10, 2, 8).transpose(1, 2)
        k = qk / qk.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() / 8**0.5
        scores = (qk @ k.transpose(-1, -2)).masked_fill(torch.eye(10, dtype=torch.bool), -1e5)
        expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, 16)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_hashing_matches_transformers_rotations_and_factorisation():
    torch.manual_seed(0)
    qk = torch.randn(2, 3, 11, 8)
    rotations = draw_rotations(3, 8, 2, [2, 4], seed=7)
    torch.manual_seed(7)
    assert torch.equal(rotations, torch.randn(3, 8, 2, 3))  # transformers: manual_seed(hash_seed); randn(...)
    buckets = hash_buckets(qk, rotations, [2, 4])
    rotated = torch.einsum("bhtd,hdnr->bhntr", qk, rotations)
    first = torch.cat([rotated[..., :1], -rotated[..., :1]], -1).argmax(-1)
    second = torch.cat([rotated[..., 1:3], -rotated[..., 1:3]], -1).argmax(-1)
    assert torch.equal(buckets, first + 2 * second)
    assert buckets.min() >= 0 and buckets.max() < 8


# ----- reversible layers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", ["mixed", "lsh"])
def test_reversible_gradients_equal_stored_activation_gradients(stack):
    """Same weights, same random state: recomputing activations from the outputs (dropout masks and fresh LSH
    rotations restored) gives the gradients of ordinary backpropagation."""
    _, config = configs(attn_layers=LAYER_STACKS[stack], num_hashes=2, hash_seed=None, hidden_dropout_prob=0.2,
                        local_attention_probs_dropout_prob=0.2, lsh_attention_probs_dropout_prob=0.2)  # fmt: skip
    torch.manual_seed(0)
    reversible = HfxReformerForMaskedLM(config).train()
    stored = copy.deepcopy(reversible)
    stored.config.reversible = False
    ids = _ids(2, 27, seed=5)

    def gradients(model):
        torch.manual_seed(123)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss, {n: p.grad for n, p in model.named_parameters()}

    loss_rev, grads_rev = gradients(reversible)
    loss_std, grads_std = gradients(stored)
    torch.testing.assert_close(loss_rev, loss_std, atol=1e-6, rtol=0)
    assert grads_rev.keys() == grads_std.keys()
    for name, grad in grads_std.items():
        assert grad is not None and grads_rev[name] is not None, name
        torch.testing.assert_close(grads_rev[name], grad, atol=ATOL, rtol=0, msg=name)


def _reversible_vs_stored_gradients(device, dtype, stack="mixed"):
    """Worst gradient difference (relative to the gradient's largest entry) between reversible and stored-activation
    training under ``dtype`` autocast, with dropout and fresh rotations: the same random state for both."""
    _, config = configs(attn_layers=LAYER_STACKS[stack], num_hashes=2, hash_seed=None, hidden_dropout_prob=0.2,
                        local_attention_probs_dropout_prob=0.2, lsh_attention_probs_dropout_prob=0.2)  # fmt: skip
    torch.manual_seed(0)
    reversible = HfxReformerForMaskedLM(config).to(device).train()
    stored = copy.deepcopy(reversible)
    stored.config.reversible = False
    ids = _ids(2, 27, seed=5).to(device)

    def gradients(model):
        torch.manual_seed(123)
        with torch.autocast(device.type, dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        (loss * 1024).backward()  # scaled, as GradScaler does in float16
        return {n: p.grad for n, p in model.named_parameters()}

    grads_rev, grads_std = gradients(reversible), gradients(stored)
    return max(((grads_rev[n] - g).abs().max() / g.abs().max()).item() for n, g in grads_std.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reversible_gradients_under_autocast_equal_stored_activation_gradients(device, dtype, monkeypatch):
    """The backward recomputation replays the forward's autocast state: it differentiates the 16-bit function the
    forward computed and rebuilds the inputs from outputs it produced itself. Measured on the CPU: ~1e-7 of each
    gradient's scale with the replay; without it (the recomputation in float32) 0.8-32 % in bfloat16, 0.11-0.13 % in
    float16."""
    # About a quarter of the dtype's rounding step (2**-8, 2**-11): far above the replay's ~1e-7.
    tolerance = {torch.bfloat16: 1e-3, torch.float16: 1e-4}[dtype]
    assert _reversible_vs_stored_gradients(device, dtype) <= tolerance
    # The same comparison without the replay fails it: the test sees the autocast state.
    monkeypatch.setattr(reversible_module, "_replayed_autocast", lambda state: contextlib.nullcontext())
    assert _reversible_vs_stored_gradients(device, dtype) > 3 * tolerance


def test_reversible_replays_the_autocast_state_it_ran_under():
    """Recorded per device type: the forward's (enabled, dtype) for the inputs' device and the CPU."""
    with torch.autocast("cpu", dtype=torch.float16):
        state = reversible_module._autocast_state(torch.device("cpu"))
    assert state == (("cpu", True, torch.float16),)
    with reversible_module._replayed_autocast(state):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert not torch.is_autocast_enabled("cpu")
    off = reversible_module._autocast_state(torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16), reversible_module._replayed_autocast(off):
        assert not torch.is_autocast_enabled("cpu")  # off in the forward: off in the recomputation, too


def test_reversible_gradient_reaches_inputs_embeds():
    _, config = configs()
    model = HfxReformerModel(config).train()
    embeds = torch.randn(1, 24, 32, requires_grad=True)
    model(inputs_embeds=embeds).last_hidden_state.pow(2).sum().backward()
    reference = embeds.grad.clone()
    embeds.grad = None
    model.config.reversible = False
    model(inputs_embeds=embeds).last_hidden_state.pow(2).sum().backward()
    torch.testing.assert_close(embeds.grad, reference, atol=ATOL, rtol=0)


def test_fast_dropout_statistics_and_gradient():
    torch.manual_seed(0)
    x = torch.ones(200_000, requires_grad=True)
    y = fast_dropout(x, 0.25, True)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    assert torch.allclose(y[kept], torch.tensor(1 / 0.75))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d(out)/d(x) is the same mask and scale
    assert fast_dropout(x, 0.25, False) is x


# ----- input checks and heads ----------------------------------------------------------------------------------


def test_bad_inputs_raise():
    _, config = configs()
    model = HfxReformerModel(config).eval()
    with pytest.raises(ValueError, match="global attention"):
        model(_ids(1, 8), global_attention_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match="token_type_ids"):
        model(_ids(1, 8), token_type_ids=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="is_decoder=False"):
        HfxReformerForMaskedLM(configs(is_decoder=True)[1])
    causal = configs(local_num_chunks_after=1)[1]
    with pytest.raises(ValueError, match="local_num_chunks_after"):
        HfxReformerForCausalLM(causal)


def test_causal_lm_loss_keywords():
    _, model = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True)
    ids = _ids(2, 16)
    with torch.no_grad():
        plain = model(ids, labels=ids)
        shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        torch.testing.assert_close(model(ids, shift_labels=shifted).loss, plain.loss)
        summed = model(ids, labels=ids, num_items_in_batch=torch.tensor(10)).loss
        torch.testing.assert_close(summed, plain.loss * 30 / 10)  # 2 x 15 targets, summed over 10 items


def test_chunked_feed_forward_and_lm_head_give_the_same_logits():
    _, model = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True)
    chunked = HfxReformerForCausalLM(configs(is_decoder=True, chunk_size_feed_forward=5, chunk_size_lm_head=3)[1])
    chunked.load_state_dict(model.state_dict())
    ids = _ids(2, 23)
    with torch.no_grad():
        torch.testing.assert_close(chunked.eval()(ids).logits, model(ids).logits, atol=ATOL, rtol=0)


# ----- import of transformers checkpoints ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref_class,auto_name,output,overrides",
    [
        (transformers.ReformerModelWithLMHead, "AutoModelForCausalLM", "logits", dict(is_decoder=True)),
        (transformers.ReformerForMaskedLM, "AutoModelForMaskedLM", "logits", {}),
        (transformers.ReformerModel, "AutoModel", "last_hidden_state", {}),
        (transformers.ReformerForSequenceClassification, "AutoModelForSequenceClassification", "logits",
         dict(num_labels=3)),
        (transformers.ReformerForQuestionAnswering, "AutoModelForQuestionAnswering", "start_logits", {}),
    ],
    ids=["causal", "masked", "base", "classification", "qa"],
)  # fmt: skip
def test_import_transformers_checkpoint(tmp_path, ref_class, auto_name, output, overrides):
    ref_config, _ = configs(**overrides)
    torch.manual_seed(0)
    ref = ref_class(ref_config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name != "lm_head.bias":
                p.add_(0.2 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "src")
    model, tokenizer = convert_from_transformers(tmp_path / "src", tmp_path / "out")
    assert tokenizer is None and model.config.model_type == "hfx-reformer"
    loaded = getattr(transformers, auto_name).from_pretrained(tmp_path / "out").eval()
    assert type(loaded) is type(model)
    ids = _ids(2, 21)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids)[output], ref(ids)[output], atol=ATOL, rtol=0)


def test_import_keeps_sentencepiece_tokenizer(tmp_path):
    """google/reformer-crime-and-punishment ships a sentencepiece model (spiece.model): it comes along."""
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")  # transformers reads spiece.model through protobuf
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog", "crime and punishment",
                                 "raskolnikov walked along the street"] * 30))  # fmt: skip
    source = tmp_path / "src"
    source.mkdir()
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(source / "spiece"), vocab_size=30,
                                   model_type="unigram", bos_id=-1, eos_id=2, unk_id=0, pad_id=-1,
                                   hard_vocab_limit=False)  # fmt: skip
    pieces = spm.SentencePieceProcessor(model_file=str(source / "spiece.model")).get_piece_size()
    ref, _ = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True, vocab_size=pieces)
    ref.save_pretrained(source)  # config.json + weights next to spiece.model, as on the Hub
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    model, converted = convert_from_transformers(source, tmp_path / "out")
    text = "the lazy fox walked"
    assert converted is not None and converted(text)["input_ids"] == tokenizer(text)["input_ids"]
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=ATOL, rtol=0)


def test_import_of_a_byte_level_checkpoint_writes_the_byte_tokenizer(tmp_path):
    """google/reformer-enwik8 has no tokenizer: its ids are UTF-8 bytes + 2. The import saves a tokenizer for that."""
    ref, _ = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True, vocab_size=258)
    ref.save_pretrained(tmp_path / "src")
    _, tokenizer = convert_from_transformers(tmp_path / "src", tmp_path / "out")
    text = "Crime and Punishment, Преступление и наказание 🙂\n"
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for tok in (tokenizer, reloaded):
        ids = tok(text)["input_ids"]
        assert ids == [b + 2 for b in text.encode()]
        assert tok.decode(ids) == text


# ----- mixed precision, devices, host reads ------------------------------------------------------------------------


def test_mask_values_fit_every_dtype():
    """Masked keys < the query's own position < any real logit, every value finite in its dtype; float32 keeps
    transformers' -1e5 for the own position (parity)."""
    assert self_mask_value(torch.float32) == SELF_MASK_VALUE == -1e5
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        masked, own = mask_value(dtype), self_mask_value(dtype)
        values = torch.tensor([masked, own], dtype=dtype)
        assert torch.isfinite(values).all() and values[0] < values[1] < -1e3, dtype
        # Softmax of [masked, own]: all weight on the own position; of [own, real]: all on the real key.
        assert torch.softmax(values.float(), -1).tolist() == [0.0, 1.0]
        assert torch.softmax(torch.tensor([own, -50.0], dtype=dtype).float(), -1).tolist() == [0.0, 1.0]


@pytest.mark.parametrize("mode", ["autocast", "weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_decoder", [False, True], ids=["encoder", "decoder"])
def test_half_precision_padded_batch_is_finite_and_close(device, dtype, mode, is_decoder):
    """A padded batch of a length the model pads inside (the masked fills of padding and window repeats, rows whose
    only key is the query itself), two hashing rounds: finite in 16 bits and close to float32 at real positions."""
    _, config = configs(attn_layers=["lsh", "local", "lsh"], num_hashes=2, is_decoder=is_decoder,
                        local_num_chunks_after=0 if is_decoder else 1)  # fmt: skip
    torch.manual_seed(0)
    model = HfxReformerModel(config).to(device).eval()
    ids = _ids(3, 21, seed=2).to(device)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    mask[2, 5:] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).last_hidden_state
        if mode == "autocast":
            with torch.autocast(device.type, dtype=dtype):
                low = model(ids, attention_mask=mask).last_hidden_state
        else:
            low = model.to(dtype)(ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(low).all()
    real = mask.bool()
    scale = ref[real].abs().max()
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    assert (low[real].float() - ref[real]).abs().max() / scale < tolerance


def test_hashing_computes_in_float32():
    """Rotations and argmax in float32 under autocast and for 16-bit query-keys: the float32 buckets of the same
    inputs (in bfloat16 the rotated coordinates of near-ties round together or swap, and buckets flip)."""
    torch.manual_seed(0)
    qk = torch.randn(2, 4, 512, 32)
    rotations = draw_rotations(4, 32, 4, [8, 8], seed=1)
    expected = hash_buckets(qk, rotations, [8, 8])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(hash_buckets(qk, rotations, [8, 8]), expected)
    rounded = qk.bfloat16()
    assert torch.equal(hash_buckets(rounded, rotations, [8, 8]), hash_buckets(rounded.float(), rotations, [8, 8]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lsh_under_autocast_hashes_into_the_float32_buckets(dtype):
    """In eval (fixed rotations) the query-keys are hashed from a float32 projection under autocast: the buckets are
    the float32 model's. (Hashing the 16-bit projection flips ~0.4 % of them, which moves 11-24 % of the context.)"""
    _, config = configs(attn_layers=["lsh"], num_hashes=4, num_buckets=8, lsh_attn_chunk_length=16)
    torch.manual_seed(0)
    attention = HfxLSHSelfAttention(config, 0).eval()
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0, 0.3)
    hidden = torch.nn.functional.layer_norm(torch.randn(4, 256, 32), (32,))
    with torch.no_grad():
        ref = attention(hidden)
        with torch.autocast("cpu", dtype=dtype):
            low = attention(hidden)
    assert torch.equal(low.global_attentions, ref.global_attentions)
    scale = ref.context.abs().max()
    assert (low.context.float() - ref.context).abs().max() / scale < {torch.bfloat16: 6e-2, torch.float16: 8e-3}[dtype]


def test_round_statistics_compute_in_float32(monkeypatch):
    """The rounds' log-normalisers (and so their weights) come from float32 scores under autocast, in the forward
    and in cached decoding."""
    seen = []
    logsumexp = torch.logsumexp

    def recording(x, *args, **kwargs):
        seen.append(x.dtype)
        return logsumexp(x, *args, **kwargs)

    monkeypatch.setattr(torch, "logsumexp", recording)
    _, model = pair(transformers.ReformerModelWithLMHead, HfxReformerForCausalLM, is_decoder=True, num_hashes=2)
    ids = _ids(1, 17, seed=3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model(ids[:, :16], use_cache=True).past_buckets_states
        model(ids[:, 16:], past_buckets_states=cache, use_cache=True)  # decode_step with cached buckets
    assert len(seen) >= 2 and set(seen) == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cast_model_keeps_float32_rotations(dtype):
    """`.to(dtype)` leaves the fixed rotations float32 and exact (a rounded copy would hash into other buckets), and
    the eval forward uses the buffer itself, without a copy per call."""
    _, config = configs(attn_layers=["lsh", "lsh"])
    model = HfxReformerModel(config)
    exact = [layer.attention.self_attention.rotations.clone() for layer in model.encoder.layers]
    model.to(dtype).eval()
    for layer, rotations in zip(model.encoder.layers, exact):
        attention = layer.attention.self_attention
        assert attention.rotations.dtype == torch.float32 and torch.equal(attention.rotations, rotations)
        like = torch.empty(1, dtype=dtype)
        assert attention.rotations_for(attention.num_hashes, like) is attention.rotations
    model.float()
    for layer, rotations in zip(model.encoder.layers, exact):
        assert torch.equal(layer.attention.self_attention.rotations, rotations)


def test_training_rotations_are_drawn_on_the_input_device():
    """Fresh rotations (training without hash_seed) come from the input's device: no CPU tensor is created for an
    input elsewhere (here the meta device), in float32 whatever the input's dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CpuOutputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = torch.utils._pytree.tree_leaves(out)
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in leaves):
                self.ops.append(func)
            return out

    _, config = configs(attn_layers=["lsh"], hash_seed=None)
    attention = HfxLSHSelfAttention(config, 0).train()
    like = torch.empty(2, 2, 8, 8, device="meta", dtype=torch.bfloat16)
    with CpuOutputs() as mode:
        rotations = attention.rotations_for(3, like)
    assert rotations.device.type == "meta" and rotations.dtype == torch.float32
    assert rotations.shape == (2, 8, 3, 2)
    assert not mode.ops, mode.ops


def test_seeded_rotations_are_the_same_on_every_device(device):
    """With a hash_seed (and in eval) the rotations are drawn once on the CPU: the model moved to `device` hashes with
    exactly those numbers, and evaluates as on the CPU."""
    _, config = configs(attn_layers=["lsh", "lsh"], hash_seed=5, num_hashes=2)
    torch.manual_seed(0)
    model = HfxReformerModel(config).eval()
    ids = _ids(2, 40, seed=1)
    with torch.no_grad():
        on_cpu = model(ids).last_hidden_state
        model.to(device)
        moved = model(ids.to(device)).last_hidden_state.cpu()
    for layer in model.encoder.layers:
        attention = layer.attention.self_attention
        assert attention.rotations.device.type == device.type
        assert torch.equal(attention.rotations.cpu(), draw_rotations(2, 8, 2, 4, seed=5))
    torch.testing.assert_close(moved, on_cpu, atol=1e-4 if device.type != "cpu" else 0, rtol=0)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_host_reads_do_not_grow_with_reformer_depth(device, training):
    """Device-to-host reads (`bool(t)`, `.item()`, data-dependent shapes) in one forward (and, in training, the
    reversible backward) are the same for 2 and 4 layers, for a padded input of a length padded inside."""
    counts = []
    for depth in (2, 4):
        _, config = configs(attn_layers=(["local", "lsh"] * depth)[:depth], num_hashes=2, hash_seed=None,
                            hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.1,
                            local_attention_probs_dropout_prob=0.1)  # fmt: skip
        torch.manual_seed(0)
        model = HfxReformerForMaskedLM(config).to(device).train(training)
        ids = _ids(2, 21, seed=1).to(device)
        mask = torch.ones_like(ids)
        mask[1, 15:] = 0
        with HostReadCounter() as counter, torch.set_grad_enabled(training):
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            if training:
                out.loss.backward()
        counts.append(counter.count)
    assert counts[0] == counts[1], counts


def test_axial_position_embeddings_are_initialised():
    """transformers skips custom-code modules without parameters of their own when it initialises weights: the axial
    tables (held by a parameter list) get their normal(0, axial_norm_std) init all the same, as in transformers."""
    _, config = configs(axial_norm_std=0.5)
    torch.manual_seed(0)
    model = HfxReformerModel(config)
    for weight in model.embeddings.position_embeddings.weights:
        assert not torch.all(weight == 1) and 0.3 < weight.std().item() < 0.7
    ref_config, _ = configs(axial_norm_std=0.5)
    torch.manual_seed(0)
    ref = transformers.ReformerModel(ref_config)
    for ours, theirs in zip(model.embeddings.position_embeddings.weights, ref.embeddings.position_embeddings.weights):
        assert torch.equal(ours, theirs)


def test_num_hidden_layers_follows_attn_layers():
    """`num_hidden_layers` is derived from `attn_layers`; a value passed along (a shared base config, an old
    config.json) does not override it."""
    _, config = configs(attn_layers=["local", "lsh", "lsh"], num_hidden_layers=2)
    assert config.num_hidden_layers == 3 and len(HfxReformerModel(config).encoder.layers) == 3


# ----- transformers' common-test defects (issue 24) -----------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("head", ["causal", "masked"])
def test_resize_token_embeddings_resizes_the_head_bias(head, tied):
    """The head's separate bias follows the new vocabulary (kept for remaining tokens, 0 for new ones); before, the
    next forward failed with 'The size of tensor a (42) must match the size of tensor b (32)'. (The decoder reads
    2 * hidden features, so it is never actually tied to the embeddings; both config settings are covered.)"""
    _, config = configs(is_decoder=head == "causal", tie_word_embeddings=tied, vocab_size=32)
    model_class = HfxReformerForCausalLM if head == "causal" else HfxReformerForMaskedLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        model.lm_head.bias.normal_()
    bias = model.lm_head.bias.detach().clone()
    ids = torch.randint(5, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    for size in (42, 20):
        model.resize_token_embeddings(size)
        assert model.lm_head.bias.shape == (size,) and model.config.vocab_size == size
        keep = min(size, 32)
        torch.testing.assert_close(model.lm_head.bias[:keep], bias[:keep])
        with torch.no_grad():
            assert model(ids.clamp(max=size - 1)).logits.shape == (2, 16, size)
    assert any(p is model.lm_head.bias for p in model.parameters())


@pytest.mark.parametrize("is_decoder", [False, True], ids=["encoder", "decoder"])
def test_hidden_states_of_a_padded_length_carry_gradients(is_decoder):
    """13 tokens, chunks of 4: the model pads inside. Every returned hidden state is on the autograd path of the
    output (retain_grad gets a gradient), and the outputs are those without output_hidden_states."""
    _, config = configs(is_decoder=is_decoder, local_num_chunks_after=0 if is_decoder else 1)
    torch.manual_seed(0)
    model = HfxReformerModel(config).eval()
    ids = _ids(2, 13, seed=4)
    out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert all(h.shape == (2, 13, config.hidden_size) for h in out.hidden_states)
    for h in out.hidden_states:
        h.retain_grad()
    out.last_hidden_state.sum().backward()
    assert all(h.grad is not None and h.grad.abs().sum() > 0 for h in out.hidden_states)
    with torch.no_grad():
        plain = model(ids).last_hidden_state
    torch.testing.assert_close(out.last_hidden_state.detach(), plain, atol=0, rtol=0)
