"""The attention switch: which kernel an attention module runs, chosen by ``config._attn_implementation``.

transformers users pick the attention kernel with ``attn_implementation`` (at ``from_pretrained``, in the config, or
later with ``model.set_attn_implementation``); the choice lands in ``config._attn_implementation``. Every attention
module of this package reads it at each forward through :func:`attention_implementation` (never caches it), so a
switch applies at the next call:

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
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

EAGER = "eager"
SDPA = "sdpa"
FLEX = "flex_attention"
IMPLEMENTATIONS: tuple[str, ...] = (EAGER, SDPA, FLEX)


def attention_implementation(config) -> str:
    """``config._attn_implementation`` (``"sdpa"`` when unset): the kernel family this forward uses.

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
# Compiled FlexAttention kernels kept per process (one per length and pattern kind) before dynamo gives up on compiling.
FLEX_RECOMPILE_LIMIT = 64


def flex_returns_lse(device: torch.device) -> bool:
    """Whether FlexAttention can return row log-normalisers here: compiled FlexAttention on the CPU cannot (torch
    2.13: "torch.compile on CPU only supports inference and `return_lse` is not supported yet"); its eager form can."""
    return device.type != "cpu" or (not FLEX_COMPILE and not torch.compiler.is_compiling())


def make_block_mask(mask_mod: Callable, batch: int | None, heads: int | None, q_len: int, kv_len: int,
               device: torch.device, block_size: int = 128):  # fmt: skip
    """FlexAttention's ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (``batch`` / ``heads`` None: the same
    for all). Building it evaluates ``mask_mod`` on every (query, key) pair; on accelerators that evaluation is compiled
    (as transformers does), so that 32k-token masks do not materialise 2**30 booleans; on the CPU it runs as it is
    (tens of milliseconds at the lengths the CPU serves, and no compilation)."""
    from torch.nn.attention.flex_attention import create_block_mask

    compile_it = torch.device(device).type != "cpu" and not torch.compiler.is_compiling()
    return create_block_mask(
        mask_mod, batch, heads, q_len, kv_len, device=device, BLOCK_SIZE=block_size, _compile=compile_it
    )


def block_mask_from_tables(
    partial: torch.Tensor, full: torch.Tensor, block_size: int, mask_mod: Callable, length: int
):  # fmt: skip
    """A ``BlockMask`` from block tables ``(batch, heads, nb, nb)`` bool: ``partial`` blocks the kernel visits and
    masks per score with ``mask_mod``, ``full`` blocks it visits without a mask (every score allowed); the rest are
    skipped. ``mask_mod`` must state the whole pattern all the same: FlexAttention's eager form applies it to every
    score and ignores the tables."""
    from torch.nn.attention.flex_attention import BlockMask

    def listed(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (count, indices) per query block: the True columns first (a stable sort keeps them in order)
        order = torch.argsort((~table).to(torch.int8), dim=-1, stable=True)
        return table.sum(-1, dtype=torch.int32), order.to(torch.int32)

    return BlockMask.from_kv_blocks(
        *listed(partial), *listed(full), BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(length, length)
    )


@functools.cache
def _compiled_flex() -> Callable:
    # One compiled kernel for the process, static shapes: a kernel per (length, pattern kind). Symbolic lengths
    # (dynamic=None after a second shape) hit an inductor C++ codegen error on the CPU for score_mod kernels (torch
    # 2.13: "'cur_kvSplitSize2' was not declared in this scope"), so every length compiles its own kernel, under a
    # recompile limit raised from dynamo's 8 (flex_attention below): past the limit dynamo would fall back to the eager
    # form, which materialises every score (measured: BigBird at 8,192 tokens after eight other shapes).
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False)


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
    reference only); inside a compiled model, the model's compilation covers it.
    """
    from torch.nn.attention.flex_attention import flex_attention as flex

    extra = {"return_lse": True} if return_lse else {}
    if torch.compiler.is_compiling() or not FLEX_COMPILE:
        return flex(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, **extra)
    with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
        return _compiled_flex()(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, **extra)


__all__ = [
    "EAGER",
    "FLEX",
    "IMPLEMENTATIONS",
    "SDPA",
    "attention_implementation",
    "block_mask_from_tables",
    "make_block_mask",
    "eager_attention",
    "flex_applies",
    "flex_attention",
    "flex_returns_lse",
]
