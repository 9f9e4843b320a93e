"""Longformer attention: a sliding window for every token plus global attention for chosen tokens.

Semantics (Beltagy et al., 2020, and transformers' ``LongformerSelfAttention``), with ``w`` the one-sided
window (``attention_window // 2``):

* a non-global query ``i`` attends to the non-global, non-padding keys ``j`` with ``|i - j| <= w`` and to every
  global key (global keys use the ordinary key/value projections here);
* a global query attends to every non-padding key, through the separate ``query_global``, ``key_global`` and
  ``value_global`` projections;
* padding queries produce zeros;
* in a packed batch (``document_ids``, see ``ops/packing.py``) every rule above holds within each document: no query
  sees a key of another document, local or global, and a global query attends to every non-padding key of its own
  document only, so each document gets what its own forward gives.

This file holds the module and its dispatch: which computation a forward takes, by the kernel choice
(:meth:`~hf_xformers.attention.base.KernelChoice.kernel_choice`), the input and the device. The computations live in
rooms of their own:

* ``sliding_window_layout.py``: what every layer of one forward shares (the global slots, their per-document layout,
  FlexAttention's block masks), built by :meth:`HfxSlidingWindowSelfAttention.shared_layout` once per forward;
* ``sliding_window_banded.py``: the band block by block, the reference path (``"eager"``, attention maps) and the
  fused one on the CPU;
* ``sliding_window_packed.py``: the global columns and rows of a packed batch, per document;
* here: one dense call for inputs within one block's key span, FlashAttention's variable-length kernel for a packed
  row without padding or global tokens on CUDA (``torch.nn.attention.varlen.varlen_attn`` with ``window_size=(w,
  w)``, one call over the row), FlexAttention with the band's block mask, and the global rows of an unpacked batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention_switch import EAGER, SDPA, flex_applies, flex_attention
from ..ops.input_checks import is_tracing, reads_values
from ..ops.kernels import attention
from ..ops.packing import PackedBatch
from ..ops.precision import autocast_input
from ..ops.shapes import cut_to_length, merge_heads, split_heads
from .base import AttentionOutput, HfxSelfAttention, QKVProjection
from .sliding_window_banded import BandedAttention
from .sliding_window_layout import GlobalSizes, LongformerLayout, longformer_layout
from .sliding_window_packed import PackedGlobalAttention

# FlashAttention's variable-length kernel (torch >= 2.9; CUDA only): a packed row's documents in one call, each
# attending within itself, with a sliding window through ``window_size``. None where the installed torch lacks it.
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None

# The dtypes and head sizes FlashAttention's kernels take.
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256


def varlen_device(device: torch.device) -> bool:
    """Whether :data:`varlen_attn` exists and runs on ``device`` (a CUDA device)."""
    return varlen_attn is not None and torch.device(device).type == "cuda"


def varlen_boundaries(packed: PackedBatch, device: torch.device) -> tuple[torch.Tensor, int] | None:
    """``(cu_seq_lens, longest)`` for :data:`varlen_attn` when ``packed`` is one unpadded row (it then carries
    ``cu_seq_lens``) on a device where the kernel runs, else None. ``longest`` is the batch's ``max_length`` or, where
    a read is free (:func:`~hf_xformers.ops.input_checks.reads_values`: inference), read once; a training step whose
    batch does not say takes the banded path instead of a read."""
    if packed.cu_seq_lens is None or not varlen_device(device):
        return None
    longest = packed.longest
    if longest is None and reads_values(packed.cu_seq_lens):
        longest = packed.longest_document()
    elif longest is not None:
        packed.assert_within(longest)  # the kernel sizes its work by it: an understated one would drop queries
    return None if longest is None else (packed.cu_seq_lens, longest)


class HfxSlidingWindowSelfAttention(HfxSelfAttention, BandedAttention, PackedGlobalAttention, QKVProjection):
    """Sliding-window + global self-attention of one Longformer layer.

    ``attentions`` (with ``output_attentions=True``): ``(batch, heads, seq_len, G + 2w + 1)``, the first ``G``
    columns are the global keys (``G`` = most global tokens of any example; in a packed batch of several rows with the
    default first-token globals, the batch's number of documents, sized without a read), then relative offsets
    ``-w .. w``; the same layout as transformers' Longformer (rows of global tokens are zero there: their output comes
    from global attention). ``global_attentions``: ``(batch, heads, G, seq_len)``, the transpose of transformers' (rows
    of empty slots, in examples with fewer than ``G`` global tokens, are zero).
    """

    supports_global_attention = True

    # Sequence parallelism carries the global projections of every token too: any token may be global.
    sequence_parallel_projections = ("query", "key", "value", "query_global", "key_global", "value_global")

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads)
        window = config.attention_window
        window = window[layer_idx] if isinstance(window, (list, tuple)) else window
        self.one_sided_window = window // 2
        # Queries go in blocks smaller than the window: a block of b queries needs b + 2w keys, so quarter-window
        # blocks compute 2.25w keys per query instead of 3w (measured ~17% faster at w = 256 on CPU). Small
        # windows keep whole-window blocks, where per-block overhead would dominate.
        self.query_block = self.one_sided_window if self.one_sided_window < 64 else self.one_sided_window // 4
        hidden = config.hidden_size
        self.query_global = nn.Linear(hidden, hidden)
        self.key_global = nn.Linear(hidden, hidden)
        self.value_global = nn.Linear(hidden, hidden)
        self.dropout_p = config.attention_probs_dropout_prob
        self.config = config  # for kernel_choice: the choice is read at every forward

    def shared_layout(
        self,
        implementation: str,
        reference: torch.Tensor,
        length: int,
        attention_mask: torch.Tensor | None,
        global_attention_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
        sizes: GlobalSizes | None = None,
        varlen: tuple[torch.Tensor, int] | None = None,
        layers: Sequence[HfxSlidingWindowSelfAttention] = (),
    ) -> LongformerLayout:
        """The :class:`~hf_xformers.attention.sliding_window_layout.LongformerLayout` of one forward of ``length``
        tokens for ``layers`` (this module alone when empty): the one place it is built. The model calls it once per
        forward for all its layers and passes it to each (``layout``); a module called on its own, for itself.

        Args:
            implementation: this forward's kernel choice (:meth:`kernel_choice`); FlexAttention's block masks, one
                per window size of ``layers``, are built only where it runs (:func:`flex_applies` on ``reference``).
            reference: a tensor on the forward's device, whose ``requires_grad`` says whether gradients are recorded.
            attention_mask: ``(batch, seq_len)`` bool, True for real tokens, or None (no padding).
            global_attention_mask: ``(batch, seq_len)`` bool, True for global tokens, or None; padding is never global.
            document_ids: ``(batch, seq_len)`` long, the documents of a packed batch, or None.
            sizes: the global layouts' sizes where the caller knows them without a read
                (:func:`~hf_xformers.attention.sliding_window_layout.first_token_sizes`); None: read here, once.
            varlen: ``(cu_seq_lens, longest)`` for the varlen kernel (:func:`varlen_boundaries`), or None.
            layers: the attention modules of every layer of the model.
        """
        layers = tuple(layers) or (self,)
        is_global = global_attention_mask
        if is_global is not None and attention_mask is not None:
            is_global = is_global & attention_mask
        flex = flex_applies(implementation, reference, self.training, self.dropout_p)
        windows = {layer.one_sided_window for layer in layers} if flex else ()
        blocks = {layer.query_block for layer in layers}
        return longformer_layout(
            attention_mask, is_global, length, reference.device, blocks, windows, document_ids, sizes, varlen
        )

    def attend_tokens(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        document_ids: torch.Tensor | None = None,
        layout: LongformerLayout | None = None,
        *,
        global_attention_mask: torch.Tensor | None = None,
    ) -> AttentionOutput:
        """``hidden_states`` ``(batch, seq_len, hidden)`` -> context ``(batch, seq_len, hidden)``.

        ``attention_mask`` None means no padding, ``global_attention_mask`` None no global token. ``document_ids``
        ``(batch, seq_len)`` long: the documents of a packed batch (:mod:`~hf_xformers.ops.packing`), each attended
        to as if alone; None: one document per row. ``layout``: :meth:`shared_layout`, which the model works out
        once per forward for all layers (the global tokens, their per-document layout, FlexAttention's block masks,
        the varlen boundaries); the layer then reads the global tokens from it and ignores
        ``global_attention_mask``. None (the module called on its own): :meth:`shared_layout` for this layer.
        """
        implementation = self.kernel_choice(hidden_states)
        batch, length = hidden_states.shape[:2]
        if layout is None:  # called on its own, not through the model
            layout = self.shared_layout(
                implementation, hidden_states, length, attention_mask, global_attention_mask, document_ids
            )
        # Up to five projections read the input (local and global query, key, value): cast it once under autocast.
        hidden_states = autocast_input(hidden_states)
        is_global, packed_globals = layout.is_global, layout.packed_globals
        global_idx, global_valid = layout.global_slots if is_global is not None else (None, None)

        # Up to one block's key span (b + 2w) the blocked computation does no less work than one dense call over
        # all keys, so short inputs take the dense call with the band as a mask: the same result at the speed
        # of full attention (no mask at all once the window covers the whole sequence). Traced graphs always
        # take the banded path: the same result, and no branch on the length.
        # "eager" (and output_attentions) take the explicit softmax of the banded path.
        eager = output_attentions or implementation == EAGER
        if not eager and implementation == SDPA and layout.varlen is not None and self._varlen_applies(hidden_states):
            context, probs = self._varlen_attention(hidden_states, *layout.varlen), None
        elif not eager and flex_applies(implementation, hidden_states, self.training, self.dropout_p):
            q, k, v = (split_heads(t, self.num_heads) for t in self.fused_qkv(hidden_states))
            block_mask = layout.flex_masks[self.one_sided_window]
            context, probs = merge_heads(flex_attention(q, k, v, block_mask=block_mask)), None
        elif not eager and not is_tracing() and length <= self.query_block + 2 * self.one_sided_window:
            context, probs = self._dense_attention(hidden_states, attention_mask, is_global, document_ids), None
        else:
            context, probs = self._banded_attention(
                hidden_states, attention_mask, is_global, global_idx, global_valid, eager, document_ids,
                packed_globals, output_attentions,
            )  # fmt: skip
            probs = probs if output_attentions else None
        if attention_mask is not None:
            # Padding queries give zeros, as in the reference implementation.
            context = context.masked_fill(~attention_mask[..., None], 0.0)

        global_probs = None
        if is_global is not None:
            global_context, global_probs = self._global_attention(
                hidden_states, attention_mask, global_idx, global_valid, eager, packed_globals, output_attentions
            )
            global_probs = global_probs if output_attentions else None
            # Written through an extra row that the empty slots point at (no boolean indexing: traceable).
            rows = torch.arange(batch, device=context.device)[:, None].expand_as(global_idx)
            target = torch.where(global_valid, global_idx, length)
            context = cut_to_length(F.pad(context, (0, 0, 0, 1)).index_put((rows, target), global_context), 1, length)
        elif self.training:
            # The global projections get no gradient when no token is global; DistributedDataParallel then
            # fails with "parameters that were not used". A zero-weighted term keeps them in the graph.
            unused = sum(
                p.sum() for m in (self.query_global, self.key_global, self.value_global) for p in m.parameters()
            )
            context = context + 0.0 * unused
        return AttentionOutput(context, probs, global_probs)

    def _varlen_applies(self, hidden_states: torch.Tensor) -> bool:
        """Whether :data:`varlen_attn` takes this layer's attention (the layout says the batch and device allow it):
        a dtype and head size FlashAttention takes, and no attention dropout (the kernel has none)."""
        return (
            hidden_states.dtype in VARLEN_DTYPES
            and self.head_dim % 8 == 0
            and self.head_dim <= VARLEN_MAX_HEAD_DIM
            and not (self.training and self.dropout_p > 0.0)
        )

    def _varlen_attention(self, hidden_states: torch.Tensor, cu_seq_lens: torch.Tensor, longest: int) -> torch.Tensor:
        """A packed row ``(1, seq_len, hidden)`` in one call of FlashAttention's varlen kernel over its documents
        (``cu_seq_lens`` ``(count + 1,)`` int32, ``longest`` the longest document): query ``i`` sees the keys ``j`` of
        its own document with ``|i - j| <= w``, i.e. ``window_size=(w, w)``. Returns ``(1, seq_len, hidden)``."""
        batch, length = hidden_states.shape[:2]
        w = self.one_sided_window
        q, k, v = (t.reshape(batch * length, self.num_heads, self.head_dim) for t in self.fused_qkv(hidden_states))
        out = varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, window_size=(w, w))
        return out.reshape(batch, length, self.num_heads * self.head_dim)

    def _dense_attention(self, hidden_states, attention_mask, is_global, document_ids=None) -> torch.Tensor:
        """Short inputs: one attention call over all keys, masked to the window and the global keys.

        A query sees the real keys within ``w`` of it and every global key (through the ordinary projections, as
        in the banded path); when ``w`` covers the whole sequence that is every real key. With ``document_ids``
        ``(batch, seq_len)`` only those of its own document (a ``(batch, seq_len, seq_len)`` mask, no larger than the
        scores of this path, which serves inputs within one block's key span).
        """
        heads, length, w = self.num_heads, hidden_states.shape[1], self.one_sided_window
        q, k, v = (split_heads(t, heads) for t in self.fused_qkv(hidden_states))
        mask = None  # nothing to mask: SDPA's unmasked kernel is the fastest (this path never runs traced)
        if length > w + 1:
            position = torch.arange(length, device=hidden_states.device)
            mask = ((position[None, :] - position[:, None]).abs() <= w)[None, None]
            if is_global is not None:
                mask = mask | is_global[:, None, None, :]
        if document_ids is not None:
            same = (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
            mask = same if mask is None else mask & same
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :] if mask is None else mask & attention_mask[:, None, None, :]
            # A query left with no key (padding far from any real token) sees everything; its output is zeroed later.
            mask = mask | ~mask.any(-1, keepdim=True)
        dropout = self.dropout_p if self.training else 0.0
        return merge_heads(attention(q, k, v, mask, dropout))

    def _global_attention(
        self, hidden_states, attention_mask, global_idx, global_valid, output_attentions, packed_globals=None,
        return_probs=True,
    ):  # fmt: skip
        """Global queries attend to every real token (of their own document, given ``packed_globals``) through the
        global projections.

        Returns ``(batch, G, hidden)`` contexts and, if asked, ``(batch, heads, G, seq_len)`` probabilities
        (``output_attentions`` selects the explicit softmax; ``return_probs`` False lets a packed batch skip the
        ``(G, seq_len)`` layout).
        """
        picked = hidden_states.gather(1, global_idx[..., None].expand(-1, -1, hidden_states.shape[-1]))
        if packed_globals is not None:
            return self._packed_global_attention(
                hidden_states, attention_mask, picked, global_valid, output_attentions, packed_globals, return_probs
            )
        q = split_heads(self.query_global(picked), self.num_heads)
        k = split_heads(self.key_global(hidden_states), self.num_heads)
        v = split_heads(self.value_global(hidden_states), self.num_heads)
        mask = None  # no padding: every slot sees every key
        if attention_mask is not None:
            # Empty slots (examples with fewer globals) may look at everything; their output is dropped.
            mask = (attention_mask[:, None, :] | ~global_valid[:, :, None])[:, None]
        dropout = self.dropout_p if self.training else 0.0
        if not output_attentions:
            return merge_heads(attention(q, k, v, mask, dropout)), None
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = probs.masked_fill(~global_valid[:, None, :, None], 0.0)
        out = torch.matmul(F.dropout(probs, dropout, self.training), v)
        return merge_heads(out), probs
