"""The common model API across every registered architecture: explicit forward signatures and the v5 loss keywords
of causal language models (``labels``, ``shift_labels``, ``num_items_in_batch``)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import hf_xformers
from hf_xformers.registration import REGISTRY
from tests import test_reformer, test_transfo_xl, test_universal
from tests.conformance import _TINY, _ids

MODEL_CLASSES = [
    (model_type, auto_name, cls)
    for model_type, (_, heads) in REGISTRY.items()
    for auto_name, cls in heads.items()
    if auto_name != "AutoImageProcessor"
]


@pytest.mark.parametrize("model_type,auto_name,cls", MODEL_CLASSES, ids=[f"{m}-{a}" for m, a, _ in MODEL_CLASSES])
def test_forward_signature_is_explicit(model_type, auto_name, cls):
    """Trainer keeps only the dataset columns named in forward's signature, and pipelines / generate look up
    ``main_input_name`` there: ``*args`` / ``**kwargs`` hide the inputs. The one exception is the packed batch's
    keywords in FlashAttention's form, ``**kwargs: Unpack[CuSeqLensKwargs]`` (transformers' own models take them the
    same way), which the collator adds after Trainer has chosen the columns; ``seq_idx`` is named, so that Trainer
    keeps a pre-packed dataset's column (issue 51)."""
    params = inspect.signature(cls.forward).parameters
    hidden = [
        name
        for name, p in params.items()
        if p.kind is p.VAR_POSITIONAL or (p.kind is p.VAR_KEYWORD and "PackedBatchKwargs" not in str(p.annotation)
                                           and "CuSeqLensKwargs" not in str(p.annotation))
    ]  # fmt: skip
    assert not hidden, f"{cls.__name__}.forward takes {hidden}"
    if model_type != "hfx-swin" and auto_name != "AutoModelForSeq2SeqLM":  # the seq2seq model refuses packed batches
        assert params["seq_idx"].kind is inspect.Parameter.KEYWORD_ONLY, f"{cls.__name__}.forward does not name seq_idx"
    assert cls.main_input_name in params


def _causal_lms():
    return {
        "performer": hf_xformers.HfxPerformerForCausalLM(
            hf_xformers.HfxPerformerConfig(**_TINY, num_random_features=16)
        ),
        "reformer": hf_xformers.HfxReformerForCausalLM(test_reformer.configs(is_decoder=True)[1]),
        "transfo_xl": hf_xformers.HfxTransfoXLForCausalLM(test_transfo_xl.tiny()),
        "universal": hf_xformers.HfxUniversalForCausalLM(test_universal.config()),
    }


@pytest.mark.parametrize("name", ["performer", "reformer", "transfo_xl", "universal"])
def test_causal_lm_loss_keywords(name):
    torch.manual_seed(0)
    model = _causal_lms()[name].eval()
    ids = _ids(2, 12)
    labels = ids.clone()
    labels[0, 4:7] = -100
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    with torch.no_grad():
        plain = model(input_ids=ids, labels=labels)
        # ponder losses (Universal Transformer) are added to the task loss: compare the task part
        extra = getattr(plain, "ponder_loss", None)
        extra = 0.0 if extra is None else extra
        from_shift = model(input_ids=ids, shift_labels=shifted)
        both = model(input_ids=ids, labels=torch.zeros_like(labels), shift_labels=shifted)  # shift_labels win
        counted = (shifted != -100).sum()
        summed = model(input_ids=ids, labels=labels, num_items_in_batch=counted * 2)
        ignored = model(input_ids=ids, labels=torch.full_like(labels, -100))
    if name == "transfo_xl":  # scores n - 1 positions from labels; shift_labels here has a -100 in the last place
        assert torch.isfinite(from_shift.loss)
    else:
        torch.testing.assert_close(from_shift.loss, plain.loss)
    torch.testing.assert_close(both.loss, from_shift.loss)
    torch.testing.assert_close(summed.loss - extra, (plain.loss - extra) / 2)
    assert (ignored.loss - extra).item() == 0.0


@pytest.mark.parametrize("name", ["longformer", "performer", "reformer", "transfo_xl", "universal"])
def test_misspelt_packing_keyword_is_refused(name):
    """``**kwargs`` take the packed batch's keywords only (``CuSeqLensKwargs``): any other name is a TypeError that
    names it, as Python's own for a forward without ``**kwargs``, not silently ignored; the right names pass."""
    if name == "longformer":
        config = hf_xformers.HfxLongformerConfig(**_TINY, attention_window=4)
        models = [hf_xformers.HfxLongformerModel(config), hf_xformers.HfxLongformerForSequenceClassification(config)]
    else:
        models = [_causal_lms()[name]]
    ids = _ids(1, 8)
    for model in models:
        with pytest.raises(TypeError, match="unexpected keyword argument 'seq_id'"):
            model(input_ids=ids, seq_id=torch.zeros_like(ids))
        if name != "transfo_xl":  # it refuses packed batches
            with torch.no_grad():
                model.eval()(input_ids=ids, seq_idx=torch.zeros_like(ids), max_length_q=8)
