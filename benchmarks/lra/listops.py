"""LRA ListOps: nested ``[MIN``/``[MAX``/``[MED``/``[SM`` expressions over 0-9, label = their value.

A generator following LRA's rules (:func:`generate_listops`), an evaluator (:func:`evaluate_listops`), the reader
of the release's ``basic_{train,val,test}.tsv`` (:func:`read_listops_tsv`) and the task loader
(:func:`load_listops`).
"""

from __future__ import annotations

import csv
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.lra.task_data import (
    PAD_ID,
    TaskData,
    check_options,
    eval_counts,
    pad,
    subset,
)

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
    return {"input_ids": pad(ids, max_length), "label": label, "length": min(len(ids), max_length)}


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
    check_options(
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
            rows = subset(rows, count, seed) if count is not None else rows
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
    num_train, num_eval = eval_counts(num_train, num_eval, 2000, 500)
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
