"""The package's layout, pinned: floors that import one way, torch-free configurations, one declaration per
architecture driving registration / PEFT / exports, and the old module paths that still import.

Static checks read the source with ``ast`` (no import side effects), so a violation names the file and line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

import hf_xformers  # noqa: E402
from hf_xformers import peft_support  # noqa: E402
from hf_xformers.configs.architecture import Architecture  # noqa: E402
from hf_xformers.models import ARCHITECTURE_PACKAGES, ARCHITECTURES  # noqa: E402
from hf_xformers.moved_modules import MOVED_MODULES  # noqa: E402
from hf_xformers.registration import REGISTRY  # noqa: E402

PACKAGE_DIR = Path(hf_xformers.__file__).resolve().parent
REPO = PACKAGE_DIR.parent
TOP_LEVEL = {"hf_xformers", "hf_xformers.models", "hf_xformers.registration", "hf_xformers.peft_support",
             "hf_xformers.export", "hf_xformers.card", "hf_xformers.moved_modules", "hf_xformers.padding_free",
             "hf_xformers.packed_inference", "hf_xformers.sequence_parallel_data"}  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py")) if "model_cards" not in p.parts}


MODULES = package_modules()


def imports_of(name: str) -> list[tuple[int, str]]:
    """``(line, imported package module)`` for every import of a package module in ``name``'s source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "hf_xformers"]
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level + (node.module or "")) if node.level else (node.module or "")
            target = importlib.util.resolve_name(base, package) if node.level else base
            if target.split(".")[0] != "hf_xformers":
                continue
            # `from . import x` imports the module x where there is one
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found += [(node.lineno, t) for t in (subs or [target])]
    return found


# Rooms of one floor that stand on another room of that floor: conversion/ (the converters) uses the assembled package
# (its registered classes, the model cards), and nothing of the top room imports the converters.
STANDS_ON = {"conversion": {"top"}}


def floor_of(name: str) -> tuple[int, str]:
    """``(floor, room)``: imports may go to a lower floor, or within the same room, never up or sideways (but for
    :data:`STANDS_ON`)."""
    parts = name.split(".")
    if name in TOP_LEVEL:
        return 3, "top"
    if parts[1] == "conversion":
        return 3, "conversion"
    if parts[1] in ("ops", "configs"):
        return 0, parts[1]
    if parts[1] in ("attention", "layers"):
        return 1, parts[1]
    if parts[1] == "models" and len(parts) >= 3:
        return 2, ".".join(parts[:3])
    raise AssertionError(
        f"{name}: a module outside the floors; place it in ops/, configs/, attention/, layers/ or models/"
    )


def test_every_module_has_a_floor():
    for name in MODULES:
        floor_of(name)


def test_imports_run_one_way():
    upward = []
    for name in MODULES:
        floor, room = floor_of(name)
        for line, target in imports_of(name):
            target_floor, target_room = floor_of(target)
            if target_room != room and target_floor >= floor and target_room not in STANDS_ON.get(room, ()):
                upward.append(f"{MODULES[name].relative_to(REPO)}:{line} ({room}, floor {floor}) imports {target} "
                              f"({target_room}, floor {target_floor})")  # fmt: skip
    assert not upward, "imports that run up or sideways:\n" + "\n".join(upward)


def test_the_layering_check_can_fail():
    # A sideways import (attention -> layers) and an upward one (ops -> models) are what the check must refuse.
    assert floor_of("hf_xformers.attention.favor")[0] == floor_of("hf_xformers.layers.heads")[0]
    assert floor_of("hf_xformers.attention.favor")[1] != floor_of("hf_xformers.layers.heads")[1]
    assert floor_of("hf_xformers.ops.kernels")[0] < floor_of("hf_xformers.models.swin.modeling_swin")[0]
    assert "hf_xformers.ops.shapes" in dict((t, n) for n, t in imports_of("hf_xformers.attention.base"))
    # conversion/ may use the top room; the top room may not import conversion/ (same floor, another room).
    top, conversion = floor_of("hf_xformers.card"), floor_of("hf_xformers.conversion.common")
    assert top[0] == conversion[0] and top[1] != conversion[1] and top[1] in STANDS_ON[conversion[1]]
    assert conversion[1] not in STANDS_ON.get(top[1], ())


def test_module_file_names_are_unique():
    """export.py copies a checkpoint's modules flat into one folder (ARCHITECTURE.md): two modules of one base name
    would need the fallback names there."""
    seen: dict[str, str] = {}
    clashes = []
    for path in MODULES.values():
        if path.name != "__init__.py":
            if path.name in seen:
                clashes.append(f"{seen[path.name]} and {path.relative_to(REPO)}")
            seen[path.name] = str(path.relative_to(REPO))
    assert not clashes, "module file names used twice: " + "; ".join(clashes)


def _imports_torch(name: str) -> bool:
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def _reached(name: str) -> set[str]:
    todo, seen = [name], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += [t for _, t in imports_of(current) if t in MODULES]
    return seen


CONFIG_MODULES = sorted(n for n in MODULES if n.rpartition(".")[2].startswith("configuration_") or ".configs." in n)


@pytest.mark.parametrize("name", CONFIG_MODULES)
def test_configurations_are_free_of_torch(name):
    """As in transformers: a configuration module, and every package module it reaches, imports no torch."""
    heavy = sorted(m for m in _reached(name) if _imports_torch(m))
    assert not heavy, f"{name} reaches torch through {heavy}"


def test_every_architecture_folder_is_declared():
    folders = sorted(p.parent.name for p in (PACKAGE_DIR / "models").glob("*/__init__.py"))
    assert sorted(ARCHITECTURE_PACKAGES) == folders
    assert [a.model_type for a in ARCHITECTURES] == list(REGISTRY)
    for name, arch in zip(ARCHITECTURE_PACKAGES, ARCHITECTURES):
        assert isinstance(arch, Architecture)
        assert importlib.import_module(f"hf_xformers.models.{name}").ARCHITECTURE is arch


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.model_type)
def test_declaration_drives_exports_registry_and_peft(arch):
    package = importlib.import_module(arch.auto_classes["AutoModel"].__module__.rpartition(".")[0])
    for name, cls in arch.exports.items():
        assert getattr(hf_xformers, name) is cls and name in hf_xformers.__all__, name
        assert name in package.__all__, name
        assert inspect.getdoc(cls), f"{name} has no docstring (its own or a base's)"
    assert transformers.AutoConfig.for_model(arch.model_type).__class__ is arch.config_class
    for auto_name, cls in arch.auto_classes.items():
        if auto_name == "AutoImageProcessor":
            continue  # registered per backend; tests/test_swin.py loads it through AutoImageProcessor
        assert getattr(transformers, auto_name)._model_mapping[arch.config_class] is cls, auto_name
    assert peft_support.LORA_TARGET_MODULES[arch.model_type] == list(arch.lora_target_modules)
    assert peft_support.IA3_TARGET_MODULES[arch.model_type] == list(arch.ia3_target_modules)
    assert peft_support.IA3_FEEDFORWARD_MODULES[arch.model_type] == list(arch.ia3_feedforward_modules)
    peft_constants = pytest.importorskip("peft.utils.constants")
    assert peft_constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[arch.model_type] == list(
        arch.lora_target_modules
    )
    # Documented: the README's table, a model card template, and ARCHITECTURE.md's map of the folder.
    assert f"`{arch.model_type}`" in (REPO / "README.md").read_text(encoding="utf-8")
    assert (REPO / "model_cards" / f"{arch.model_type.removeprefix('hfx-')}.md").is_file()
    folder = Path(package.__file__).parent.name
    assert f"models/{folder}/" in (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")


def test_a_declaration_refuses_what_would_break_registration():
    config_class = ARCHITECTURES[0].config_class
    model = ARCHITECTURES[0].auto_classes["AutoModel"]
    kwargs = dict(lora_target_modules=("q",), ia3_target_modules=("k",), ia3_feedforward_modules=())

    class Foreign(config_class):
        model_type = "longformer"

    with pytest.raises(ValueError, match="hfx-"):
        Architecture(config_class=Foreign, auto_classes={"AutoModel": model}, **kwargs)
    with pytest.raises(ValueError, match="AutoModel"):
        Architecture(config_class=config_class, auto_classes={}, **kwargs)
    with pytest.raises(ValueError, match="subset"):
        Architecture(config_class=config_class, auto_classes={"AutoModel": model},
                     **{**kwargs, "ia3_feedforward_modules": ("ff",)})  # fmt: skip


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_old_module_paths_still_import(old):
    module = importlib.import_module(f"hf_xformers.{old}")
    assert module is importlib.import_module(f"hf_xformers.{MOVED_MODULES[old]}")


def test_old_names_in_old_places():
    from hf_xformers.layers.act import ponder_loss  # noqa: F401
    from hf_xformers.layers.recurrent_block import HfxUniversalCache, attention_mask_4d, timing_signal  # noqa: F401

    from hf_xformers.attention.base import ceil_div, merge_heads  # noqa: F401
    from hf_xformers.layers.text_model import HfxPreTrainedModel
    from hf_xformers.models.universal.modeling_universal import HfxUniversalCache as cache  # noqa: F401

    assert HfxPreTrainedModel.__module__ == "hf_xformers.layers.pretrained"


@pytest.mark.parametrize("folder", ["examples", "benchmarks", "conversion"])
def test_scripts_patch_no_import_path(folder):
    """Examples, benchmarks and conversions run as modules from the repository root (``python -m examples.run_glue``)
    and import each other as packages: none edits ``sys.path``, but for one form in the examples, which also run as
    files from any folder, as transformers' scripts do (``python examples/run_glue.py``): the repository root put
    first on the path only when the script has no package (``if not __package__:`` on the line before)."""
    patched = []
    for p in sorted((REPO / folder).rglob("*.py")):
        lines = p.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not re.search(r"sys\.path\.(insert|append)|sys\.path\s*\+?=", line):
                continue
            run_as_a_file = folder == "examples" and i > 0 and lines[i - 1].startswith("if not __package__:")
            if not (run_as_a_file and line.strip().startswith("sys.path.insert(0, ")):
                patched.append(f"{p.relative_to(REPO)}:{i + 1}")
    assert not patched, patched


# The one way to reach the attention kernel (ARCHITECTURE.md, "The attention switch"): the rule and the mixin live in
# these two modules; everything else asks an attention module's KernelChoice.kernel_choice.
DISPATCH_MODULES = {"hf_xformers.ops.attention_switch", "hf_xformers.attention.base"}
CHOICE_PARAMETERS = {"implementation", "attn_implementation"}
# What runs once per call of a module: its forward, and the attention variants' attend_tokens (attention/base.py's
# HfxSelfAttention.forward calls it).
ENTRY_POINTS = {"forward", "attend_tokens"}


def dispatch_violations(name: str) -> list[str]:
    """Where module ``name`` reaches the kernel choice other than through ``KernelChoice``: a call of
    ``attention_implementation``, a ``forward`` that takes the choice as a parameter (a choice threaded down the
    layers), or a ``forward`` that asks ``kernel_choice`` more than once."""
    path = MODULES[name].relative_to(REPO)
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and name not in DISPATCH_MODULES:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called == "attention_implementation":
                found.append(f"{path}:{node.lineno} calls attention_implementation; ask self.kernel_choice(x)")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ENTRY_POINTS:
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for argument in arguments:
                if argument.arg in CHOICE_PARAMETERS:
                    found.append(
                        f"{path}:{node.lineno} forward takes {argument.arg!r}; read it in the attention module"
                    )
            asks = [
                call for call in ast.walk(node)
                if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "kernel_choice"
            ]  # fmt: skip
            if len(asks) > 1:
                found.append(f"{path}:{node.lineno} forward asks kernel_choice {len(asks)} times; once per forward")
    return found


def test_attention_is_dispatched_one_way():
    """No module calls ``attention_implementation`` but the switch and ``KernelChoice``, no ``forward`` passes the
    choice down a signature, and no ``forward`` asks for it twice."""
    violations = [v for name in MODULES for v in dispatch_violations(name)]
    assert not violations, "\n".join(violations)


def test_the_dispatch_check_can_fail(tmp_path, monkeypatch):
    source = (
        "from ..ops.attention_switch import attention_implementation\n\n\n"
        "class Layer:\n"
        "    def forward(self, x, implementation='sdpa'):\n"
        "        return attention_implementation(self.config), self.kernel_choice(x), self.kernel_choice(x)\n"
    )
    (tmp_path / "threaded.py").write_text(source)
    monkeypatch.setitem(MODULES, "hf_xformers.attention.threaded", tmp_path / "threaded.py")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    violations = dispatch_violations("hf_xformers.attention.threaded")
    assert [v.split(" ", 1)[1].split(";")[0] for v in violations] == [
        "forward takes 'implementation'", "forward asks kernel_choice 2 times", "calls attention_implementation",
    ]  # fmt: skip


# The team's limit on a function's length (docstring and decorators' lines apart, signature included), in every folder
# of shipped or runnable code.
MAX_FUNCTION_LINES = 80
CODE_FOLDERS = ("hf_xformers", "conversion", "examples", "scripts")


def long_functions(source: str, path: str) -> list[str]:
    """``"path:line name (n lines)"`` for every function or method of ``source`` longer than
    :data:`MAX_FUNCTION_LINES` (from its ``def`` line to its last line)."""
    return [
        f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("folder", CODE_FOLDERS)
def test_no_function_is_over_80_lines(folder):
    """Split a longer function into named pieces (each says what it does) rather than raise the limit."""
    found = [
        line
        for path in sorted((REPO / folder).rglob("*.py"))
        for line in long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    ]
    assert not found, "functions over 80 lines:\n" + "\n".join(found)


def test_the_function_length_check_can_fail():
    def method(lines: int) -> str:
        """A class whose one method is ``lines`` long, its ``def`` line included."""
        body = "".join(f"        x{i} = {i}\n" for i in range(lines - 1))
        return f"class A:\n    async def method(self):\n{body}"

    assert long_functions(method(MAX_FUNCTION_LINES), "a.py") == []
    assert long_functions(method(MAX_FUNCTION_LINES + 1), "a.py") == [f"a.py:2 method ({MAX_FUNCTION_LINES + 1} lines)"]
