"""Make the Transformer-XL reference fixture (tests/fixtures/transfo_xl/) with transformers 4.37.2.

Transformer-XL was removed from transformers 5; 4.37.2 is the last release whose ``TransfoXLLMHeadModel``
runs with torch 2.13. This script runs in its own virtual environment, outside the repository::

    python3 -m venv /tmp/tfxl && /tmp/tfxl/bin/pip install torch==2.13.0 transformers==4.37.2 sacremoses
    /tmp/tfxl/bin/python scripts/make_transfo_xl_fixture.py

It builds a tiny, seeded ``TransfoXLLMHeadModel`` (adaptive input and softmax with ``div_val`` 2, memories,
``clamp_len`` and ``same_length`` active), runs two consecutive segments, and writes:

* ``config.json`` and ``pytorch_model.bin``: ``save_pretrained`` output, the layout of the Hub checkpoints
  (``transfo-xl-wt103``), read by ``hfx-import``;
* ``expected.safetensors``: the inputs and, for each segment ``s`` in (1, 2), the log-probabilities
  ``logits_s`` (batch, len, vocab), per-token losses ``losses_s`` (batch, len - 1), ``loss_s``, and the
  memories ``mems_s_<layer>`` it returns, in 4.x's layout (mem_len, batch, d_model).

The first segment runs with ``mems=None``: 4.x then attends to ``mem_len`` zero vectors (its initial memory).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import TransfoXLConfig, TransfoXLLMHeadModel

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "transfo_xl"
BATCH, SEG_LEN = 2, 5


def main() -> None:
    if transformers.__version__ != "4.37.2":
        sys.exit(f"needs transformers 4.37.2, found {transformers.__version__}")
    torch.manual_seed(0)
    config = TransfoXLConfig(
        vocab_size=40, cutoffs=[10, 20], d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=32, div_val=2,
        n_layer=2, mem_len=6, clamp_len=5, same_length=True, dropout=0.0, dropatt=0.0, eos_token_id=0,
    )  # fmt: skip
    model = TransfoXLLMHeadModel(config).eval()
    with torch.no_grad():
        # The initialisation leaves LayerNorm biases at zero and LayerNorm weights near one; perturb every
        # tensor so that each one matters to the outputs.
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))

    ids = torch.randint(0, config.vocab_size, (BATCH, 2 * SEG_LEN))
    labels = ids.clone()
    labels[1, 3] = -100  # an ignored target
    tensors = {"input_ids": ids, "labels": labels}
    mems = None
    with torch.no_grad():
        for s in (1, 2):
            seg = slice((s - 1) * SEG_LEN, s * SEG_LEN)
            with_loss = model(input_ids=ids[:, seg], labels=labels[:, seg].clone(), mems=mems)
            out = model(input_ids=ids[:, seg], mems=mems)
            tensors[f"logits_{s}"] = out.prediction_scores
            tensors[f"losses_{s}"] = with_loss.losses
            tensors[f"loss_{s}"] = with_loss.loss
            for layer, mem in enumerate(out.mems):
                tensors[f"mems_{s}_{layer}"] = mem
            mems = out.mems

    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=False)
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT / "expected.safetensors")
    print(f"wrote {OUT}: loss_1={tensors['loss_1'].item():.6f} loss_2={tensors['loss_2'].item():.6f}")


if __name__ == "__main__":
    main()
