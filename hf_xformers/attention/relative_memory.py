"""Transformer-XL attention: relative positional encodings over a segment plus its memory (Dai et al., 2019).

Query ``i`` of the current segment (absolute position ``i + m``, with ``m`` memory positions before the segment)
scores key ``j`` (of the ``k = m + q`` memory + segment positions) as

    score[i, j] = ((q_i + u) . k_j  +  (q_i + v) . r_{i + m - j}) / sqrt(d_head)

where ``u`` (``r_w_bias``) and ``v`` (``r_r_bias``) are the two learnt global biases (one per head) and
``r_d = W_r . sinusoid(min(d, clamp_len))`` encodes the distance ``d``. The position term is computed once per
distance, ``(q_i + v) . r`` for every ``r`` row, and moved into place by :func:`relative_shift` (the paper's
"rel_shift" trick: a zero column in front and the buffer read with shorter rows). Keys the caller does not allow (the future, and with
``same_length`` keys more than ``mem_len - 1`` positions back) are masked out.

This is not the generic ``(config, layer_idx)`` attention interface of ``attention/base.py``: it needs the
memory and the position encodings, so the Transformer-XL layer calls it directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import AttentionOutput


def sinusoid_positions(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal encodings ``(k, dim)`` of float ``distances`` ``(k,)``: ``[sin(d w), cos(d w)]`` with
    ``w_t = 10000^(-2t/dim)``, as in the original Transformer (sines first, then cosines)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, dim, 2.0, device=distances.device) / dim))
    angles = distances[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def relative_distances(query_len: int, key_len: int, clamp_len: int, device=None) -> torch.Tensor:
    """Float distances ``(key_len,)`` ``key_len - 1, ..., 1, 0``, clamped at ``clamp_len`` when it is positive.

    Row ``t`` of the position encodings is distance ``key_len - 1 - t``: the distance from the last query
    (absolute position ``key_len - 1``) to key ``t``.
    """
    # Integer arange, then float: a float step would make the traced length ceil((0 - key_len) / -1.0), which the
    # tracer cannot equate with key_len (torch.export then rejects a dynamic length).
    distances = (key_len - 1 - torch.arange(key_len, device=device)).float()
    if clamp_len > 0:
        # Longer distances than seen in training all share the encoding of clamp_len.
        distances = distances.clamp(max=clamp_len)
    return distances


def allowed_keys(query_len: int, memory_len: int, same_length: bool, mem_len: int, device=None) -> torch.Tensor:
    """Boolean ``(query_len, memory_len + query_len)``: True where query ``i`` may attend to key ``j``.

    Causal: ``j <= i + memory_len``. With ``same_length``, also ``i + memory_len - j < mem_len``, so every query
    sees the same number of keys (``mem_len``, itself included) however far into the segment it sits.
    """
    q = torch.arange(query_len, device=device)[:, None] + memory_len
    k = torch.arange(memory_len + query_len, device=device)[None, :]
    allowed = k <= q
    if same_length and mem_len > 0:
        allowed &= (q - k) < mem_len
    return allowed


def relative_shift(position_scores: torch.Tensor, memory_len: int) -> torch.Tensor:
    """Per-distance scores ``(..., q, k)`` (column ``t`` = distance ``k - 1 - t``) -> per-key scores ``(..., q, k)``.

    Query ``i`` and key ``j`` are at distance ``i + memory_len - j``, i.e. column ``q - 1 - i + j``. Future keys
    (``j > i + memory_len``) have no column; they get the score of distance 0 and must be masked by the caller.
    """
    # The paper's trick, one copy and no index tensor (a gather of a column index cost as much as both score
    # products at 512 x 1024): with a zero column in front, the row-major buffer read with rows of ``q`` instead of
    # ``k + 1`` puts column ``q - 1 - i + j`` of row ``i`` at ``(i, j)`` for every key up to the query's own
    # position; what lands on the future keys is another row's score, masked by the caller.
    # Written on the flattened rows, so that a traced graph with a dynamic length proves every reshape by arithmetic
    # alone (a (k + 1, q) view of the (q, k + 1) buffer makes the tracer guard on a divisibility of the length).
    query_len, key_len = position_scores.shape[-2:]
    flat = F.pad(position_scores, (1, 0)).flatten(-2)  # (..., q * (k + 1))
    return flat[..., query_len:].view(*position_scores.shape[:-2], query_len, key_len)


class HfxRelativeMemoryAttention(nn.Module):
    """Multi-head attention with Transformer-XL's relative positions (the formula in the module docstring).

    Owns ``qkv_net`` (fused query/key/value projection, no bias), ``r_net`` (position projection, no bias) and the
    global biases ``r_w_bias`` (u) and ``r_r_bias`` (v), ``(n_head, d_head)`` each, as in the checkpoints. The
    output projection, residual and LayerNorm belong to the layer.
    """

    def __init__(self, config, layer_idx: int | None = None) -> None:
        super().__init__()
        self.n_head, self.d_head = config.n_head, config.d_head
        inner = self.n_head * self.d_head
        self.qkv_net = nn.Linear(config.d_model, 3 * inner, bias=False)
        self.r_net = nn.Linear(config.d_model, inner, bias=False)
        self.r_w_bias = nn.Parameter(torch.zeros(self.n_head, self.d_head))
        self.r_r_bias = nn.Parameter(torch.zeros(self.n_head, self.d_head))
        self.dropatt = nn.Dropout(config.dropatt)
        self.scale = self.d_head**-0.5

    def forward(
        self,
        states: torch.Tensor,
        query_len: int,
        position_encodings: torch.Tensor,
        allowed: torch.Tensor,
        output_attentions: bool = False,
    ) -> AttentionOutput:
        """Attend from the last ``query_len`` positions of ``states`` to all of them.

        Args:
            states: ``(batch, key_len, d_model)``, memory then segment (already layer-normed in pre-LN models).
            query_len: length ``q`` of the current segment (the last ``q`` rows of ``states``).
            position_encodings: ``(key_len, d_model)`` sinusoids of :func:`relative_distances`.
            allowed: ``(q, key_len)`` bool from :func:`allowed_keys`, or ``(batch, 1, q, key_len)`` with padded keys
                masked too.
        Returns:
            An :class:`~hf_xformers.attention.base.AttentionOutput`: ``context`` ``(batch, q, n_head * d_head)`` and,
            if asked, the probabilities ``attentions`` ``(batch, n_head, q, key_len)``.
        """
        batch, key_len, _ = states.shape
        memory_len = key_len - query_len
        query, key, value = self.qkv_net(states).chunk(3, dim=-1)
        query = query[:, memory_len:]

        def heads(x: torch.Tensor) -> torch.Tensor:  # (batch, len, n_head * d_head) -> (batch, n_head, len, d_head)
            return x.view(batch, -1, self.n_head, self.d_head).transpose(1, 2)

        query, key, value = heads(query), heads(key), heads(value)
        rel = self.r_net(position_encodings).view(key_len, self.n_head, self.d_head).transpose(0, 1)  # (h, k, d)
        content = (query + self.r_w_bias[:, None, :]) @ key.transpose(-1, -2)  # (batch, h, q, k)
        position = (query + self.r_r_bias[:, None, :]) @ rel.transpose(-1, -2)[None]  # (batch, h, q, k) by distance
        scores = (content + relative_shift(position, memory_len)) * self.scale
        # Masked logits sit at the dtype's minimum. The CPU softmax of half-precision scores accumulates in float32
        # (the same probabilities as a float32 softmax rounded down), so no float32 copy of the scores is made there;
        # other devices' half-precision softmax takes its statistics in float32 explicitly.
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if scores.device.type == "cpu":
            probs = F.softmax(scores, dim=-1).to(value.dtype)
        else:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        probs = self.dropatt(probs)
        context = (probs @ value).transpose(1, 2).reshape(batch, query_len, self.n_head * self.d_head)
        return AttentionOutput(context, probs if output_attentions else None)
