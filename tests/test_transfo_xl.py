"""Tests of hfx-transfo-xl: conformance, transformers 4.37.2 parity (fixture), memories, adaptive softmax, generate,
the stream dataset and the recurrent Trainer.

The fixture in tests/fixtures/transfo_xl/ was made by scripts/make_transfo_xl_fixture.py in a separate environment
with transformers 4.37.2 (Transformer-XL is gone from transformers 5).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, TrainingArguments  # noqa: E402

from hf_xformers import (  # noqa: E402
    HfxRecurrentTrainer,
    HfxStreamSegments,
    HfxTransfoXLConfig,
    HfxTransfoXLForCausalLM,
    HfxTransfoXLForSequenceClassification,
    HfxTransfoXLModel,
)
from hf_xformers.attention.relative_memory import sinusoid_positions  # noqa: E402
from hf_xformers.conversion.convert_from_transformers import convert_from_transformers  # noqa: E402
from hf_xformers.models.transfo_xl.adaptive_softmax import HfxAdaptiveLogSoftmax  # noqa: E402
from hf_xformers.ops.compat import CACHE_NAME  # noqa: E402
from tests.conformance import NUM_LABELS, SEQ_LEN, VOCAB, TextModelConformance, _ids  # noqa: E402
from tests.generation_checks import greedy_by_hand  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "transfo_xl"
TINY = dict(
    vocab_size=VOCAB, cutoffs=[20, 50], d_model=32, n_head=4, d_inner=37, n_layer=2, div_val=2,
    mem_len=8, clamp_len=0, same_length=False, dropout=0.0, dropatt=0.0, num_labels=NUM_LABELS,
)  # fmt: skip


def tiny(**overrides) -> HfxTransfoXLConfig:
    return HfxTransfoXLConfig(**{**TINY, **overrides})


def lm(**overrides) -> HfxTransfoXLForCausalLM:
    torch.manual_seed(0)
    model = HfxTransfoXLForCausalLM(tiny(**overrides)).eval()
    with torch.no_grad():  # the default init leaves biases at 0 and LayerNorms at 1: make every tensor matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def run_segments(model, ids: torch.Tensor, segment: int, mems=None) -> tuple[torch.Tensor, tuple]:
    """Hidden states ``(batch, len, d)`` of ``ids`` fed ``segment`` tokens at a time, memories carried."""
    base = model.transformer if hasattr(model, "transformer") else model
    outs = []
    for start in range(0, ids.shape[1], segment):
        out = base(input_ids=ids[:, start : start + segment], mems=mems)
        outs.append(out.last_hidden_state)
        mems = out.mems
    return torch.cat(outs, dim=1), mems


# ----- shared conformance suite -------------------------------------------------------------------------
class TestTransfoXLConformance(TextModelConformance):
    packing_refusal = "cannot take a packed"
    config_class = HfxTransfoXLConfig
    base_config = {
        k: v
        for k, v in TINY.items()
        if k not in ("vocab_size", "num_labels", "d_model", "n_head", "d_inner", "n_layer")
    }
    heads = {
        "AutoModel": HfxTransfoXLModel,
        "AutoModelForCausalLM": HfxTransfoXLForCausalLM,
        "AutoModelForSequenceClassification": HfxTransfoXLForSequenceClassification,
    }
    bad_configs = [
        (dict(cutoffs=[50, 20]), "cutoffs"),
        (dict(cutoffs=[20, VOCAB]), "cutoffs"),
        (dict(mem_len=-1), "mem_len"),
        (dict(mem_len=0, same_length=True), "same_length"),
        (dict(div_val=0), "div_val"),
        (dict(div_val=64), "div_val"),
        (dict(dropout=1.0), "dropout"),
    ]
    dropout_config = dict(dropout=0.1, dropatt=0.1)

    def depth_config(self, num_layers: int) -> dict:
        return {"n_layer": num_layers}

    def inputs_for(self, auto_name, batch=2, length=SEQ_LEN):
        inputs = super().inputs_for(auto_name, batch, length)
        if auto_name == "AutoModelForCausalLM":
            inputs["labels"] = inputs["input_ids"].clone()
        return inputs

    def expected_shape(self, auto_name, batch, length):
        if auto_name == "AutoModelForCausalLM":
            return (batch, length, VOCAB)
        return super().expected_shape(auto_name, batch, length)

    def test_base_model_pooler_and_tuple_output(self):
        """No pooler in a causal LM; the tuple output starts with the hidden states, then the memories."""
        model = self.make_model("AutoModel")
        inputs = self.inputs_for("AutoModel")
        out = model(**inputs)
        as_tuple = model(**inputs, return_dict=False)
        assert torch.equal(as_tuple[0], out.last_hidden_state)
        assert len(as_tuple[1]) == model.config.n_layer

    def test_trainer_step(self, tmp_path):
        """The conformance Trainer step, with this model's parameter names."""
        from transformers import Trainer

        torch.manual_seed(0)
        model = HfxTransfoXLForSequenceClassification(self.make_config())
        ids = _ids(8, SEQ_LEN, seed=7)
        rows = [
            {"input_ids": ids[i], "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long), "labels": i % NUM_LABELS}
            for i in range(8)
        ]
        before = {n: p.clone() for n, p in model.state_dict().items()}
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
            use_cpu=True, report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        result = Trainer(model=model, args=args, train_dataset=rows).train()
        assert result.global_step == 2 and math.isfinite(result.training_loss)
        changed = [n for n, p in model.state_dict().items() if not torch.equal(p, before[n])]
        assert any("classifier" in n for n in changed) and any("layers.0" in n for n in changed)

    def test_too_long_input_raises(self):
        pytest.skip("relative positions: Transformer-XL has no length limit")

    def test_left_padding_masks_the_padded_keys(self):
        """Relative positions and masked keys: a left-padded sequence's real tokens get the unpadded outputs, and the
        classifier pools the last real token on either side."""
        model = self.make_model("AutoModel")
        ids = _ids(1, SEQ_LEN)
        pad = 3
        padded = torch.cat([torch.full((1, pad), 7), ids], dim=1)
        mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(ids)], dim=1)
        with torch.no_grad():
            alone = model(input_ids=ids).last_hidden_state
            left = model(input_ids=padded, attention_mask=mask).last_hidden_state[:, pad:]
            unmasked = model(input_ids=padded).last_hidden_state[:, pad:]
        torch.testing.assert_close(left, alone, atol=self.atol, rtol=0)
        assert not torch.allclose(unmasked, alone, atol=1e-3)  # the mask is what makes them equal
        classifier = self.make_model("AutoModelForSequenceClassification")
        with torch.no_grad():
            right = torch.cat([ids, torch.full((1, pad), 7)], dim=1)
            right_mask = mask.flip(-1)
            scores = [
                classifier(input_ids=x, attention_mask=m).logits
                for x, m in ((ids, None), (padded, mask), (right, right_mask))
            ]
        torch.testing.assert_close(scores[1], scores[0], atol=self.atol, rtol=0)
        torch.testing.assert_close(scores[2], scores[0], atol=self.atol, rtol=0)

    def test_wrong_mask_shape_raises(self):
        super().test_wrong_mask_shape_raises()
        model = self.make_model("AutoModel")
        ids = _ids(2, SEQ_LEN)
        with pytest.raises(ValueError, match="shape of `input_ids`"):
            model(input_ids=ids, attention_mask=torch.ones(2, SEQ_LEN - 1, dtype=torch.long))
        mems = model(input_ids=ids).mems
        with pytest.raises(ValueError, match="same row"):
            model(input_ids=ids[:1], mems=mems)
        with pytest.raises(ValueError, match="one tensor per layer"):
            model(input_ids=ids, mems=mems[:1])


# ----- reference parity: transformers 4.37.2 ----------------------------------------------------------------
def _check_fixture_parity(model: HfxTransfoXLForCausalLM) -> None:
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    ids, labels = expected["input_ids"], expected["labels"]
    seg = ids.shape[1] // 2
    # 4.x starts from mem_len zero vectors when mems=None; ours starts empty unless given them.
    mems = model.zero_memories(ids.shape[0])
    with torch.no_grad():
        for s in (1, 2):
            part = slice((s - 1) * seg, s * seg)
            out = model(input_ids=ids[:, part], labels=labels[:, part], mems=mems)
            torch.testing.assert_close(out.logits, expected[f"logits_{s}"], atol=1e-5, rtol=0)
            torch.testing.assert_close(out.loss, expected[f"loss_{s}"], atol=1e-5, rtol=0)
            # 4.x returns the per-token losses grouped by cluster, not in token order: compare them as sets.
            torch.testing.assert_close(
                out.losses.flatten().sort().values, expected[f"losses_{s}"].flatten().sort().values, atol=1e-5, rtol=0
            )
            if s == 1:
                assert out.losses[1, 2] == 0  # the ignored target (labels[1, 3] = -100)
            for layer, mem in enumerate(out.mems):
                # 4.x memories are (mem_len, batch, d_model); ours are batch-first.
                torch.testing.assert_close(mem, expected[f"mems_{s}_{layer}"].transpose(0, 1), atol=1e-5, rtol=0)
            mems = out.mems


def test_reference_parity_pytorch_model_bin(tmp_path):
    """The fixture's pytorch_model.bin (the layout of transfo-xl-wt103) converts and reproduces 4.37.2 to 1e-5."""
    model, tokenizer = convert_from_transformers(FIXTURE, tmp_path / "converted")
    assert tokenizer is None and type(model) is HfxTransfoXLForCausalLM
    softmax, emb = model.adaptive_softmax, model.transformer.word_emb
    assert all(softmax.out_layers[i].weight is emb.emb_layers[i].weight for i in range(3))
    assert softmax.out_projs[1] is emb.emb_projs[1] and softmax.out_projs[0] is not emb.emb_projs[0]
    _check_fixture_parity(model)
    # The converted checkpoint reloads through the Auto classes with identical outputs.
    _check_fixture_parity(AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval())


def test_reference_parity_safetensors_without_tied_tensors(tmp_path):
    """A safetensors save of the same model (tied tensors left out, as 4.x writes it) converts too."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(FIXTURE / "config.json", source / "config.json")
    weights = torch.load(FIXTURE / "pytorch_model.bin", weights_only=True)
    for key in (
        "crit.out_layers.0.weight",
        "crit.out_layers.1.weight",
        "crit.out_layers.2.weight",
        "crit.out_projs.1",
        "crit.out_projs.2",
    ):
        weights.pop(key)
    save_file({k: v.clone().contiguous() for k, v in weights.items()}, str(source / "model.safetensors"))
    model, _ = convert_from_transformers(source)
    _check_fixture_parity(model)


def test_import_base_model_with_shared_biases(tmp_path):
    """A TransfoXLModel checkpoint (no prefix, no softmax) with shared r_w_bias/r_r_bias (untie_r=False) imports as
    HfxTransfoXLModel and equals the LM's base model with those biases copied into every layer."""
    weights = torch.load(FIXTURE / "pytorch_model.bin", weights_only=True)
    config = json.loads((FIXTURE / "config.json").read_text())
    base = {k.removeprefix("transformer."): v for k, v in weights.items() if k.startswith("transformer.")}
    for name in ("r_w_bias", "r_r_bias"):
        base[name] = base.pop(f"layers.0.dec_attn.{name}")
        base.pop(f"layers.1.dec_attn.{name}")
    source = tmp_path / "base"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["TransfoXLModel"], "untie_r": False}))
    torch.save(base, source / "pytorch_model.bin")
    model, _ = convert_from_transformers(source)
    assert type(model) is HfxTransfoXLModel
    reference, _ = convert_from_transformers(FIXTURE)
    with torch.no_grad():
        for layer in reference.transformer.layers:
            layer.attention.r_w_bias.copy_(base["r_w_bias"])
            layer.attention.r_r_bias.copy_(base["r_r_bias"])
        ids = _ids(2, 7) % config["vocab_size"]
        assert torch.equal(
            model(input_ids=ids).last_hidden_state, reference.transformer(input_ids=ids).last_hidden_state
        )


# ----- the attention formula, against a per-pair oracle -------------------------------------------------------
def _oracle_hidden(model: HfxTransfoXLModel, ids: torch.Tensor, mems=None) -> torch.Tensor:
    """Transformer-XL's layer written pair by pair: score(i, j) = (q_i + u).k_j + (q_i + v).W_r sin(dist(i, j))."""
    config = model.config
    hidden = model.word_emb(ids)
    batch, q_len, _ = hidden.shape
    for idx, layer in enumerate(model.layers):
        states = hidden if mems is None else torch.cat([mems[idx], hidden], 1)
        k_len, m_len = states.shape[1], states.shape[1] - q_len
        att = layer.attention
        qkv = att.qkv_net(states).view(batch, k_len, 3, config.n_head, config.d_head)
        q, k, v = qkv[:, m_len:, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = torch.full((batch, config.n_head, q_len, k_len), float("-inf"))
        for i in range(q_len):
            for j in range(k_len):
                dist = i + m_len - j
                if dist < 0 or (config.same_length and dist >= config.mem_len):
                    continue
                d = float(min(dist, config.clamp_len) if config.clamp_len > 0 else dist)
                r = att.r_net(sinusoid_positions(torch.tensor([d]), config.d_model)).view(config.n_head, config.d_head)
                scores[:, :, i, j] = ((q[:, i] + att.r_w_bias) * k[:, j]).sum(-1) + ((q[:, i] + att.r_r_bias) * r).sum(
                    -1
                )
        probs = torch.softmax(scores / config.d_head**0.5, dim=-1)
        context = torch.einsum("bhij,bjhd->bihd", probs, v).reshape(batch, q_len, -1)
        hidden = layer.attention_layer_norm(hidden + layer.attention_output(context))
        hidden = layer.ff_layer_norm(hidden + layer.ff_out(torch.relu(layer.ff_in(hidden))))
    return hidden


@pytest.mark.parametrize(
    "overrides", [dict(mem_len=0), dict(clamp_len=3), dict(same_length=True, mem_len=5, clamp_len=4)]
)
def test_attention_matches_pairwise_oracle(overrides):
    """With and without memories; mem_len=0 is a plain causal Transformer with relative positions."""
    model = lm(**overrides).transformer
    ids = _ids(2, 7, seed=1)
    with torch.no_grad():
        first = model(input_ids=ids)
        torch.testing.assert_close(first.last_hidden_state, _oracle_hidden(model, ids), atol=1e-5, rtol=0)
        if model.config.mem_len == 0:
            assert first.mems is None
            return
        nxt = _ids(2, 6, seed=2)
        second = model(input_ids=nxt, mems=first.mems)
        torch.testing.assert_close(second.last_hidden_state, _oracle_hidden(model, nxt, first.mems), atol=1e-5, rtol=0)


def test_mem_len_zero_is_a_plain_transformer():
    """No memory: each segment's output is that of the segment alone, and it is causal."""
    model = lm(mem_len=0).transformer
    ids = _ids(1, 12, seed=3)
    with torch.no_grad():
        whole = model(input_ids=ids).last_hidden_state
        prefix = model(input_ids=ids[:, :5]).last_hidden_state
        alone = model(input_ids=ids[:, 6:]).last_hidden_state
        carried, mems = run_segments(model, ids, 6)
    assert mems is None
    torch.testing.assert_close(whole[:, :5], prefix, atol=1e-5, rtol=0)  # causal: later tokens change nothing
    torch.testing.assert_close(carried[:, 6:], alone, atol=1e-6, rtol=0)  # nothing carried over


# ----- memories: segment by segment == one pass over the concatenation -----------------------------------------
@pytest.mark.parametrize(
    "overrides, total, segment",
    [
        (dict(mem_len=18, clamp_len=5), 24, 6),  # the memory holds every earlier token
        (dict(mem_len=5, same_length=True, clamp_len=3), 30, 4),  # attention span = mem_len: any length works
        (dict(mem_len=7, same_length=True), 21, 7),
    ],
)
def test_segments_with_memory_equal_one_pass(overrides, total, segment):
    model = lm(**overrides)
    ids = _ids(2, total, seed=4)
    with torch.no_grad():
        full = model.transformer(input_ids=ids)
        carried, mems = run_segments(model, ids, segment)
        torch.testing.assert_close(carried, full.last_hidden_state, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.stack(mems), torch.stack(full.mems), atol=1e-5, rtol=0)
        # The LM losses agree as well, when every token is scored against its successor.
        whole_loss = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:]).losses
        seg_losses, mems = [], None
        for start in range(0, total - 1, segment):
            out = model(
                input_ids=ids[:, start : start + segment][:, : total - 1 - start],
                shift_labels=ids[:, start + 1 : start + segment + 1],
                mems=mems,
            )
            seg_losses.append(out.losses)
            mems = out.mems
    torch.testing.assert_close(torch.cat(seg_losses, 1), whole_loss, atol=1e-5, rtol=0)


def test_memory_too_short_differs_and_memories_are_detached():
    model = lm(mem_len=4).train()
    ids = _ids(1, 16, seed=5)
    out = model.transformer(input_ids=ids[:, :8])
    assert all(m.shape == (1, 4, 32) and not m.requires_grad for m in out.mems)
    torch.testing.assert_close(out.mems[0], model.transformer.word_emb(ids[:, 4:8]).detach())
    out2 = model(input_ids=ids[:, 8:], labels=ids[:, 8:], mems=out.mems)
    out2.loss.backward()  # no graph reaches back into the first segment
    model.eval()
    with torch.no_grad():
        full = model.transformer(input_ids=ids).last_hidden_state
        carried, _ = run_segments(model, ids, 8)
    assert not torch.allclose(carried[:, 8:], full[:, 8:], atol=1e-4)  # the span (15) exceeds mem_len (4)
    torch.testing.assert_close(carried[:, :8], full[:, :8], atol=1e-5, rtol=0)


# ----- adaptive softmax ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "div_val, d_embed, cutoffs", [(1, 16, [10, 30]), (1, 24, [10, 30]), (2, 16, [10, 30]), (1, 16, [])]
)
def test_adaptive_softmax_normalised_and_nll_consistent(div_val, d_embed, cutoffs):
    torch.manual_seed(0)
    softmax = HfxAdaptiveLogSoftmax(40, d_embed, 24, cutoffs, div_val)
    for p in softmax.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    hidden = torch.randn(9, 24)
    logp = softmax.log_prob(hidden)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(9), atol=1e-5, rtol=0)
    target = torch.tensor([0, 9, 10, 29, 30, 39, -100, 5, 35])
    nll = softmax.nll(hidden, target)
    keep = target != -100
    torch.testing.assert_close(nll[keep], -logp[keep].gather(1, target[keep, None]).squeeze(1), atol=1e-5, rtol=0)
    assert nll[~keep].item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["autocast", "weights"])
def test_mixed_precision_adaptive_softmax_float32_attention_in_value_dtype(dtype, mode):
    """Under autocast and with 16-bit weights, the adaptive softmax normalises in float32 (log-probabilities sum to 1
    to float32 precision; a 16-bit log_softmax is off by ~1e-2) and the losses are float32; the attention's softmax
    (float32, masked at the float32 minimum) comes back in the values' dtype, so its matmul does not mix dtypes."""
    model = lm(div_val=2, dropatt=0.0)
    if mode == "weights":
        model = model.to(dtype)
    ids = _ids(2, 12)
    region = torch.autocast("cpu", dtype=dtype) if mode == "autocast" else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), region:
        out = model(input_ids=ids, labels=ids, output_attentions=True)
    assert out.logits.dtype == out.losses.dtype == out.loss.dtype == torch.float32
    torch.testing.assert_close(out.logits.exp().sum(-1), torch.ones(2, 12), atol=1e-5, rtol=0)
    picked = -out.logits[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(out.losses, picked, atol=1e-5, rtol=0)
    with torch.no_grad():
        reference = lm(div_val=2, dropatt=0.0)(input_ids=ids, labels=ids)
    assert abs(out.loss - reference.loss) < 0.05 * reference.loss
    for probs in out.attentions:
        assert probs.dtype == dtype and torch.isfinite(probs).all()
        assert probs.shape[-2:] == (12, 12) and not probs.triu(1).any()  # future keys: exactly 0


@pytest.mark.parametrize("overrides", [dict(div_val=1, d_embed=24), dict(div_val=1, cutoffs=[]), dict(div_val=4)])
def test_adaptive_variants_tie_and_roundtrip(overrides, tmp_path):
    model = lm(**overrides)
    ids = _ids(2, 9)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    softmax, emb = model.adaptive_softmax, model.transformer.word_emb
    assert all(layer.weight is emb.emb_layers[i].weight for i, layer in enumerate(softmax.out_layers))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, before)
    assert loaded.adaptive_softmax.out_layers[0].weight is loaded.transformer.word_emb.emb_layers[0].weight


# ----- generation ---------------------------------------------------------------------------------------------------
def test_generate_carries_memories():
    """Greedy generate() (one token per step, memories carried) equals recomputing the whole prefix each step."""
    model = lm(mem_len=32)
    prompt = _ids(2, 5, seed=6)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 11)
    assert torch.equal(out, greedy_by_hand(model, prompt, 6))
    # Without a memory there is nothing to carry: every step recomputes the whole sequence, with the same tokens.
    no_memory = lm(mem_len=0, same_length=False)
    out = no_memory.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_hand(no_memory, prompt, 3))


@pytest.mark.parametrize(
    ("mem_len", "same_length"),
    [(32, False), (32, True), (4, True), (4, False)],
    ids=["memory_holds_all", "memory_holds_all_same_length", "short_memory_same_length", "short_memory"],
)
@pytest.mark.parametrize("num_beams", [1, 2], ids=["greedy", "beam"])
def test_generate_per_step_outputs_follow_transformers_contract(mem_len, same_length, num_beams):
    """generate(output_attentions, output_hidden_states, return_dict_in_generate) on a left-padded batch, as
    transformers' generation tests read it: with the cache (the memories) every step after the first feeds the new
    token alone, hidden states and attention queries of length 1 and keys over every token so far (tokens that left
    a short memory at 0), and the memories come back; without it every step is a full forward and none come back.
    Where the memories see what a full forward sees (a memory holding the whole sequence, or same_length, which limits
    both to the last mem_len positions) the cached steps give its logits and its attention rows."""
    model = lm(mem_len=mem_len, same_length=same_length)
    prompt = _ids(2, 7, seed=3)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    kwargs = dict(
        attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=num_beams, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True, output_attentions=True, output_hidden_states=True,
    )  # fmt: skip
    runs = {use_cache: model.generate(prompt, use_cache=use_cache, **kwargs) for use_cache in (True, False)}
    rows = 2 * num_beams
    for use_cache, out in runs.items():
        assert (out.get(CACHE_NAME) is not None) == use_cache
        assert len(out.hidden_states) == len(out.attentions) == 6
        for step, (hidden, attentions) in enumerate(zip(out.hidden_states, out.attentions)):
            queries = 1 if (use_cache and step > 0) else 7 + step
            assert [tuple(h.shape) for h in hidden] == [(rows, queries, 32)] * 3, (use_cache, step)
            assert [tuple(a.shape) for a in attentions] == [(rows, 4, queries, 7 + step)] * 2, (use_cache, step)
    if mem_len < 13 and not same_length:
        return  # the cached steps see the last mem_len positions, the full forwards all of them
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    for cached, full in zip(runs[True].logits, runs[False].logits, strict=True):
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)
    for step in range(1, 6):
        for cached, full in zip(runs[True].attentions[step], runs[False].attentions[step], strict=True):
            torch.testing.assert_close(cached[..., 0, :], full[..., -1, :], atol=1e-5, rtol=0)


def test_unpadded_cached_steps_report_every_token_so_far():
    """An unpadded prompt longer than the memory: generate() drops its all-ones mask, yet each cached step's one
    query row spans every token so far (the memory's columns last, 0 for tokens that have left it), as transformers'
    generation tests read it, and equals the last row of a full forward (same_length: both see the last mem_len)."""
    model = lm(mem_len=4, same_length=True)
    prompt = _ids(2, 7, seed=3)
    out = model.generate(
        prompt, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
        output_attentions=True,
    )  # fmt: skip
    for step in (1, 2):
        with torch.no_grad():
            full = model(input_ids=out.sequences[:, : 7 + step], output_attentions=True).attentions
        for cached, whole in zip(out.attentions[step], full, strict=True):
            assert tuple(cached.shape) == (2, 4, 1, 7 + step)
            assert bool((cached[..., : 7 + step - 5] == 0).all())  # left the memory (4 kept + the new token)
            torch.testing.assert_close(cached[..., 0, :], whole[..., -1, :], atol=1e-5, rtol=0)


# ----- streams and the recurrent Trainer -------------------------------------------------------------------------
def test_stream_segments_keep_rows():
    data = HfxStreamSegments(torch.arange(43), batch_size=2, segment_length=5)
    assert len(data) == 2 * 4  # 21 tokens per stream -> 4 segments of 5 (+1 target)
    assert data[0]["input_ids"].tolist() == [0, 1, 2, 3, 4] and data[0]["shift_labels"].tolist() == [1, 2, 3, 4, 5]
    assert data[1]["input_ids"].tolist() == [21, 22, 23, 24, 25]
    assert data[2]["input_ids"].tolist() == [5, 6, 7, 8, 9]  # step 1, row 0 continues row 0
    with pytest.raises(ValueError, match="segment_length"):
        HfxStreamSegments(torch.arange(10), batch_size=2, segment_length=5)


def test_recurrent_trainer_carries_memories(tmp_path):
    model = lm(mem_len=6)
    stream = _ids(1, 2 * 4 * 6 + 2, seed=8)[0]
    data = HfxStreamSegments(stream, batch_size=2, segment_length=6)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, prediction_loss_only=True,
    )  # fmt: skip
    trainer = HfxRecurrentTrainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    # Evaluation: the Trainer's loss is the mean over the stream scored segment by segment with memories.
    expected, mems = [], None
    with torch.no_grad():
        for step in range(data.num_segments):
            batch = [data[step * 2 + row] for row in range(2)]
            out = model(
                input_ids=torch.stack([b["input_ids"] for b in batch]),
                shift_labels=torch.stack([b["shift_labels"] for b in batch]),
                mems=mems,
            )
            expected.append(out.loss)
            mems = out.mems
        no_memory = torch.stack([model(input_ids=torch.stack([data[i]["input_ids"], data[i + 1]["input_ids"]]), shift_labels=torch.stack([data[i]["shift_labels"], data[i + 1]["shift_labels"]])).loss for i in range(0, len(data), 2)])  # fmt: skip
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(torch.stack(expected).mean().item(), abs=1e-5)
    assert metrics["eval_loss"] != pytest.approx(no_memory.mean().item(), abs=1e-5)
    result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    assert trainer._memories["train"] is not None and trainer._memories["train"][0].shape == (2, 6, 32)
    bad = HfxRecurrentTrainer(model=model, args=args, train_dataset=HfxStreamSegments(stream, 3, 6))
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        bad.train()


def test_sequence_classification_uses_last_real_token():
    torch.manual_seed(0)
    model = HfxTransfoXLForSequenceClassification(tiny()).eval()
    ids = _ids(1, 8)
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 8), torch.zeros(1, 3)], 1).long()
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=padded, attention_mask=mask).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0
        )


@pytest.mark.parametrize(
    "overrides",
    [dict(cutoffs=[], div_val=1), dict(cutoffs=[20, 50], div_val=1), dict(cutoffs=[20, 50], div_val=2)],
    ids=["one-softmax", "clusters-div1", "clusters-div2"],
)
def test_resize_token_embeddings_grows_last_cluster(overrides, tmp_path):
    model = lm(**overrides)
    ids = _ids(2, SEQ_LEN)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    embeddings = model.resize_token_embeddings(VOCAB + 7)
    assert embeddings is model.transformer.word_emb
    assert model.config.vocab_size == VOCAB + 7
    assert model.adaptive_softmax.out_layers[-1].weight is embeddings.emb_layers[-1].weight  # still tied
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert after.shape == (2, SEQ_LEN, VOCAB + 7)
    torch.testing.assert_close(after.exp().sum(-1), torch.ones(2, SEQ_LEN))
    # Old tokens keep their weights: within each cluster only the normaliser changes (the last cluster's, which
    # gained tokens; with one softmax, the only one), so log-probabilities move by one constant per cluster.
    bounds = [0, *model.config.cutoffs, VOCAB]
    for start, end in zip(bounds, bounds[1:]):
        diff = before[..., start:end] - after[..., start:end]
        torch.testing.assert_close(diff, diff[..., :1].expand_as(diff), atol=1e-5, rtol=0)
    assert (before[..., bounds[-2] :] - after[..., bounds[-2] : VOCAB]).min() > 0  # new tokens take probability
    new_ids = torch.full((1, 4), VOCAB + 6)
    loss = model(input_ids=new_ids, labels=new_ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    model.save_pretrained(tmp_path)
    reloaded = HfxTransfoXLForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=new_ids).logits, model.eval()(input_ids=new_ids).logits)


def test_resize_token_embeddings_pads_and_shrinks_within_last_cluster():
    model = lm()
    model.resize_token_embeddings(VOCAB + 1, pad_to_multiple_of=8)
    assert model.config.vocab_size % 8 == 0 and model.config.vocab_size > VOCAB
    model.resize_token_embeddings(55)  # the last cluster starts at 50
    assert model.adaptive_softmax.log_prob(torch.randn(3, 32)).shape == (3, 55)
    with pytest.raises(ValueError, match="last adaptive cluster"):
        model.resize_token_embeddings(50)


def test_smaller_vocab_than_cutoffs_on_load_is_a_clear_error(tmp_path):
    lm().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pass cutoffs that fit"):
        HfxTransfoXLForCausalLM.from_pretrained(tmp_path, vocab_size=40, ignore_mismatched_sizes=True)
    model = HfxTransfoXLForCausalLM.from_pretrained(
        tmp_path, vocab_size=40, cutoffs=[10, 20], ignore_mismatched_sizes=True
    )
    assert model.adaptive_softmax.log_prob(torch.randn(1, 32)).shape == (1, 40)


def test_memories_longer_than_mem_len_are_trimmed():
    model = lm(mem_len=4)
    ids = _ids(1, 12)
    long_mems = tuple(torch.randn(1, 9, 32) for _ in range(2))
    with torch.no_grad():
        out = model(input_ids=ids[:, :5], mems=long_mems)
        trimmed = model(input_ids=ids[:, :5], mems=tuple(m[:, -4:] for m in long_mems))
    torch.testing.assert_close(out.logits, trimmed.logits, atol=0, rtol=0)
    assert all(m.shape == (1, 4, 32) for m in out.mems)
    no_memory = lm(mem_len=0, same_length=False)
    with torch.no_grad():
        torch.testing.assert_close(no_memory(input_ids=ids, mems=long_mems).logits, no_memory(input_ids=ids).logits)


def test_adaptive_layers_trace_without_graph_breaks():
    """Cluster selection in the adaptive embedding and softmax depends on the ids; traced code must not."""
    model = lm()
    ids = _ids(2, SEQ_LEN)
    labels = ids.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        eager = model(input_ids=ids, labels=labels)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids, labels=labels)
    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled.losses, eager.losses, atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled.loss, eager.loss, atol=1e-6, rtol=0)
