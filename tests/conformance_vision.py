"""The conformance suite every vision architecture runs with a tiny config.

Use it by subclassing :class:`VisionModelConformance` in a ``test_<arch>.py`` file::

    class TestSwinConformance(VisionModelConformance):
        config_class = HfxSwinConfig
        base_config = dict(embed_dim=16, depths=[2, 2], ...)   # tiny: embed <= 32, <= 2 stages, images <= 64 px
        heads = {"AutoModel": HfxSwinModel, "AutoModelForImageClassification": ..., "AutoBackbone": ...}
        image_processor_class = HfxSwinImageProcessor
        bad_configs = [(dict(window_size=0), "window_size")]  # (overrides, regex the ValueError must match)

        def expected_last_hidden_state_shape(self, config, batch, height, width): ...
        def expected_num_hidden_states(self, config): ...
        def expected_num_attentions(self, config): ...

Heads are keyed by the Auto class that must resolve to them: ``AutoModel`` (``last_hidden_state``,
``pooler_output``), ``AutoModelForImageClassification`` (``logits``, ``labels``),
``AutoModelForMaskedImageModeling`` (``reconstruction``, ``bool_masked_pos``) and ``AutoBackbone``
(``feature_maps``). ``odd_sizes`` are input sizes that the architecture must accept although they need padding.

Every test runs on the device given to pytest (``pytest --device cuda``; the CPU by default: the ``device`` fixture of
``tests/conftest.py``), with that device's tolerance (``device_atol``). Mixed precision: every head trains under
``torch.autocast`` in bfloat16 and float16 with dropout on (``dropout_config``), and runs with half-precision weights,
within ``MIXED_PRECISION_TOLERANCE`` of float32. Hooks an architecture may override besides the shape hooks:
``dropout_config`` (the config fields that turn dropout / stochastic depth on) and ``depth_config(n)`` (config
overrides for a model ``n`` blocks deep, for the host-synchronisation count).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, Trainer, TrainingArguments, pipeline

from hf_xformers.registration import REGISTRY

from .device_checks import (
    FP16_LOSS_SCALE,
    HALF_DTYPES,
    MIXED_PRECISION_TOLERANCE,
    HostReadCounter,
    buffer_mismatches,
    build_under_bfloat16_default,
    check_auto_dtype_load,
    deviation,
)

IMAGE_SIZE = 32
NUM_LABELS = 3
ATOL = 1e-5

def pixel_values(batch: int, height: int = IMAGE_SIZE, width: int | None = None, channels: int = 3, seed: int = 0):
    """Normalised-looking random images ``(batch, channels, height, width)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, height, height if width is None else width, generator=g)


def random_images(count: int, sizes=((40, 30), (24, 24), (33, 47)), seed: int = 0) -> list[Image.Image]:
    """PIL RGB images of assorted sizes (``(width, height)``), as a user would pass them to a processor."""
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for w, h in (sizes[i % len(sizes)] for i in range(count))
    ]


class VisionModelConformance:
    config_class: type
    base_config: dict = {}
    heads: dict[str, type] = {}
    image_processor_class: type | None = None
    bad_configs: list[tuple[dict, str]] = []
    image_size: int = IMAGE_SIZE
    odd_sizes: list[tuple[int, int]] = [(29, 45)]
    # Config fields that turn dropout on, for the mixed-precision training step.
    dropout_config: dict = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    device: torch.device = torch.device("cpu")
    atol: float = ATOL

    @pytest.fixture(autouse=True)
    def _on_device(self, device, device_atol):
        """Every test runs on the ``--device`` of the pytest run, with that device's tolerance."""
        self.device, self.atol = device, device_atol

    # ----- hooks an architecture fills in ---------------------------------------------------------
    def expected_last_hidden_state_shape(self, config, batch: int, height: int, width: int) -> tuple:
        raise NotImplementedError

    def expected_num_hidden_states(self, config) -> int:
        raise NotImplementedError

    def expected_num_attentions(self, config) -> int:
        raise NotImplementedError

    def expected_feature_map_shapes(self, model, batch: int, height: int, width: int) -> list[tuple]:
        """Shapes of the backbone's ``feature_maps`` (only needed with an ``AutoBackbone`` head)."""
        raise NotImplementedError

    def depth_config(self, depth: int) -> dict:
        """Config overrides for a model ``depth`` blocks deep (per stage, for hierarchical models)."""
        return {"num_hidden_layers": depth}

    # ----- helpers -------------------------------------------------------------------------------
    def make_config(self, **overrides):
        return self.config_class(**{"num_labels": NUM_LABELS, **self.base_config, **overrides})

    def make_model(self, auto_name: str, **overrides):
        torch.manual_seed(0)
        model = self.heads[auto_name](self.make_config(**overrides)).eval()
        # Move every parameter off its (often zero / one) initial value so that every weight matters.
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        return model.to(self.device)

    def num_patches(self, config, height: int, width: int) -> int:
        patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
        return -(-height // patch) * -(-width // patch)

    def inputs_for(self, auto_name: str, batch: int = 2, height: int | None = None, width: int | None = None) -> dict:
        """Inputs (and labels / masked positions) for one head, on the test's device."""
        return {k: v.to(self.device) for k, v in self._cpu_inputs_for(auto_name, batch, height, width).items()}

    def _cpu_inputs_for(self, auto_name: str, batch: int, height: int | None, width: int | None) -> dict:
        height = height or self.image_size
        width = width or height
        config = self.make_config()
        inputs = {"pixel_values": pixel_values(batch, height, width, config.num_channels)}
        if auto_name == "AutoModelForImageClassification":
            inputs["labels"] = torch.arange(batch) % NUM_LABELS
        elif auto_name == "AutoModelForMaskedImageModeling":
            g = torch.Generator().manual_seed(3)
            inputs["bool_masked_pos"] = torch.rand(batch, self.num_patches(config, height, width), generator=g) > 0.5
        return inputs

    @staticmethod
    def main_output(auto_name: str, out) -> torch.Tensor:
        if auto_name == "AutoModel":
            return out.last_hidden_state
        if auto_name == "AutoModelForImageClassification":
            return out.logits
        if auto_name == "AutoModelForMaskedImageModeling":
            return out.reconstruction
        if auto_name == "AutoBackbone":
            return torch.cat([f.flatten(1) for f in out.feature_maps], dim=1)
        raise KeyError(auto_name)

    def check_shapes(self, auto_name: str, model, out, batch: int, height: int, width: int) -> None:
        config = model.config
        if auto_name == "AutoModel":
            assert tuple(out.last_hidden_state.shape) == self.expected_last_hidden_state_shape(
                config, batch, height, width
            )
            assert tuple(out.pooler_output.shape) == (batch, config.hidden_size)
        elif auto_name == "AutoModelForImageClassification":
            assert tuple(out.logits.shape) == (batch, NUM_LABELS)
        elif auto_name == "AutoModelForMaskedImageModeling":
            assert tuple(out.reconstruction.shape) == (batch, config.num_channels, height, width)
        elif auto_name == "AutoBackbone":
            assert [tuple(f.shape) for f in out.feature_maps] == self.expected_feature_map_shapes(
                model, batch, height, width
            )

    # ----- shapes and outputs ----------------------------------------------------------------------
    def test_head_output_shapes_and_losses(self):
        for auto_name in self.heads:
            model = self.make_model(auto_name).train()
            out = model(**self.inputs_for(auto_name))
            self.check_shapes(auto_name, model, out, 2, self.image_size, self.image_size)
            target = (
                out.loss
                if auto_name in ("AutoModelForImageClassification", "AutoModelForMaskedImageModeling")
                else None
            )
            if target is not None:
                assert target.dim() == 0 and torch.isfinite(target), auto_name
            else:
                target = self.main_output(auto_name, out).pow(2).mean()
            target.backward()
            grads = [p.grad for p in model.parameters() if p.requires_grad]
            assert any(g is not None and g.abs().sum() > 0 for g in grads), auto_name

    def test_any_input_size(self):
        """Sizes that are not multiples of the patch/window/merging factors are padded, not refused."""
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            for height, width in self.odd_sizes:
                with torch.no_grad():
                    out = model(**self.inputs_for(auto_name, batch=1, height=height, width=width))
                self.check_shapes(auto_name, model, out, 1, height, width)
                assert torch.isfinite(self.main_output(auto_name, out)).all(), (auto_name, height, width)

    def test_base_model_pooled_output_and_tuple_output(self):
        model = self.make_model("AutoModel")
        inputs = self.inputs_for("AutoModel")
        with torch.no_grad():
            out = model(**inputs)
            as_tuple = model(**inputs, return_dict=False)
        assert out.pooler_output.shape == (2, model.config.hidden_size)
        assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.last_hidden_state)

    def test_output_attentions_and_hidden_states(self):
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            config = model.config
            inputs = self.inputs_for(auto_name)
            with torch.no_grad():
                out = model(**inputs, output_attentions=True, output_hidden_states=True)
                plain = model(**inputs)
            if auto_name != "AutoBackbone":
                assert len(out.hidden_states) == self.expected_num_hidden_states(config), auto_name
                assert all(h.shape[0] == 2 for h in out.hidden_states)
            else:
                assert out.hidden_states is not None and plain.hidden_states is None
            assert len(out.attentions) == self.expected_num_attentions(config), auto_name
            for att in out.attentions:
                assert torch.all(att >= 0)
                torch.testing.assert_close(att.sum(-1), torch.ones_like(att[..., 0]), atol=self.atol, rtol=0)
            # Asking for attentions and hidden states must not change the result.
            torch.testing.assert_close(
                self.main_output(auto_name, out), self.main_output(auto_name, plain), atol=self.atol, rtol=0
            )

    def test_eager_and_sdpa_agree(self):
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            inputs = {k: v for k, v in self.inputs_for(auto_name).items() if k != "labels"}
            with torch.no_grad():
                fast = self.main_output(auto_name, model(**inputs))
                model.set_attn_implementation("eager")
                eager = self.main_output(auto_name, model(**inputs))
            torch.testing.assert_close(fast, eager, atol=self.atol, rtol=0)

    def test_classification_problem_types(self):
        if "AutoModelForImageClassification" not in self.heads:
            pytest.skip("no image classification head")
        head = self.heads["AutoModelForImageClassification"]
        images = self.inputs_for("AutoModel")["pixel_values"]
        torch.manual_seed(0)
        reg = head(self.make_config(num_labels=1)).to(self.device)
        targets = torch.tensor([0.5, -1.0], device=self.device)
        out = reg(pixel_values=images, labels=targets)
        assert reg.config.problem_type == "regression" and out.logits.shape == (2, 1)
        torch.testing.assert_close(out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), targets))
        multi = head(self.make_config()).to(self.device)
        labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], device=self.device)
        out = multi(pixel_values=images, labels=labels)
        assert multi.config.problem_type == "multi_label_classification"
        torch.testing.assert_close(out.loss, torch.nn.functional.binary_cross_entropy_with_logits(out.logits, labels))
        single = head(self.make_config()).to(self.device)
        with pytest.raises(ValueError, match="num_labels"):
            single(pixel_values=images, labels=torch.tensor([0, NUM_LABELS], device=self.device))

    # ----- Auto classes and serialisation ----------------------------------------------------------
    def test_auto_resolution(self, tmp_path):
        model_type = self.config_class.model_type
        assert model_type.startswith("hfx-")
        config = AutoConfig.for_model(model_type, **self.base_config)
        assert type(config) is self.config_class
        for auto_name, cls in self.heads.items():
            model = getattr(transformers, auto_name).from_config(config)
            assert type(model) is cls, auto_name
        if self.image_processor_class is not None:
            self.image_processor_class().save_pretrained(tmp_path)
            config.save_pretrained(tmp_path)
            assert type(AutoImageProcessor.from_pretrained(tmp_path)) is self.image_processor_class

    def test_save_load_roundtrip_is_exact(self, tmp_path):
        """Eval outputs are identical (bit for bit) after save/load, and twice in a row."""
        for auto_name, cls in self.heads.items():
            model = self.make_model(auto_name)
            inputs = {k: v for k, v in self.inputs_for(auto_name).items() if k != "labels"}
            with torch.no_grad():
                before = self.main_output(auto_name, model(**inputs))
                again = self.main_output(auto_name, model(**inputs))
            assert torch.equal(before, again), f"{auto_name}: eval outputs differ between two calls"
            path = tmp_path / auto_name
            model.save_pretrained(path)
            # transformers 5.23's AutoBackbone.from_pretrained cannot read local folders (it asks the Hub whether
            # the path is a repo: HFValidationError, for its own SwinBackbone too); load through the class.
            loader = cls if auto_name == "AutoBackbone" else getattr(transformers, auto_name)
            loaded = loader.from_pretrained(path).eval().to(self.device)
            assert type(loaded) is cls
            with torch.no_grad():
                after = self.main_output(auto_name, loaded(**inputs))
            assert torch.equal(before, after), auto_name
            saved, original = loaded.config.to_dict(), model.config.to_dict()
            saved.pop("_name_or_path"), original.pop("_name_or_path")
            assert saved == original, auto_name

    # ----- invariances -----------------------------------------------------------------------------
    def test_batch_invariance(self):
        """An image's output does not depend on its batch-mates."""
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            images = self.inputs_for(auto_name, batch=3)["pixel_values"]
            with torch.no_grad():
                both = self.main_output(auto_name, model(pixel_values=images))
                alone = [self.main_output(auto_name, model(pixel_values=images[i : i + 1])) for i in range(3)]
            torch.testing.assert_close(both, torch.cat(alone), atol=self.atol, rtol=0)

    # ----- training ----------------------------------------------------------------------------------
    def test_gradient_checkpointing_same_gradients(self):
        auto_name = (
            "AutoModelForImageClassification" if "AutoModelForImageClassification" in self.heads else "AutoModel"
        )
        inputs = self.inputs_for(auto_name)

        def grads(checkpointing: bool):
            model = self.make_model(auto_name).train()
            if checkpointing:
                model.gradient_checkpointing_enable()
                assert model.is_gradient_checkpointing
            out = self.main_output(auto_name, model(**inputs))
            out.float().pow(2).mean().backward()
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        plain, checkpointed = grads(False), grads(True)
        assert plain.keys() == checkpointed.keys() and plain
        for name in plain:
            torch.testing.assert_close(plain[name], checkpointed[name], atol=self.atol / 10, rtol=1e-5, msg=name)

    def test_trainer_step(self, tmp_path):
        head = self.heads["AutoModelForImageClassification"]
        torch.manual_seed(0)
        model = head(self.make_config())
        images = pixel_values(8, self.image_size, seed=7)  # Trainer moves the model and the batches to the device
        rows = [{"pixel_values": images[i], "labels": i % NUM_LABELS} for i in range(8)]
        before = copy.deepcopy(model.state_dict())
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
            use_cpu=self.device.type == "cpu", report_to="none", save_strategy="no", eval_strategy="no",
            disable_tqdm=True,
        )  # fmt: skip
        result = Trainer(model=model, args=args, train_dataset=rows).train()
        assert result.global_step == 2 and np.isfinite(result.training_loss)
        changed = [n for n, p in model.state_dict().items() if not torch.equal(p, before[n])]
        assert any(n.startswith("classifier") for n in changed)
        assert any("embeddings" in n for n in changed), "the encoder's first weights did not train"

    # ----- bad inputs ----------------------------------------------------------------------------------
    def test_bad_inputs_raise(self):
        model = self.make_model("AutoModel")
        channels = model.config.num_channels
        with pytest.raises(ValueError, match="num_channels"):
            model(pixel_values=pixel_values(1, channels=channels + 1).to(self.device))
        with pytest.raises(ValueError, match="unsqueeze"):
            model(pixel_values=pixel_values(1, channels=channels)[0].to(self.device))
        with pytest.raises(ValueError, match="pixel_values"):
            model()
        with pytest.raises(ValueError, match="floating point"):
            model(
                pixel_values=torch.zeros(
                    1, channels, self.image_size, self.image_size, dtype=torch.uint8, device=self.device
                )
            )
        if "AutoModelForMaskedImageModeling" in self.heads:
            mim = self.make_model("AutoModelForMaskedImageModeling")
            with pytest.raises(ValueError, match="bool_masked_pos"):
                mim(
                    pixel_values=pixel_values(1).to(self.device),
                    bool_masked_pos=torch.zeros(1, 3, dtype=torch.bool, device=self.device),
                )

    def test_invalid_config_values_raise(self):
        assert self.bad_configs, "list at least one invalid config value"
        for overrides, pattern in self.bad_configs:
            with pytest.raises(ValueError, match=pattern):
                self.make_config(**overrides)

    # ----- backbone ------------------------------------------------------------------------------------
    def test_backbone_out_features(self):
        if "AutoBackbone" not in self.heads:
            pytest.skip("no backbone")
        stages = self.make_config().stage_names
        for out_features in ([stages[-1]], stages[1:], stages):
            model = self.make_model("AutoBackbone", out_features=out_features)
            assert model.out_features == out_features
            with torch.no_grad():
                out = model(pixel_values=pixel_values(2).to(self.device))
            assert len(out.feature_maps) == len(out_features)
            assert [f.shape[1] for f in out.feature_maps] == model.channels
        with pytest.raises(ValueError, match="out_features"):
            self.make_config(out_features=["no-such-stage"])

    # ----- image processor and pipeline ------------------------------------------------------------------
    def test_image_processor_and_pipeline(self, tmp_path):
        if self.image_processor_class is None or "AutoModelForImageClassification" not in self.heads:
            pytest.skip("no image processor or classification head")
        size = {"height": self.image_size, "width": self.image_size}
        processor = self.image_processor_class(size=size)
        images = random_images(3)
        batch = processor(images, return_tensors="pt")
        assert tuple(batch["pixel_values"].shape) == (3, 3, self.image_size, self.image_size)
        gray = processor(images[0].convert("L"), return_tensors="pt")["pixel_values"]
        assert gray.shape == (1, 3, self.image_size, self.image_size), "grayscale images must become RGB"

        labels = {0: "cat", 1: "dog", 2: "bird"}
        model = self.make_model(
            "AutoModelForImageClassification", id2label=labels, label2id={v: k for k, v in labels.items()}
        )
        model.save_pretrained(tmp_path)
        processor.save_pretrained(tmp_path)
        reloaded = AutoImageProcessor.from_pretrained(tmp_path)
        assert type(reloaded) is self.image_processor_class
        assert torch.equal(reloaded(images, return_tensors="pt")["pixel_values"], batch["pixel_values"])

        classifier = pipeline("image-classification", model=str(tmp_path), device=self.device)
        predictions = classifier(images[0], top_k=3)
        assert {p["label"] for p in predictions} == set(labels.values())
        with torch.no_grad():
            probs = model(pixel_values=batch["pixel_values"].to(self.device)).logits[0].softmax(-1)
        best = max(predictions, key=lambda p: p["score"])
        assert best["label"] == labels[int(probs.argmax())]
        assert abs(best["score"] - float(probs.max())) < 1e-5

    # ----- mixed precision and any device ----------------------------------------------------------------
    def training_loss(self, auto_name: str, out) -> torch.Tensor:
        """The head's own loss, or for heads without one (base model, backbone) the mean square of the output."""
        loss = getattr(out, "loss", None)
        return loss if loss is not None else self.main_output(auto_name, out).float().pow(2).mean()

    @pytest.mark.parametrize("dtype", HALF_DTYPES)
    def test_autocast_training_step(self, dtype):
        """Every head: a training step under autocast with dropout on (fp16 with a GradScaler-style scaled loss) gives
        a finite loss and finite gradients; in eval mode the autocast output is within tolerance of float32, with and
        without autograd recording (architectures may take another kernel path when parameters need gradients)."""
        scale = FP16_LOSS_SCALE if dtype == torch.float16 else 1.0
        tolerance = MIXED_PRECISION_TOLERANCE[dtype]
        for auto_name in self.heads:
            model = self.make_model(auto_name, **self.dropout_config).train()
            inputs = self.inputs_for(auto_name)
            with torch.autocast(self.device.type, dtype=dtype):
                loss = self.training_loss(auto_name, model(**inputs))
            assert loss.dim() == 0 and torch.isfinite(loss), (auto_name, loss)
            (loss * scale).backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert grads, auto_name
            bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
            assert not bad, f"{auto_name}: non-finite gradients in {bad[:5]}"
            assert any(g.abs().sum() > 0 for g in grads.values()), f"{auto_name}: every gradient is zero"

            model = self.make_model(auto_name)
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
            with torch.no_grad():
                reference = self.main_output(auto_name, model(**inputs))
                with torch.autocast(self.device.type, dtype=dtype):
                    no_grad = self.main_output(auto_name, model(**inputs))
            with torch.autocast(self.device.type, dtype=dtype):
                recorded = self.main_output(auto_name, model(**inputs)).detach()
            for mode, out in (("no_grad", no_grad), ("grad", recorded)):
                assert torch.isfinite(out).all(), (auto_name, mode)
                error = deviation(out, reference)
                assert error <= tolerance, f"{auto_name} ({mode}): deviation {error:.2e} from float32 > {tolerance}"

    @pytest.mark.parametrize("dtype", HALF_DTYPES)
    def test_half_precision_weights(self, dtype):
        """``model.to(dtype)`` in eval mode: finite outputs within tolerance of the float32 model."""
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            inputs = {k: v for k, v in self.inputs_for(auto_name).items() if k != "labels"}
            half_inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
            with torch.no_grad():
                reference = self.main_output(auto_name, model(**inputs))
                out = self.main_output(auto_name, model.to(dtype)(**half_inputs))
            assert out.dtype == dtype, (auto_name, out.dtype)
            assert torch.isfinite(out).all(), auto_name
            error = deviation(out, reference)
            tolerance = MIXED_PRECISION_TOLERANCE[dtype]
            assert error <= tolerance, f"{auto_name}: deviation {error:.2e} from float32 > {tolerance}"

    # ----- any dtype at load and construction time ----------------------------------------------------------
    def registered_heads(self) -> dict[str, type]:
        """Every model class the registry files under this model type (the suite's ``heads`` and any it leaves out;
        not the image processor), so that loading in another dtype covers each of them."""
        registered = REGISTRY[self.config_class.model_type][1]
        return {**self.heads, **{name: cls for name, cls in registered.items() if name != "AutoImageProcessor"}}

    @staticmethod
    def _loader(auto_name: str, cls: type):
        """What loads a checkpoint of ``cls``: its Auto class, except for backbones: ``AutoBackbone.from_pretrained``
        (transformers 5.23 / 5.24) asks the Hub whether the name is a repository before anything else and fails on a
        local folder (``HFValidationError``), so backbones load through their own class."""
        return cls if auto_name == "AutoBackbone" else getattr(transformers, auto_name)

    def _float32_reference(self, auto_name: str, cls: type):
        """``cls`` of the tiny config in float32 (seeded, every weight moved off its initial value as in
        ``make_model``), its inputs without labels, and its main output on them."""
        torch.manual_seed(0)
        model = cls(self.make_config()).eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        model = model.to(self.device)
        inputs = {k: v for k, v in self.inputs_for(auto_name).items() if k != "labels"}
        with torch.no_grad():
            return model, inputs, self.main_output(auto_name, model(**inputs))

    def _check_low_precision(self, auto_name: str, model, reference, inputs: dict, ref_out, dtype) -> None:
        """``model`` (built or loaded in ``dtype``): every parameter in ``dtype``, buffers the float32 ``reference``'s
        (rounded), and an eval forward on ``inputs`` (images cast to ``dtype``) with finite outputs within
        ``MIXED_PRECISION_TOLERANCE`` of ``ref_out``."""
        wrong = [f"{n} ({p.dtype})" for n, p in model.named_parameters() if p.dtype != dtype]
        assert not wrong, f"{auto_name}: parameters not in {dtype}: {wrong[:5]}"
        bad = buffer_mismatches(model, reference)
        assert not bad, f"{auto_name}: buffers that are not the float32 model's (rounded): {bad[:5]}"
        half_inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        with torch.no_grad():
            out = self.main_output(auto_name, model.eval()(**half_inputs))
        assert out.dtype == dtype, (auto_name, out.dtype)
        assert torch.isfinite(out).all(), auto_name
        error, tolerance = deviation(out, ref_out), MIXED_PRECISION_TOLERANCE[dtype]
        assert error <= tolerance, f"{auto_name}: deviation {error:.2e} from float32 > {tolerance}"

    @pytest.mark.parametrize("dtype", HALF_DTYPES)
    def test_loads_in_half_precision(self, dtype, tmp_path):
        """A float32 checkpoint loaded with ``from_pretrained(dtype=...)`` (every registered head): parameters in that
        dtype, buffers the float32 model's rounded, and eval outputs finite and close to float32."""
        for auto_name, cls in self.registered_heads().items():
            reference, inputs, ref_out = self._float32_reference(auto_name, cls)
            reference.save_pretrained(tmp_path / auto_name)
            loaded = self._loader(auto_name, cls).from_pretrained(tmp_path / auto_name, dtype=dtype)
            assert type(loaded) is cls and loaded.dtype == dtype, (auto_name, type(loaded), loaded.dtype)
            self._check_low_precision(auto_name, loaded.to(self.device), reference, inputs, ref_out, dtype)

    def test_auto_dtype_roundtrip(self, tmp_path):
        """A checkpoint saved in bfloat16 comes back in bfloat16 with ``dtype="auto"``, and computes exactly what the
        saved model computed."""
        for auto_name, cls in self.registered_heads().items():
            model, inputs, _ = self._float32_reference(auto_name, cls)
            model = model.to(torch.bfloat16)
            inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
            with torch.no_grad():
                saved = self.main_output(auto_name, model(**inputs))
            model.save_pretrained(tmp_path / auto_name)
            loaded = self._loader(auto_name, cls).from_pretrained(tmp_path / auto_name, dtype="auto")
            with torch.no_grad():
                again = self.main_output(auto_name, loaded.eval().to(self.device)(**inputs))
            check_auto_dtype_load(auto_name, cls, loaded, model, again, saved)

    def test_builds_under_a_bfloat16_default_dtype(self):
        """Built under ``torch.set_default_dtype(torch.bfloat16)`` (then restored): parameters in bfloat16, buffers the
        float32 model's rounded, and with the float32 model's weights copied in, eval outputs finite and close to
        float32."""
        for auto_name, cls in self.registered_heads().items():
            reference, inputs, ref_out = self._float32_reference(auto_name, cls)
            model = build_under_bfloat16_default(auto_name, cls, self.make_config(), reference)
            # Construction's own random initialisation is not compared: the weights are made the float32 model's
            # (load_state_dict casts them) before comparing outputs.
            model.load_state_dict(reference.state_dict())
            self._check_low_precision(auto_name, model.to(self.device), reference, inputs, ref_out, torch.bfloat16)

    def test_host_syncs_do_not_grow_with_depth(self):
        """Device-to-host reads (``bool(t)``, ``.item()``, data-dependent shapes) in one forward of every head, eval
        and train, at a size that needs no padding and one that does: a model three blocks deep makes as many as one
        a block deep, so none happens per block."""
        for auto_name in self.heads:
            for size in [(self.image_size, self.image_size), self.odd_sizes[0]]:
                inputs = self.inputs_for(auto_name, height=size[0], width=size[1])
                for train in (False, True):
                    counts = []
                    for depth in (1, 3):
                        model = self.make_model(auto_name, **self.depth_config(depth), **self.dropout_config)
                        model.train(train)
                        # Training records autograd (the path a training step takes); evaluation does not.
                        with torch.set_grad_enabled(train), HostReadCounter() as counter:
                            model(**inputs)
                        counts.append(counter.count)
                    assert counts[0] == counts[1], f"{auto_name} {size} train={train}: host reads {counts} (1 vs 3)"
