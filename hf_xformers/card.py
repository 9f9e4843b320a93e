"""Model cards (``README.md``) for hf_xformers checkpoints and training output folders.

:func:`write_model_card` reads what the folder holds and writes the card:

1. YAML metadata: ``library_name: transformers``, the licence, tags (``hf-xformers``, the ``model_type``, the
   architecture template's tags, ``custom_code`` once the folder is self-contained), the ``pipeline_tag`` of the
   saved head, ``base_model`` when the model was converted or fine-tuned from a Hub model, datasets, metrics and a
   ``model-index`` built from ``eval_results.json``;
2. what the checkpoint is and how to load it (with the package, and without it when the folder carries its code);
3. the architecture's text from the shipped template ``model_cards/<arch>.md`` (its headings one level down);
4. the training hyperparameters and the evaluation table.

What the other files cannot tell (the Hub id a model came from, the data set, the hyperparameters of the run) comes
from :data:`CARD_DATA_FILE`, a small JSON file that the conversion scripts and the example scripts write next to
the checkpoint (:func:`save_card_data`), or from the ``card_data`` argument. Its keys:

``base_model``
    Hub id of the model the weights came from (converted or fine-tuned from).
``source``
    what the model was made from, in words (a local folder, a conversion) when there is no Hub id to name.
``summary``
    one paragraph saying how the checkpoint was made.
``datasets``, ``dataset_name``, ``dataset_type``, ``dataset_config``
    the Hub ids of the data sets, and the evaluation data set's display name, id (or ``local``) and configuration.
``eval_splits``
    ``{metric key prefix: split}``: which split the metrics of ``eval_results.json`` were computed on (default
    ``{"eval": "validation"}``; ``run_glue.py`` adds ``"eval_mismatched": "validation_mismatched"`` for MNLI).
``task_type``, ``pipeline_tag``, ``license``, ``language``, ``tags``, ``model_name``
    overrides of what is derived from the folder and the template.
``hyperparameters``
    ``{name: value}`` of the training run.

Python::

    from hf_xformers import write_model_card
    write_model_card("out/sst2")

Command line::

    python -m hf_xformers.card --source out/sst2
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .registration import REGISTRY

CARD_DATA_FILE = "hfx_card_data.json"
PACKAGE_DIR = Path(__file__).resolve().parent
# Where the architecture templates are: inside the installed package (setup.py copies them into wheels), or in the
# source checkout next to the package (editable installs and running from the repository).
TEMPLATE_DIRS = (PACKAGE_DIR / "model_cards", PACKAGE_DIR.parent / "model_cards")

# The Hub task (pipeline tag) of each head.
PIPELINE_TAGS = {
    "AutoModelForMaskedLM": "fill-mask",
    "AutoModelForSequenceClassification": "text-classification",
    "AutoModelForTokenClassification": "token-classification",
    "AutoModelForQuestionAnswering": "question-answering",
    "AutoModelForMultipleChoice": "multiple-choice",
    "AutoModelForCausalLM": "text-generation",
    "AutoModelForSeq2SeqLM": "text2text-generation",
    "AutoModelForImageClassification": "image-classification",
    "AutoModelForMaskedImageModeling": "image-feature-extraction",
    "AutoBackbone": "image-feature-extraction",
}
# Keys of eval_results.json that describe the run rather than the model's quality.
BOOKKEEPING_SUFFIXES = (
    "runtime", "samples_per_second", "steps_per_second", "samples", "epoch", "tokens", "model_preparation_time",
    "jit_compilation_time", "mem_cpu_alloc_delta", "mem_cpu_peaked_delta",
)  # fmt: skip
# Trainer arguments worth stating in a card, in this order (read from trainer_state.json when no card data).
STATE_HYPERPARAMETERS = ("train_batch_size", "num_train_epochs", "max_steps", "global_step")


def template_path(model_type: str) -> Path:
    """The shipped card template of ``model_type`` (``model_cards/<arch>.md``, ``<arch>`` without ``hfx-``).

    Raises:
        ValueError: ``model_type`` is not an hf_xformers one.
        FileNotFoundError: the template is missing (a broken installation).
    """
    if model_type not in REGISTRY:
        raise ValueError(
            f"model_type {model_type!r} is not an hf_xformers architecture; cards are written for {sorted(REGISTRY)}."
        )
    name = f"{model_type.removeprefix('hfx-')}.md"
    for folder in TEMPLATE_DIRS:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(
        f"No card template {name} in {[str(d) for d in TEMPLATE_DIRS]}; reinstall hf_xformers (the wheel ships "
        "model_cards/*.md inside the package)."
    )


def save_card_data(folder: str | os.PathLike, **fields: Any) -> Path:
    """Merge ``fields`` (keys of the module docstring; None values are dropped) into ``folder``'s
    :data:`CARD_DATA_FILE` and return its path."""
    path = Path(folder) / CARD_DATA_FILE
    data = load_card_data(folder)
    data.update({key: value for key, value in fields.items() if value is not None})
    # Insertion order kept: the card lists the hyperparameters in the order the scripts give them.
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    return path


def load_card_data(folder: str | os.PathLike) -> dict:
    """The contents of ``folder``'s :data:`CARD_DATA_FILE` (an empty dict when there is none)."""
    path = Path(folder) / CARD_DATA_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def hub_model_id(name_or_path: str | os.PathLike | None) -> str | None:
    """The Hub id that ``name_or_path`` stands for, or None.

    A Hub id is returned as it is; a local folder gives the Hub id it was downloaded as (a Hub cache folder
    ``.../models--org--name/snapshots/<sha>``) or the ``base_model`` recorded in its card data (a converted model,
    an earlier training run); anything else gives None.
    """
    if name_or_path is None:
        return None
    text = str(name_or_path)
    path = Path(text)
    if path.exists():
        for part in reversed(path.resolve().parts):
            if part.startswith("models--"):
                return part.removeprefix("models--").replace("--", "/", 1)
        return load_card_data(path).get("base_model") if path.is_dir() else None
    return text if _HUB_ID.match(text) and ".." not in text else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _head(model_type: str, config: dict) -> str | None:
    """The Auto class name of the saved head (from ``architectures``)."""
    architectures = config.get("architectures") or []
    _, heads = REGISTRY[model_type]
    for auto_name, cls in heads.items():
        if architectures and cls.__name__ == architectures[0]:
            return auto_name
    return None


def _metric_groups(results: dict, splits: dict[str, str]) -> list[tuple[str, str, str, float]]:
    """``(key, split, metric name, value)`` for the quality metrics of ``eval_results.json``."""
    prefixes = sorted(splits, key=len, reverse=True)  # "eval_mismatched" before "eval"
    found = []
    for key, value in sorted(results.items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key.endswith(BOOKKEEPING_SUFFIXES):
            continue
        prefix = next((p for p in prefixes if key.startswith(p + "_")), None)
        if prefix is None:
            continue
        found.append((key, splits[prefix], key[len(prefix) + 1 :], float(value)))
    return found


def _demote_headings(markdown: str) -> str:
    """Every Markdown heading one level down (``#`` -> ``##``), leaving code blocks alone."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out).strip() + "\n"


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-3 and value != 0 else f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


def _dedupe(items) -> list:
    return list(dict.fromkeys(item for item in items if item))


def build_model_card(folder: str | os.PathLike, card_data: dict | None = None) -> ModelCard:
    """The card of the checkpoint or training output ``folder`` (see the module docstring), not yet saved.

    Raises:
        ValueError: ``folder`` has no ``config.json``, or its ``model_type`` is not an hf_xformers one.
    """
    path = Path(folder)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{str(path)!r} has no config.json; pass a checkpoint folder (save_pretrained) or a training output_dir "
            "the model was saved into."
        )
    config = json.loads(config_file.read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    template = ModelCard(template_path(model_type).read_text(encoding="utf-8"))
    base = template.data.to_dict()
    info = {**load_card_data(path), **(card_data or {})}
    info["model_name"] = info.get("model_name") or path.resolve().name
    head = _head(model_type, config)
    self_contained = "AutoConfig" in (config.get("auto_map") or {})
    results = _read_json(path / "eval_results.json")
    metrics = _metric_groups(results, info.get("eval_splits") or {"eval": "validation"})
    data = _card_metadata(info, base, model_type, _pipeline_tag(info, head, base), self_contained, metrics)

    architecture = (config.get("architectures") or ["?"])[0]
    summary = f"A `{model_type}` checkpoint (`{architecture}`), made with hf_xformers {_package_version()}."
    sections = [
        f"# {info['model_name']}\n",
        f"{summary} {_origin(info)}".rstrip() + "\n",
        f"## How to load\n\n{_load_text(head or 'AutoModel', info['model_name'], self_contained)}\n",
        _base_model_text(model_type, _stores_pooler(path)) if (head or "AutoModel") == "AutoModel" else "",
        _demote_headings(template.text),
        "## Training procedure\n\n" + _hyperparameter_text(path, info),
        "## Evaluation results\n\n" + _results_table(results, metrics),
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(sections))


def _pipeline_tag(info: dict, head: str | None, base: dict) -> str | None:
    """The card's ``pipeline_tag``: the caller's, else the saved head's, else features for a base model (image ones
    for a vision model), else the template's."""
    pipeline_tag = info.get("pipeline_tag") or PIPELINE_TAGS.get(head)
    if pipeline_tag is None and head == "AutoModel":
        vision = str(base.get("pipeline_tag") or "").startswith("image")
        pipeline_tag = "image-feature-extraction" if vision else "feature-extraction"
    return pipeline_tag or base.get("pipeline_tag")


def _card_metadata(
    info: dict,
    base: dict,
    model_type: str,
    pipeline_tag: str | None,
    self_contained: bool,
    metrics: list[tuple[str, str, str, float]],
) -> ModelCardData:
    """The card's YAML header: licence, language and tags (the template's and the caller's), the model-index of the
    evaluation ``metrics``."""
    datasets = info.get("datasets")
    eval_results = [
        EvalResult(
            task_type=info.get("task_type") or pipeline_tag or "other",
            dataset_type=info.get("dataset_type") or (datasets or ["local"])[0],
            dataset_name=info.get("dataset_name") or (datasets or ["local data"])[0],
            dataset_config=info.get("dataset_config"),
            dataset_split=split,
            metric_type=metric,
            metric_name=metric,
            metric_value=round(value, 4),
        )
        for _, split, metric, value in metrics
    ]
    tags = ["hf-xformers", model_type, *(base.get("tags") or []), *(info.get("tags") or [])]
    return ModelCardData(
        library_name="transformers",
        license=info.get("license") or base.get("license"),
        language=info.get("language") or base.get("language"),
        tags=_dedupe([*tags, "custom_code" if self_contained else None]),
        pipeline_tag=pipeline_tag,
        base_model=info.get("base_model"),
        datasets=datasets,
        metrics=_dedupe(metric for _, _, metric, _ in metrics) or None,
        model_name=info["model_name"],
        eval_results=eval_results or None,
    )


def _origin(info: dict) -> str:
    """Where the checkpoint comes from: the caller's ``summary``, its ``base_model`` or ``source``, or nothing."""
    base_model = info.get("base_model")
    if info.get("summary"):
        return info["summary"]
    if base_model:
        return f"Derived from [`{base_model}`](https://huggingface.co/{base_model})."
    return f"Derived from {info['source']}." if info.get("source") else ""


def _load_text(auto_class: str, name: str, self_contained: bool) -> str:
    """The card's loading snippets: through the package, and without it when the folder carries the model code."""
    load = f"""```python
import hf_xformers  # registers the hfx-* model types (pip install hf-xformers)
from transformers import {auto_class}

model = {auto_class}.from_pretrained("{name}")
```"""
    if self_contained:
        load += f"""

This folder also carries the model code (exported from hf_xformers), so it loads without the package:

```python
from transformers import {auto_class}

model = {auto_class}.from_pretrained("{name}", trust_remote_code=True)
```"""
    return load


def _base_model_text(model_type: str, pooler: bool) -> str:
    """What a base checkpoint (no task head stored) serves: features, and every task head with new head weights
    (those that pool starting from a stored ``pooler``)."""
    heads = [name for name in REGISTRY[model_type][1] if name != "AutoModel"]
    listed = ", ".join(f"`{name}`" for name in heads)
    text = (
        "This is a base model: no task head is stored, and `AutoModel` returns its hidden states (and the pooled "
        f"output where the architecture has a pooler). The task heads of `{model_type}` ({listed}) load from it too, "
        "as from any base checkpoint: the encoder weights come from here and the head starts from new, untrained "
        "weights, to be fine-tuned (transformers lists them as newly initialised)."
    )
    if pooler:
        text += (
            " A pooler is stored (BERT's `tanh(dense(first token))`): the sequence-classification head starts its "
            "`classifier.dense` from it "
            "and the multiple-choice head reads it, as BERT's heads do, so only their last layer is new; the "
            "token-classification and question-answering heads use no pooler, and transformers lists it as unused."
        )
    return text + "\n"


def _stores_pooler(path: Path) -> bool:
    """Whether the checkpoint in ``path`` stores a pooler (``pooler.dense.weight``), read from its safetensors
    header or shard index (no tensor is loaded)."""
    index = _read_json(path / "model.safetensors.index.json")
    if index:
        return "pooler.dense.weight" in index.get("weight_map", {})
    if not (path / "model.safetensors").is_file():
        return False
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as weights:
        return "pooler.dense.weight" in weights.keys()


def _package_version() -> str:
    from . import __version__

    return __version__


def _hyperparameter_text(path: Path, info: dict) -> str:
    hyper = dict(info.get("hyperparameters") or {})
    if not hyper:
        state = _read_json(path / "trainer_state.json")
        hyper = {key: state[key] for key in STATE_HYPERPARAMETERS if state.get(key) is not None}
    if not hyper:
        return "No training run is recorded in this folder (for example, a converted checkpoint).\n"
    rows = "\n".join(f"| {key} | {_format(value)} |" for key, value in hyper.items())
    text = f"| hyperparameter | value |\n|---|---|\n{rows}\n"
    train = _read_json(path / "train_results.json")
    if "train_loss" in train:
        text += f"\nFinal training loss: {_format(float(train['train_loss']))}.\n"
    return text


def _results_table(results: dict, metrics: list[tuple[str, str, str, float]]) -> str:
    if not metrics:
        return "No evaluation results (`eval_results.json`) in this folder.\n"
    rows = "\n".join(f"| {key} | {split} | {_format(value)} |" for key, split, _, value in metrics)
    table = f"| result (`eval_results.json`) | split | value |\n|---|---|---|\n{rows}\n"
    samples = {key: value for key, value in results.items() if key.endswith("_samples")}
    if samples:
        table += "\n" + ", ".join(f"`{key}`: {value}" for key, value in sorted(samples.items())) + "\n"
    return table


def write_model_card(checkpoint_or_output_dir: str | os.PathLike, card_data: dict | None = None) -> Path:
    """Write ``README.md`` (the card of :func:`build_model_card`) into ``checkpoint_or_output_dir``.

    Args:
        checkpoint_or_output_dir: a checkpoint folder or a training ``output_dir`` with ``config.json``.
        card_data: entries that override the folder's :data:`CARD_DATA_FILE` (keys in the module docstring).

    Returns:
        The path of the written ``README.md``.

    Raises:
        ValueError: no ``config.json``, or a ``model_type`` that is not an hf_xformers one.
    """
    card = build_model_card(checkpoint_or_output_dir, card_data)
    path = Path(checkpoint_or_output_dir) / "README.md"
    card.save(str(path))
    return path


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python -m hf_xformers.card --source DIR [--base_model ID] [--dataset ID] [--license L]``."""
    parser = argparse.ArgumentParser(
        prog="python -m hf_xformers.card",
        description="Write README.md (a Hub model card) for an hf_xformers checkpoint or training output folder: "
        "metadata (licence, tags, pipeline tag of the saved head, base model, data sets, model-index), how to load "
        "it, the architecture's text, the training hyperparameters and the evaluation results found in the folder.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--source", required=True, help="checkpoint folder or training --output_dir")
    parser.add_argument("--base_model", help="Hub id of the model it was converted or fine-tuned from")
    parser.add_argument("--dataset", action="append", dest="datasets", help="Hub id of a training data set (repeat)")
    parser.add_argument("--license", help="licence id (default: the architecture template's)")
    parser.add_argument("--model_name", help="name in the card and its model-index (default: the folder name)")
    args = parser.parse_args(argv)
    overrides = {key: getattr(args, key) for key in ("base_model", "datasets", "license", "model_name")}
    try:
        path = write_model_card(args.source, {k: v for k, v in overrides.items() if v is not None})
    except ValueError as error:
        parser.error(str(error))
    print(f"Wrote {path}")


if __name__ == "__main__":
    main()
