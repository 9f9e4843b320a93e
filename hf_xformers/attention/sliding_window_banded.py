"""Longformer's local attention block by block: the sliding window (plus the global keys) as many small dense problems.

Queries are cut into blocks of ``b`` tokens (``b = w``, or ``w / 4`` for windows of 64 and more). A block only needs
the ``b + 2w`` keys around it, so each block is one small dense attention problem, and all blocks go through one
batched call of ``ops/kernels.attention`` (PyTorch's fused ``scaled_dot_product_attention``) with an additive band
mask. The key neighbourhoods are overlapping *views* of the key/value tensors (``unfold``, :func:`neighbourhoods`),
not copies; there are no overlapping-chunk products and no ``(seq, 2w + 1)`` score tensor in memory. A packed batch
adds its document condition in the same layouts: the documents of the key neighbourhoods are ``unfold`` views of
``document_ids`` like the keys themselves, so the mask stays the size of the band. Inference over long inputs goes a
chunk of blocks at a time (:data:`LOCAL_CHUNK_TOKENS`); ``output_attentions`` returns the probabilities in
transformers' band layout.

:class:`BandedAttention` holds these paths as methods of
:class:`~hf_xformers.attention.sliding_window.HfxSlidingWindowSelfAttention` (a packed batch with global tokens
continues in ``attention/sliding_window_packed.py``); the functions above it reshape blocks so that they trace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..ops.input_checks import is_tracing
from ..ops.kernels import attention
from ..ops.precision import is_half_precision
from ..ops.shapes import ceil_div, cut_to_length, unblock

# Queries per chunk of Longformer's banded attention without gradients (``_chunked_banded_attention``): at base width
# the chunk's float32 scores are ~110 MB, and the chunks are still large enough to keep the products efficient.
LOCAL_CHUNK_TOKENS = 4096


def neighbourhoods(x: torch.Tensor, span: int, step: int) -> torch.Tensor:
    """Overlapping windows of ``span`` rows every ``step`` rows along dim 1, as a view (no copy).

    Args:
        x: ``(batch, length, *rest)``.
    Returns:
        ``(batch, (length - span) // step + 1, span, *rest)``.
    """
    return x.unfold(1, span, step).movedim(-1, 2)


class BlockWindows(torch.autograd.Function):
    """The key (or value) neighbourhoods of the query blocks as one contiguous head-major tensor, with optional
    global rows in front of every block's window, for training in half precision.

    The ``unfold`` views serve float32, whose per-head products take any strides; in half precision the products need
    plain operands, so the attention kernel would copy the windows anyway, and autograd's ``unfold_backward`` (the
    gradient of overlapping views, a scatter) cost more than the window products themselves (8 % of a bf16 training
    step at 4k tokens). Here a window of ``s`` whole blocks is copied block by block, and its gradient is ``s``
    block-shifted additions.

    ``x`` ``(batch, (nb + s - 1) * b, heads, dim)``, ``extra`` ``(batch, G, heads, dim)`` or None ->
    ``(batch * nb, heads, G + s * b, dim)``, a view of a contiguous ``(heads, batch * nb, G + s * b, dim)``.
    """

    @staticmethod
    def forward(ctx, x, extra, b, s):  # noqa: D102
        batch, rows, heads, dim = x.shape
        nb, num_extra = rows // b - s + 1, 0 if extra is None else extra.shape[1]
        out = x.new_empty(heads, batch, nb, num_extra + s * b, dim)
        # Head-major first (one transposing copy), so that the s block copies move whole (b, dim) blocks.
        blocks = x.permute(2, 0, 1, 3).contiguous().view(heads, batch, rows // b, b, dim)
        for j in range(s):
            out[:, :, :, num_extra + j * b : num_extra + (j + 1) * b] = blocks[:, :, j : j + nb]
        if num_extra:
            out[:, :, :, :num_extra] = extra.permute(2, 0, 1, 3)[:, :, None]
        ctx.sizes = (batch, rows, heads, dim, nb, num_extra, b, s)
        return out.view(heads, batch * nb, num_extra + s * b, dim).transpose(0, 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        batch, rows, heads, dim, nb, num_extra, b, s = ctx.sizes
        grad = grad.transpose(0, 1).reshape(heads, batch, nb, num_extra + s * b, dim)
        summed = grad.new_zeros(heads, batch, rows // b, b, dim)
        for j in range(s):
            # add_ on the view (``+=`` on an index would also copy the view onto itself)
            summed[:, :, j : j + nb].add_(grad[:, :, :, num_extra + j * b : num_extra + (j + 1) * b])
        grad_x = summed.view(heads, batch, rows, dim).permute(1, 2, 0, 3)
        grad_extra = grad[:, :, :, :num_extra].sum(2).permute(1, 2, 0, 3) if num_extra else None
        return grad_x, grad_extra, None, None


def globals_in_front(windows: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The global rows in front of every block's window: ``windows`` ``(batch, n, heads, span, dim)``, ``extra``
    ``(batch, G, heads, dim)`` or None -> ``(batch, n, heads, G + span, dim)`` (``windows`` itself for None)."""
    if extra is None:
        return windows
    batch, n, heads, _, dim = windows.shape
    return torch.cat([extra.transpose(1, 2)[:, None].expand(batch, n, heads, extra.shape[1], dim), windows], dim=3)


def block_windows(x: torch.Tensor, span: int, b: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The ``span``-row key (or value) neighbourhood of every ``b``-query block, ``x`` ``(batch, nb * b + span - b,
    heads, dim)`` -> ``(batch * nb, heads, span, dim)``, with the ``extra`` ``(batch, G, heads, dim)`` global rows in
    front of every block's window (``G + span`` rows) when given.

    Views (:func:`neighbourhoods`; the global rows are concatenated) in float32, in inference and while tracing;
    :class:`BlockWindows` when a half-precision gradient is recorded and the window is whole blocks.
    """
    if (
        is_half_precision(x.dtype)
        and torch.is_grad_enabled()
        and x.requires_grad
        and span % b == 0
        and not is_tracing()
    ):
        return BlockWindows.apply(x, extra, b, span // b)
    return fold_blocks(globals_in_front(neighbourhoods(x, span, b).permute(0, 1, 3, 2, 4), extra))


def fold_blocks(x: torch.Tensor) -> torch.Tensor:
    """The blocks of every example as one batch dimension: ``(batch, nb, *rest)`` -> ``(batch * nb, *rest)``.

    Eager mode reshapes (a view where the strides allow it; the overlapping key neighbourhoods of several examples are
    copied). While tracing, a reshape that merges a *static* batch size ``B`` with the block count ``nb = ceil(L / b)``
    of a symbolic length makes the tracer decide ``B % (B * nb) != 0`` (true for every ``nb >= 2``, but it cannot
    bound a floor division), which ``torch.export`` rejects as a guard on the length (with a dynamic batch the guard
    is on two symbols, which export does not check). So one static example is selected (a view, as in eager mode),
    and anything else is made contiguous and viewed through one flat dimension: flattening needs no check, and
    splitting the flat dimension only divisibility that the tracer proves. The same numbers either way.
    """
    if not torch.compiler.is_compiling():
        return x.reshape(-1, *x.shape[2:])
    if isinstance(x.shape[0], int) and x.shape[0] == 1:
        return x[0]
    return x.contiguous().view(-1).view(x.shape[0] * x.shape[1], *x.shape[2:])


def block_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` ``(n, heads, rows, k)`` @ ``b`` ``(n, heads, k, cols)`` -> ``(n, heads, rows, cols)``, ``n = batch * nb``.

    ``torch.matmul`` merges ``n`` with ``heads`` for its batched product, the reshape :func:`fold_blocks` describes
    (``nb % (heads * nb)`` for one example); while tracing both sides are folded first with its flat view.
    """
    if not torch.compiler.is_compiling():
        return torch.matmul(a, b)
    return torch.bmm(fold_blocks(a), fold_blocks(b)).view(*a.shape[:-1], b.shape[-1])


def project_rows(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear`` applied to ``x`` ``(batch, n, hidden)`` -> ``(batch, n, out)``, where ``n`` is block-rounded.

    A 3-D input makes ``F.linear`` merge ``batch`` with ``n`` for its matrix product; with ``n = nb * b`` that is the
    reshape :func:`fold_blocks` describes. While tracing the rows are folded to 2-D first, with the guard-free flat
    view; eager mode calls the module on ``x`` as it is (the same kernels, hence the same numbers, as before).
    """
    if not torch.compiler.is_compiling():
        return linear(x)
    return linear(fold_blocks(x)).view(x.shape[0], x.shape[1], -1)


class BandedAttention:
    """The banded paths of :class:`~hf_xformers.attention.sliding_window.HfxSlidingWindowSelfAttention`, a mixin of
    that module: its methods read the module's ``query`` / ``key`` / ``value`` projections, ``num_heads``,
    ``head_dim``, ``one_sided_window`` (``w``), ``query_block`` (``b``), ``dropout_p`` and ``training``."""

    def _banded_attention(
        self, hidden_states, attention_mask, is_global, global_idx, global_valid, output_attentions, document_ids=None,
        packed_globals=None, return_probs=True,
    ):  # fmt: skip
        """Sliding-window attention (plus global keys) computed block by block.

        Shapes inside: ``nb`` blocks of ``b`` queries (``b = self.query_block``); each block sees the
        ``span = b + 2w`` local keys around it and ``G`` global keys. ``document_ids`` ``(batch, seq_len)`` (a packed
        batch) masks every key of another document, in the same block layout; with global tokens
        (``packed_globals``) a block sees only the ``W`` global slots of the documents it touches instead of all
        ``G`` (``_packed_banded_attention``, ``attention/sliding_window_packed.py``). ``output_attentions`` selects the
        explicit softmax; ``return_probs`` False lets a packed batch with global tokens skip the band layout of the
        probabilities (nobody asked for them). Returns the context ``(batch, seq_len, hidden)`` and the
        probabilities ``(batch, heads, seq_len, G + 2w + 1)`` or None.
        """
        batch, length = hidden_states.shape[:2]
        hidden = self.num_heads * self.head_dim  # the context's width (a sequence-parallel input is wider)
        heads, dim, w, b = self.num_heads, self.head_dim, self.one_sided_window, self.query_block
        nb = ceil_div(length, b)
        if is_tracing():
            # A traced graph is specialised on more than one query block: the tracer's contiguity checks of the block
            # views ask whether nb == 1, a guard that torch.export cannot turn into a bound on the length. Asked here
            # first as nb >= 2 (a guard, not a check: torch.compile retraces a single-block input), the bound is
            # what export suggests for a Dim that starts lower (min = b + 1).
            bool(nb >= 2)
        span = b + 2 * w
        q, k, v = self._padded_projections(hidden_states, nb)
        # (batch * nb, heads, b, dim) queries and (batch * nb, heads, span, dim) keys/values: views of q, k and v,
        # except the overlapping key/value neighbourhoods of several examples (no single stride steps over both).
        qb = fold_blocks(q.view(batch, nb, b, heads, dim).permute(0, 1, 3, 2, 4))
        # Global keys and values come in front of the windows (when there are any and the batch is not packed).
        gk = gv = None
        if is_global is not None and packed_globals is None:
            position = (global_idx + w)[..., None, None].expand(-1, -1, heads, dim)
            gk, gv = k.gather(1, position), v.gather(1, position)  # (batch, G, heads, dim)
        # Inference over more blocks than one chunk: the blocks go through attention a chunk at a time
        # (:meth:`_chunked_banded_attention`), so that neither the windows nor the scores exist for all blocks at once.
        chunked = (
            not output_attentions and packed_globals is None and not is_tracing() and nb > LOCAL_CHUNK_TOKENS // b
            and not (torch.is_grad_enabled() and hidden_states.requires_grad)
        )  # fmt: skip
        if not chunked:
            kb, vb = block_windows(k, span, b, gk), block_windows(v, span, b, gv)
        bias, query_docs, query_pad = self._band_bias(hidden_states, attention_mask, is_global, document_ids, qb.dtype)
        if packed_globals is not None:
            return self._packed_banded_attention(
                qb, kb, vb, bias, query_docs, query_pad, k, v, is_global, global_idx, packed_globals,
                output_attentions, return_probs, length,
            )  # fmt: skip
        global_bias = None  # (batch, nb, 1, b, G): the global columns of the bias
        if is_global is not None:
            neg_inf = torch.tensor(float("-inf"), dtype=qb.dtype, device=qb.device)
            global_bias = torch.where(global_valid, 0.0, neg_inf)[:, None, None, None, :].expand(-1, nb, 1, b, -1)
        if chunked:
            out = self._chunked_banded_attention(q, k, v, bias.view(batch, nb, 1, b, span), gk, gv, global_bias)
            return unblock(out.transpose(2, 3), length).reshape(batch, length, hidden), None
        if global_bias is not None:
            bias = torch.cat([fold_blocks(global_bias), bias], -1)
        if not output_attentions:
            out = attention(qb, kb, vb, bias, self.dropout_p if self.training else 0.0)
            out = out.view(batch, nb, heads, b, dim).transpose(2, 3)  # (batch, nb, b, heads, dim)
            return unblock(out, length).reshape(batch, length, hidden), None
        scores = block_matmul(qb, kb.transpose(-1, -2)) * dim**-0.5 + bias
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).masked_fill(query_pad, 0.0).to(q.dtype)
        return self._band_probs_and_context(weights, v, is_global, global_idx, nb, length)

    def _padded_projections(self, hidden_states: torch.Tensor, nb: int) -> tuple[torch.Tensor, ...]:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> the queries ``(batch, nb * b, hidden)`` of ``nb`` whole
        blocks, and the keys and values ``(batch, nb * b + 2w, heads, dim)`` with ``w`` rows of padding in front."""
        batch, length, _ = hidden_states.shape
        heads, dim, w, b = self.num_heads, self.head_dim, self.one_sided_window, self.query_block
        # w rows of padding before and w (plus the tail to a whole block) after: every query block then has
        # its full neighbourhood, and the padded keys are masked (_band_bias). Projecting the padding costs 2w rows,
        # cheaper than padding q, k and v separately.
        padded = F.pad(hidden_states, (0, 0, w, w + nb * b - length))
        k = self.key(padded).view(batch, nb * b + 2 * w, heads, dim)
        v = self.value(padded).view(batch, nb * b + 2 * w, heads, dim)
        q = project_rows(self.query, padded[:, w : w + nb * b])
        return q, k, v

    def _band_bias(
        self, hidden_states, attention_mask, is_global, document_ids, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The additive mask of the local problems of ``hidden_states`` ``(batch, seq_len, hidden)``, ``(batch * nb,
        1, b, span)`` in ``dtype``: 0 where a query may look, -inf elsewhere. ``attention_mask`` / ``is_global``
        ``(batch, seq_len)`` bool or None; ``document_ids`` ``(batch, seq_len)`` or None. Also returns the queries'
        documents ``(batch, nb, b)`` (None without ``document_ids``) and the padding queries ``(batch * nb, 1, b, 1)``
        bool."""
        real = (
            attention_mask if attention_mask is not None else torch.ones_like(hidden_states[..., 0], dtype=torch.bool)
        )
        (batch, length), w, b = real.shape, self.one_sided_window, self.query_block
        nb, span = ceil_div(length, b), b + 2 * w
        # A band |offset| <= w (key column c of block-local query row r sits at offset c - w - r) and real,
        # non-global local keys (global keys come in through the global slots instead). Built in two broadcast adds:
        # it is rebuilt in every layer and is as large as the score matrix, so every extra pass over it shows in the
        # timings.
        local_key = real if is_global is None else real & ~is_global
        local_key = F.pad(local_key, (w, w + nb * b - length), value=False)
        neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=real.device)
        key_bias = fold_blocks(torch.where(neighbourhoods(local_key, span, b), 0.0, neg_inf)[:, :, None, None])
        offset = torch.arange(span, device=real.device)[None, :] - w - torch.arange(b, device=real.device)[:, None]
        bias = key_bias + torch.where(offset.abs() <= w, 0.0, neg_inf)
        query_docs = None
        if document_ids is not None:
            # The key neighbourhoods' documents, unfolded exactly as the keys are: (batch, nb, span) against the
            # (batch, nb, b) queries' (the padding, -1, is masked as padding already).
            docs = F.pad(document_ids, (w, w + nb * b - length), value=-1)
            query_docs = docs[:, w : w + nb * b].view(batch, nb, b)
            same = query_docs[..., None] == neighbourhoods(docs, span, b)[:, :, None, :]
            bias = bias.masked_fill(~fold_blocks(same[:, :, None]), float("-inf"))
        # A padding query can be left with no key at all (NaN); let it see its whole neighbourhood instead,
        # its output is zeroed later. A packed batch always does it, whatever its length (one more operator when the
        # length is a multiple of the block), so that its step launches the same kernels for every row length.
        query_pad = fold_blocks(~F.pad(real, (0, nb * b - length), value=False).view(batch, nb, 1, b, 1))
        if attention_mask is not None or document_ids is not None or is_tracing() or nb * b != length:
            bias.masked_fill_(query_pad, 0.0)
        return bias, query_docs, query_pad

    def _band_probs_and_context(self, weights, v, is_global, global_idx, nb: int, length: int):
        """The explicit path's probabilities in the band layout ``(batch, heads, seq_len, G + 2w + 1)`` (global
        columns first, then offsets ``-w .. w``) from the block weights ``(batch * nb, heads, b, G + span)``, and the
        context ``(batch, seq_len, hidden)`` computed from them, so that the returned probabilities are part of the
        autograd graph. ``v``: the padded values ``(batch, nb * b + 2w, heads, dim)``."""
        batch, heads, dim, w = v.shape[0], self.num_heads, self.head_dim, self.one_sided_window
        num_global = 0 if is_global is None else global_idx.shape[1]
        probs = self._to_band_layout(weights, batch, nb, num_global, length)
        if is_global is not None:
            # A global token's local row is not used (its output comes from global attention): zero it.
            probs = probs.masked_fill(is_global[:, None, :, None], 0.0)
        # Offset o of query t is padded key row t + w + o, i.e. window t .. t + 2w of the padded keys.
        band = F.dropout(probs, self.dropout_p if self.training else 0.0, self.training)
        local_v = cut_to_length(v.unfold(1, 2 * w + 1, 1), 1, length)  # (batch, length, heads, dim, 2w + 1)
        out = torch.einsum("bhlj,blhdj->blhd", band[..., num_global:], local_v)
        if num_global:
            global_v = v.gather(1, (global_idx + w)[..., None, None].expand(-1, -1, heads, dim))  # (b, G, h, d)
            out = out + torch.einsum("bhlg,bghd->blhd", band[..., :num_global], global_v)
        return out.reshape(batch, length, heads * dim), probs

    def _chunked_banded_attention(self, q, k, v, bias, gk, gv, global_bias) -> torch.Tensor:
        """:meth:`_banded_attention` without gradients, ``LOCAL_CHUNK_TOKENS`` queries at a time: the key windows
        (with the global keys in front) and the scores of one chunk of blocks exist at once, not of all ``nb``
        (128k tokens at base width: 3.6 GB of float32 scores and 1.8 GB of windows per tensor otherwise). The same
        numbers: every block is its own attention problem. In training mode (a forward under ``no_grad``, e.g. Monte
        Carlo dropout) each chunk drops attention probabilities as the one-pass computation does.

        ``q`` ``(batch, nb * b, heads * dim)``; ``k`` / ``v`` ``(batch, nb * b + 2w, heads, dim)``; ``bias``
        ``(batch, nb, 1, b, span)``; ``gk`` / ``gv`` ``(batch, G, heads, dim)`` and ``global_bias``
        ``(batch, nb, 1, b, G)``, or None. Returns ``(batch, nb, heads, b, dim)``.
        """
        heads, dim, b = self.num_heads, self.head_dim, self.query_block
        batch, nb, span = bias.shape[0], bias.shape[1], bias.shape[-1]
        queries = q.view(batch, nb, b, heads, dim).permute(0, 1, 3, 2, 4)  # (batch, nb, heads, b, dim)
        keys = neighbourhoods(k, span, b).permute(0, 1, 3, 2, 4)  # (batch, nb, heads, span, dim) views
        values = neighbourhoods(v, span, b).permute(0, 1, 3, 2, 4)
        out = q.new_empty(batch, nb, heads, b, dim)
        step = max(1, LOCAL_CHUNK_TOKENS // b)
        dropout = self.dropout_p if self.training else 0.0
        for first in range(0, nb, step):
            blocks = slice(first, min(first + step, nb))
            n = blocks.stop - first
            kc, vc = globals_in_front(keys[:, blocks], gk), globals_in_front(values[:, blocks], gv)
            bc = bias[:, blocks] if global_bias is None else torch.cat([global_bias[:, blocks], bias[:, blocks]], -1)
            fold = (batch * n, heads)
            context = attention(
                queries[:, blocks].reshape(*fold, b, dim), kc.reshape(*fold, -1, dim), vc.reshape(*fold, -1, dim),
                bc.reshape(batch * n, 1, b, -1), dropout,
            )  # fmt: skip
            out[:, blocks] = context.view(batch, n, heads, b, dim)
        return out

    def _to_band_layout(self, weights, batch, nb, num_global, length) -> torch.Tensor:
        """``(batch * nb, heads, b, G + span)`` block weights -> ``(batch, heads, length, G + 2w + 1)``."""
        w, b, heads = self.one_sided_window, self.query_block, self.num_heads
        # Row r keeps local columns r .. r + 2w, i.e. offsets -w .. w.
        cols = torch.arange(b, device=weights.device)[:, None] + torch.arange(2 * w + 1, device=weights.device)
        band = weights[..., num_global:].gather(-1, cols.expand(batch * nb, heads, b, 2 * w + 1))
        both = torch.cat([weights[..., :num_global], band], dim=-1)
        return unblock(both.view(batch, nb, heads, b, -1).transpose(2, 3), length).transpose(1, 2)
