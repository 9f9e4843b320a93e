"""Carry a sentence-transformers model's modules over to a converted checkpoint.

A sentence-transformers model folder is a transformers checkpoint plus the files that say how token vectors become
one text embedding:

* ``modules.json``: the ordered modules, each ``{"idx", "name", "path", "type"}``. The ``Transformer`` module
  lives at ``path`` ``""`` (the checkpoint itself; ``"0_Transformer"`` in folders written by sentence-transformers
  before 1.0), then e.g. ``Pooling`` (``1_Pooling/config.json``), ``Dense`` (``2_Dense/``: config and weights),
  ``Normalize`` (no files).
* ``sentence_bert_config.json`` in the ``Transformer`` module's folder: ``max_seq_length`` (inputs are cut there),
  ``do_lower_case`` and, from sentence-transformers 5, the module's other settings.
* ``config_sentence_transformers.json``: prompts, the similarity function, the versions it was saved with.

Without ``modules.json``, ``SentenceTransformer(folder)`` builds a ``Transformer`` and a mean ``Pooling`` and nothing
else, so a converted checkpoint without these files embeds differently from its source (no normalisation, CLS
pooling replaced by mean pooling, dense layers lost). The converters call :func:`carry_sentence_transformers_modules`
after saving the converted model: the modules are copied as they are, the ``Transformer`` module becomes the converted
checkpoint at the folder's root, and ``max_seq_length`` is raised to the converted model's length.

The converted model types are registered with transformers' Auto classes when ``hf_xformers`` is imported, which is
all ``SentenceTransformer(folder)`` needs::

    import hf_xformers  # registers the hfx-* model types with AutoConfig / AutoModel
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer("minilm-longformer-4096")
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError

logger = logging.getLogger(__name__)

MODULES_FILE = "modules.json"
MODEL_CONFIG_FILE = "config_sentence_transformers.json"
# The Transformer module's settings; older sentence-transformers releases named the file after the model family.
TRANSFORMER_CONFIG_FILE = "sentence_bert_config.json"
LEGACY_TRANSFORMER_CONFIG_FILES = (
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
# Files of an earlier sentence-transformers model that must not survive next to a newly converted checkpoint.
STALE_FILES = (MODULES_FILE, MODEL_CONFIG_FILE, TRANSFORMER_CONFIG_FILE, *LEGACY_TRANSFORMER_CONFIG_FILES)
# Keyword groups of sentence_bert_config.json handed to the tokenizer (new and pre-5.0 names): a model_max_length
# there wins over max_seq_length when sentence-transformers builds the tokenizer.
TOKENIZER_KWARG_GROUPS = ("processor_kwargs", "tokenizer_args")


@dataclass
class SentenceTransformersModules:
    """The sentence-transformers files of a source model.

    Attributes:
        root: the folder (or Hub id) holding ``modules.json``.
        modules: the entries of ``modules.json`` in order.
        transformer_index: position of the ``Transformer`` module in ``modules``.
        transformer_config: its ``sentence_bert_config.json`` (empty when the source has none).
        model_config: ``config_sentence_transformers.json``, or None when the source has none.
        revision: the Hub revision the files were read at (None for a local folder).
    """

    root: str
    modules: list[dict]
    transformer_index: int
    transformer_config: dict
    model_config: dict | None
    revision: str | None = None

    @property
    def transformer_path(self) -> str:
        """Folder of the ``Transformer`` module relative to :attr:`root` (``""``: the root itself)."""
        return self.modules[self.transformer_index]["path"]


def _is_local(source: str | Path) -> bool:
    return Path(source).is_dir()


def _source_file(source: str | Path, filename: str, revision: str | None = None) -> Path | None:
    """``filename`` (a path relative to ``source``) of a local folder or, for a Hub id, from the Hub cache
    (downloaded when online); None when the source has no such file."""
    if _is_local(source):
        path = Path(source) / filename
        return path if path.is_file() else None
    try:
        return Path(hf_hub_download(str(source), filename, revision=revision))
    except EntryNotFoundError:
        return None
    except LocalEntryNotFoundError:
        # Offline and not in the cache: a snapshot downloaded whole would hold the file, so take it as absent.
        logger.info("%s of %s is not in the Hugging Face cache; taken as absent.", filename, source)
        return None
    except HFValidationError:
        raise ValueError(f"{str(source)!r} is neither a local folder nor a Hub model id ('org/name').") from None


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}); copy it again from the original model."
        ) from error


def _check_relative(path: str, where: str) -> None:
    parts = PurePosixPath(path).parts
    if PurePosixPath(path).is_absolute() or ".." in parts:
        raise ValueError(f"{where} names the module folder {path!r}; module folders must lie inside the model folder.")


def _modules_root(source: str | Path, revision: str | None) -> tuple[str, Path] | None:
    """Where ``modules.json`` is: in ``source``, or (a local ``0_Transformer`` folder of a pre-1.0 model) in its
    parent when the parent's ``Transformer`` module is that folder. Returns ``(root, modules.json)`` or None."""
    found = _source_file(source, MODULES_FILE, revision)
    if found is not None:
        return str(source), found
    if _is_local(source):
        parent = Path(source).resolve().parent
        candidate = parent / MODULES_FILE
        if candidate.is_file():
            entries = _read_json(candidate)
            name = Path(source).resolve().name
            if isinstance(entries, list) and any(
                isinstance(e, dict) and _is_transformer(e) and e.get("path", "").strip("/") == name for e in entries
            ):
                return str(parent), candidate
    return None


def _is_transformer(entry: dict) -> bool:
    # "sentence_transformers.models.Transformer" (all releases) or the module path of 5.x/6.x saves.
    return str(entry.get("type", "")).rsplit(".", 1)[-1] == "Transformer"


def read_sentence_transformers_modules(
    source: str | Path, revision: str | None = None
) -> SentenceTransformersModules | None:
    """Read the sentence-transformers files of ``source`` (a local folder or a Hub id).

    Returns:
        The modules, or None when ``source`` is a plain transformers checkpoint (no ``modules.json``).

    Raises:
        ValueError: ``modules.json`` is not a list of modules, names a folder outside the model, or holds no or
            several ``Transformer`` modules (a ``Router`` of several encoders is not converted).
    """
    located = _modules_root(source, revision)
    if located is None:
        return None
    root, modules_file = located
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(e, dict) and "path" in e for e in modules):
        raise ValueError(f"{modules_file} is not a list of modules with a 'path' each; copy it again from the model.")
    for entry in modules:
        _check_relative(entry["path"], str(modules_file))
    transformers_at = [i for i, entry in enumerate(modules) if _is_transformer(entry)]
    if len(transformers_at) != 1:
        types = [entry.get("type") for entry in modules]
        raise ValueError(
            f"{modules_file} lists the modules {types}; only a sentence-transformers model with exactly one "
            "Transformer module can be converted. Convert the encoder folder on its own and build the "
            "SentenceTransformer around it."
        )
    index = transformers_at[0]
    transformer_dir = modules[index]["path"].strip("/")
    transformer_config: dict = {}
    for name in (TRANSFORMER_CONFIG_FILE, *LEGACY_TRANSFORMER_CONFIG_FILES):
        found = _source_file(root, f"{transformer_dir}/{name}" if transformer_dir else name, revision)
        if found is not None:
            transformer_config = _read_json(found)
            break
    model_config_file = _source_file(root, MODEL_CONFIG_FILE, revision)
    model_config = _read_json(model_config_file) if model_config_file is not None else None
    return SentenceTransformersModules(root, modules, index, transformer_config, model_config, revision)


def _module_folder(modules: SentenceTransformersModules, path: str) -> Path | None:
    """A module's folder on disk (a Hub id's is downloaded into the cache); None when it holds no files."""
    if _is_local(modules.root):
        folder = Path(modules.root) / path
    else:
        try:
            snapshot = snapshot_download(modules.root, revision=modules.revision, allow_patterns=[f"{path}/*"])
        except LocalEntryNotFoundError:
            return None
        folder = Path(snapshot) / path
    return folder if folder.is_dir() else None


def write_sentence_transformers_modules(
    modules: SentenceTransformersModules, output_dir: str | Path, max_seq_length: int | None = None
) -> None:
    """Write ``modules`` next to a converted checkpoint saved in ``output_dir``.

    The ``Transformer`` module points at ``output_dir`` itself (``path`` ``""``); every other module's folder is
    copied as it is; ``sentence_bert_config.json`` is written with ``max_seq_length`` (and a ``model_max_length``
    given to the tokenizer there) set to ``max_seq_length`` when given, else kept.
    """
    output_dir = Path(output_dir)
    entries = [dict(entry) for entry in modules.modules]
    entries[modules.transformer_index]["path"] = ""
    for i, entry in enumerate(entries):
        path = entry["path"].strip("/")
        if i == modules.transformer_index or not path:
            continue
        target = output_dir / path
        if target.is_dir():  # a module folder of an earlier conversion (prepare_output_dir's overwrite)
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        folder = _module_folder(modules, path)
        if folder is not None:
            shutil.copytree(folder, target)

    config = dict(modules.transformer_config)
    if max_seq_length is not None:
        config["max_seq_length"] = int(max_seq_length)
        for group in TOKENIZER_KWARG_GROUPS:
            if isinstance(config.get(group), dict) and "model_max_length" in config[group]:
                config[group] = {**config[group], "model_max_length": int(max_seq_length)}
    _write_json(output_dir / MODULES_FILE, entries)
    _write_json(output_dir / TRANSFORMER_CONFIG_FILE, config)
    if modules.model_config is not None:
        _write_json(output_dir / MODEL_CONFIG_FILE, modules.model_config)


def _write_json(path: Path, content: dict | list) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def remove_stale_files(output_dir: str | Path) -> list[str]:
    """Remove the top-level sentence-transformers files (:data:`STALE_FILES`) from ``output_dir``: left from an
    earlier model, they would make ``SentenceTransformer`` load that model's modules. Returns the names removed."""
    removed = []
    for name in STALE_FILES:
        path = Path(output_dir) / name
        if path.is_file():
            path.unlink()
            removed.append(name)
    return removed


def carry_sentence_transformers_modules(
    source: str | Path, output_dir: str | Path, max_seq_length: int | None = None, revision: str | None = None
) -> bool:
    """Give the converted checkpoint in ``output_dir`` the sentence-transformers modules of ``source``.

    Call it after the converted model and tokenizer are saved. A plain transformers source writes nothing (and
    removes sentence-transformers files an earlier conversion left in ``output_dir``).

    Args:
        source: the converted model's source: a local folder (a ``0_Transformer`` folder of a pre-1.0 model is
            found through its parent's ``modules.json``) or a Hub id (read from the Hugging Face cache).
        output_dir: the folder the converted checkpoint was saved in.
        max_seq_length: the converted model's length (``sentence_bert_config.json``'s ``max_seq_length``); None
            keeps the source's.
        revision: the Hub revision of ``source``.

    Returns:
        True when ``source`` is a sentence-transformers model and its modules were written.

    Raises:
        ValueError: ``source`` has a ``modules.json`` the conversion cannot carry (see
            :func:`read_sentence_transformers_modules`).
    """
    removed = remove_stale_files(output_dir)
    if removed:
        logger.info("Removed the sentence-transformers files of an earlier model from %s: %s", output_dir, removed)
    modules = read_sentence_transformers_modules(source, revision)
    if modules is None:
        return False
    write_sentence_transformers_modules(modules, output_dir, max_seq_length)
    names = [str(entry.get("type", "?")).rsplit(".", 1)[-1] for entry in modules.modules]
    logger.info(
        "Carried the sentence-transformers modules %s over to %s (max_seq_length %s); load it with "
        "`import hf_xformers; SentenceTransformer(%r)`.",
        " -> ".join(names),
        output_dir,
        max_seq_length if max_seq_length is not None else modules.transformer_config.get("max_seq_length"),
        str(output_dir),
    )
    return True
