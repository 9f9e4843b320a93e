"""LRA Pathfinder (the 32x32 task): are the two markers joined by one dashed path? A generator with exact labels
(:func:`generate_pathfinder`) and the loader of generated or image-folder data (:func:`load_pathfinder`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from benchmarks.lra.image import image_side, pixels_example, read_image_folder, to_gray
from benchmarks.lra.task_data import (
    BYTE_VOCAB_SIZE,
    TaskData,
    check_options,
    eval_counts,
    subset,
)

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
    check_options("pathfinder", options, (*generator_keys, "eval_fraction"))
    side = image_side("pathfinder", max_length, 16 if data_dir is None else 2)
    if data_dir is not None:
        from PIL import Image

        files, label_names, carved = read_image_folder(
            data_dir, class_ids=PATHFINDER_CLASS_IDS, seed=seed, eval_fraction=float(options.get("eval_fraction", 0.1))
        )
        data = {}
        for split, rows in files.items():
            examples = []
            for path, label in subset(rows, num_train if split == "train" else num_eval, seed):
                with Image.open(path) as image:
                    examples.append(pixels_example(to_gray(image, side), label))
            data[split] = examples
        source = f"Pathfinder image folder {data_dir} ({side}x{side} grayscale)"
        source += f" (carved from train: {', '.join(carved)})" if carved else ""
    else:
        num_train, num_eval = eval_counts(num_train, num_eval, 1000, 250)
        settings = {key: options[key] for key in generator_keys if key in options}
        data = {}
        for offset, (split, count) in enumerate((("train", num_train), ("validation", num_eval), ("test", num_eval))):
            images, labels, _ = generate_pathfinder(count, side=side, seed=seed * 3 + offset, **settings)
            order = np.random.default_rng(seed * 3 + offset).permutation(count)  # labels alternate: mix them
            data[split] = [pixels_example(images[i], labels[i]) for i in order]
        source = f"generated (seed {seed}): Pathfinder {side}x{side}, balanced" + (f", {settings}" if settings else "")
    return TaskData("pathfinder", data["train"], data["validation"], data["test"], 2, BYTE_VOCAB_SIZE, side * side,
                    image_shape=(side, side), source=source, label_names=("0", "1"))  # fmt: skip
