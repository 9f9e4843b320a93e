"""``hfx-transfo-xl``: Transformer-XL (Dai et al., 2019), a causal language model with segment-level recurrence.

Each layer attends over its own segment plus a memory: the inputs it saw in earlier segments (detached, at most
``mem_len`` per layer), with relative positional encodings (``attention/relative_memory.py``). Tokens enter through
adaptive input embeddings and leave through an adaptive softmax (``models/transfo_xl/adaptive_softmax.py``).

Memories are batch-first: a tuple with one ``(batch, memory_len, d_model)`` tensor per layer. Every forward takes
``mems`` and returns the updated ones; pass them back with the next segment of the same streams (same batch rows).
``mems=None`` starts with an empty memory (the original code's behaviour; ``transformers`` 4.x instead attends to
``mem_len`` zero vectors, which ``zero_memories()`` reproduces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput
from typing_extensions import Unpack

from ...attention.relative_memory import (
    HfxRelativeMemoryAttention,
    allowed_keys,
    relative_distances,
    sinusoid_positions,
)
from ...layers.generation import HfxGenerationMixin
from ...layers.losses import check_sequence_labels, sequence_classification_loss
from ...layers.pooling import pool_tokens
from ...layers.pretrained import HfxPreTrainedModel
from ...ops.input_checks import (
    check_embeds_width,
    check_not_empty,
    check_token_ids,
    is_tracing,
    refuse,
    token_shape,
    unpadded_to_none,
)
from ...ops.packing import (
    CuSeqLensKwargs,
    PackedBatch,
    PackedBatchKwargs,
    marks_documents,
    packing_kwargs,
    refuse_packed,
    resolve_packed_batch,
)
from .adaptive_softmax import HfxAdaptiveEmbedding, HfxAdaptiveLogSoftmax
from .configuration_transfo_xl import HfxTransfoXLConfig

Memories = tuple[torch.Tensor, ...]


# Why Transformer-XL refuses a packed batch, and what to do instead (ops/packing.refuse_packed).
PACKING_REFUSAL = (
    "its memories carry hidden states across the segments of one stream, so packed documents would attend to each "
    "other through the memory and the relative positions, which run across the whole row",
    "Feed one stream per row instead, with examples/run_clm.py (HfxStreamSegments + HfxRecurrentTrainer carry the "
    "memories across steps), or pad the batch (DataCollatorWithPadding) rather than flattening it.",
)


@dataclass
class HfxTransfoXLModelOutput(ModelOutput):
    """``last_hidden_state`` ``(batch, seq_len, d_model)``; ``mems``: per layer ``(batch, memory_len, d_model)``
    for the next segment (None when ``mem_len == 0``); ``hidden_states``: ``n_layer + 1`` tensors
    ``(batch, seq_len, d_model)``; ``attentions``: per layer ``(batch, n_head, seq_len, memory_len + seq_len)``."""

    last_hidden_state: torch.Tensor | None = None
    mems: Memories | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class HfxTransfoXLCausalLMOutput(ModelOutput):
    """``loss``: mean over scored tokens; ``logits``: log-probabilities ``(batch, seq_len, vocab_size)`` (the
    adaptive softmax yields normalised scores); ``losses``: per-token negative log-likelihoods ``(batch, n_targets)``,
    0 where ignored; ``mems`` etc. as in :class:`HfxTransfoXLModelOutput`."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    losses: torch.Tensor | None = None
    mems: Memories | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class HfxTransfoXLSequenceClassifierOutput(ModelOutput):
    """``logits`` ``(batch, num_labels)`` from the last real token; other fields as above."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    mems: Memories | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class HfxTransfoXLPreTrainedModel(HfxPreTrainedModel):
    """The shared defaults of :class:`~hf_xformers.layers.pretrained.HfxPreTrainedModel`, with Transformer-XL's own
    weight init, vocabulary resizing (adaptive clusters) and zero memories."""

    config_class = HfxTransfoXLConfig
    sequence_parallel_refusal = (
        "its memories hold the previous segment's hidden states of every token and its relative positions "
        "span memory and segment; train with shorter segments (mem_len) instead"
    )
    base_model_prefix = "transformer"
    _no_split_modules = ["HfxTransfoXLLayer"]
    # attn_implementation: relative-position attention has one kernel (attention/relative_memory.py), explicit scores
    # with the position term; "eager" and "sdpa" both run it (no fused form takes the shifted position scores), and it
    # is no FlexAttention score_mod that pays (the term is a per-distance dot product, a full score-sized tensor).
    # HfxPreTrainedModel's _supports_flex_attn = False says so.

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Not the shared init: the original's scales are init_std and proj_init_std (no initializer_range), and the
        # relative biases, adaptive projections and cluster logits need their own.
        std, proj_std = self.config.init_std, self.config.proj_init_std
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, HfxRelativeMemoryAttention):
            nn.init.normal_(module.r_w_bias, 0.0, std)
            nn.init.normal_(module.r_r_bias, 0.0, std)
        elif isinstance(module, nn.ParameterList):
            # The only parameter lists are the adaptive projections (emb_projs, out_projs). transformers calls this
            # for every module holding parameters directly, i.e. for the lists, not for their adaptive parents.
            for proj in module:
                nn.init.normal_(proj, 0.0, proj_std)
        elif isinstance(module, HfxAdaptiveLogSoftmax):
            if module.n_tail:
                nn.init.normal_(module.cluster_weight, 0.0, std)
                nn.init.zeros_(module.cluster_bias)

    def __init__(self, config: HfxTransfoXLConfig, *inputs, **kwargs) -> None:
        # from_pretrained(..., vocab_size=N) sets fields after the config validated itself: check again before
        # building tables from them (else torch fails with "negative dimension").
        config.validate_transfo_xl()
        super().__init__(config, *inputs, **kwargs)

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> HfxAdaptiveEmbedding:
        """Resize the vocabulary to ``new_num_tokens`` (rounded up to ``pad_to_multiple_of``) and return the input
        embeddings.

        Tokens are added or removed at the end of the vocabulary, i.e. in the last adaptive cluster (the only one
        with no ``cutoffs``); the adaptive softmax follows and stays tied. New rows start at the mean of the old
        ones (``mean_resizing=True``) or are drawn from ``N(0, init_std)``. A size that would empty the last cluster
        raises a ``ValueError``: cutoffs cannot move without retraining the clusters.
        """
        embeddings = self.base_model.word_emb
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embeddings
        new_size = self.config.vocab_size if new_num_tokens is None else int(new_num_tokens)
        if pad_to_multiple_of is not None:
            new_size = -(-new_size // pad_to_multiple_of) * pad_to_multiple_of
        std = None if mean_resizing else self.config.init_std
        embeddings.resize_vocab(new_size, std)
        softmax = getattr(self, "adaptive_softmax", None)
        if softmax is not None:
            softmax.resize_vocab(new_size, std)
        self.config.vocab_size = new_size
        # The new softmax layer has its own weight; tying points it at the new embedding table again.
        self.tie_weights()
        return embeddings

    def zero_memories(self, batch_size: int) -> Memories:
        """``n_layer`` zero memories ``(batch_size, mem_len, d_model)``: what ``transformers`` 4.x starts from."""
        param = next(self.parameters())
        shape = (batch_size, self.config.mem_len, self.config.d_model)
        return tuple(param.new_zeros(shape) for _ in range(self.config.n_layer))


class HfxTransfoXLLayer(GradientCheckpointingLayer):
    """Relative-position attention over memory + segment, then a ReLU feed-forward block; post-LN (the paper)
    or pre-LN (``pre_lnorm``), each sub-layer with a residual connection."""

    def __init__(self, config: HfxTransfoXLConfig, layer_idx: int) -> None:
        super().__init__()
        self.pre_lnorm = config.pre_lnorm
        self.attention = HfxRelativeMemoryAttention(config, layer_idx)
        self.attention_output = nn.Linear(config.n_head * config.d_head, config.d_model, bias=False)
        self.attention_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.ff_in = nn.Linear(config.d_model, config.d_inner)
        self.ff_out = nn.Linear(config.d_inner, config.d_model)
        self.ff_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        position_encodings: torch.Tensor,
        allowed: torch.Tensor,
        memory: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden`` ``(batch, q, d_model)``, ``memory`` ``(batch, m, d_model)`` or None; see the attention module
        for ``position_encodings`` ``(m + q, d_model)`` and ``allowed`` ``(q, m + q)``. Returns the new hidden states
        ``(batch, q, d_model)`` and the attention probabilities (or None)."""
        states = hidden if memory is None else torch.cat([memory, hidden], dim=1)
        if self.pre_lnorm:
            # Pre-LN normalises the memory too, as the keys and values come from it.
            states = self.attention_layer_norm(states)
        context, probs, _ = self.attention(states, hidden.shape[1], position_encodings, allowed, output_attentions)
        attended = self.dropout(self.attention_output(context))
        if self.pre_lnorm:
            hidden = hidden + attended
            ff = self.dropout(self.ff_out(self.dropout(F.relu(self.ff_in(self.ff_layer_norm(hidden))))))
            return hidden + ff, probs
        hidden = self.attention_layer_norm(hidden + attended)
        ff = self.dropout(self.ff_out(self.dropout(F.relu(self.ff_in(hidden)))))
        return self.ff_layer_norm(hidden + ff), probs


class HfxTransfoXLModel(HfxTransfoXLPreTrainedModel):
    """Adaptive embeddings -> ``n_layer`` :class:`HfxTransfoXLLayer` with memories. No pooler.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxTransfoXLConfig, HfxTransfoXLModel
        >>> config = HfxTransfoXLConfig(
        ...     vocab_size=100, cutoffs=[20, 50], d_model=32, d_embed=32, n_head=2,
        ...     d_head=16, d_inner=64, n_layer=2, mem_len=16,
        ... )
        >>> model = HfxTransfoXLModel(config).eval()
        >>> segment_1, segment_2 = torch.randint(0, 100, (2, 2, 12))  # 2 streams each
        >>> out = model(segment_1)
        >>> out = model(segment_2, mems=out.mems)  # sees segment 1 through the memory
        >>> out.last_hidden_state.shape, len(out.mems), out.mems[0].shape
        (torch.Size([2, 12, 32]), 2, torch.Size([2, 16, 32]))
    """

    def __init__(self, config: HfxTransfoXLConfig, add_pooling_layer: bool = False) -> None:
        super().__init__(config)
        self.word_emb = HfxAdaptiveEmbedding(
            config.vocab_size, config.d_embed, config.d_model, config.cutoffs, config.div_val
        )
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(HfxTransfoXLLayer(config, i) for i in range(config.n_layer))
        self.post_init()

    def get_input_embeddings(self) -> HfxAdaptiveEmbedding:
        return self.word_emb

    def set_input_embeddings(self, value: HfxAdaptiveEmbedding) -> None:
        self.word_emb = value

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, mems) -> tuple[int, int]:
        shape = token_shape(input_ids, inputs_embeds)
        if len(shape) != 2:
            refuse("input_rank", f"`input_ids` must have shape (batch, seq_len), got {shape}")
        check_token_ids(input_ids, self.config.vocab_size)
        check_not_empty(shape, "input_ids" if input_ids is not None else "inputs_embeds")
        check_embeds_width(inputs_embeds, self.config.d_model)
        if attention_mask is not None and (
            attention_mask.dim() != 2 or attention_mask.shape[0] != shape[0] or attention_mask.shape[1] < shape[1]
        ):
            refuse(
                "mask_shape",
                f"`attention_mask` must have the shape of `input_ids` {shape} (or cover the memory too: "
                f"(batch, memory + seq_len)), got {tuple(attention_mask.shape)}",
            )
        if mems is not None:
            if len(mems) != self.config.n_layer:
                raise ValueError(
                    f"`mems` must hold one tensor per layer ({self.config.n_layer}), got {len(mems)}; pass back the "
                    "`mems` of the previous output unchanged."
                )
            expected = (shape[0], self.config.d_model)
            for mem in mems:
                if mem.dim() != 3 or (mem.shape[0], mem.shape[2]) != expected or mem.shape[1] != mems[0].shape[1]:
                    raise ValueError(
                        f"`mems` tensors must be (batch={shape[0]}, memory_len, d_model={self.config.d_model}), got "
                        f"{tuple(mem.shape)}. Memories belong to the batch rows they were made with: keep each stream "
                        "in the same row, or pass mems=None to start afresh."
                    )
        return shape

    def _refuse_packed(
        self,
        shape: tuple[int, int],
        device: torch.device,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        packing: PackedBatchKwargs,
        packed_batch=None,
    ) -> None:
        """Raise the ``ValueError`` of :func:`~hf_xformers.ops.packing.refuse_packed` for a packed batch (several
        documents in a row, marked in either of ``DataCollatorWithFlattening``'s forms: ``packing``, the forward's
        :class:`~hf_xformers.ops.packing.PackedBatchKwargs`, or a head's ``packed_batch``); an ordinary batch passes,
        whatever its ``position_ids`` (positions never mark documents)."""
        documents = packed_batch
        if documents is None and marks_documents(packing):
            documents = resolve_packed_batch(shape, device, position_ids, attention_mask=attention_mask, **packing)
        if documents is not None:
            refuse_packed(type(self).__name__, *PACKING_REFUSAL)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        mems: Memories | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        seq_idx: torch.Tensor | None = None,
        packed_batch: PackedBatch | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxTransfoXLModelOutput | tuple:
        """Encode one segment of each stream.

        Args:
            input_ids: ``(batch, seq_len)`` token ids (or ``inputs_embeds`` ``(batch, seq_len, d_model)``).
            mems: the ``mems`` of the previous segment's output (per layer ``(batch, memory_len, d_model)``), or None.
                Memories longer than ``config.mem_len`` are cut to their last ``mem_len`` positions (what the model
                itself returns), so the model never attends further back than it was configured (and trained) to;
                with ``mem_len == 0`` they are ignored. Raise ``config.mem_len`` to use a longer memory at evaluation.
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding (left or right): padded keys are
                masked. It may also cover earlier tokens (``(batch, past + seq_len)``, what ``generate()`` passes):
                its last ``memory + seq_len`` columns then mask the memory too; memory it does not cover counts as
                real, and ``attentions`` then cover all of its columns (0 for tokens no longer in the memory).
            inputs_embeds: ``(batch, seq_len, d_model)``, instead of ``input_ids``.
            output_attentions: also return every layer's attention probabilities
                ``(batch, n_head, seq_len, memory_len + seq_len)``.
            output_hidden_states: also return the hidden states after the embeddings and after every layer.
            return_dict: an :class:`HfxTransfoXLModelOutput` (None: ``config.return_dict``) or a plain tuple.
            position_ids: accepted and not used (positions are relative here).
            seq_idx: accepted, with ``packed_batch`` and ``kwargs``, so that a packed (padding-free) batch from
                ``DataCollatorWithFlattening`` is refused with a ``ValueError`` instead of mixing its documents.
            packed_batch: a head's :class:`~hf_xformers.ops.packing.PackedBatch`, refused as well.
            **kwargs: the collator's other boundaries (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`), refused
                as well.
        Returns:
            :class:`HfxTransfoXLModelOutput`.
        """
        batch, query_len = self._check_inputs(input_ids, inputs_embeds, attention_mask, mems)
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        packing = packing_kwargs(self, kwargs, seq_idx)
        self._refuse_packed((batch, query_len), device, attention_mask, position_ids, packing, packed_batch)
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        if mems is not None:
            mem_len = self.config.mem_len
            mems = None if mem_len == 0 else tuple(mem[:, -mem_len:] for mem in mems)
        embeds = self.word_emb(input_ids) if inputs_embeds is None else inputs_embeds
        positions, allowed = self._relative_attention_inputs(embeds, query_len, mems, attention_mask)
        key_len = allowed.shape[-1]
        # A mask wider than memory + segment covers tokens that have left the memory (generate() passes the mask of
        # every token so far): the probabilities are reported over all of them, 0 for those, so that a decoding step's
        # row lines up with the mask's columns and with the last row of a full forward over the sequence so far
        # (transformers' per-step contract: keys = every token so far).
        dropped = 0
        if output_attentions and attention_mask is not None and attention_mask.shape[1] > key_len:
            dropped = attention_mask.shape[1] - key_len
        hidden, layer_inputs, all_hidden, all_attentions = self._run_layers(
            self.dropout(embeds), positions, allowed, mems, output_attentions, output_hidden_states, dropped
        )
        out = HfxTransfoXLModelOutput(
            last_hidden_state=hidden,
            mems=self._update_memories(layer_inputs, mems),
            hidden_states=all_hidden,
            attentions=all_attentions,
        )
        return self._finish(out, return_dict)

    def _relative_attention_inputs(
        self,
        embeds: torch.Tensor,
        query_len: int,
        mems: Memories | None,
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What every layer's attention shares: the relative position encodings ``(m + q, d_model)`` (dropout
        applied) and the keys each query may see, ``allowed`` ``(q, m + q)``, or ``(batch, 1, q, m + q)`` with padded
        keys masked (``attention_mask`` ``(batch, ...)``, its last ``m + q`` columns; memory it does not cover is
        real)."""
        memory_len = 0 if mems is None else mems[0].shape[1]
        key_len = memory_len + query_len
        device = embeds.device
        distances = relative_distances(query_len, key_len, self.config.clamp_len, device=device)
        positions = self.dropout(sinusoid_positions(distances, self.config.d_model).to(embeds.dtype))
        allowed = allowed_keys(query_len, memory_len, self.config.same_length, self.config.mem_len, device=device)
        # "Is anything padded" once per forward; padded keys are masked for every query (batch, 1, q, k).
        key_mask = unpadded_to_none(attention_mask.bool()) if attention_mask is not None else None
        if key_mask is not None:
            key_mask = key_mask[:, -key_len:]
            if key_mask.shape[1] < key_len:
                key_mask = F.pad(key_mask, (key_len - key_mask.shape[1], 0), value=True)
            allowed = allowed & key_mask[:, None, None, :]
        return positions, allowed

    def _run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        mems: Memories | None,
        output_attentions: bool,
        output_hidden_states: bool,
        dropped: int,
    ) -> tuple[torch.Tensor, list[torch.Tensor], tuple | None, tuple | None]:
        """The layers over ``hidden`` ``(batch, q, d_model)``, each with its memory. Returns the last hidden states
        (dropout applied), every layer's input (the next memories), and the hidden states and attentions asked for
        (None otherwise); ``dropped``: columns of zeros put before each attention map for tokens no longer in the
        memory."""
        layer_inputs, all_hidden, all_attentions = [], (), ()
        for i, layer in enumerate(self.layers):
            layer_inputs.append(hidden)
            if output_hidden_states:
                all_hidden += (hidden,)
            memory = None if mems is None else mems[i]
            hidden, probs = layer(hidden, positions, allowed, memory=memory, output_attentions=output_attentions)
            if output_attentions:
                all_attentions += (F.pad(probs, (dropped, 0)) if dropped else probs,)
        hidden = self.dropout(hidden)
        if output_hidden_states:
            all_hidden += (hidden,)
        return (
            hidden,
            layer_inputs,
            all_hidden if output_hidden_states else None,
            all_attentions if output_attentions else None,
        )

    @torch.no_grad()
    def _update_memories(self, layer_inputs: list[torch.Tensor], mems: Memories | None) -> Memories | None:
        """Each layer's input of this segment appended to its memory, keeping the last ``mem_len`` positions.

        Detached (no gradient flows into earlier segments, the paper's stop-gradient), so memories can be carried
        across optimisation steps.
        """
        mem_len = self.config.mem_len
        if mem_len == 0:
            return None
        new = []
        for i, states in enumerate(layer_inputs):
            full = states if mems is None else torch.cat([mems[i], states], dim=1)
            new.append(full[:, -mem_len:].detach())
        return tuple(new)


class HfxTransfoXLForCausalLM(HfxGenerationMixin, HfxTransfoXLPreTrainedModel, GenerationMixin):
    """Transformer-XL language model: the base model and an adaptive softmax tied to the adaptive embeddings.

    ``labels`` ``(batch, seq_len)`` are the input ids themselves (-100 where no loss is wanted), shifted inside: the
    output at position ``t`` is scored against ``labels[:, t + 1]``, so ``losses`` has ``seq_len - 1`` columns. To
    score every token of a long stream (including the first of each segment, predicted from the previous one), pass
    ``shift_labels`` ``(batch, seq_len)`` instead: the targets already aligned with the positions (what
    :class:`~hf_xformers.models.transfo_xl.training_transfo_xl.HfxStreamSegments` yields).

    ``generate()`` carries the memories from step to step: each step feeds only the newest token (greedy, sampling,
    beam search, which reorders the memories with the beams; left padding through ``attention_mask``), and its
    ``output_attentions`` cover every token so far (0 for those no longer in the memory), as transformers' per-step
    contract expects of a cache. The logits equal those of full recomputation (``use_cache=False``) while the memory
    holds the whole sequence (``mem_len >= prompt + new tokens``), and at any length with ``same_length=True`` (the
    default: every query attends to the last ``mem_len`` positions either way); with ``same_length=False`` a longer
    sequence is seen through the last ``mem_len`` positions only, as in training, where full recomputation sees all.
    With ``mem_len=0`` there is no memory to carry: every step re-encodes the whole sequence and no cache is returned.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxTransfoXLConfig, HfxTransfoXLForCausalLM
        >>> config = HfxTransfoXLConfig(
        ...     vocab_size=100, cutoffs=[20, 50], d_model=32, d_embed=32, n_head=2,
        ...     d_head=16, d_inner=64, n_layer=2, mem_len=16,
        ... )
        >>> model = HfxTransfoXLForCausalLM(config).eval()
        >>> segment_1, segment_2 = torch.randint(0, 100, (2, 2, 12))  # 2 streams each
        >>> out = model(segment_1, labels=segment_1)  # shifted inside
        >>> out = model(segment_2, mems=out.mems, labels=segment_2)
        >>> out.logits.shape, out.losses.shape  # log-probabilities; per-token losses
        (torch.Size([2, 12, 100]), torch.Size([2, 11]))
        >>> model.generate(segment_1, min_new_tokens=4, max_new_tokens=4).shape
        torch.Size([2, 16])
    """

    generation_cache_argument = "mems"

    def __init__(self, config: HfxTransfoXLConfig) -> None:
        super().__init__(config)
        self.transformer = HfxTransfoXLModel(config)
        self.adaptive_softmax = HfxAdaptiveLogSoftmax(
            config.vocab_size, config.d_embed, config.d_model, config.cutoffs, config.div_val
        )
        # Per instance: which tensors are tied depends on the config (number of clusters, div_val, tie_projs).
        self._tied_weights_keys = self._adaptive_tied_keys()
        self.post_init()

    def _adaptive_tied_keys(self) -> dict[str, str]:
        """``{softmax tensor: embedding tensor}``: every cluster weight, and the projections ``config.tie_projs``
        names (``transformers``' generic tying knows only one output embedding)."""
        emb, out = "transformer.word_emb", "adaptive_softmax"
        n_layers = len(self.adaptive_softmax.out_layers)
        tied = {f"{out}.out_layers.{i}.weight": f"{emb}.emb_layers.{i}.weight" for i in range(n_layers)}
        n_emb_projs = len(self.transformer.word_emb.emb_projs)
        for i, tie in enumerate(self.config.tie_projs):
            if tie and i < len(self.adaptive_softmax.out_projs) and n_emb_projs:
                # With div_val == 1 there is one input projection for every cluster.
                tied[f"{out}.out_projs.{i}"] = f"{emb}.emb_projs.{i if self.config.div_val > 1 else 0}"
        return tied

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return dict(self._tied_weights_keys) if self.config.tie_word_embeddings else {}

    def get_output_embeddings(self) -> None:
        # The adaptive softmax is not a single Linear; returning None keeps transformers' resizing helpers away.
        return None

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        mems: Memories | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_logits: bool = True,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxTransfoXLCausalLMOutput | tuple:
        """Returns ``logits`` (log-probabilities) ``(batch, seq_len, vocab_size)`` unless ``return_logits=False``
        (training needs only the loss, which the adaptive softmax computes for the target clusters alone), the
        new ``mems``, and with ``labels`` (shifted inside) or ``shift_labels`` (already aligned; they take precedence,
        as in transformers' causal LMs) the per-token ``losses`` and their mean ``loss`` (their sum over
        ``num_items_in_batch`` when Trainer passes it). ``use_cache`` is accepted for ``generate()`` and has no effect:
        the memories are the cache. A packed batch (``seq_idx``, or ``kwargs``:
        :class:`~hf_xformers.ops.packing.CuSeqLensKwargs`) is refused (see :meth:`HfxTransfoXLModel.forward`).

        Args:
            input_ids: ``(batch, seq_len)`` token ids of the segment.
            mems: the previous segment's ``mems`` (per layer ``(batch, memory_len, d_model)``), or None.
            attention_mask: ``(batch, seq_len)`` (or ``(batch, past + seq_len)``), 1 for real tokens, 0 for padding.
            inputs_embeds: ``(batch, seq_len, d_model)``, instead of ``input_ids``.
            labels: ``(batch, seq_len)``, usually the input ids; -100 where no loss is wanted; shifted inside.
            shift_labels: ``(batch, seq_len)`` targets already aligned with the positions (used instead of
                ``labels``; every position scored, the first included).
            num_items_in_batch: the number of scored tokens over the accumulated batch (Trainer).
            return_logits: compute the log-probabilities over the whole vocabulary (False: only the loss).
            use_cache: accepted for ``generate()``; the memories are the cache.
            output_attentions: also return every layer's attention probabilities
                ``(batch, n_head, seq_len, memory_len + seq_len)``.
            output_hidden_states: also return the hidden states after the embeddings and after every layer.
            return_dict: an :class:`HfxTransfoXLCausalLMOutput` (None: ``config.return_dict``) or a plain tuple.
            position_ids: accepted and not used (positions are relative here).
            seq_idx: a packed batch's documents, refused.
            **kwargs: the padding-free collator's boundaries (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`),
                refused.

        Returns:
            ``HfxTransfoXLCausalLMOutput``: ``loss``, ``logits``, the per-token ``losses``, the new ``mems``.
        """
        if shift_labels is not None:
            labels = None
        out = self.transformer(
            input_ids, mems=mems, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            position_ids=position_ids, **packing_kwargs(self, kwargs, seq_idx),
        )  # fmt: skip
        hidden = out.last_hidden_state
        logits = None
        if return_logits:
            logits = self.adaptive_softmax.log_prob(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1)
        loss = losses = None
        if labels is not None or shift_labels is not None:
            loss, losses = self._adaptive_loss(hidden, labels, shift_labels, num_items_in_batch)
        result = self._head_result(HfxTransfoXLCausalLMOutput, out, loss, logits=logits, losses=losses, mems=out.mems)
        return self._finish(result, return_dict)

    def _adaptive_loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None,
        shift_labels: torch.Tensor | None,
        num_items_in_batch: int | torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean next-token loss and the per-token ``losses`` ``(batch, n_targets)`` (0 where ignored) of
        ``hidden`` ``(batch, seq_len, d_model)`` against ``labels`` (shifted here) or ``shift_labels`` (aligned), as
        the adaptive softmax scores them (the target clusters alone)."""
        if labels is not None:
            targets_hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets_hidden, targets = hidden, shift_labels
        if tuple(targets.shape) != tuple(targets_hidden.shape[:2]):
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(hidden.shape[:2])}, got "
                f"{tuple((labels if labels is not None else shift_labels).shape)}."
            )
        valid = targets != -100
        if not is_tracing() and valid.any():
            if int(targets[valid].max()) >= self.config.vocab_size or int(targets[valid].min()) < 0:
                raise ValueError(f"labels must be token ids below vocab_size ({self.config.vocab_size}) or -100.")
        losses = self.adaptive_softmax.nll(targets_hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1))
        losses = losses.view(targets.shape)
        # Mean over scored tokens; a segment with none gives 0 (not NaN), so a step can still run backward.
        loss = losses.sum() / (valid.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return loss, losses

    # ----- generation: the memories play the part of the key/value cache ---------------------------------
    def _cache_of_output(self, outputs) -> Memories | None:
        return outputs.mems

    def _unseen_tokens(self, input_ids: torch.Tensor, cache: Memories | None) -> int:
        # Memories do not count tokens (they keep the last mem_len); generate() adds one token per step.
        return 1 if cache is not None else input_ids.shape[1]

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs) -> dict:
        """The shared step inputs (:class:`~hf_xformers.layers.generation.HfxGenerationMixin`), plus, on a cached
        step that reports attentions without a mask, the all-ones mask of every token so far ``(batch, seq_len)``.

        ``generate()`` drops an all-ones mask before the first step (nothing is padded). A cached step then feeds the
        new token and the memories, which hold at most ``mem_len`` earlier tokens, so the forward alone cannot know
        how many tokens there were; the mask's width tells it, and the attentions of the new token's query row cover
        them all (0 for tokens that have left the memory), as transformers' per-step contract reads them. A mask
        with nothing padded changes no logits; without ``output_attentions`` none is made.
        """
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        output_attentions = inputs.get("output_attentions")
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if output_attentions and inputs.get("attention_mask") is None and inputs.get("mems") is not None:
            inputs["attention_mask"] = input_ids.new_ones(input_ids.shape)
        return inputs


class HfxTransfoXLForSequenceClassification(HfxTransfoXLPreTrainedModel):
    """A linear classifier on the last real token's hidden state (the only one that has seen the whole input in a causal
    model), or with ``config.classifier_pooling = "mean"`` on the mean over the real tokens. The last token is found
    from ``attention_mask`` (right padding), else from ``pad_token_id``, else it is the last position. Losses by
    ``problem_type`` as in every hf_xformers classification head.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxTransfoXLConfig
        >>> from hf_xformers import HfxTransfoXLForSequenceClassification
        >>> config = HfxTransfoXLConfig(
        ...     vocab_size=100, cutoffs=[20, 50], d_model=32, d_embed=32, n_head=2,
        ...     d_head=16, d_inner=64, n_layer=2, mem_len=16, num_labels=3,
        ... )
        >>> model = HfxTransfoXLForSequenceClassification(config).eval()
        >>> input_ids = torch.randint(0, 100, (2, 12))
        >>> out = model(input_ids, labels=torch.tensor([0, 2]))  # last tokens
        >>> out.logits.shape
        torch.Size([2, 3])
    """

    def __init__(self, config: HfxTransfoXLConfig) -> None:
        super().__init__(config)
        pooling = getattr(config, "classifier_pooling", None) or "last"
        if pooling not in ("last", "mean"):
            raise ValueError(f"classifier_pooling must be 'last' or 'mean' for Transformer-XL, got {pooling!r}.")
        self.pooling = pooling
        self.transformer = HfxTransfoXLModel(config)
        dropout = config.dropout if config.classifier_dropout is None else config.classifier_dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def _pool(self, hidden: torch.Tensor, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None):
        """``(batch, seq_len, d_model)`` -> ``(batch, d_model)``: the last real token, or the mean of the real ones."""
        real = attention_mask[:, -hidden.shape[1] :] if attention_mask is not None else None
        if real is None and input_ids is not None and self.config.pad_token_id is not None:
            real = input_ids != self.config.pad_token_id
        if self.pooling == "mean":
            return pool_tokens(hidden, real, "mean")
        batch, length = hidden.shape[:2]
        if real is None:
            last = torch.full((batch,), length - 1, device=hidden.device)
        else:
            # The last real position, with left or right padding (position 0 when nothing is real).
            positions = torch.arange(1, length + 1, device=hidden.device)
            last = (real.long() * positions).argmax(-1)
        return hidden[torch.arange(batch, device=hidden.device), last]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        mems: Memories | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxTransfoXLSequenceClassifierOutput | tuple:
        """Returns ``logits`` ``(batch, num_labels)``, the loss when ``labels`` ``(batch,)`` (or multi-hot
        ``(batch, num_labels)``) are given, and the new ``mems``. A packed batch is refused (see
        :meth:`HfxTransfoXLModel.forward`).

        Args:
            input_ids: ``(batch, seq_len)`` token ids.
            mems: the previous segment's ``mems`` (per layer ``(batch, memory_len, d_model)``), or None.
            attention_mask: ``(batch, seq_len)``, 1 for real tokens, 0 for padding; it finds the last real token.
            inputs_embeds: ``(batch, seq_len, d_model)``, instead of ``input_ids``.
            labels: ``(batch,)`` class ids, regression values (``num_labels=1``) or ``(batch, num_labels)`` multi-hot
                floats.
            output_attentions: also return every layer's attention probabilities.
            output_hidden_states: also return the hidden states after the embeddings and after every layer.
            return_dict: an ``HfxTransfoXLSequenceClassifierOutput`` (None: ``config.return_dict``) or a plain tuple.
            position_ids: accepted and not used (positions are relative here).
            seq_idx: a packed batch's documents, refused.
            **kwargs: the padding-free collator's boundaries (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`),
                refused.

        Returns:
            ``HfxTransfoXLSequenceClassifierOutput``: ``loss``, ``logits`` ``(batch, num_labels)``, ``mems``,
            ``hidden_states`` and ``attentions`` when asked.
        """
        check_sequence_labels(labels, self.config)
        out = self.transformer(
            input_ids, mems=mems, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            position_ids=position_ids, **packing_kwargs(self, kwargs, seq_idx),
        )  # fmt: skip
        logits = self.classifier(self.dropout(self._pool(out.last_hidden_state, input_ids, attention_mask)))
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        result = self._head_result(HfxTransfoXLSequenceClassifierOutput, out, loss, logits=logits, mems=out.mems)
        return self._finish(result, return_dict)
