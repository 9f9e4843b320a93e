"""hfx-swin: the vision conformance suite, the window attention against a dense oracle, parity with transformers'
Swin (every head, sizes that need padding), and the import of transformers checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import (
    AutoImageProcessor,
    AutoModelForImageClassification,
    SwinBackbone,
    SwinConfig,
    SwinForImageClassification,
    SwinForMaskedImageModeling,
    SwinModel,
    UperNetConfig,
    UperNetForSemanticSegmentation,
    ViTImageProcessorPil,
    pipeline,
)

from hf_xformers import (
    HfxSwinBackbone,
    HfxSwinConfig,
    HfxSwinForImageClassification,
    HfxSwinForMaskedImageModeling,
    HfxSwinImageProcessor,
    HfxSwinModel,
)
from hf_xformers.attention.shifted_window import HfxShiftedWindowSelfAttention
from hf_xformers.conversion.convert_from_transformers import convert_from_transformers, rename_swin_weights
from hf_xformers.models.swin.modeling_swin import stage_grids

from .conformance_vision import HostReadCounter, VisionModelConformance, pixel_values, random_images

# Patch 2 on 32 px: stage 1 is 16 x 16 (shifted windows of 4), stage 2 is 8 x 8 (still shifted).
TINY = dict(
    image_size=32,
    patch_size=2,
    embed_dim=16,
    depths=[2, 2],
    num_heads=[2, 4],
    window_size=4,
    encoder_stride=4,
    drop_path_rate=0.0,
)
HEADS = {
    "AutoModel": HfxSwinModel,
    "AutoModelForImageClassification": HfxSwinForImageClassification,
    "AutoModelForMaskedImageModeling": HfxSwinForMaskedImageModeling,
    "AutoBackbone": HfxSwinBackbone,
}


class TestSwinConformance(VisionModelConformance):
    config_class = HfxSwinConfig
    base_config = TINY
    heads = HEADS
    image_processor_class = HfxSwinImageProcessor
    dropout_config = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, drop_path_rate=0.1)
    # (29, 45): padding everywhere; (10, 6): maps smaller than the window (transformers fails there).
    odd_sizes = [(29, 45), (10, 6)]
    bad_configs = [
        (dict(num_heads=[2]), "one head count per stage"),
        (dict(num_heads=[3, 4]), "does not divide"),
        (dict(window_size=0), "window_size"),
        (dict(depths=[]), "depths"),
        (dict(patch_size=0), "patch_size"),
        (dict(num_channels=0), "num_channels"),
        (dict(drop_path_rate=1.0), "drop_path_rate"),
        (dict(hidden_dropout_prob=-0.1), "hidden_dropout_prob"),
        (dict(mlp_ratio=0), "mlp_ratio"),
        (dict(hidden_act="nope"), "hidden_act"),
        (dict(out_features=["stage3"]), "out_features"),
    ]

    def expected_last_hidden_state_shape(self, config, batch, height, width):
        rows, cols = stage_grids(config, height, width)[-1]
        return (batch, rows * cols, config.hidden_size)

    def depth_config(self, depth):
        return {"depths": [depth] * len(TINY["depths"])}

    def expected_num_hidden_states(self, config):
        return len(config.depths) + 1

    def expected_num_attentions(self, config):
        return len(config.depths)

    def expected_feature_map_shapes(self, model, batch, height, width):
        grids = stage_grids(model.config, height, width)
        grids = [grids[0]] + grids  # the stem has stage 1's grid
        return [
            (batch, channels, *grids[model.stage_names.index(stage)])
            for stage, channels in zip(model.out_features, model.channels)
        ]


def test_simmim_needs_matching_encoder_stride():
    with pytest.raises(ValueError, match="encoder_stride=4"):
        HfxSwinForMaskedImageModeling(HfxSwinConfig(**{**TINY, "encoder_stride": 32}))


# --------------------------------------------------------------------------------------------------------------
# The window attention against a dense oracle
# --------------------------------------------------------------------------------------------------------------


def dense_window_attention(attn: HfxShiftedWindowSelfAttention, x, height, width, window, shift):
    """Masked full attention over the padded, rolled map: token i sees token j iff both lie in the same window;
    -100 between shift regions; bias by the (dy, dx) offset. No window partitioning involved."""
    batch, _, dim = x.shape
    pad_h, pad_w = -height % window, -width % window
    grid = F.pad(x.view(batch, height, width, dim), (0, 0, 0, pad_w, 0, pad_h))
    ph, pw = height + pad_h, width + pad_w
    grid = torch.roll(grid, (-shift, -shift), (1, 2))
    tokens = grid.reshape(batch, ph * pw, dim)
    rows = torch.arange(ph).repeat_interleave(pw)
    cols = torch.arange(pw).repeat(ph)

    def region(idx, length):
        return (idx >= length - window).long() + (idx >= length - shift).long() if shift else torch.zeros_like(idx)

    same_window = ((rows[:, None] // window) == (rows[None] // window)) & (
        (cols[:, None] // window) == (cols[None] // window)
    )
    reg = region(rows, ph) * 3 + region(cols, pw)
    table = attn.relative_position_bias_table.view(2 * attn.window_size - 1, 2 * attn.window_size - 1, -1)
    dy = (rows[:, None] - rows[None]).clamp(-(window - 1), window - 1) + attn.window_size - 1
    dx = (cols[:, None] - cols[None]).clamp(-(window - 1), window - 1) + attn.window_size - 1
    bias = table[dy, dx].permute(2, 0, 1)  # (heads, L, L)
    bias = bias + (reg[:, None] != reg[None]) * -100.0
    heads, hd = attn.num_heads, attn.head_dim
    q, k, v = (p(tokens).view(batch, -1, heads, hd).transpose(1, 2) for p in (attn.query, attn.key, attn.value))
    scores = q @ k.transpose(-1, -2) * hd**-0.5 + bias
    scores = scores.masked_fill(~same_window, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, ph, pw, dim)
    out = torch.roll(out, (shift, shift), (1, 2))[:, :height, :width]
    return out.reshape(batch, height * width, dim)


@pytest.mark.parametrize(
    "height,width,shift,always_partition,expected_window",
    [
        (8, 8, 2, False, 4),  # plain shifted windows
        (7, 10, 2, False, 4),  # padding + shift
        (4, 9, 2, False, 4),  # map == window on one side: window kept, shift dropped
        (3, 5, 2, False, 3),  # map smaller than the window: window shrinks to 3, central part of the table
        (3, 5, 2, True, 4),  # backbone: padded to the window, shift kept
        (9, 6, 0, False, 4),
    ],
)
def test_window_attention_matches_dense_oracle(
    height, width, shift, always_partition, expected_window, device, device_atol
):
    torch.manual_seed(0)
    attn = HfxShiftedWindowSelfAttention(HfxSwinConfig(window_size=4), 16, 2, shift_size=shift).eval()
    with torch.no_grad():
        attn.relative_position_bias_table.normal_()
    x = torch.randn(2, height * width, 16)
    eff_shift = shift if (always_partition or min(height, width) > 4) else 0
    with torch.no_grad():
        expected = dense_window_attention(attn, x, height, width, expected_window, eff_shift)
        attn, x = attn.to(device), x.to(device)
        fast = attn(x, (height, width), always_partition=always_partition).context.cpu()
        eager = attn(x, (height, width), always_partition=always_partition, output_attentions=True)
    torch.testing.assert_close(fast, expected, atol=device_atol, rtol=0)
    torch.testing.assert_close(eager.context.cpu(), expected, atol=device_atol, rtol=0)
    assert eager.attentions.shape[-1] == expected_window**2


# --------------------------------------------------------------------------------------------------------------
# Parity with transformers
# --------------------------------------------------------------------------------------------------------------


def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move every parameter off its initial value (biases and bias tables start at 0, LayerNorms at 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def reference_pair(ref_class, our_class, **overrides):
    """A transformers Swin (eager attention, so it returns attentions) and ours with the same weights."""
    torch.manual_seed(0)
    kwargs = {**TINY, "num_labels": 3, **overrides}
    ref = perturb_(ref_class(SwinConfig(**kwargs)))
    ref.set_attn_implementation("eager")
    ours = our_class(HfxSwinConfig(**kwargs)).eval()
    state = rename_swin_weights(ref.state_dict())
    result = ours.load_state_dict(state, strict=False)
    assert not result.missing_keys, result.missing_keys
    assert all(k.startswith("swin.layernorm.") for k in result.unexpected_keys), result.unexpected_keys
    return ref, ours


def max_diff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        return (a - b).abs().max().item()
    assert len(a) == len(b)
    return max(max_diff(x, y) for x, y in zip(a, b))


def assert_same_outputs(ref_out, our_out, keys):
    for key in keys:
        diff = max_diff(ref_out[key], our_out[key])
        assert diff < 1e-5, f"{key}: max |diff| {diff:.2e}"


# (32, 32): no padding; (36, 44): padding at patch (18 x 22), window and merge (9 x 11) level.
SIZES = [(32, 32), (36, 44)]


@pytest.mark.parametrize("size", SIZES)
def test_parity_with_transformers_model_and_classifier(size):
    x = pixel_values(2, *size, seed=1)
    for ref_class, our_class, keys in (
        (SwinModel, HfxSwinModel, ["last_hidden_state", "pooler_output"]),
        (SwinForImageClassification, HfxSwinForImageClassification, ["logits"]),
    ):
        ref, ours = reference_pair(ref_class, our_class)
        with torch.no_grad():
            a = ref(x, output_hidden_states=True, output_attentions=True)
            b = ours(x, output_hidden_states=True, output_attentions=True)
        assert_same_outputs(a, b, keys + ["hidden_states", "reshaped_hidden_states", "attentions"])
    labels = torch.tensor([0, 2])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, labels=labels).loss, ref(x, labels=labels).loss, atol=1e-6, rtol=0)


def test_parity_with_transformers_patch4_window_sized_stage():
    """Patch 4: stage 2 is exactly one window (shift dropped), as in Swin-T's last stage at 224 px."""
    x = pixel_values(2, 32, seed=2)
    ref, ours = reference_pair(
        SwinForImageClassification, HfxSwinForImageClassification, patch_size=4, encoder_stride=8
    )
    with torch.no_grad():
        assert_same_outputs(ref(x, output_attentions=True), ours(x, output_attentions=True), ["logits", "attentions"])


def test_parity_with_transformers_without_qkv_bias():
    """``qkv_bias=False``: the fused query/key/value product runs without a bias (SDPA and explicit paths)."""
    x = pixel_values(2, 36, 44, seed=7)
    ref, ours = reference_pair(SwinModel, HfxSwinModel, qkv_bias=False)
    assert ours.encoder.layers[0].blocks[0].attention.self.query.bias is None
    with torch.no_grad():
        assert_same_outputs(ref(x), ours(x), ["last_hidden_state", "pooler_output"])
        assert_same_outputs(ref(x, output_attentions=True), ours(x, output_attentions=True), ["attentions"])


def test_parity_with_transformers_simmim():
    x = pixel_values(2, 32, seed=3)
    mask = torch.rand(2, 256, generator=torch.Generator().manual_seed(4)) > 0.4
    ref, ours = reference_pair(SwinForMaskedImageModeling, HfxSwinForMaskedImageModeling)
    with torch.no_grad():
        assert_same_outputs(ref(x, bool_masked_pos=mask), ours(x, bool_masked_pos=mask), ["loss", "reconstruction"])


@pytest.mark.parametrize("size", SIZES)
def test_parity_with_transformers_backbone(size):
    x = pixel_values(2, *size, seed=5)
    ref, ours = reference_pair(SwinBackbone, HfxSwinBackbone, out_features=["stem", "stage1", "stage2"])
    assert ours.channels == ref.channels
    with torch.no_grad():
        a = ref(x, output_hidden_states=True)
        b = ours(x, output_hidden_states=True)
    assert_same_outputs(a, b, ["feature_maps", "hidden_states"])


def test_backbone_drives_a_transformers_segmentation_head():
    """AutoBackbone resolution through a config: UperNet builds and trains on our backbone."""
    backbone = HfxSwinConfig(**TINY, out_features=["stage1", "stage2"])
    config = UperNetConfig(
        backbone_config=backbone, hidden_size=16, num_labels=4, pool_scales=[1, 2], use_auxiliary_head=False
    )
    model = UperNetForSemanticSegmentation(config)
    assert type(model.backbone) is HfxSwinBackbone
    out = model(pixel_values(2, 40), labels=torch.randint(0, 4, (2, 40, 40)))
    assert out.logits.shape == (2, 4, 40, 40) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.backbone.swin.embeddings.patch_embeddings.projection.weight.grad is not None


def test_absolute_position_embeddings_parity_and_other_sizes():
    x = pixel_values(1, 32, seed=6)
    ref, ours = reference_pair(SwinModel, HfxSwinModel, use_absolute_embeddings=True)
    with torch.no_grad():
        assert_same_outputs(ref(x), ours(x), ["last_hidden_state"])
        # Other sizes: the table is resized (transformers would fail without interpolate_pos_encoding).
        assert torch.isfinite(ours(pixel_values(1, 40, 24)).last_hidden_state).all()


def test_maps_smaller_than_the_window_work():
    """transformers fails on these sizes ("The size of tensor a (4) must match ..."); ours runs on and matches its
    own larger-window computation where the window covers everything."""
    model = perturb_(HfxSwinForImageClassification(HfxSwinConfig(**{**TINY, "patch_size": 4, "encoder_stride": 8})))
    for size in ((16, 16), (8, 8), (16, 40), (3, 3)):
        with torch.no_grad():
            assert torch.isfinite(model(pixel_values(1, *size)).logits).all(), size


def test_bf16_forward_is_finite_and_close():
    model = perturb_(HfxSwinModel(HfxSwinConfig(**TINY)))
    x = pixel_values(2, 32)
    with torch.no_grad():
        full = model(x).last_hidden_state
        half = model.to(torch.bfloat16)(x.bfloat16()).last_hidden_state.float()
    assert torch.isfinite(half).all()
    assert (half - full).abs().max() < 0.15


# --------------------------------------------------------------------------------------------------------------
# Importing transformers checkpoints
# --------------------------------------------------------------------------------------------------------------


def test_convert_from_transformers_classifier_with_image_processor(tmp_path):
    source, target = tmp_path / "swin", tmp_path / "hfx"
    torch.manual_seed(0)
    labels = {0: "cat", 1: "dog", 2: "bird"}
    config = SwinConfig(**TINY, id2label=labels, label2id={v: k for k, v in labels.items()})
    reference = perturb_(SwinForImageClassification(config))
    reference.save_pretrained(source)
    # The Hub's microsoft/swin-tiny-patch4-window7-224 ships this (old feature-extractor style) file.
    (source / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "do_normalize": True,
                "do_resize": True,
                "feature_extractor_type": "ViTFeatureExtractor",
                "image_mean": [0.485, 0.456, 0.406],
                "image_std": [0.229, 0.224, 0.225],
                "resample": 3,
                "size": 32,
            }
        )
    )
    model, tokenizer = convert_from_transformers(source, target)
    assert type(model) is HfxSwinForImageClassification and tokenizer is None
    assert model.config.id2label == labels

    x = pixel_values(2, 36, 44, seed=7)
    with torch.no_grad():
        expected = reference(x).logits
        assert max_diff(model(x).logits, expected) < 1e-5
        loaded = AutoModelForImageClassification.from_pretrained(target).eval()
        assert type(loaded) is HfxSwinForImageClassification
        assert max_diff(loaded(x).logits, expected) < 1e-5

    processor = AutoImageProcessor.from_pretrained(target)
    assert type(processor) is HfxSwinImageProcessor
    assert processor.size == {"height": 32, "width": 32} and list(processor.image_mean) == [0.485, 0.456, 0.406]
    images = random_images(2)
    ref_pixels = ViTImageProcessorPil(
        size={"height": 32, "width": 32}, resample=3, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]
    )(images, return_tensors="pt")["pixel_values"]
    assert torch.allclose(processor(images, return_tensors="pt")["pixel_values"], ref_pixels, atol=1e-6)
    predictions = pipeline("image-classification", model=str(target), device="cpu")(images[0], top_k=3)
    assert {p["label"] for p in predictions} == set(labels.values())


@pytest.mark.parametrize(
    "ref_class,our_class,extra",
    [
        (SwinModel, HfxSwinModel, {}),
        (SwinForMaskedImageModeling, HfxSwinForMaskedImageModeling, {}),
        (SwinBackbone, HfxSwinBackbone, {"out_features": ["stage1", "stage2"]}),
    ],
)
def test_convert_from_transformers_other_heads(tmp_path, ref_class, our_class, extra):
    torch.manual_seed(0)
    reference = perturb_(ref_class(SwinConfig(**TINY, **extra)))
    reference.save_pretrained(tmp_path / "swin")
    model, _ = convert_from_transformers(tmp_path / "swin")
    assert type(model) is our_class
    x = pixel_values(1, 32, seed=8)
    with torch.no_grad():
        a, b = reference(x), model(x)
    key = {"SwinModel": "last_hidden_state", "SwinForMaskedImageModeling": "reconstruction"}.get(
        ref_class.__name__, "feature_maps"
    )
    assert max_diff(a[key], b[key]) < 1e-5


# --------------------------------------------------------------------------------------------------------------
# Mixed precision and any device
# --------------------------------------------------------------------------------------------------------------


def test_window_attention_adds_the_bias_in_float32_under_autocast(device):
    """With a trained-size bias table (entries of several units), the explicit path (training: the table needs a
    gradient) adds the bias to the 16-bit scores in float32. Measured relative deviation from float32 under bf16 CPU
    autocast: 5.0e-3 (2.3e-2 when the bias was rounded to bf16 first)."""
    torch.manual_seed(0)
    attn = HfxShiftedWindowSelfAttention(HfxSwinConfig(window_size=7), 32, 2, shift_size=3).eval()
    with torch.no_grad():
        attn.relative_position_bias_table.normal_(0, 5.0)
    attn, x = attn.to(device), torch.randn(2, 14 * 14, 32).to(device)
    reference = attn(x, (14, 14)).context.detach()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = attn(x, (14, 14))
    assert out.context.requires_grad  # the explicit path, not SDPA
    error = ((out.context.float() - reference).abs().max() / reference.abs().max().clamp(min=1)).item()
    assert error < 1e-2, error


def test_masked_image_modeling_loss_does_not_overflow_in_float16(device):
    """131,072 masked pixels: more than float16 can count (65,504). The loss stays the float32 model's under fp16
    autocast and with fp16 weights (it was 0: the pixel count overflowed to inf)."""
    model = perturb_(HfxSwinForMaskedImageModeling(HfxSwinConfig(**TINY))).to(device)
    x = pixel_values(8, 128, seed=9).to(device)
    masked = torch.ones(8, 64 * 64, dtype=torch.bool, device=device)
    with torch.no_grad():
        reference = model(x, bool_masked_pos=masked).loss
        with torch.autocast(device.type, dtype=torch.float16):
            autocast = model(x, bool_masked_pos=masked).loss
        half = model.half()(x.half(), bool_masked_pos=masked).loss
    assert reference > 0.1
    for loss in (autocast, half):
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, reference, rtol=1e-2, atol=0)


def _clear_swin_caches():
    from hf_xformers.attention import shifted_window

    for cached in (
        shifted_window.window_token_indices,
        shifted_window.relative_position_index,
        shifted_window.shifted_window_mask,
    ):
        cached.cache_clear()


def test_cold_caches_read_nothing_back_from_the_device(device):
    """The per-size index caches are filled without reading values back (the former window index used boolean
    indexing, a synchronisation on a GPU whenever a new image size arrives); padded size, shifted windows."""
    model = perturb_(HfxSwinModel(HfxSwinConfig(**TINY))).to(device)
    x = pixel_values(1, 29, 45).to(device)
    _clear_swin_caches()
    with torch.no_grad(), HostReadCounter() as counter:
        model(x)
    assert counter.count == 0


class _CpuTensorsMade(TorchDispatchMode):
    """Records the ops that produce a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_flatten(out)[0]):
            self.ops.add(str(func))
        return out


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_forward_creates_no_cpu_tensor_for_inputs_elsewhere(train):
    """Every head on the meta device, cold caches, training with dropout and stochastic depth: no op in the forward
    makes a CPU tensor (index tables, masks and random draws are made on the inputs' device). Classification runs
    without labels: the label-range check reads the labels back once per forward (``layers/heads.py``)."""
    config = {**TINY, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "drop_path_rate": 0.1}
    for name, cls in HEADS.items():
        model = cls(HfxSwinConfig(**config)).to("meta").train(train)
        inputs = {"pixel_values": pixel_values(2, 29, 45).to("meta")}
        if name == "AutoModelForMaskedImageModeling":
            inputs["bool_masked_pos"] = torch.zeros(2, 15 * 23, dtype=torch.bool, device="meta")
        _clear_swin_caches()
        with torch.set_grad_enabled(train), _CpuTensorsMade() as made:
            model(**inputs)
        assert not made.ops, f"{name}: {sorted(made.ops)}"
