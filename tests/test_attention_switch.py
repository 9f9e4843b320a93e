"""``attn_implementation`` for every architecture: each choice it accepts gives the ``"sdpa"`` path's outputs, the
switch works after loading, the refused choices say which ones exist, and FlexAttention really runs where chosen.

FlexAttention runs in its eager (reference) form in most tests, which is quick for tiny inputs; one test per
structured pattern runs the compiled kernel, the form that runs by default (inference only on the CPU).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

import hf_xformers  # noqa: E402
import hf_xformers.ops.attention_switch as switch  # noqa: E402
from hf_xformers.attention import block_sparse, chunked_local, lsh, multi_head, shifted_window, sliding_window  # noqa: E402

from .test_compile_export import build, image_inputs, text_inputs  # noqa: E402

ALL = ("eager", "sdpa", "flex_attention")
SUPPORTED = {
    "longformer": ALL,
    "bigbird": ALL,
    "swin": ALL,
    "reformer": ALL,
    "universal": ALL,
    "universal_act": ALL,
    # Low-rank and linear attention are no mask pattern; Transformer-XL's relative positions are no score_mod that pays.
    "linformer": ("eager", "sdpa"),
    "performer": ("eager", "sdpa"),
    "transfo_xl": ("eager", "sdpa"),
}
FLEX_MODULES = (sliding_window, block_sparse, shifted_window, chunked_local, lsh, multi_head)
LENGTH = 37  # sparse for every pattern of the tiny configs (Longformer window 4, BigBird 10 blocks of 4, ...)
ATOL = 1e-5


def run(model, arch: str, implementation: str, padding: str = "right", **kwargs):
    """``last_hidden_state`` and the mask of real rows under ``implementation``."""
    model.set_attn_implementation(implementation)
    assert model.config._attn_implementation == implementation
    if arch == "swin":
        (pixels,) = image_inputs((40, 33))
        out = model(pixel_values=pixels.to(next(model.parameters()).dtype), **kwargs)
        return out, torch.ones(out.last_hidden_state.shape[:2], dtype=torch.bool)
    ids, mask = text_inputs(LENGTH)
    if padding == "left":
        ids, mask = ids.flip(1), mask.flip(1)
    elif padding == "none":
        mask = torch.ones_like(mask)
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    return out, mask.bool()


def max_difference(a, b, real) -> float:
    return (a - b)[real].abs().max().item()


@pytest.fixture
def eager_flex(monkeypatch):
    monkeypatch.setattr(switch, "FLEX_COMPILE", False)


@pytest.fixture
def flex_calls(monkeypatch) -> list:
    """Counts FlexAttention calls made by the attention modules."""
    calls = []
    for module in FLEX_MODULES:
        if hasattr(module, "flex_attention"):

            def counted(*args, _kernel=switch.flex_attention, **kwargs):
                calls.append(1)
                return _kernel(*args, **kwargs)

            monkeypatch.setattr(module, "flex_attention", counted)
    return calls


CASES = [(arch, impl) for arch, impls in SUPPORTED.items() for impl in impls if impl != "sdpa"]


@pytest.mark.parametrize("padding", ["right", "left", "none"])
@pytest.mark.parametrize(("arch", "implementation"), CASES, ids=[f"{a}-{i}" for a, i in CASES])
def test_every_choice_gives_the_sdpa_outputs(arch, implementation, padding, eager_flex, flex_calls):
    if arch == "swin" and padding != "right":
        pytest.skip("images have no padding")
    model = build(arch)
    with torch.no_grad():
        reference, real = run(model, arch, "sdpa", padding)
        out, _ = run(model, arch, implementation, padding)
    assert max_difference(out.last_hidden_state, reference.last_hidden_state, real) < ATOL
    if implementation == "flex_attention":
        assert flex_calls, "flex_attention was chosen but no FlexAttention call was made"


@pytest.mark.parametrize("arch", ["longformer", "bigbird", "swin", "reformer"])
def test_compiled_flex_attention_gives_the_sdpa_outputs(arch, flex_calls):
    """The compiled kernel (the default form of "flex_attention"): inference on the CPU."""
    assert switch.FLEX_COMPILE
    model = build(arch)
    with torch.no_grad():
        reference, real = run(model, arch, "sdpa")
        out, _ = run(model, arch, "flex_attention")
    assert flex_calls
    assert max_difference(out.last_hidden_state, reference.last_hidden_state, real) < ATOL


def test_lsh_rounds_are_combined_under_flex_attention(eager_flex, monkeypatch):
    """Two hashing rounds need each row's log-normaliser, which FlexAttention's eager form returns."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("return_lse", False))
        return switch.flex_attention(*args, **kwargs)

    monkeypatch.setattr(lsh, "flex_attention", counted)
    model = build("reformer")
    assert model.config.num_hashes == 2 and "lsh" in model.config.attn_layers
    with torch.no_grad():
        reference, real = run(model, "reformer", "sdpa")
        out, _ = run(model, "reformer", "flex_attention")
    assert any(calls)
    assert max_difference(out.last_hidden_state, reference.last_hidden_state, real) < ATOL


@pytest.mark.parametrize("arch", list(SUPPORTED))
def test_eager_returns_attention_maps_and_sdpa_is_the_default(arch):
    model = build(arch)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        reference, real = run(model, arch, "sdpa")
        out, _ = run(model, arch, "eager", output_attentions=True)
    assert out.attentions is not None and all(a is not None and torch.isfinite(a).all() for a in out.attentions)
    assert max_difference(out.last_hidden_state, reference.last_hidden_state, real) < ATOL


@pytest.mark.parametrize("arch", list(SUPPORTED))
def test_switching_after_loading_is_allowed(arch, caplog):
    model = build(arch)
    with caplog.at_level(logging.WARNING, logger="transformers"):
        model.set_attn_implementation("eager")
    assert "does not support setting its attention implementation" not in caplog.text
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("arch", [a for a, impls in SUPPORTED.items() if "flex_attention" not in impls])
def test_unsupported_choices_name_the_supported_ones(arch):
    model = build(arch)
    assert not model._supports_flex_attn
    with pytest.raises(ValueError, match="flex_attention"):
        model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="flex_attention"):
        transformers.AutoModel.from_config(model.config, attn_implementation="flex_attention")


@pytest.mark.parametrize("arch", ["longformer", "linformer"])
def test_flash_attention_is_refused_as_transformers_refuses_it(arch):
    model = build(arch)
    with pytest.raises((ValueError, ImportError), match="[Ff]lash"):
        model.set_attn_implementation("flash_attention_2")


def test_the_choice_loads_and_is_not_saved(tmp_path, eager_flex):
    """As in transformers: ``attn_implementation`` is a load-time choice; config.json does not keep it."""
    model = build("longformer")
    model.set_attn_implementation("flex_attention")
    model.save_pretrained(tmp_path)
    assert "attn_implementation" not in (tmp_path / "config.json").read_text()
    reloaded = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="flex_attention").eval()
    assert reloaded.config._attn_implementation == "flex_attention"
    assert transformers.AutoModel.from_pretrained(tmp_path).config._attn_implementation == "sdpa"
    with torch.no_grad():
        out, real = run(reloaded, "longformer", "flex_attention")
        reference, _ = run(model, "longformer", "sdpa")
    assert max_difference(out.last_hidden_state, reference.last_hidden_state, real) < ATOL


@pytest.mark.parametrize("arch", ["longformer", "bigbird", "reformer", "universal"])
def test_cpu_training_under_flex_attention_takes_the_sdpa_path(arch, flex_calls):
    """FlexAttention has no backward pass on the CPU: a forward with gradients runs the "sdpa" path."""
    model = build(arch).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.set_attn_implementation("flex_attention")
    ids, mask = text_inputs(LENGTH)
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert not flex_calls
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", list(SUPPORTED))
def test_eager_and_sdpa_agree_in_half_precision(arch, dtype, padding):
    """transformers' eager-versus-SDPA expectation: the same outputs to half-precision rounding."""
    if arch == "swin" and padding == "left":
        pytest.skip("images have no padding")
    model = build(arch).to(dtype)
    with torch.no_grad():
        reference, real = run(model, arch, "sdpa", padding)
        out, _ = run(model, arch, "eager", padding)
    scale = reference.last_hidden_state[real].float().abs().max().item()
    assert max_difference(out.last_hidden_state.float(), reference.last_hidden_state.float(), real) < 3e-2 * max(scale, 1)


def test_longformer_builds_its_block_mask_once_per_forward_without_host_reads(eager_flex, monkeypatch):
    from .device_checks import HostReadCounter

    built, original = [], sliding_window.band_block_mask

    def counted(*args, **kwargs):
        with HostReadCounter() as reads:
            mask = original(*args, **kwargs)
        built.append(reads.count)
        return mask

    monkeypatch.setattr(sliding_window, "band_block_mask", counted)
    model = build("longformer")
    assert model.config.num_hidden_layers == 2
    with torch.no_grad():
        run(model, "longformer", "flex_attention")
    assert built == [0], "one BlockMask for both layers (one window size), and no device-to-host read to build it"


@pytest.mark.parametrize(("length", "window", "with_globals", "padded"), [(300, 16, False, False), (700, 128, True, True),
                                                                        (513, 256, True, False), (129, 8, False, True)])  # fmt: skip
def test_longformer_block_lists_match_an_evaluated_mask(length, window, with_globals, padded):
    """The band's block lists (from block arithmetic) against ``create_block_mask``'s evaluation of every score: every
    block with an allowed score is visited (a listed block may hold none: the mask then decides), and no block is
    marked full (the compiled kernel skips the mask there) unless every score in it is allowed."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = torch.ones(2, length, dtype=torch.bool)
    if padded:
        mask[1, length // 2 :] = False
    is_global = None
    if with_globals:
        is_global = torch.zeros(2, length, dtype=torch.bool)
        is_global[:, 0] = True
        is_global[0, length - 5] = True
        is_global &= mask
    ours = sliding_window.band_block_mask(mask if padded else None, is_global, window, length, torch.device("cpu"))
    evaluated = create_block_mask(ours.mask_mod, 2, None, length, length, BLOCK_SIZE=sliding_window.FLEX_BLOCK)
    visited = ours.to_dense().expand(2, -1, -1, -1).bool()
    assert not (evaluated.to_dense().bool() & ~visited).any(), "a block with an allowed score is skipped"

    def full_blocks(block_mask) -> torch.Tensor:
        table = torch.zeros_like(visited)
        counts = block_mask.full_kv_num_blocks.expand(2, -1, -1)
        indices = block_mask.full_kv_indices.expand(2, -1, -1, -1)
        for b, h, qb in torch.nonzero(counts >= 0).tolist():
            table[b, h, qb, indices[b, h, qb, : counts[b, h, qb]].long()] = True
        return table

    whole_rows = length // sliding_window.FLEX_BLOCK  # query blocks inside the sequence (the last may reach past it)
    ours_full, evaluated_full = full_blocks(ours)[:, :, :whole_rows], full_blocks(evaluated)[:, :, :whole_rows]
    assert not (ours_full & ~evaluated_full).any(), "a block marked full holds a masked score"
    assert ours_full.any() == evaluated_full.any()


def test_compiled_longformer_kernel_over_many_blocks(flex_calls):
    """The compiled kernel over the block lists at a length of several FlexAttention blocks, with global tokens and
    padding: the same context as the "sdpa" path."""
    config = hf_xformers.HfxLongformerConfig(
        vocab_size=50, hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
        attention_window=128, max_position_embeddings=800,
    )  # fmt: skip
    torch.manual_seed(0)
    attention = sliding_window.HfxSlidingWindowSelfAttention(config).eval()
    hidden = torch.randn(2, 700, 32)
    mask = torch.ones(2, 700, dtype=torch.bool)
    mask[1, 450:] = False
    is_global = torch.zeros_like(mask)
    is_global[:, 0] = is_global[0, 600] = True
    with torch.no_grad():
        reference = attention(hidden, mask, is_global).context
        config._attn_implementation = "flex_attention"
        out = attention(hidden, mask, is_global).context
    assert flex_calls
    assert max_difference(out, reference, mask) < ATOL


def test_generation_under_flex_attention_gives_the_sdpa_tokens(flex_calls):
    """Cached decoding keeps SDPA under "flex_attention" (a static compiled kernel per key length would recompile at
    every token); the tokens are those of the "sdpa" path."""
    model = hf_xformers.HfxUniversalForCausalLM(
        hf_xformers.HfxUniversalConfig(vocab_size=50, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                       max_position_embeddings=64)  # fmt: skip
    ).eval()
    prompt = torch.randint(3, 50, (2, 7))
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=1)
    reference = model.generate(prompt, **kwargs)
    model.set_attn_implementation("flex_attention")
    assert torch.equal(model.generate(prompt, **kwargs), reference)
    assert not flex_calls
