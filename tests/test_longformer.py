"""hfx-longformer: the conformance suite, parity with transformers' Longformer and with full-attention RoBERTa."""

from __future__ import annotations

import pytest
import torch
from transformers import LongformerConfig, LongformerForMaskedLM, LongformerModel, RobertaConfig, RobertaModel

from hf_xformers import (
    HfxLongformerConfig,
    HfxLongformerForMaskedLM,
    HfxLongformerForMultipleChoice,
    HfxLongformerForQuestionAnswering,
    HfxLongformerForSequenceClassification,
    HfxLongformerForTokenClassification,
    HfxLongformerModel,
)

from .conformance import SEQ_LEN, TextModelConformance


class TestLongformerConformance(TextModelConformance):
    config_class = HfxLongformerConfig
    base_config = dict(attention_window=[4, 6], type_vocab_size=1)
    heads = {
        "AutoModel": HfxLongformerModel,
        "AutoModelForMaskedLM": HfxLongformerForMaskedLM,
        "AutoModelForSequenceClassification": HfxLongformerForSequenceClassification,
        "AutoModelForMultipleChoice": HfxLongformerForMultipleChoice,
        "AutoModelForQuestionAnswering": HfxLongformerForQuestionAnswering,
        "AutoModelForTokenClassification": HfxLongformerForTokenClassification,
    }
    bad_configs = [
        (dict(attention_window=5), "even"),
        (dict(attention_window=[4, 4, 4]), "one window per layer"),
        (dict(attention_window=0), "positive even"),
        (dict(max_position_embeddings=2), "max_position_embeddings"),
    ]

    def depth_config(self, num_layers):
        return {"num_hidden_layers": num_layers, "attention_window": 4}

    def full_attention_config(self):
        return {"attention_window": 2 * SEQ_LEN}  # every window covers the whole input


TINY = dict(
    vocab_size=120,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=130,
    type_vocab_size=1,
    layer_norm_eps=1e-5,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def hf_to_hfx_state_dict(state_dict: dict) -> dict:
    """transformers Longformer/RoBERTa names -> ours (tests only; conversion/ has the full importer)."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith("position_ids"):
            continue
        key = key.replace("roberta.", "longformer.", 1)
        out["lm_head.decoder.bias" if key == "lm_head.bias" else key] = value
    return out


def padded_batch_with_globals(length: int = 53):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, TINY["vocab_size"], (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length - 9 :] = 0
    mask[2, 12:] = 0
    ids[mask == 0] = 1
    ids[:, 0] = 0
    glob = torch.zeros_like(ids)
    glob[0, [0, 7, 30]] = 1
    glob[1, 0] = 1
    glob[2, [0, 4, 11]] = 1
    return ids, mask, glob


@pytest.fixture(scope="module", params=[[4, 10], [128, 256]], ids=["small-windows", "quarter-window-blocks"])
def mlm_pair(request):
    """Windows under 64 use whole-window query blocks, larger ones quarter-window blocks: test both."""
    torch.manual_seed(0)
    kw = dict(TINY, attention_window=request.param, max_position_embeddings=400)
    ref = LongformerForMaskedLM(LongformerConfig(**kw)).eval()
    ours = HfxLongformerForMaskedLM(HfxLongformerConfig(**kw)).eval()
    result = ours.load_state_dict(hf_to_hfx_state_dict(ref.state_dict()), strict=False)
    assert not result.unexpected_keys and not result.missing_keys
    return ref, ours


@pytest.mark.parametrize("use_globals", [False, True])
def test_masked_lm_matches_transformers(mlm_pair, use_globals, device, device_atol):
    ref, ours = (model.to(device) for model in mlm_pair)
    ids, mask, glob = padded_batch_with_globals(length=53 if ours.config.attention_window[0] < 100 else 301)
    ids, mask, glob = ids.to(device), mask.to(device), glob.to(device) if use_globals else None
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, global_attention_mask=glob).logits
        got = ours(ids, attention_mask=mask, global_attention_mask=glob).logits
    assert (expected - got).abs().max() <= device_atol


def test_base_model_and_attentions_match_transformers(device, device_atol):
    torch.manual_seed(1)
    kw = dict(TINY, attention_window=6)
    ref = LongformerModel(LongformerConfig(**kw)).eval()
    ours = HfxLongformerModel(HfxLongformerConfig(**kw)).eval()
    ours.load_state_dict(hf_to_hfx_state_dict(ref.state_dict()))
    ref, ours = ref.to(device), ours.to(device)
    ids, mask, glob = (t.to(device) for t in padded_batch_with_globals(length=40))
    with torch.no_grad():
        a = ref(ids, attention_mask=mask, global_attention_mask=glob, output_attentions=True)
        b = ours(ids, attention_mask=mask, global_attention_mask=glob, output_attentions=True)
    real = mask.bool()
    assert (a.last_hidden_state - b.last_hidden_state).abs()[real].max() <= device_atol
    assert (a.pooler_output - b.pooler_output).abs().max() <= device_atol
    for ra, oa, rg, og in zip(a.attentions, b.attentions, a.global_attentions, b.global_attentions):
        assert ra.shape == oa.shape  # (batch, heads, seq, globals + window + 1)
        assert (ra - oa).abs().max() <= device_atol
        # transformers lays global attentions out as (batch, heads, padded seq, globals).
        valid = torch.arange(og.shape[2], device=device)[None, :] < glob.sum(-1, keepdim=True)  # 3, 1, 3 globals
        assert (rg[:, :, : ids.shape[1]].transpose(-1, -2) - og).abs().permute(0, 2, 1, 3)[valid].max() <= device_atol
        assert torch.all(og.permute(0, 2, 1, 3)[~valid] == 0)


@pytest.mark.parametrize("length", [9, 17])
def test_equals_full_attention_roberta_when_window_covers_sequence(length):
    torch.manual_seed(2)
    ref = RobertaModel(RobertaConfig(**TINY), add_pooling_layer=False).eval()
    ours = HfxLongformerModel(HfxLongformerConfig(**TINY, attention_window=2 * length), add_pooling_layer=False).eval()
    state = hf_to_hfx_state_dict({f"roberta.{k}": v for k, v in ref.state_dict().items()})
    result = ours.load_state_dict({k.removeprefix("longformer."): v for k, v in state.items()}, strict=False)
    assert set(result.missing_keys) == {
        f"encoder.layer.{i}.attention.self.{n}_global.{p}"
        for i in range(2)
        for n in ("query", "key", "value")
        for p in ("weight", "bias")
    }
    ids = torch.randint(5, TINY["vocab_size"], (2, length))
    mask = torch.ones_like(ids)
    mask[1, length - 3 :] = 0
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).last_hidden_state
        fused = ours(ids, attention_mask=mask).last_hidden_state
        blocked = ours(ids, attention_mask=mask, output_attentions=True).last_hidden_state  # banded eager path
    real = mask.bool()
    assert (expected - fused).abs()[real].max() <= 1e-5
    assert (expected - blocked).abs()[real].max() <= 1e-5


def test_fused_and_eager_paths_agree_with_globals():
    torch.manual_seed(3)
    model = HfxLongformerModel(HfxLongformerConfig(**TINY, attention_window=[4, 8])).eval()
    ids, mask, glob = padded_batch_with_globals()
    with torch.no_grad():
        fused = model(ids, attention_mask=mask, global_attention_mask=glob).last_hidden_state
        eager = model(ids, attention_mask=mask, global_attention_mask=glob, output_attentions=True)
    assert (fused - eager.last_hidden_state).abs().max() <= 1e-5
    for att in eager.attentions:
        rows = att.sum(-1)  # every real, non-global query's probabilities sum to one
        local = mask.bool() & ~glob.bool()
        torch.testing.assert_close(rows.permute(0, 2, 1)[local], torch.ones_like(rows.permute(0, 2, 1)[local]))


def test_window_limits_receptive_field():
    """A token beyond the window (and not global) must not influence a query after one layer."""
    torch.manual_seed(4)
    config = HfxLongformerConfig(**dict(TINY, num_hidden_layers=1), attention_window=4)
    model = HfxLongformerModel(config).eval()
    ids = torch.randint(5, TINY["vocab_size"], (1, 30))
    changed = ids.clone()
    changed[0, 20] = 7 if ids[0, 20] != 7 else 8
    with torch.no_grad():
        a, b = model(ids).last_hidden_state, model(changed).last_hidden_state
    diff = (a - b).abs().amax(-1)[0]
    assert torch.all(diff[[i for i in range(30) if abs(i - 20) > 2]] == 0)
    assert torch.all(diff[18:23] > 0)
    # Made global, the same token reaches every position.
    glob = torch.zeros_like(ids)
    glob[0, 20] = 1
    with torch.no_grad():
        a = model(ids, global_attention_mask=glob).last_hidden_state
        b = model(changed, global_attention_mask=glob).last_hidden_state
    assert torch.all((a - b).abs().amax(-1) > 0)


def test_global_projections_get_gradients_without_global_tokens():
    """DDP needs every parameter in the graph even when no token is global."""
    model = HfxLongformerModel(HfxLongformerConfig(**TINY, attention_window=4)).train()
    out = model(torch.randint(5, TINY["vocab_size"], (2, 20)))
    (out.last_hidden_state.sum() + out.pooler_output.sum()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_classification_makes_first_token_global_by_default():
    torch.manual_seed(5)
    model = HfxLongformerForSequenceClassification(HfxLongformerConfig(**TINY, attention_window=4, num_labels=2)).eval()
    ids, mask, _ = padded_batch_with_globals()
    first = torch.zeros_like(ids)
    first[:, 0] = 1
    with torch.no_grad():
        default = model(ids, attention_mask=mask).logits
        explicit = model(ids, attention_mask=mask, global_attention_mask=first).logits
        none = model(ids, attention_mask=mask, global_attention_mask=torch.zeros_like(ids)).logits
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)
    assert (default - none).abs().max() > 1e-4


def test_question_answering_makes_question_global_and_needs_a_separator():
    torch.manual_seed(6)
    model = HfxLongformerForQuestionAnswering(HfxLongformerConfig(**TINY, attention_window=4)).eval()
    ids = torch.randint(5, TINY["vocab_size"], (1, 20))
    ids[0, 0], ids[0, 5], ids[0, 6], ids[0, -1] = 0, 2, 2, 2
    question = torch.zeros_like(ids)
    question[0, :5] = 1
    with torch.no_grad():
        default = model(ids).start_logits
        explicit = model(ids, global_attention_mask=question).start_logits
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)
    with pytest.raises(ValueError, match="sep_token_id"):
        model(torch.randint(5, TINY["vocab_size"], (1, 20)))


def test_lengths_that_are_not_a_multiple_of_the_window():
    """Inputs are padded to the block size inside each layer and cut back: any length works."""
    torch.manual_seed(7)
    model = HfxLongformerModel(HfxLongformerConfig(**TINY, attention_window=[6, 8])).eval()
    for length in (1, 2, 5, 13, 31):
        out = model(torch.randint(5, TINY["vocab_size"], (2, length))).last_hidden_state
        assert out.shape == (2, length, TINY["hidden_size"]) and torch.isfinite(out).all()


def test_global_attention_mask_needs_matching_shape():
    model = HfxLongformerModel(HfxLongformerConfig(**TINY, attention_window=4))
    with pytest.raises(ValueError, match="global_attention_mask"):
        model(torch.randint(5, 100, (2, 10)), global_attention_mask=torch.ones(2, 9))


def test_pipelines_work_from_a_saved_directory(tmp_path):
    from transformers import pipeline

    from .tiny_tokenizers import roberta_tokenizer

    tok = roberta_tokenizer()
    config = HfxLongformerConfig(**dict(TINY, vocab_size=len(tok)), attention_window=4, num_labels=2)
    torch.manual_seed(8)
    HfxLongformerForMaskedLM(config).save_pretrained(tmp_path / "mlm")
    tok.save_pretrained(tmp_path / "mlm")
    fill = pipeline("fill-mask", model=str(tmp_path / "mlm"), top_k=3)
    preds = fill("the quick brown <mask> jumps over the lazy dog")
    assert len(preds) == 3 and all(0 <= p["score"] <= 1 for p in preds)

    config.id2label, config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    HfxLongformerForSequenceClassification(config).save_pretrained(tmp_path / "cls")
    tok.save_pretrained(tmp_path / "cls")
    classify = pipeline("text-classification", model=str(tmp_path / "cls"))
    assert classify("hello world")[0]["label"] in {"neg", "pos"}


def test_bfloat16_forward_is_finite_and_close_to_float32():
    torch.manual_seed(9)
    model = HfxLongformerForMaskedLM(HfxLongformerConfig(**TINY, attention_window=[4, 8])).eval()
    ids, mask, glob = padded_batch_with_globals()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, global_attention_mask=glob).logits
        half = model.to(torch.bfloat16)(ids, attention_mask=mask, global_attention_mask=glob).logits.float()
    assert torch.isfinite(half).all()
    assert (half - full).abs()[mask.bool()].max() < 0.1 * full.abs().max()


def test_multiple_choice_default_global_mask_matches_transformers():
    """Without a mask, the choice tokens (after the first </s></s>) are global, as in transformers."""
    from transformers import LongformerForMultipleChoice

    torch.manual_seed(10)
    kw = dict(TINY, attention_window=4)
    ref = LongformerForMultipleChoice(LongformerConfig(**kw)).eval()
    ours = HfxLongformerForMultipleChoice(HfxLongformerConfig(**kw)).eval()
    ours.load_state_dict(hf_to_hfx_state_dict(ref.state_dict()))
    ids = torch.randint(5, TINY["vocab_size"], (2, 2, 21))
    ids[..., 0] = 0
    ids[..., 8], ids[..., 9], ids[..., -1] = 2, 2, 2  # <s> context </s></s> choice </s>
    with torch.no_grad():
        expected, got = ref(ids).logits, ours(ids).logits
    assert (expected - got).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="sep_token_id"):
        ours(torch.randint(5, TINY["vocab_size"], (1, 2, 21)))


@pytest.mark.parametrize("length", [5, 9, 13, 24, 25], ids=lambda n: f"len{n}")
def test_short_input_dense_path_equals_banded_path(length):
    """Up to b + 2w tokens one masked dense call replaces the blocked computation; both must agree (padding,
    global tokens, a window that covers the input and one that does not)."""
    from hf_xformers.attention.sliding_window import HfxSlidingWindowSelfAttention

    torch.manual_seed(0)
    config = HfxLongformerConfig(hidden_size=32, num_attention_heads=4, attention_window=16, vocab_size=50)
    attention = HfxSlidingWindowSelfAttention(config).eval()  # w = 8, b = 8: dense up to 24 tokens
    hidden = torch.randn(3, length, 32)
    mask = torch.ones(3, length, dtype=torch.bool)
    mask[1, length // 2 :] = False
    mask[2, 0] = True
    mask[2, 1:] = length < 3
    is_global = torch.zeros(3, length, dtype=torch.bool)
    is_global[0, length // 3] = True
    for global_mask in (None, is_global):
        with torch.no_grad():
            fast = attention(hidden, mask, global_mask).context
            banded = attention(hidden, mask, global_mask, output_attentions=True).context  # the banded path
        torch.testing.assert_close(fast, banded, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [1, 2])
def test_inference_in_chunks_equals_one_pass(monkeypatch, batch):
    """Without gradients, long inputs go through the banded attention and the feed-forward a chunk at a time; the
    numbers must be those of the one-pass computation (which a recorded gradient still takes), with global tokens
    and padding."""
    from hf_xformers.attention import sliding_window, sliding_window_banded
    from hf_xformers.layers import encoder

    config = HfxLongformerConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        attention_window=16, max_position_embeddings=300, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = HfxLongformerModel(config).eval()
    torch.manual_seed(0)
    input_ids = torch.randint(5, 100, (batch, 250))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, 230:] = 0
    global_attention_mask = torch.zeros_like(input_ids)
    global_attention_mask[:, [0, 77]] = 1
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, global_attention_mask=global_attention_mask)
    one_pass = model(**inputs).last_hidden_state  # gradients recorded: no chunks
    assert one_pass.requires_grad
    calls = []
    original = sliding_window.HfxSlidingWindowSelfAttention._chunked_banded_attention
    monkeypatch.setattr(
        sliding_window.HfxSlidingWindowSelfAttention, "_chunked_banded_attention",
        lambda self, *a: calls.append(1) or original(self, *a),
    )  # fmt: skip
    monkeypatch.setattr(sliding_window_banded, "LOCAL_CHUNK_TOKENS", 8)  # one 8-query block per chunk
    monkeypatch.setattr(encoder, "FFN_CHUNK_TOKENS", 60)
    with torch.no_grad():
        chunked = model(**inputs).last_hidden_state
    assert len(calls) == config.num_hidden_layers
    torch.testing.assert_close(chunked, one_pass.detach(), atol=1e-6, rtol=1e-5)


def test_chunked_inference_in_train_mode_keeps_attention_dropout(monkeypatch):
    """A train-mode forward without gradients over more blocks than one chunk (the chunked path, e.g. Monte Carlo
    dropout at inference) drops attention probabilities as the one-pass path does: with attention dropout 0.5 its
    output is not the eval output (it was, silently), and with dropout 0 it is."""
    from hf_xformers.attention import sliding_window, sliding_window_banded

    calls = []
    original = sliding_window.HfxSlidingWindowSelfAttention._chunked_banded_attention
    monkeypatch.setattr(
        sliding_window.HfxSlidingWindowSelfAttention, "_chunked_banded_attention",
        lambda self, *a: calls.append(1) or original(self, *a),
    )  # fmt: skip
    monkeypatch.setattr(sliding_window_banded, "LOCAL_CHUNK_TOKENS", 16)  # two 8-query blocks per chunk
    input_ids = torch.randint(5, 100, (2, 90), generator=torch.Generator().manual_seed(0))
    differences = {}
    for dropout in (0.5, 0.0):
        config = HfxLongformerConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            attention_window=16, max_position_embeddings=130, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=dropout,
        )  # fmt: skip
        torch.manual_seed(0)
        model = HfxLongformerModel(config)
        calls.clear()
        with torch.no_grad():
            evaluated = model.eval()(input_ids).last_hidden_state
            trained = model.train()(input_ids).last_hidden_state
        assert len(calls) == 2, "both forwards take the chunked path"
        differences[dropout] = (trained - evaluated).abs().max().item()
    assert differences[0.0] == 0.0
    assert differences[0.5] > 1e-2, "train mode with attention dropout 0.5 gave the eval output"
