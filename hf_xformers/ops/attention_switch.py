"""The attention switch: which kernel an attention module runs, chosen by ``config._attn_implementation``.

transformers users pick the attention kernel with ``attn_implementation`` (at ``from_pretrained``, in the config, or
later with ``model.set_attn_implementation``); the choice lands in ``config._attn_implementation``. Every attention
module of this package reads it at each forward through ``attention/base.KernelChoice.kernel_choice``, which calls
:func:`attention_implementation` (never caches it; no other module calls it), so a switch applies at the next call:

* ``"eager"``: explicit ``softmax(q k^T / sqrt(d) + mask) v`` in plain PyTorch (:func:`eager_attention`): the
  reference path, and the one that returns attention maps (``output_attentions=True`` takes it whatever the choice).
* ``"sdpa"`` (the default): the fused paths, PyTorch's ``scaled_dot_product_attention`` and, on the CPU with
  dropout, our own kernel (``ops/kernels.py``).
* ``"flex_attention"``: PyTorch's FlexAttention with a ``BlockMask`` that describes the architecture's sparsity
  pattern (:func:`flex_attention`), for the structured patterns (Longformer's band, BigBird's blocks, Swin's windows,
  Reformer's chunks). FlexAttention has no backward pass on the CPU, so a CPU forward with gradients falls back to
  the ``"sdpa"`` path (:func:`flex_applies`); on CUDA it is the fused Triton kernel that skips empty blocks.

Which choices an architecture accepts is stated by its ``PreTrainedModel`` flags (``_supports_sdpa``,
``_supports_flex_attn``); transformers refuses the others with its own error naming the supported ones.

When the user chose nothing (no ``attn_implementation`` at load or in the config, no ``set_attn_implementation``),
transformers records ``"sdpa"``; hf_xformers then runs, per device, the fastest correct kernel it has measured there
(:data:`CUDA_DEFAULTS`, decided at each forward by :func:`attention_implementation` from the input's device): on
the CPU always ``"sdpa"``; on CUDA FlexAttention for Longformer. An explicit choice, ``"sdpa"`` included, is kept
on every device.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

EAGER = "eager"
SDPA = "sdpa"
FLEX = "flex_attention"
IMPLEMENTATIONS: tuple[str, ...] = (EAGER, SDPA, FLEX)


# What an architecture (config.model_type) runs on CUDA when the user chose no attn_implementation; every other one
# runs "sdpa" there. The evidence, NVIDIA H200, torch 2.11 + CUDA 13.0, training steps (forward + backward) under
# bf16 autocast, batch 1, hidden 768, 2 layers, no dropout (make gpu-check at 788e991, wave-6 notes):
# * Longformer (window 512): flex_attention 18 ms against our sdpa path 23 ms at 32k tokens (1.25x), 12 ms against
#   15 ms at 4k; peak memory at 32k 2.4 GB against 4.2 GB (0.58x). The outputs and gradients agree with float32 eager
#   as the sdpa path's do (the attention_implementations sweep: mean relative error <= 1e-2, gradient cosine >= 0.998).
# * BigBird (blocks of 64, 3 random): our sdpa path 14 ms at 4k and 15 ms at 16k (transformers: 96 and 104 ms);
#   flex_attention did not compile there then (64-token BlockMask, fixed since: FLEX_BLOCK_SIZE) and has no GPU
#   figure yet, so BigBird keeps sdpa until `make gpu-check` (attention_switch step) shows flex faster.
# * Reformer, Universal, Swin: flex_attention runs but no training figure against sdpa yet: sdpa.
# Training with attention dropout takes the sdpa path whatever the choice (flex_applies).
CUDA_DEFAULTS: dict[str, str] = {"hfx-longformer": FLEX}
# The config attribute that says the user chose no attn_implementation (set by the model at construction, cleared by
# set_attn_implementation: layers/pretrained.py); configs/text_config.RUNTIME_ONLY_PREFIX keeps it out of config.json.
UNSET_ATTRIBUTE = "_hfx_attn_implementation_unset"


def mark_implementation_unset(config, unset: bool) -> None:
    """Record on ``config`` whether its ``attn_implementation`` is transformers' default rather than a choice."""
    setattr(config, UNSET_ATTRIBUTE, unset)


# HFX_DEVICE_DEFAULTS=0 in the environment keeps "sdpa" as the unset choice on every device (read once, at import):
# what `make gpu-check` runs the conformance suites under, whose time on the GPU fits the sdpa paths (they test the
# CUDA default of every architecture being "sdpa" there; its other steps run FlexAttention).
DEVICE_DEFAULTS_ENABLED: bool = os.environ.get("HFX_DEVICE_DEFAULTS", "1") != "0"


def device_defaults(device: torch.device | str) -> dict[str, str]:
    """The per-architecture defaults for ``device`` (:data:`CUDA_DEFAULTS` on CUDA, none elsewhere): the one place
    that decides which device has which defaults (tests patch it to check a CUDA decision on the CPU)."""
    return CUDA_DEFAULTS if DEVICE_DEFAULTS_ENABLED and torch.device(device).type == "cuda" else {}


def attention_implementation(config, device: torch.device | str | None = None) -> str:
    """The kernel family this forward uses: ``config._attn_implementation`` (``"sdpa"`` when unset), or, where the
    user chose none and ``device`` (the input's) has a measured faster default for this architecture
    (:func:`device_defaults`), that default.

    Raises:
        ValueError: a choice none of our attention modules implements (flash attention, paged attention, a hub
            kernel); transformers' own checks refuse most of them earlier, at load or ``set_attn_implementation``.
    """
    implementation = getattr(config, "_attn_implementation", None) or SDPA
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={implementation!r} is not available for hf_xformers models; use one of "
            f"{IMPLEMENTATIONS} (the model's _supports_* flags say which it accepts)."
        )
    if device is not None and implementation == SDPA and getattr(config, UNSET_ATTRIBUTE, False):
        return device_defaults(device).get(getattr(config, "model_type", None), implementation)
    return implementation


def flex_applies(implementation: str, reference: torch.Tensor, training: bool, dropout_p: float = 0.0) -> bool:
    """True when ``"flex_attention"`` was chosen and can run here. FlexAttention has no backward pass on the CPU, so
    CPU training (a module in training mode, or a forward that records gradients) takes the ``"sdpa"`` path instead:
    the same numbers, and a reversible stack recomputes exactly what its forward computed. Nor has it dropout on the
    probabilities: training with attention dropout takes the ``"sdpa"`` path on every device."""
    if implementation != FLEX or (training and dropout_p > 0.0):
        return False
    if reference.device.type != "cpu":
        return True
    return not training and not (torch.is_grad_enabled() and reference.requires_grad)


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale + bias, masked) v`` spelled out: the reference kernel.

    Args:
        query: ``(..., q_len, d)``; key, value: ``(..., k_len, d)`` (``value`` may have another last size).
        mask: bool, broadcastable to ``(..., q_len, k_len)``, True where a query may attend; every row must keep
            at least one key (masked scores are ``-inf``).
        dropout_p: dropout on the probabilities (0 in eval mode).
        bias: float, broadcastable to the scores, added before the softmax (Swin's relative positions).
        scale: defaults to ``d ** -0.5``.
    Returns:
        ``context`` ``(..., q_len, d_v)`` and the probabilities ``(..., q_len, k_len)`` the context is computed from
        (before dropout); the softmax is taken in float32, as SDPA's math path does.
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(F.dropout(probs, dropout_p, dropout_p > 0.0), value), probs


# Outside torch.compile, run FlexAttention compiled (its eager form materialises every score: a reference, slow and
# quadratic in memory). Tests set this to False to check the eager form too.
FLEX_COMPILE = True
# The CPU kernel of compiled FlexAttention (torch 2.13's inductor C++ template) computes wrong rows, NaN at times, for
# head sizes of 8 and 16 when its key split (the BlockMask's block size, or the whole length when shorter) is 8 modulo
# 16: e.g. (2, 1, 40, 8) queries, keys and values under a 128-block mask are 0.6 off the eager form in the last batch
# element, with different garbage from run to run (an uninitialised buffer). Head sizes of 32 and 64 are exact at every
# length measured, so smaller heads reach the CPU kernel zero-padded to this width (tests/test_attention_switch.py).
CPU_FLEX_MIN_HEAD_DIM = 32
# Compiled FlexAttention kernels kept per process (one per length and pattern kind) before dynamo gives up on compiling.
FLEX_RECOMPILE_LIMIT = 64


def flex_returns_lse(device: torch.device) -> bool:
    """Whether FlexAttention can return row log-normalisers here: compiled FlexAttention on the CPU cannot (torch
    2.13: "torch.compile on CPU only supports inference and `return_lse` is not supported yet"); its eager form can."""
    return device.type != "cpu" or (not FLEX_COMPILE and not torch.compiler.is_compiling())


# ----- FlexAttention on GPUs: block sizes the kernels accept, tiles that fit the shared memory -------------------
#
# The Triton kernels behind compiled FlexAttention walk a BlockMask in tiles of BLOCK_M queries x BLOCK_N keys
# (forward) and BLOCK_M1 x BLOCK_N1, BLOCK_M2 x BLOCK_N2 (backward), and refuse a BlockMask whose block size their
# tile does not divide ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N", measured on an H200 with
# BigBird's 64-token blocks: the default forward tile on sm_90 is 128 x 128 in 16 bits). Every default tile of torch's
# heuristics (A100, H100/H200, Blackwell; 16 to 128) divides 128, so every BlockMask built for a GPU kernel is built
# at FLEX_BLOCK_SIZE; a pattern on finer blocks (BigBird's) keeps its exact shape in the mask_mod, and the block
# tables are coarsened to 128 (block_mask_from_tables): a 128-block is visited when any of its finer blocks is, and
# skips its per-score mask only when all of them are full. On the CPU the tables stay at the pattern's own block size
# (the CPU kernel takes any, and finer tables skip more work there).
FLEX_BLOCK_SIZE = 128


def gpu_kernels(device: torch.device | str) -> bool:
    """Whether FlexAttention on ``device`` runs the GPU (Triton) kernels, whose tiles need the block sizes and shared
    memory arranged here: every device but the CPU. The one place that decides it (tests patch it to check, on the
    CPU, what a GPU run would be given)."""
    return torch.device(device).type != "cpu"


def make_block_mask(mask_mod: Callable, batch: int | None, heads: int | None, q_len: int, kv_len: int,
               device: torch.device, block_size: int = FLEX_BLOCK_SIZE):  # fmt: skip
    """FlexAttention's ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (``batch`` / ``heads`` None: the same
    for all). Building it evaluates ``mask_mod`` on every (query, key) pair; on accelerators that evaluation is compiled
    (as transformers does), so that 32k-token masks do not materialise 2**30 booleans; on the CPU it runs as it is
    (tens of milliseconds at the lengths the CPU serves, and no compilation).

    Raises:
        ValueError: for a GPU, a ``block_size`` that is not a multiple of :data:`FLEX_BLOCK_SIZE` (the kernels' tiles
            would not divide it); state a finer pattern inside ``mask_mod`` instead.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if gpu_kernels(device) and block_size % FLEX_BLOCK_SIZE:
        raise ValueError(
            f"A FlexAttention BlockMask for a GPU needs a block size that is a multiple of {FLEX_BLOCK_SIZE} (the "
            f"kernels' tiles must divide it), got {block_size}; build it at {FLEX_BLOCK_SIZE} and state the finer "
            "pattern inside mask_mod."
        )
    compile_it = torch.device(device).type != "cpu" and not torch.compiler.is_compiling()
    return create_block_mask(
        mask_mod, batch, heads, q_len, kv_len, device=device, BLOCK_SIZE=block_size, _compile=compile_it
    )


def coarsen_block_tables(
    partial: torch.Tensor, full: torch.Tensor, block_size: int, length: int, target: int = FLEX_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables ``(batch, heads, nb, nb)`` bool at ``block_size`` -> the same pattern's tables ``(batch, heads,
    nc, nc)`` at ``target`` (``nc = ceil(length / target)``): a coarse block pair is visited when any finer pair in
    it is (partial or full), and is full only when every finer pair in it is full; visited and not full is partial.
    Works for any pair of sizes through units of ``gcd(block_size, target)`` tokens (BigBird's 64 -> 128: pairs of
    blocks; 48 -> 128: units of 16). Places past the tables (beyond ``nb * block_size``) hold no token: they do not
    make a block visited, nor stop it from being full."""
    unit = math.gcd(block_size, target)
    rep, group = block_size // unit, target // unit
    nb = partial.shape[-1]
    coarse = -(-length // target)
    units, wanted = nb * rep, coarse * group

    def to_units(table: torch.Tensor, pad_value: bool) -> torch.Tensor:
        shape = table.shape[:-2]
        table = table[..., :, None, :, None].expand(*shape, nb, rep, nb, rep).reshape(*shape, units, units)
        if units >= wanted:
            return table[..., :wanted, :wanted]
        extra = wanted - units
        return F.pad(table, (0, extra, 0, extra), value=pad_value)

    def grouped(table: torch.Tensor) -> torch.Tensor:  # (..., wanted, wanted) -> (..., coarse, group, coarse, group)
        return table.reshape(*table.shape[:-2], coarse, group, coarse, group)

    visited = grouped(to_units(partial | full, False)).any(-1).any(-2)
    all_full = grouped(to_units(full, True)).all(-1).all(-2)
    return visited & ~all_full, all_full


def block_mask_from_tables(
    partial: torch.Tensor, full: torch.Tensor, block_size: int, mask_mod: Callable, length: int
):  # fmt: skip
    """A ``BlockMask`` from block tables ``(batch, heads, nb, nb)`` bool: ``partial`` blocks the kernel visits and
    masks per score with ``mask_mod``, ``full`` blocks it visits without a mask (every score allowed); the rest are
    skipped. ``mask_mod`` must state the whole pattern all the same: FlexAttention's eager form applies it to every
    score and ignores the tables. For the GPU kernels, tables at a block size that is not a multiple of
    :data:`FLEX_BLOCK_SIZE` are coarsened to it (:func:`coarsen_block_tables`; ``mask_mod`` keeps the exact pattern)."""
    from torch.nn.attention.flex_attention import BlockMask

    if gpu_kernels(partial.device) and block_size % FLEX_BLOCK_SIZE:
        partial, full = coarsen_block_tables(partial, full, block_size, length)
        block_size = FLEX_BLOCK_SIZE

    def listed(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (count, indices) per query block: the True columns first (a stable sort keeps them in order)
        order = torch.argsort((~table).to(torch.int8), dim=-1, stable=True)
        return table.sum(-1, dtype=torch.int32), order.to(torch.int32)

    return BlockMask.from_kv_blocks(
        *listed(partial), *listed(full), BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(length, length)
    )


# Tiles and pipeline depths to choose from, the largest first: (BLOCK_M, BLOCK_N, num_stages, num_warps) for the
# forward kernel and (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps) for the backward one (the kernel
# asserts BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0). The first of each is torch's own default on sm_90
# for 16-bit inputs and head_dim 64 (what the H200 run measured: Longformer 1.25x faster than our sdpa path at 32k
# tokens); the rest step down until the estimate (flex_shared_memory) fits the card.
FLEX_FORWARD_TILES: tuple[tuple[int, int, int, int], ...] = (
    (128, 128, 3, 4),
    (128, 64, 3, 8),
    (128, 64, 2, 4),
    (64, 64, 2, 4),
    (64, 32, 2, 4),
    (32, 32, 1, 4),
    (16, 16, 1, 4),
)
FLEX_BACKWARD_TILES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (64, 128, 128, 64, 3, 8),
    (64, 64, 64, 64, 3, 4),
    (64, 64, 64, 64, 2, 4),
    (32, 64, 64, 32, 2, 4),
    (32, 64, 64, 32, 1, 4),
    (16, 32, 32, 16, 1, 4),
    (16, 16, 16, 16, 1, 4),
)
# Shared memory per block (opt-in maximum) when the device does not report it, by compute capability: 227 KiB on
# sm_90 (H100/H200: "Hardware limit: 232448" in Triton's error), 163 KiB on sm_80, 99 KiB on the other sm_8x; 48 KiB
# (every CUDA device) otherwise.
SHARED_MEMORY_BY_CAPABILITY = {(9, 0): 232448, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376}
# Kept free of the estimate: Triton's own scratch (barriers, reductions) beside the tiles.
SHARED_MEMORY_RESERVE = 8 * 1024


def _rounded(dim: int) -> int:
    # the kernels pad head dims to a power of two (QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED)
    return 1 << max(0, (dim - 1).bit_length())


def flex_shared_memory(tiles: tuple[int, ...], qk_dim: int, v_dim: int, element_size: int) -> int:
    """Estimated shared memory (bytes) of one FlexAttention kernel with ``tiles`` (a :data:`FLEX_FORWARD_TILES` or
    :data:`FLEX_BACKWARD_TILES` entry) on inputs of ``element_size`` bytes and head dims ``qk_dim`` / ``v_dim``.

    Forward: the query tile (``BLOCK_M x d``), ``num_stages`` buffered key and value tiles (``BLOCK_N x (d + d_v)``)
    and the float32 score tile (``BLOCK_M x BLOCK_N``, for the mask and layout changes). Backward: the larger of its
    two loops, each holding its fixed tiles (keys and values for dK/dV, queries and output gradients for dQ), the
    buffered tiles of the other side and two float32 tiles (probabilities and their gradients). An estimate, not
    Triton's allocator: it ranks tiles and keeps a margin (:data:`SHARED_MEMORY_RESERVE`); ``make gpu-check`` runs
    the kernels (``attention_implementations``, float32 and bfloat16, head dims 64 and 128)."""
    qk, v, e = _rounded(qk_dim), _rounded(v_dim), element_size
    if len(tiles) == 4:
        block_m, block_n, stages, _ = tiles
        return e * block_m * qk + stages * e * block_n * (qk + v) + 4 * block_m * block_n
    m1, n1, m2, n2, stages, _ = tiles
    keys_side = e * n1 * (qk + v) + stages * e * m1 * (qk + v) + 2 * 4 * m1 * n1
    query_side = e * m2 * (qk + v) + stages * e * n2 * (qk + v) + 2 * 4 * m2 * n2
    return max(keys_side, query_side)


@torch.compiler.assume_constant_result
def shared_memory_budget(device_index: int) -> int:
    """The bytes of shared memory one block may use on CUDA device ``device_index`` (its opt-in maximum), less
    :data:`SHARED_MEMORY_RESERVE`. A constant of the device: compiled graphs take it as one."""
    props = torch.cuda.get_device_properties(device_index)
    limit = getattr(props, "shared_memory_per_block_optin", 0) or SHARED_MEMORY_BY_CAPABILITY.get(
        (props.major, props.minor), 48 * 1024
    )
    return limit - SHARED_MEMORY_RESERVE


def _takes_prefixed_kernel_options() -> bool:
    # Recent torch (its FlexKernelOptions documents them) takes fwd_ / bwd_ prefixes: separate stages and warps for
    # the two kernels. Before, the same keys reach both kernels.
    from torch.nn.attention import flex_attention as flex_module

    return "fwd_" in (getattr(getattr(flex_module, "FlexKernelOptions", None), "__doc__", None) or "")


PREFIXED_KERNEL_OPTIONS: bool = _takes_prefixed_kernel_options()


def flex_kernel_options(
    qk_dim: int, v_dim: int, dtype: torch.dtype, block_size: tuple[int, int], budget: int
) -> dict[str, int]:
    """``kernel_options`` for compiled FlexAttention on CUDA: the first forward and backward tiles (of
    :data:`FLEX_FORWARD_TILES`, :data:`FLEX_BACKWARD_TILES`) that divide the BlockMask's ``block_size`` ``(q, kv)``
    and whose :func:`flex_shared_memory` fits ``budget`` bytes, for inputs of ``dtype`` with head dims ``qk_dim`` /
    ``v_dim`` (float32 inputs, or head dims of 128, take smaller tiles than torch's defaults, which need more than
    an H100 has: "out of resource: shared memory, Required: 442368, Hardware limit: 232448").

    Raises:
        ValueError: no tile fits (a head dim far beyond 256); use smaller heads or the ``"sdpa"`` implementation.
    """
    element = torch.empty((), dtype=dtype).element_size()
    q_block, kv_block = block_size

    def fits(tiles: tuple[int, ...]) -> bool:
        if len(tiles) == 4:
            divides = q_block % tiles[0] == 0 and kv_block % tiles[1] == 0
        else:
            divides = all(q_block % m == 0 for m in tiles[0:3:2]) and all(kv_block % n == 0 for n in tiles[1:4:2])
        return divides and flex_shared_memory(tiles, qk_dim, v_dim, element) <= budget

    forward = next((t for t in FLEX_FORWARD_TILES if fits(t)), None)
    backward = next((t for t in FLEX_BACKWARD_TILES if fits(t)), None)
    if forward is None or backward is None:
        raise ValueError(
            f"No FlexAttention tile fits {budget} bytes of shared memory for head dims {qk_dim}/{v_dim} in {dtype}; "
            'use smaller attention heads, or attn_implementation="sdpa".'
        )
    fwd_m, fwd_n, fwd_stages, fwd_warps = forward
    m1, n1, m2, n2, bwd_stages, bwd_warps = backward
    if PREFIXED_KERNEL_OPTIONS:
        return {
            "fwd_BLOCK_M": fwd_m, "fwd_BLOCK_N": fwd_n, "fwd_num_stages": fwd_stages, "fwd_num_warps": fwd_warps,
            "bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_stages": bwd_stages, "bwd_num_warps": bwd_warps,
        }  # fmt: skip
    # One set of stages and warps for both kernels: the smaller, which fits both estimates.
    return {
        "BLOCK_M": fwd_m, "BLOCK_N": fwd_n, "BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2,
        "num_stages": min(fwd_stages, bwd_stages), "num_warps": min(fwd_warps, bwd_warps),
    }  # fmt: skip


def kernel_options_for(query: torch.Tensor, value: torch.Tensor, block_mask) -> dict[str, int] | None:
    """The ``kernel_options`` FlexAttention gets for these inputs: :func:`flex_kernel_options` for the main CUDA kernel
    (the BlockMask's block size, the device's shared memory), None elsewhere (the CPU kernel; ROCm, whose own
    heuristics size the tiles for its 64 KiB; queries shorter than 128, which run the decoding kernel, whose
    ``BLOCK_M`` follows the query length)."""
    if query.device.type != "cuda" or torch.version.hip is not None or not gpu_kernels(query.device):
        return None
    if query.shape[-2] < FLEX_BLOCK_SIZE:
        return None
    block_size = (FLEX_BLOCK_SIZE, FLEX_BLOCK_SIZE) if block_mask is None else tuple(block_mask.BLOCK_SIZE)
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    return flex_kernel_options(query.shape[-1], value.shape[-1], query.dtype, block_size, shared_memory_budget(index))


@functools.cache
def _compiled_flex(symbolic_lengths: bool) -> Callable:
    # One compiled FlexAttention for the process per kind of device. On the CPU, static shapes: a kernel per (length,
    # pattern kind). Symbolic lengths (dynamic=None after a second shape) hit an inductor C++ codegen error on the CPU
    # for score_mod kernels (torch 2.13: "'cur_kvSplitSize2' was not declared in this scope"), so every length compiles
    # its own kernel, under a recompile limit raised from dynamo's 8 (flex_attention below): past the limit dynamo
    # would fall back to the eager form, which materialises every score (measured: BigBird at 8,192 tokens after eight
    # other shapes). On GPUs, where FlexAttention may be the default (CUDA_DEFAULTS) and training batches come in
    # many lengths, dynamo's automatic dynamic shapes (as transformers compiles flex_attention): the second length
    # recompiles once with symbolic lengths, which every later length reuses.
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=None if symbolic_lengths else False)


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask=None,
    score_mod: Callable | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention: ``(batch, heads, q_len, d)`` queries against ``(batch, heads, k_len, d)`` keys and values,
    restricted by ``block_mask`` (a ``BlockMask``) and with ``score_mod`` applied to every score. Returns the context
    ``(batch, heads, q_len, d)`` and, with ``return_lse``, the natural log of each row's softmax normaliser
    ``(batch, heads, q_len)``.

    Outside ``torch.compile`` the kernel runs compiled (FlexAttention's eager form materialises the scores and is a
    reference only); inside a compiled model, the model's compilation covers it. Under autocast, the inputs reach the
    kernel in the autocast dtype, as SDPA's do (a query-key product computed in float32 before, such as LSH's
    normalised keys on CUDA, would double the kernel's shared memory); on CUDA the kernel gets tiles that fit
    (:func:`kernel_options_for`).
    """
    from torch.nn.attention.flex_attention import flex_attention as flex

    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if device_type == "cpu" and head_dim < CPU_FLEX_MIN_HEAD_DIM and (FLEX_COMPILE or torch.compiler.is_compiling()):
        # Zero columns leave every score (and so the normaliser) unchanged; the value's extra columns are cut below.
        scale = head_dim**-0.5 if scale is None else scale
        width = CPU_FLEX_MIN_HEAD_DIM
        query, key = F.pad(query, (0, width - head_dim)), F.pad(key, (0, width - head_dim))
        value = F.pad(value, (0, max(width - value_dim, 0)))
    extra = {"return_lse": True} if return_lse else {}
    options = kernel_options_for(query, value, block_mask)
    if options is not None:
        extra["kernel_options"] = options
    if torch.compiler.is_compiling() or not FLEX_COMPILE:
        out = flex(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, **extra)
    else:
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
            compiled = _compiled_flex(query.device.type != "cpu")
            out = compiled(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, **extra)
    if value.shape[-1] == value_dim:
        return out
    return (out[0][..., :value_dim], out[1]) if return_lse else out[..., :value_dim]


__all__ = [
    "EAGER",
    "FLEX",
    "FLEX_BLOCK_SIZE",
    "IMPLEMENTATIONS",
    "SDPA",
    "CUDA_DEFAULTS",
    "UNSET_ATTRIBUTE",
    "attention_implementation",
    "block_mask_from_tables",
    "device_defaults",
    "mark_implementation_unset",
    "coarsen_block_tables",
    "flex_kernel_options",
    "flex_shared_memory",
    "gpu_kernels",
    "kernel_options_for",
    "make_block_mask",
    "eager_attention",
    "flex_applies",
    "flex_attention",
    "flex_returns_lse",
]
