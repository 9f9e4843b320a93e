"""``hfx-universal``: the Universal Transformer (Dehghani et al., 2019) as ``transformers`` models.

One shared Transformer block is applied recurrently in depth (``models/universal/recurrent_block.py``), with per-position
Adaptive Computation Time (``models/universal/adaptive_computation_time.py``) or a fixed number of steps. This file holds the embeddings (optionally
ALBERT's factorised ones), the base model, which is an encoder or, with ``config.is_decoder``, a causal decoder with
a per-step cache (and cross-attention in the seq2seq model), and the heads: masked LM, sequence and token
classification, causal LM and encoder-decoder LM.

Every output carries ``ponder_steps`` ``(batch, seq_len)`` (steps per position, 0 at padding) and, with ACT,
``ponder_loss = act_loss_weight * mean(N + R)`` over real tokens. Heads add the ponder loss to the task loss when
``labels`` are given and report it separately.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    MaskedLMOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput
from typing_extensions import Unpack

from ...attention.multi_head import attention_groups, attention_mask_4d
from ...layers.encoder import HfxPooler
from ...layers.generation import HfxGenerationMixin
from ...layers.heads import (
    HfxCausalLMHeadMixin,
    HfxLMHead,
    HfxMaskedLMHeadMixin,
    HfxSequenceClassificationHeadMixin,
    HfxTokenClassificationHeadMixin,
    token_cross_entropy,
)
from ...layers.pretrained import HfxPreTrainedModel
from ...ops.attention_switch import EAGER, flex_applies
from ...ops.compat import CACHE_NAME, cache_field, output_cache, resolve_cache_argument
from ...ops.input_checks import (
    check_embeds_width,
    check_not_empty,
    check_position_ids,
    check_token_ids,
    check_type_ids,
    is_tracing,
    reads_values,
    refuse,
    token_shape,
    unpadded_to_none,
)
from ...ops.packing import (
    CuSeqLensKwargs,
    PackedBatch,
    PackedBatchKwargs,
    packing_kwargs,
    refuse_packed,
    resolve_packed_batch,
)
from ...ops.varlen import DocumentLayout, compute_dtype, document_layout, varlen_applies
from .adaptive_computation_time import HfxHaltingUnit, ponder_loss
from .configuration_universal import HfxUniversalConfig
from .recurrent_block import (
    HfxSeparableConv1d,
    HfxUniversalCache,
    HfxUniversalRecurrentEncoder,
)

# ----- outputs ---------------------------------------------------------------------------------------------------


@dataclass
@cache_field
class HfxUniversalModelOutput(ModelOutput):
    """``last_hidden_state`` ``(batch, seq_len, hidden)``; ``pooler_output`` ``(batch, hidden)`` or None;
    ``cache`` (``past_key_values`` before transformers 5.24): the decoder cache (:class:`HfxUniversalCache`) when one
    is used; ``hidden_states``: the
    embeddings and the state after every step; ``attentions`` / ``cross_attentions``: per step
    ``(batch, heads, seq_len, keys)``; ``ponder_loss``: ``act_loss_weight * mean(N + R)`` over real tokens (None in
    fixed-step mode); ``ponder_steps`` ``(batch, seq_len)``: steps ``N`` per position (0 at padding);
    ``ponder_remainders`` ``(batch, seq_len)``: ACT remainders ``R``."""

    last_hidden_state: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None
    cache: HfxUniversalCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[torch.Tensor, ...] | None = None
    ponder_loss: torch.Tensor | None = None
    ponder_steps: torch.Tensor | None = None
    ponder_remainders: torch.Tensor | None = None


@dataclass
class HfxUniversalMaskedLMOutput(MaskedLMOutput):
    """``MaskedLMOutput`` plus ``ponder_loss`` (included in ``loss``) and ``ponder_steps`` ``(batch, seq_len)``."""

    ponder_loss: torch.Tensor | None = None
    ponder_steps: torch.Tensor | None = None


@dataclass
class HfxUniversalSequenceClassifierOutput(SequenceClassifierOutput):
    """``SequenceClassifierOutput`` plus ``ponder_loss`` (included in ``loss``) and ``ponder_steps``."""

    ponder_loss: torch.Tensor | None = None
    ponder_steps: torch.Tensor | None = None


@dataclass
class HfxUniversalTokenClassifierOutput(TokenClassifierOutput):
    """``TokenClassifierOutput`` plus ``ponder_loss`` (included in ``loss``) and ``ponder_steps``."""

    ponder_loss: torch.Tensor | None = None
    ponder_steps: torch.Tensor | None = None


@dataclass
class HfxUniversalCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``ponder_loss`` (included in ``loss``) and ``ponder_steps`` of the new tokens."""

    ponder_loss: torch.Tensor | None = None
    ponder_steps: torch.Tensor | None = None


@dataclass
class HfxUniversalSeq2SeqLMOutput(Seq2SeqLMOutput):
    """``Seq2SeqLMOutput`` plus ``ponder_loss`` (encoder + decoder, included in ``loss``), ``encoder_ponder_steps``
    ``(batch, src_len)`` and ``decoder_ponder_steps`` ``(batch, tgt_len)``."""

    ponder_loss: torch.Tensor | None = None
    encoder_ponder_steps: torch.Tensor | None = None
    decoder_ponder_steps: torch.Tensor | None = None


# The shared heads' output classes -> ours, with the ponder fields.
_PONDER_OUTPUTS = {
    MaskedLMOutput: HfxUniversalMaskedLMOutput,
    SequenceClassifierOutput: HfxUniversalSequenceClassifierOutput,
    TokenClassifierOutput: HfxUniversalTokenClassifierOutput,
    CausalLMOutputWithPast: HfxUniversalCausalLMOutput,
}


def _add_ponder(loss: torch.Tensor | None, ponder: torch.Tensor | None) -> torch.Tensor | None:
    """The task loss plus the ponder loss (only when there is a task loss: without labels nothing is trained)."""
    return loss + ponder if loss is not None and ponder is not None else loss


def _seq2seq_output(
    loss: torch.Tensor | None,
    logits: torch.Tensor,
    ponder: torch.Tensor | None,
    decoded: HfxUniversalModelOutput,
    encoded: HfxUniversalModelOutput,
) -> HfxUniversalSeq2SeqLMOutput:
    """The encoder-decoder's output: ``loss`` (ponder loss included) and ``logits`` ``(batch, tgt_len, vocab)``, the
    decoder's cache, states, attentions and ponder steps (``decoded``) and the encoder's (``encoded``)."""
    # The output's fields are the two halves' own under a `decoder_` / `encoder_` prefix.
    halves = {f"decoder_{name}": getattr(decoded, name) for name in ("hidden_states", "attentions", "ponder_steps")}
    for name in ("last_hidden_state", "hidden_states", "attentions", "ponder_steps"):
        halves[f"encoder_{name}"] = getattr(encoded, name)
    return HfxUniversalSeq2SeqLMOutput(
        loss=loss, logits=logits, cross_attentions=decoded.cross_attentions, ponder_loss=ponder, **halves,
        **{CACHE_NAME: output_cache(decoded)},
    )  # fmt: skip


# ----- building blocks -------------------------------------------------------------------------------------------


class HfxUniversalEmbeddings(nn.Module):
    """Word + token type (+ learned absolute position, ``position_embedding_type="absolute"``) embeddings, LayerNorm,
    dropout, then, for factorised embeddings (``config.embedding_size`` set), ALBERT's projection
    ``embedding_hidden_mapping_in`` to ``hidden_size``. ``(batch, seq_len)`` -> ``(batch, seq_len, hidden)``.

    With ``"sinusoidal"`` (the paper) there is no position table here: the position signal is added at every step.
    """

    def __init__(self, config: HfxUniversalConfig) -> None:
        super().__init__()
        size = config.embedding_size or config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, size, padding_idx=config.pad_token_id)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, size) if config.position_embedding_type == "absolute" else None
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size)
        self.LayerNorm = nn.LayerNorm(size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.embedding_hidden_mapping_in = (
            nn.Linear(size, config.hidden_size) if config.embedding_size is not None else None
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds`` (instead of ``input_ids``) are ``(batch, seq_len, embedding_size or hidden_size)``."""
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if token_type_ids is None:
            token_type_ids = torch.zeros(position_ids.shape, dtype=torch.long, device=embeddings.device)
        embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = self.dropout(self.LayerNorm(embeddings))
        if self.embedding_hidden_mapping_in is not None:
            embeddings = self.embedding_hidden_mapping_in(embeddings)
        return embeddings


class HfxUniversalLMHead(HfxLMHead):
    """``decoder(LayerNorm(act(dense(h))))`` with ``act = config.hidden_act``; for factorised embeddings ``dense`` maps to
    ``embedding_size`` and the tied ``decoder`` from it (ALBERT's MLM head). ``(batch, seq, hidden)`` -> ``(.., vocab)``."""

    def __init__(self, config: HfxUniversalConfig) -> None:
        super().__init__(config)
        size = config.embedding_size or config.hidden_size
        if size != config.hidden_size:
            self.dense = nn.Linear(config.hidden_size, size)
            self.layer_norm = nn.LayerNorm(size, eps=config.layer_norm_eps)
            self.decoder = nn.Linear(size, config.vocab_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(self.act(self.dense(hidden_states))))


# ----- models ----------------------------------------------------------------------------------------------------


class HfxUniversalPreTrainedModel(HfxPreTrainedModel):
    config_class = HfxUniversalConfig
    sequence_parallel_refusal = (
        "its recurrent block halts per token across depth (ACT) and its decoder attends through a cache; it "
        "has no sequence-parallel path"
    )
    base_model_prefix = "universal"
    _no_split_modules = ["HfxUniversalLayer"]
    # Causal and padding masks as FlexAttention's BlockMask (multi_head.py); dense attention otherwise.
    _supports_flex_attn = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' ``from_pretrained``; an encoder-only class (the base model or an encoder head) also loads the
        encoder of a seq2seq checkpoint (:class:`HfxUniversalForSeq2SeqLM`, ``config.is_encoder_decoder``), as
        ``BartModel``'s encoder loads from a BART checkpoint: ``encoder.*`` becomes the base model's names, the
        decoder and the LM head are left out. A ``key_mapping`` or ``config`` passed by the caller wins."""
        if cls is not HfxUniversalForSeq2SeqLM and "key_mapping" not in kwargs and "config" not in kwargs:
            hub = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
            probe = cls.config_class.from_pretrained(
                pretrained_model_name_or_path, **{k: kwargs[k] for k in hub if k in kwargs}
            )
            if probe.is_encoder_decoder:
                probe.is_encoder_decoder = False
                kwargs["config"] = probe
                own = "" if cls is HfxUniversalModel else f"{cls.base_model_prefix}."
                kwargs["key_mapping"] = {r"^encoder\.": own}
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def _head_result(self, output_class: type, base_output, loss: torch.Tensor | None, **fields):
        """The shared heads' outputs with the base model's ponder loss (added to a task loss) and ponder steps."""
        ponder = base_output.ponder_loss
        return _PONDER_OUTPUTS[output_class](
            loss=_add_ponder(loss, ponder), hidden_states=base_output.hidden_states,
            attentions=base_output.attentions, ponder_loss=ponder, ponder_steps=base_output.ponder_steps, **fields,
        )  # fmt: skip

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxHaltingUnit):
            # b = 1: p starts near sigmoid(1) = 0.73 (tensor2tensor's act_halting_bias_init).
            init.constant_(module.bias, self.config.act_halting_bias_init)
        elif isinstance(module, HfxSeparableConv1d):
            # A depthwise filter sees k inputs of one channel: unit-variance outputs need std k^-1/2, not 0.02.
            init.normal_(module.depthwise.weight, std=module.kernel_size**-0.5)


class HfxUniversalModel(HfxUniversalPreTrainedModel):
    """Embeddings -> the shared block applied in depth (``encoder``) -> optional pooler (``tanh(dense(h[:, 0]))``).

    An encoder by default; with ``config.is_decoder`` a causal decoder that can keep a :class:`HfxUniversalCache`
    (``use_cache=True`` or ``past_key_values``), and with ``config.add_cross_attention`` it attends to
    ``encoder_hidden_states``.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxUniversalConfig, HfxUniversalModel
        >>> config = HfxUniversalConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     intermediate_size=64, act_max_steps=4,
        ... )
        >>> model = HfxUniversalModel(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 20))
        >>> out = model(input_ids, attention_mask=torch.ones_like(input_ids))
        >>> out.last_hidden_state.shape, out.ponder_steps.shape  # ACT's steps
        (torch.Size([2, 20, 32]), torch.Size([2, 20]))
    """

    def __init__(self, config: HfxUniversalConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = HfxUniversalEmbeddings(config)
        self.encoder = HfxUniversalRecurrentEncoder(config)
        self.pooler = HfxPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def _check_inputs(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor | None,
        past_len: int,
    ) -> None:
        """Checks with messages that name the fix. Shapes and dtypes are checked in traced graphs too; the id-range
        checks, which read tensor values, only in eager mode (``ops/input_checks.py``)."""
        shape = token_shape(input_ids, inputs_embeds)
        if len(shape) != 2:
            refuse("input_rank", f"`input_ids` must have shape (batch, seq_len), got {shape}")
        check_token_ids(input_ids, self.config.vocab_size)
        check_not_empty(shape, "input_ids" if input_ids is not None else "inputs_embeds")
        check_embeds_width(inputs_embeds, self.get_input_embeddings().embedding_dim)
        if attention_mask is not None:
            expected = (shape[0], past_len + shape[1])
            if tuple(attention_mask.shape) != expected:
                what = "past + new tokens" if past_len else "`input_ids`"
                refuse(
                    "mask_shape",
                    f"`attention_mask` must have shape {expected} ({what}), got {tuple(attention_mask.shape)}",
                )
        check_type_ids(token_type_ids, self.config.type_vocab_size, shape)
        if self.config.add_cross_attention and encoder_hidden_states is None:
            raise ValueError(
                "This decoder attends to an encoder: pass `encoder_hidden_states` (batch, src_len, hidden)."
            )
        if not self.config.add_cross_attention and encoder_hidden_states is not None:
            raise ValueError("`encoder_hidden_states` given, but config.add_cross_attention is False.")

    def _check_length(
        self, past_len: int, length: int, packed: PackedBatch | None, position_ids: torch.Tensor | None
    ) -> None:
        """Past plus new tokens within ``config.max_position_embeddings``; in a packed batch each document (a row may
        be longer: positions restart). A packed batch's longest document is the host integer the batch carries
        (``max_length_q``) where it does; else it is read from ``position_ids`` or the lengths where a read is free
        (:func:`~hf_xformers.ops.input_checks.reads_values`) and not checked elsewhere (a training step on an
        accelerator, a traced graph), as the other value checks."""
        limit = self.config.max_position_embeddings
        if packed is None:
            if past_len + length > limit:
                refuse(
                    "sequence_too_long",
                    f"{past_len + length} tokens (past {past_len} + new {length}) exceed "
                    f"config.max_position_embeddings={limit}",
                )
            return
        if is_tracing():
            return
        longest = packed.longest
        if longest is None:
            if not reads_values(packed.document_ids):
                return
            longest = int(position_ids.max()) + 1 if position_ids is not None else packed.longest_document()
        if longest > limit:
            refuse(
                "sequence_too_long",
                f"A packed document of {longest} tokens exceeds config.max_position_embeddings={limit}",
            )

    def _packed_inputs(
        self,
        shape: tuple[int, int],
        device: torch.device,
        key_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        packing: PackedBatchKwargs,
        uses_cache: bool,
        encoder_hidden_states: torch.Tensor | None,
        packed_batch: PackedBatch | None = None,
    ) -> tuple[PackedBatch | None, torch.Tensor | None]:
        """``(packed, position_ids)`` of a packed batch (:mod:`~hf_xformers.ops.packing`): the documents
        ``(batch, seq_len)`` long, and positions restarting at 0 in every document (the caller's, checked, or counted
        here), as each document's solo forward numbers them; ``(None, position_ids)`` for an ordinary batch. ``packing``:
        the forward's :class:`~hf_xformers.ops.packing.PackedBatchKwargs`.

        ``seq_idx`` / ``cu_seq_lens`` mark documents; ``position_ids`` never do (a padded row's positions restart at
        its padding and a cached step's continue earlier tokens: ``generate()`` passes both).

        Raises:
            ValueError: a packed batch with a cache (its keys would mix documents across calls), with
                cross-attention, or whose positions do not start at 0 in every document.
        """
        packed = packed_batch or resolve_packed_batch(shape, device, position_ids, attention_mask=key_mask, **packing)
        if packed is None:
            return None, position_ids
        name = type(self).__name__
        if uses_cache:
            refuse_packed(
                f"{name} with a cache",
                "the cache keeps one stream of tokens per row, and later tokens would attend to every packed "
                "document before them",
                "Pass use_cache=False and no past_key_values for packed training or scoring, and generate from "
                "unpacked (padded) prompts.",
            )
        if encoder_hidden_states is not None:
            refuse_packed(
                f"{name} with cross-attention",
                "each packed document would need its own encoder states, which encoder_hidden_states cannot say",
                "Pad the batch (DataCollatorForSeq2Seq) for the encoder-decoder model.",
            )
        if position_ids is None:
            return packed, packed.positions
        if reads_values(position_ids):
            starts = position_ids.masked_select(packed.starts)
            if bool((starts != 0).any()):
                refuse(
                    "packed_position_start",
                    "In a packed batch every document's positions must start at 0, as in its own forward, but some "
                    f"start at {sorted(set(starts.tolist()))[:4]}: it needs position_ids_start=0 (the collator's default)",
                )
        return packed, position_ids

    def _decoder_cache(
        self, past_key_values: HfxUniversalCache | None, use_cache: bool | None
    ) -> tuple[HfxUniversalCache | None, int]:
        """The cache this forward extends (the caller's, or a new one for a decoder asked to ``use_cache``) and the
        number of tokens it holds.

        Raises:
            ValueError: a cache for an encoder, or a cache of another type.
        """
        if use_cache and past_key_values is None and self.config.is_decoder:
            past_key_values = HfxUniversalCache()
        if past_key_values is not None and not self.config.is_decoder:
            raise ValueError("past_key_values only exist for decoders (config.is_decoder=True).")
        if past_key_values is not None and not isinstance(past_key_values, HfxUniversalCache):
            raise ValueError(
                f"past_key_values must be an HfxUniversalCache (keys and values per recurrent step), got "
                f"{type(past_key_values).__name__}; pass use_cache=True to start one."
            )
        return past_key_values, 0 if past_key_values is None else past_key_values.get_seq_length()

    def _self_attention_mask(
        self,
        hidden: torch.Tensor,
        key_mask: torch.Tensor | None,
        packed: PackedBatch | None,
        past_len: int,
        cached: bool,
        output_attentions: bool,
    ) -> tuple[torch.Tensor | DocumentLayout | None, bool, torch.Tensor | None]:
        """The self-attention mask every step shares, prepared once per forward: ``(mask, is_causal, groups)``.

        ``hidden`` ``(batch, seq_len, hidden)``: the embeddings; ``key_mask`` ``(batch, past_len + seq_len)`` bool or
        None (no padding); ``cached``: a cache is in use. An ordinary batch gets a bool ``(batch or 1, 1, seq_len,
        keys)`` mask (:func:`attention_mask_4d`), or None with ``is_causal`` (SDPA's own causal mask) or for one new
        token after a cache. A packed batch gets its documents' :func:`attention_groups` ``(batch, seq_len)`` and
        either a dense mask (the eager softmax, which also returns the probabilities) or a
        :class:`~hf_xformers.ops.varlen.DocumentLayout` for one kernel call over the whole row per step; which one
        depends on the kernel choice, asked of the shared attention module (its
        :meth:`~hf_xformers.attention.base.KernelChoice.kernel_choice`), as it will ask itself at every step.
        """
        config, device = self.config, hidden.device
        length = hidden.shape[1]
        causal = bool(config.is_decoder)
        if packed is None:
            # An uncached causal pass without padding is SDPA's own is_causal (top-left aligned, which is right only
            # when there are no earlier tokens); one new token after a cache sees every key and needs no mask at all.
            is_causal = causal and key_mask is None and past_len == 0
            if is_causal or (causal and key_mask is None and cached and length == 1):
                return None, is_causal, None
            return attention_mask_4d(key_mask, length, past_len, causal, device), is_causal, None
        groups = attention_groups(packed.document_ids, key_mask)
        implementation = self.encoder.layer.attention.self.kernel_choice(hidden)
        if output_attentions or implementation == EAGER:
            return attention_mask_4d(key_mask, length, 0, causal, device, groups), False, groups
        dropout = config.attention_probs_dropout_prob if self.training else 0.0
        head_dim = config.hidden_size // config.num_attention_heads
        layout = document_layout(
            groups, causal, cu_seq_lens=packed.cu_seq_lens, max_length=packed.longest,
            varlen=varlen_applies(device, compute_dtype(hidden), head_dim, dropout),
            flex=flex_applies(implementation, hidden, self.training, config.attention_probs_dropout_prob),
        )  # fmt: skip
        return layout, False, groups

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: HfxUniversalCache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: HfxUniversalCache | None = None,
        *,
        seq_idx: torch.Tensor | None = None,
        packed_batch: PackedBatch | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxUniversalModelOutput | tuple:
        """Encode (or, for a decoder, continue) a batch, or a packed batch of documents (transformers'
        ``DataCollatorWithFlattening``, positions from 0: ``position_ids_start=0``).

        Args:
            input_ids: ``(batch, seq_len)`` token ids (or ``inputs_embeds``, see :class:`HfxUniversalEmbeddings`).
            attention_mask: ``(batch, seq_len)`` 1 for real tokens, 0 for padding; for a decoder with a cache,
                ``(batch, past + seq_len)``. Padding never runs under ACT and is left out of the ponder loss.
            token_type_ids: ``(batch, seq_len)`` segment ids.
            position_ids: ``(batch, seq_len)``; default: the count of real tokens before each token (from 0), so left
                and right padding give a token the same position.
            inputs_embeds: ``(batch, seq_len, embedding_size or hidden_size)``, instead of ``input_ids``.
            encoder_hidden_states: ``(batch, src_len, hidden)`` (decoders with cross-attention).
            encoder_attention_mask: ``(batch, src_len)``, 1 for real source tokens.
            past_key_values: a :class:`HfxUniversalCache` to extend (decoders); ``use_cache=True`` starts one.
            use_cache: start or continue a cache and return it (decoders).
            output_attentions: also return the attention probabilities of every step.
            output_hidden_states: also return the states after the embeddings and after every step.
            return_dict: an :class:`HfxUniversalModelOutput` (None: ``config.return_dict``) or a plain tuple.
            cache: the same, under transformers 5.24's name (pass one of the two).
            seq_idx: ``(batch, seq_len)``, the document of every token of a packed batch.
            packed_batch: the :class:`~hf_xformers.ops.packing.PackedBatch` a head resolved (None: resolved here).
            **kwargs: ``cu_seq_lens_q/k`` (:class:`~hf_xformers.ops.packing.CuSeqLensKwargs`), cumulative lengths of one
                row, and ``max_length_q/k``, the longest document (read instead of the device). Each packed document
                gets what its own forward gives (attention, separable convolutions and positions stay inside it; ACT
                halts per position as always). No cache and no cross-attention then.
        Returns:
            :class:`HfxUniversalModelOutput`; for a packed batch ``pooler_output`` is ``(num_documents, hidden)``, one
            row per document in order, and ``ponder_loss`` the mean over all real tokens of the batch (as for a
            padded batch of the same documents: the solo runs' ponder losses weighted by their lengths).
        """
        past_key_values, past_len = self._decoder_cache(resolve_cache_argument(past_key_values, cache), use_cache)
        self._check_inputs(input_ids, inputs_embeds, attention_mask, token_type_ids, encoder_hidden_states, past_len)
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states

        batch, length, device = self._shape_checking_positions(input_ids, inputs_embeds, position_ids)
        # "Is anything padded?" is decided here, once per forward (one host read in eager mode): below, None means no
        # padding, and the attention gets no mask (or is_causal) so that SDPA can use its fused kernels.
        key_mask = unpadded_to_none(attention_mask.bool()) if attention_mask is not None else None
        packed, position_ids = self._packed_inputs(
            (batch, length), device, key_mask, position_ids, packing_kwargs(self, kwargs, seq_idx),
            past_key_values is not None or bool(use_cache), encoder_hidden_states, packed_batch,
        )  # fmt: skip
        self._check_length(past_len, length, packed, position_ids)
        real_mask, position_ids = self._real_and_positions(key_mask, position_ids, (batch, length), past_len, device)
        hidden = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)
        mask, is_causal, groups = self._self_attention_mask(
            hidden, key_mask, packed, past_len, past_key_values is not None, output_attentions
        )
        cross_mask = None if encoder_hidden_states is None else self._cross_attention_mask(encoder_attention_mask)
        out = self.encoder(
            hidden, real_mask, mask, position_ids, encoder_hidden_states, cross_mask, past_key_values,
            output_attentions, output_hidden_states, is_causal=is_causal, padded=key_mask is not None,
            document_ids=groups,
        )  # fmt: skip
        return self._finish(self._model_output(out, real_mask, packed, past_key_values), return_dict)

    def _shape_checking_positions(
        self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> tuple[int, int, torch.device]:
        """``(batch, seq_len, device)`` of the inputs, once ``position_ids`` are checked against the position table."""
        batch, length = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        # Sinusoidal positions have no table, but a negative one is no position of any token.
        table = self.config.max_position_embeddings if self.config.position_embedding_type == "absolute" else None
        check_position_ids(position_ids, (batch, length), 0, table)
        return batch, length, input_ids.device if input_ids is not None else inputs_embeds.device

    def _real_and_positions(
        self,
        key_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        shape: tuple[int, int],
        past_len: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``real_mask`` ``(batch, seq_len)`` bool (False at padding) of the new tokens, and their ``position_ids``
        ``(batch, seq_len)``: the given ones, or by default the count of real tokens before each token (from 0, past
        tokens included), so that left and right padding give a token the same position."""
        batch, length = shape
        if key_mask is not None:
            real_mask = key_mask[:, past_len:]
        else:
            real_mask = torch.ones(batch, length, dtype=torch.bool, device=device)
        if position_ids is None:
            if key_mask is not None:
                position_ids = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
            else:
                position_ids = torch.arange(past_len, past_len + length, device=device).expand(batch, -1)
        return real_mask, position_ids

    @staticmethod
    def _cross_attention_mask(encoder_attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """``encoder_attention_mask`` ``(batch, src_len)`` (1 for real states) as the cross-attention's bool
        ``(batch, 1, 1, src_len)`` mask; None where nothing is padded."""
        if encoder_attention_mask is None:
            return None
        device = encoder_attention_mask.device
        return attention_mask_4d(unpadded_to_none(encoder_attention_mask.bool()), 1, 0, False, device)

    def _model_output(
        self, out, real_mask: torch.Tensor, packed: PackedBatch | None, cache: HfxUniversalCache | None
    ) -> HfxUniversalModelOutput:
        """The base model's output from the recurrence's ``out`` (:class:`RecurrenceOutput`): the pooler (one row per
        document of a packed batch) and, with ACT, the ponder loss over the ``real_mask`` ``(batch, seq_len)``."""
        loss = None
        if self.config.use_act:
            loss = ponder_loss(out.ponder_steps, out.ponder_remainders, real_mask, self.config.act_loss_weight)
        pools = self.pooler is not None and (packed is None or packed.count is not None)
        return HfxUniversalModelOutput(
            last_hidden_state=out.last_hidden_state,
            pooler_output=self.pooler(out.last_hidden_state, packed) if pools else None,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            cross_attentions=out.cross_attentions,
            ponder_loss=loss,
            ponder_steps=out.ponder_steps,
            ponder_remainders=out.ponder_remainders,
            **{CACHE_NAME: cache},
        )


# ----- heads: the shared ones of layers/heads.py, with the ponder loss added (HfxUniversalPreTrainedModel._head_result)


class HfxUniversalForMaskedLM(HfxMaskedLMHeadMixin, HfxUniversalPreTrainedModel):
    """Masked language modelling; the decoder is tied to the input embeddings. ``labels`` ``(batch, seq_len)``, -100
    where no loss is wanted; the loss is the cross-entropy plus the ponder loss.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxUniversalConfig, HfxUniversalForMaskedLM
        >>> config = HfxUniversalConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     intermediate_size=64, act_max_steps=4,
        ... )
        >>> model = HfxUniversalForMaskedLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 20))
        >>> labels = torch.full_like(input_ids, -100)
        >>> labels[:, 5] = input_ids[:, 5]
        >>> out = model(input_ids, labels=labels)  # cross-entropy + ponder loss
        >>> out.logits.shape
        torch.Size([2, 20, 100])
    """

    base_model_class = HfxUniversalModel
    lm_head_class = HfxUniversalLMHead
    _tied_weights_keys = {"lm_head.decoder.weight": "universal.embeddings.word_embeddings.weight"}


class HfxUniversalForSequenceClassification(HfxSequenceClassificationHeadMixin, HfxUniversalPreTrainedModel):
    """Classification or regression from the first token (RoBERTa's head, which is BERT/ALBERT's pooler + classifier);
    losses by ``config.problem_type``, plus the ponder loss.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxUniversalConfig
        >>> from hf_xformers import HfxUniversalForSequenceClassification
        >>> config = HfxUniversalConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     intermediate_size=64, act_max_steps=4, num_labels=3,
        ... )
        >>> model = HfxUniversalForSequenceClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 20))
        >>> model(input_ids, labels=torch.tensor([0, 2])).logits.shape
        torch.Size([2, 3])
    """

    base_model_class = HfxUniversalModel


class HfxUniversalForTokenClassification(HfxTokenClassificationHeadMixin, HfxUniversalPreTrainedModel):
    """Per-token labels ``(batch, seq_len)`` (-100 where no loss is wanted), plus the ponder loss.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxUniversalConfig
        >>> from hf_xformers import HfxUniversalForTokenClassification
        >>> config = HfxUniversalConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     intermediate_size=64, act_max_steps=4, num_labels=5,
        ... )
        >>> model = HfxUniversalForTokenClassification(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 20))
        >>> model(input_ids, labels=torch.randint(0, 5, (2, 20))).logits.shape
        torch.Size([2, 20, 5])
    """

    base_model_class = HfxUniversalModel


# ----- generation ------------------------------------------------------------------------------------------------


class HfxUniversalForCausalLM(HfxCausalLMHeadMixin, HfxUniversalPreTrainedModel, GenerationMixin):
    """Decoder-only language model: causal self-attention (and causal separable convolutions), the LM head tied to
    the input embeddings. The config is copied with ``is_decoder=True`` and without cross-attention (the caller's
    object is left as it is).

    Inputs and labels as in :class:`~hf_xformers.layers.heads.HfxCausalLMHeadMixin`; the loss is the next-token
    cross-entropy plus the ponder loss. ``generate()`` keeps a :class:`HfxUniversalCache` (greedy, sampling and beam
    search).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxUniversalConfig, HfxUniversalForCausalLM
        >>> config = HfxUniversalConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     intermediate_size=64, act_max_steps=4,
        ... )
        >>> model = HfxUniversalForCausalLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 20))
        >>> model(input_ids, labels=input_ids).logits.shape  # labels shifted inside
        torch.Size([2, 20, 100])
        >>> prompt = input_ids[:, :6]
        >>> model.generate(prompt, min_new_tokens=4, max_new_tokens=4).shape
        torch.Size([2, 10])
    """

    base_model_class = HfxUniversalModel
    lm_head_class = HfxUniversalLMHead
    generation_cache_class = HfxUniversalCache
    _tied_weights_keys = {"lm_head.decoder.weight": "universal.embeddings.word_embeddings.weight"}

    @classmethod
    def causal_config(cls, config: HfxUniversalConfig) -> HfxUniversalConfig:
        if config.is_decoder and not config.add_cross_attention:
            return config
        config = copy.deepcopy(config)
        config.is_decoder, config.add_cross_attention = True, False
        return config


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs from ``labels`` ``(batch, tgt_len)``: the start token, then the labels without the last one
    (-100 replaced by the pad token)."""
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class HfxUniversalDecoderModel(HfxUniversalModel):
    """The decoder of :class:`HfxUniversalForSeq2SeqLM`: an :class:`HfxUniversalModel` built from a decoder's config
    (causal self-attention, cross-attention to the encoder). A class of its own because it is not the base model: the
    seq2seq model's only child of the base model's class is its encoder, the attribute ``base_model_prefix`` names,
    which is how transformers moves weights between a base checkpoint and the seq2seq model."""


class HfxUniversalForSeq2SeqLM(HfxGenerationMixin, HfxUniversalPreTrainedModel, GenerationMixin):
    """Encoder-decoder Universal Transformer (the paper's translation setting): a bidirectional encoder, a causal decoder
    whose block also attends to the encoder output, each with its own ACT (or fixed steps), shared word embeddings
    and an LM head tied to them.

    ``labels`` ``(batch, tgt_len)`` (-100 at padding) are the targets; without ``decoder_input_ids`` the decoder reads
    them shifted right after ``decoder_start_token_id`` (``bos_token_id`` when unset). The ponder loss is the
    encoder's plus the decoder's; the decoder's counts the positions whose label is not -100 (or those of
    ``decoder_attention_mask``).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxUniversalConfig, HfxUniversalForSeq2SeqLM
        >>> config = HfxUniversalConfig(
        ...     vocab_size=100, hidden_size=32, num_attention_heads=2,
        ...     intermediate_size=64, act_max_steps=4,
        ... )
        >>> model = HfxUniversalForSeq2SeqLM(config).eval()
        >>> input_ids = torch.randint(5, 100, (2, 20))
        >>> labels = torch.randint(5, 100, (2, 7))  # read shifted right
        >>> out = model(input_ids, labels=labels)
        >>> out.logits.shape
        torch.Size([2, 7, 100])
        >>> # the decoder's start token, then 5 new ones
        >>> model.generate(input_ids, min_new_tokens=5, max_new_tokens=5).shape
        torch.Size([2, 6])
    """

    generation_cache_class = HfxUniversalCache
    _tied_weights_keys = {
        "decoder.embeddings.word_embeddings.weight": "encoder.embeddings.word_embeddings.weight",
        "lm_head.decoder.weight": "encoder.embeddings.word_embeddings.weight",
    }

    def __init__(self, config: HfxUniversalConfig) -> None:
        if not config.is_encoder_decoder or config.is_decoder or config.add_cross_attention:
            config = copy.deepcopy(config)
            config.is_encoder_decoder, config.is_decoder, config.add_cross_attention = True, False, False
        super().__init__(config)
        self.encoder = HfxUniversalModel(config, add_pooling_layer=False)
        decoder_config = copy.deepcopy(config)
        decoder_config.is_encoder_decoder = False
        decoder_config.is_decoder = decoder_config.add_cross_attention = True
        self.decoder = HfxUniversalDecoderModel(decoder_config, add_pooling_layer=False)
        self.lm_head = HfxUniversalLMHead(config)
        self.post_init()

    # The base model (HfxUniversalModel, what AutoModel builds for this model type) is the encoder: a real attribute,
    # as transformers expects of base_model_prefix (`model.base_model`, loading a base checkpoint and the reverse).
    base_model_prefix = "encoder"
    # What a base / other-head checkpoint has that the seq2seq model does not (its encoder has no pooler).
    _keys_to_ignore_on_load_unexpected = [r"^encoder\.pooler\.", r"^(classifier|qa_outputs)\."]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, warm_start_decoder: bool = False, **kwargs):
        """transformers' ``from_pretrained``, which also warm-starts from an encoder checkpoint.

        A seq2seq checkpoint (``config.is_encoder_decoder``) loads as it was saved. A checkpoint of
        :class:`HfxUniversalModel` or of an encoder head (masked LM, classification ...) loads into the encoder (its
        ``embeddings.*``/``encoder.*`` or ``universal.*`` weights become ``encoder.*``; a masked LM's ``lm_head`` is
        kept, the word embeddings are shared with the decoder), as users of transformers' ``EncoderDecoderModel``
        expect. The decoder then starts from its initialisation, or, with ``warm_start_decoder=True``, from a copy of
        the loaded encoder (all but the cross-attention, which no encoder has). A ``key_mapping`` passed by the caller
        replaces the mapping.
        """
        probe = kwargs.get("config")
        if not isinstance(probe, cls.config_class):
            hub = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
            probe = cls.config_class.from_pretrained(
                pretrained_model_name_or_path, **{k: kwargs[k] for k in hub if k in kwargs}
            )
        from_encoder = not probe.is_encoder_decoder
        if from_encoder:
            # One pattern for both layouts (one rename per key): a base model's own names, or a head's "universal.".
            kwargs.setdefault("key_mapping", {r"^(?:universal\.)?(embeddings|encoder|pooler)\.": r"encoder.\1."})
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if from_encoder and warm_start_decoder:
            with torch.no_grad():
                model.decoder.load_state_dict(model.encoder.state_dict(), strict=False)
        return loaded

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embeddings.word_embeddings = value
        self.decoder.embeddings.word_embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.decoder = new_embeddings

    def get_encoder(self, modality: str | None = None) -> HfxUniversalModel:
        return self.encoder

    def get_decoder(self) -> HfxUniversalDecoderModel:
        return self.decoder

    @property
    def decoder_start_token_id(self) -> int:
        start = self.config.decoder_start_token_id
        return self.config.bos_token_id if start is None else start

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: HfxUniversalModelOutput | tuple | None = None,
        past_key_values: HfxUniversalCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: HfxUniversalCache | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[CuSeqLensKwargs],
    ) -> HfxUniversalSeq2SeqLMOutput | tuple:
        """Returns ``logits`` ``(batch, tgt_len, vocab)``, the decoder cache when one is used, and with ``labels`` the
        cross-entropy (mean over labelled tokens, or sum over ``num_items_in_batch``) plus the ponder loss.

        ``input_ids``/``attention_mask`` ``(batch, src_len)`` feed the encoder unless ``encoder_outputs`` are given
        (``generate()`` encodes once); ``decoder_attention_mask`` is ``(batch, past + tgt_len)`` with a cache.
        ``position_ids`` and the padding-free collator's boundaries (``seq_idx``, ``kwargs``) are accepted only to
        refuse them with a ``ValueError``: packed batches are not supported here.

        Args:
            input_ids: ``(batch, src_len)`` source token ids.
            attention_mask: ``(batch, src_len)``, 1 for real source tokens, 0 for padding.
            decoder_input_ids: ``(batch, tgt_len)`` (None: ``labels`` shifted right after the start token).
            decoder_attention_mask: ``(batch, tgt_len)``, or ``(batch, past + tgt_len)`` with a cache.
            encoder_outputs: the encoder's output for ``input_ids``, to skip encoding it again.
            past_key_values: the decoder's :class:`HfxUniversalCache` from an earlier call (its name before
                transformers 5.24).
            inputs_embeds: ``(batch, src_len, embedding_size or hidden_size)``, instead of ``input_ids``.
            decoder_inputs_embeds: ``(batch, tgt_len, embedding_size or hidden_size)``, instead of
                ``decoder_input_ids``.
            labels: ``(batch, tgt_len)`` target ids, -100 at padding.
            use_cache: start or continue the decoder's cache and return it.
            num_items_in_batch: the number of labelled tokens over the accumulated batch (Trainer).
            output_attentions: also return the attention probabilities of every step (self and cross).
            output_hidden_states: also return the states after the embeddings and after every step.
            return_dict: an ``HfxUniversalSeq2SeqLMOutput`` (None: ``config.return_dict``) or a plain tuple.
            cache: the same as ``past_key_values``, under its name from transformers 5.24.
            position_ids: refused (see above).
            seq_idx: refused (see above).
            **kwargs: the padding-free collator's other boundaries, refused (see above).

        Returns:
            ``HfxUniversalSeq2SeqLMOutput``: ``loss``, ``logits`` ``(batch, tgt_len, vocab_size)``, the cache, the
            encoder's and decoder's ponder losses and steps, ``hidden_states`` and ``attentions`` when asked.
        """
        self._refuse_packing(position_ids, packing_kwargs(self, kwargs, seq_idx))
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            )  # fmt: skip
        elif not isinstance(encoder_outputs, HfxUniversalModelOutput):
            encoder_outputs = HfxUniversalModelOutput(last_hidden_state=encoder_outputs[0])
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id, self.decoder_start_token_id)
        out = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask, inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_outputs.last_hidden_state, encoder_attention_mask=attention_mask,
            past_key_values=resolve_cache_argument(past_key_values, cache), use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
        )  # fmt: skip
        logits = self.lm_head(out.last_hidden_state)
        ponder = self._ponder_loss(out, encoder_outputs, labels if decoder_attention_mask is None else None)
        loss = token_cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
        result = _seq2seq_output(_add_ponder(loss, ponder), logits, ponder, out, encoder_outputs)
        return self._finish(result, return_dict)

    def _refuse_packing(self, position_ids: torch.Tensor | None, packing: PackedBatchKwargs) -> None:
        """Raise the ``ValueError`` of :func:`~hf_xformers.ops.packing.refuse_packed` when ``position_ids`` or any of
        the padding-free collator's boundaries (``packing``) is given."""
        given = [name for name, value in {"position_ids": position_ids, **packing}.items() if value is not None]
        if given:
            refuse_packed(
                type(self).__name__,
                f"it was given {', '.join(given)}; source and target documents would have to be packed in step, and "
                "its positions always count from 0 in each row",
                "Pad the batch instead (DataCollatorForSeq2Seq).",
            )

    def _ponder_loss(
        self, decoded: HfxUniversalModelOutput, encoded: HfxUniversalModelOutput, labels: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The ponder loss of both stacks (None without ACT): the decoder's over its real positions, or, given
        ``labels`` ``(batch, tgt_len)`` (when there is no decoder mask), over the labelled ones, plus the encoder's."""
        if not self.config.use_act:
            return None
        decoder_ponder = decoded.ponder_loss
        if labels is not None:
            # Decoder padding (after the targets) never reaches real positions (causal attention), but must stay out
            # of the mean: without a decoder mask, the labelled positions are the real ones.
            decoder_ponder = ponder_loss(
                decoded.ponder_steps, decoded.ponder_remainders, labels.ne(-100), self.config.act_loss_weight
            )
        encoder_ponder = encoded.ponder_loss
        return decoder_ponder if encoder_ponder is None else decoder_ponder + encoder_ponder

    def _prepare_text_encoder_decoder_kwargs_for_generation(
        self, inputs_tensor: torch.Tensor, model_kwargs: dict, model_input_name: str | None, generation_config
    ) -> dict:
        """The encoder pass of ``generate()``, without the scalar ``ponder_loss``: generate repeats every tensor of
        the encoder output along the batch for beams and extra sequences, which a 0-d tensor does not allow.
        (A private ``GenerationMixin`` hook; the beam-search test fails loudly if transformers renames it.)"""
        model_kwargs = super()._prepare_text_encoder_decoder_kwargs_for_generation(
            inputs_tensor, model_kwargs, model_input_name, generation_config
        )
        encoded = model_kwargs["encoder_outputs"]
        model_kwargs["encoder_outputs"] = HfxUniversalModelOutput(
            last_hidden_state=encoded.last_hidden_state, hidden_states=encoded.hidden_states,
            attentions=encoded.attentions, ponder_steps=encoded.ponder_steps,
            ponder_remainders=encoded.ponder_remainders,
        )  # fmt: skip
        return model_kwargs
