"""Every registered architecture trains under FSDP in two CPU processes (gloo), sharded by its ``_no_split_modules``.

One ``torchrun`` launch of ``tests/fsdp_worker.py`` runs all of them (starting processes costs more than training the
tiny models); each architecture is then checked on its own:

- the losses of three SGD steps, each rank on half of the global batch, equal those of a single-process run on the
  whole batch (same initial weights and data) to 1e-5 relative; so do the trained weights (absolute);
- the full state dict gathered from the shards, saved with ``save_pretrained``, loads with ``from_pretrained`` (no
  missing or unexpected keys) into a model whose outputs equal the sharded model's outputs exactly.

accelerate does not shard on the CPU (see the worker's docstring), so the worker calls ``fully_shard`` itself;
``test_accelerate_still_refuses_cpu_fsdp`` notices when that changes, and Trainer could be used instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_xformers.registration import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
LOGITS_RTOL = 1e-5

# Linformer: the base model decides once per forward which layers need a mask of supported projected positions by
# reading every layer's projections (E, F) before the layers run; under FSDP those are still shards then (it failed
# with "RuntimeError: .tolist() is not supported for tensor subclasses, got DTensor"), so with sharded projections
# each layer decides inside its own forward. "layerwise" sharing keeps the projection in the base model's root unit.
CASES = [*REGISTRY, "hfx-linformer-layerwise"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp") / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "tests.fsdp_worker", str(out),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as error:  # a collective that never pairs up hangs rather than fails
        pytest.fail(f"FSDP workers did not finish within 300 s; output:\n{(error.stdout or b'')[-4000:]!r}")
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("model_type", CASES)
def test_fsdp_training_matches_one_process_and_saves_a_full_checkpoint(results, model_type):
    result = results[model_type]
    assert "error" not in result, result.get("error")
    # Sharded by the layer class the model names, and nothing left unsharded.
    assert result["unit_count"] >= 1, f"no module of the classes {result['units']} (_no_split_modules)"
    assert result["all_parameters_sharded"]
    # Training moved the weights far more than the tolerance: otherwise the comparisons would prove nothing.
    assert result["weights_max_abs_change_in_training"] > 100 * WEIGHT_ATOL
    losses, reference = result["fsdp_losses"], result["reference_losses"]
    assert result["loss_max_rel_diff"] <= LOSS_RTOL, (losses, reference)
    assert result["weights_max_abs_diff_vs_reference"] <= WEIGHT_ATOL
    # The checkpoint: every key of the model, all of them loaded, and the same function as the sharded model.
    assert result["state_dict_matches_model"]
    assert result["loading_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert result["loaded_vs_fsdp_max_abs_diff"] == 0.0
    assert result["fsdp_vs_reference_logits_max_rel_diff"] <= LOGITS_RTOL


def test_accelerate_still_refuses_cpu_fsdp(results):
    # If this fails, accelerate shards on the CPU now: the worker can train through Trainer(fsdp=...) instead.
    assert results["accelerate_shards_on_cpu"] is False
