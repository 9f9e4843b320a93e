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

:class:`HfxSelfAttention` holds that ``forward`` once; a variant inherits it and implements
:meth:`HfxSelfAttention.attend_tokens`, which takes the inputs it reads: the interface's (the global mask only where
``supports_global_attention``, Longformer's) and the extras its model prepares once per forward.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import nn

from ..ops.attention_switch import attention_implementation
from ..ops.sequence_parallel import SequenceShards, heads_to_tokens, tokens_to_heads
from ..ops.shapes import ceil_div, cut_to_length, merge_heads, split_heads, unblock

__all__ = [
    "AttentionOutput",
    "HfxSelfAttention",
    "KernelChoice",
    "QKVProjection",
    "plain_linears",
    # the reshapes every attention module uses, re-exported from ops/shapes.py
    "ceil_div",
    "cut_to_length",
    "merge_heads",
    "split_heads",
    "unblock",
]


class AttentionOutput(NamedTuple):
    context: torch.Tensor
    """``(batch, seq_len, hidden)``"""
    attentions: torch.Tensor | None = None
    """Probabilities; the shape is documented by each module."""
    global_attentions: torch.Tensor | None = None
    """Probabilities of the global tokens, for modules with global attention."""


class KernelChoice:
    """The one way an attention module reaches its kernel: the module keeps the ``config`` it was built from
    (``self.config``) and reads the choice at each forward with :meth:`kernel_choice`, so that
    ``model.set_attn_implementation`` applies at the next call. Nothing passes the choice down a signature; a model
    that prepares per-forward extras for its layers (FlexAttention block masks) asks one of its attention modules."""

    config: object

    def kernel_choice(self, reference: torch.Tensor) -> str:
        """``"eager"``, ``"sdpa"`` or ``"flex_attention"`` for a forward on ``reference``'s device
        (:func:`~hf_xformers.ops.attention_switch.attention_implementation`: the user's choice, or the device's
        measured default where there is none)."""
        return attention_implementation(self.config, reference.device)


class HfxSelfAttention(KernelChoice):
    """The interface's ``forward`` (module docstring), written once for every token-sequence attention variant.

    Put it first among a variant's bases (its ``forward`` must come before ``nn.Module``'s), and implement
    :meth:`attend_tokens`; a variant with global tokens sets ``supports_global_attention = True`` and takes
    ``global_attention_mask`` there as a keyword-only parameter.
    """

    supports_global_attention = False
    # The projections that read the input, one token at a time, in the order the sequence-parallel exchange carries
    # them (:meth:`attend_sequence_parallel`). A variant whose mechanism reads the input otherwise cannot take it.
    sequence_parallel_projections: tuple[str, ...] = ("query", "key", "value")
    # (first, count, all) on a sequence-parallel head shard (:meth:`head_shard`): it runs heads first .. first + count
    # of the layer's all; None on the layer itself.
    head_range: tuple[int, int, int] | None = None

    @property
    def all_heads(self) -> int:
        """The layer's number of heads (a head shard's :attr:`num_heads` is a part of them)."""
        return self.num_heads if self.head_range is None else self.head_range[2]

    def own_heads(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """``tensor``, drawn for :attr:`all_heads` along ``dim``, narrowed to this module's heads: a head shard makes
        the random draws of the whole layer (the same generator calls as one process) and keeps its heads' part."""
        if self.head_range is None:
            return tensor
        return tensor.narrow(dim, self.head_range[0], self.head_range[1])

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        *extras,
        **named_extras,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> :class:`AttentionOutput` (module docstring), through
        :meth:`attend_tokens`, which gets ``extras`` and ``named_extras`` (what the model prepared once for all
        layers) as they came, and ``global_attention_mask`` where the variant has global tokens.

        Raises:
            ValueError: a ``global_attention_mask`` given to a variant without global tokens, which cannot honour it.
        """
        shards = named_extras.pop("sequence_parallel", None)
        if self.supports_global_attention:
            named_extras["global_attention_mask"] = global_attention_mask
        elif global_attention_mask is not None:
            raise ValueError(
                f"{type(self).__name__} has no global attention (supports_global_attention is False): drop "
                "`global_attention_mask`."
            )
        if shards is not None:
            return self.attend_sequence_parallel(hidden_states, shards, attention_mask, *extras, **named_extras)
        return self.attend_tokens(hidden_states, attention_mask, output_attentions, *extras, **named_extras)

    def attend_sequence_parallel(
        self, hidden_states: torch.Tensor, shards: SequenceShards, attention_mask, *extras, **named_extras
    ) -> AttentionOutput:
        """Ulysses: this rank's tokens ``(batch, shard, hidden)`` -> their context ``(batch, shard, hidden)``, the
        mechanism run whole on ``heads / size`` heads (``ops/sequence_parallel.py``).

        Each of :attr:`sequence_parallel_projections` is applied to the rank's tokens; one all-to-all carries them to
        the rank of their heads; :meth:`head_shard` runs :meth:`attend_tokens` unchanged there, its projections
        become column selectors on what arrived (exact: a projection reads one token at a time) and the masks and
        extras are the whole sequence's, prepared once by the model; a second all-to-all brings the context back.
        """
        batch, shard = hidden_states.shape[:2]
        heads, dim = self.num_heads, self.head_dim
        names = self.sequence_parallel_projections
        parts = [self.sequence_parallel_project(name, hidden_states) for name in names]
        # A float32 part (LSH's hash input under autocast) promotes 16-bit ones, exactly; their selectors cast back.
        dtypes = [part.dtype for part in parts]
        projected = torch.cat(parts, dim=-1)
        # (batch, shard, P, heads, dim) -> (batch, shard, heads, P * dim): each head's P projections travel together.
        per_head = projected.view(batch, shard, len(names), heads, dim).transpose(2, 3).flatten(3)
        arrived = tokens_to_heads(per_head, shards.group)  # (batch, seq, heads / size, P * dim)
        length, local_heads = arrived.shape[1], arrived.shape[2]
        arrived = arrived.view(batch, length, local_heads, len(names), dim).transpose(2, 3).flatten(2)
        view = self.head_shard(shards.rank * local_heads, local_heads, dtypes)
        out = view.attend_tokens(arrived, attention_mask, False, *extras, **named_extras)
        context = heads_to_tokens(out.context.view(batch, length, local_heads, dim), shards.group)
        # The third field is the variant's own (Reformer's LSH buckets of this rank's heads, which the reversible
        # backward pass hands back to this rank's recomputation); attention probabilities are refused under SP.
        return AttentionOutput(context.reshape(batch, shard, heads * dim), None, out.global_attentions)

    def sequence_parallel_project(self, name: str, hidden_states: torch.Tensor) -> torch.Tensor:
        """Projection ``name`` of :attr:`sequence_parallel_projections` on this rank's tokens ``(batch, shard,
        hidden)`` -> ``(batch, shard, heads * head_dim)``: the submodule of that name (a variant may add others)."""
        return getattr(self, name)(hidden_states)

    def head_shard(self, first: int, count: int, dtypes: list[torch.dtype] | None = None) -> HfxSelfAttention:
        """This module restricted to heads ``first .. first + count`` of its input, the projections of
        :attr:`sequence_parallel_projections` replaced by column selectors of :meth:`attend_sequence_parallel`'s
        exchanged input (each cast to ``dtypes[i]``, its projection's dtype, when given). A view: it shares every
        parameter and buffer; a variant with per-head state (BigBird's random blocks) narrows it in
        :meth:`narrow_head_state`."""
        view = copy.copy(self)
        view._modules = dict(self._modules)
        view._buffers = dict(self._buffers)
        view.num_heads = count
        view.head_range = (first, count, self.num_heads)
        width = count * self.head_dim
        for i, name in enumerate(self.sequence_parallel_projections):
            setattr(view, name, _Columns(i * width, width, None if dtypes is None else dtypes[i]))
        view.narrow_head_state(first, count)
        return view

    def narrow_head_state(self, first: int, count: int) -> None:
        """Keep the per-head state of heads ``first .. first + count`` (on a :meth:`head_shard` view); none here."""

    def attend_tokens(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, output_attentions: bool
    ) -> AttentionOutput:
        """The variant's attention: ``hidden_states`` ``(batch, seq_len, hidden)``, ``attention_mask`` ``(batch,
        seq_len)`` bool or None, and the extras of its model (further parameters) -> :class:`AttentionOutput`."""
        raise NotImplementedError(f"{type(self).__name__} must implement attend_tokens (attention/base.py).")


class _Columns(nn.Module):
    """``x[..., start:start + width]`` in ``dtype`` (None: ``x``'s): a projection of
    :meth:`HfxSelfAttention.head_shard`, whose input already holds the projected heads."""

    def __init__(self, start: int, width: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.start, self.width, self.dtype = start, width, dtype

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        columns = hidden_states.narrow(-1, self.start, self.width)
        return columns if self.dtype is None else columns.to(self.dtype)


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
