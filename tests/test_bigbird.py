"""hfx-bigbird: the conformance suite, the block-sparse kernel against its dense masked oracle, the pattern itself,
seeded random blocks, and parity with transformers' BigBird in ``original_full`` mode."""

from __future__ import annotations

import pytest
import torch
from transformers import BigBirdConfig, BigBirdForMaskedLM, BigBirdModel

from hf_xformers import (
    HfxBigBirdConfig,
    HfxBigBirdForMaskedLM,
    HfxBigBirdForMultipleChoice,
    HfxBigBirdForQuestionAnswering,
    HfxBigBirdForSequenceClassification,
    HfxBigBirdForTokenClassification,
    HfxBigBirdModel,
)
from hf_xformers.conversion.convert_from_transformers import rename_bigbird_weights

from .conformance import TextModelConformance


class TestBigBirdConformance(TextModelConformance):
    packing_config = dict(fixed_random_blocks=True)  # training draws random blocks afresh otherwise
    config_class = HfxBigBirdConfig
    # Block 4 and one random block: SEQ_LEN = 24 is 6 blocks, more than the r + 4 = 5 that full coverage needs,
    # so rows 1 and 4 really are sparse.
    base_config = dict(
        block_size=4, num_random_blocks=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, sep_token_id=2
    )
    heads = {
        "AutoModel": HfxBigBirdModel,
        "AutoModelForMaskedLM": HfxBigBirdForMaskedLM,
        "AutoModelForSequenceClassification": HfxBigBirdForSequenceClassification,
        "AutoModelForMultipleChoice": HfxBigBirdForMultipleChoice,
        "AutoModelForQuestionAnswering": HfxBigBirdForQuestionAnswering,
        "AutoModelForTokenClassification": HfxBigBirdForTokenClassification,
    }
    bad_configs = [
        (dict(attention_type="sparse"), "attention_type"),
        (dict(block_size=0), "block_size"),
        (dict(num_random_blocks=-1), "num_random_blocks"),
        (dict(random_seed=-3), "random_seed"),
        (dict(pad_token_id=500), "pad_token_id"),
    ]

    def full_attention_config(self):
        return {"block_size": 8}  # 3 blocks <= r + 4: the pattern covers every key


class TestBigBirdOriginalFullConformance(TestBigBirdConformance):
    """The same suite with ``attention_type="original_full"`` (plain softmax attention, with attention dropout)."""

    base_config = {**TestBigBirdConformance.base_config, "attention_type": "original_full"}

    def full_attention_config(self):
        return {}


TINY = dict(
    vocab_size=120,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=160,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def attention_layer(block_size: int = 4, num_random_blocks: int = 2, **kw):
    torch.manual_seed(0)
    config = HfxBigBirdConfig(**TINY, block_size=block_size, num_random_blocks=num_random_blocks, **kw)
    return HfxBigBirdModel(config).encoder.layer[1].attention.self.eval()


def padded_masks(batch: int, length: int) -> torch.Tensor:
    """Right padding of different amounts, one example with a hole, one unpadded."""
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, max(1, length - 7) :] = False
    mask[2, max(1, length // 3) :] = False
    mask[3, length // 2 : length // 2 + 3] = False
    return mask


@pytest.mark.parametrize("num_random_blocks", [0, 1, 3])
@pytest.mark.parametrize("length", [1, 5, 13, 24, 37, 64, 101])
def test_block_sparse_kernel_equals_dense_oracle(num_random_blocks, length, device, device_atol):
    layer = attention_layer(block_size=4, num_random_blocks=num_random_blocks).to(device)
    x = torch.randn(4, length, TINY["hidden_size"], generator=torch.Generator().manual_seed(length)).to(device)
    mask = padded_masks(4, length).to(device)
    with torch.no_grad():
        oracle, _ = layer.dense_reference(x, mask)
        # The blocked kernel itself (short inputs dispatch elsewhere, tested below) and whatever forward dispatches to.
        for fast in (layer._block_sparse(x, mask, layer.plan(mask)), layer(x, mask).context):
            assert (fast - oracle).abs().max() <= device_atol
            assert torch.all(fast[~mask] == 0)


def test_kernel_and_oracle_gradients_agree():
    layer = attention_layer(block_size=3, num_random_blocks=2).train()
    layer.fixed_random_blocks = True  # the same pattern in both calls
    x = torch.randn(2, 40, TINY["hidden_size"], requires_grad=True)
    mask = padded_masks(4, 40)[1:3]
    grads = []
    for fn in (lambda: layer(x, mask).context, lambda: layer.dense_reference(x, mask)[0]):
        x.grad = None
        layer.zero_grad()
        fn().pow(2).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def block_pattern(layer, length: int) -> torch.Tensor:
    """``(heads, nb, nb)`` bool block pattern of one unpadded example, read from the dense mask."""
    b = layer.block_size
    mask = layer.pattern_mask(layer.plan(torch.ones(1, length, dtype=torch.bool)), length)[0]
    return mask[:, ::b, ::b]


def test_pattern_is_global_window_and_random_blocks():
    r, nb = 2, 12
    layer = attention_layer(block_size=4, num_random_blocks=r)
    pattern = block_pattern(layer, 4 * nb)
    assert pattern[:, [0, nb - 1]].all() and pattern[:, :, [0, nb - 1]].all()  # global rows and columns
    for i in range(1, nb - 1):
        window = [j for j in (i - 1, i, i + 1)]
        assert pattern[:, i, window].all()
        others = [j for j in range(1, nb - 1) if abs(i - j) > 1]
        # Exactly r random blocks per head among the rest.
        assert torch.equal(pattern[:, i, others].sum(-1), torch.full((layer.num_heads,), r))
    # Random blocks differ between heads and rows (not all the same block 0, as transformers' eval mode).
    assert len({tuple(p.flatten().tolist()) for p in pattern}) > 1


@pytest.mark.parametrize("num_random_blocks", [0, 2])
def test_short_inputs_are_exactly_full_attention(num_random_blocks):
    """With at most r + 4 blocks every row takes all remaining blocks: block-sparse IS full attention (no switch)."""
    torch.manual_seed(1)
    config = HfxBigBirdConfig(**TINY, block_size=4, num_random_blocks=num_random_blocks)
    sparse = HfxBigBirdModel(config).eval()
    full = HfxBigBirdModel(HfxBigBirdConfig(**TINY, block_size=4, attention_type="original_full")).eval()
    full.load_state_dict(sparse.state_dict())
    length = 4 * (num_random_blocks + 4) - 1
    assert block_pattern(sparse.encoder.layer[0].attention.self, length).all()
    ids = torch.randint(5, 120, (2, length))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    with torch.no_grad():
        a, b = sparse(ids, attention_mask=mask).last_hidden_state, full(ids, attention_mask=mask).last_hidden_state
    assert (a - b).abs()[mask.bool()].max() <= 1e-5
    # One block more and the pattern no longer covers everything: outputs differ.
    longer = torch.randint(5, 120, (1, length + 1 + 4 * 2))
    with torch.no_grad():
        assert (sparse(longer).last_hidden_state - full(longer).last_hidden_state).abs().max() > 1e-4


def test_random_blocks_are_seeded_in_eval_and_redrawn_in_training(tmp_path):
    torch.manual_seed(2)
    config = HfxBigBirdConfig(**TINY, block_size=4, num_random_blocks=2, random_seed=7)
    model = HfxBigBirdModel(config).eval()
    ids = torch.randint(5, 120, (2, 77))
    with torch.no_grad():
        first = model(ids).last_hidden_state
        assert torch.equal(first, model(ids).last_hidden_state)
    model.save_pretrained(tmp_path)
    reloaded = HfxBigBirdModel.from_pretrained(tmp_path).eval()
    assert reloaded.config.random_seed == 7
    with torch.no_grad():
        assert torch.equal(first, reloaded(ids).last_hidden_state)
        # Another seed, another pattern.
        other = HfxBigBirdModel(HfxBigBirdConfig(**TINY, block_size=4, num_random_blocks=2, random_seed=8)).eval()
        other.load_state_dict(model.state_dict())
        assert (other(ids).last_hidden_state - first).abs().max() > 1e-4
        # Training (dropout is 0 here) redraws the blocks at every call ...
        model.train()
        a, b = model(ids).last_hidden_state, model(ids).last_hidden_state
        assert (a - b).abs().max() > 1e-4
        # ... unless the config fixes them: then training uses the seeded eval pattern.
        fixed = HfxBigBirdModel.from_pretrained(tmp_path, fixed_random_blocks=True).train()
        assert torch.equal(fixed(ids).last_hidden_state, first)


def test_layers_draw_different_random_blocks():
    torch.manual_seed(3)
    model = HfxBigBirdModel(HfxBigBirdConfig(**TINY, block_size=4, num_random_blocks=2)).eval()
    patterns = [block_pattern(layer.attention.self, 80) for layer in model.encoder.layer]
    assert not torch.equal(patterns[0], patterns[1])


def test_output_attentions_are_the_pattern():
    torch.manual_seed(4)
    model = HfxBigBirdModel(HfxBigBirdConfig(**TINY, block_size=4, num_random_blocks=1)).eval()
    ids = torch.randint(5, 120, (1, 50))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    layer = model.encoder.layer[0].attention.self
    allowed = layer.pattern_mask(layer.plan(torch.ones(1, 50, dtype=torch.bool)), 50)
    att = out.attentions[0]
    assert att.shape == (1, 4, 50, 50) and torch.all(att[~allowed] == 0)
    torch.testing.assert_close(att.sum(-1), torch.ones(1, 4, 50))


# --- parity with transformers ---------------------------------------------------------------------------------


def transformers_pair(model_class, hfx_class, seed: int, **kw):
    torch.manual_seed(seed)
    config = dict(TINY, **kw, attention_type="original_full", hidden_act="gelu_new", type_vocab_size=2)
    ref = model_class(BigBirdConfig(**config)).eval()
    ours = hfx_class(HfxBigBirdConfig(**config)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # move every weight off its initial value, so misplaced weights show
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    result = ours.load_state_dict(
        {k.removeprefix("bigbird.") if hfx_class is HfxBigBirdModel else k: v
         for k, v in rename_bigbird_weights(ref.state_dict()).items()}, strict=False,
    )  # fmt: skip
    # transformers' BigBirdForMaskedLM keeps a pooler it never uses; ours has none.
    assert all(".pooler." in k for k in result.unexpected_keys) and set(result.missing_keys) <= {
        "lm_head.decoder.weight"
    }
    return ref, ours


def padded_batch(length: int = 45):
    ids = torch.randint(5, TINY["vocab_size"], (3, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, length - 9 :] = 0
    mask[2, 12:] = 0
    ids[mask == 0] = 0
    token_types = torch.zeros_like(ids)
    token_types[:, length // 2 :] = 1
    return ids, mask, token_types


@pytest.mark.parametrize("rescale", [False, True])
def test_base_model_matches_transformers_original_full(rescale, device, device_atol):
    ref, ours = (m.to(device) for m in transformers_pair(BigBirdModel, HfxBigBirdModel, seed=5, rescale_embeddings=rescale))
    ids, mask, token_types = (t.to(device) for t in padded_batch())
    with torch.no_grad():
        a = ref(ids, attention_mask=mask, token_type_ids=token_types)
        b = ours(ids, attention_mask=mask, token_type_ids=token_types)
    assert (a.last_hidden_state - b.last_hidden_state).abs().max() <= device_atol
    assert (a.pooler_output - b.pooler_output).abs().max() <= device_atol


def test_masked_lm_matches_transformers_original_full():
    ref, ours = transformers_pair(BigBirdForMaskedLM, HfxBigBirdForMaskedLM, seed=6)
    assert ours.lm_head.decoder.weight is ours.bigbird.embeddings.word_embeddings.weight
    ids, mask, _ = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask, labels=labels)
        b = ours(ids, attention_mask=mask, labels=labels)
    assert (a.logits - b.logits).abs().max() <= 1e-5
    assert abs(a.loss.item() - b.loss.item()) <= 1e-5


def test_bfloat16_block_sparse_is_close_to_float32():
    torch.manual_seed(9)
    model = HfxBigBirdForMaskedLM(HfxBigBirdConfig(**TINY, block_size=4, num_random_blocks=2)).eval()
    ids, mask, _ = padded_batch(70)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        half = model.to(torch.bfloat16)(ids, attention_mask=mask).logits.float()
    assert torch.isfinite(half).all()
    assert (half - full).abs()[mask.bool()].max() < 0.1 * full.abs().max()


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train-fresh-random-blocks"])
@pytest.mark.parametrize("length", [3, 7, 13, 20], ids=lambda n: f"len{n}")
def test_short_input_full_attention_path_equals_block_sparse(length, training):
    """Up to r + 4 blocks the pattern covers every key, so one full-attention call replaces the blocked path; the
    blocked path (what tracing uses) must give the same result, padding queries zeroed."""
    from hf_xformers.attention.block_sparse import HfxBlockSparseSelfAttention

    torch.manual_seed(0)
    config = HfxBigBirdConfig(hidden_size=32, num_attention_heads=4, block_size=4, num_random_blocks=1,
                              vocab_size=50, max_position_embeddings=32, attention_probs_dropout_prob=0.0)  # fmt: skip
    attention = HfxBlockSparseSelfAttention(config).train(training)  # full path up to 5 blocks = 20 tokens
    hidden = torch.randn(3, length, 32)
    mask = torch.ones(3, length, dtype=torch.bool)
    mask[1, max(1, length // 2) :] = False
    with torch.no_grad():
        torch.manual_seed(1)  # training draws random blocks from the global RNG: the same draws for both paths
        fast = attention(hidden, mask).context
        torch.manual_seed(1)
        blocked = attention._block_sparse(hidden, mask, attention.plan(mask))
    torch.testing.assert_close(fast, blocked, atol=1e-5, rtol=0)
    assert fast[1, max(1, length // 2) :].abs().max() == 0 if length > 1 else True


def test_block_sparse_has_no_attention_dropout_but_original_full_does():
    """As in the original implementation and transformers' block-sparse kernel, attention_probs_dropout_prob does not
    apply to block_sparse attention (at any length: blocked path and short-input full path); original_full uses it."""
    from hf_xformers.attention.block_sparse import HfxBlockSparseSelfAttention

    torch.manual_seed(0)
    config = HfxBigBirdConfig(hidden_size=32, num_attention_heads=4, block_size=4, num_random_blocks=1,
                              vocab_size=50, max_position_embeddings=64, attention_probs_dropout_prob=0.5,
                              fixed_random_blocks=True)  # fmt: skip
    layer = HfxBlockSparseSelfAttention(config)
    for length in (12, 45):  # full-attention path (3 blocks) and blocked path (12 blocks)
        hidden = torch.randn(2, length, 32)
        torch.testing.assert_close(layer.train()(hidden).context, layer.eval()(hidden).context, rtol=0, atol=1e-6)
    config.attention_type = "original_full"
    full = HfxBlockSparseSelfAttention(config)
    hidden = torch.randn(2, 12, 32)
    assert (full.train()(hidden).context - full.eval()(hidden).context).abs().max() > 0.1


@pytest.mark.parametrize("num_random_blocks", [0, 1, 3])
def test_dense_dispatch_is_where_it_computes_no_more_block_products(num_random_blocks):
    """Dense: nb * nb block products; blocked: 5 + r for each of the nb - 2 middle blocks plus nb for each of the
    two global query blocks (block nb - 1 is always global or padding)."""
    layer = attention_layer(block_size=4, num_random_blocks=num_random_blocks)
    for nb in range(1, 40):
        blocked = (nb - 2) * (5 + num_random_blocks) + 2 * nb
        assert layer.dense_is_cheaper(nb) == (nb * nb <= blocked)
    assert attention_layer(block_size=4, num_random_blocks=3).dense_is_cheaper(8)  # 512 tokens at block_size 64
    assert not attention_layer(block_size=4, num_random_blocks=3).dense_is_cheaper(9)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train-fresh-random-blocks"])
@pytest.mark.parametrize("num_random_blocks,length", [(0, 18), (0, 20), (1, 22), (1, 24), (3, 30), (3, 32)])
def test_dense_pattern_path_equals_block_sparse(num_random_blocks, length, training):
    """Past full coverage (more than r + 4 blocks) but where dense is no more work, forward runs one SDPA call with
    the pattern as a mask: the same outputs and gradients as the blocked path, padded or not (an unpadded batch
    shares one mask over the batch)."""
    layer = attention_layer(block_size=4, num_random_blocks=num_random_blocks).train(training)
    nb = -(-length // 4)
    assert nb > num_random_blocks + 4 and layer.dense_is_cheaper(nb)
    x = torch.randn(4, length, TINY["hidden_size"], generator=torch.Generator().manual_seed(length))
    for mask in (padded_masks(4, length), torch.ones(4, length, dtype=torch.bool)):
        results = []
        for dispatch in (True, False):
            h = x.clone().requires_grad_(True)
            layer.zero_grad()
            torch.manual_seed(3)  # training draws random blocks from the global RNG: the same draws for both paths
            out = layer(h, mask).context if dispatch else layer._block_sparse(h, mask, layer.plan(mask))
            out.pow(2).sum().backward()
            results.append([out.detach(), h.grad] + [p.grad.clone() for p in layer.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert torch.all(results[0][0][~mask] == 0)


def test_attention_refuses_inputs_past_the_seeded_block_table():
    """Called on its own (the model checks lengths first), the layer says why it cannot pick seeded random blocks for
    more blocks than its table holds, instead of drawing unseeded ones in eval mode."""
    layer = attention_layer(block_size=4, num_random_blocks=1)
    too_long = layer.max_blocks * 4 + 4
    with pytest.raises(ValueError, match="max_position_embeddings"):
        layer(torch.randn(1, too_long, TINY["hidden_size"]))
