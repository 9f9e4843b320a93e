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
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

import hf_xformers  # noqa: E402
import hf_xformers.ops.attention_switch as switch  # noqa: E402
from hf_xformers.attention import (  # noqa: E402
    block_sparse_flex,
    chunked_local,
    lsh,
    multi_head,
    shifted_window,
    sliding_window,
    sliding_window_layout,
)

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
FLEX_MODULES = (sliding_window, block_sparse_flex, shifted_window, chunked_local, lsh, multi_head)
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


@pytest.mark.parametrize("head_dim", [8, 16])
def test_compiled_flex_attention_on_the_cpu_is_exact_for_small_heads(head_dim):
    """torch 2.13's CPU kernel of compiled FlexAttention computes garbage rows (NaN at times) for heads of 8 and 16 when
    its key split is 8 modulo 16 (here: 40 keys under a 128-block mask); the switch pads such heads
    (``CPU_FLEX_MIN_HEAD_DIM``). The tiny test configs of Reformer have 8-wide heads."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    assert switch.FLEX_COMPILE
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 2, 40, head_dim) for _ in range(3))
    block_mask = switch.make_block_mask(lambda b, h, i, j: i >= j, None, None, 40, 40, torch.device("cpu"))
    expected = eager_flex(query, key, value, block_mask=block_mask)
    for _ in range(3):  # the kernel's garbage changes from call to call
        out = switch.flex_attention(query, key, value, block_mask=block_mask)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


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

    built, original = [], sliding_window_layout.band_block_mask

    def counted(*args, **kwargs):
        with HostReadCounter() as reads:
            mask = original(*args, **kwargs)
        built.append(reads.count)
        return mask

    monkeypatch.setattr(sliding_window_layout, "band_block_mask", counted)
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
    cpu = torch.device("cpu")
    ours = sliding_window_layout.band_block_mask(mask if padded else None, is_global, window, length, cpu)
    evaluated = create_block_mask(ours.mask_mod, 2, None, length, length, BLOCK_SIZE=sliding_window_layout.FLEX_BLOCK)
    visited = ours.to_dense().expand(2, -1, -1, -1).bool()
    assert not (evaluated.to_dense().bool() & ~visited).any(), "a block with an allowed score is skipped"

    def full_blocks(block_mask) -> torch.Tensor:
        table = torch.zeros_like(visited)
        counts = block_mask.full_kv_num_blocks.expand(2, -1, -1)
        indices = block_mask.full_kv_indices.expand(2, -1, -1, -1)
        for b, h, qb in torch.nonzero(counts >= 0).tolist():
            table[b, h, qb, indices[b, h, qb, : counts[b, h, qb]].long()] = True
        return table

    # query blocks inside the sequence (the last may reach past it)
    whole_rows = length // sliding_window_layout.FLEX_BLOCK
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


# ----- FlexAttention on GPUs: block sizes the Triton kernels accept, tiles within the shared memory -----------------

# What a GPU run gets, checked here on the CPU: H100 / H200 shared memory per block (Triton: "Hardware limit: 232448"),
# less the reserve the tile choice keeps.
HOPPER_BUDGET = 232448 - switch.SHARED_MEMORY_RESERVE
FLEX_ARCHS = ("longformer", "bigbird", "reformer", "universal", "swin")


def _token_table(table: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """Block table ``(..., n, n)`` -> the token table ``(..., length, length)`` it covers (places past the table:
    False)."""
    tokens = table.repeat_interleave(block, -1).repeat_interleave(block, -2)
    size = tokens.shape[-1]
    if size < length:
        tokens = F.pad(tokens, (0, length - size, 0, length - size))
    return tokens[..., :length, :length]


@pytest.mark.parametrize(("block", "length"), [(4, 37), (16, 300), (48, 400), (64, 520), (64, 256), (256, 600)])
def test_coarsened_tables_keep_the_pattern(block, length):
    """BigBird's tables at its own block size, coarsened to the GPU kernels' 128: no allowed pair is skipped, no
    partly masked block is marked full, and no block is visited that holds no visited pair of the fine tables."""
    nb = -(-length // block)
    g = torch.Generator().manual_seed(block + length)
    visited = torch.rand(2, 3, nb, nb, generator=g) < 0.3
    full = visited & (torch.rand(2, 3, nb, nb, generator=g) < 0.5)
    partial = visited & ~full
    coarse_partial, coarse_full = switch.coarsen_block_tables(partial, full, block, length)
    nc = -(-length // switch.FLEX_BLOCK_SIZE)
    assert coarse_partial.shape == coarse_full.shape == (2, 3, nc, nc)
    assert not (coarse_partial & coarse_full).any()
    fine_visit, fine_full = _token_table(visited, block, length), _token_table(full, block, length)
    coarse_visit = _token_table(coarse_partial | coarse_full, switch.FLEX_BLOCK_SIZE, length)
    coarse_whole = _token_table(coarse_full, switch.FLEX_BLOCK_SIZE, length)
    assert not (fine_visit & ~coarse_visit).any(), "a visited pair falls in a skipped 128-block"
    assert not (coarse_whole & ~fine_full).any(), "a 128-block marked full holds a pair that needs its mask"
    # Minimal: every visited 128-block holds a visited pair.
    held = F.pad(fine_visit, (0, nc * 128 - length, 0, nc * 128 - length)).view(2, 3, nc, 128, nc, 128)
    assert torch.equal(held.any(-1).any(-2), coarse_partial | coarse_full)


def test_a_block_mask_for_a_gpu_refuses_a_block_size_the_tiles_do_not_divide(monkeypatch):
    monkeypatch.setattr(switch, "gpu_kernels", lambda device: True)
    with pytest.raises(ValueError, match="multiple of 128"):
        switch.make_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, torch.device("cpu"), block_size=64)


@pytest.fixture
def as_if_on_a_gpu(monkeypatch) -> list:
    """The CPU run builds what a GPU run would (``gpu_kernels`` is True): every FlexAttention call is recorded with
    its BlockMask's block size and the ``kernel_options`` an H100 / H200 would get for it, then runs here (eager)."""
    monkeypatch.setattr(switch, "FLEX_COMPILE", False)
    monkeypatch.setattr(switch, "gpu_kernels", lambda device: True)
    calls = []
    for module in FLEX_MODULES:
        if hasattr(module, "flex_attention"):

            def recorded(q, k, v, *args, _kernel=switch.flex_attention, **kwargs):
                block_mask = kwargs.get("block_mask")
                block = (128, 128) if block_mask is None else tuple(block_mask.BLOCK_SIZE)
                options = switch.flex_kernel_options(q.shape[-1], v.shape[-1], q.dtype, block, HOPPER_BUDGET)
                calls.append((block, options))
                return _kernel(q, k, v, *args, **kwargs)

            monkeypatch.setattr(module, "flex_attention", recorded)
    return calls


def _tiles_divide(block: tuple[int, int], options: dict) -> bool:
    q_block, kv_block = block
    plain = {k.removeprefix("fwd_").removeprefix("bwd_"): v for k, v in options.items()}
    m = [plain[k] for k in ("BLOCK_M", "BLOCK_M1", "BLOCK_M2") if k in plain]
    n = [plain[k] for k in ("BLOCK_N", "BLOCK_N1", "BLOCK_N2") if k in plain]
    return len(m) == len(n) == 3 and all(q_block % t == 0 for t in m) and all(kv_block % t == 0 for t in n)


@pytest.mark.parametrize("arch", FLEX_ARCHS)
def test_every_block_mask_for_a_gpu_suits_the_kernels(arch, as_if_on_a_gpu):
    """Every BlockMask an architecture builds for a GPU has a block size of a multiple of 128 (BigBird's tiny config
    has blocks of 4), the tiles passed with it divide that size, and the outputs stay those of the "sdpa" path."""
    model = build(arch)
    with torch.no_grad():
        reference, real = run(model, arch, "sdpa")
        out, _ = run(model, arch, "flex_attention")
    assert as_if_on_a_gpu, f"{arch}: no FlexAttention call"
    for block, options in as_if_on_a_gpu:
        assert all(size % switch.FLEX_BLOCK_SIZE == 0 for size in block), (arch, block)
        assert _tiles_divide(block, options), (arch, block, options)
    assert max_difference(out.last_hidden_state, reference.last_hidden_state, real) < ATOL


def test_compiled_bigbird_kernel_over_coarsened_blocks(monkeypatch, flex_calls):
    """The compiled kernel walks the coarsened tables (it skips what they skip and leaves the mask out of full
    blocks): BigBird with 48-token blocks over several 128-token blocks, padded, gives the "sdpa" context."""
    monkeypatch.setattr(switch, "gpu_kernels", lambda device: True)
    config = hf_xformers.HfxBigBirdConfig(
        vocab_size=50, hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
        block_size=48, num_random_blocks=1, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf_xformers.HfxBigBirdModel(config).eval()
    ids = torch.randint(5, 50, (2, 720))
    mask = torch.ones_like(ids)
    mask[1, 500:] = 0
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation("flex_attention")
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert flex_calls
    assert max_difference(out, reference, mask.bool()) < ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 96, 128])
def test_kernel_options_fit_the_shared_memory_of_an_h100(head_dim, dtype):
    """The tiles passed on CUDA fit an H100 / H200's 227 KiB (estimated) for head dims up to 128 in float32 and 16
    bits, divide the 128-token blocks, keep the kernels' own constraints, and for bf16 at head_dim 64 are torch's sm_90
    defaults (the configuration the H200 measured)."""
    options = switch.flex_kernel_options(head_dim, head_dim, dtype, (128, 128), HOPPER_BUDGET)
    plain = {k.removeprefix("fwd_").removeprefix("bwd_"): v for k, v in options.items()}
    element = torch.empty((), dtype=dtype).element_size()
    forward = (plain["BLOCK_M"], plain["BLOCK_N"], options.get("fwd_num_stages", plain["num_stages"]), 4)
    backward = (plain["BLOCK_M1"], plain["BLOCK_N1"], plain["BLOCK_M2"], plain["BLOCK_N2"],
                options.get("bwd_num_stages", plain["num_stages"]), 4)  # fmt: skip
    for tiles in (forward, backward):
        assert switch.flex_shared_memory(tiles, head_dim, head_dim, element) <= 227 * 1024, (tiles, dtype, head_dim)
    assert _tiles_divide((128, 128), options)
    assert plain["BLOCK_N1"] % plain["BLOCK_M1"] == 0 and plain["BLOCK_M2"] % plain["BLOCK_N2"] == 0
    if dtype != torch.float32 and head_dim == 64:
        assert forward[:3] == (128, 128, 3) and backward[:5] == (64, 128, 128, 64, 3)
    # Float32 inputs, or head_dim 128, do not get the 16-bit head_dim-64 tiles, whose estimate exceeds the card.
    big = switch.flex_shared_memory(switch.FLEX_FORWARD_TILES[0], head_dim, head_dim, element)
    assert (big <= HOPPER_BUDGET) == (forward[:2] == (128, 128))


def test_shared_memory_estimate_grows_with_tiles_stages_and_precision():
    estimate = switch.flex_shared_memory
    assert estimate((128, 128, 3, 4), 64, 64, 4) == 2 * estimate((128, 128, 3, 4), 64, 64, 2) - 4 * 128 * 128
    deeper, shallower, smaller = ((128, 128, 3, 4), (128, 128, 2, 4), (64, 64, 2, 4))
    assert estimate(deeper, 64, 64, 2) > estimate(shallower, 64, 64, 2) > estimate(smaller, 64, 64, 2)
    assert estimate((64, 128, 128, 64, 3, 8), 128, 128, 2) > estimate((64, 128, 128, 64, 3, 8), 64, 64, 2)
    # Head dims round up to a power of two, as the kernels pad them.
    assert estimate((64, 64, 2, 4), 48, 48, 2) == estimate((64, 64, 2, 4), 64, 64, 2)
    with pytest.raises(ValueError, match="smaller attention heads"):
        switch.flex_kernel_options(4096, 4096, torch.float32, (128, 128), HOPPER_BUDGET)


def test_flex_inputs_take_the_autocast_dtype(monkeypatch):
    """Under autocast the three inputs reach FlexAttention in the autocast dtype (a float32 key beside bfloat16
    queries, as LSH's normalised keys are on CUDA, would double the kernel's shared memory)."""
    seen = []
    import torch.nn.attention.flex_attention as flex_module

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return q

    monkeypatch.setattr(switch, "FLEX_COMPILE", False)
    monkeypatch.setattr(flex_module, "flex_attention", spy)
    q, v = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16), torch.randn(1, 2, 8, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        switch.flex_attention(q, torch.randn(1, 2, 8, 4), v)
    switch.flex_attention(q.float(), torch.randn(1, 2, 8, 4), v.float())
    assert seen == [(torch.bfloat16,) * 3, (torch.float32,) * 3]


def test_kernel_options_only_for_the_cuda_kernels():
    """The CPU kernel gets no tile options (none of its own); nor do short queries (the decoding kernel)."""
    q = torch.randn(1, 2, 256, 64)
    assert switch.kernel_options_for(q, q, None) is None


# ----- the default per device: the fastest correct kernel where the user chose none ---------------------------------


@pytest.fixture
def as_if_on_cuda(monkeypatch):
    """The per-device decision as CUDA makes it, for inputs on the CPU."""
    monkeypatch.setattr(switch, "device_defaults", lambda device: switch.CUDA_DEFAULTS)


@pytest.mark.parametrize("arch", list(SUPPORTED))
def test_unset_choice_takes_the_device_default(arch, monkeypatch):
    """Where the user chose nothing: ``"sdpa"`` on the CPU, the architecture's measured CUDA default on CUDA (flex for
    Longformer, sdpa for the rest); an explicit choice, ``"sdpa"`` included, is kept on every device."""
    model = build(arch)
    config, cpu = model.config, torch.device("cpu")
    assert config._attn_implementation == "sdpa"
    # Every model marks "nothing chosen" (Transformer-XL too, on the shared base: it has no device default, so the
    # mark changes nothing there).
    assert getattr(config, switch.UNSET_ATTRIBUTE, False)
    assert switch.attention_implementation(config, cpu) == "sdpa"
    monkeypatch.setattr(switch, "device_defaults", lambda device: switch.CUDA_DEFAULTS)
    expected = "flex_attention" if arch == "longformer" else "sdpa"
    assert switch.attention_implementation(config, cpu) == expected
    assert switch.attention_implementation(config) == "sdpa"  # no device: the recorded choice
    model.set_attn_implementation("sdpa")
    assert switch.attention_implementation(config, cpu) == "sdpa"
    explicit = type(model)(type(config)(**{**config.to_dict(), "attn_implementation": "sdpa"}))
    assert not getattr(explicit.config, switch.UNSET_ATTRIBUTE, False)
    assert switch.attention_implementation(explicit.config, cpu) == "sdpa"


def test_cuda_defaults_run_what_they_name():
    """Every CUDA default is an implementation its architecture accepts."""
    from hf_xformers.registration import REGISTRY

    for model_type, implementation in switch.CUDA_DEFAULTS.items():
        model_class = REGISTRY[model_type][1]["AutoModel"]
        assert implementation in switch.IMPLEMENTATIONS
        assert implementation != "flex_attention" or model_class._supports_flex_attn, model_type


def test_longformer_runs_flex_by_default_on_cuda(as_if_on_cuda, eager_flex, flex_calls, monkeypatch):
    """Longformer with no choice made, as on CUDA: inference runs FlexAttention (the block masks built once per
    forward) with the "sdpa" path's outputs."""
    built = []
    original = sliding_window_layout.band_block_mask
    monkeypatch.setattr(sliding_window_layout, "band_block_mask", lambda *a, **k: built.append(1) or original(*a, **k))
    model = build("longformer")
    ids, mask = text_inputs(LENGTH)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert flex_calls and built == [1]
    explicit = build("longformer")
    explicit.set_attn_implementation("sdpa")
    flex_calls.clear()
    with torch.no_grad():
        reference = explicit(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not flex_calls
    assert max_difference(out, reference, mask.bool()) < ATOL
    # Where the layers will not run FlexAttention (here CPU training; on CUDA training with attention dropout), the
    # model builds no block mask for them either.
    built.clear()
    trained = build("longformer").train()
    trained.set_attn_implementation("flex_attention")
    trained(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert not flex_calls and not built


@pytest.mark.parametrize("arch", ["longformer", "reformer", "swin", "universal"])
def test_the_unset_mark_is_not_saved(arch, tmp_path):
    """The run-time mark stays out of config.json and ``to_dict`` (every config base: the text config, the
    transformers-checkpoint mixin); a reloaded model with no choice is unset again."""
    model = build(arch)
    assert getattr(model.config, switch.UNSET_ATTRIBUTE)
    assert not any(k.startswith("_hfx_") for k in model.config.to_dict())
    model.save_pretrained(tmp_path)
    assert "_hfx_" not in (tmp_path / "config.json").read_text()
    reloaded = transformers.AutoModel.from_pretrained(tmp_path)
    assert getattr(reloaded.config, switch.UNSET_ATTRIBUTE)
    assert not getattr(transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="sdpa").config,
                       switch.UNSET_ATTRIBUTE, False)  # fmt: skip


def test_gpu_flex_compiles_with_symbolic_lengths(monkeypatch):
    """Off the CPU (where FlexAttention may be the default and training lengths vary) the compiled kernel takes
    dynamo's automatic dynamic shapes, not a kernel per length up to the recompile limit and then the eager form;
    the CPU keeps static shapes (its symbolic-length codegen fails)."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(kwargs) or fn)
    switch._compiled_flex.cache_clear()
    try:
        switch._compiled_flex(True)
        switch._compiled_flex(False)
    finally:
        switch._compiled_flex.cache_clear()
    assert compiled == [{"dynamic": None}, {"dynamic": False}]


def test_device_defaults_follow_the_device_and_can_be_turned_off(monkeypatch):
    assert switch.device_defaults(torch.device("cuda")) == switch.CUDA_DEFAULTS
    assert switch.device_defaults("cpu") == {}
    monkeypatch.setattr(switch, "DEVICE_DEFAULTS_ENABLED", False)  # HFX_DEVICE_DEFAULTS=0
    assert switch.device_defaults(torch.device("cuda")) == {}


@pytest.mark.parametrize("model_type", sorted(switch.CUDA_DEFAULTS))
def test_every_cuda_default_is_what_the_model_runs_there(model_type, as_if_on_cuda, eager_flex, flex_calls):
    """An architecture listed in CUDA_DEFAULTS passes its input's device to the switch wherever it dispatches, so
    that the default is what runs (with the outputs of the explicit "sdpa" choice)."""
    arch = model_type.removeprefix("hfx-").replace("-", "_")
    model = build(arch)
    ids, mask = text_inputs(LENGTH)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    ran_flex = bool(flex_calls)
    assert ran_flex == (switch.CUDA_DEFAULTS[model_type] == "flex_attention"), model_type
    with torch.no_grad():
        reference, real = run(model, arch, "sdpa")
    assert max_difference(out, reference.last_hidden_state, real) < ATOL


def test_swin_follows_a_switch_at_the_next_call(eager_flex, flex_calls, monkeypatch):
    """Swin's window attention reads the choice itself (KernelChoice) at every forward: nothing passed down the stages
    holds an old one, so ``set_attn_implementation`` changes the kernel of the very next call."""
    sdpa_calls = []

    def counted_sdpa(*args, _kernel=F.scaled_dot_product_attention, **kwargs):
        sdpa_calls.append(1)
        return _kernel(*args, **kwargs)

    monkeypatch.setattr(shifted_window.F, "scaled_dot_product_attention", counted_sdpa)
    model = build("swin")
    with torch.no_grad():
        reference, real = run(model, "swin", "sdpa")
        assert sdpa_calls and not flex_calls
        sdpa_calls.clear()
        eager, _ = run(model, "swin", "eager")
        assert not sdpa_calls and not flex_calls, "eager was chosen but the window attention still ran SDPA"
        flex, _ = run(model, "swin", "flex_attention")
        assert flex_calls and not sdpa_calls
    for out in (eager, flex):
        assert max_difference(out.last_hidden_state, reference.last_hidden_state, real) < ATOL
