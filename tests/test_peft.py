"""PEFT for every architecture (issue 24): peft's configs find our attention projections without ``target_modules``.

For each model type in the registry, on its classification head (text: ``task_type="SEQ_CLS"``; Swin's image
classification, which peft has no task type for: the generic ``PeftModel`` with the classifier in
``modules_to_save``): LoRA adapts exactly the modules ``hf_xformers.peft_support`` names, a fine-tuning step changes
only adapter and head weights, and the adapter saved with ``save_pretrained`` and loaded with
``PeftModel.from_pretrained`` onto a fresh base model gives the fine-tuned outputs. IA3's defaults are checked too.
"""

from __future__ import annotations

import sys

import pytest
import torch

peft = pytest.importorskip("peft")

import hf_xformers as H  # noqa: E402
from hf_xformers import peft_support  # noqa: E402
from tests import (  # noqa: E402
    test_bigbird,
    test_linformer,
    test_longformer,
    test_performer,
    test_reformer,
    test_swin,
    test_transfo_xl,
    test_universal,
)

# The conformance suite of each model type: its tiny config and its inputs.
SUITES = {
    "hfx-longformer": test_longformer.TestLongformerConformance,
    "hfx-bigbird": test_bigbird.TestBigBirdConformance,
    "hfx-linformer": test_linformer.TestLinformerConformance,
    "hfx-performer": test_performer.TestPerformerConformance,
    "hfx-reformer": test_reformer.TestReformerConformance,
    "hfx-transfo-xl": test_transfo_xl.TestTransfoXLConformance,
    "hfx-universal": test_universal.TestUniversalConformance,
    "hfx-swin": test_swin.TestSwinConformance,
}
MODEL_TYPES = sorted(H.REGISTRY)
IMAGE_HEAD = "AutoModelForImageClassification"
TEXT_HEAD = "AutoModelForSequenceClassification"


def suite_for(model_type: str):
    suite = SUITES[model_type]()
    suite.device = torch.device("cpu")  # set by a fixture inside the conformance classes
    return suite


def head_of(model_type: str) -> str:
    return IMAGE_HEAD if IMAGE_HEAD in H.REGISTRY[model_type][1] else TEXT_HEAD


def base_model(model_type: str) -> torch.nn.Module:
    """The classification model, the same weights on every call."""
    torch.manual_seed(0)
    suite = suite_for(model_type)
    return H.REGISTRY[model_type][1][head_of(model_type)](suite.make_config())


def inputs(model_type: str) -> dict:
    """Inputs with labels for the classification head (batch of 2)."""
    return suite_for(model_type).inputs_for(head_of(model_type))


def lora_config() -> peft.LoraConfig:
    """No ``target_modules``: peft takes them from its table for the model type."""
    return peft.LoraConfig(task_type="SEQ_CLS", r=4)


def peft_model(model_type: str, config) -> peft.PeftModel:
    if head_of(model_type) == IMAGE_HEAD:
        # peft's task types are all for text; an image classifier is a plain PeftModel whose head trains in full.
        config.task_type = None
        config.modules_to_save = ["classifier"]
    return peft.get_peft_model(base_model(model_type), config)


def used_linears(model_type: str) -> set[str]:
    """Paths of the ``nn.Linear`` modules of the plain model whose weights get a gradient from the loss: the ones
    whose output matters (Longformer's last layer, for instance, feeds the classifier's global first token through
    its global projections only)."""
    model = base_model(model_type).train()
    model(**inputs(model_type)).loss.backward()
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module.weight.grad is not None and module.weight.grad.any()
    }


def adapter_params(model: peft.PeftModel, marker: str) -> dict[str, str]:
    """Adapter parameter name -> path of the module it adapts in the plain model (``marker``: "lora_B", "ia3_l")."""
    prefix = "base_model.model."
    return {
        name: name.removeprefix(prefix).split(f".{marker}.")[0]
        for name, _ in model.named_parameters()
        if f".{marker}." in name
    }


def adapted_modules(model: torch.nn.Module, marker: str) -> set[str]:
    """The last name of every module that holds an adapter (``marker``: "lora_A" for LoRA, "ia3_l" for IA3)."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, marker)}


def test_every_model_type_has_peft_defaults():
    """A new architecture in the registry must get its rows too."""
    for table in (peft_support.LORA_TARGET_MODULES, peft_support.IA3_TARGET_MODULES, peft_support.IA3_FEEDFORWARD_MODULES):
        assert set(table) == set(H.REGISTRY)


def test_registration_without_peft_is_a_no_op(monkeypatch):
    """hf_xformers does not depend on peft: without it the registration reports False instead of failing."""
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft...` raise ImportError
    monkeypatch.setitem(sys.modules, "peft.utils", None)
    assert peft_support.register_with_peft() is False


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_without_target_modules_adapts_the_attention_projections(model_type):
    model = peft_model(model_type, lora_config())
    assert adapted_modules(model, "lora_A") == set(peft_support.LORA_TARGET_MODULES[model_type])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_ia3_without_target_modules(model_type):
    config = peft.IA3Config(task_type="SEQ_CLS")
    model = peft_model(model_type, config)
    expected = {name.rsplit(".", 1)[-1] for name in peft_support.IA3_TARGET_MODULES[model_type]}
    assert adapted_modules(model, "ia3_l") == expected
    # Every scale on a module that matters gets a gradient: none is bypassed by a computation that reads the
    # projection's weight instead of calling the module.
    model(**inputs(model_type)).loss.backward()
    grads = dict(model.named_parameters())
    expected = {name for name, path in adapter_params(model, "ia3_l").items() if path in used_linears(model_type)}
    assert expected
    bypassed = {name for name in expected if grads[name].grad is None or not grads[name].grad.any()}
    assert not bypassed, sorted(bypassed)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_fine_tune_save_and_reload(model_type, tmp_path):
    """Two optimiser steps change only LoRA and head weights; the saved adapter on a fresh base model gives the
    fine-tuned model's outputs exactly (and differs from the base model's)."""
    model = peft_model(model_type, lora_config())
    batch = inputs(model_type)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(2):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed, "nothing trained"
    assert all("lora_" in name or "modules_to_save" in name for name in changed), sorted(changed)
    # Every adapter on a module that matters trained: none is bypassed by a computation that reads the projection's
    # weight instead of calling the module.
    used = used_linears(model_type)
    expected = {name for name, path in adapter_params(model, "lora_B").items() if path in used}
    assert expected and expected <= changed, sorted(expected - changed)

    model.eval()
    features = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        expected = model(**features).logits
    model.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(base_model(model_type), tmp_path).eval()
    with torch.no_grad():
        got = reloaded(**features).logits
        untuned = base_model(model_type).eval()(**features).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(untuned, expected)


def test_reformer_cached_decoding_calls_lora_adapted_projections():
    """Reformer's cached LSH decoding projects the picked keys per head from the weights; with LoRA on ``query_key``
    and ``value`` it must call the adapted modules: the LoRA model generates the merged model's tokens, with and
    without the cache, and the adapters change them."""
    from tests.test_generation import _model, _prompt

    model = _model("hfx-reformer", H.HfxReformerForCausalLM)
    lora = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=32))
    with torch.no_grad():  # LoRA starts as a no-op (B = 0): make the adapters change the projections
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    lora.eval()
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=None)
    prompt = _prompt(length=12)  # longer than an LSH chunk: cached steps go through the picked-window path
    cached = lora.generate(input_ids=prompt, **kwargs)
    uncached = lora.generate(input_ids=prompt, use_cache=False, **kwargs)
    merged = lora.merge_and_unload()  # plain Linears again: the fused weight paths
    assert torch.equal(cached, merged.generate(prompt, **kwargs))
    assert torch.equal(uncached, merged.generate(prompt, use_cache=False, **kwargs))
    assert not torch.equal(cached, _model("hfx-reformer", H.HfxReformerForCausalLM).generate(prompt, **kwargs))
