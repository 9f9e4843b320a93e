"""Performer attention: FAVOR+ (Choromanski et al., 2021), softmax attention through positive random features.

Semantics. Softmax attention ``softmax(q k^T / sqrt(d)) v`` is ``D^-1 A v`` with ``A_ij = exp(q_i . k_j / sqrt(d))``.
FAVOR+ writes ``exp(x . y) = E_w[phi(x) . phi(y)]`` with positive features (``x_hat = x * d^-1/4``)::

    phi(x)_r = m^-1/2 * exp(w_r . x_hat - |x_hat|^2 / 2)        r = 1 .. m,  w_r = rows of the projection (m, d)

and replaces ``A`` by ``phi(Q) phi(K)^T``. Never forming that ``(n, n)`` product, the output is::

    out_i = phi(q_i) . (sum_j phi(k_j) v_j^T)  /  phi(q_i) . (sum_j phi(k_j))         (bidirectional)
    out_i = the same with sums over j <= i only                                        (causal, prefix sums)

at a cost linear in the sequence length.

The pieces, one idea a file: the random features and feature maps (:mod:`~hf_xformers.attention.favor_features`),
the bidirectional sums (:mod:`~hf_xformers.attention.favor_linear`), the causal prefix sums
(:mod:`~hf_xformers.attention.favor_causal`), packed batches (:mod:`~hf_xformers.attention.favor_packed`) and
cached decoding (:mod:`~hf_xformers.attention.favor_decoding`). This module holds the layer, and
:func:`favor_attention`, which picks the form.

Precision. :func:`favor_attention` casts queries, keys, values and the projection to float32 and turns autocast off
for everything after the q/k/v projections: the projection onto the random features, the exponentials and their
stabilisers, the key-value sums (the causal prefix sums included) and the normaliser all compute in float32 under
``torch.autocast`` and with half-precision weights (under autocast a matmul would otherwise run in half precision, and
the ratio of two such sums loses about 1 % to 2 % of accuracy in bfloat16). Only the context is cast back, to the
dtype of the values. With half-precision weights the projection buffer itself holds values rounded to that dtype,
which are then used in float32.
"""

from __future__ import annotations

import torch

from ..ops.input_checks import is_tracing
from ..ops.packing import same_document
from ..ops.precision import float32_autocast_off
from ..ops.shapes import merge_heads, split_heads
from .base import AttentionOutput, HfxSelfAttention, QKVProjection
from .favor_causal import causal_linear_attention, causal_softmax_key_features
from .favor_decoding import favor_attention_with_state
from .favor_features import (
    KERNELS,
    QUERY_EPS,
    default_num_features,
    draw_key,
    relu_kernel_features,
    seeded_random_features,
    softmax_kernel_features,
    softmax_key_logits,
)
from .favor_linear import CAUSAL_CHUNK_SIZE, blocked_softmax_attention, linear_attention, rescale
from .favor_packed import FavorDocuments, as_documents, packed_linear_attention


def dense_kernel_attention(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    causal: bool = False,
    query_eps: float = 0.0,
    key_stabiliser: torch.Tensor | None = None,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The quadratic oracle of :func:`~hf_xformers.attention.favor_linear.linear_attention` /
    :func:`~hf_xformers.attention.favor_causal.causal_linear_attention` /
    :func:`~hf_xformers.attention.favor_packed.packed_linear_attention`: the same features, with the ``(seq, seq)``
    attention matrix formed explicitly (and lower-triangular when ``causal``; zero between documents when
    ``document_ids`` ``(batch, seq)``, or their :class:`~hf_xformers.attention.favor_packed.FavorDocuments`, are given).

    ``key_stabiliser`` ``(batch, heads, seq)``: per-position key stabilisers (causal only), as in
    :func:`~hf_xformers.attention.favor_causal.causal_linear_attention`.

    Returns:
        ``(out, probs)``: ``(batch, heads, seq, e)`` and ``(batch, heads, seq, seq)`` (rows sum to 1).
    """
    scores = torch.matmul(query_features + query_eps, key_features.transpose(-1, -2))
    if key_stabiliser is not None:
        scores = scores * rescale(key_stabiliser.unsqueeze(-2), key_stabiliser.unsqueeze(-1))
    if isinstance(document_ids, FavorDocuments):
        document_ids = document_ids.document_ids
    if document_ids is not None:
        scores = scores.masked_fill(~same_document(document_ids, document_ids).unsqueeze(1), 0.0)
    if causal:
        scores = scores.tril()
    total = scores.sum(-1, keepdim=True)
    probs = scores / torch.where(total > 0, total, torch.ones_like(total))
    return torch.matmul(probs, value), probs


def favor_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    projection: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
    kernel: str = "softmax",
    output_attentions: bool = False,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FAVOR+ attention of split heads.

    Everything here computes in float32 with autocast off, whatever the inputs' dtype and the autocast state: the
    feature maps (projection, exponentials, stabilisers), the key-value sums and causal prefix sums, the normaliser
    and the implied attention matrix. Only the results are cast back.

    Args:
        query, key, value: ``(batch, heads, seq, d)``, any float dtype.
        projection: ``(m, d)`` random feature rows, any float dtype (used as its float32 values).
        attention_mask: ``(batch, seq)`` bool, True for real tokens, or None when nothing is padded.
        causal: query ``i`` sees keys ``j <= i`` only.
        kernel: ``"softmax"`` (FAVOR+ positive features) or ``"relu"`` (generalized kernel).
        output_attentions: also return the implied ``(batch, heads, seq, seq)`` attention matrix (quadratic).
        chunk_size: chunk of the causal prefix sums (and of the packed forms).
        document_ids: ``(batch, seq)`` long, the document of every token of a packed batch
            (:mod:`~hf_xformers.ops.packing`), or their :class:`~hf_xformers.attention.favor_packed.FavorDocuments` for
            this ``causal`` (worked out once per forward by the model; their chunk size then counts), or None: every
            query then attends within its own document only, with that document's own stabilisers (module docstring), as
            that document's own forward would.

    Returns:
        ``(context, probs)``: context ``(batch, heads, seq, d)`` in ``value``'s dtype; probs (same dtype) or None.
    """
    if kernel not in KERNELS:
        raise ValueError(f"Unknown FAVOR kernel {kernel!r}; use one of {KERNELS} (config.favor_kernel).")
    dtype = value.dtype
    with float32_autocast_off(value.device.type):
        query, key, value, projection = (t.float() for t in (query, key, value, projection))
        context, probs = _favor_attention_float32(
            query, key, value, projection, attention_mask, causal, kernel, output_attentions, chunk_size, document_ids
        )
    return context.to(dtype), None if probs is None else probs.to(dtype)


def _favor_attention_float32(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    projection: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    kernel: str,
    output_attentions: bool,
    chunk_size: int,
    document_ids: torch.Tensor | FavorDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`favor_attention` on float32 inputs, in their dtype (the caller has turned autocast off)."""
    if isinstance(document_ids, FavorDocuments) and document_ids.spans is not None:
        if output_attentions:  # the maps of the whole row: the packed form below
            document_ids = document_ids.document_ids
        else:  # one document at a time, each its own forward's FAVOR+ (FavorDocuments.spans: the CPU in eager mode)
            return torch.cat([
                _favor_attention_float32(
                    query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], projection,
                    None if attention_mask is None else attention_mask[:, a:b], causal, kernel, False, chunk_size,
                )[0]
                for a, b in document_ids.spans
            ], dim=2), None  # fmt: skip
    # The block loop's trip count depends on the length, so traced graphs (torch.compile / torch.export) take the
    # one-shot form below: the same result to rounding, with every key feature in memory at once.
    if kernel == "softmax" and not causal and not output_attentions and document_ids is None and not is_tracing():
        return blocked_softmax_attention(query, key, value, projection, attention_mask), None
    if document_ids is not None and not output_attentions:
        document_ids = as_documents(document_ids, causal, chunk_size)  # once for the stabilisers and the sums
    ids = document_ids.document_ids if isinstance(document_ids, FavorDocuments) else document_ids
    stabiliser = None
    if kernel == "softmax":
        query_features = softmax_kernel_features(query, projection, is_query=True)
        if causal:
            logits = softmax_key_logits(key, projection, attention_mask)
            key_features, stabiliser = causal_softmax_key_features(logits, chunk_size, document_ids)
        else:
            key_features = softmax_kernel_features(
                key, projection, is_query=False, key_mask=attention_mask, document_ids=ids
            )
        eps = QUERY_EPS
    else:
        query_features = relu_kernel_features(query, projection)
        key_features = relu_kernel_features(key, projection, key_mask=attention_mask)
        eps = 0.0
    if output_attentions:
        # The context comes from the returned (implied) attention matrix, the same numbers to rounding as the linear
        # form, so that the matrix is part of the autograd graph (`retain_grad()` on it gets a gradient).
        return dense_kernel_attention(query_features, key_features, value, causal, eps, stabiliser, document_ids)
    if causal:
        return (
            causal_linear_attention(query_features, key_features, value, chunk_size, eps, stabiliser, document_ids),
            None,
        )
    if document_ids is not None:
        return packed_linear_attention(query_features, key_features, value, document_ids, chunk_size, eps), None
    return linear_attention(query_features, key_features, value, eps), None


class HfxFavorSelfAttention(HfxSelfAttention, QKVProjection):
    """FAVOR+ self-attention of one Performer layer (module docstring for the maths).

    Config fields used: ``num_random_features`` (None: ``int(d ln d)``), ``favor_kernel`` (``"softmax"`` or
    ``"relu"``), ``orthogonal_features``, ``random_feature_seed``, ``is_decoder`` (causal attention).
    ``attention_probs_dropout_prob`` is not used: the attention matrix is never formed, so there are no
    probabilities to drop.

    Buffers (saved with the checkpoint): ``projection_matrix`` ``(m, head_dim)``, and ``num_redraws``, the index of
    the current draw. Draw ``t`` of layer ``l`` is keyed by ``(random_feature_seed, l, t)``
    (:func:`~hf_xformers.attention.favor_features.draw_key`, Gaussians from the counter-based Philox-4x32-10: no
    generator, so a scheduled redraw traces): a fresh model from the same config has the same features, and only
    :meth:`redraw_projection` and :meth:`redraw_where` change them. The first draw and explicit redraws are made on
    the CPU (float32) and the buffer moves with the model, so the features are the same numbers on every device;
    ``model.to(half dtype)`` rounds them to that dtype (the attention still computes in float32), and so does
    building the model in a 16-bit dtype (``torch.set_default_dtype``, ``from_pretrained(dtype=...)``): never a 16-bit
    draw, which would be other numbers.

    ``attentions`` (with ``output_attentions=True``): the implied attention matrix ``(batch, heads, seq_len, seq_len)``
    (formed explicitly, quadratic in memory); the context is the linear-time one either way.

    FAVOR+ is its own kernel: every ``attn_implementation`` the Performer accepts (``"eager"``, ``"sdpa"``) runs it,
    so the forward reads no kernel choice; the module keeps ``config`` as every attention module does
    (:class:`~hf_xformers.attention.base.KernelChoice`), for a model that asks one of its layers.
    """

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads)
        self.config = config
        self.layer_idx = layer_idx
        self.num_features = config.num_random_features or default_num_features(self.head_dim)
        self.kernel = config.favor_kernel
        self.orthogonal = config.orthogonal_features
        self.seed = config.random_feature_seed
        self.causal = bool(getattr(config, "is_decoder", False))
        # Drawn in float32, then in the dtype the model is built in (torch.get_default_dtype(); from_pretrained sets it
        # to its `dtype`): a 16-bit model holds the float32 model's features rounded, as after `model.to(dtype)`.
        projection = self.draw_projection_matrix(0).to(torch.get_default_dtype())
        self.register_buffer("projection_matrix", projection)
        self.register_buffer("num_redraws", torch.zeros((), dtype=torch.long))

    def draw_projection_matrix(self, draw: int | torch.Tensor) -> torch.Tensor:
        """Draw number ``draw`` of this layer's ``(num_features, head_dim)`` projection, float32: on the CPU for an int
        ``draw``, on its device for a 0-dim int64 tensor (a traced redraw's counter, never read back)."""
        key = draw_key(self.seed, self.layer_idx, draw)[None]
        return seeded_random_features(self.num_features, self.head_dim, key, self.orthogonal)[0]

    def next_draw_key(self) -> torch.Tensor:
        """The key of the next draw (``num_redraws + 1``), a 0-dim int64 tensor on the buffer's device (no read)."""
        return draw_key(self.seed, self.layer_idx, self.num_redraws + 1)

    @torch.no_grad()
    def redraw_where(self, due: torch.Tensor, fresh: torch.Tensor | None = None) -> None:
        """The next draw in place where ``due`` (a 0-dim bool tensor on the buffer's device), else nothing, with no
        branch on ``due`` and no host read, so that a training step traces into one graph whatever the step
        (``torch.compile(fullgraph=True)``). ``fresh``: that draw's ``(num_features, head_dim)`` rows, made by the
        caller for all layers at once (None: drawn here, on the buffer's device)."""
        if fresh is None:
            fresh = self.draw_projection_matrix(self.num_redraws + 1)
        self.projection_matrix.copy_(torch.where(due, fresh.to(self.projection_matrix.dtype), self.projection_matrix))
        self.num_redraws.add_(due.long())

    @torch.no_grad()
    def redraw_projection(self, draw: int | None = None, fresh: torch.Tensor | None = None) -> None:
        """Replace the projection by draw number ``draw`` of this layer's sequence (in place, same device and dtype).

        The draw is made on the CPU from its seed (so it is the same numbers on every device) and copied to the
        buffer's device once.

        Args:
            draw: the draw's number; None: the next one (``num_redraws + 1``, read back from the buffer: a host
                synchronisation when the buffer is on an accelerator, which the model avoids by passing it).
            fresh: that draw's ``(num_features, head_dim)`` rows, already made (on any device), or None to make it.
        """
        if draw is None:
            draw = int(self.num_redraws) + 1
        if fresh is None:
            fresh = self.draw_projection_matrix(draw)
        self.num_redraws.fill_(draw)
        self.projection_matrix.copy_(fresh)

    def attend_tokens(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        cache=None,
        document_ids: torch.Tensor | None = None,
        favor_documents: FavorDocuments | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq, hidden)``; ``cache``: a decoding cache (causal only, the model's
        ``HfxPerformerCache``: ``states[layer_idx]`` is this layer's
        :data:`~hf_xformers.attention.favor_decoding.FavorState`, read and replaced here), or None. With a cache,
        ``seq`` is the new tokens and ``attention_mask`` their mask. ``document_ids`` ``(batch, seq)`` long: the
        documents of a packed batch (:mod:`~hf_xformers.ops.packing`), each attended within as on its own; None for an
        ordinary batch. ``favor_documents``: their layout against the chunks
        (:func:`~hf_xformers.attention.favor_packed.favor_documents`), which the model works out once per forward for
        every layer; None: worked out here from ``document_ids``."""
        if cache is not None and (document_ids is not None or favor_documents is not None):
            raise ValueError(
                "A decoding cache holds one running state per row, so it cannot follow the documents of a packed "
                "batch: decode each document in its own row (or pass use_cache=False)."
            )
        q, k, v = (split_heads(x, self.num_heads) for x in self.fused_qkv(hidden_states))
        if cache is not None:
            state = cache.states[self.layer_idx] if self.layer_idx < len(cache.states) else None
            context, state = favor_attention_with_state(
                q, k, v, self.projection_matrix, attention_mask, self.kernel, state
            )
            cache.set_state(self.layer_idx, state)
            return AttentionOutput(merge_heads(context), None)
        context, probs = favor_attention(
            q, k, v, self.projection_matrix, attention_mask, self.causal, self.kernel, output_attentions,
            document_ids=favor_documents if favor_documents is not None else document_ids,
        )  # fmt: skip
        return AttentionOutput(merge_heads(context), probs)
