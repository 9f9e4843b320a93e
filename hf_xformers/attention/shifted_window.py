"""Swin's (shifted) window self-attention with a learned relative position bias (Liu et al., 2021).

Semantics, for a feature map of ``H x W`` tokens, window ``M`` (``config.window_size``) and the layer's shift
``S`` (0 or ``M // 2``):

* **Window and shift per call** (transformers' rule, so results match its Swin): when the map is no larger than
  the window (``min(H, W) <= M``) the window becomes ``m = min(H, W)`` and the shift ``s = 0``, i.e. one window
  spans the short side and nothing is shifted; otherwise ``m = M`` and ``s = S``. ``always_partition=True`` (the
  backbone) keeps ``m = M`` and ``s = S`` whatever the size.
* **Padding instead of failing**: the map is zero-padded at the bottom/right to multiples of ``m``. Padded tokens
  are ordinary keys (zero input, so their keys/values are the projection biases) exactly as in the original
  implementation and transformers; their outputs are dropped.
* **Shift**: the padded map is rolled by ``(-s, -s)`` before being cut into ``m x m`` windows and rolled back
  afterwards. Tokens that the roll brought together from opposite borders must not see each other: each axis is
  split into three regions (``[0, P - m)``, ``[P - m, P - s)``, ``[P - s, P)`` for a padded length ``P``) and
  pairs of tokens from different regions get ``-100`` added to their score (as in the original: its weight
  ``exp(-100)`` is negligible, and the value is safe in fp16/bf16 arithmetic, unlike ``-inf``).
* **Relative position bias**: head ``h`` adds ``B[dy + M - 1, dx + M - 1, h]`` for a key ``(dy, dx)`` rows and
  columns away from the query, from a ``(2M - 1)^2 x heads`` table. A smaller window (``m < M``) reads the
  central part of the same table, so it equals the full window restricted to the tokens that exist.

How it is computed: pad, roll and window partition are one ``index_select`` with a cached token index (and
their inverse another), instead of three or four copies (``torch.roll`` over two dims alone costs over ten
copies on CPU). All windows of all images then go through one batched ``scaled_dot_product_attention`` call with
the bias and the shift mask as one additive float mask. When the bias table needs a gradient (training), an
explicit matmul-softmax-matmul path is used instead (SDPA would fall back to its slower unfused path there), and
so it is for ``output_attentions``, which returns the probabilities. Index tables and masks are made on the inputs'
device with index arithmetic (nothing on the CPU, no value read back), once per map size in eager mode.

Precision (autocast, half-precision weights): the projections and both products run in the autocast dtype. On the
explicit path the bias and shift mask stay in the bias table's dtype (float32 under autocast), so the scores they are
added to become float32, and softmax computes in float32 whatever its input; the probabilities are cast back to the
dtype of the queries for the second product. SDPA takes its mask in the queries' dtype, so there the bias is rounded
to 16 bits (bfloat16 keeps ~3 significant digits). Masking is additive with ``-100``, which every dtype represents.

This module is the ``attention.self`` of a Swin block; its constructor and ``forward`` differ from the text
attention interface (``ARCHITECTURE.md``) because a Swin stage has its own width, heads and 2-D token grid.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention_switch import EAGER, flex_applies, flex_attention
from ..ops.shapes import ceil_div
from .base import AttentionOutput, KernelChoice, QKVProjection

SHIFT_MASK_VALUE = -100.0
"""Score added between tokens of different shift regions (the original implementation's value)."""


def window_and_shift(height: int, width: int, window: int, shift: int, always_partition: bool) -> tuple[int, int]:
    """The ``(window, shift)`` a block uses on an ``height x width`` map (see the module docstring)."""
    if always_partition or min(height, width) > window:
        return window, shift
    return min(height, width), 0


@lru_cache(maxsize=64)
def window_token_indices(
    height: int, width: int, window: int, shift: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad + roll + window partition of an ``height x width`` token map, and its inverse, as two gathers (eager
    mode's cache of :func:`traced_window_token_indices`, built once per map size).

    Returns:
        ``gather`` ``(num_windows * window**2,)``: for every slot of the windows (windows in row-major order, tokens
        row-major inside each), the token it holds; padding slots hold ``height * width``, the index of a zero
        token appended to the input. ``scatter`` ``(height * width,)``: the slot of every real token. Both long,
        on ``device``.
    """
    # Index arithmetic on the target device: no CPU tensor to copy over, and no boolean indexing (whose output size
    # a GPU would have to report back to the host) even when the cache is cold.
    with torch.inference_mode(False):
        return traced_window_token_indices(height, width, window, shift, device)


def traced_window_token_indices(height, width, window: int, shift: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices of :func:`window_token_indices` from index arithmetic alone, so that symbolic ``height`` /
    ``width`` trace (torch.compile / torch.export call this directly: no cache keyed by the size, no in-place writes).

    Slot ``(window row a, window col c, row i, col j)`` of the rolled, padded ``P_h x P_w`` map holds the token at
    ``((a m + i + s) mod P_h, (c m + j + s) mod P_w)`` (``torch.roll`` by ``-s``), or the appended zero token when that
    lies in the padding; token ``(y, x)`` sits in the slot of rolled position ``((y - s) mod P_h, (x - s) mod P_w)``.
    """
    rows_of_windows, cols_of_windows = ceil_div(height, window), ceil_div(width, window)
    padded_h, padded_w = rows_of_windows * window, cols_of_windows * window
    # The wrap-arounds are written as one conditional subtraction / addition (every value is within one period):
    # a modulo by a symbolic size does not convert to ONNX.
    inner = torch.arange(window, device=device)
    y = torch.arange(rows_of_windows, device=device)[:, None] * window + inner + shift  # (a, i)
    x = torch.arange(cols_of_windows, device=device)[:, None] * window + inner + shift  # (c, j)
    y, x = torch.where(y >= padded_h, y - padded_h, y), torch.where(x >= padded_w, x - padded_w, x)
    y, x = y[:, None, :, None], x[None, :, None, :]  # slots in (a, c, i, j) order
    real = (y < height) & (x < width)
    gather = torch.where(real, y * width + x, height * width).flatten()
    ry = torch.arange(height, device=device) - shift
    rx = torch.arange(width, device=device) - shift
    ry, rx = torch.where(ry < 0, ry + padded_h, ry), torch.where(rx < 0, rx + padded_w, rx)
    window_index = (ry // window)[:, None] * cols_of_windows + (rx // window)[None, :]
    scatter = window_index * (window * window) + (ry % window)[:, None] * window + (rx % window)[None, :]
    return gather, scatter.flatten()


@lru_cache(maxsize=64)
def relative_position_index(window: int, table_window: int, device: torch.device) -> torch.Tensor:
    """Cached :func:`relative_position_index_uncached` (eager mode)."""
    # Cached tensors must not be inference tensors: one made under inference_mode cannot be used for autograd later.
    with torch.inference_mode(False):
        return relative_position_index_uncached(window, table_window, device)


def relative_position_index_uncached(window: int, table_window: int, device: torch.device) -> torch.Tensor:
    """Row of the bias table for every (query, key) pair of a ``window x window`` window.

    The table covers offsets of a ``table_window`` window: row ``(dy + T - 1) * (2T - 1) + (dx + T - 1)``.

    Returns:
        ``(window**2 * window**2,)`` long, flattened ``(query, key)``.
    """
    side = torch.arange(window, device=device)
    coords = torch.stack(torch.meshgrid(side, side, indexing="ij")).flatten(1)
    offsets = coords[:, :, None] - coords[:, None, :] + (table_window - 1)  # (2, N, N), in [0, 2T - 2]
    return (offsets[0] * (2 * table_window - 1) + offsets[1]).flatten()


@lru_cache(maxsize=64)
def shifted_window_mask(height: int, width: int, window: int, shift: int, device: torch.device) -> torch.Tensor:
    """Cached :func:`shifted_window_mask_uncached` (eager mode)."""
    with torch.inference_mode(False):
        return shifted_window_mask_uncached(height, width, window, shift, device)


def shifted_window_mask_uncached(height, width, window: int, shift: int, device) -> torch.Tensor:
    """Additive mask that keeps rolled-together regions apart, for a padded ``height x width`` map (multiples of
    ``window``; symbolic sizes trace).

    Returns:
        ``(num_windows, window**2, window**2)`` float32: 0 within a region, :data:`SHIFT_MASK_VALUE` across.
    """

    def regions(length, blocks) -> torch.Tensor:  # (blocks, window): region id of each row, per window row
        idx = torch.arange(blocks, device=device)[:, None] * window + torch.arange(window, device=device)
        return (idx >= length - window).long() + (idx >= length - shift).long()

    # Region ids in window order, (windows along H, windows along W, window, window) -> (num_windows, N).
    rows, cols = regions(height, height // window), regions(width, width // window)
    region = (rows[:, None, :, None] * 3 + cols[None, :, None, :]).flatten(0, 1).flatten(1)
    different = region[:, :, None] != region[:, None, :]
    return torch.where(different, SHIFT_MASK_VALUE, 0.0).to(torch.float32)


class HfxShiftedWindowSelfAttention(KernelChoice, QKVProjection):
    """Multi-head self-attention inside (shifted) ``window x window`` windows of a 2-D token map.

    Parameters (names as in Swin checkpoints): ``query``, ``key``, ``value`` (``dim -> dim``) and
    ``relative_position_bias_table`` ``((2 * window_size - 1)**2, num_heads)``.

    Args:
        config: the model's config: ``window_size`` (the window side ``M``), ``qkv_bias`` (biases on
            ``query``/``key``/``value``), ``attention_probs_dropout_prob`` (dropout on the probabilities, training
            only); kept, so that the kernel choice (``config._attn_implementation``) is read at every forward.
        dim: channels of the stage.
        num_heads: attention heads (``dim`` must be a multiple).
        shift_size: ``0`` (W-MSA) or ``M // 2`` (SW-MSA), used when the map is larger than the window.
    """

    supports_global_attention = False

    def __init__(self, config, dim: int, num_heads: int, shift_size: int = 0) -> None:
        super().__init__(dim, num_heads)
        if not config.qkv_bias:  # all three or none: fused_qkv needs them alike
            for proj in (self.query, self.key, self.value):
                proj.register_parameter("bias", None)
        self.config = config
        self.window_size = config.window_size
        self.shift_size = shift_size
        self.dropout_p = config.attention_probs_dropout_prob
        self.scale = self.head_dim**-0.5
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * self.window_size - 1) ** 2, num_heads))

    def relative_position_bias(self, window: int) -> torch.Tensor:
        """``(num_heads, window**2, window**2)``: the bias of every (query, key) pair of a ``window`` window."""
        device = self.relative_position_bias_table.device
        if torch.compiler.is_compiling():  # traced graphs build the (constant) index inline: no Python cache
            index = relative_position_index_uncached(window, self.window_size, device)
        else:
            index = relative_position_index(window, self.window_size, device)
        n = window * window
        # Contiguous: SDPA reads a contiguous mask measurably faster than this permuted view (and it is small).
        return self.relative_position_bias_table[index].view(n, n, -1).permute(2, 0, 1).contiguous()

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_dimensions: tuple[int, int],
        always_partition: bool = False,
        output_attentions: bool = False,
    ) -> AttentionOutput:
        """Attend within windows, with the kernel ``config._attn_implementation`` chooses: ``"eager"`` the explicit
        softmax, ``"sdpa"`` SDPA, ``"flex_attention"`` FlexAttention with the bias and the shift mask as its
        ``score_mod``.

        Args:
            hidden_states: ``(batch, H * W, dim)``, already normalised, tokens in row-major order.
            input_dimensions: ``(H, W)``.
            always_partition: keep the configured window and shift even on maps no larger than the window.
            output_attentions: also return the probabilities (explicit softmax instead of SDPA).

        Returns:
            :class:`AttentionOutput` with ``context`` ``(batch, H * W, dim)`` (before the output projection) and,
            when asked, ``attentions`` ``(batch * num_windows, num_heads, m**2, m**2)``.
        """
        implementation = self.kernel_choice(hidden_states)
        batch, _, channels = hidden_states.shape
        height, width = input_dimensions
        window, shift = window_and_shift(height, width, self.window_size, self.shift_size, always_partition)
        # Ceil-divisions written so that symbolic sizes trace (torch.compile / torch.export with dynamic H, W).
        padded_h, padded_w = ceil_div(height, window) * window, ceil_div(width, window) * window
        num_windows = (padded_h // window) * (padded_w // window)
        q, k, v, scatter = self._window_qkv(hidden_states, (height, width), (padded_h, padded_w), window, shift)
        shift_mask = None
        if shift:
            make_mask = shifted_window_mask_uncached if torch.compiler.is_compiling() else shifted_window_mask
            shift_mask = make_mask(padded_h, padded_w, window, shift, q.device)  # (windows, N, N)
        # One additive mask: bias (1, heads, N, N) [+ shift mask (windows, 1, N, N) -> (windows, heads, N, N)], in
        # the bias table's dtype (float32 unless the weights are half precision).
        mask = self.relative_position_bias(window).unsqueeze(0)
        if shift:
            mask = mask + shift_mask.to(mask.dtype).unsqueeze(1)

        # SDPA's fused CPU kernel cannot return a gradient for the mask; when the bias table needs one, torch runs
        # its unfused math path instead, which the explicit path beats (measured ~10 % on Swin-T shapes).
        probs = None
        if not output_attentions and flex_applies(implementation, q, self.training, self.dropout_p):
            context = self._flex_windows(q, k, v, window, shift_mask, num_windows)
        elif output_attentions or implementation == EAGER or (mask.requires_grad and torch.is_grad_enabled()):
            context, probs = self._explicit_windows(q, k, v, mask, batch, num_windows)
        else:
            context = self._sdpa_windows(q, k, v, mask, batch, num_windows, shift)

        # (batch * windows, heads, N, head_dim) -> (batch, windows * N, dim) -> the real tokens in map order.
        n = window * window
        context = context.reshape(-1, self.num_heads, n, self.head_dim).transpose(1, 2).reshape(batch, -1, channels)
        context = context.index_select(1, scatter)
        return AttentionOutput(context, probs if output_attentions else None)

    def _window_qkv(
        self, hidden_states: torch.Tensor, size: tuple, padded_size: tuple, window: int, shift: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad, roll and cut ``hidden_states`` ``(batch, H * W, dim)`` (``size`` ``(H, W)``, padded to ``padded_size``)
        into windows (one gather) and project them: ``q``, ``k``, ``v`` each ``(batch * num_windows, heads, N,
        head_dim)`` with ``N = window**2``, and the ``scatter`` index that puts the windows' tokens back in map order
        (:func:`window_token_indices`)."""
        (height, width), (padded_h, padded_w) = size, padded_size
        tracing = torch.compiler.is_compiling()
        if tracing:
            gather, scatter = traced_window_token_indices(height, width, window, shift, hidden_states.device)
        else:
            gather, scatter = window_token_indices(height, width, window, shift, hidden_states.device)
        x = hidden_states
        if tracing or padded_h * padded_w > height * width:  # padding slots read this appended zero token
            x = F.pad(x, (0, 0, 0, 1))
        n = window * window
        windows = x.index_select(1, gather).view(-1, n, hidden_states.shape[-1])  # (batch * num_windows, N, dim)
        q, k, v = (t.view(-1, n, self.num_heads, self.head_dim).transpose(1, 2) for t in self.fused_qkv(windows))
        return q, k, v, scatter

    def _flex_windows(self, q, k, v, window: int, shift_mask: torch.Tensor | None, num_windows) -> torch.Tensor:
        """FlexAttention over the windows, the bias and ``shift_mask`` ``(num_windows, N, N)`` (or None) added per
        score: ``(batch * num_windows, heads, N, head_dim)``."""
        bias = self.relative_position_bias(window)  # (heads, N, N)
        shift_mask = shift_mask.to(bias.dtype) if shift_mask is not None else None

        def window_scores(score, b, h, q_idx, kv_idx):
            # b runs over (batch * windows), window-major within each image
            score = score + bias[h, q_idx, kv_idx]
            if shift_mask is not None:
                score = score + shift_mask[b % num_windows, q_idx, kv_idx]
            return score

        return flex_attention(q, k, v, score_mod=window_scores, scale=self.scale)

    def _explicit_windows(
        self, q, k, v, mask: torch.Tensor, batch: int, num_windows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The explicit softmax over the windows with the additive ``mask`` ``(windows or 1, heads, N, N)``: the
        context ``(batch, num_windows, heads, N, head_dim)`` and the probabilities ``(batch * num_windows, heads, N,
        N)``."""
        n, dropout = q.shape[2], self.dropout_p if self.training else 0.0
        # Scores as (batch, windows, heads, N, N): the mask broadcasts over images instead of being copied.
        q, k, v = (t.view(batch, num_windows, self.num_heads, n, self.head_dim) for t in (q, k, v))
        # Under autocast q and k are 16-bit and so is their product; adding the float32 mask promotes the scores
        # to float32 (as in the original and transformers), so the bias is not rounded to 16 bits. Softmax
        # computes in float32 and its probabilities come back in q's dtype, so the second product runs in the
        # same dtype as the first (on CUDA autocast would cast them there anyway).
        scores = torch.matmul(q * self.scale, k.transpose(-1, -2)) + mask
        # The returned (batch * windows, heads, N, N) probabilities are the tensor the context is computed from
        # (through a view), so they are part of the autograd graph: `retain_grad()` on them gets a gradient.
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).flatten(0, 1)
        weights = probs.view(batch, num_windows, self.num_heads, n, n)
        return torch.matmul(F.dropout(weights, dropout, True) if dropout else weights, v), probs

    def _sdpa_windows(self, q, k, v, mask: torch.Tensor, batch: int, num_windows, shift: int) -> torch.Tensor:
        """SDPA over the windows with the additive ``mask`` ``(windows or 1, heads, N, N)``:
        ``(batch * num_windows, heads, N, head_dim)``."""
        n, dropout = q.shape[2], self.dropout_p if self.training else 0.0
        # SDPA takes a float mask in the query's dtype only (16-bit under autocast: the bias is rounded there).
        mask = mask.to(q.dtype)
        if shift:  # SDPA needs a mask broadcastable to its 4-D (batch * windows, heads, N, N) problem
            mask = mask.expand(batch, -1, -1, -1, -1).reshape(batch * num_windows, self.num_heads, n, n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale)
