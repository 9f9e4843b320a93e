"""The eight architectures in the Long Range Arena's settings, behind one call: :func:`build_model`.

Every architecture gets the same body size (the *small* setting of the PyTorch re-runs by default: 2 layers, hidden
64, feed-forward 128, 2 heads; or LRA's per-task setting, :data:`LRA_SETTINGS`) and its own attention knobs at
values that suit the sequence length (:func:`arch_knobs`, listed in every result). Sequences are classified from
the mean of their real tokens (``classifier_pooling="mean"``) through the architecture's own
``AutoModelForSequenceClassification`` head; three cases need a wrapper:

* Retrieval (two documents): :class:`TwoTowerClassifier` encodes both with the same base model, mean-pools each and
  classifies ``[u, v, u * v, u - v]`` with a two-layer MLP (LRA's setup).
* Transformer-XL reads a sequence as segments with memory (:class:`SegmentedTransfoXL`): each segment attends to
  itself and to the cached (detached) states of the previous one, as Transformer-XL was designed to run; the
  classifier reads the mean over all segments' real tokens.
* Swin classifies the 2-D image (``image_shape``) with its image head: not LRA's 1-D pixel-sequence protocol, and
  marked so in the tables. It does not take the text tasks.

All models are built from ``seed``: the same initial weights for the same architecture, task and seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

import hf_xformers
from hf_xformers.layers.losses import sequence_classification_loss
from hf_xformers.layers.pooling import pool_tokens
from hf_xformers.registration import REGISTRY

ARCHS = (
    "hfx-longformer",
    "hfx-bigbird",
    "hfx-linformer",
    "hfx-performer",
    "hfx-reformer",
    "hfx-transfo-xl",
    "hfx-universal",
    "hfx-swin",
)
VISION_ARCHS = ("hfx-swin",)

# Body sizes: the PyTorch re-runs' small setting, and LRA's per-task settings (paper appendix).
SMALL = dict(layers=2, hidden=64, ffn=128, heads=2)
LRA_SETTINGS = {
    "listops": dict(layers=6, hidden=512, ffn=2048, heads=8),
    "text": dict(layers=6, hidden=512, ffn=2048, heads=8),
    "retrieval": dict(layers=4, hidden=128, ffn=512, heads=4),
    "image": dict(layers=3, hidden=64, ffn=128, heads=4),
    "pathfinder": dict(layers=4, hidden=128, ffn=128, heads=8),
}


def body_size(task: str, setting: str) -> dict:
    """``layers``, ``hidden``, ``ffn``, ``heads`` for ``setting`` ``"small"`` or ``"lra"``."""
    if setting == "small":
        return dict(SMALL)
    if setting == "lra":
        return dict(LRA_SETTINGS[task])
    raise ValueError(f"setting must be 'small' or 'lra', got {setting!r}.")


def arch_knobs(arch: str, length: int, heads: int, hidden: int) -> dict:
    """Each architecture's own attention settings for sequences of ``length`` tokens (config field -> value).

    Chosen so that each one is an efficient approximation at this length, not full attention in disguise: a
    Longformer window and BigBird blocks of about an eighth to a thirtieth of the length, Linformer's k and
    Performer's features at the re-runs' 256 (capped by the length), LSH chunks of 64 with about one bucket per chunk
    and two hashing rounds, Transformer-XL segments of a quarter of the length with equal memory.
    """
    if arch == "hfx-longformer":
        window = max(8, min(256, 2 ** round(math.log2(max(length // 8, 8)))))
        return {"attention_window": window}
    if arch == "hfx-bigbird":
        block = 16 if length <= 512 else 32 if length <= 2048 else 64
        return {"block_size": min(block, max(2, length // 8)), "num_random_blocks": 2}
    if arch == "hfx-linformer":
        return {"linformer_k": min(256, length), "linformer_sharing": "headwise"}
    if arch == "hfx-performer":
        return {"num_random_features": 256}
    if arch == "hfx-reformer":
        chunk = min(64, max(4, length // 4))
        buckets = max(2, 2 * round(length / chunk / 2))
        return {"lsh_attn_chunk_length": chunk, "num_buckets": buckets, "num_hashes": 2, "attn_layers": "lsh"}
    if arch == "hfx-transfo-xl":
        segment = max(16, length // 4)
        return {"segment_length": segment, "mem_len": segment}
    if arch == "hfx-universal":
        return {"use_act": False, "steps": "= layers (one shared layer applied `layers` times)"}
    if arch == "hfx-swin":
        return {"patch_size": 2, "window_size": 4, "depths": "[layers // 2, layers - layers // 2]"}
    raise ValueError(f"Unknown architecture {arch!r}; choose from {ARCHS}.")


def _text_config(arch: str, *, vocab_size: int, length: int, num_labels: int, size: dict, dropout: float):
    """The ``hfx-*`` config of a text architecture for sequences of ``length`` token ids (0 = padding)."""
    layers, hidden, ffn, heads = size["layers"], size["hidden"], size["ffn"], size["heads"]
    knobs = arch_knobs(arch, length, heads, hidden)
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=ffn, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        num_labels=num_labels, pad_token_id=0, bos_token_id=None, eos_token_id=None, sep_token_id=None,
        classifier_pooling="mean", type_vocab_size=1,
        # RoBERTa's offset: positions start at pad_token_id + 1, so the table needs length + 1 rows.
        max_position_embeddings=length + 2,
    )  # fmt: skip
    if arch == "hfx-longformer":
        return hf_xformers.HfxLongformerConfig(**common, **knobs)
    if arch == "hfx-bigbird":
        return hf_xformers.HfxBigBirdConfig(**{**common, "max_position_embeddings": length}, **knobs)
    if arch == "hfx-linformer":
        return hf_xformers.HfxLinformerConfig(**common, **knobs)
    if arch == "hfx-performer":
        return hf_xformers.HfxPerformerConfig(**common, **knobs)
    if arch == "hfx-universal":
        return hf_xformers.HfxUniversalConfig(**common, use_act=False)
    if arch == "hfx-reformer":
        chunk = knobs["lsh_attn_chunk_length"]
        return hf_xformers.HfxReformerConfig(
            vocab_size=vocab_size, hidden_size=hidden, num_attention_heads=heads, attention_head_size=hidden // heads,
            feed_forward_size=ffn, attn_layers=["lsh"] * layers, lsh_attn_chunk_length=chunk,
            local_attn_chunk_length=chunk, num_buckets=knobs["num_buckets"], num_hashes=knobs["num_hashes"],
            axial_pos_embds=False, max_position_embeddings=math.ceil(length / chunk) * chunk, pad_token_id=0,
            eos_token_id=None, hidden_dropout_prob=dropout, lsh_attention_probs_dropout_prob=dropout,
            local_attention_probs_dropout_prob=dropout, num_labels=num_labels, classifier_pooling="mean",
            hidden_act="gelu",
        )  # fmt: skip
    if arch == "hfx-transfo-xl":
        return hf_xformers.HfxTransfoXLConfig(
            vocab_size=vocab_size, d_model=hidden, d_embed=hidden, n_head=heads, d_head=hidden // heads, d_inner=ffn,
            n_layer=layers, mem_len=knobs["mem_len"], clamp_len=length, same_length=False, cutoffs=[], div_val=1,
            dropout=dropout, dropatt=dropout, num_labels=num_labels, pad_token_id=0, eos_token_id=None,
            classifier_pooling="mean",
        )  # fmt: skip
    raise ValueError(f"{arch} is not a text architecture; choose from {[a for a in ARCHS if a not in VISION_ARCHS]}.")


class SegmentedTransfoXL(nn.Module):
    """Transformer-XL classification over a long sequence read as segments of ``segment_length`` tokens, carrying
    the memories from one segment to the next; the head reads the mean of every segment's real tokens.

    ``forward(input_ids (batch, seq_len), attention_mask (batch, seq_len), labels (batch,))``.
    """

    def __init__(self, model: hf_xformers.HfxTransfoXLForSequenceClassification, segment_length: int) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.segment_length = segment_length

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``(batch, seq_len)`` -> ``(batch, seq_len, d_model)`` hidden states, segment by segment with memory."""
        mems, states = None, []
        for start in range(0, input_ids.shape[1], self.segment_length):
            piece = slice(start, start + self.segment_length)
            mask = None if attention_mask is None else attention_mask[:, piece]
            out = self.model.transformer(input_ids[:, piece], mems=mems, attention_mask=mask, return_dict=True)
            states.append(out.last_hidden_state)
            mems = out.mems
        return torch.cat(states, dim=1)

    def forward(self, input_ids, attention_mask=None, labels=None) -> SequenceClassifierOutput:
        pooled = pool_tokens(self.encode(input_ids, attention_mask), attention_mask, "mean")
        logits = self.model.classifier(self.model.dropout(pooled))
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


class TwoTowerClassifier(nn.Module):
    """LRA's retrieval model: both documents through one encoder, mean-pooled to ``u`` and ``v``, then
    ``MLP([u, v, u * v, u - v])`` -> ``num_labels`` logits.

    ``encoder(input_ids, attention_mask) -> (batch, seq_len, hidden)``; ``forward`` takes ``input_ids``,
    ``attention_mask``, ``input_ids_2``, ``attention_mask_2`` (each ``(batch, seq_len)``) and ``labels``.
    """

    def __init__(self, encoder: nn.Module, hidden: int, num_labels: int, config, dropout: float = 0.1) -> None:
        super().__init__()
        self.encoder = encoder
        self.config = config
        self.mlp = nn.Sequential(
            nn.Linear(4 * hidden, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, num_labels)
        )

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return pool_tokens(self.encoder(input_ids, attention_mask), attention_mask, "mean")

    def forward(
        self, input_ids, attention_mask=None, input_ids_2=None, attention_mask_2=None, labels=None
    ) -> SequenceClassifierOutput:
        u, v = self.embed(input_ids, attention_mask), self.embed(input_ids_2, attention_mask_2)
        logits = self.mlp(torch.cat([u, v, u * v, u - v], dim=-1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


class _BaseEncoder(nn.Module):
    """``(input_ids, attention_mask) -> last_hidden_state`` of an ``hfx-*`` base model (the retrieval tower)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        state = out.last_hidden_state
        # Reformer's states are [y1; y2] (2 * hidden): the two halves of the reversible stream, averaged.
        return state if state.shape[-1] == self.model.config.hidden_size else state.view(*state.shape[:-1], 2, -1).mean(-2)


def build_model(
    arch: str,
    task: str,
    *,
    vocab_size: int,
    length: int,
    num_labels: int,
    two_tower: bool = False,
    image_shape: tuple[int, int] | None = None,
    setting: str = "small",
    dropout: float = 0.1,
    seed: int = 0,
) -> tuple[nn.Module, dict]:
    """The model of ``arch`` for ``task`` and the settings it was built with (for the results).

    Returns ``(model, settings)``; ``model(**batch)`` returns an output with ``loss`` and ``logits``.
    """
    size = body_size(task, setting)
    torch.manual_seed(seed)
    knobs = arch_knobs(arch, length, size["heads"], size["hidden"])
    settings = {**size, **{k: v for k, v in knobs.items()}, "setting": setting, "pooling": "mean"}
    if arch in VISION_ARCHS:
        if image_shape is None:
            raise ValueError(f"{arch} is a vision model: it takes the image and pathfinder tasks, not {task!r}.")
        depths = [max(1, size["layers"] // 2), max(1, size["layers"] - size["layers"] // 2)]
        config = hf_xformers.HfxSwinConfig(
            image_size=list(image_shape), patch_size=2, num_channels=1, embed_dim=size["hidden"], depths=depths,
            num_heads=[size["heads"], 2 * size["heads"]], window_size=4, mlp_ratio=size["ffn"] / size["hidden"],
            hidden_dropout_prob=dropout, drop_path_rate=dropout, num_labels=num_labels, encoder_stride=4,
        )  # fmt: skip
        settings.update(depths=depths, protocol="2-D image (not LRA's 1-D pixel sequence)")
        return SwinOnPixels(hf_xformers.HfxSwinForImageClassification(config), image_shape), settings
    config = _text_config(arch, vocab_size=vocab_size, length=length, num_labels=num_labels, size=size, dropout=dropout)
    if arch == "hfx-transfo-xl":
        model = SegmentedTransfoXL(hf_xformers.HfxTransfoXLForSequenceClassification(config), knobs["segment_length"])
        if two_tower:
            return TwoTowerClassifier(_SegmentEncoder(model), size["hidden"], num_labels, config, dropout), settings
        return model, settings
    if two_tower:
        base = _BaseEncoder(REGISTRY[config.model_type][1]["AutoModel"](config))
        return TwoTowerClassifier(base, size["hidden"], num_labels, config, dropout), settings
    return REGISTRY[config.model_type][1]["AutoModelForSequenceClassification"](config), settings


class _SegmentEncoder(nn.Module):
    def __init__(self, segmented: SegmentedTransfoXL) -> None:
        super().__init__()
        self.segmented = segmented

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.segmented.encode(input_ids, attention_mask)


class SwinOnPixels(nn.Module):
    """Swin's image classifier on pixel-id sequences: ids ``1..256`` (``(batch, H * W)``, row-major; 0 = padding)
    become one-channel images in ``[-1, 1]``, ``(batch, 1, H, W)``."""

    def __init__(self, model: nn.Module, image_shape: tuple[int, int]) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.image_shape = tuple(image_shape)

    def forward(self, input_ids, attention_mask=None, labels=None) -> SequenceClassifierOutput:
        # In the weights' dtype (a bfloat16 model takes bfloat16 pixels; under autocast the weights stay float32).
        pixels = ((input_ids.float() - 1.0).clamp(min=0.0) / 127.5 - 1.0).to(self.model.dtype)
        out = self.model(pixel_values=pixels.view(-1, 1, *self.image_shape), labels=labels, return_dict=True)
        return SequenceClassifierOutput(loss=out.loss, logits=out.logits)
