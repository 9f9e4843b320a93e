"""The conformance suite every text architecture runs with a tiny config.

Use it by subclassing :class:`TextModelConformance` in a ``test_<arch>.py`` file::

    class TestLongformerConformance(TextModelConformance):
        config_class = HfxLongformerConfig
        base_config = dict(attention_window=4, ...)        # tiny: hidden <= 64, <= 2 layers
        heads = {"AutoModel": HfxLongformerModel, "AutoModelForMaskedLM": HfxLongformerForMaskedLM, ...}
        bad_configs = [(dict(attention_window=3), "even")]  # (overrides, regex the ValueError must match)

Sequence lengths used here are chosen longer than the tiny windows/blocks, so the efficient path is
exercised, not only its short-input fallback.

Every test runs on the device given to pytest (``pytest --device cuda``; the CPU by default), with
device-appropriate tolerances (``tests/conftest.py``). Mixed precision: every head trains under ``torch.autocast`` in
bfloat16 and float16 with dropout on (``dropout_config``) and runs with half-precision weights, within
``MIXED_PRECISION_TOLERANCE`` of float32. Hooks an architecture may override: ``dropout_config`` (the config fields
that turn dropout on), ``depth_config(n)`` (a model of ``n`` layers) and ``full_attention_config()`` (a config and
input length at which the model's SDPA calls need no mask, or None where it computes without SDPA).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, Trainer, TrainingArguments

from hf_xformers.registration import REGISTRY

from .device_checks import (
    FP16_LOSS_SCALE,
    HALF_DTYPES,
    MIXED_PRECISION_TOLERANCE,
    DefaultDeviceRecorder,
    HostReadCounter,
    buffer_mismatches,
    build_under_bfloat16_default,
    check_auto_dtype_load,
    deviation,
)
from .packing_conformance import PackingConformance

SEQ_LEN = 24
VOCAB = 99
NUM_LABELS = 3
NUM_CHOICES = 2
ATOL = 1e-5

_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=NUM_LABELS,
)


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Ids 0-4 are the special tokens of our tiny vocabularies (<s>, <pad>, </s>, <unk>, <mask>).
    ids = torch.randint(5, VOCAB, (batch, length), generator=g)
    ids[:, 0] = 0
    ids[:, -1] = 2
    return ids


class TextModelConformance(PackingConformance):
    config_class: type
    base_config: dict = {}
    heads: dict[str, type] = {}
    bad_configs: list[tuple[dict, str]] = []
    pad_token_id: int = 1
    # Parameter-name fragment of the first encoder layer (the Trainer test checks that it trained).
    first_layer_key: str = "encoder.layer.0"
    # Config fields that turn dropout on, for the mixed-precision training step.
    dropout_config: dict = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    # Whether padded inputs reach SDPA as a mask (Linformer zeroes padding before projecting instead).
    padding_needs_sdpa_mask: bool = True
    device: torch.device = torch.device("cpu")
    atol: float = ATOL

    @pytest.fixture(autouse=True)
    def _on_device(self, device, device_atol):
        """Every test runs on the ``--device`` of the pytest run, with that device's tolerance."""
        self.device, self.atol = device, device_atol

    # ----- hooks ---------------------------------------------------------------------------------
    def depth_config(self, num_layers: int) -> dict:
        """Config overrides for a model of ``num_layers`` layers."""
        return {"num_hidden_layers": num_layers}

    def full_attention_config(self) -> dict | None:
        """Config overrides under which an unpadded ``SEQ_LEN``-token input needs no attention mask at all (every
        query sees every key), or None if the architecture makes no SDPA call."""
        return None

    # ----- helpers -------------------------------------------------------------------------------
    def make_config(self, **overrides):
        return self.config_class(**{**_TINY, **self.base_config, **overrides})

    def make_model(self, auto_name: str, **overrides):
        torch.manual_seed(0)
        return self.heads[auto_name](self.make_config(**overrides)).eval().to(self.device)

    def inputs_for(self, auto_name: str, batch: int = 2, length: int = SEQ_LEN) -> dict:
        """Inputs (and labels) for one head, on the test's device."""
        return {k: v.to(self.device) for k, v in self._cpu_inputs_for(auto_name, batch, length).items()}

    def _cpu_inputs_for(self, auto_name: str, batch: int, length: int) -> dict:
        ids = _ids(batch, length)
        mask = torch.ones_like(ids)
        if auto_name == "AutoModelForMultipleChoice":
            ids = torch.stack([ids, _ids(batch, length, seed=1)], dim=1)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1][:batch])}
        inputs = {"input_ids": ids, "attention_mask": mask}
        if auto_name == "AutoModelForMaskedLM":
            inputs["labels"] = ids.masked_fill(
                torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) > 0.3, -100
            )
        elif auto_name == "AutoModelForSequenceClassification":
            inputs["labels"] = torch.arange(batch) % NUM_LABELS
        elif auto_name == "AutoModelForTokenClassification":
            inputs["labels"] = torch.randint(0, NUM_LABELS, ids.shape, generator=torch.Generator().manual_seed(4))
        elif auto_name == "AutoModelForQuestionAnswering":
            inputs["start_positions"] = torch.tensor([1, 3][:batch])
            inputs["end_positions"] = torch.tensor([2, 5][:batch])
        return inputs

    @staticmethod
    def main_output(auto_name: str, out) -> torch.Tensor:
        if auto_name == "AutoModel":
            return out.last_hidden_state
        if auto_name == "AutoModelForQuestionAnswering":
            return torch.stack([out.start_logits, out.end_logits], -1)
        return out.logits

    def expected_shape(self, auto_name: str, batch: int, length: int) -> tuple:
        hidden = self.make_config().hidden_size
        return {
            "AutoModel": (batch, length, hidden),
            "AutoModelForMaskedLM": (batch, length, VOCAB),
            "AutoModelForSequenceClassification": (batch, NUM_LABELS),
            "AutoModelForMultipleChoice": (batch, NUM_CHOICES),
            "AutoModelForTokenClassification": (batch, length, NUM_LABELS),
            "AutoModelForQuestionAnswering": (batch, length, 2),
        }[auto_name]

    # ----- shapes and outputs ----------------------------------------------------------------------
    def test_head_output_shapes_and_losses(self):
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            inputs = self.inputs_for(auto_name)
            out = model(**inputs)
            assert tuple(self.main_output(auto_name, out).shape) == self.expected_shape(auto_name, 2, SEQ_LEN), (
                auto_name
            )
            if auto_name != "AutoModel":
                assert out.loss is not None and out.loss.dim() == 0 and torch.isfinite(out.loss), auto_name
                out.loss.backward()
                grads = [p.grad for p in model.parameters() if p.requires_grad]
                assert any(g is not None and g.abs().sum() > 0 for g in grads), auto_name

    def test_base_model_pooler_and_tuple_output(self):
        model = self.make_model("AutoModel")
        inputs = self.inputs_for("AutoModel")
        out = model(**inputs)
        assert out.pooler_output.shape == (2, model.config.hidden_size)
        as_tuple = model(**inputs, return_dict=False)
        assert torch.equal(as_tuple[0], out.last_hidden_state)

    def test_output_attentions_and_hidden_states(self):
        config = self.make_config()
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            inputs = self.inputs_for(auto_name)
            out = model(**inputs, output_attentions=True, output_hidden_states=True)
            rows = 2 * NUM_CHOICES if auto_name == "AutoModelForMultipleChoice" else 2
            assert len(out.hidden_states) == config.num_hidden_layers + 1
            assert all(h.shape == (rows, SEQ_LEN, config.hidden_size) for h in out.hidden_states)
            assert len(out.attentions) == config.num_hidden_layers
            for att in out.attentions:
                assert att.shape[:3] == (rows, config.num_attention_heads, SEQ_LEN)
                assert torch.all(att >= 0)
            # Attentions must not change the result.
            plain = model(**inputs)
            torch.testing.assert_close(
                self.main_output(auto_name, out), self.main_output(auto_name, plain), atol=self.atol, rtol=0
            )

    def test_classification_problem_types(self):
        inputs = self.inputs_for("AutoModel")
        inputs.pop("labels", None)
        if "AutoModelForSequenceClassification" not in self.heads:
            pytest.skip("no sequence classification head")
        head = self.heads["AutoModelForSequenceClassification"]
        torch.manual_seed(0)
        reg = head(self.make_config(num_labels=1)).to(self.device)
        targets = torch.tensor([0.5, -1.0], device=self.device)
        out = reg(**inputs, labels=targets)
        assert reg.config.problem_type == "regression" and out.logits.shape == (2, 1)
        torch.testing.assert_close(out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), targets))
        multi = head(self.make_config()).to(self.device)
        labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], device=self.device)
        out = multi(**inputs, labels=labels)
        assert multi.config.problem_type == "multi_label_classification"
        torch.testing.assert_close(out.loss, torch.nn.functional.binary_cross_entropy_with_logits(out.logits, labels))
        single = head(self.make_config()).to(self.device)
        with pytest.raises(ValueError, match="num_labels"):
            single(**inputs, labels=torch.tensor([0, NUM_LABELS], device=self.device))

    def test_mean_pooling_classifier(self):
        """``classifier_pooling="mean"``: the head reads the mean of the real tokens, so right padding changes
        nothing, and an unknown pooling is a ValueError."""
        head = self.heads.get("AutoModelForSequenceClassification")
        if head is None:
            pytest.skip("no sequence classification head")
        model = self.make_model("AutoModelForSequenceClassification", classifier_pooling="mean")
        ids = _ids(1, SEQ_LEN - 6, seed=8).to(self.device)
        padded = torch.cat([ids, torch.full((1, 6), self.pad_token_id, device=self.device)], dim=1)
        mask = (torch.arange(SEQ_LEN, device=self.device) < SEQ_LEN - 6).long()[None]
        with torch.no_grad():
            alone = model(input_ids=ids).logits
            batched = model(input_ids=padded, attention_mask=mask).logits
            first = self.make_model("AutoModelForSequenceClassification")(input_ids=ids).logits
        torch.testing.assert_close(batched, alone, atol=self.atol, rtol=0)
        assert not torch.allclose(first, alone)  # a different readout of the same weights
        with pytest.raises(ValueError, match="classifier_pooling"):
            head(self.make_config(classifier_pooling="max"))

    # ----- Auto classes and serialisation ----------------------------------------------------------
    def test_auto_resolution(self):
        model_type = self.config_class.model_type
        assert model_type.startswith("hfx-")
        config = AutoConfig.for_model(model_type, **{**_TINY, **self.base_config})
        assert type(config) is self.config_class
        for auto_name, cls in self.heads.items():
            model = getattr(transformers, auto_name).from_config(config)
            assert type(model) is cls, auto_name

    def test_save_load_roundtrip(self, tmp_path):
        for auto_name, cls in self.heads.items():
            model = self.make_model(auto_name)
            inputs = self.inputs_for(auto_name)
            with torch.no_grad():
                before = self.main_output(auto_name, model(**inputs))
            path = tmp_path / auto_name
            model.save_pretrained(path)
            loaded = getattr(transformers, auto_name).from_pretrained(path).eval().to(self.device)
            assert type(loaded) is cls
            with torch.no_grad():
                after = self.main_output(auto_name, loaded(**inputs))
            assert torch.equal(before, after), auto_name
            assert (
                loaded.config.to_dict() == model.config.to_dict()
                or loaded.config.to_diff_dict() == model.config.to_diff_dict()
            )

    def test_masked_lm_weights_tied(self, tmp_path):
        if "AutoModelForMaskedLM" not in self.heads:
            pytest.skip("no masked LM head")
        model = self.make_model("AutoModelForMaskedLM")
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        model.save_pretrained(tmp_path)
        loaded = self.heads["AutoModelForMaskedLM"].from_pretrained(tmp_path)
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight

    # ----- invariances -----------------------------------------------------------------------------
    def test_padding_invariance(self):
        """Right padding (and padding far past the real tokens) leaves real positions unchanged."""
        for auto_name in ("AutoModel", "AutoModelForMaskedLM"):
            if auto_name not in self.heads:
                continue
            model = self.make_model(auto_name)
            short = _ids(1, SEQ_LEN - 7, seed=5).to(self.device)
            long = _ids(1, SEQ_LEN, seed=6).to(self.device)
            padded = torch.full((2, SEQ_LEN + 5), self.pad_token_id, device=self.device)
            padded[0, : short.shape[1]] = short[0]
            padded[1, :SEQ_LEN] = long[0]
            mask = (padded != self.pad_token_id).long()
            with torch.no_grad():
                batch_out = self.main_output(auto_name, model(input_ids=padded, attention_mask=mask))
                alone_short = self.main_output(auto_name, model(input_ids=short))
                alone_long = self.main_output(auto_name, model(input_ids=long))
            torch.testing.assert_close(batch_out[0, : short.shape[1]], alone_short[0], atol=self.atol, rtol=0)
            torch.testing.assert_close(batch_out[1, :SEQ_LEN], alone_long[0], atol=self.atol, rtol=0)

    def test_batch_invariance(self):
        """An example's output does not depend on its batch-mates."""
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            inputs = self.inputs_for(auto_name, batch=2)
            inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
            with torch.no_grad():
                both = self.main_output(auto_name, model(**inputs))
                first = self.main_output(auto_name, model(**{k: v[:1] for k, v in inputs.items()}))
                second = self.main_output(auto_name, model(**{k: v[1:] for k, v in inputs.items()}))
            torch.testing.assert_close(both[:1], first, atol=self.atol, rtol=0)
            torch.testing.assert_close(both[1:], second, atol=self.atol, rtol=0)

    # ----- training ----------------------------------------------------------------------------------
    def test_gradient_checkpointing_same_gradients(self):
        auto_name = "AutoModelForMaskedLM" if "AutoModelForMaskedLM" in self.heads else "AutoModel"
        if not self.heads[auto_name].supports_gradient_checkpointing:
            # A declining architecture (Reformer) says so, and why, instead of transformers' bare refusal.
            with pytest.raises(ValueError, match="checkpointing"):
                self.make_model(auto_name).train().gradient_checkpointing_enable()
            return
        inputs = self.inputs_for(auto_name)

        def grads(checkpointing: bool):
            model = self.make_model(auto_name).train()
            if checkpointing:
                model.gradient_checkpointing_enable()
                assert model.is_gradient_checkpointing
            out = self.main_output(auto_name, model(**inputs))
            (out.float().pow(2).mean()).backward()
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        plain, checkpointed = grads(False), grads(True)
        assert plain.keys() == checkpointed.keys() and plain
        for name in plain:
            torch.testing.assert_close(plain[name], checkpointed[name], atol=self.atol / 10, rtol=1e-5, msg=name)

    def test_trainer_step(self, tmp_path):
        head = self.heads["AutoModelForSequenceClassification"]
        torch.manual_seed(0)
        model = head(self.make_config())
        ids = _ids(8, SEQ_LEN, seed=7)  # Trainer moves the model and the batches to the device
        rows = [
            {"input_ids": ids[i], "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long), "labels": i % NUM_LABELS}
            for i in range(8)
        ]
        before = copy.deepcopy(model.state_dict())
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
            use_cpu=self.device.type == "cpu", report_to="none", save_strategy="no", eval_strategy="no",
            disable_tqdm=True,
        )  # fmt: skip
        result = Trainer(model=model, args=args, train_dataset=rows).train()
        assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
        changed = [n for n, p in model.state_dict().items() if not torch.equal(p.cpu(), before[n].cpu())]
        assert any("classifier" in n for n in changed) and any(self.first_layer_key in n for n in changed)

    # ----- mixed precision, half-precision weights ----------------------------------------------------
    def _scored_output(self, auto_name: str, out) -> torch.Tensor:
        """The loss (heads) or a scalar of the hidden states (base model), in float32, to differentiate."""
        return out.loss.float() if auto_name != "AutoModel" else self.main_output(auto_name, out).float().pow(2).mean()

    @pytest.mark.parametrize("dtype", HALF_DTYPES)
    def test_autocast_training_step(self, dtype):
        """Every head trains under autocast with dropout on: finite loss and gradients (float16 with a scaled loss,
        as GradScaler does), dropout really on, and eval outputs under autocast close to float32."""
        tolerance = MIXED_PRECISION_TOLERANCE[dtype]
        scale = FP16_LOSS_SCALE if dtype is torch.float16 else 1.0
        for auto_name in self.heads:
            model = self.make_model(auto_name, **self.dropout_config).train()
            inputs = self.inputs_for(auto_name)
            with torch.autocast(self.device.type, dtype=dtype):
                out = model(**inputs)
                again = model(**inputs)
            loss = self._scored_output(auto_name, out)
            assert torch.isfinite(loss), auto_name
            assert not torch.equal(self.main_output(auto_name, out), self.main_output(auto_name, again)), (
                f"{auto_name}: two training-mode forwards agree; dropout_config does not turn dropout on"
            )
            (loss * scale).backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert grads and any(g.abs().sum() > 0 for g in grads.values()), auto_name
            bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
            assert not bad, f"{auto_name}: non-finite gradients in {bad[:5]}"
            model.eval()
            with torch.no_grad():
                ref = self.main_output(auto_name, model(**inputs))
                with torch.autocast(self.device.type, dtype=dtype):
                    low = self.main_output(auto_name, model(**inputs))
            assert torch.isfinite(low).all(), auto_name
            assert deviation(low, ref) <= tolerance, f"{auto_name}: {deviation(low, ref):.2e} from float32"

    @pytest.mark.parametrize("dtype", HALF_DTYPES)
    def test_half_precision_weights(self, dtype):
        """``model.to(bfloat16 / float16)`` evaluates finitely, close to float32, with outputs in that dtype."""
        tolerance = MIXED_PRECISION_TOLERANCE[dtype]
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            inputs = self.inputs_for(auto_name)
            with torch.no_grad():
                ref = self.main_output(auto_name, model(**inputs))
                low = self.main_output(auto_name, model.to(dtype)(**inputs))
            assert low.dtype == dtype or auto_name != "AutoModel", (auto_name, low.dtype)
            assert torch.isfinite(low).all(), auto_name
            assert deviation(low, ref) <= tolerance, f"{auto_name}: {deviation(low, ref):.2e} from float32"

    # ----- any dtype at load and construction time ----------------------------------------------------------
    def registered_heads(self) -> dict[str, type]:
        """Every model class the registry files under this model type: the suite's ``heads`` and the ones it leaves
        out (causal and encoder-decoder LMs), so that loading in another dtype covers each of them."""
        registered = REGISTRY[self.config_class.model_type][1]
        return {**self.heads, **{name: cls for name, cls in registered.items() if name.startswith("AutoModel")}}

    def dtype_inputs_for(self, auto_name: str) -> dict:
        """Inputs of ``inputs_for`` for the suite's heads; the ids alone (and, encoder-decoder, half as many decoder
        ids) for registered heads the suite leaves out."""
        if auto_name in self.heads:
            return self.inputs_for(auto_name)
        inputs = {k: v for k, v in self.inputs_for("AutoModel").items() if k in ("input_ids", "attention_mask")}
        if auto_name == "AutoModelForSeq2SeqLM":
            inputs["decoder_input_ids"] = inputs["input_ids"][:, : SEQ_LEN // 2]
        return inputs

    def _float32_reference(self, auto_name: str, cls: type):
        """``cls`` of the tiny config in float32 (seeded) and its main output on ``dtype_inputs_for``."""
        torch.manual_seed(0)
        model = cls(self.make_config()).eval().to(self.device)
        with torch.no_grad():
            return model, self.main_output(auto_name, model(**self.dtype_inputs_for(auto_name)))

    def _check_low_precision(self, auto_name: str, model, reference, ref_out: torch.Tensor, dtype) -> None:
        """``model`` (built or loaded in ``dtype``): every parameter in ``dtype``, buffers the float32 ``reference``'s
        (rounded), and an eval forward with finite outputs (and loss) within ``MIXED_PRECISION_TOLERANCE`` of
        ``ref_out``."""
        wrong = [f"{n} ({p.dtype})" for n, p in model.named_parameters() if p.dtype != dtype]
        assert not wrong, f"{auto_name}: parameters not in {dtype}: {wrong[:5]}"
        bad = buffer_mismatches(model, reference)
        assert not bad, f"{auto_name}: buffers that are not the float32 model's (rounded): {bad[:5]}"
        with torch.no_grad():
            out = model.eval()(**self.dtype_inputs_for(auto_name))
        low = self.main_output(auto_name, out)
        assert low.dtype == dtype or auto_name != "AutoModel", (auto_name, low.dtype)
        assert torch.isfinite(low).all(), auto_name
        loss = getattr(out, "loss", None)
        assert loss is None or torch.isfinite(loss), (auto_name, loss)
        tolerance = MIXED_PRECISION_TOLERANCE[dtype]
        assert deviation(low, ref_out) <= tolerance, f"{auto_name}: {deviation(low, ref_out):.2e} from float32"

    @pytest.mark.parametrize("dtype", HALF_DTYPES)
    def test_loads_in_half_precision(self, dtype, tmp_path):
        """A float32 checkpoint loaded with ``from_pretrained(dtype=...)`` (every registered head): parameters in that
        dtype, seeded random buffers the float32 model's rounded (drawn in float32, not in 16 bits), and eval outputs
        finite and close to float32."""
        for auto_name, cls in self.registered_heads().items():
            reference, ref_out = self._float32_reference(auto_name, cls)
            reference.save_pretrained(tmp_path / auto_name)
            loaded = getattr(transformers, auto_name).from_pretrained(tmp_path / auto_name, dtype=dtype)
            assert type(loaded) is cls and loaded.dtype == dtype, (auto_name, type(loaded), loaded.dtype)
            self._check_low_precision(auto_name, loaded.to(self.device), reference, ref_out, dtype)

    def test_auto_dtype_roundtrip(self, tmp_path):
        """A checkpoint saved in bfloat16 comes back in bfloat16 with ``dtype="auto"``, and computes exactly what the
        saved model computed."""
        for auto_name, cls in self.registered_heads().items():
            model = self._float32_reference(auto_name, cls)[0].to(torch.bfloat16)
            inputs = self.dtype_inputs_for(auto_name)
            with torch.no_grad():
                saved = self.main_output(auto_name, model(**inputs))
            model.save_pretrained(tmp_path / auto_name)
            loaded = getattr(transformers, auto_name).from_pretrained(tmp_path / auto_name, dtype="auto")
            with torch.no_grad():
                again = self.main_output(auto_name, loaded.eval().to(self.device)(**inputs))
            check_auto_dtype_load(auto_name, cls, loaded, model, again, saved)

    def test_builds_under_a_bfloat16_default_dtype(self):
        """Built under ``torch.set_default_dtype(torch.bfloat16)`` (then restored): parameters in bfloat16, seeded
        random buffers the float32 model's rounded, and with the float32 model's weights copied in, eval outputs
        finite and close to float32."""
        for auto_name, cls in self.registered_heads().items():
            reference, ref_out = self._float32_reference(auto_name, cls)
            model = build_under_bfloat16_default(auto_name, cls, self.make_config(), reference)
            # Construction's own (random) initialisation is not compared: only seeded tables must match, so the
            # parameters are made the float32 model's before comparing outputs (load_state_dict casts them).
            model.load_state_dict(reference.state_dict())
            self._check_low_precision(auto_name, model.to(self.device), reference, ref_out, torch.bfloat16)

    # ----- device synchronisation and fused kernels ---------------------------------------------------
    def test_host_syncs_do_not_grow_with_depth(self):
        """Anything decided from tensor values ("is anything padded / global") is decided once per forward, not in
        every layer: on a GPU each such read waits for the device. Eval and training mode, with and without padding."""
        counts = {}
        for depth in (1, 3):
            torch.manual_seed(0)
            model = self.heads["AutoModel"](self.make_config(**self.depth_config(depth), **self.dropout_config))
            model = model.to(self.device)
            ids = _ids(2, SEQ_LEN).to(self.device)
            padded = torch.ones_like(ids)
            padded[0, SEQ_LEN - 5 :] = 0
            for training in (False, True):
                model.train(training)
                for name, mask in (("unpadded", torch.ones_like(ids)), ("padded", padded)):
                    with torch.no_grad(), HostReadCounter() as counter:
                        model(input_ids=ids, attention_mask=mask)
                    counts[depth, training, name] = counter.count
        for training in (False, True):
            for name in ("unpadded", "padded"):
                one, three = counts[1, training, name], counts[3, training, name]
                assert one == three, f"training={training}, {name}: {one} host reads with 1 layer, {three} with 3"

    def test_same_outputs_on_the_device_as_on_the_cpu(self, device):
        """Seeded randomness (hash rotations, random features, random blocks) is drawn on the CPU and copied, so a
        checkpoint evaluates the same on every device (skipped when the run's ``--device`` is the CPU)."""
        if device.type == "cpu":
            pytest.skip("run with --device <accelerator> to compare against the CPU")
        self.device = torch.device("cpu")
        for auto_name in self.heads:
            model = self.make_model(auto_name)
            inputs = self.inputs_for(auto_name)
            with torch.no_grad():
                on_cpu = self.main_output(auto_name, model(**inputs))
                moved = model.to(device)(**{k: v.to(device) for k, v in inputs.items()})
            torch.testing.assert_close(self.main_output(auto_name, moved).cpu(), on_cpu, atol=1e-4, rtol=1e-4)

    def test_forward_creates_no_tensor_on_the_default_device(self):
        """Every tensor a forward makes is made on its inputs' device: with the default device set to `meta`, a
        factory call without ``device=`` would show up as a meta tensor (on a GPU run: a CPU tensor, an error or a
        copy). Every head, eval and training mode (dropout on), padded input."""
        for auto_name in self.heads:
            model = self.make_model(auto_name, **self.dropout_config)
            inputs = self.inputs_for(auto_name)
            mask = inputs["attention_mask"].clone()
            mask[..., SEQ_LEN - 3 :] = 0
            inputs["attention_mask"] = mask
            for training in (False, True):
                model.train(training)
                with torch.device("meta"), DefaultDeviceRecorder() as recorder:
                    out = model(**inputs)
                    loss = self._scored_output(auto_name, out)
                assert not loss.is_meta and not recorder.ops, (auto_name, training, recorder.ops[:5])

    def test_sdpa_gets_no_mask_without_padding(self, monkeypatch):
        """Where every query sees every key and nothing is padded, SDPA is called without a mask (a mask keeps it
        off its flash kernel); with padding it still gets one (where the architecture masks padding in SDPA)."""
        overrides = self.full_attention_config()
        if overrides is None:
            pytest.skip("this architecture makes no SDPA call")
        masks = []
        sdpa = F.scaled_dot_product_attention

        def recording_sdpa(*args, **kwargs):
            masks.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
        model = self.make_model("AutoModel", **overrides)
        ids = _ids(2, SEQ_LEN).to(self.device)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            assert masks and all(m is None for m in masks), [None if m is None else tuple(m.shape) for m in masks]
            masks.clear()
            padded = torch.ones_like(ids)
            padded[0, SEQ_LEN - 5 :] = 0
            model(input_ids=ids, attention_mask=padded)
        assert any(m is not None for m in masks) == self.padding_needs_sdpa_mask

    # ----- bad inputs ----------------------------------------------------------------------------------
    def test_too_long_input_raises(self):
        model = self.make_model("AutoModel")
        limit = model.config.max_position_embeddings
        with pytest.raises(ValueError, match="max_position_embeddings"):
            model(input_ids=_ids(1, limit + 1).to(self.device))

    def test_wrong_mask_shape_raises(self):
        model = self.make_model("AutoModel")
        ids = _ids(2, SEQ_LEN).to(self.device)
        with pytest.raises(ValueError, match="attention_mask"):
            model(input_ids=ids, attention_mask=torch.ones(2, SEQ_LEN - 1, device=self.device))
        with pytest.raises(ValueError, match="input_ids"):
            model(input_ids=ids[0])
        with pytest.raises(ValueError, match="exactly one"):
            model()
        with pytest.raises(ValueError, match="vocab_size"):
            model(input_ids=ids.clamp(max=VOCAB - 1) + 1)

    def test_degenerate_ids_raise(self):
        """Negative or float ids, empty sequences and empty batches get a ValueError that names the fix."""
        model = self.make_model("AutoModel")
        ids = _ids(2, SEQ_LEN).to(self.device)
        negative = ids.clone()
        negative[1, 3] = -100
        with pytest.raises(ValueError, match="negative id -100"):
            model(input_ids=negative)
        with pytest.raises(ValueError, match="integer token ids"):
            model(input_ids=ids.float())
        with pytest.raises(ValueError, match="length 0"):
            model(input_ids=ids[:, :0])
        with pytest.raises(ValueError, match="batch of 0"):
            model(input_ids=ids[:0])

    def test_no_labelled_token_gives_zero_loss(self):
        """A batch whose labels are all ignored scores nothing: loss 0 and zero gradients (not NaN), so gradient
        accumulation over sparsely labelled batches stays finite. (A ponder loss, where a model has one, remains.)"""
        for auto_name in ("AutoModelForMaskedLM", "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"):
            if auto_name not in self.heads:
                continue
            model = self.make_model(auto_name)
            inputs = self.inputs_for(auto_name)
            if auto_name == "AutoModelForQuestionAnswering":  # answers outside the input are ignored
                inputs["start_positions"] = inputs["end_positions"] = torch.full((2,), SEQ_LEN + 3, device=self.device)
            else:
                inputs["labels"] = torch.full_like(inputs["labels"], -100)
            out = model(**inputs)
            ponder = getattr(out, "ponder_loss", None)
            task_loss = out.loss - ponder if ponder is not None else out.loss
            assert torch.isfinite(out.loss) and task_loss.item() == 0.0, auto_name
            if ponder is None:
                out.loss.backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                assert all(torch.all(g == 0) for g in grads), auto_name

    def test_multiple_choice_needs_3d_inputs(self):
        if "AutoModelForMultipleChoice" not in self.heads:
            pytest.skip("no multiple choice head")
        model = self.make_model("AutoModelForMultipleChoice")
        with pytest.raises(ValueError, match="num_choices"):
            model(input_ids=_ids(2, SEQ_LEN).to(self.device))

    def test_invalid_config_values_raise(self):
        assert self.bad_configs, "list at least one invalid config value"
        for overrides, pattern in self.bad_configs:
            with pytest.raises(ValueError, match=pattern):
                self.make_config(**overrides)
        with pytest.raises(ValueError, match=re.escape("num_attention_heads")):
            self.make_config(hidden_size=30, num_attention_heads=4)
