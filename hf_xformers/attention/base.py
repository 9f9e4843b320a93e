"""The interface every self-attention variant implements.

An attention module is built as ``AttentionClass(config, layer_idx)`` and called as::

    out = attention(hidden_states, attention_mask=None, global_attention_mask=None, output_attentions=False)

Inputs:
    hidden_states: ``(batch, seq_len, hidden)``.
    attention_mask: ``(batch, seq_len)`` bool, True for real tokens (keys to attend to), or None.
    global_attention_mask: ``(batch, seq_len)`` bool, True for tokens with global attention, or None.
        Only modules with ``supports_global_attention = True`` accept it.
    output_attentions: also return attention probabilities (may be slower: no fused kernel).

Returns an :class:`AttentionOutput`. ``context`` is the attention result *before* the output projection
(``(batch, seq_len, hidden)``); the encoder layer owns the output projection, residual and LayerNorm, so an
attention variant is only the part that differs between architectures.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class AttentionOutput(NamedTuple):
    context: torch.Tensor
    """``(batch, seq_len, hidden)``"""
    attentions: torch.Tensor | None = None
    """Probabilities; the shape is documented by each module."""
    global_attentions: torch.Tensor | None = None
    """Probabilities of the global tokens, for modules with global attention."""


def ceil_div(size, divisor: int):
    """``ceil(size / divisor)`` for a positive ``divisor``, written ``(size + divisor - 1) // divisor`` so that a
    symbolic ``size`` traces into a correct graph: the ``-(-size // divisor)`` idiom divides a negative number, and
    ONNX's integer ``Div`` (which the ONNX exporter emits for symbolic sizes) truncates towards zero instead of
    flooring, so an exported graph would get a block count one short at lengths that need padding."""
    return (size + divisor - 1) // divisor


def cut_to_length(x: torch.Tensor, dim: int, length) -> torch.Tensor:
    """The first ``length`` entries of ``x`` along ``dim``: cuts a block-padded result back to the input length.

    Eager mode slices (a view). While ``torch.compile`` / ``torch.export`` trace, an ``index_select`` of
    ``arange(length)`` is used instead: slicing a padded length such as ``ceil(L / b) * b`` back to ``L`` makes the
    tracer try to prove ``L <= ceil(L / b) * b`` and decide whether the slice is contiguous (``L % b == 0``), which
    specialises the graph on the length; the gather needs neither. The same numbers either way.
    """
    if not torch.compiler.is_compiling():
        # Uncut inputs come back as they are (not a view): returned attention maps stay on the autograd path.
        return x if x.shape[dim] == length else x.narrow(dim, 0, length)
    return x.index_select(dim, torch.arange(length, device=x.device))


def unblock(x: torch.Tensor, length, dim: int = 1) -> torch.Tensor:
    """Blocks back in sequence order: ``x`` with ``num_blocks`` at ``dim`` and ``block`` at ``dim + 1``
    (``(..., num_blocks, block, *rest)``) -> ``(..., length, *rest)``, cut to the first ``length <= num_blocks * block``
    positions.

    Eager mode merges the two block dimensions and slices (a view where possible). While tracing, position ``t`` is
    read as ``x[..., t // block, t % block]`` instead: merging ``num_blocks`` (a ceil-division of a symbolic length)
    with the block size asks the tracer to decide ``ceil(L / b) % (ceil(L / b) * b)``, which it cannot, and slicing
    back to ``L`` to prove ``L <= ceil(L / b) * b``; ``torch.export`` then rejects a dynamic length. The same numbers
    either way.
    """
    block = x.shape[dim + 1]
    if not torch.compiler.is_compiling():
        return x.flatten(dim, dim + 1).narrow(dim, 0, length)
    position = torch.arange(length, device=x.device)
    return x[(slice(None),) * dim + (position // block, position % block)]


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(batch, seq, heads * dim)`` -> ``(batch, heads, seq, dim)``."""
    batch, seq, _ = x.shape
    return x.view(batch, seq, num_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(batch, heads, seq, dim)`` -> ``(batch, seq, heads * dim)``."""
    batch, heads, seq, dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * dim)


def plain_linears(*modules: nn.Module) -> bool:
    """True when every module is an ``nn.Linear`` as built, so its weight may be read and fused with others. A module
    that was wrapped or replaced (peft's LoRA / IA3 layers, quantised linears) or carries forward hooks computes
    something else than ``linear(x, weight, bias)``: it has to be called."""
    return all(type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks for m in modules)


class QKVProjection(nn.Module):
    """Separate query, key and value projections, named as in BERT/RoBERTa checkpoints."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({num_heads}); "
                "change one of them in the config."
            )
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)

    def fused_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query``, ``key`` and ``value`` of ``(batch, seq, hidden)`` in one matrix product, each ``(batch, seq, hidden)``.

        The same numbers as the three ``nn.Linear`` calls (to rounding), but one GEMM reads the input once, and in
        the backward pass the three input gradients come out of one product instead of being summed; the
        parameters stay the three separate, checkpoint-compatible ``Linear`` modules.
        """
        if not plain_linears(self.query, self.key, self.value):
            return self.query(hidden_states), self.key(hidden_states), self.value(hidden_states)
        weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
        biases = (self.query.bias, self.key.bias, self.value.bias)
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        return nn.functional.linear(hidden_states, weight, bias).chunk(3, dim=-1)
