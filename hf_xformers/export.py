"""Self-contained Hub checkpoints: the model code travels with the weights.

A checkpoint saved with ``save_pretrained`` only loads where ``hf_xformers`` is installed and imported. This module
writes a checkpoint folder that also loads with ``trust_remote_code=True`` where the package is absent:

* the package modules the architecture needs (found by following its imports, statically) are copied *flat* into
  the folder, their package imports rewritten to ``from .module import X``: transformers copies a checkpoint's code
  by following exactly that form of import, and nothing else;
* ``config.json`` gets an ``auto_map`` entry for ``AutoConfig`` and for every Auto class the architecture is
  registered with in :data:`hf_xformers.registration.REGISTRY` (not only the class that was saved), and for
  ``AutoImageProcessor`` where the architecture has an image processor (also in ``preprocessor_config.json``);
* weights stay safetensors; tokenizer, generation config, processor and other top-level files are carried over.

Where ``hf_xformers`` is imported, the same folder still loads through the registered classes: transformers prefers
registered (non-transformers) classes to a checkpoint's code, with or without ``trust_remote_code``.

Python::

    from hf_xformers import export_for_hub
    export_for_hub("out/sst2", "out/sst2-hub")          # or export_for_hub(model, "out/model-hub")

Command line::

    hfx-export --source out/sst2 --output out/sst2-hub      # or python -m hf_xformers.export ...
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from .registration import REGISTRY

PACKAGE = __name__.split(".")[0]
PACKAGE_DIR = Path(__file__).resolve().parent
# First line of every exported module: how a later export recognises (and replaces) the files of an earlier one.
HEADER_MARKER = "# Exported from hf_xformers"
IMAGE_PROCESSOR_AUTO = "AutoImageProcessor"
# Files of a training run that an upload does not need (optimizer state, RNG states ...). Sub-folders
# (checkpoint-*, runs/) are never copied.
TRAINER_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth")


def _package_version() -> str:
    # Read from the package itself, not from installed metadata: a source checkout has no metadata of its own.
    from . import __version__

    return __version__


# ---------------------------------------------------------------------------------------------------------------
# Which modules an architecture needs
# ---------------------------------------------------------------------------------------------------------------


def _module_file(module: str) -> Path:
    """The source file of the package module ``module`` (dotted name)."""
    parts = module.split(".")[1:]
    path = PACKAGE_DIR.joinpath(*parts)
    if path.is_dir():
        return path / "__init__.py"
    return path.with_suffix(".py")


def _resolve_import(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The dotted package module that ``node`` (inside ``module``) imports from, or None for outside imports."""
    if node.level == 0:
        name = node.module or ""
        return name if name == PACKAGE or name.startswith(PACKAGE + ".") else None
    anchor = module if is_package else module.rpartition(".")[0]
    return importlib.util.resolve_name("." * node.level + (node.module or ""), anchor)


def _package_imports(module: str) -> list[tuple[ast.ImportFrom, str]]:
    """``(import node, imported package module)`` for every import of a package module in ``module``'s source.

    Raises:
        ValueError: an import form the flat export cannot rewrite (``import hf_xformers.x``, ``from . import x``,
            or names taken from a package ``__init__`` rather than from the module that defines them).
    """
    path = _module_file(module)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    raise ValueError(
                        f"{path}:{node.lineno}: `import {alias.name}` cannot be exported as Hub code; write "
                        f"`from .module import Name` (a relative import of the defining module) instead."
                    )
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _resolve_import(node, module, path.name == "__init__.py")
        if target is None:
            continue
        if _module_file(target).name == "__init__.py":
            raise ValueError(
                f"{path}:{node.lineno}: imports {[a.name for a in node.names]} from the package {target!r}; export "
                "copies modules flat and needs the import to name the module that defines them "
                f"(`from .{target.rpartition('.')[2]}.<module> import Name`)."
            )
        found.append((node, target))
    return found


def required_modules(roots: Iterable[str]) -> list[str]:
    """Dotted names of the package modules that the modules ``roots`` need, ``roots`` included, sorted.

    Follows every import of a package module (relative or ``hf_xformers.``-absolute) in the source, statically
    (``ast``), so a new module is picked up as soon as some needed module imports it.
    """
    todo = list(roots)
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(target for _, target in _package_imports(module))
    return sorted(seen)


def flat_names(modules: Iterable[str]) -> dict[str, str]:
    """Flat module name in the checkpoint folder for each dotted package module.

    The file's base name where it is unique among ``modules`` (the package's convention); otherwise the path
    below the package joined with ``_`` (``models_swin_modeling_swin``), so two same-named files cannot overwrite
    each other.
    """
    modules = sorted(modules)
    base = {m: m.rpartition(".")[2] for m in modules}
    counts: dict[str, int] = {}
    for name in base.values():
        counts[name] = counts.get(name, 0) + 1
    names = {m: base[m] if counts[base[m]] == 1 else "_".join(m.split(".")[1:]) for m in modules}
    if len(set(names.values())) != len(names):  # only conceivable with names like a_b/c.py and a/b_c.py
        raise ValueError(f"Modules {modules} do not get distinct flat names: {names}.")
    return names


def _rewrite_source(module: str, flat: dict[str, str]) -> str:
    """``module``'s source with each package import turned into ``from .<flat name> import ...``."""
    path = _module_file(module)
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    imports = sorted(_package_imports(module), key=lambda item: item[0].lineno, reverse=True)
    for node, target in imports:
        first, last = node.lineno - 1, node.end_lineno - 1
        before = lines[first][: node.col_offset]
        after = lines[last][node.end_col_offset :]
        if before.strip() or after.strip() and not after.strip().startswith("#"):
            raise ValueError(
                f"{path}:{node.lineno}: put the package import on lines of its own (no `;`) so that it can be "
                "rewritten for the Hub export."
            )
        names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        statement = f"{before}from .{flat[target]} import {names}"
        if len(statement) > 110:  # keep the line length of the package's style
            inner = "".join(f"{before}    {part.strip()},\n" for part in names.split(","))
            statement = f"{before}from .{flat[target]} import (\n{inner}{before})"
        lines[first : last + 1] = [statement + after]  # `after` keeps a trailing comment and the newline
    return "".join(lines)


def _header(module: str) -> str:
    relative = _module_file(module).relative_to(PACKAGE_DIR.parent).as_posix()
    return (
        f"{HEADER_MARKER} {_package_version()} ({relative}) by hf_xformers.export_for_hub.\n"
        "# A copy for loading with trust_remote_code=True where hf_xformers is not installed; change the package and\n"
        "# export again rather than editing this file.\n"
    )


# ---------------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------------


def architecture_classes(model_type: str) -> dict[str, type]:
    """``{"AutoConfig": config class, <Auto class name>: class, ...}`` of ``model_type`` from the registration table.

    Raises:
        ValueError: ``model_type`` is not one of the package's.
    """
    if model_type not in REGISTRY:
        raise ValueError(
            f"model_type {model_type!r} is not an hf_xformers architecture; export_for_hub exports the model types "
            f"{sorted(REGISTRY)}. A transformers model needs no export: its code ships with transformers."
        )
    config_class, heads = REGISTRY[model_type]
    return {"AutoConfig": config_class, **heads}


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{str(folder)!r} has no config.json; pass a folder written by save_pretrained() (or Trainer.save_model), "
            "or the model itself."
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error.msg}, line {error.lineno}); save the model again."
        ) from error


def _copy_checkpoint(source: Path, out_dir: Path, config: dict) -> None:
    """Copy the top-level files of ``source`` into ``out_dir``, with safetensors weights.

    Earlier exported modules are left behind (the export writes fresh ones), and so is a Trainer's resumable state.
    A source with PyTorch pickle weights only is loaded with its registered class and saved again (safetensors).
    """
    skipped = set()
    for pattern in TRAINER_STATE_FILES:
        skipped.update(p.name for p in source.glob(pattern))
    has_safetensors = any(source.glob("*.safetensors"))
    if not has_safetensors:
        if not any(source.glob("pytorch_model*.bin")):
            raise ValueError(
                f"{str(source)!r} has a config.json but no weights (model.safetensors); save the model into it first."
            )
        heads = architecture_classes(config["model_type"])
        by_name = {cls.__name__: cls for cls in heads.values()}
        architecture = (config.get("architectures") or [None])[0]
        if architecture is None:
            raise ValueError(
                f"{source}: config.json names no `architectures`, so it is unknown which head the pickle weights "
                "belong to; load the model with its class and save_pretrained() it (safetensors), then export."
            )
        if architecture not in by_name:
            raise ValueError(
                f"{source}: architecture {architecture!r} is not registered for {config['model_type']!r}; expected "
                f"one of {sorted(by_name)}."
            )
        by_name[architecture].from_pretrained(str(source)).save_pretrained(str(out_dir))
        skipped.update(p.name for p in source.glob("pytorch_model*.bin*"))
        skipped.update({"config.json", "generation_config.json"})
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name in skipped or _is_exported_module(path):
            continue
        shutil.copy2(path, out_dir / path.name)


def _is_exported_module(path: Path) -> bool:
    if path.suffix != ".py" or not path.is_file():
        return False
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.readline().startswith(HEADER_MARKER)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def export_for_hub(model_or_dir, out_dir: str | os.PathLike, *, processor=None, overwrite: bool = False) -> Path:
    """Write a checkpoint folder that loads with ``trust_remote_code=True`` where ``hf_xformers`` is not installed.

    Args:
        model_or_dir (PreTrainedModel | str | os.PathLike): an hf_xformers model (``PreTrainedModel``), or a folder written by ``save_pretrained`` /
            ``Trainer.save_model`` (config, safetensors weights, tokenizer or image processor, ...).
        out_dir: the folder to write. It may be ``model_or_dir`` itself (the export is then added in place);
            otherwise it must be new or empty unless ``overwrite``.
        processor (Any): with a model: a tokenizer or image processor to save next to it (anything with
            ``save_pretrained``).
        overwrite: write into a non-empty ``out_dir`` that is not the source, replacing the files of the same name.

    Returns:
        ``out_dir`` as a ``Path``. It holds the source's top-level files (weights as safetensors; a Trainer's
        optimizer/scheduler/RNG state and sub-folders such as ``checkpoint-*`` are left out), the modules the
        architecture needs (each with a header naming the package version), and ``auto_map`` entries in
        ``config.json`` for ``AutoConfig`` and every Auto class the architecture is registered with.

    Raises:
        ValueError: the source has no ``config.json`` or no weights, its ``model_type`` is not an hf_xformers one,
            or ``out_dir`` is a file or a non-empty folder (without ``overwrite``).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"Output {str(out)!r} is a file; pass a folder (it is created if missing).")
    if isinstance(model_or_dir, (str, os.PathLike)):
        source = Path(model_or_dir)
        if not source.is_dir():
            raise ValueError(f"Source {str(source)!r} is not a folder; pass a saved checkpoint folder or a model.")
        if processor is not None:
            raise ValueError("`processor` only applies to a model; a folder carries its own tokenizer/processor files.")
        in_place = out.exists() and out.resolve() == source.resolve()
        config = _read_config(source)
        architecture_classes(config.get("model_type"))  # refuse foreign model types before writing anything
        if not in_place:
            _check_empty(out, overwrite)
            out.mkdir(parents=True, exist_ok=True)
            _copy_checkpoint(source, out, config)
        elif not any(source.glob("*.safetensors")):
            # In place, pickle weights are converted in a scratch folder, then moved over.
            with tempfile.TemporaryDirectory() as scratch:
                _copy_checkpoint(source, Path(scratch), config)
                for path in Path(scratch).iterdir():
                    shutil.copy2(path, out / path.name)
            for stale in source.glob("pytorch_model*.bin*"):
                stale.unlink()
    else:
        if not hasattr(model_or_dir, "save_pretrained") or not hasattr(model_or_dir, "config"):
            raise ValueError(f"export_for_hub takes a model or a checkpoint folder, got {type(model_or_dir).__name__}.")
        architecture_classes(getattr(model_or_dir.config, "model_type", None))
        _check_empty(out, overwrite)
        out.mkdir(parents=True, exist_ok=True)
        model_or_dir.save_pretrained(str(out))
        if processor is not None:
            processor.save_pretrained(str(out))
    _write_code(out)
    return out


def _check_empty(out: Path, overwrite: bool) -> None:
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        shown = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise ValueError(
            f"Output folder {str(out)!r} is not empty ({shown}, ...). Choose a new or empty folder, export in place "
            "(output = source), or pass --overwrite (overwrite=True)."
        )


def _write_code(out: Path) -> None:
    """Write the architecture's modules into the checkpoint folder ``out`` and point ``auto_map`` at them."""
    config = _read_config(out)
    classes = architecture_classes(config["model_type"])
    modules = required_modules(cls.__module__ for cls in classes.values())
    flat = flat_names(modules)
    for stale in out.glob("*.py"):  # an earlier export's files (another package version may have other modules)
        if _is_exported_module(stale):
            stale.unlink()
    for module in modules:
        (out / f"{flat[module]}.py").write_text(_header(module) + _rewrite_source(module, flat), encoding="utf-8")
    auto_map = {name: f"{flat[cls.__module__]}.{cls.__name__}" for name, cls in classes.items()}
    config["auto_map"] = auto_map
    _write_json(out / "config.json", config)
    processor_file = out / "preprocessor_config.json"
    if IMAGE_PROCESSOR_AUTO in auto_map and processor_file.is_file():
        # AutoImageProcessor (transformers 5.23) reads config.json's auto_map only when the processor file names no
        # `image_processor_type`; a name transformers does not know would end the search there, where the package
        # is absent. An auto_map in the processor file instead would make the pipelines derive a video processor
        # from it ("...VideoProcessor", which does not exist) and ask whether to run its code, even where the
        # package is imported. So the type goes, and config.json's auto_map is the one reference.
        processor_config = json.loads(processor_file.read_text(encoding="utf-8"))
        processor_config.pop("image_processor_type", None)
        processor_config.pop("auto_map", None)
        _write_json(processor_file, processor_config)


def exported_modules(folder: str | os.PathLike) -> list[str]:
    """Names of the exported module files in ``folder`` (recognised by their header), sorted."""
    return sorted(p.name for p in Path(folder).glob("*.py") if _is_exported_module(p))


def main(argv: list[str] | None = None) -> None:
    """Command line: ``hfx-export --source DIR --output DIR [--overwrite]``."""
    parser = argparse.ArgumentParser(
        description="Make an hf_xformers checkpoint folder self-contained for the Hub: the package modules its "
        "architecture needs are copied into the folder and config.json gets an auto_map, so the folder loads with "
        "trust_remote_code=True where hf_xformers is not installed (and through the registered classes where it is). "
        "Weights, tokenizer and processor files are carried over.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--source", required=True, help="checkpoint folder (save_pretrained / Trainer output_dir)")
    parser.add_argument("--output", required=True, help="folder to write (may be --source itself: export in place)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --output folder")
    args = parser.parse_args(argv)
    try:
        out = export_for_hub(args.source, args.output, overwrite=args.overwrite)
    except ValueError as error:
        parser.error(str(error))
    print(f"Wrote {out} with {', '.join(exported_modules(out))}", file=sys.stdout)


if __name__ == "__main__":
    main()
