"""Cached decoding with FAVOR+: causal attention in its recurrent form.

Per (batch, head) the state is the running sum ``S = sum_j phi(k_j) [v_j, 1]`` ``(m, e + 1)`` and, for the softmax
kernel, the running key stabiliser it is expressed against. A new token rescales ``S`` when the stabiliser rises,
adds its key and reads its output: a cost independent of how many tokens came before, and the outputs of the causal
forward over the whole sequence (:mod:`~hf_xformers.attention.favor_causal`).
"""

from __future__ import annotations

import torch

from ..ops.precision import float32_autocast_off
from .favor_causal import causal_linear_attention, running_max
from .favor_features import (
    KERNELS,
    QUERY_EPS,
    finite_or_zero,
    relu_kernel_features,
    softmax_kernel_features,
    softmax_key_logits,
)
from .favor_linear import CAUSAL_CHUNK_SIZE, normalise, rescale, with_ones

FavorState = tuple  # (key_value (batch, heads, m, e + 1), stabiliser (batch, heads) or None), both float32


def favor_attention_with_state(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    projection: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kernel: str,
    state: FavorState | None,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
) -> tuple[torch.Tensor, FavorState]:
    """Causal FAVOR+ of new tokens that follow the tokens summarised by ``state``: the recurrent form (cached decoding).

    The state holds, per (batch element, head), ``S = sum_j phi(k_j) exp(-s) [v_j, 1]`` over every key seen so far
    and, for the softmax kernel, the running key stabiliser ``s`` it is expressed against (the max over the keys
    seen, ``-inf`` before any real one). New tokens read ``S`` rescaled to their own running stabiliser plus the
    keys among themselves (a ``(new, new)`` product), then are added to it: the cost depends on the number of new
    tokens, never on how many came before. The outputs are those of
    :func:`~hf_xformers.attention.favor.favor_attention` with ``causal=True`` over the whole sequence (the same
    stabilisers, so the same terms, summed in another order).

    With ``state=None`` (a prompt) the new tokens go through the chunked prefix sums of
    :func:`~hf_xformers.attention.favor_causal.causal_linear_attention`, and the state after the last of them is
    formed once.

    Args:
        query, key, value: ``(batch, heads, new, d)`` of the new tokens, any float dtype.
        projection: ``(m, d)``.
        attention_mask: ``(batch, new)`` bool for the new tokens (True = real), or None.
        kernel: ``"softmax"`` or ``"relu"``.
        state: what an earlier call returned, or None.
        chunk_size: chunk of the prefix sums (prompt) and of the running max.

    Returns:
        ``(context, state)``: ``(batch, heads, new, d)`` in ``value``'s dtype, and the state after the new tokens.
    """
    if kernel not in KERNELS:
        raise ValueError(f"Unknown FAVOR kernel {kernel!r}; use one of {KERNELS} (config.favor_kernel).")
    dtype = value.dtype
    with float32_autocast_off(value.device.type):
        query, key, value, projection = (t.float() for t in (query, key, value, projection))
        previous = None if state is None else state[1]
        query_features, key_features, running, eps = _new_features(
            query, key, projection, attention_mask, kernel, previous, chunk_size
        )
        stabiliser = None if running is None else finite_or_zero(running)
        if stabiliser is not None:
            key_features = (key_features - stabiliser.unsqueeze(-1)).exp()
        value = with_ones(value)
        if state is None:
            context = causal_linear_attention(
                query_features, key_features, value[..., :-1], chunk_size, eps, stabiliser
            )
        else:
            context = _read_past_and_new(query_features, key_features, value, state[0], eps, stabiliser, previous)
        new_state = (
            _summed_state(key_features, value, state, stabiliser),
            None if running is None else running[..., -1],
        )
    return context.to(dtype), new_state


def _new_features(
    query: torch.Tensor,
    key: torch.Tensor,
    projection: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kernel: str,
    previous: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """The new tokens' query features ``(batch, heads, new, m)``, their key features (for the softmax kernel, the
    key *logits*, still to be stabilised), the running key stabiliser ``(batch, heads, new)`` continuing
    ``previous`` (``-inf`` before any real key; None for the relu kernel) and the query ``eps``."""
    if kernel != "softmax":
        query_features = relu_kernel_features(query, projection)
        return query_features, relu_kernel_features(key, projection, key_mask=attention_mask), None, 0.0
    logits = softmax_key_logits(key, projection, attention_mask)
    running = running_max(logits.detach().amax(-1), chunk_size)  # (b, h, new), -inf before any real key
    if previous is not None:
        running = torch.maximum(running, previous.unsqueeze(-1))
    return softmax_kernel_features(query, projection, is_query=True), logits, running, QUERY_EPS


def _read_past_and_new(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    key_value: torch.Tensor,
    eps: float,
    stabiliser: torch.Tensor | None,
    previous: torch.Tensor | None,
) -> torch.Tensor:
    """The context of the new tokens ``(batch, heads, new, e)``: earlier tokens through the state ``key_value``
    ``(batch, heads, m, e + 1)`` (stabilised at ``previous``), the new ones among themselves through a small causal
    product; ``value`` ``(batch, heads, new, e + 1)``."""
    scores = torch.matmul(query_features + eps, key_features.transpose(-1, -2))
    if stabiliser is not None:
        scores = scores * rescale(stabiliser.unsqueeze(-2), stabiliser.unsqueeze(-1))
    out = torch.matmul(scores.tril(), value)
    earlier = torch.matmul(query_features, key_value) + eps * key_value.sum(-2, keepdim=True)
    if stabiliser is not None:
        earlier = earlier * rescale(previous.unsqueeze(-1), stabiliser).unsqueeze(-1)
    return normalise(out + earlier)


def _summed_state(
    key_features: torch.Tensor, value: torch.Tensor, state: FavorState | None, stabiliser: torch.Tensor | None
) -> torch.Tensor:
    """The key-value sum after the last new token ``(batch, heads, m, e + 1)``, against that token's running
    stabiliser: the new keys' ``phi(k) [v, 1]`` added to the earlier state, if any."""
    if stabiliser is not None:
        last = stabiliser[..., -1:]  # (b, h, 1)
        key_features = key_features * rescale(stabiliser, last).unsqueeze(-1)
    key_value = torch.matmul(key_features.transpose(-1, -2), value)
    if state is None:
        return key_value
    if stabiliser is None:
        return key_value + state[0]
    return key_value + state[0] * rescale(state[1], last[..., 0])[..., None, None]
