"""End to end: ``Trainer(bf16=True)`` on the CPU trains every text architecture in mixed precision.

The conformance suites check each head under ``torch.autocast`` directly; this checks the way users turn it on.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from . import (
    test_bigbird,
    test_linformer,
    test_longformer,
    test_performer,
    test_reformer,
    test_transfo_xl,
    test_universal,
)
from .conformance import SEQ_LEN, _ids

# The tiny configs of the conformance suites (modules imported, not their classes, so pytest does not collect the
# suites a second time here).
SUITES = {
    "longformer": test_longformer.TestLongformerConformance,
    "bigbird": test_bigbird.TestBigBirdConformance,
    "linformer": test_linformer.TestLinformerConformance,
    "performer": test_performer.TestPerformerConformance,
    "reformer": test_reformer.TestReformerConformance,
    "transfo_xl": test_transfo_xl.TestTransfoXLConformance,
    "universal": test_universal.TestUniversalConformance,
}


@pytest.mark.parametrize("arch", sorted(SUITES))
def test_trainer_bf16_trains_on_cpu(arch, tmp_path):
    suite = SUITES[arch]()
    model = suite.heads["AutoModelForSequenceClassification"](suite.make_config(**suite.dropout_config))
    ids = _ids(8, SEQ_LEN, seed=7)
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long), "labels": i % 3} for i in range(8)]
    before = copy.deepcopy(model.state_dict())
    # What the model computes in: the output dtype of every Linear during training.
    dtypes = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, args, out: dtypes.add(out.dtype) if m.training else None)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, bf16=True,
        use_cpu=True, report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    result = Trainer(model=model, args=args, train_dataset=rows).train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)
    assert dtypes == {torch.bfloat16}, dtypes  # autocast was on for every projection
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, before[n])]
    assert any("classifier" in n for n in changed) and len(changed) > len(before) // 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
