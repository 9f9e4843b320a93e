"""Self-contained Hub checkpoints (hf_xformers.export).

The main test exports a tiny model of every head of every ``model_type`` in the registration table, then loads each
in a fresh process that refuses ``import hf_xformers`` (tests/remote_code_check.py), with ``trust_remote_code=True``,
and checks that its outputs are identical to the original's (and the pipeline's, for text classification, fill-mask
and image classification). One process per model type checks all its heads. Nothing reaches the network.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForSequenceClassification,
    RobertaConfig,
    RobertaModel,
    pipeline,
)

import hf_xformers
from hf_xformers import export
from hf_xformers.export import HEADER_MARKER, export_for_hub, exported_modules
from hf_xformers.registration import REGISTRY
from tests.remote_code_check import flatten_outputs
from tests.tiny_tokenizers import roberta_tokenizer

CHILD = Path(__file__).resolve().parent / "remote_code_check.py"
SEQ_LEN = 20
TEXT = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
)  # fmt: skip
# Tiny configs (hidden <= 32, 2 layers), small enough windows / blocks / chunks that the efficient paths run.
CONFIGS = {
    "hfx-longformer": dict(TEXT, attention_window=4, type_vocab_size=1),
    "hfx-bigbird": dict(TEXT, block_size=4, num_random_blocks=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        sep_token_id=2),  # fmt: skip
    "hfx-linformer": dict(TEXT, linformer_k=16, type_vocab_size=1),
    "hfx-performer": dict(TEXT, num_random_features=32, type_vocab_size=1),
    "hfx-reformer": dict(
        hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37, attn_layers=["local", "lsh"],
        local_attn_chunk_length=4, lsh_attn_chunk_length=8, num_buckets=4, axial_pos_shape=[8, 8],
        axial_pos_embds_dim=[16, 16], max_position_embeddings=64, pad_token_id=1, eos_token_id=None, hash_seed=3,
        hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
        num_labels=3,
    ),  # fmt: skip
    "hfx-transfo-xl": dict(cutoffs=[20, 50], d_model=32, n_head=4, d_inner=37, n_layer=2, div_val=2, mem_len=8,
                           dropout=0.0, dropatt=0.0, num_labels=3),  # fmt: skip
    "hfx-universal": dict(TEXT, act_max_steps=2),
    "hfx-swin": dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                     encoder_stride=4, drop_path_rate=0.0, num_labels=3),  # fmt: skip
}
VISION = {"hfx-swin"}
PIPELINES = {
    "AutoModelForSequenceClassification": {"task": "text-classification", "inputs": "the quick brown fox",
                                           "kwargs": {"top_k": None}},  # fmt: skip
    "AutoModelForMaskedLM": {"task": "fill-mask", "inputs": "the quick <mask> fox jumps", "kwargs": {"top_k": 3}},
    "AutoModelForImageClassification": {"task": "image-classification", "kwargs": {"top_k": 3}},
}


def model_heads(model_type: str) -> dict[str, type]:
    """The model classes of ``model_type`` in the registration table (its image processor left out)."""
    return {name: cls for name, cls in REGISTRY[model_type][1].items() if name != "AutoImageProcessor"}


@pytest.fixture(scope="module")
def tokenizer():
    return roberta_tokenizer()


@pytest.fixture(scope="module")
def child_env(tmp_path_factory) -> dict:
    """Environment of the checking process: offline, one thread, dynamic modules in a scratch folder."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path_factory.mktemp("hf_modules")),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


@contextlib.contextmanager
def one_thread():
    """The checking process runs on one thread; the expected outputs are computed the same way, so they can be
    compared for equality (a different thread count may change the last bits of a reduction)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_child(cases: list[dict], scratch: Path, env: dict) -> dict:
    """Run tests/remote_code_check.py on ``cases`` in a fresh process (cwd outside the repository) and return its
    report."""
    manifest, report = scratch / "manifest.json", scratch / "report.json"
    manifest.write_text(json.dumps({"cases": cases}))
    done = subprocess.run(
        [sys.executable, "-I", str(CHILD), str(manifest), str(report)],
        cwd=scratch, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())


def build_model(model_type: str, auto_name: str):
    config_class, _ = REGISTRY[model_type]
    kwargs = dict(CONFIGS[model_type])
    if model_type not in VISION:
        kwargs["vocab_size"] = len(roberta_tokenizer())
    torch.manual_seed(0)
    return model_heads(model_type)[auto_name](config_class(**kwargs)).eval()


def make_inputs(model_type: str, auto_name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if model_type in VISION:
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    ids = torch.randint(5, 250, (2, SEQ_LEN), generator=g)
    ids[:, 0], ids[:, -1] = 0, 2
    if auto_name == "AutoModelForMultipleChoice":
        ids = torch.stack([ids, ids.flip(-1)], dim=1)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if auto_name == "AutoModelForSeq2SeqLM":
        inputs["decoder_input_ids"] = ids[:, :6].clone()
    return inputs


def test_every_registered_architecture_is_covered():
    """A new model_type in the registration table needs a tiny config here, so its export is tested."""
    assert set(CONFIGS) == set(REGISTRY)


def prepare_model_type(model_type: str, root: Path, tokenizer, image: np.ndarray) -> tuple[list[dict], dict]:
    """Export every head of ``model_type`` under ``root``; return the child's cases and what each must give."""
    cases, expected = [], {"outputs": {}, "pipelines": {}}
    vision = model_type in VISION
    for auto_name in model_heads(model_type):
        folder, name = root / auto_name, f"{model_type}/{auto_name}"
        model = build_model(model_type, auto_name)
        processor = hf_xformers.HfxSwinImageProcessor(size={"height": 32, "width": 32}) if vision else tokenizer
        export_for_hub(model, folder, processor=processor)
        inputs = make_inputs(model_type, auto_name)
        save_file(inputs, root / f"{auto_name}.inputs.safetensors")
        with one_thread(), torch.no_grad():
            expected["outputs"][auto_name] = flatten_outputs(model(**inputs))
        case = {"name": name, "dir": str(folder), "auto": auto_name, "trust": True,
                "inputs": str(root / f"{auto_name}.inputs.safetensors"),
                "outputs": str(root / f"{auto_name}.outputs.safetensors")}  # fmt: skip
        if auto_name == "AutoModel":  # the processor once per model type
            if vision:
                case.update(image=str(root.parent / "image.npy"), pixels=str(root / "pixels.safetensors"))
            else:
                case["tokenizer"] = "hello world, a tiny corpus"
        if auto_name in PIPELINES:
            spec = dict(PIPELINES[auto_name])
            spec.setdefault("inputs", str(root.parent / "image.npy"))
            case["pipeline"] = spec
            with one_thread():
                pipe = pipeline(spec["task"], model=str(folder))  # the registered classes, in this process
                result = pipe(Image.fromarray(image) if vision else spec["inputs"], **spec["kwargs"])
            expected["pipelines"][auto_name] = json.loads(json.dumps(result, default=float))
        cases.append(case)
    # auto_map covers every registered head, not only the saved one: the base model's folder loads as the last head.
    other = list(model_heads(model_type))[-1]
    cases.append({"name": f"{model_type}/cross", "dir": str(root / "AutoModel"), "auto": other, "trust": True})
    return cases, expected


def prepare_refusals(root: Path, tokenizer) -> tuple[list[dict], dict]:
    """A plain checkpoint (no code) and a CLI-exported one (from a saved folder, with a generation config)."""
    model = build_model("hfx-universal", "AutoModelForCausalLM")
    model.generation_config.max_new_tokens = 7  # a non-default generation config is saved with the model
    model.save_pretrained(root / "plain")
    tokenizer.save_pretrained(root / "plain")
    export.main(["--source", str(root / "plain"), "--output", str(root / "exported")])
    inputs = make_inputs("hfx-universal", "AutoModelForCausalLM")
    save_file(inputs, root / "inputs.safetensors")
    with one_thread(), torch.no_grad():
        expected = flatten_outputs(model(**inputs))
    plain, exported, auto = str(root / "plain"), str(root / "exported"), "AutoModelForCausalLM"
    cases = [
        {"name": "refusal/plain", "dir": plain, "auto": auto, "trust": True},
        {"name": "refusal/plain_config", "dir": plain, "auto": "AutoConfig", "trust": True},
        {"name": "refusal/untrusted", "dir": exported, "auto": auto, "trust": False},
        {"name": "refusal/untrusted_config", "dir": exported, "auto": "AutoConfig", "trust": False},
        {"name": "refusal/trusted", "dir": exported, "auto": auto, "trust": True,
         "inputs": str(root / "inputs.safetensors"), "outputs": str(root / "outputs.safetensors")},
    ]  # fmt: skip
    return cases, {"outputs": expected}


@pytest.fixture(scope="module")
def remote(tmp_path_factory, tokenizer, child_env) -> dict:
    """Everything the package-free process checks, prepared here and run in ONE process (starting one costs
    several seconds of imports): ``{"root", "report", "image", "expected": {model_type or "refusal": ...}}``."""
    root = tmp_path_factory.mktemp("remote")
    image = np.random.default_rng(0).integers(0, 256, (40, 36, 3), dtype=np.uint8)
    np.save(root / "image.npy", image)
    cases, expected = [], {}
    for model_type in sorted(REGISTRY):
        more, expected[model_type] = prepare_model_type(model_type, root / model_type, tokenizer, image)
        cases += more
    (root / "refusal").mkdir()
    more, expected["refusal"] = prepare_refusals(root / "refusal", tokenizer)
    cases += more
    return {"root": root, "report": run_child(cases, root, child_env), "image": image, "expected": expected}


def test_the_checking_process_cannot_import_the_package(remote):
    assert remote["report"]["package_importable"] is False
    assert remote["report"]["package_in_sys_modules"] is False


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_exported_checkpoint_loads_without_the_package(model_type, remote, tokenizer):
    """Every head: loaded with trust_remote_code from the checkpoint's own code, identical outputs; the pipelines
    give identical results; the tokenizer or image processor loads too."""
    root, expected = remote["root"] / model_type, remote["expected"][model_type]
    results = {name.split("/")[1]: r for name, r in remote["report"]["cases"].items() if name.startswith(model_type + "/")}
    cross = results.pop("cross")
    assert cross["ok"], cross.get("traceback")
    assert cross["class"].startswith("transformers_modules.")
    assert cross["class"].endswith(model_heads(model_type)[list(model_heads(model_type))[-1]].__name__)
    assert set(results) == set(model_heads(model_type))
    for auto_name, result in results.items():
        assert result["ok"], f"{model_type} {auto_name}:\n{result['traceback']}"
        # The class came from the checkpoint's code, not from an installed package.
        assert result["class"].startswith("transformers_modules."), result["class"]
        got = load_file(root / f"{auto_name}.outputs.safetensors")
        assert set(got) == set(expected["outputs"][auto_name]), auto_name
        for key, tensor in expected["outputs"][auto_name].items():
            assert torch.equal(got[key], tensor), f"{model_type} {auto_name} {key} differs"
        if auto_name in PIPELINES:
            assert result["pipeline"] == expected["pipelines"][auto_name]
    base = results["AutoModel"]
    if model_type in VISION:
        assert base["processor_class"].startswith("transformers_modules.")
        assert base["processor_class"].endswith(".HfxSwinImageProcessor")
        processor = hf_xformers.HfxSwinImageProcessor(size={"height": 32, "width": 32})
        reference = processor(remote["image"], return_tensors="pt")["pixel_values"]
        assert torch.equal(load_file(root / "pixels.safetensors")["pixel_values"], reference)
    else:
        assert base["tokens"] == tokenizer("hello world, a tiny corpus")["input_ids"]


def test_without_code_or_without_trust_transformers_refuses(remote):
    """A plain checkpoint where the package is absent gives transformers' unknown-architecture error; an exported
    one loaded without trust_remote_code refuses to run its code. The folder exported by the CLI (from a saved
    folder rather than a model) loads with trust_remote_code and keeps its generation config."""
    report = {name.split("/")[1]: r for name, r in remote["report"]["cases"].items() if name.startswith("refusal/")}
    for name in ("plain", "plain_config"):
        assert not report[name]["ok"]
        assert report[name]["error_type"] == "ValueError", report[name]["traceback"]
        assert "hfx-universal" in report[name]["error"]
        assert "does not recognize this architecture" in report[name]["error"]
    for name in ("untrusted", "untrusted_config"):
        assert not report[name]["ok"]
        assert report[name]["error_type"] == "ValueError", report[name]["traceback"]
        assert "contains custom code which must be executed" in report[name]["error"]
        assert "trust_remote_code=True" in report[name]["error"]
    assert report["trusted"]["ok"], report["trusted"].get("traceback")
    root, expected = remote["root"] / "refusal", remote["expected"]["refusal"]["outputs"]
    got = load_file(root / "outputs.safetensors")
    assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    assert json.loads((root / "exported" / "generation_config.json").read_text())["max_new_tokens"] == 7


def test_with_the_package_imported_the_registered_classes_load_it(tmp_path):
    """Where hf_xformers is imported, an exported folder loads through the registered classes, with or without
    trust_remote_code, and the Swin processor too."""
    model = build_model("hfx-longformer", "AutoModelForSequenceClassification")
    export_for_hub(model, tmp_path / "lf")
    inputs = make_inputs("hfx-longformer", "AutoModelForSequenceClassification")
    for trust in (None, False, True):
        config = AutoConfig.from_pretrained(tmp_path / "lf", trust_remote_code=trust)
        assert type(config) is hf_xformers.HfxLongformerConfig
        loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lf", trust_remote_code=trust)
        assert type(loaded) is hf_xformers.HfxLongformerForSequenceClassification
        with torch.no_grad():
            assert torch.equal(loaded.eval()(**inputs).logits, model(**inputs).logits)
    swin = build_model("hfx-swin", "AutoModelForImageClassification")
    export_for_hub(swin, tmp_path / "swin", processor=hf_xformers.HfxSwinImageProcessor())
    for trust in (None, True):
        processor = AutoImageProcessor.from_pretrained(tmp_path / "swin", trust_remote_code=trust)
        assert type(processor) is hf_xformers.HfxSwinImageProcessor


def _defined_names(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}


@pytest.mark.parametrize("model_type", ["hfx-longformer", "hfx-swin"])
def test_only_the_needed_code_with_headers_and_a_full_auto_map(model_type, tmp_path):
    model = build_model(model_type, "AutoModel")
    out = export_for_hub(model, tmp_path / "out")
    files = exported_modules(out)
    assert files == sorted(p.name for p in out.glob("*.py"))
    # The closure of the architecture's classes, and nothing from the other architectures.
    classes = export.architecture_classes(model_type).values()
    needed = export.flat_names(export.required_modules(cls.__module__ for cls in classes))
    assert files == sorted(f"{name}.py" for name in needed.values())
    foreign = {"lsh.py", "modeling_reformer.py", "block_sparse.py", "favor.py", "relative_memory.py", "adaptive.py"}
    foreign |= {"sliding_window.py", "modeling_longformer.py"} if model_type == "hfx-swin" else {"shifted_window.py",
                                                                                              "modeling_swin.py"}  # fmt: skip
    assert not foreign & set(files)
    for name in files:
        text = (out / name).read_text()
        assert text.startswith(f"{HEADER_MARKER} {hf_xformers.__version__} (hf_xformers/")
        assert not re.search(r"^\s*(from|import)\s+hf_xformers", text, flags=re.MULTILINE), name
        assert not re.search(r"^\s*from\s+\.\.", text, flags=re.MULTILINE), name
        # Every relative import names a file of the folder (what transformers copies into its module cache).
        for target in re.findall(r"^\s*from\s+\.(\S+)\s+import", text, flags=re.MULTILINE):
            assert (out / f"{target}.py").is_file(), (name, target)
        ast.parse(text)
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert set(auto_map) == {"AutoConfig", *REGISTRY[model_type][1]}
    for reference in auto_map.values():
        module, cls = reference.split(".")
        assert cls in _defined_names(out / f"{module}.py"), reference
    if model_type == "hfx-swin":
        assert "AutoBackbone" in auto_map and "AutoImageProcessor" in auto_map


def test_swin_processor_is_found_through_the_config_auto_map(tmp_path, monkeypatch):
    """The processor file names no type and no auto_map (see export._write_code); config.json's auto_map does, and
    an image-classification pipeline where the package is imported asks no question about remote code."""
    model = build_model("hfx-swin", "AutoModelForImageClassification")
    out = export_for_hub(model, tmp_path / "out", processor=hf_xformers.HfxSwinImageProcessor())
    processor_config = json.loads((out / "preprocessor_config.json").read_text())
    assert "image_processor_type" not in processor_config and "auto_map" not in processor_config
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert auto_map["AutoImageProcessor"] == "image_processing_swin.HfxSwinImageProcessor"
    asked = []
    monkeypatch.setattr("builtins.input", lambda *args: asked.append(args) or "n")
    classifier = pipeline("image-classification", model=str(out))
    assert type(classifier.image_processor) is hf_xformers.HfxSwinImageProcessor
    assert type(classifier.model) is hf_xformers.HfxSwinForImageClassification
    assert asked == []


def test_folder_export_carries_files_and_replaces_an_earlier_export(tokenizer, tmp_path):
    """From a Trainer-like output folder: weights, tokenizer, card and results are carried over; optimizer state,
    checkpoint-* folders and an earlier export's modules are not. In place, the earlier export is replaced."""
    source = tmp_path / "run"
    model = build_model("hfx-bigbird", "AutoModelForMaskedLM")
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    (source / "README.md").write_text("---\nlicense: mit\n---\n# card\n")
    (source / "eval_results.json").write_text('{"eval_loss": 1.0}')
    (source / "optimizer.pt").write_bytes(b"state")
    (source / "checkpoint-2").mkdir()
    (source / "checkpoint-2" / "model.safetensors").write_bytes(b"x")
    (source / "old_module.py").write_text(f"{HEADER_MARKER} 0.0.1 (hf_xformers/old.py)\n")
    (source / "user_helper.py").write_text("VALUE = 1\n")
    weights = (source / "model.safetensors").read_bytes()

    out = export_for_hub(source, tmp_path / "hub")
    names = {p.name for p in out.iterdir()}
    assert {"README.md", "eval_results.json", "tokenizer.json", "tokenizer_config.json", "user_helper.py"} <= names
    assert not {"optimizer.pt", "checkpoint-2", "old_module.py"} & names
    assert (out / "model.safetensors").read_bytes() == weights

    export_for_hub(source, source)  # in place
    assert not (source / "old_module.py").exists() and (source / "user_helper.py").exists()
    assert (source / "model.safetensors").read_bytes() == weights
    assert exported_modules(source) == exported_modules(out)
    again = export_for_hub(source, source)  # exporting twice changes nothing
    assert exported_modules(again) == exported_modules(out)
    assert json.loads((source / "config.json").read_text())["auto_map"]["AutoModelForMaskedLM"] == (
        "modeling_bigbird.HfxBigBirdForMaskedLM"
    )


def test_pickle_weights_become_safetensors(tmp_path):
    model = build_model("hfx-linformer", "AutoModelForSequenceClassification")
    source = tmp_path / "bin"
    model.config.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="names no `architectures`"):
        export_for_hub(source, tmp_path / "unknown")
    model.config.architectures = [type(model).__name__]  # what save_pretrained records
    model.config.save_pretrained(source)
    inputs = make_inputs("hfx-linformer", "AutoModelForSequenceClassification")
    with torch.no_grad():
        expected = model(**inputs).logits
    for out in (tmp_path / "copy", source):  # to another folder, then in place
        export_for_hub(source, out)
        assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
        loaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
        with torch.no_grad():
            assert torch.equal(loaded(**inputs).logits, expected)


def test_bad_sources_and_outputs_say_what_to_do(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        export_for_hub(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ValueError, match="not a folder"):
        export_for_hub(tmp_path / "missing", tmp_path / "out")
    roberta = RobertaModel(RobertaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=8, vocab_size=30))  # fmt: skip
    roberta.save_pretrained(tmp_path / "roberta")
    with pytest.raises(ValueError, match=r"'roberta' is not an hf_xformers architecture.*hfx-longformer"):
        export_for_hub(tmp_path / "roberta", tmp_path / "out")
    with pytest.raises(ValueError, match="not an hf_xformers architecture"):
        export_for_hub(roberta, tmp_path / "out")
    model = build_model("hfx-longformer", "AutoModel")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty.*--overwrite"):
        export_for_hub(model, tmp_path / "busy")
    export_for_hub(model, tmp_path / "busy", overwrite=True)
    assert (tmp_path / "busy" / "modeling_longformer.py").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        export_for_hub(model, tmp_path / "file")
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="only applies to a model"):
        export_for_hub(tmp_path / "saved", tmp_path / "out2", processor=object())
    with pytest.raises(SystemExit):
        export.main(["--source", str(tmp_path / "empty"), "--output", str(tmp_path / "out3")])
    assert "no config.json" in capsys.readouterr().err


# ----- the import rewrite, on a fake package ----------------------------------------------------------------------


def _fake_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "hf_xformers"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [package, *[p for p in package.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    return package


def test_import_closure_and_rewrite_with_clashing_names(tmp_path, monkeypatch):
    package = _fake_package(tmp_path, {
        "a/user.py": (
            "from __future__ import annotations\n\nfrom typing import TYPE_CHECKING\n\nimport torch\n"
            "from hf_xformers.b.mod_x import B\nfrom .mod_x import (\n    A,\n    A2 as Alias,\n)\n\n"
            "if TYPE_CHECKING:\n    from ..b.helper import H  # only for annotations\n"
        ),
        "a/mod_x.py": "A = A2 = 1\n",
        "b/mod_x.py": "from .helper import H\nB = H\n",
        "b/helper.py": "H = 2\n",
        "b/unused.py": "U = 3\n",
    })  # fmt: skip
    monkeypatch.setattr(export, "PACKAGE_DIR", package)
    modules = export.required_modules(["hf_xformers.a.user"])
    assert modules == ["hf_xformers.a.mod_x", "hf_xformers.a.user", "hf_xformers.b.helper", "hf_xformers.b.mod_x"]
    flat = export.flat_names(modules)
    assert flat == {"hf_xformers.a.mod_x": "a_mod_x", "hf_xformers.a.user": "user",
                    "hf_xformers.b.helper": "helper", "hf_xformers.b.mod_x": "b_mod_x"}  # fmt: skip
    text = export._rewrite_source("hf_xformers.a.user", flat)
    assert "from .b_mod_x import B\n" in text
    assert "from .a_mod_x import A, A2 as Alias\n" in text
    assert "    from .helper import H  # only for annotations\n" in text
    assert "import torch\n" in text and "hf_xformers" not in text
    assert export._rewrite_source("hf_xformers.b.mod_x", flat).startswith("from .helper import H\n")


@pytest.mark.parametrize(
    "source, match",
    [
        ("from . import helper\n", "from the package 'hf_xformers.b'"),
        ("from ..b import H\n", "from the package 'hf_xformers.b'"),
        ("import hf_xformers.b.helper\n", "cannot be exported"),
        ("x = 1; from .helper import H\n", "lines of its own"),
    ],
)
def test_import_forms_the_export_cannot_rewrite_are_named(source, match, tmp_path, monkeypatch):
    package = _fake_package(tmp_path, {"b/user.py": source, "b/helper.py": "H = 2\n"})
    monkeypatch.setattr(export, "PACKAGE_DIR", package)
    with pytest.raises(ValueError, match=match):
        modules = export.required_modules(["hf_xformers.b.user"])
        export._rewrite_source("hf_xformers.b.user", export.flat_names(modules))
