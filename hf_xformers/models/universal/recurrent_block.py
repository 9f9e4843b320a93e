"""The Universal Transformer's shared block and the recurrence in depth that applies it (Dehghani et al., 2019).

One post-LN Transformer block (the paper's equations, which are BERT's layer):

    A = LayerNorm(x + MultiHeadSelfAttention(x))        x = state + position signal + timestep signal
    A = LayerNorm(A + MultiHeadCrossAttention(A, enc))  decoders of encoder-decoder models only
    H = LayerNorm(A + Transition(A))

is applied again and again to every position in parallel, with the same weights: a fixed number of times, or with
Adaptive Computation Time (``act.py``) deciding per position how much each step counts. Parameter names follow BERT
(``attention.self.query``, ``attention.output.dense``, ``intermediate.dense``, ``output.LayerNorm`` ...), so an
ALBERT checkpoint, whose layers share one set of weights, maps onto the block by a rename.

Transition functions (``config.transition``):

* ``"ffn"``: ``dense(act(dense(A)))`` per position.
* ``"sepconv"``: the paper's separable convolutions over the sequence, ``sepconv_k2(dropout(relu(sepconv_k1(A))))``
  (tensor2tensor's ``sepconv_relu_sepconv``: kernels 3 and 5, the first to ``intermediate_size`` channels). Each
  separable convolution is a depthwise convolution (one filter per channel) followed by a pointwise ``Linear``.
  Padding positions are zeroed before each convolution so they never leak into real ones; encoders pad "same"
  (centred window), decoders pad on the left (causal), and decoders keep the last ``k - 1`` inputs of every step in
  the cache so that generating token by token gives the same result as one pass.

Signals: the position and timestep signals are tensor2tensor's ``get_timing_signal_1d`` (sines of all timescales, then
cosines), of the position index and of the step index; both are added before every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ...attention.multi_head import HfxUniversalAttention, attention_mask_4d  # noqa: F401 (old import path)
from ...layers.encoder import HfxDenseResidual, HfxIntermediate
from ...layers.generation import HfxCache
from .adaptive_computation_time import HfxAdaptiveComputationTime, early_exit_enabled
from .configuration_universal import POSITION_EMBEDDING_TYPES, TRANSITIONS  # noqa: F401 (old import path)


def timing_signal(positions: torch.Tensor, channels: int, max_timescale: float = 1.0e4) -> torch.Tensor:
    """Sinusoidal signal of ``positions`` (any shape, integer or float) -> ``(*positions.shape, channels)`` float32.

    Channel ``i < channels // 2`` is ``sin(pos / 10000^(i / (channels // 2 - 1)))``, the next ``channels // 2`` the
    cosines of the same timescales (tensor2tensor's layout; an odd last channel is 0).
    """
    num_timescales = channels // 2
    log_increment = math.log(max_timescale) / max(num_timescales - 1, 1)
    inv_timescales = torch.exp(
        torch.arange(num_timescales, dtype=torch.float32, device=positions.device) * -log_increment
    )
    scaled = positions.to(torch.float32).unsqueeze(-1) * inv_timescales
    signal = torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1)
    return F.pad(signal, (0, channels % 2))


class HfxUniversalCache(HfxCache):
    """What a decoder needs from earlier tokens, for every recurrent step (the block is shared, its inputs are not).

    ``keys[step]`` / ``values[step]``: ``(batch, heads, seen_tokens, head_dim)`` self-attention keys and values of the
    block's input at ``step``; ``conv_tails[(step, i)]``: ``(batch, kernel_i - 1, channels)``, the last inputs of the
    ``i``-th causal separable convolution; ``cross_key_value``: the encoder states' keys and values (one pair: the
    encoder output and the shared weights are the same at every step). Filled in place by the forward pass.
    """

    batch_fields = ("keys", "values", "conv_tails", "cross_key_value")

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.conv_tails: dict[tuple[int, int], torch.Tensor] = {}
        self.cross_key_value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The number of tokens already seen."""
        return self.keys[0].shape[2] if self.keys else 0

    def update(self, step: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this call's ``keys``/``values`` ``(batch, heads, new, head_dim)`` at ``step``; returns all of them."""
        if step == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
        else:
            self.keys[step] = torch.cat([self.keys[step], keys], dim=2)
            self.values[step] = torch.cat([self.values[step], values], dim=2)
        return self.keys[step], self.values[step]


class HfxUniversalAttentionBlock(nn.Module):
    """``LayerNorm(x + dropout(dense(attention(x))))``: attention (``self``) and its output projection (``output``)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.self = HfxUniversalAttention(config)
        self.output = HfxDenseResidual(config.hidden_size, config)

    def forward(self, hidden_states: torch.Tensor, *attention_args, **attention_kwargs):
        """``hidden_states`` ``(batch, query, hidden)`` -> (the block's output, same shape, and the attention
        probabilities or None); the attention (:class:`~hf_xformers.attention.multi_head.HfxUniversalAttention`) gets
        the rest of the arguments as they came (``attention_mask``, ``key_value_states``, ``step``, ``cache``,
        ``output_attentions``, ``is_causal``)."""
        context, probs, _ = self.self(hidden_states, *attention_args, **attention_kwargs)
        return self.output(context, hidden_states), probs


class HfxSeparableConv1d(nn.Module):
    """A depthwise convolution over the sequence (``kernel_size`` taps per channel, no bias) followed by a pointwise
    ``Linear`` (with bias), as TensorFlow's ``separable_conv``. ``(batch, seq, in)`` -> ``(batch, seq, out)``.

    ``causal``: the window ends at the position itself (``k - 1`` zeros or cached inputs on the left); otherwise it
    is centred (TensorFlow "SAME": ``(k - 1) // 2`` left, ``k // 2`` right).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, causal: bool) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.causal = causal
        self.depthwise = nn.Conv1d(in_channels, in_channels, kernel_size, groups=in_channels, bias=False)
        self.pointwise = nn.Linear(in_channels, out_channels)

    def forward(
        self, x: torch.Tensor, tail: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``(batch, seq, in)``; ``tail`` ``(batch, k - 1, in)``: the inputs before ``x`` (causal only; None:
        zeros); ``document_ids`` ``(batch, seq)`` long: the documents of a packed batch (no tail), each convolved as
        if alone. Returns the output and, when causal, the new tail (the last ``k - 1`` inputs)."""
        k = self.kernel_size
        new_tail = None
        if self.causal:
            left = tail if tail is not None else x.new_zeros(x.shape[0], k - 1, x.shape[2])
            full = torch.cat([left, x], dim=1)
            new_tail = full[:, full.shape[1] - (k - 1) :]
        else:
            full = F.pad(x, (0, 0, (k - 1) // 2, k // 2))
        if document_ids is not None:
            return self.pointwise(self._within_documents(full, document_ids)), new_tail
        return self.pointwise(self.depthwise(full.transpose(1, 2)).transpose(1, 2)), new_tail

    def _within_documents(self, full: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        """The depthwise convolution of a packed row, ``full`` ``(batch, left + seq + right, in)`` (the row with its
        zero margins) -> ``(batch, seq, in)``: each tap reads a neighbour only inside the output's own document, so a
        document's edges see the zeros its solo forward pads with. ``k`` masked multiply-adds over the row: the
        convolution's own cost, whatever the number of documents."""
        k, length = self.kernel_size, document_ids.shape[1]
        left = k - 1 if self.causal else (k - 1) // 2
        # The margins hold zeros already: any label serves there.
        documents = F.pad(document_ids, (left, k - 1 - left), value=-1)
        weight = self.depthwise.weight[:, 0].to(full.dtype)  # (in, k)
        out = None
        for j in range(k):
            same = (documents[:, j : j + length] == document_ids).unsqueeze(-1)
            tap = full[:, j : j + length] * same * weight[:, j]
            out = tap if out is None else out + tap
        return out


class HfxSeparableConvTransition(nn.Module):
    """``conv2(dropout(relu(conv1(x))))``, padding zeroed before each convolution (tensor2tensor's
    ``sepconv_relu_sepconv``). ``(batch, seq, hidden)`` -> ``(batch, seq, hidden)``."""

    def __init__(self, config) -> None:
        super().__init__()
        causal = bool(config.is_decoder)
        self.conv1 = HfxSeparableConv1d(
            config.hidden_size, config.intermediate_size, config.sepconv_first_kernel_size, causal
        )
        self.conv2 = HfxSeparableConv1d(
            config.intermediate_size, config.hidden_size, config.sepconv_second_kernel_size, causal
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        nonpadding: torch.Tensor | None = None,
        step: int = 0,
        cache: HfxUniversalCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``nonpadding`` ``(batch, seq, 1)``: 1 at real positions, 0 at padding (None: no padding);
        ``document_ids`` ``(batch, seq)``: a packed batch's documents (see :class:`HfxSeparableConv1d`)."""
        h = hidden_states
        for i, conv in enumerate((self.conv1, self.conv2)):
            if i == 1:
                h = self.dropout(F.relu(h))
            if nonpadding is not None:
                h = h * nonpadding
            tail = cache.conv_tails.get((step, i)) if cache is not None else None
            h, new_tail = conv(h, tail, document_ids)
            if cache is not None and new_tail is not None:
                cache.conv_tails[(step, i)] = new_tail
        return h


class HfxResidualLayerNorm(nn.Module):
    """``LayerNorm(residual + dropout(x))``: the post-LN residual around the separable-convolution transition."""

    def __init__(self, config) -> None:
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(hidden) + residual)


class HfxUniversalLayer(GradientCheckpointingLayer):
    """The shared block: self-attention, (cross-attention), transition; each post-LN with a residual connection."""

    def __init__(self, config) -> None:
        super().__init__()
        self.attention = HfxUniversalAttentionBlock(config)
        self.crossattention = HfxUniversalAttentionBlock(config) if config.add_cross_attention else None
        self.use_sepconv = config.transition == "sepconv"
        if self.use_sepconv:
            self.transition = HfxSeparableConvTransition(config)
            self.output = HfxResidualLayerNorm(config)
        else:
            self.intermediate = HfxIntermediate(config)
            self.output = HfxDenseResidual(config.intermediate_size, config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        nonpadding: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        step: int = 0,
        past_key_values: HfxUniversalCache | None = None,
        output_attentions: bool = False,
        is_causal: bool = False,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One application of the block.

        Args:
            hidden_states: ``(batch, seq, hidden)``, the state with this step's signals added.
            attention_mask: bool ``(batch or 1, 1, seq, keys)`` (see :func:`attention_mask_4d`), a packed batch's
                :class:`~hf_xformers.ops.varlen.DocumentLayout` or None (no mask).
            is_causal: causal self-attention without a mask (``attention_mask`` None, no cached tokens).
            nonpadding: ``(batch, seq, 1)`` 1/0 mask for the separable convolutions, or None.
            encoder_hidden_states: ``(batch, src_len, hidden)`` for cross-attention (decoders of seq2seq models).
            encoder_attention_mask: bool ``(batch, 1, 1, src_len)`` or None.
            step: the recurrent step (0-based): which cache slot to read and extend.
            past_key_values: the decoder cache, extended in place, or None.
            document_ids: ``(batch, seq)`` long, a packed batch's documents (``attention_mask`` keeps the attention
                inside them): the separable convolutions stay inside each document too. None: an ordinary batch.
        Returns:
            ``(new_state, self-attention probabilities or None, cross-attention probabilities or None)``.
        """
        attended, self_probs = self.attention(
            hidden_states, attention_mask, None, step, past_key_values, output_attentions, is_causal
        )
        cross_probs = None
        if self.crossattention is not None:
            attended, cross_probs = self.crossattention(
                attended, encoder_attention_mask, encoder_hidden_states, step, past_key_values, output_attentions
            )
        if self.use_sepconv:
            transformed = self.transition(attended, nonpadding, step, past_key_values, document_ids)
        else:
            transformed = self.intermediate(attended)
        return self.output(transformed, attended), self_probs, cross_probs


class RecurrenceOutput(NamedTuple):
    last_hidden_state: torch.Tensor
    """``(batch, seq, hidden)``"""
    ponder_steps: torch.Tensor
    """``(batch, seq)`` float32: steps taken per position (0 at padding)."""
    ponder_remainders: torch.Tensor
    """``(batch, seq)`` float32: ACT remainders ``R`` (zeros in fixed-step mode)."""
    hidden_states: tuple[torch.Tensor, ...] | None
    attentions: tuple[torch.Tensor, ...] | None
    cross_attentions: tuple[torch.Tensor, ...] | None


class HfxUniversalRecurrentEncoder(nn.Module):
    """The shared :class:`HfxUniversalLayer` (``layer``) applied in depth: ``num_hidden_layers`` times, or with ACT
    (``act``, only when ``config.use_act``) for at most ``act_max_steps`` steps. Adds the signals before each step."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.layer = HfxUniversalLayer(config)
        self.act = (
            HfxAdaptiveComputationTime(config.hidden_size, config.act_epsilon, config.act_max_steps)
            if config.use_act
            else None
        )

    def _step_signals(self, position_ids: torch.Tensor, hidden_states: torch.Tensor) -> Callable:
        """``prepare(state, step)``: the state ``(batch, seq, hidden)`` with the signals of ``step`` added, the
        sinusoidal position signal of ``position_ids`` ``(batch, seq)`` and the timestep signal, as the config asks
        (each computed once per forward, in ``hidden_states``' dtype)."""
        config, dtype = self.config, hidden_states.dtype
        position_signal = None
        if config.position_embedding_type == "sinusoidal":
            position_signal = timing_signal(position_ids, config.hidden_size).to(dtype)
        step_signals = None
        if config.add_timestep_signal:
            steps = torch.arange(config.num_recurrent_steps, device=hidden_states.device)
            step_signals = timing_signal(steps, config.hidden_size).to(dtype)

        def prepare(state: torch.Tensor, step: int) -> torch.Tensor:
            if position_signal is not None:
                state = state + position_signal
            if step_signals is not None:
                state = state + step_signals[step]
            return state

        return prepare

    def forward(
        self,
        hidden_states: torch.Tensor,
        real_mask: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: HfxUniversalCache | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        is_causal: bool = False,
        padded: bool = True,
        document_ids: torch.Tensor | None = None,
    ) -> RecurrenceOutput:
        """Run the recurrence.

        Args:
            hidden_states: ``(batch, seq, hidden)`` embeddings.
            real_mask: ``(batch, seq)`` bool, False at padding (padding never runs under ACT).
            attention_mask: bool ``(batch or 1, 1, seq, keys)`` or None (no mask).
            is_causal: causal self-attention without a mask (see :class:`HfxUniversalAttention`).
            padded: whether ``real_mask`` may hold False (else the separable convolutions skip zeroing padding).
            position_ids: ``(batch, seq)`` position of each token (for the sinusoidal position signal).
            encoder_hidden_states, encoder_attention_mask, past_key_values, document_ids: see
                :class:`HfxUniversalLayer` (``position_ids`` of a packed batch restart at every document).
        Returns:
            :class:`RecurrenceOutput`; ``hidden_states`` holds the embeddings and the state after every step that ran
            (all ``act_max_steps`` of them when hidden states or attentions are asked for).
        """
        config = self.config
        prepare = self._step_signals(position_ids, hidden_states)
        nonpadding = real_mask.unsqueeze(-1).to(hidden_states.dtype) if self.layer.use_sepconv and padded else None

        def block(x: torch.Tensor, step: int) -> tuple:
            # Positional tensors: reentrant gradient checkpointing only propagates gradients through those.
            return self.layer(
                x, attention_mask, nonpadding, encoder_hidden_states, encoder_attention_mask,
                step=step, past_key_values=past_key_values, output_attentions=output_attentions, is_causal=is_causal,
                document_ids=document_ids,
            )  # fmt: skip

        all_hidden = (hidden_states,) if output_hidden_states else None
        if self.act is not None:
            # Early exit changes no output, but a cache must hold every step for the tokens still to come, and the
            # per-step outputs have a fixed length when asked for.
            stop_early = (
                past_key_values is None
                and not (output_attentions or output_hidden_states)
                and early_exit_enabled(config.act_early_exit, hidden_states.device)
            )
            out = self.act(hidden_states, real_mask, prepare, block, stop_early, output_hidden_states)
            state, steps, remainders = out.state, out.ponder_steps, out.remainders
            if output_hidden_states:
                all_hidden += out.step_states
            extras = out.step_extras
        else:
            state, extras = hidden_states, []
            for step in range(config.num_hidden_layers):
                state, *step_extras = block(prepare(state, step), step)
                extras.append(tuple(step_extras))
                if output_hidden_states:
                    all_hidden += (state,)
            steps = real_mask.float() * config.num_hidden_layers
            remainders = torch.zeros_like(steps)
        attentions = tuple(e[0] for e in extras) if output_attentions else None
        cross = tuple(e[1] for e in extras) if output_attentions and config.add_cross_attention else None
        return RecurrenceOutput(state, steps, remainders, all_hidden, attentions, cross)
