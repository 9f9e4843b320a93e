"""LRA image classification on grayscale pixel sequences (CIFAR-10 in LRA), and the image plumbing Pathfinder
shares: image folders (:func:`read_image_folder`), square sides from ``max_length``, pixels as ids."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from benchmarks.lra.task_data import (
    BYTE_VOCAB_SIZE,
    VALIDATION_NAMES,
    TaskData,
    carve,
    check_options,
    fill_missing_splits,
    pick_column,
    subset,
)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def image_side(task: str, max_length: int | None, smallest: int) -> int:
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


def pixels_example(pixels: np.ndarray, label: int) -> dict:
    """Row-major uint8 pixels -> ids ``pixel + 1`` (no padding: every pixel is a real token)."""
    ids = (pixels.astype(np.int64).reshape(-1) + 1).tolist()
    return {"input_ids": ids, "label": int(label), "length": len(ids)}


def to_gray(image, side: int) -> np.ndarray:
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
        split_dirs["validation"] = next((subfolders[n] for n in VALIDATION_NAMES if n in subfolders), None)
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
    splits, carved = fill_missing_splits(splits, eval_fraction, seed)
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
    check_options("image", options, ("hub_dataset", "hub_config", "image_column", "label_column", "eval_fraction"))
    side = image_side("image", max_length, 2)
    fraction = float(options.get("eval_fraction", 0.1))
    from PIL import Image

    if data_dir is not None:
        files, label_names, carved = read_image_folder(data_dir, seed=seed, eval_fraction=fraction)
        data = {}
        for split, rows in files.items():
            picked = subset(rows, num_train if split == "train" else num_eval, seed)
            examples = []
            for path, label in picked:
                with Image.open(path) as image:
                    examples.append(pixels_example(to_gray(image, side), label))
            data[split] = examples
        source = f"image folder {data_dir} (grayscale, resized to {side}x{side})"
        source += f" (carved from train: {', '.join(carved)})" if carved else ""
    elif options.get("hub_dataset"):
        data, label_names, source = _hub_images(options, side, fraction, seed, num_train, num_eval)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        pixels = np.clip(np.round(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
        rows = [(to_gray(Image.fromarray(img), side), int(label)) for img, label in zip(pixels, digits.target)]
        train, test = carve(rows, fraction, seed + 1)
        train, validation = carve(train, fraction, seed + 2)
        data = {
            "train": [pixels_example(p, y) for p, y in subset(train, num_train, seed)],
            "validation": [pixels_example(p, y) for p, y in subset(validation, num_eval, seed)],
            "test": [pixels_example(p, y) for p, y in subset(test, num_eval, seed)],
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
    image_key = pick_column(name, columns, options.get("image_column"), ("img", "image", "pixel_values"), "image")
    label_key = pick_column(name, columns, options.get("label_column"), ("label", "labels", "fine_label"), "label")
    feature = train_split.features[label_key]
    label_names = list(getattr(feature, "names", None) or [str(i) for i in sorted(set(train_split[label_key]))])
    rows: dict[str, list | None] = {}
    for split, keys in (("train", ("train",)), ("validation", VALIDATION_NAMES), ("test", ("test",))):
        key = next((k for k in keys if k in dataset), None)
        rows[split] = list(range(len(dataset[key]))) if key else None
        rows[f"{split}_key"] = key
    keys = {split: rows.pop(f"{split}_key") for split in ("train", "validation", "test")}
    index_rows = {split: [(keys[split] if rows[split] is not None else "train", i) for i in (rows[split] or [])] or None
                  for split in ("train", "validation", "test")}  # fmt: skip
    index_rows, carved = fill_missing_splits(index_rows, fraction, seed)
    data = {}
    for split, picked in index_rows.items():
        picked = subset(picked, num_train if split == "train" else num_eval, seed)
        data[split] = [
            pixels_example(to_gray(dataset[key][i][image_key], side), dataset[key][i][label_key]) for key, i in picked
        ]
    source = f"Hub dataset {name} (grayscale, {side}x{side})"
    source += f" (carved from train: {', '.join(carved)})" if carved else ""
    return data, label_names, source
