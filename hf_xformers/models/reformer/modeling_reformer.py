"""``hfx-reformer``: Reformer (Kitaev et al., 2020) with the module names of transformers' ``ReformerModel``.

Layout (pre-LN, reversible): the embeddings ``e`` start both streams, ``x1 = x2 = e``; layer ``i`` computes
``y1 = x1 + Attention_i(LayerNorm(x2))`` and ``y2 = x2 + FeedForward_i(LayerNorm(y1))``; the output is
``LayerNorm([y1; y2])``, of width ``2 * hidden_size``. Attention is chunked local (``attention/chunked_local.py``) or
LSH (``attention/lsh.py``) per ``config.attn_layers``; the reversible machinery is ``models/reformer/reversible.py``.

Any length up to ``max_position_embeddings`` works in training and eval: inputs longer than the shortest chunk are
padded inside to a multiple of the chunk lengths and cut back, and every example is computed as it would be alone
(see ``chunked_local.py``), so padding a batch does not change its outputs.

Packed (padding-free) batches, as ``DataCollatorWithFlattening(position_ids_start=0)`` makes them (boundaries as
``seq_idx`` or ``cu_seq_lens_q/k``; ``position_ids`` never mark documents): the documents of a row are laid out in an
internal row, each in a region padded to the chunk multiple as its own forward pads it (:func:`lay_out_documents`), the
layers run on that row with every chunk kept inside one document (``attention/chunked_local.py``, ``attention/lsh.py``)
and the outputs are gathered back into the packed row: every document gets what its own forward gives (with fixed
rotations: eval, or a ``hash_seed``; training rotations are one draw per layer and call, as for any batch). Positions
restart at 0 in each document. Padding (``attention_mask``) is never part of a document
(:class:`~hf_xformers.ops.packing.PackedBatch`). A packed batch costs its tokens plus less than one chunk multiple per
document (and one more where the row's length is not read: training on an accelerator, traced graphs). The layout makes
no host read when the batch carries ``cu_seq_lens_q/k`` (the number of documents by their shape), and a traced graph
needs them: ``seq_idx`` does not say how many documents there are (a ``ValueError`` says so).

Mixed precision (``torch.autocast`` or ``model.to(bfloat16 / float16)``): mask logits fit the scores' dtype, LSH
hashing and the rounds' softmax statistics compute in float32 (the fixed rotations stay a float32 buffer when the model
is cast), and the reversible backward pass recomputes each layer under the forward's autocast state. With fixed
rotations (``hash_seed``, or eval) every device hashes with the same numbers; fresh training rotations are drawn on the
input's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.activations import ACT2FN
from transformers.modeling_outputs import ModelOutput
from typing_extensions import Unpack

from ...attention.chunked_local import DocumentLayout, HfxLocalSelfAttention, decode_padded_length
from ...attention.lsh import HfxLSHSelfAttention
from ...layers.encoder import INPLACE_ACTIVATIONS
from ...layers.generation import HfxCache
from ...layers.heads import (
    HfxCausalLMHeadMixin,
    HfxMaskedLMHeadMixin,
    HfxQuestionAnsweringHeadMixin,
    HfxSequenceClassificationHeadMixin,
    causal_lm_loss,
)
from ...layers.losses import next_token_labels
from ...layers.pretrained import HfxPreTrainedModel
from ...ops.fast_dropout import HfxDropout, fast_dropout
from ...ops.input_checks import (
    check_embeds_width,
    check_not_empty,
    check_position_ids,
    check_token_ids,
    reads_values,
    refuse,
    token_shape,
    unpadded_to_none,
)
from ...ops.packing import CuSeqLensKwargs, PackedBatch, PackedBatchKwargs, packing_kwargs, resolve_packed_batch
from ...ops.sequence_parallel import SequenceShards, current_shards
from ...ops.shapes import ceil_div, cut_to_length
from .configuration_reformer import HfxReformerConfig
from .reversible import reversible_sequence


def chunked_over_positions(fn, hidden_states: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``fn`` applied to ``chunk_size`` positions at a time (all at once for 0): the same result, with the
    intermediate activations of one chunk alive at a time. Unlike transformers' ``apply_chunking_to_forward`` the
    length need not be a multiple of ``chunk_size``."""
    if chunk_size <= 0 or hidden_states.shape[1] <= chunk_size:
        return fn(hidden_states)
    return torch.cat([fn(part) for part in hidden_states.split(chunk_size, dim=1)], dim=1)


# ----------------------------------------------------------------------------------------------------------------
# Embeddings
# ----------------------------------------------------------------------------------------------------------------


class HfxAxialWeights(nn.ParameterList):
    """The two axial tables (checkpoint keys ``weights.0`` / ``weights.1``). A class of their own because
    transformers initialises custom-code modules only where they hold parameters directly: the
    :class:`HfxAxialPositionEmbeddings` around them holds none and is skipped, so ``_init_weights`` must recognise the
    list itself (a plain ``ParameterList`` would leave them at their placeholder ones)."""


class HfxAxialPositionEmbeddings(nn.Module):
    """Axial positions: position ``p`` of a ``(rows, cols)`` grid (``p = row * cols + col``) is
    ``[weights[0][row]; weights[1][col]]``, ``rows * d0 + cols * d1`` parameters instead of ``rows * cols * hidden``.

    In training, dropout removes whole grid columns per example (transformers' ``dropout2d`` on the grid).
    ``(batch, seq_len)`` position ids -> ``(batch, seq_len, hidden)``.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.shape = tuple(config.axial_pos_shape)
        self.dropout = config.hidden_dropout_prob
        rows, cols = self.shape
        dim0, dim1 = config.axial_pos_embds_dim
        self.weights = HfxAxialWeights(
            [nn.Parameter(torch.ones(rows, 1, dim0)), nn.Parameter(torch.ones(1, cols, dim1))]
        )

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        cols = self.shape[1]
        row, col = position_ids // cols, position_ids % cols
        rows_table = self.weights[0].view(self.shape[0], -1)
        cols_table = self.weights[1].view(cols, -1)
        encodings = torch.cat([rows_table[row], cols_table[col]], dim=-1)
        if self.training and self.dropout > 0:
            keep = nn.functional.dropout(encodings.new_ones(position_ids.shape[0], cols), self.dropout, True)
            encodings = encodings * keep.gather(1, col)[..., None]
        return encodings


class HfxLearnedPositionEmbeddings(nn.Module):
    """One learned row per position, with dropout. ``(batch, seq_len)`` -> ``(batch, seq_len, hidden)``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = HfxDropout(config.hidden_dropout_prob)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embedding(position_ids))


class HfxReformerEmbeddings(nn.Module):
    """``dropout(word) + position`` (no LayerNorm: every layer normalises its own input)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (
            HfxAxialPositionEmbeddings(config) if config.axial_pos_embds else HfxLearnedPositionEmbeddings(config)
        )
        self.dropout = HfxDropout(config.hidden_dropout_prob)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Returns ``(batch, seq_len, hidden)``; positions count from ``start`` (cached decoding) unless given."""
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        batch, seq_len = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(start, start + seq_len, device=inputs_embeds.device).expand(batch, -1)
        return self.dropout(inputs_embeds) + self.position_embeddings(position_ids)


# ----------------------------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------------------------


class HfxReformerSelfOutput(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.num_attention_heads * config.attention_head_size, config.hidden_size, bias=False)
        self.dropout = HfxDropout(config.hidden_dropout_prob, inplace_without_grad=True)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.dense(context))


class HfxReformerAttention(nn.Module):
    """``output(self_attention(LayerNorm(x)))``: the ``f`` of a reversible block."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        kind = config.attn_layers[layer_idx]
        attention_class = HfxLSHSelfAttention if kind == "lsh" else HfxLocalSelfAttention
        self.self_attention = attention_class(config, layer_idx)
        self.output = HfxReformerSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, padded_lengths=None, num_hashes=None, buckets=None,
                output_attentions=False, output_length=None, documents=None, sequence_parallel=None):  # fmt: skip
        """``(batch, seq, hidden)`` -> (output, :class:`AttentionOutput` with the LSH buckets in ``global_attentions``'
        place ``[2]``, the normalised input). ``documents``: the :class:`DocumentLayout` of a packed batch.
        ``sequence_parallel``: the :class:`~hf_xformers.ops.sequence_parallel.SequenceShards` of a sequence-parallel
        forward (``hidden_states`` is then this rank's tokens; masks and lengths are the whole sequence's)."""
        normed = self.layer_norm(hidden_states)
        sp = {} if sequence_parallel is None else {"sequence_parallel": sequence_parallel}
        if isinstance(self.self_attention, HfxLSHSelfAttention):
            out = self.self_attention(normed, attention_mask, None, output_attentions, padded_lengths, num_hashes,
                                      buckets, output_length, documents=documents, **sp)  # fmt: skip
        else:
            out = self.self_attention(normed, attention_mask, None, output_attentions, padded_lengths, output_length,
                                      documents=documents, **sp)  # fmt: skip
        return self.output(out.context), out, normed

    def decode_step(
        self,
        hidden_states: torch.Tensor,
        past_states: torch.Tensor,
        past_buckets: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        padded_length: int,
        num_hashes: int | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One new position ``hidden_states`` ``(batch, 1, hidden)`` against the cached normalised inputs of this
        block ``past_states`` ``(batch, past_len, hidden)`` (and LSH buckets ``past_buckets``): the last row of the
        full forward over every position so far, which the model would pad to ``padded_length`` and mask with
        ``key_mask`` ``(batch, past_len + 1)`` (None: nothing padded).

        Returns the output ``(batch, 1, hidden)``, the new position's normalised input ``(batch, 1, hidden)`` (for
        the cache), the buckets of every position so far (LSH; None otherwise) and, with ``output_attentions``, the
        probabilities ``(batch, heads, 1, past_len + 1)``."""
        normed = self.layer_norm(hidden_states)
        context, buckets, probs = self.self_attention.decode_step(
            normed, past_states, past_buckets, num_hashes, output_attentions, key_mask=key_mask,
            padded_length=padded_length,
        )  # fmt: skip
        return self.output(context), normed, buckets, probs


class HfxReformerFeedForward(nn.Module):
    """``output(act(dropout(dense(LayerNorm(x)))))`` in chunks of ``chunk_size_feed_forward`` positions: the ``g``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.chunk_size = config.chunk_size_feed_forward
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dense = nn.Module()
        self.dense.dense = nn.Linear(config.hidden_size, config.feed_forward_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.feed_forward_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.act_inplace = INPLACE_ACTIVATIONS.get(config.hidden_act) if isinstance(config.hidden_act, str) else None
        self.dropout_prob = config.hidden_dropout_prob

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return chunked_over_positions(self.forward_chunk, hidden_states, self.chunk_size)

    def forward_chunk(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = self.dense.dense(self.layer_norm(hidden_states))
        grad = torch.is_grad_enabled()
        # Without a gradient (eval, and the forward pass of the reversible layers) the (seq, feed_forward_size)
        # activation, the largest tensor of the layer, is overwritten instead of allocating two more (fresh CPU
        # buffers of that size cost page faults). Under autograd an in-place op on the Linear's output view would
        # cost a full copy; there only the activation of dropout's fresh output runs in place (ReLU's backward needs
        # only its output).
        hidden = fast_dropout(hidden, self.dropout_prob, self.training, inplace=not grad)
        fresh = not grad or (self.training and self.dropout_prob > 0)
        if self.act_inplace is not None and fresh and (not grad or self.act_inplace is torch.relu_):
            hidden = self.act_inplace(hidden)
        else:
            hidden = self.act(hidden)
        return fast_dropout(self.output.dense(hidden), self.dropout_prob, self.training, inplace=not grad)


class HfxReformerLayer(nn.Module):
    """A reversible block: ``f`` = attention, ``g`` = feed-forward (the interface of ``models/reformer/reversible.py``)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention = HfxReformerAttention(config, layer_idx)
        self.feed_forward = HfxReformerFeedForward(config)

    def f(self, x2, extra=None, attention_mask=None, padded_lengths=None, num_hashes=None, documents=None,
          sequence_parallel=None):  # fmt: skip
        out, attn, _ = self.attention(x2, attention_mask, padded_lengths, num_hashes, buckets=extra,
                                      documents=documents, sequence_parallel=sequence_parallel)  # fmt: skip
        return out, attn.global_attentions

    def g(self, y1: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(y1)

    def decode_step(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        cache: HfxReformerCache,
        key_mask: torch.Tensor | None,
        padded_length: int,
        num_hashes: int | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This block on one new position, ``x1`` and ``x2`` ``(batch, 1, hidden)``, reading and extending this
        layer's entries of the decoding ``cache`` (see :meth:`HfxReformerAttention.decode_step` for ``key_mask`` and
        ``padded_length``). Returns the next ``(x1, x2)`` and the probabilities (with ``output_attentions``)."""
        i = self.layer_idx
        out, normed, cache.buckets[i], probs = self.attention.decode_step(
            x2, cache.states[i], cache.buckets[i], key_mask, padded_length, num_hashes, output_attentions
        )
        cache.states[i] = torch.cat([cache.states[i], normed], dim=1)
        x1 = x1 + out
        return x1, x2 + self.feed_forward(x1), probs

    def f_parameters(self):
        return self.attention.parameters()

    def g_parameters(self):
        return self.feed_forward.parameters()


class HfxReformerCache(HfxCache):
    """What cached decoding keeps per layer: the normalised attention inputs ``(batch, len, hidden)`` and, for LSH
    layers, their buckets ``(batch, heads, rounds, len)`` (None for local layers and for LSH layers whose input was
    still no longer than a chunk); and once for all layers the key mask of those positions, ``key_mask``
    ``(batch, len)`` bool (True = real; None while nothing is padded), so that a step that is given only the new
    position's mask still masks the padded keys. Plays the part of transformers' ``past_buckets_states``."""

    batch_fields = ("states", "buckets", "key_mask")

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []
        self.buckets: list[torch.Tensor | None] = []
        self.key_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.states[layer_idx].shape[1] if self.states else 0

    def add_prompt_layer(
        self, normed: torch.Tensor, buckets: torch.Tensor | None, key_mask: torch.Tensor | None, length: int
    ) -> None:
        """Keep the next layer's normalised input ``(batch, padded, hidden)`` and buckets ``(batch, heads, rounds,
        padded)`` (or None) of a prompt, and the key mask ``(batch, padded)`` (or None), cut to its ``length``
        real positions."""
        self.states.append(normed[:, :length])
        self.buckets.append(None if buckets is None else buckets[..., :length])
        self.key_mask = None if key_mask is None else key_mask[:, :length]


class HfxReformerEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(HfxReformerLayer(config, i) for i in range(config.num_hidden_layers))
        self.layer_norm = nn.LayerNorm(2 * config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = HfxDropout(config.hidden_dropout_prob, inplace_without_grad=True)

    def forward(self, hidden_states, attention_mask=None, padded_lengths=None, num_hashes=None,
                output_attentions=False, output_hidden_states=False, cache=None, cache_length=None,
                documents=None, slots=None, sequence_parallel=None):  # fmt: skip
        """``(batch, seq, hidden)`` -> ``(batch, seq, 2 * hidden)``, the per-layer ``x2`` streams, attentions.

        ``cache``: an empty :class:`HfxReformerCache` to fill (prefill, ``cache_length`` real positions) or a filled
        one to decode one position with (``attention_mask`` then the key mask of every position so far, ``(batch,
        cached + 1)``, or None). A packed batch: ``hidden_states`` is the internal row of
        :func:`lay_out_documents`, ``documents`` its layout and ``slots`` ``(batch, packed_len)`` the slot of every
        packed token in it; the reported ``x2`` streams are then ``(batch, packed_len, hidden)``.
        """
        all_hidden, all_attn = [], []
        x1 = x2 = hidden_states
        # Internal padding: report each stream state cut to the real length (gathered from the internal row of a
        # packed batch), and carry on from a tensor rebuilt from that cut (with the padded slots as they were), so
        # that the reported states are on the autograd path of the output (`retain_grad()` on them gets gradients)
        # and the numbers are unchanged.
        expose = output_hidden_states and (
            slots is not None
            or (cache_length is not None and (torch.compiler.is_compiling() or hidden_states.shape[1] != cache_length))
        )
        if expose:
            hidden, x1 = _on_path(x1, cache_length, slots)
            x2 = x1
        if cache is not None and len(cache):
            x1, x2 = self._decode_step(x1, x2, attention_mask, num_hashes, cache, all_hidden, all_attn,
                                       output_attentions, output_hidden_states)  # fmt: skip
        elif (
            self.config.reversible and self.training and torch.is_grad_enabled()
            and not (output_attentions or output_hidden_states) and not torch.compiler.is_compiling()
        ):  # fmt: skip
            # (A traced graph takes the loop below, whose activations autograd keeps: the same numbers, without the
            # reversible memory saving. The reversible function records and restores the random generator's state
            # around every f and g, which dynamo refuses to trace.)
            x1, x2 = reversible_sequence(
                self.layers, x1, x2, attention_mask=attention_mask, padded_lengths=padded_lengths,
                num_hashes=num_hashes, documents=documents, sequence_parallel=sequence_parallel,
            )  # fmt: skip
        else:
            for i, layer in enumerate(self.layers):
                if expose:
                    if i:  # layer 0's input is the embedding output, already rebuilt above
                        hidden, x2 = _on_path(x2, cache_length, slots)
                    all_hidden.append(hidden)
                elif output_hidden_states:
                    all_hidden.append(x2)
                out, attn, normed = layer.attention(x2, attention_mask, padded_lengths, num_hashes,
                                                    output_attentions=output_attentions,
                                                    output_length=cache_length, documents=documents,
                                                    sequence_parallel=sequence_parallel)  # fmt: skip
                if cache is not None:
                    cache.add_prompt_layer(normed, attn.global_attentions, attention_mask, cache_length)
                if output_attentions:
                    all_attn.append(attn.attentions)
                x1 = x1 + out
                x2 = x2 + layer.feed_forward(x1)
        if expose:
            hidden, x2 = _on_path(x2, cache_length, slots)
            all_hidden.append(hidden)
        elif output_hidden_states:
            all_hidden.append(x2)
        hidden = self.dropout(self.layer_norm(torch.cat([x1, x2], dim=-1)))
        return hidden, all_hidden, all_attn

    def _decode_step(self, x1, x2, key_mask, num_hashes, cache, all_hidden, all_attn, output_attentions,
                     output_hidden_states):  # fmt: skip
        """One new position ``x1``, ``x2`` ``(batch, 1, hidden)`` through every layer (:meth:`HfxReformerLayer.
        decode_step`): each attends as the last row of a full forward over the sequence so far, which the model would
        pad to a chunk multiple and mask with ``key_mask`` ``(batch, cached + 1)`` (None: unpadded). Appends to
        ``all_hidden`` / ``all_attn`` what is asked for; returns the last ``(x1, x2)``."""
        padded = decode_padded_length(
            cache.get_seq_length() + 1, self.config.chunk_multiple, self.config.min_chunk_length
        )
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(x2)
            x1, x2, probs = layer.decode_step(x1, x2, cache, key_mask, padded, num_hashes, output_attentions)
            if output_attentions:
                all_attn.append(probs)
        cache.key_mask = key_mask
        return x1, x2


def _on_path(x: torch.Tensor, length, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(batch, padded, hidden)`` -> ``(real, rebuilt)``: its first ``length`` positions (or its ``slots``
    ``(batch, packed_len)``, the packed tokens of an internal row), and ``x`` made again from them and its padded
    places (the same numbers), for the forward to continue from."""
    if slots is not None:
        index = slots[..., None].expand(-1, -1, x.shape[-1])
        real = x.gather(1, index)
        return real, x.scatter(1, index, real)
    real = cut_to_length(x, 1, length)
    tail = x.index_select(1, torch.arange(length, x.shape[1], device=x.device))
    return real, torch.cat([real, tail], dim=1)


# ----------------------------------------------------------------------------------------------------------------
# Packed batches
# ----------------------------------------------------------------------------------------------------------------


def lay_out_documents(
    packed: PackedBatch, multiple: int, min_chunk_length: int
) -> tuple[DocumentLayout, torch.Tensor, int]:
    """Where the documents of a packed batch go in the internal row the layers run on.

    Each real document gets a region of its length rounded up to ``multiple`` (the chunk multiple), in order, so that
    every chunk of every layer lies in one document and each document is chunked from its first token, as its own
    forward pads and chunks it; the padding tokens of a row (never a document) follow its last region, in the row's
    tail, which is a region of its own that holds no document.

    Every step is a tensor operation whose count does not depend on the number of documents, and the row's length is
    a host number: with values that may be read for free (eager mode on the CPU, or without gradients) the longest
    row's need, one read; otherwise (a training step on an accelerator, a traced graph) the bound ``seq_len +
    count * (multiple - 1)`` rounded up to ``multiple``, which every row meets (each region adds less than
    ``multiple`` slots to its document) and which needs only ``packed.count``, known from the shape of
    ``cu_seq_lens``. The tail's extra slots change no document's numbers.

    Args:
        packed: the batch's :class:`~hf_xformers.ops.packing.PackedBatch` (``index``, ``positions`` ``(batch,
            packed_len)``, ``count``).
        multiple, min_chunk_length: ``config.chunk_multiple`` and ``config.min_chunk_length``.
    Returns:
        ``(layout, slots, length)``: the :class:`DocumentLayout` of the internal row ``(batch, length)``, and the
        internal slot of every packed token ``(batch, packed_len)`` long.
    Raises:
        ValueError: the number of documents is unknown (a traced graph whose documents only ``seq_idx`` marks).
    """
    count = packed.count
    if count is None:  # eager mode always knows it (resolve_packed_batch reads it): this is a traced graph
        raise ValueError(
            "Reformer lays the documents of a packed row out in an internal row whose length depends on the number "
            "of documents, which a traced graph (torch.compile / torch.export) cannot read when only `seq_idx` marks "
            "them: pass `cu_seq_lens_q/k` and `max_length_q/k` for one packed row "
            "(DataCollatorWithFlattening(return_flash_attn_kwargs=True))."
        )
    index, inside = packed.index, packed.positions
    batch, packed_len = index.shape
    device = index.device
    real = index < count  # padding holds document number `count`
    lengths = packed.lengths()  # (count,)
    region = ceil_div(lengths, multiple) * multiple
    solo = torch.where(lengths > min_chunk_length, region, lengths)
    rows = torch.arange(batch, device=device)[:, None].expand(batch, packed_len).reshape(-1)
    # Documents are numbered row after row: each one's row, and its region's start inside that row.
    row_of_doc = torch.zeros(count + 1, dtype=torch.long, device=device).scatter_reduce(
        0, index.reshape(-1), rows, "amax"
    )[:count]
    row_used = torch.zeros(batch, dtype=torch.long, device=device).index_add(0, row_of_doc, region)
    start = region.cumsum(0) - region - (row_used.cumsum(0) - row_used)[row_of_doc]
    padding_rank = (~real).long().cumsum(-1) - 1
    start_of = torch.cat([start, start.new_zeros(1)])  # padding's slot `count` reads 0 (replaced below)
    slots = torch.where(real, start_of[index] + inside, row_used[:, None] + padding_rank)
    need = row_used + (~real).sum(-1)
    if reads_values(need):
        length = ceil_div(int(need.max()), multiple) * multiple
    else:
        length = ceil_div(packed_len + count * (multiple - 1), multiple) * multiple
    # The document of every internal slot: region starts marked and counted along the row, from the row's first.
    marks = torch.zeros(batch, length, dtype=torch.long, device=device).index_put(
        (row_of_doc, start), torch.ones_like(start)
    )
    per_row = torch.zeros(batch, dtype=torch.long, device=device).index_add(0, row_of_doc, torch.ones_like(start))
    owner = (per_row.cumsum(0) - per_row)[:, None] + marks.cumsum(-1) - 1
    owner = owner.clamp(min=0, max=count - 1)
    tail = torch.arange(length, device=device) >= row_used[:, None]
    region_start = torch.where(tail, row_used[:, None], start[owner])
    solo_length = torch.where(tail, torch.zeros_like(region_start), solo[owner])
    return DocumentLayout(region_start, solo_length), slots, length


def _cut_output(
    hidden: torch.Tensor,
    all_hidden: list[torch.Tensor] | None,
    all_attn: list[torch.Tensor] | None,
    cache: HfxReformerCache | None,
    seq_len: int,
    start: int,
) -> HfxReformerModelOutput:
    """The encoder's outputs over the padded row cut back to the input's ``seq_len`` positions (after ``start``
    cached ones): ``hidden`` ``(batch, padded, 2 * hidden)``, the ``x2`` streams and attentions asked for (empty
    None when not asked)."""
    return HfxReformerModelOutput(
        last_hidden_state=cut_to_length(hidden, 1, seq_len),
        past_buckets_states=cache,
        # Already cut inside the encoder (on the autograd path) where the input was padded; a no-op otherwise.
        hidden_states=None if all_hidden is None else tuple(cut_to_length(h, 1, seq_len) for h in all_hidden),
        # (A cached step's probabilities cover every position so far: only its one query row is new.)
        attentions=(
            None
            if all_attn is None
            else tuple(cut_to_length(cut_to_length(a, 2, seq_len), 3, start + seq_len) for a in all_attn)
        ),
    )


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class HfxReformerModelOutput(ModelOutput):
    """``last_hidden_state`` ``(batch, seq_len, 2 * hidden)``; ``past_buckets_states`` the decoding cache;
    ``hidden_states`` the ``x2`` stream before each layer and after the last ``(batch, seq_len, hidden)``;
    ``attentions`` dense ``(batch, heads, seq_len, seq_len)`` per layer."""

    last_hidden_state: torch.Tensor | None = None
    past_buckets_states: HfxReformerCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class HfxReformerCausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_buckets_states: HfxReformerCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class HfxReformerPreTrainedModel(HfxPreTrainedModel):
    # Local attention's chunk windows as FlexAttention's BlockMask (LSH layers keep their sorted-chunk kernel).
    _supports_flex_attn = True
    config_class = HfxReformerConfig
    sequence_parallel_refusal = None  # Ulysses: each rank runs the whole sequence on heads / sp_size heads
    base_model_prefix = "reformer"
    # The unit FSDP shards by and device maps keep whole must be a module whose forward encloses every use of its
    # parameters: the reversible path calls each layer's f and g (never a layer's forward) from one autograd
    # function over all layers, and recomputes them in the backward pass, so only the encoder qualifies.
    _no_split_modules = ["HfxReformerEncoder"]
    # Declined, as transformers' Reformer declines it: the reversible layers already recompute their activations in
    # the backward pass. transformers' contract for checkpointing (a `GradientCheckpointingLayer` whose checkpointed
    # forward runs in training) could only be met by trading the reversible stack for one that keeps each layer's
    # input, which takes more memory than not checkpointing at all.
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxAxialWeights):
            for weight in module:
                nn.init.normal_(weight, std=self.config.axial_norm_std)
        elif isinstance(module, HfxLSHSelfAttention):
            module.rotations.copy_(module.fixed_rotations(module.num_hashes))
        elif isinstance(module, HfxReformerLMHead):
            nn.init.zeros_(module.bias)

    def gradient_checkpointing_enable(self, *args, **kwargs) -> None:
        """Refused with the reason. (From transformers 5.23 on, ``activation_checkpointing_enable()`` calls this
        override too.)"""
        raise ValueError(
            f"{type(self).__name__} does not use gradient (activation) checkpointing: its reversible layers already "
            "recompute their activations in the backward pass, so training memory stays flat in the number of "
            "layers. Leave checkpointing off (drop `--gradient_checkpointing` / `--activation_checkpointing`), and "
            "keep `config.reversible=True` for that memory saving."
        )

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """As transformers' method; the LM head's separate bias (``lm_head.bias``, which transformers does not know
        about) is resized with the decoder, tied or not."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        head = getattr(self, "lm_head", None)
        if isinstance(head, HfxReformerLMHead):
            head.match_bias_to_decoder()
        return embeddings


class HfxReformerModel(HfxReformerPreTrainedModel):
    """Reformer encoder (or decoder, with ``config.is_decoder``). Output width is ``2 * hidden_size``.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxReformerConfig, HfxReformerModel
        >>> config = HfxReformerConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     attention_head_size=16, feed_forward_size=64,
        ...     attn_layers=["local", "lsh"], local_attn_chunk_length=8,
        ...     lsh_attn_chunk_length=8, num_buckets=4, axial_pos_shape=[8, 8],
        ...     axial_pos_embds_dim=[16, 16], max_position_embeddings=64,
        ... )
        >>> model = HfxReformerModel(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 32))
        >>> out = model(input_ids, attention_mask=torch.ones_like(input_ids))
        >>> out.last_hidden_state.shape  # the two reversible streams, concatenated
        torch.Size([2, 32, 64])
    """

    # Attention differs per layer (config.attn_layers); neither kind has global tokens.
    attention_class = None

    def __init__(self, config: HfxReformerConfig, add_pooling_layer: bool = False) -> None:
        super().__init__(config)
        self.embeddings = HfxReformerEmbeddings(config)
        self.encoder = HfxReformerEncoder(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, global_attention_mask, token_type_ids, cache,
                      packed=None, position_ids=None):  # fmt: skip
        shape = token_shape(input_ids, inputs_embeds)
        if len(shape) != 2:
            refuse("input_rank", f"`input_ids` must have shape (batch, seq_len), got {shape}")
        past = cache.get_seq_length() if cache is not None else 0
        longest = past + shape[1]
        if packed is not None:
            # A packed row may be longer than the table: each document must fit (its positions restart). Read where
            # reading is free, else the longest document the batch states (`max_length_q`), if it does.
            longest = int(position_ids.max()) + 1 if reads_values(position_ids) else (packed.longest or 0)
        if longest > self.config.max_position_embeddings:
            refuse(
                "sequence_too_long",
                f"Sequence length {longest} exceeds config.max_position_embeddings ({self.config.max_position_embeddings})",
            )
        if past and shape[1] != 1:
            raise ValueError(
                f"With a filled `past_buckets_states` cache the model decodes one position at a time; got {shape[1]}."
            )
        if global_attention_mask is not None:
            refuse("no_global_attention", "Reformer has no global attention")
        if token_type_ids is not None:
            refuse("token_type_range", "Reformer has no token types (`token_type_ids` given)")
        # With a cache: the mask of every position so far (what generate() passes) or of the new one alone.
        accepted = [shape, (shape[0], past + shape[1])] if past else [shape]
        if attention_mask is not None and tuple(attention_mask.shape) not in accepted:
            cached = f" or cover the cached positions too {(shape[0], past + shape[1])}" if past else ""
            refuse(
                "mask_shape",
                f"`attention_mask` must have the shape of `input_ids` {shape}{cached}, got {tuple(attention_mask.shape)}",
            )
        check_token_ids(input_ids, self.config.vocab_size)
        check_not_empty(shape, "input_ids" if input_ids is not None else "inputs_embeds")
        check_embeds_width(inputs_embeds, self.get_input_embeddings().embedding_dim)
        check_position_ids(position_ids, shape, 0, self.config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        num_hashes: int | None = None,
        past_buckets_states: HfxReformerCache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        global_attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        seq_idx: torch.Tensor | None = None,
        packed_batch: PackedBatch | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxReformerModelOutput | tuple:
        """Encode (or decode) a batch, or a packed batch of documents (transformers' ``DataCollatorWithFlattening``
        with ``position_ids_start=0``).

        Args:
            input_ids: ``(batch, seq_len)`` (or ``inputs_embeds`` ``(batch, seq_len, hidden)``); any length up to
                ``max_position_embeddings``.
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding.
            position_ids: ``(batch, seq_len)`` from 0 (None: ``0, 1, ...``, or each document's own count).
            num_hashes: hashing rounds for this call (None: ``config.num_hashes``).
            past_buckets_states: cache from an earlier call (decoders): the input is then one new position.
            use_cache: return a cache (decoders in eval; default ``config.use_cache``).
            output_attentions: also return every layer's attention probabilities ``(batch, heads, seq_len, seq_len)``.
            output_hidden_states: also return the ``x2`` stream before every layer and after the last.
            return_dict: an :class:`HfxReformerModelOutput` (None: ``config.return_dict``) or a plain tuple.
            global_attention_mask: refused (Reformer has no global tokens).
            token_type_ids: refused (Reformer has no token types).
            seq_idx: ``(batch, seq_len)``, the document of every token of a packed batch.
            packed_batch: the batch's :class:`~hf_xformers.ops.packing.PackedBatch`, as the heads resolve it once
                (None: resolved here from ``seq_idx``, ``kwargs`` and ``attention_mask``).
            **kwargs: ``cu_seq_lens_q/k`` (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`) as ``(num_documents +
                1,)`` cumulative lengths of one row, and ``max_length_q/k``, the longest document, checked against the
                position table where the positions are not read. A packed batch's documents each get
                what their own forward gives, and each may be up to ``max_position_embeddings`` long; padding
                (``attention_mask``) is never part of a document. Traced graphs need ``cu_seq_lens_q/k``; packed
                batches take no cache.
        Returns:
            :class:`HfxReformerModelOutput`, ``last_hidden_state`` ``(batch, seq_len, 2 * hidden_size)``.
        """
        cache = past_buckets_states
        packing = packing_kwargs(self, kwargs, seq_idx)
        reference = input_ids if input_ids is not None else inputs_embeds
        packed = packed_batch
        if packed is None and reference is not None and reference.dim() == (2 if input_ids is not None else 3):
            packed = self._resolve_packed(reference, attention_mask, position_ids, packing)
        if packed is not None:
            position_ids = self._packed_position_ids(packed, position_ids, cache, use_cache)
            use_cache = False
        self._check_inputs(input_ids, inputs_embeds, attention_mask, global_attention_mask, token_type_ids, cache,
                           packed, position_ids)  # fmt: skip
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        use_cache = config.use_cache if use_cache is None else use_cache
        use_cache = bool(use_cache and config.is_decoder and not self.training) or cache is not None
        if packed is not None:
            return self._packed_forward(
                input_ids, attention_mask, position_ids, inputs_embeds, num_hashes, packed, output_attentions,
                output_hidden_states, return_dict,
            )  # fmt: skip
        out = self._forward_rows(
            input_ids, attention_mask, position_ids, inputs_embeds, num_hashes, cache, use_cache, output_attentions,
            output_hidden_states,
        )  # fmt: skip
        return self._finish(out, return_dict)

    def _forward_rows(self, input_ids, attention_mask, position_ids, inputs_embeds, num_hashes, cache, use_cache,
                      output_attentions, output_hidden_states) -> HfxReformerModelOutput:  # fmt: skip
        """An ordinary (unpacked) batch, checked, or one new position after ``cache``: embed, pad to the chunks, run
        the layers (filling or reading the cache when ``use_cache``) and cut back to the input's length."""
        reference = input_ids if input_ids is not None else inputs_embeds
        seq_len = reference.shape[1]
        start = cache.get_seq_length() if cache is not None else 0
        hidden = self.embeddings(input_ids, position_ids, inputs_embeds, start=start)
        # "Is anything padded" is read once here (one host read in eager mode); an all-ones mask becomes None, so no
        # layer masks, and no layer reads mask values back.
        if start:
            attention_mask = mask = self._decode_key_mask(cache, attention_mask, start)
            padded_lengths = None
        else:
            attention_mask = unpadded_to_none(None if attention_mask is None else attention_mask.bool())
            hidden, mask, padded_lengths = self._padded_to_chunks(hidden, attention_mask)
        if use_cache and cache is None:
            cache = HfxReformerCache()
        cache = cache if use_cache else None
        shards = current_shards()
        if shards is not None:
            hidden = self._local_tokens(hidden, shards)
        hidden, all_hidden, all_attn = self.encoder(
            hidden, mask, padded_lengths, num_hashes, output_attentions, output_hidden_states, cache=cache,
            cache_length=seq_len, sequence_parallel=shards,
        )  # fmt: skip
        if shards is not None:
            hidden = shards.gather(hidden)
        all_hidden = all_hidden if output_hidden_states else None
        all_attn = all_attn if output_attentions else None
        return _cut_output(hidden, all_hidden, all_attn, cache, seq_len, start)

    def _local_tokens(self, hidden: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
        """This rank's tokens of the embeddings padded to the chunks, ``(batch, padded / size, hidden)``, for a
        sequence-parallel forward (``ops/sequence_parallel.py``); the encoder runs on them."""
        padded = hidden.shape[1]
        if padded % shards.size:
            raise ValueError(
                f"Reformer pads this batch to {padded} positions (a multiple of its chunk lengths, "
                f"config.chunk_multiple={self.config.chunk_multiple}), which the {shards.size} sequence-parallel ranks "
                f"cannot share equally: pad the batch to a multiple of {self.config.chunk_multiple} (pad_to_multiple_of) "
                "or choose an sp_size that divides it."
            )
        return shards.local(hidden)

    @staticmethod
    def _resolve_packed(reference, attention_mask, position_ids, packing: PackedBatchKwargs) -> PackedBatch | None:
        """The documents of a packed batch (``reference``: ``input_ids`` or ``inputs_embeds``; ``packing``: the
        forward's :class:`~hf_xformers.ops.packing.PackedBatchKwargs`), or None, resolved as the heads resolve them,
        with the mask where it covers the new tokens only (a cached step's mask covers the cache too)."""
        shape = tuple(reference.shape[:2])
        return resolve_packed_batch(
            shape, reference.device, position_ids,
            attention_mask=attention_mask if attention_mask is None or attention_mask.shape == shape else None,
            **packing,
        )  # fmt: skip

    def _padded_to_chunks(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """An input longer than the shortest chunk padded to a multiple of the chunk lengths: ``hidden`` ``(batch,
        seq_len, hidden)`` -> ``(batch, padded, hidden)``, its key mask ``(batch, padded)`` (None: nothing padded) and
        the length each example would be padded to alone ``(batch,)`` (None without an ``attention_mask``, see
        ``attention/chunked_local.py``)."""
        config = self.config
        batch, seq_len = hidden.shape[:2]
        device = hidden.device
        mask = attention_mask
        multiple = config.chunk_multiple
        # Traced graphs (torch.compile / torch.export) always pad, by 0 at a multiple: no branch on the remainder.
        if seq_len > config.min_chunk_length and (torch.compiler.is_compiling() or seq_len % multiple):
            pad = ceil_div(seq_len, multiple) * multiple - seq_len
            hidden = nn.functional.pad(hidden, (0, 0, 0, pad))
            if mask is None:
                mask = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
            mask = nn.functional.pad(mask, (0, pad), value=False)
        if attention_mask is None:
            return hidden, mask, None
        positions = torch.arange(1, seq_len + 1, device=device)
        extent = (attention_mask * positions).amax(-1).clamp(min=1)
        padded_lengths = torch.where(
            extent > config.min_chunk_length, (extent + multiple - 1) // multiple * multiple, extent
        )
        return hidden, mask, padded_lengths

    @staticmethod
    def _decode_key_mask(
        cache: HfxReformerCache, attention_mask: torch.Tensor | None, cached: int
    ) -> torch.Tensor | None:
        """The key mask of a cached step, ``(batch, cached + 1)`` bool or None (nothing padded): the given mask when
        it covers every position (as ``generate()`` passes it), else the cache's mask extended by the new
        position's (``(batch, 1)``, or real when None)."""
        if attention_mask is not None and attention_mask.shape[1] == cached + 1:
            return unpadded_to_none(attention_mask.bool())
        if attention_mask is None and cache.key_mask is None:
            return None
        batch = cache.states[0].shape[0]
        device = cache.states[0].device
        past = cache.key_mask
        if past is None:
            past = torch.ones(batch, cached, dtype=torch.bool, device=device)
        new = torch.ones(batch, 1, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        return unpadded_to_none(torch.cat([past, new], dim=1))

    def _packed_position_ids(
        self, packed: PackedBatch, position_ids: torch.Tensor | None, cache, use_cache: bool | None
    ) -> torch.Tensor:
        """The positions of a packed batch (each document's own, from 0), after refusing what packing cannot do."""
        if cache is not None or use_cache:
            raise ValueError(
                "A packed (padding-free) batch cannot use or fill a decoding cache: drop `past_buckets_states` and "
                "pass use_cache=False (generate() decodes ordinary batches)."
            )
        if position_ids is None:
            return packed.positions
        if reads_values(position_ids):  # eager, where the read is free
            first = torch.where(packed.starts, position_ids, torch.zeros_like(position_ids))
            if bool(first.any()):
                starts = sorted(set(first[first != 0].tolist()))[:4]
                refuse(
                    "packed_position_start",
                    "In a packed batch every document's positions must start at 0, Reformer's first position, but "
                    f"some start at {starts}: Reformer needs position_ids_start=0",
                )
        return position_ids

    def _packed_forward(self, input_ids, attention_mask, position_ids, inputs_embeds, num_hashes, packed,
                        output_attentions, output_hidden_states, return_dict):  # fmt: skip
        """A packed batch ``(batch, packed_len)`` (:class:`~hf_xformers.ops.packing.PackedBatch` ``packed``): embed,
        lay the documents out in the internal row (:func:`lay_out_documents`), run the layers there and gather the
        packed tokens back."""
        config = self.config
        hidden = self.embeddings(input_ids, position_ids, inputs_embeds)
        batch = hidden.shape[0]
        layout, slots, length = lay_out_documents(packed, config.chunk_multiple, config.min_chunk_length)
        index = slots[..., None].expand(-1, -1, hidden.shape[-1])
        row = hidden.new_zeros(batch, length, hidden.shape[-1]).scatter(1, index, hidden)
        # Real tokens are those of a document (padding holds document number `count`); empty slots stay masked.
        real = packed.index < packed.count
        row_mask = torch.zeros(batch, length, dtype=torch.bool, device=hidden.device).scatter(1, slots, real)
        shards = current_shards()
        row, all_hidden, all_attn = self.encoder(
            row if shards is None else self._local_tokens(row, shards), row_mask, None, num_hashes, output_attentions,
            output_hidden_states, documents=layout, slots=slots, sequence_parallel=shards,
        )  # fmt: skip
        if shards is not None:
            row = shards.gather(row)
        attentions = None
        if output_attentions:
            rows = slots[:, None, :, None].expand(-1, all_attn[0].shape[1], -1, length)
            cols = slots[:, None, None, :].expand(-1, all_attn[0].shape[1], slots.shape[1], -1)
            attentions = tuple(a.gather(2, rows).gather(3, cols) for a in all_attn)
        out = HfxReformerModelOutput(
            last_hidden_state=row.gather(1, slots[..., None].expand(-1, -1, row.shape[-1])),
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=attentions,
        )
        return self._finish(out, return_dict)


# ----------------------------------------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------------------------------------


class HfxReformerLMHead(nn.Module):
    """``decoder([y1; y2]) + bias`` over ``2 * hidden_size`` features, ``chunk_size_lm_head`` positions at a time.

    transformers 5 keeps ``lm_head.bias`` as a parameter but no longer adds it (4.x tied it to the decoder); the
    bias is added here, so imported checkpoints score as they were trained.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.chunk_size = config.chunk_size_lm_head
        self.decoder = nn.Linear(2 * config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return chunked_over_positions(self.forward_chunk, hidden_states, self.chunk_size)

    def forward_chunk(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(hidden_states) + self.bias

    @torch.no_grad()
    def match_bias_to_decoder(self) -> None:
        """After the vocabulary was resized (the decoder has new rows): keep the bias of the tokens that remain, 0 for
        new ones (what transformers does for a bias carried by the decoder itself)."""
        size = self.decoder.out_features
        if self.bias.shape[0] == size:
            return
        bias = self.bias.new_zeros(size)
        keep = min(size, self.bias.shape[0])
        bias[:keep] = self.bias[:keep]
        self.bias = nn.Parameter(bias, requires_grad=self.bias.requires_grad)


class _ReformerHeadSizes:
    """Task heads read ``[y1; y2]``, twice the hidden size."""

    def head_input_size(self, config) -> int:
        return 2 * config.hidden_size


class HfxReformerForMaskedLM(_ReformerHeadSizes, HfxMaskedLMHeadMixin, HfxReformerPreTrainedModel):
    """Reformer with a masked-language-modelling head over both reversible streams (a decoder ``2 * hidden_size``
    wide, plus a bias); bidirectional, so ``config.is_decoder`` must be False.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxReformerConfig, HfxReformerForMaskedLM
        >>> config = HfxReformerConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     attention_head_size=16, feed_forward_size=64,
        ...     attn_layers=["local", "lsh"], local_attn_chunk_length=8,
        ...     lsh_attn_chunk_length=8, num_buckets=4, axial_pos_shape=[8, 8],
        ...     axial_pos_embds_dim=[16, 16], max_position_embeddings=64,
        ... )
        >>> model = HfxReformerForMaskedLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 32))
        >>> labels = torch.full_like(input_ids, -100)
        >>> labels[:, 5] = input_ids[:, 5]
        >>> out = model(input_ids, labels=labels)
        >>> out.logits.shape, out.loss.dim()
        (torch.Size([2, 32, 100]), 0)
    """

    base_model_class = HfxReformerModel
    lm_head_class = HfxReformerLMHead

    def __init__(self, config: HfxReformerConfig) -> None:
        if config.is_decoder:
            raise ValueError(
                "HfxReformerForMaskedLM needs bidirectional attention: set is_decoder=False in the config "
                "(HfxReformerForCausalLM is the decoder)."
            )
        super().__init__(config)


class HfxReformerForSequenceClassification(
    _ReformerHeadSizes, HfxSequenceClassificationHeadMixin, HfxReformerPreTrainedModel
):
    """Reformer with a classification or regression head on both streams' first token, or on the mean of the tokens with
    ``config.classifier_pooling = "mean"``; the loss follows ``config.problem_type``. A packed batch is classified per
    document.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxReformerConfig
        >>> from hf_xformers import HfxReformerForSequenceClassification
        >>> config = HfxReformerConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     attention_head_size=16, feed_forward_size=64,
        ...     attn_layers=["local", "lsh"], local_attn_chunk_length=8,
        ...     lsh_attn_chunk_length=8, num_buckets=4, axial_pos_shape=[8, 8],
        ...     axial_pos_embds_dim=[16, 16], max_position_embeddings=64,
        ...     num_labels=3,
        ... )
        >>> model = HfxReformerForSequenceClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 32))
        >>> model(input_ids, labels=torch.tensor([0, 2])).logits.shape
        torch.Size([2, 3])
    """

    base_model_class = HfxReformerModel


class HfxReformerForQuestionAnswering(_ReformerHeadSizes, HfxQuestionAnsweringHeadMixin, HfxReformerPreTrainedModel):
    """Reformer for extractive question answering: a start and an end logit for every token.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxReformerConfig, HfxReformerForQuestionAnswering
        >>> config = HfxReformerConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     attention_head_size=16, feed_forward_size=64,
        ...     attn_layers=["local", "lsh"], local_attn_chunk_length=8,
        ...     lsh_attn_chunk_length=8, num_buckets=4, axial_pos_shape=[8, 8],
        ...     axial_pos_embds_dim=[16, 16], max_position_embeddings=64,
        ... )
        >>> model = HfxReformerForQuestionAnswering(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 32))
        >>> start, end = torch.tensor([3, 9]), torch.tensor([5, 12])
        >>> out = model(input_ids, start_positions=start, end_positions=end)
        >>> out.start_logits.shape, out.end_logits.shape
        (torch.Size([2, 32]), torch.Size([2, 32]))
    """

    base_model_class = HfxReformerModel


class HfxReformerForCausalLM(HfxCausalLMHeadMixin, HfxReformerPreTrainedModel, GenerationMixin):
    """Left-to-right language model (transformers' ``ReformerModelWithLMHead``).

    The model is always causal: a config with ``is_decoder=False`` is copied with ``is_decoder=True``. ``labels``
    ``(batch, seq_len)`` are the input ids (shifted inside; -100 = no loss) or, as transformers' causal LMs accept,
    ``shift_labels`` already shifted. ``generate()`` keeps the normalised layer inputs and LSH buckets of earlier
    positions and their key mask in :class:`HfxReformerCache` and feeds one new token per step, as transformers does
    (greedy, sampling, beam search): every step gives the logits of a full forward over the sequence so far under its
    attention mask, so a left-padded batch decodes with the cache too (transformers' Reformer drops the mask in
    generate()). Positions count from the first slot, padding included, as in transformers' Reformer, unless
    ``position_ids`` are given.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxReformerConfig, HfxReformerForCausalLM
        >>> config = HfxReformerConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     attention_head_size=16, feed_forward_size=64,
        ...     attn_layers=["local", "lsh"], local_attn_chunk_length=8,
        ...     lsh_attn_chunk_length=8, num_buckets=4, axial_pos_shape=[8, 8],
        ...     axial_pos_embds_dim=[16, 16], max_position_embeddings=64,
        ... )
        >>> model = HfxReformerForCausalLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 32))
        >>> out = model(input_ids, labels=input_ids)  # shifted inside
        >>> out.logits.shape
        torch.Size([2, 32, 100])
        >>> prompt = input_ids[:, :8]
        >>> model.generate(prompt, min_new_tokens=4, max_new_tokens=4).shape
        torch.Size([2, 12])
    """

    base_model_class = HfxReformerModel
    lm_head_class = HfxReformerLMHead
    generation_cache_argument = "past_buckets_states"

    def __init__(self, config: HfxReformerConfig) -> None:
        if ("local" in config.attn_layers and config.local_num_chunks_after) or (
            "lsh" in config.attn_layers and config.lsh_num_chunks_after
        ):
            raise ValueError(
                "A causal language model cannot look at later chunks: set local_num_chunks_after and "
                "lsh_num_chunks_after to 0."
            )
        super().__init__(config)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        num_hashes: int | None = None,
        past_buckets_states: HfxReformerCache | None = None,
        use_cache: bool | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        *,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxReformerCausalLMOutput | tuple:
        """Returns ``logits`` ``(batch, seq_len, vocab)``; the mean next-token cross-entropy with ``labels`` or
        ``shift_labels`` (summed and divided by ``num_items_in_batch`` when given, as Trainer does).

        A packed batch (``DataCollatorWithFlattening(position_ids_start=0)``: ``seq_idx``, or ``kwargs``,
        :class:`~hf_xformers.ops.packing.CuSeqLensKwargs`) is read as documents that never see each other (see
        :class:`HfxReformerModel`), and no document's last token is scored against the next document's first.

        Args:
            input_ids: ``(batch, seq_len)`` token ids (with a filled cache: one new position), or a packed row.
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding; with a cache also
                ``(batch, past + seq_len)``.
            position_ids: ``(batch, seq_len)`` from 0 (None: ``0, 1, ...``, or each document's own count).
            inputs_embeds: ``(batch, seq_len, hidden)``, instead of ``input_ids``.
            num_hashes: hashing rounds for this call (None: ``config.num_hashes``).
            past_buckets_states: the :class:`HfxReformerCache` an earlier call returned.
            use_cache: start or continue a cache and return it (None: ``config.use_cache``).
            labels: ``(batch, seq_len)``, usually the input ids; -100 where no loss is wanted; shifted inside.
            shift_labels: ``(batch, seq_len)`` labels already aligned with the positions (used instead of ``labels``).
            num_items_in_batch: the number of scored tokens over the accumulated batch (Trainer).
            output_attentions: also return every layer's attention probabilities.
            output_hidden_states: also return the hidden states before every layer and after the last.
            return_dict: an :class:`HfxReformerCausalLMOutput` (None: ``config.return_dict``) or a plain tuple.
            seq_idx: ``(batch, seq_len)``, the document of every token of a packed batch.
            **kwargs: the boundaries of a packed row (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`:
                ``cu_seq_lens_q/k`` with ``max_length_q/k``).

        Returns:
            ``HfxReformerCausalLMOutput``: ``loss``, ``logits`` ``(batch, seq_len, vocab_size)``,
            ``past_buckets_states`` (with ``use_cache``), ``hidden_states`` and ``attentions`` when asked.
        """
        packing = packing_kwargs(self, kwargs, seq_idx)
        documents = None
        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is not None and reference.dim() == (2 if input_ids is not None else 3):
            documents = self._packed_batch(input_ids, inputs_embeds, position_ids, attention_mask, packing)
        out = self.reformer(
            input_ids, attention_mask, position_ids, inputs_embeds, num_hashes, past_buckets_states, use_cache,
            output_attentions, output_hidden_states, return_dict=True, packed_batch=documents,
        )  # fmt: skip
        logits = self.lm_head(out.last_hidden_state)
        if documents is not None and shift_labels is None and labels is not None:
            shift_labels = next_token_labels(labels, documents.starts)
        loss = causal_lm_loss(logits, labels, shift_labels, num_items_in_batch)
        result = HfxReformerCausalLMOutput(
            loss=loss, logits=logits, past_buckets_states=out.past_buckets_states,
            hidden_states=out.hidden_states, attentions=out.attentions,
        )  # fmt: skip
        return self._finish(result, return_dict)

    # ----- generation --------------------------------------------------------------------------------------
    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        return None  # positions follow the cache length

    def _cache_of_output(self, outputs) -> HfxReformerCache | None:
        return outputs.past_buckets_states
