"""Activation (gradient) checkpointing with every architecture: ``model.gradient_checkpointing_enable()`` and then a
training step gives the gradients of the same step without checkpointing, for the base model and every head of all
eight architectures, with dropout on (the recomputation must draw the same masks) and off.

The tiny configurations, heads and inputs are those of each architecture's conformance suite
(``tests/conformance.py``, ``tests/conformance_vision.py``); the suites' own checkpointing test covers one head
without dropout.

And transformers' contract for checkpointing (its common model tests): a class that says
``supports_gradient_checkpointing`` holds a ``GradientCheckpointingLayer`` whose checkpointed forward runs, forward and
again in the backward pass, when a head trains with checkpointing on; a class that does not (Reformer, whose
reversible layers already recompute their activations) refuses ``gradient_checkpointing_enable()`` with the reason.
"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_xformers.registration import REGISTRY

from . import (
    test_bigbird,
    test_linformer,
    test_longformer,
    test_performer,
    test_reformer,
    test_swin,
    test_transfo_xl,
    test_universal,
)

SUITES = {
    "longformer": test_longformer.TestLongformerConformance,
    "bigbird": test_bigbird.TestBigBirdConformance,
    "linformer": test_linformer.TestLinformerConformance,
    "performer": test_performer.TestPerformerConformance,
    "reformer": test_reformer.TestReformerConformance,
    "transfo_xl": test_transfo_xl.TestTransfoXLConformance,
    "universal": test_universal.TestUniversalConformance,
    "swin": test_swin.TestSwinConformance,
}
# Reformer declines checkpointing (its reversible layers recompute their activations in the backward pass anyway).
DECLINING = {"reformer"}
CHECKPOINTING = [arch for arch in SUITES if arch not in DECLINING]


def _suite(arch: str):
    suite = SUITES[arch]()
    suite.device, suite.atol = torch.device("cpu"), 1e-5
    return suite


def _loss(suite, auto_name: str, out) -> torch.Tensor:
    """The head's loss where it has labels, else a loss of its main output (the base model)."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    return suite.main_output(auto_name, out).float().pow(2).mean()


def _gradients(suite, auto_name: str, overrides: dict, checkpointing: bool, kwargs: dict | None = None) -> dict:
    model = suite.make_model(auto_name, **overrides).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert model.is_gradient_checkpointing
    inputs = suite.inputs_for(auto_name)
    torch.manual_seed(1234)  # the same dropout masks for both runs (checkpointing replays the RNG state)
    _loss(suite, auto_name, model(**inputs)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(plain: dict, checkpointed: dict, what: str) -> None:
    assert plain and plain.keys() == checkpointed.keys(), (what, plain.keys() ^ checkpointed.keys())
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=f"{what}: {name}")


@pytest.mark.parametrize("arch", CHECKPOINTING)
def test_checkpointed_training_step_gives_the_same_gradients(arch):
    """Every head (base model included), dropout on: the recomputed forward draws the same masks. transformers'
    default (non-reentrant) checkpoint for every head, the reentrant one (which older recipes and Trainer's
    ``gradient_checkpointing_kwargs`` still ask for) for the base model."""
    suite = _suite(arch)
    assert len(suite.heads) >= 2, arch  # the base model and at least one head
    overrides = suite.dropout_config
    for auto_name in suite.heads:
        plain = _gradients(suite, auto_name, overrides, False)
        _assert_same(plain, _gradients(suite, auto_name, overrides, True), auto_name)
    plain = _gradients(suite, "AutoModel", overrides, False)
    reentrant = _gradients(suite, "AutoModel", overrides, True, {"use_reentrant": True})
    _assert_same(plain, reentrant, "AutoModel, reentrant")


@pytest.mark.parametrize("arch", CHECKPOINTING)
def test_checkpointing_recomputes_the_layers(arch):
    """Checkpointing really is on: the attention modules run their forward again during the backward pass (a flag
    that is set but never read would pass the gradient test trivially)."""
    suite = _suite(arch)
    for overrides in [{}]:
        model = suite.make_model("AutoModel", **overrides).train()
        model.gradient_checkpointing_enable()
        calls = {"forward": 0, "backward": 0}
        phase = ["forward"]

        def count(*_, calls=calls, phase=phase):
            calls[phase[0]] += 1

        attention = [m for name, m in model.named_modules() if name.endswith(("attention", ".attn"))]
        assert attention, arch
        for module in attention:
            module.register_forward_pre_hook(count)
        loss = _loss(suite, "AutoModel", model(**suite.inputs_for("AutoModel")))
        phase[0] = "backward"
        loss.backward()
        assert calls["forward"] > 0 and calls["backward"] == calls["forward"], (arch, overrides, calls)


def _registered_classes(model_type: str) -> list[type]:
    return [cls for task, cls in REGISTRY[model_type][1].items() if task != "AutoImageProcessor"]


def _model_type(arch: str) -> str:
    return SUITES[arch].config_class.model_type


@pytest.mark.parametrize("arch", list(SUITES))
def test_every_class_keeps_transformers_checkpointing_contract(arch):
    """Every registered class (heads and base model): if it says ``supports_gradient_checkpointing``, a
    ``GradientCheckpointingLayer`` is among its modules and ``gradient_checkpointing_enable()`` / ``_disable()`` turn
    every module's ``gradient_checkpointing`` flag on and off; if it does not, enabling fails with a ``ValueError``
    that gives the reason, through each entry point transformers offers."""
    suite = _suite(arch)
    config = suite.make_config()
    for cls in _registered_classes(_model_type(arch)):
        torch.manual_seed(0)
        model = cls(config)
        if arch in DECLINING:
            assert not cls.supports_gradient_checkpointing, cls.__name__
            entry_points = ["gradient_checkpointing_enable", "activation_checkpointing_enable"]
            for name in [n for n in entry_points if hasattr(model, n)]:
                with pytest.raises(ValueError, match="reversible layers already recompute"):
                    getattr(model, name)()
            assert not model.is_gradient_checkpointing
            continue
        assert cls.supports_gradient_checkpointing, cls.__name__
        assert any(isinstance(m, GradientCheckpointingLayer) for m in model.modules()), cls.__name__
        for enable in (True, False):
            model.gradient_checkpointing_enable() if enable else model.gradient_checkpointing_disable()
            assert model.is_gradient_checkpointing is enable, cls.__name__
            flags = {
                n: m.gradient_checkpointing for n, m in model.named_modules() if hasattr(m, "gradient_checkpointing")
            }
            assert flags and all(v is enable for v in flags.values()), (cls.__name__, enable, flags)


@pytest.mark.parametrize("arch", CHECKPOINTING)
def test_every_head_trains_through_the_checkpointed_layers(arch):
    """A training step of every head (labels given) with checkpointing on runs the first
    ``GradientCheckpointingLayer`` through its checkpoint function, and that function runs the layer's forward more
    than once (forward, then recomputed in the backward pass), as transformers' ``test_training_gradient_checkpointing``
    checks; the loss has gradients everywhere the run without checkpointing has them."""
    suite = _suite(arch)
    for auto_name in [name for name in suite.heads if name != "AutoModel"]:
        inputs = suite.inputs_for(auto_name)
        model = suite.make_model(auto_name).train()
        _loss(suite, auto_name, model(**inputs)).backward()
        nonzero = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_enable()
        layer = next(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
        checkpoint, forward_runs = layer._gradient_checkpointing_func, []

        def counting_checkpoint(forward, *args, checkpoint=checkpoint, forward_runs=forward_runs, **kwargs):
            def counted(*a, **k):
                forward_runs.append(1)
                return forward(*a, **k)

            return checkpoint(counted, *args, **kwargs)

        layer._gradient_checkpointing_func = counting_checkpoint
        _loss(suite, auto_name, model(**inputs)).backward()
        assert len(forward_runs) > 1, (arch, auto_name, forward_runs)
        checkpointed = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert checkpointed == nonzero, (arch, auto_name, checkpointed ^ nonzero)
