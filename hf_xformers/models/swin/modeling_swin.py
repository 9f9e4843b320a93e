"""``hfx-swin``: the hierarchical Swin Transformer (Liu et al., 2021) and its heads.

Layout (parameter names follow the Swin checkpoints on the Hub, so importing them is a rename at most)::

    embeddings      patch_embeddings.projection (Conv2d, stride = patch) -> norm [-> mask token] [+ abs. positions]
    encoder.layers  one HfxSwinStage per entry of config.depths:
        blocks      HfxSwinLayer x depth, shift 0 / window // 2 alternating (pre-LN):
                        x = x + drop_path(attention.output(attention.self(layernorm_before(x))))
                        x = x + drop_path(output(intermediate(layernorm_after(x))))
        downsample  HfxSwinPatchMerging (every stage but the last): 2x2 neighbours -> norm -> reduction, C -> 2C
    layernorm       final LayerNorm; the pooled output is the mean over the last map's tokens

The window attention itself (shift, padding, relative position bias, SDPA) is
:class:`~hf_xformers.attention.shifted_window.HfxShiftedWindowSelfAttention`.

**Any input size works**: images are zero-padded to a multiple of the patch size, every block pads its map to a
multiple of its window, and patch merging pads odd maps to even sizes; outputs cover the real tokens only
(``ceil(H / patch)`` x ``ceil(W / patch)`` at stage 1, halved, rounded up, per stage). Maps no larger than the
window use one window over the short side and no shift (transformers' rule; transformers fails when a map gets
*smaller* than the window, we do not). With the same weights, outputs equal transformers' ``Swin*`` classes.

Heads: :class:`HfxSwinModel` (pooled output; per-stage maps in ``reshaped_hidden_states``),
:class:`HfxSwinForImageClassification`, :class:`HfxSwinForMaskedImageModeling` (SimMIM) and
:class:`HfxSwinBackbone` (``feature_maps`` of ``config.out_features``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.backbone_utils import BackboneMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BackboneOutput
from transformers.models.swin.modeling_swin import (
    SwinImageClassifierOutput,
    SwinMaskedImageModelingOutput,
    SwinModelOutput,
)
from transformers.utils import ModelOutput

from ...attention.shifted_window import HfxShiftedWindowSelfAttention
from ...layers.encoder import HfxIntermediate
from ...layers.heads import sequence_classification_loss
from ...layers.pretrained import HfxPreTrainedModel
from ...ops.shapes import ceil_div
from .configuration_swin import HfxSwinConfig

# LayerNorms whose eps the original checkpoints fix at 1e-5 whatever config.layer_norm_eps says
# (patch embedding, patch merging, backbone outputs); kept so converted models give the same numbers.
FIXED_LAYER_NORM_EPS = 1e-5


# ----------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------


# The outputs are transformers' Swin outputs (the same fields: last_hidden_state / logits / reconstruction, with
# hidden_states, attentions and the feature maps reshaped_hidden_states), under our names, so code written for
# transformers' Swin reads ours unchanged. attentions: per stage, the probabilities of its last block,
# (batch * windows, heads, window**2, window**2); pooler_output: the mean over tokens; the masked-image-modelling loss
# is the mean L1 over masked pixels and channels (float32).
HfxSwinModelOutput = SwinModelOutput
HfxSwinImageClassifierOutput = SwinImageClassifierOutput
HfxSwinMaskedImageModelingOutput = SwinMaskedImageModelingOutput


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


def stage_grids(config: HfxSwinConfig, height: int, width: int) -> list[tuple[int, int]]:
    """Token grid ``(rows, cols)`` of every stage for a ``height x width`` image (padding included)."""
    patch_h, patch_w = _pair(config.patch_size)
    grid = (-(-height // patch_h), -(-width // patch_w))
    grids = [grid]
    for _ in range(len(config.depths) - 1):
        grid = ((grid[0] + 1) // 2, (grid[1] + 1) // 2)
        grids.append(grid)
    return grids


def merged_size(size):
    """Rows (or columns) after patch merging: ``ceil(size / 2)``, written so that a symbolic size traces."""
    return ceil_div(size, 2)


def tokens_to_map(tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``(batch, h * w, C)`` -> ``(batch, C, h, w)``."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], *grid)


# ----------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------


class HfxDropPath(nn.Module):
    """Stochastic depth: zero a whole residual branch per sample with probability ``p`` (training only) and scale
    the kept ones by ``1 / (1 - p)``."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask.div_(keep)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class HfxSwinPatchEmbeddings(nn.Module):
    """Non-overlapping patches -> ``embed_dim`` channels: ``(batch, C, H, W)`` -> ``(batch, h * w, embed_dim)``
    with ``(h, w) = (ceil(H / patch), ceil(W / patch))``; the image is zero-padded at the bottom/right."""

    def __init__(self, config: HfxSwinConfig) -> None:
        super().__init__()
        self.patch_size = _pair(config.patch_size)
        self.projection = nn.Conv2d(config.num_channels, config.embed_dim, self.patch_size, stride=self.patch_size)

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        height, width = pixel_values.shape[-2:]
        patch_h, patch_w = self.patch_size
        # Ceil-divisions written so that symbolic sizes trace; traced graphs always pad (by 0 at a multiple).
        pad_h, pad_w = ceil_div(height, patch_h) * patch_h - height, ceil_div(width, patch_w) * patch_w - width
        if torch.compiler.is_compiling() or height % patch_h or width % patch_w:
            pixel_values = F.pad(pixel_values, (0, pad_w, 0, pad_h))
        x = self.projection(pixel_values)
        return x.flatten(2).transpose(1, 2), (x.shape[2], x.shape[3])


class HfxSwinEmbeddings(nn.Module):
    """Patch embedding -> LayerNorm -> (SimMIM) mask tokens -> (optional) absolute positions -> dropout."""

    def __init__(self, config: HfxSwinConfig, use_mask_token: bool = False) -> None:
        super().__init__()
        self.patch_embeddings = HfxSwinPatchEmbeddings(config)
        self.norm = nn.LayerNorm(config.embed_dim, eps=FIXED_LAYER_NORM_EPS)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, config.embed_dim)) if use_mask_token else None
        image_h, image_w = _pair(config.image_size)
        patch_h, patch_w = self.patch_embeddings.patch_size
        self.position_grid = (image_h // patch_h, image_w // patch_w)
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, self.position_grid[0] * self.position_grid[1], config.embed_dim))
            if config.use_absolute_embeddings
            else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def absolute_positions(self, grid: tuple[int, int]) -> torch.Tensor:
        """``(1, h * w, embed_dim)``: the table, bicubically resized when the token grid differs from the
        ``image_size`` it was made for (so any input size works)."""
        table = self.position_embeddings
        if tuple(grid) == self.position_grid:
            return table
        table = tokens_to_map(table, self.position_grid)
        table = F.interpolate(table, size=grid, mode="bicubic", align_corners=False)
        return table.flatten(2).transpose(1, 2)

    def forward(
        self, pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """``(batch, C, H, W)`` -> ``((batch, h * w, embed_dim), (h, w))``. ``bool_masked_pos`` ``(batch, h * w)``:
        True where the patch is replaced by the mask token."""
        x, grid = self.patch_embeddings(pixel_values)
        x = self.norm(x)
        if bool_masked_pos is not None:
            masked = bool_masked_pos.unsqueeze(-1).to(x.dtype)
            x = x * (1.0 - masked) + self.mask_token.to(x.dtype) * masked
        if self.position_embeddings is not None:
            x = x + self.absolute_positions(grid)
        return self.dropout(x), grid


class HfxSwinSelfOutput(nn.Module):
    """Output projection of the attention (per token, so it commutes with the window shuffling)."""

    def __init__(self, config: HfxSwinConfig, dim: int) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.dense(context))


class HfxSwinAttention(nn.Module):
    """``self`` (window attention) followed by ``output`` (projection): ``(batch, L, dim)`` -> same."""

    def __init__(self, config: HfxSwinConfig, dim: int, num_heads: int, shift_size: int) -> None:
        super().__init__()
        self.self = HfxShiftedWindowSelfAttention(config, dim, num_heads, shift_size)
        self.output = HfxSwinSelfOutput(config, dim)

    def forward(self, hidden_states, input_dimensions, always_partition=False, output_attentions=False):
        out = self.self(hidden_states, input_dimensions, always_partition, output_attentions)
        return self.output(out.context), out.attentions


class HfxSwinIntermediate(HfxIntermediate):
    """The shared feed-forward expansion at a stage's width: ``dim -> mlp_ratio * dim``."""

    def __init__(self, config: HfxSwinConfig, dim: int) -> None:
        super().__init__(config, dim, int(config.mlp_ratio * dim))


class HfxSwinOutput(nn.Module):
    def __init__(self, config: HfxSwinConfig, dim: int) -> None:
        super().__init__()
        self.dense = nn.Linear(int(config.mlp_ratio * dim), dim)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.dense(hidden_states))


class HfxSwinLayer(GradientCheckpointingLayer):
    """One Swin block (pre-LN): window attention, then MLP, each a residual branch with stochastic depth.

    Stochastic depth applies to both branches, as in the original and timm (transformers applies it to the
    attention branch only); it only matters in training.
    """

    def __init__(self, config: HfxSwinConfig, dim: int, num_heads: int, shift_size: int, drop_path: float) -> None:
        super().__init__()
        self.layernorm_before = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.attention = HfxSwinAttention(config, dim, num_heads, shift_size)
        self.drop_path = HfxDropPath(drop_path)
        self.layernorm_after = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.intermediate = HfxSwinIntermediate(config, dim)
        self.output = HfxSwinOutput(config, dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_dimensions: tuple[int, int],
        always_partition: bool = False,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(batch, H * W, dim)`` -> (same shape, attention probabilities or None)."""
        attended, probs = self.attention(
            self.layernorm_before(hidden_states), input_dimensions, always_partition, output_attentions
        )
        hidden_states = hidden_states + self.drop_path(attended)
        hidden_states = hidden_states + self.drop_path(
            self.output(self.intermediate(self.layernorm_after(hidden_states)))
        )
        return hidden_states, probs


class HfxSwinPatchMerging(nn.Module):
    """Halve the resolution, double the channels: each 2x2 neighbourhood's four ``dim`` vectors are concatenated
    (order: (0,0), (1,0), (0,1), (1,1) as (row, col)), normalised and projected ``4 dim -> 2 dim``. Odd maps are
    zero-padded at the bottom/right first. ``(batch, H * W, dim)`` -> ``(batch, ceil(H/2) * ceil(W/2), 2 dim)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim, eps=FIXED_LAYER_NORM_EPS)

    def forward(self, hidden_states: torch.Tensor, input_dimensions: tuple[int, int]) -> torch.Tensor:
        height, width = input_dimensions
        batch, _, dim = hidden_states.shape
        half_h, half_w = merged_size(height), merged_size(width)
        x = hidden_states.view(batch, height, width, dim)
        if torch.compiler.is_compiling() or height % 2 or width % 2:  # traced graphs always pad (by 0 when even)
            x = F.pad(x, (0, 0, 0, 2 * half_w - width, 0, 2 * half_h - height))
        # (batch, h/2, row parity, w/2, col parity, dim) -> neighbours in the order (0,0), (1,0), (0,1), (1,1): a view
        # and one copy (rather than four strided slices, whose sizes a tracer cannot prove equal for a symbolic size).
        x = x.view(batch, half_h, 2, half_w, 2, dim).permute(0, 1, 3, 4, 2, 5).reshape(batch, -1, 4 * dim)
        return self.reduction(self.norm(x))


class HfxSwinStage(nn.Module):
    """``depth`` blocks at one resolution, then (except for the last stage) patch merging."""

    def __init__(self, config: HfxSwinConfig, stage: int, drop_path: list[float]) -> None:
        super().__init__()
        dim = config.embed_dim * 2**stage
        self.blocks = nn.ModuleList(
            HfxSwinLayer(config, dim, config.num_heads[stage], 0 if i % 2 == 0 else config.window_size // 2, rate)
            for i, rate in enumerate(drop_path)
        )
        self.downsample = HfxSwinPatchMerging(dim) if stage < len(config.depths) - 1 else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_dimensions: tuple[int, int],
        always_partition: bool = False,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], torch.Tensor | None]:
        """Returns ``(output, output before merging, output grid, last block's attentions)``; the output is
        ``(batch, tokens, channels)`` on the returned grid."""
        probs = None
        for block in self.blocks:
            hidden_states, probs = block(hidden_states, input_dimensions, always_partition, output_attentions)
        before = hidden_states
        if self.downsample is None:
            return hidden_states, before, input_dimensions, probs
        grid = (merged_size(input_dimensions[0]), merged_size(input_dimensions[1]))
        return self.downsample(hidden_states, input_dimensions), before, grid, probs


@dataclass
class HfxSwinEncoderOutput(ModelOutput):
    """What :class:`HfxSwinEncoder` returns; ``stage_maps``: the stem and every stage's map before merging,
    ``(batch, C, h, w)`` (the backbone's features)."""

    last_hidden_state: torch.Tensor | None = None
    grid: tuple[int, int] | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    reshaped_hidden_states: tuple[torch.Tensor, ...] | None = None
    stage_maps: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class HfxSwinEncoder(nn.Module):
    """The stages, with stochastic-depth rates rising linearly from 0 to ``drop_path_rate`` over all blocks."""

    def __init__(self, config: HfxSwinConfig) -> None:
        super().__init__()
        total = sum(config.depths)
        rates = [config.drop_path_rate * i / max(total - 1, 1) for i in range(total)]
        starts = [sum(config.depths[:s]) for s in range(len(config.depths))]
        self.layers = nn.ModuleList(
            HfxSwinStage(config, s, rates[start : start + depth])
            for s, (start, depth) in enumerate(zip(starts, config.depths))
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        grid: tuple[int, int],
        always_partition: bool = False,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        output_stage_maps: bool = False,
    ) -> HfxSwinEncoderOutput:
        """``hidden_states`` ``(batch, h * w, embed_dim)`` on ``grid`` ``(h, w)``."""
        stem = tokens_to_map(hidden_states, grid) if output_hidden_states or output_stage_maps else None
        hidden = (hidden_states,) if output_hidden_states else None
        maps = (stem,) if output_hidden_states else None
        stage_maps = (stem,) if output_stage_maps else None
        attentions = () if output_attentions else None
        for stage in self.layers:
            stage_grid = grid
            hidden_states, before, grid, probs = stage(hidden_states, grid, always_partition, output_attentions)
            if output_hidden_states:
                hidden += (hidden_states,)
                maps += (tokens_to_map(hidden_states, grid),)
            if output_stage_maps:
                stage_maps += (tokens_to_map(before, stage_grid),)
            if output_attentions:
                attentions += (probs,)
        return HfxSwinEncoderOutput(
            last_hidden_state=hidden_states,
            grid=grid,
            hidden_states=hidden,
            reshaped_hidden_states=maps,
            stage_maps=stage_maps,
            attentions=attentions,
        )


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


class HfxSwinPreTrainedModel(HfxPreTrainedModel):
    config_class = HfxSwinConfig
    sequence_parallel_refusal = (
        "an image model: its windows shift across the whole patch grid and merge it stage by stage; shard "
        "images with data parallelism instead"
    )
    base_model_prefix = "swin"
    main_input_name = "pixel_values"
    # Window attention with the relative-position bias and the shift mask as FlexAttention's score_mod.
    _supports_flex_attn = True
    input_modalities = ("image",)
    # The block, not the stage (transformers' choice): FSDP gathers one unit's parameters at a time, and one stage
    # holds most of a model (18 of Swin-B's 24 blocks).
    _no_split_modules = ["HfxSwinLayer"]
    # Older Swin checkpoints store the (recomputed) relative position index as a buffer.
    _keys_to_ignore_on_load_unexpected = [r"relative_position_index"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HfxShiftedWindowSelfAttention):
            init.zeros_(module.relative_position_bias_table)
        elif isinstance(module, HfxSwinEmbeddings):
            if module.mask_token is not None:
                init.zeros_(module.mask_token)
            if module.position_embeddings is not None:
                init.zeros_(module.position_embeddings)

    def _head_result(self, output_class: type, base_output, loss: torch.Tensor | None, **fields):
        """A head's output (:meth:`HfxPreTrainedModel._head_result`) with the base model's
        ``reshaped_hidden_states`` too, the hidden states as ``(batch, channels, h, w)`` maps."""
        return super()._head_result(
            output_class, base_output, loss, reshaped_hidden_states=base_output.reshaped_hidden_states, **fields
        )

    def _check_pixel_values(self, pixel_values: torch.Tensor | None, bool_masked_pos: torch.Tensor | None = None):
        """Raise a ``ValueError`` naming the fix for inputs the model cannot take."""
        if pixel_values is None:
            raise ValueError("Pass `pixel_values` (batch, num_channels, height, width), e.g. from the image processor.")
        if pixel_values.dim() != 4:
            raise ValueError(
                f"`pixel_values` must have shape (batch, num_channels, height, width), got {tuple(pixel_values.shape)}. "
                "Add a batch dimension with `unsqueeze(0)` for a single image."
            )
        channels = self.config.num_channels
        if pixel_values.shape[1] != channels:
            raise ValueError(
                f"`pixel_values` has {pixel_values.shape[1]} channels but the model expects "
                f"config.num_channels={channels}, channels first. Convert the images (e.g. image.convert('RGB') "
                "for grayscale), let the image processor do it (do_convert_rgb=True), or move channels-last "
                "arrays to channels-first with `permute(0, 3, 1, 2)`."
            )
        if not pixel_values.is_floating_point():
            raise ValueError(
                f"`pixel_values` must be floating point, got {pixel_values.dtype}; rescale and normalise the images "
                "with the image processor."
            )
        if bool_masked_pos is not None:
            rows, cols = stage_grids(self.config, *pixel_values.shape[-2:])[0]
            expected = (pixel_values.shape[0], rows * cols)
            if tuple(bool_masked_pos.shape) != expected:
                raise ValueError(
                    f"`bool_masked_pos` must have shape (batch, num_patches) = {expected} for this image size "
                    f"({rows} x {cols} patches), got {tuple(bool_masked_pos.shape)}."
                )


class HfxSwinModel(HfxSwinPreTrainedModel):
    """Swin encoder: ``pixel_values`` ``(batch, C, H, W)`` of any size -> tokens of the last stage and their mean.

    Args:
        add_pooling_layer: compute ``pooler_output`` (mean over tokens).
        use_mask_token: add SimMIM's learned mask token (used by ``bool_masked_pos``).
        add_layernorm: apply the final LayerNorm (the backbone normalises its own outputs instead).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxSwinConfig, HfxSwinModel
        >>> config = HfxSwinConfig(
        ...     image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
        ...     num_heads=[2, 4], window_size=4, encoder_stride=8,
        ... )
        >>> model = HfxSwinModel(config).eval()
        >>> pixel_values = torch.randn(2, 3, 32, 32)
        >>> out = model(pixel_values)  # the last stage's 4 x 4 tokens, and their mean
        >>> out.last_hidden_state.shape, out.pooler_output.shape
        (torch.Size([2, 16, 32]), torch.Size([2, 32]))
    """

    def __init__(
        self,
        config: HfxSwinConfig,
        add_pooling_layer: bool = True,
        use_mask_token: bool = False,
        add_layernorm: bool = True,
    ) -> None:
        super().__init__(config)
        self.num_features = config.hidden_size
        self.embeddings = HfxSwinEmbeddings(config, use_mask_token=use_mask_token)
        self.encoder = HfxSwinEncoder(config)
        self.layernorm = nn.LayerNorm(self.num_features, eps=config.layer_norm_eps) if add_layernorm else None
        self.add_pooling_layer = add_pooling_layer
        self.post_init()

    def get_input_embeddings(self) -> HfxSwinPatchEmbeddings:
        return self.embeddings.patch_embeddings

    def encode(
        self,
        pixel_values: torch.Tensor | None,
        bool_masked_pos: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        output_stage_maps: bool = False,
        always_partition: bool = False,
    ) -> HfxSwinEncoderOutput:
        """Embeddings and stages, without the final LayerNorm; what every head builds on."""
        self._check_pixel_values(pixel_values, bool_masked_pos)
        if bool_masked_pos is not None and self.embeddings.mask_token is None:
            raise ValueError("`bool_masked_pos` needs a mask token; use HfxSwinForMaskedImageModeling.")
        hidden_states, grid = self.embeddings(pixel_values, bool_masked_pos)
        return self.encoder(
            hidden_states,
            grid,
            always_partition=always_partition,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            output_stage_maps=output_stage_maps,
        )

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        bool_masked_pos: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        interpolate_pos_encoding: bool = False,
    ) -> HfxSwinModelOutput | tuple:
        """Encode a batch of images.

        Args:
            pixel_values: ``(batch, num_channels, height, width)``, any height and width.
            bool_masked_pos: ``(batch, num_patches)``, True for patches to replace by the mask token (needs
                ``use_mask_token``).
            output_attentions: also return every block's window attention probabilities.
            output_hidden_states: also return the tokens after the embeddings and after every stage.
            return_dict: an :class:`HfxSwinModelOutput` (None: ``config.return_dict``) or a plain tuple.
            interpolate_pos_encoding: accepted for compatibility with transformers; absolute position tables
                are always resized to the input's grid.
        Returns:
            :class:`HfxSwinModelOutput`.
        """
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        enc = self.encode(pixel_values, bool_masked_pos, output_attentions, output_hidden_states)
        sequence = enc.last_hidden_state
        if self.layernorm is not None:
            sequence = self.layernorm(sequence)
        out = HfxSwinModelOutput(
            last_hidden_state=sequence,
            pooler_output=sequence.mean(dim=1) if self.add_pooling_layer else None,
            hidden_states=enc.hidden_states,
            attentions=enc.attentions,
            reshaped_hidden_states=enc.reshaped_hidden_states,
        )
        return self._finish(out, return_dict)


class HfxSwinForImageClassification(HfxSwinPreTrainedModel):
    """Linear classifier on the pooled output. ``labels`` ``(batch,)`` (single label), ``(batch, num_labels)`` floats
    (multi-label) or regression values with ``num_labels == 1``; see ``sequence_classification_loss``.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxSwinConfig, HfxSwinForImageClassification
        >>> config = HfxSwinConfig(
        ...     image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
        ...     num_heads=[2, 4], window_size=4, encoder_stride=8, num_labels=5,
        ... )
        >>> model = HfxSwinForImageClassification(config).eval()
        >>> pixel_values = torch.randn(2, 3, 32, 32)
        >>> model(pixel_values, labels=torch.tensor([0, 4])).logits.shape
        torch.Size([2, 5])
    """

    def __init__(self, config: HfxSwinConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.swin = HfxSwinModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        interpolate_pos_encoding: bool = False,
    ) -> HfxSwinImageClassifierOutput | tuple:
        """Classify a batch of images: ``logits`` ``(batch, num_labels)``, and the loss when ``labels`` are given.

        Args:
            pixel_values: ``(batch, num_channels, height, width)``, any height and width.
            labels: ``(batch,)`` class ids, regression values (``num_labels=1``) or ``(batch, num_labels)`` multi-hot
                floats.
            output_attentions: also return every block's window attention probabilities.
            output_hidden_states: also return the tokens after the embeddings and after every stage.
            return_dict: an ``HfxSwinImageClassifierOutput`` (None: ``config.return_dict``) or a plain tuple.
            interpolate_pos_encoding: accepted for compatibility with transformers; absolute position tables are
                always resized to the input's grid.

        Returns:
            ``HfxSwinImageClassifierOutput``: ``loss``, ``logits``, ``hidden_states``, ``reshaped_hidden_states``
            and ``attentions`` when asked.
        """
        out = self.swin(
            pixel_values,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.classifier(out.pooler_output)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        result = self._head_result(HfxSwinImageClassifierOutput, out, loss, logits=logits)
        return self._finish(result, return_dict)


class HfxSwinForMaskedImageModeling(HfxSwinPreTrainedModel):
    """SimMIM (Xie et al., 2022): masked patches become a learned mask token; a 1x1 convolution and a pixel shuffle by
    ``encoder_stride`` decode the last map back to pixels; the loss is the L1 error on masked pixels only.

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxSwinConfig, HfxSwinForMaskedImageModeling
        >>> config = HfxSwinConfig(
        ...     image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
        ...     num_heads=[2, 4], window_size=4, encoder_stride=8,
        ... )
        >>> model = HfxSwinForMaskedImageModeling(config).eval()
        >>> pixel_values = torch.randn(2, 3, 32, 32)
        >>> bool_masked_pos = torch.rand(2, 64) < 0.5  # 8 x 8 patches of 4 x 4 pixels
        >>> out = model(pixel_values, bool_masked_pos=bool_masked_pos)
        >>> out.reconstruction.shape, out.loss.dim()
        (torch.Size([2, 3, 32, 32]), 0)
    """

    def __init__(self, config: HfxSwinConfig) -> None:
        super().__init__(config)
        patch_h, patch_w = _pair(config.patch_size)
        stride = patch_h * 2 ** (len(config.depths) - 1)
        if patch_h != patch_w or config.encoder_stride != stride:
            raise ValueError(
                f"SimMIM decodes the last stage back to pixels, so encoder_stride must be patch_size * "
                f"2**(len(depths) - 1) = {stride} (square patches), got encoder_stride={config.encoder_stride}, "
                f"patch_size={config.patch_size}; set encoder_stride={stride}."
            )
        self.swin = HfxSwinModel(config, add_pooling_layer=False, use_mask_token=True)
        self.decoder = nn.Sequential(
            nn.Conv2d(config.hidden_size, config.encoder_stride**2 * config.num_channels, kernel_size=1),
            nn.PixelShuffle(config.encoder_stride),
        )
        self.post_init()

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        bool_masked_pos: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        interpolate_pos_encoding: bool = False,
    ) -> HfxSwinMaskedImageModelingOutput | tuple:
        """Reconstruct the masked patches of a batch of images (SimMIM).

        Args:
            pixel_values: ``(batch, num_channels, H, W)``.
            bool_masked_pos: ``(batch, num_patches)``, True for masked patches (``num_patches`` =
                ``ceil(H / patch) * ceil(W / patch)``).
            output_attentions: also return every block's window attention probabilities.
            output_hidden_states: also return the tokens after the embeddings and after every stage.
            return_dict: an ``HfxSwinMaskedImageModelingOutput`` (None: ``config.return_dict``) or a plain tuple.
            interpolate_pos_encoding: accepted for compatibility with transformers; absolute position tables are
                always resized to the input's grid.

        Returns:
            ``reconstruction`` ``(batch, num_channels, H, W)`` and, with ``bool_masked_pos``, the loss (computed
            in float32 under autocast and with half-precision weights alike).
        """
        out = self.swin(
            pixel_values,
            bool_masked_pos=bool_masked_pos,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        height, width = pixel_values.shape[-2:]
        grids = stage_grids(self.config, height, width)
        features = tokens_to_map(out.last_hidden_state, grids[-1])
        # Padded inputs decode to the padded size; keep the part that covers the image.
        reconstruction = self.decoder(features)[:, :, :height, :width]

        loss = None
        if bool_masked_pos is not None:
            patch = _pair(self.config.patch_size)[0]
            # In float32 whatever the model's dtype: a count of masked pixels passes float16's largest value
            # (65504) at a few 224-pixel images, and the loss would silently become 0.
            mask = bool_masked_pos.reshape(-1, 1, *grids[0]).float()
            mask = mask.repeat_interleave(patch, 2).repeat_interleave(patch, 3)[:, :, :height, :width]
            error = F.l1_loss(pixel_values.float(), reconstruction.float(), reduction="none")
            loss = (error * mask).sum() / (mask.sum() + 1e-5) / self.config.num_channels

        result = self._head_result(HfxSwinMaskedImageModelingOutput, out, loss, reconstruction=reconstruction)
        return self._finish(result, return_dict)


class HfxSwinBackbone(BackboneMixin, HfxSwinPreTrainedModel):
    """Feature maps of the stages named in ``config.out_features`` (``"stem"``, ``"stage1"`` ...), each
    LayerNorm-ed, ``(batch, channels, h, w)``, for detection/segmentation heads (``AutoBackbone``).

    As in transformers, stage maps are taken before patch merging and windows are never shrunk to small maps
    (``always_partition``: small maps are padded to the window and keep their shift).

    Examples:
        >>> import torch
        >>> from hf_xformers import HfxSwinConfig, HfxSwinBackbone
        >>> config = HfxSwinConfig(
        ...     image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
        ...     num_heads=[2, 4], window_size=4, encoder_stride=8,
        ...     out_features=["stage1", "stage2"],
        ... )
        >>> model = HfxSwinBackbone(config).eval()
        >>> pixel_values = torch.randn(2, 3, 32, 32)
        >>> [tuple(m.shape) for m in model(pixel_values).feature_maps]
        [(2, 16, 8, 8), (2, 32, 4, 4)]
    """

    # The base model's final LayerNorm is not used by the backbone; checkpoints of other heads carry it.
    _keys_to_ignore_on_load_unexpected = [r"relative_position_index", r"swin\.layernorm\."]

    def __init__(self, config: HfxSwinConfig) -> None:
        super().__init__(config)
        self.num_features = [config.embed_dim] + [config.embed_dim * 2**i for i in range(len(config.depths))]
        self.swin = HfxSwinModel(config, add_pooling_layer=False, add_layernorm=False)
        self.hidden_states_norms = nn.ModuleDict(
            {
                stage: nn.LayerNorm(channels, eps=FIXED_LAYER_NORM_EPS)
                for stage, channels in zip(self.out_features, self.channels)
            }
        )
        self.post_init()

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
    ) -> BackboneOutput | tuple:
        """The feature maps of a batch of images.

        Args:
            pixel_values: ``(batch, num_channels, height, width)``, any height and width.
            output_hidden_states: also return the stem's and every stage's map before merging.
            output_attentions: also return every block's window attention probabilities.
            return_dict: a ``BackboneOutput`` (None: ``config.return_dict``) or a plain tuple.

        Returns:
            ``BackboneOutput``: ``feature_maps``, one ``(batch, channels, h, w)`` map per ``out_features`` entry;
            ``hidden_states`` (when asked): the stem and every stage's map before merging; ``attentions``.
        """
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        enc = self.swin.encode(
            pixel_values, output_attentions=output_attentions, output_stage_maps=True, always_partition=True
        )
        maps = enc.stage_maps
        feature_maps = tuple(
            self.hidden_states_norms[stage](m.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous()
            for stage, m in zip(self.stage_names, maps)
            if stage in self.out_features
        )
        out = BackboneOutput(
            feature_maps=feature_maps,
            hidden_states=maps if output_hidden_states else None,
            attentions=enc.attentions,
        )
        return self._finish(out, return_dict)
