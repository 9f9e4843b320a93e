"""Activation (gradient) checkpointing with every architecture: ``model.gradient_checkpointing_enable()`` and then a
training step gives the gradients of the same step without checkpointing, for the base model and every head of all
eight architectures, with dropout on (the recomputation must draw the same masks) and off.

The tiny configurations, heads and inputs are those of each architecture's conformance suite
(``tests/conformance.py``, ``tests/conformance_vision.py``); the suites' own checkpointing test covers one head
without dropout.
"""

from __future__ import annotations

import pytest
import torch

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
# Per architecture, config overrides to run besides the suite's own: Reformer's plain (not reversible) stack, the one
# that checkpointing changes there (its reversible stack recomputes the layers in the backward pass anyway).
VARIANTS = {arch: [{}] for arch in SUITES} | {"reformer": [{}, {"reversible": False}]}


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


@pytest.mark.parametrize("arch", list(SUITES))
def test_checkpointed_training_step_gives_the_same_gradients(arch):
    """Every head (base model included), dropout on: the recomputed forward draws the same masks. transformers'
    default (non-reentrant) checkpoint for every head, the reentrant one (which older recipes and Trainer's
    ``gradient_checkpointing_kwargs`` still ask for) for the base model."""
    suite = _suite(arch)
    assert len(suite.heads) >= 2, arch  # the base model and at least one head
    for overrides in VARIANTS[arch]:
        overrides = {**suite.dropout_config, **overrides}
        for auto_name in suite.heads:
            plain = _gradients(suite, auto_name, overrides, False)
            _assert_same(plain, _gradients(suite, auto_name, overrides, True), f"{auto_name} {overrides}")
        plain = _gradients(suite, "AutoModel", overrides, False)
        reentrant = _gradients(suite, "AutoModel", overrides, True, {"use_reentrant": True})
        _assert_same(plain, reentrant, f"AutoModel, reentrant, {overrides}")


@pytest.mark.parametrize("arch", list(SUITES))
def test_checkpointing_recomputes_the_layers(arch):
    """Checkpointing really is on: the attention modules run their forward again during the backward pass (a flag
    that is set but never read would pass the gradient test trivially)."""
    suite = _suite(arch)
    for overrides in VARIANTS[arch]:
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
