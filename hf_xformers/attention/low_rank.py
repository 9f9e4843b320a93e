"""Linformer attention (Wang et al., 2020): keys and values projected along the sequence to a fixed length ``k``.

Semantics, per head, for an input of ``L <= n`` tokens (``n`` = the configured maximum length)::

    K' = E[:L]^T K        V' = F[:L]^T V          E, F: (n, k) learned, K, V: (L, d) with padded rows zeroed
    out = softmax(Q K'^T / sqrt(d)) V'            (L, k) attention instead of (L, L)

so time and memory are linear in ``L``. Details:

* Inputs shorter than ``n`` use the leading ``L`` rows of ``E`` and ``F``; an input longer than ``n`` raises a
  ``ValueError`` (``n`` comes from ``max_position_embeddings``: it is ``max_position_embeddings - pad_token_id - 1``,
  the tokens the position table serves).
* Padded positions are zeroed in ``K`` and ``V`` before the projection, so they add nothing to ``K'`` and ``V'``:
  a right-padded batch gives each example the result it gets alone.
* A projected position that no real token feeds (its columns of ``E`` and ``F`` are zero on every real position,
  e.g. the pooling blocks past the end of a short input after a conversion) holds a zero key and a zero value; it
  is masked like padding rather than left to soak up attention. With learned, dense ``E`` and ``F`` this never
  happens.
* Sharing (``config.linformer_sharing``), from the paper's section 4:

  ============  ==============================================================================
  ``none``      each head of each layer has its own ``E`` and ``F`` (``2 * heads`` matrices per layer)
  ``headwise``  one ``E`` and one ``F`` per layer, shared by its heads (fairseq's default)
  ``kv``        one matrix per layer used as both ``E`` and ``F``, shared by its heads
  ``layerwise`` one matrix for every layer, head, keys and values; the base model owns it and passes
                it to each layer's attention
  ============  ==============================================================================

Attention dropout applies to the ``(L, k)`` probabilities, as in the paper.

How it is computed: with one ``E`` (and ``F``) for all heads of a layer, the input is compressed first and the
key/value ``Linear`` layers run on the ``k`` compressed rows, ``E^T (X W^T + b) = (E^T X) W^T + (E^T 1) b``, instead
of on all ``L`` tokens (the same numbers to rounding; it saves two of the layer's four ``L x hidden x hidden``
products). Per-head matrices (``none``) project the per-head keys and values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.choices import LINFORMER_SHARING_MODES
from ..ops.attention_switch import EAGER, eager_attention
from ..ops.input_checks import is_tracing
from ..ops.kernels import attention
from ..ops.shapes import merge_heads, split_heads
from .base import AttentionOutput, HfxSelfAttention, QKVProjection, plain_linears

SHARING_MODES = LINFORMER_SHARING_MODES


def linformer_max_length(config) -> int:
    """``n``: the longest input, i.e. the tokens the RoBERTa-style position table serves."""
    return config.max_position_embeddings - config.pad_token_id - 1


class HfxSequenceProjection(nn.Module):
    """``count`` projection matrices ``(n, k)`` along the sequence (``E`` or ``F``), one per head or one shared.

    ``weight``: ``(count, n, k)``. Initialised uniformly in ``+-sqrt(3 / (n + k))`` (Xavier-uniform with gain
    ``1/sqrt(2)``, fairseq's Linformer init), which keeps projected keys and values at about the scale of a single
    key or value.
    """

    def __init__(self, max_length: int, projected_length: int, count: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, max_length, projected_length))
        self.reset_parameters()

    @property
    def init_bound(self) -> float:
        _, n, k = self.weight.shape
        return math.sqrt(3.0 / (n + k))

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.weight, -self.init_bound, self.init_bound)


class HfxLowRankSelfAttention(HfxSelfAttention, QKVProjection):
    """Linformer self-attention of one layer (module docstring for the semantics).

    Built as ``HfxLowRankSelfAttention(config, layer_idx)``; with ``linformer_sharing="layerwise"`` also pass
    ``shared_projection`` (an :class:`HfxSequenceProjection` with ``count=1`` owned by the base model; it is kept
    as a reference, not registered here, so the checkpoint holds it once).

    ``attentions`` (with ``output_attentions=True``): ``(batch, heads, seq_len, k)``, probabilities over the
    projected positions.
    """

    def __init__(self, config, layer_idx: int = 0, shared_projection: HfxSequenceProjection | None = None) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads)
        self.layer_idx = layer_idx
        self.max_length = linformer_max_length(config)
        self.projected_length = config.linformer_k
        self.sharing = config.linformer_sharing
        self.dropout_p = config.attention_probs_dropout_prob
        self.config = config  # for kernel_choice: the choice is read at every forward
        self._support_cache: tuple | None = None  # (E, F, key, support) for unpadded inputs
        n, k = self.max_length, self.projected_length
        if self.sharing == "none":
            self.key_projection = HfxSequenceProjection(n, k, count=self.num_heads)
            self.value_projection = HfxSequenceProjection(n, k, count=self.num_heads)
        elif self.sharing == "headwise":
            self.key_projection = HfxSequenceProjection(n, k)
            self.value_projection = HfxSequenceProjection(n, k)
        elif self.sharing == "kv":
            self.kv_projection = HfxSequenceProjection(n, k)
        elif self.sharing == "layerwise":
            if shared_projection is None:
                raise ValueError(
                    "linformer_sharing='layerwise' uses one projection for all layers: build the attention through "
                    "HfxLinformerModel, or pass shared_projection=HfxSequenceProjection(n, k)."
                )
            # A tuple hides the module from nn.Module's registration: the base model owns (and saves) it once.
            self._shared = (shared_projection,)
        else:
            raise ValueError(f"linformer_sharing must be one of {SHARING_MODES}, got {self.sharing!r}.")

    def projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E, F)``, each ``(count, n, k)`` with ``count`` = heads (``none``) or 1; the same tensor when shared."""
        if self.sharing in ("none", "headwise"):
            return self.key_projection.weight, self.value_projection.weight
        shared = self.kv_projection if self.sharing == "kv" else self._shared[0]
        return shared.weight, shared.weight

    def _compressed_linear(
        self, pooled: torch.Tensor, matrix: torch.Tensor, linear: nn.Linear, padding: torch.Tensor | None
    ) -> torch.Tensor:
        """``E^T (X W^T + 1 b^T)`` (padded rows zeroed) from ``pooled = E^T X``: ``(E^T X) W^T + (E^T m) b^T``.

        Associativity: the key/value ``Linear`` then runs on ``k`` compressed rows instead of ``L`` tokens, which
        removes two of the four ``(L, hidden) x (hidden, hidden)`` products of the layer's attention.

        Args:
            pooled: ``(batch, k, hidden)``, ``E^T X`` with padded rows of ``X`` zeroed.
            matrix: ``(L, k)``, the rows of ``E`` in use.
            linear: ``self.key`` or ``self.value``.
            padding: ``(batch, L)`` bool, True for real tokens, or None.

        Returns:
            ``(batch, heads, k, head_dim)``.
        """
        out = F.linear(pooled, linear.weight)
        if linear.bias is not None:
            # The bias reaches a projected position once per real token it pools: the column sums of E over them.
            weights = matrix.sum(0) if padding is None else torch.matmul(padding.to(matrix.dtype), matrix)
            # In the product's dtype: under autocast `out` is half precision, and a float32 term would promote the
            # keys (and values) to float32 while the queries stay half.
            out = out + (weights[..., None] * linear.bias).to(out.dtype)
        return split_heads(out, self.num_heads)

    def _project(self, x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """``(batch, L, hidden)`` -> ``(batch, heads, k, head_dim)`` through one matrix per head, ``(heads, L, k)``."""
        return torch.matmul(matrix.transpose(1, 2), split_heads(x, self.num_heads))

    def support_mask(self, padding: torch.Tensor | None, length: int) -> torch.Tensor:
        """``(batch or 1, count, 1, k)`` bool: True where a projected position draws on some real token (its column
        of ``E`` or of ``F`` is non-zero there). An example without any real token would have no key at all (NaN):
        its row is all True instead (it is ignored anyway). Reads no value back to the host.

        Args:
            padding: ``(batch, L)`` bool mask of real tokens, or None when there is no padding.
            length: ``L``; the first ``L`` rows of ``E`` and ``F`` are used.
        """
        key_weight, value_weight = self.projections()

        def nonzero() -> torch.Tensor:  # (count, L, k)
            return (key_weight.detach()[:, :length] != 0) | (value_weight.detach()[:, :length] != 0)

        if padding is None and is_tracing():
            # Traced graphs recompute it (a few comparisons on the (count, L, k) weights): a cache keyed by data
            # pointers and the length cannot be traced, and would specialise the graph on the length.
            support = nonzero().any(dim=1)[None, :, None, :]  # (1, count, 1, k)
        elif padding is None:
            # Depends on the weights only: cached until they change. In-place updates (optimizer steps, copy_) bump
            # ``_version``; moves and casts change ``data_ptr``; a replaced tensor fails the identity check.
            key = tuple((w.data_ptr(), w._version) for w in (key_weight, value_weight)) + (length,)
            cached = self._support_cache
            if cached is None or cached[0] is not key_weight or cached[1] is not value_weight or cached[2] != key:
                cached = (key_weight, value_weight, key, nonzero().any(dim=1)[None, :, None, :])  # (1, count, 1, k)
                self._support_cache = cached
            support = cached[3]
        else:
            real = padding[:, None, None, :].to(key_weight.dtype)
            support = torch.matmul(real, nonzero().to(key_weight.dtype)[None]) > 0
        return support | ~support.any(-1, keepdim=True)

    def attend_tokens(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        projection_support: tuple[torch.Tensor | None, ...] | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> context ``(batch, seq_len, hidden)``.

        ``attention_mask`` None means no padding. ``projection_support``: every layer's :meth:`support_mask`, or None
        where every projected position is supported, as the model works it out once per forward (None: here).
        """
        batch, length, _ = hidden_states.shape
        if length > self.max_length:
            raise ValueError(
                f"Linformer projects keys and values from at most {self.max_length} positions, got {length}. "
                "Raise config.max_position_embeddings (the projections E, F have max_position_embeddings - "
                "pad_token_id - 1 rows) or truncate the input."
            )
        # None means no padding (the model decides that once per forward). Padding is zeroed before the projection.
        padding = attention_mask
        key_weight, value_weight = self.projections()
        # One E (and F) for all heads: compress the input, then apply W_k, W_v (by linearity: only for plain Linears,
        # an adapter such as LoRA's changes what the projection computes).
        if key_weight.shape[0] == 1 and plain_linears(self.key, self.value):
            q = split_heads(self.query(hidden_states), self.num_heads)
            x = hidden_states if padding is None else hidden_states.masked_fill(~padding[..., None], 0.0)
            pooled_k = torch.matmul(key_weight[0, :length].T, x)  # (batch, k, hidden)
            pooled_v = pooled_k if value_weight is key_weight else torch.matmul(value_weight[0, :length].T, x)
            k = self._compressed_linear(pooled_k, key_weight[0, :length], self.key, padding)
            v = self._compressed_linear(pooled_v, value_weight[0, :length], self.value, padding)
        else:
            query, key, value = self.fused_qkv(hidden_states)
            q = split_heads(query, self.num_heads)
            if padding is not None:
                # Zeroed before projecting: padding must not leak into the compressed keys and values.
                pad = ~padding[..., None]
                key, value = key.masked_fill(pad, 0.0), value.masked_fill(pad, 0.0)
            k = self._project(key, key_weight[:, :length])
            v = self._project(value, value_weight[:, :length])
        if projection_support is not None:
            mask = projection_support[self.layer_idx]
        else:  # called on its own, not through the model: decide here (a host read in eager mode)
            mask = self.support_mask(padding, length)
            mask = None if not is_tracing() and bool(mask.all()) else mask
        dropout = self.dropout_p if self.training else 0.0
        if not output_attentions and self.kernel_choice(hidden_states) != EAGER:
            # SDPA itself without dropout; with dropout our kernel instead of SDPA's CPU math path (kernels.py).
            context = attention(q, k, v, mask, dropout)
            return AttentionOutput(merge_heads(context))
        context, probs = eager_attention(q, k, v, mask, dropout)
        return AttentionOutput(merge_heads(context), probs if output_attentions else None)
