"""Loads exported checkpoints in a process where ``hf_xformers`` cannot be imported (run by tests/test_export.py).

Usage: ``python -I tests/remote_code_check.py MANIFEST.json REPORT.json``. ``-I`` keeps the current folder and
``PYTHONPATH`` off ``sys.path``; the editable install would still find the package, so a meta-path finder refuses
every ``hf_xformers`` import. The manifest lists cases; each is loaded with its Auto class, run on saved inputs, and
its outputs saved (the test compares them with the original model's). Failures are recorded per case with their
traceback, so one broken head does not hide the others.

Case keys: ``name``, ``dir``, ``auto`` (an Auto class name), ``trust`` (``trust_remote_code``), and optionally
``inputs``/``outputs`` (safetensors files), ``tokenizer`` (text to encode with ``AutoTokenizer``), ``image``
(``.npy`` file for ``AutoImageProcessor``), ``pipeline`` (``{"task": ..., "inputs": ..., "kwargs": {...}}``).
"""

from __future__ import annotations

import importlib.abc
import json
import sys
import traceback

BLOCKED = "hf_xformers"


class BlockPackage(importlib.abc.MetaPathFinder):
    """Refuses to import :data:`BLOCKED` (and its submodules), wherever it is installed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == BLOCKED or fullname.startswith(BLOCKED + "."):
            raise ImportError(f"{fullname} is blocked in this process (checking self-contained checkpoints)")
        return None


def flatten_outputs(output, prefix: str = "out") -> dict:
    """Every tensor of a model output (a ``ModelOutput``, tuple or tensor), keyed by its path; other objects
    (caches) are skipped."""
    import torch

    if isinstance(output, torch.Tensor):
        return {prefix: output.detach().contiguous()}
    if hasattr(output, "keys") and hasattr(output, "__getitem__"):
        items = [(str(key), output[key]) for key in output.keys()]
    elif isinstance(output, (tuple, list)):
        items = [(str(i), value) for i, value in enumerate(output)]
    else:
        return {}
    flat = {}
    for key, value in items:
        flat.update(flatten_outputs(value, f"{prefix}.{key}"))
    return flat


def jsonable(value):
    """Pipeline results as plain JSON (numpy scalars -> floats)."""
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def run_case(case: dict) -> dict:
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    result = {}
    if "auto" in case:
        load = getattr(transformers, case["auto"]).from_pretrained
        if case["auto"] == "AutoBackbone":
            # transformers 5.23's AutoBackbone.from_pretrained first asks the Hub whether the path is a repo, which
            # a local folder fails; what follows that check is the generic Auto-class loading (auto_map, trust).
            from transformers.models.auto.auto_factory import _BaseAutoBackboneClass

            load = super(_BaseAutoBackboneClass, transformers.AutoBackbone).from_pretrained
        model = load(case["dir"], trust_remote_code=case["trust"])  # a model, or AutoConfig's config
        model = model.eval() if hasattr(model, "eval") else model
        result["class"] = f"{type(model).__module__}.{type(model).__name__}"
        if "inputs" in case:
            with torch.no_grad():
                output = model(**load_file(case["inputs"]))
            save_file(flatten_outputs(output), case["outputs"])
    if "tokenizer" in case:
        tokenizer = transformers.AutoTokenizer.from_pretrained(case["dir"], trust_remote_code=case["trust"])
        result["tokens"] = tokenizer(case["tokenizer"])["input_ids"]
    if "image" in case:
        processor = transformers.AutoImageProcessor.from_pretrained(case["dir"], trust_remote_code=case["trust"])
        result["processor_class"] = f"{type(processor).__module__}.{type(processor).__name__}"
        pixels = processor(np.load(case["image"]), return_tensors="pt")["pixel_values"]
        save_file({"pixel_values": pixels.contiguous()}, case["pixels"])
    if "pipeline" in case:
        spec = case["pipeline"]
        inputs = spec["inputs"]
        if spec["task"] == "image-classification":
            from PIL import Image

            inputs = Image.fromarray(np.load(inputs))
        pipe = transformers.pipeline(spec["task"], model=case["dir"], trust_remote_code=case["trust"])
        result["pipeline"] = jsonable(pipe(inputs, **spec.get("kwargs", {})))
    return result


def main(manifest_path: str, report_path: str) -> None:
    sys.meta_path.insert(0, BlockPackage())
    import torch

    torch.set_num_threads(1)  # the test computes the expected outputs on one thread too: identical, not close
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    report = {"cases": {}}
    try:
        import hf_xformers  # noqa: F401

        report["package_importable"] = True
    except ImportError:
        report["package_importable"] = False
    for case in manifest["cases"]:
        try:
            report["cases"][case["name"]] = {"ok": True, **run_case(case)}
        except Exception as error:  # recorded for the test to report, with the exception's type and message
            report["cases"][case["name"]] = {
                "ok": False,
                "error_type": type(error).__name__,
                "error": str(error),
                "traceback": traceback.format_exc(),
            }
    report["package_in_sys_modules"] = any(name.split(".")[0] == BLOCKED for name in sys.modules)
    with open(report_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
