"""Fine-tune (or train from scratch) an image classifier with ``transformers.Trainer``.

Works with ``hfx-swin`` and with any model ``AutoModelForImageClassification`` can load. Data, in order of
precedence:

* ``--train_dir`` / ``--validation_dir``: ``imagefolder`` trees, one sub-folder per class
  (``train/cat/1.png``, ``train/dog/2.jpg`` ...);
* ``--dataset_name``: a Hub dataset with an image column and a label column (``--image_column_name``,
  ``--label_column_name``; found automatically when named ``image``/``img`` and ``label``/``labels``);
* neither: scikit-learn's ``load_digits()`` (1,797 real 8 x 8 grayscale digits, 10 classes), upscaled to
  ``--image_size`` RGB, so the script runs with no download at all.

Without a validation split, ``--train_val_split`` of the training data is held out (stratified). Training images
go through a random resized crop and (``--hflip_prob``) a horizontal flip, in PIL/NumPy; evaluation images are
resized. Without ``--model_name_or_path`` a new ``hfx-swin`` is built (``--config_overrides`` adjusts it) at a
resolution taken from the training images and a shape taken from the resolution (``swin_shape``: patch, window,
stages, width), and trained with from-scratch defaults (``SCRATCH_TRAINING``: learning rate 2e-3, 10 % warm-up,
cosine decay, weight decay 0.05, batch 32) for every one of these options the command line does not set; the log
says which were applied. The number of epochs follows ``--time_budget_minutes`` (10): a few timed training steps
tell how many epochs fit, so the cosine schedule ends when the time is up (``plan_epochs``). A pretrained model keeps
the Trainer's defaults.

``--output_dir`` ends up ready to upload: ``model.safetensors``, ``config.json`` (with ``id2label``),
``preprocessor_config.json``, ``README.md`` (model card with the metrics), ``train_results.json``,
``eval_results.json``, ``all_results.json`` and ``trainer_state.json``; ``--self_contained`` adds the model's code, so
the folder also loads with ``trust_remote_code=True`` where hf_xformers is not installed, and ``--push_to_hub``
uploads it.

Examples (see examples/README.md)::

    python -m examples.run_image_classification --output_dir out/digits --do_train --do_eval
    python -m examples.run_image_classification --train_dir data/train --validation_dir data/val \\
        --do_train --do_eval --output_dir out/my-images
    python -m examples.run_image_classification --model_name_or_path path/to/hfx-swin-tiny \\
        --train_dir data/train --validation_dir data/val --ignore_mismatched_sizes \\
        --do_train --do_eval --learning_rate 5e-5 --num_train_epochs 3 --output_dir out/my-classes
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import numpy as np
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, load_dataset
from datasets import Image as ImageFeature
from PIL import Image, ImageOps
from torch.utils.data import DataLoader
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageClassification,
    EvalPrediction,
    SchedulerType,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

import hf_xformers  # (also registers the hfx-* model types with the Auto classes)
from examples.utils_examples import (
    RunArguments,
    apply_scratch_defaults,
    check_world_size,
    explicit_options,
    finish_output_dir,
    hub_model_id,
    model_origin,
    parse_script_args,
    resume_checkpoint,
    setup_logging,
    take,
)

logger = logging.getLogger("run_image_classification")

DIGITS = "sklearn-digits"

# The shape of a new model follows Swin-T's plan at 224 pixels (4 x 4 patches -> 56 x 56 tokens, windows of 7, stages
# of 56, 28, 14 and 7 tokens a side, the last one a single window), scaled to the images: smaller images get smaller
# patches so that the first stage still has MIN_TOKENS_PER_SIDE tokens a side or more (the 8 x 8 or 7 x 7 tokens of
# the small ViTs for CIFAR and MNIST), and stages are added while the map is larger than one window. A 28-pixel digit:
# 4 x 4 patches, 7 x 7 tokens in one window, merged to 4 x 4. See swin_shape. Measured on 500 real MNIST digits, 8
# epochs: this shape (patch 4, width 64) reaches 0.42 accuracy, 2 x 2 patches of width 32 (14 x 14 tokens, twice the
# compute) 0.21: the coarser, wider model learns faster per step and per second.
MIN_TOKENS_PER_SIDE = 7
MAX_PATCH = 4  # Swin's own patch: larger images get more stages, not coarser tokens
MIN_STAGES, MAX_STAGES = 2, 4  # at least one merge: a wider, coarser map for the classifier
WINDOW_SIDES = (7, 8, 6, 5, 4)  # Swin's 7 where it tiles the map, else the nearest side that does (no padding)
SCRATCH_WIDTH = 64  # channels of the first stage; each later stage doubles them
HEAD_DIM = 32  # Swin-T's
BLOCKS_PER_STAGE = 2
MAX_EPOCHS = 100
# Timed training steps of the budget probe (after two untimed ones that warm up the kernels and the allocator).
PROBE_STEPS = 5


@dataclass
class ModelArguments:
    """Which model and image processor to train."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Local folder or Hub id of the model to fine-tune; without it a new hfx-swin is trained, with the "
            "from-scratch defaults of SCRATCH_TRAINING for every training option you do not set (see above)."
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": 'JSON of HfxSwinConfig fields for a new model, e.g. \'{"embed_dim": 48, "depths": [2, 2, 2]}\'.'
        },
    )
    image_processor_name: str | None = field(
        default=None, metadata={"help": "Image processor to use instead of the model's (folder or Hub id)."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Cache for downloaded models and datasets."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom code from the Hub (trusted repos only)."}
    )
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={"help": "Re-initialise a classifier whose size differs from the data's number of classes."},
    )
    time_budget_minutes: float = field(
        default=10.0,
        metadata={
            "help": "New model without --num_train_epochs/--max_steps: the whole run (data, training, evaluation) "
            f"should take about this long; the epochs (at most {MAX_EPOCHS}) are fitted to it from a few timed "
            "training steps, which also pick the faster of one thread and all of them."
        },
    )

    def __post_init__(self) -> None:
        if not self.time_budget_minutes > 0:
            raise ValueError(f"--time_budget_minutes must be positive, got {self.time_budget_minutes}.")


@dataclass
class DataTrainingArguments:
    """Which images and labels, and how to augment them."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset with images and labels."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of --dataset_name."})
    train_dir: str | None = field(default=None, metadata={"help": "imagefolder tree of training images."})
    validation_dir: str | None = field(default=None, metadata={"help": "imagefolder tree of evaluation images."})
    image_column_name: str | None = field(default=None, metadata={"help": "Image column (default: image or img)."})
    label_column_name: str | None = field(default=None, metadata={"help": "Label column (default: label or labels)."})
    train_val_split: float = field(
        default=0.15, metadata={"help": "Share of the training data held out when there is no validation split."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training images."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation images."})
    image_size: int | None = field(
        default=None,
        metadata={
            "help": "Training/evaluation resolution (default: the image processor's; for a new model, from the "
            "training images: their typical side rounded up to a multiple of 8, between 16 and 224; 32 for digits)."
        },
    )
    crop_scale_min: float | None = field(
        default=None,
        metadata={
            "help": "Random resized crop keeps between this share of the image area and all of it (default 0.5 when "
            "fine-tuning, 0.8 for a new model: small images and small data lose too much to strong crops)."
        },
    )
    hflip_prob: float | None = field(
        default=None,
        metadata={
            "help": "Probability of a horizontal flip in training (default 0.5; 0 for digits and grayscale images, "
            "whose mirror images are often other symbols)."
        },
    )
    no_augmentation: bool = field(default=False, metadata={"help": "Train on resized images, without crops or flips."})

    def __post_init__(self) -> None:
        if self.dataset_name and (self.train_dir or self.validation_dir):
            raise ValueError("Pass either --dataset_name or --train_dir/--validation_dir, not both.")
        if self.validation_dir and not self.train_dir:
            raise ValueError("--validation_dir needs --train_dir (the classes come from the training folders).")
        if not 0 < self.train_val_split < 1:
            raise ValueError(f"--train_val_split must lie in (0, 1), got {self.train_val_split}.")
        if self.crop_scale_min is not None and not 0 < self.crop_scale_min <= 1:
            raise ValueError(f"--crop_scale_min must lie in (0, 1], got {self.crop_scale_min}.")

    @property
    def source(self) -> str:
        return self.dataset_name or ("imagefolder" if self.train_dir else DIGITS)


# The Trainer's defaults (learning rate 5e-5, no warm-up, 3 epochs, batch 8) suit fine-tuning; a Swin trained from
# scratch on a few thousand small images needs a large learning rate with a warm-up and a decay to zero, like any
# small ViT (scikit-learn's digits as 28 x 28 PNGs: the Trainer's defaults reach 0.15 accuracy). The number of
# epochs is not among them: it follows --time_budget_minutes (plan_epochs).
SCRATCH_TRAINING = dict(
    learning_rate=2e-3, warmup_steps=0.1, lr_scheduler_type=SchedulerType.COSINE, weight_decay=0.05,
    per_device_train_batch_size=32,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def load_digits_dataset(image_size: int) -> DatasetDict:
    """scikit-learn's digits as RGB PIL images of ``image_size`` pixels, ``image``/``label`` columns, in one
    ``train`` split (the caller holds out the validation part)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Values 0..16 -> 0..255, nearest-neighbour upscaling keeps the strokes crisp.
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    images = [Image.fromarray(p).resize((image_size, image_size), Image.NEAREST).convert("RGB") for p in pixels]
    features = Features({"image": ImageFeature(), "label": ClassLabel(names=[str(d) for d in range(10)])})
    return DatasetDict(
        {"train": Dataset.from_dict({"image": images, "label": digits.target.tolist()}, features=features)}
    )


def load_splits(data_args: DataTrainingArguments, cache_dir: str | None, image_size: int) -> DatasetDict:
    """``train`` and (when the source has one) ``validation`` splits with their raw columns."""
    if data_args.train_dir:
        files = {"train": os.path.join(data_args.train_dir, "**")}
        if data_args.validation_dir:
            files["validation"] = os.path.join(data_args.validation_dir, "**")
        return load_dataset("imagefolder", data_files=files, cache_dir=cache_dir)
    if data_args.dataset_name:
        splits = load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache_dir)
        if "validation" not in splits and "test" in splits:
            splits["validation"] = splits["test"]
        return splits
    return load_digits_dataset(image_size)


def pick_column(dataset: Dataset, given: str | None, candidates: tuple[str, ...], what: str) -> str:
    """The column holding ``what``: ``given``, else the first of ``candidates`` present.

    Raises:
        ValueError: the column does not exist; the message lists the columns there are.
    """
    names = dataset.column_names
    if given is not None:
        if given not in names:
            raise ValueError(f"--{what}_column_name {given!r} is not a column of the data; columns: {names}.")
        return given
    for name in candidates:
        if name in names:
            return name
    raise ValueError(f"Found no {what} column among {names}; name it with --{what}_column_name.")


def prepare_splits(
    splits: DatasetDict, data_args: DataTrainingArguments, seed: int
) -> tuple[Dataset, Dataset, list[str]]:
    """``(train, validation, class names)`` with columns ``image`` and ``label`` (class ids).

    Raises:
        ValueError: no training split, or a label column that is neither class ids nor class names.
    """
    if "train" not in splits:
        raise ValueError(f"The data have no 'train' split (splits: {list(splits)}).")
    train = splits["train"]
    image_column = pick_column(train, data_args.image_column_name, ("image", "img"), "image")
    label_column = pick_column(train, data_args.label_column_name, ("label", "labels"), "label")
    splits = splits.select_columns([image_column, label_column])
    if label_column != "label":
        splits = splits.rename_column(label_column, "label")
    if image_column != "image":
        splits = splits.rename_column(image_column, "image")
    if not isinstance(splits["train"].features["label"], ClassLabel):
        splits = splits.class_encode_column("label")  # class names (or arbitrary ids) -> 0..n-1
    names = splits["train"].features["label"].names
    if "validation" in splits:
        validation = splits["validation"]
        if validation.features["label"] != splits["train"].features["label"]:
            raise ValueError(
                f"Validation classes {validation.features['label'].names} differ from the training classes {names}; "
                "give both folders the same class sub-folders."
            )
        return splits["train"], validation, names
    held_out = splits["train"].train_test_split(
        test_size=data_args.train_val_split, seed=seed, stratify_by_column="label"
    )
    return held_out["train"], held_out["test"], names


def random_resized_crop(
    image: Image.Image, size: int, scale: tuple[float, float], rng: random.Random, ratio=(3 / 4, 4 / 3)
) -> Image.Image:
    """A random crop covering ``scale`` of the area with aspect ratio in ``ratio``, resized to ``size`` x ``size``
    (bicubic). Falls back to the largest central crop within ``ratio`` after 10 misses (the usual recipe)."""
    width, height = image.size
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return image.resize((size, size), Image.BICUBIC, box=(left, top, left + w, top + h))
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return image.resize((size, size), Image.BICUBIC, box=(left, top, left + w, top + h))


class TrainTransform:
    """Random resized crop + horizontal flip (PIL), then the image processor's rescale and normalisation."""

    def __init__(self, processor, size: int, crop_scale_min: float, hflip_prob: float, seed: int) -> None:
        self.processor, self.size = processor, size
        self.scale = (crop_scale_min, 1.0)
        self.hflip_prob = hflip_prob
        self.rng = random.Random(seed)

    def augment(self, image: Image.Image) -> Image.Image:
        image = random_resized_crop(image.convert("RGB"), self.size, self.scale, self.rng)
        return ImageOps.mirror(image) if self.rng.random() < self.hflip_prob else image

    def __call__(self, batch: dict) -> dict:
        images = [self.augment(image) for image in batch["image"]]
        pixels = self.processor(images, do_resize=False, do_center_crop=False, return_tensors="pt")["pixel_values"]
        return {"pixel_values": list(pixels), "labels": batch["label"]}


class EvalTransform:
    """The image processor at ``size``: resize, rescale, normalise."""

    def __init__(self, processor, size: int) -> None:
        self.processor, self.size = processor, {"height": size, "width": size}

    def __call__(self, batch: dict) -> dict:
        images = [image.convert("RGB") for image in batch["image"]]
        pixels = self.processor(images, size=self.size, do_center_crop=False, return_tensors="pt")["pixel_values"]
        return {"pixel_values": list(pixels), "labels": batch["label"]}


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.stack([row["pixel_values"] for row in rows]),
        "labels": torch.tensor([row["labels"] for row in rows], dtype=torch.long),
    }


def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    return {"accuracy": float((np.argmax(logits, axis=-1) == prediction.label_ids).mean())}


# ---------------------------------------------------------------------------------------------------------------
# Model, processor and model card
# ---------------------------------------------------------------------------------------------------------------


def processor_size(processor) -> int | None:
    size = getattr(processor, "size", None) or {}
    size = size if isinstance(size, dict) else dict(size)
    return size.get("height") or size.get("shortest_edge")


def build_model_and_processor(model_args: ModelArguments, data_args: DataTrainingArguments, names: list[str]):
    """``(model, image processor, image size)`` for ``names`` classes."""
    labels = {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
    if model_args.model_name_or_path is None:
        overrides = json.loads(model_args.config_overrides) if model_args.config_overrides else {}
        image_size = data_args.image_size or 32
        config = hf_xformers.HfxSwinConfig(
            **{**swin_shape(image_size), "image_size": image_size, **overrides}, num_labels=len(names), **labels
        )
        logger.info(
            "New hfx-swin for %d pixels: patch %s, window %d, depths %s, embed_dim %d, num_heads %s (--config_overrides).",
            image_size, config.patch_size, config.window_size, config.depths, config.embed_dim, config.num_heads,
        )  # fmt: skip
        processor = hf_xformers.HfxSwinImageProcessor(size={"height": image_size, "width": image_size})
        return hf_xformers.HfxSwinForImageClassification(config), processor, image_size
    if model_args.config_overrides:
        raise ValueError("--config_overrides only applies to a new model; drop it or --model_name_or_path.")
    common = {"cache_dir": model_args.cache_dir, "trust_remote_code": model_args.trust_remote_code}
    config = AutoConfig.from_pretrained(
        model_args.model_name_or_path, num_labels=len(names), finetuning_task="image-classification", **labels, **common
    )
    model = AutoModelForImageClassification.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
        **common,
    )
    processor = AutoImageProcessor.from_pretrained(
        model_args.image_processor_name or model_args.model_name_or_path, **common
    )
    image_size = data_args.image_size or processor_size(processor) or 224
    if hasattr(processor, "size"):
        processor.size = {"height": image_size, "width": image_size}  # saved with the model: what it was tuned at
    return model, processor, image_size


def card_data(model_args: ModelArguments, data_args: DataTrainingArguments, names: list[str]) -> dict:
    """What the model card (``hf_xformers.card``) says about this run beyond what the output folder holds."""
    source = data_args.source
    described = {
        DIGITS: "scikit-learn's `load_digits()` (8 x 8 grayscale digits, upscaled to RGB)",
        "imagefolder": "local image folders (one folder per class)",
    }.get(source, f"the Hub dataset `{source}`")
    start = (
        f"fine-tuned from {model_origin(model_args.model_name_or_path)}"
        if model_args.model_name_or_path
        else "trained from scratch"
    )
    classes = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")
    return {
        "base_model": hub_model_id(model_args.model_name_or_path),
        "summary": f"An image classifier ({len(names)} classes: {classes}) {start} on {described}, with "
        "`examples/run_image_classification.py` of hf_xformers.",
        "datasets": [data_args.dataset_name] if data_args.dataset_name else None,
        "dataset_name": data_args.dataset_name or source,
        "dataset_type": data_args.dataset_name or "local",
        "dataset_config": data_args.dataset_config_name,
        "task_type": "image-classification",
    }


def _hflip_prob(data_args: DataTrainingArguments) -> float:
    if data_args.hflip_prob is not None:
        return data_args.hflip_prob
    return 0.0 if data_args.source == DIGITS else 0.5  # a mirrored digit is another symbol, or none


def _image_sample(train: Dataset, n: int = 64) -> list[Image.Image]:
    """Up to ``n`` training images spread over the split (undecoded formats are decoded by ``datasets``)."""
    step = max(1, len(train) // n)
    return [train[i]["image"] for i in range(0, len(train), step)][:n]


def patch_for(image_size: int) -> int:
    """Patch side of a new model: Swin's 4, or less where that would leave fewer than MIN_TOKENS_PER_SIDE tokens."""
    return max(1, min(MAX_PATCH, image_size // MIN_TOKENS_PER_SIDE))


def swin_shape(image_size: int) -> dict:
    """``HfxSwinConfig`` fields of a new model for ``image_size`` x ``image_size`` images (see MIN_TOKENS_PER_SIDE).

    The patch gives a first map of ``ceil(image_size / patch)`` tokens a side; the window is Swin's 7 where it tiles
    that map, else the nearest side in WINDOW_SIDES that does; a stage (half the side, twice the channels) is added
    while the map is larger than one window, from MIN_STAGES to MAX_STAGES. 28 pixels: patch 4, 7 x 7 tokens, window
    7, stages of 7 and 4 tokens a side; 32: patch 4, 8 x 8, window 8, stages of 8 and 4; 224: patch 4, 56 x 56,
    window 7, four stages (56, 28, 14, 7).
    """
    patch = patch_for(image_size)
    side = -(-image_size // patch)
    window = next((w for w in WINDOW_SIDES if side % w == 0), WINDOW_SIDES[0])
    stages = 1
    while stages < MIN_STAGES or (side > window and stages < MAX_STAGES):
        side, stages = -(-side // 2), stages + 1
    widths = [SCRATCH_WIDTH * 2**stage for stage in range(stages)]
    return dict(
        patch_size=patch, window_size=window, embed_dim=SCRATCH_WIDTH, depths=[BLOCKS_PER_STAGE] * stages,
        num_heads=[max(1, width // HEAD_DIM) for width in widths], drop_path_rate=0.1,
    )  # fmt: skip


def infer_image_size(images: list[Image.Image]) -> int:
    """A resolution for a new model: the median of the images' longer sides, between 16 and 224, rounded up to a
    multiple of the patch it gets (``patch_for``), so that no patch is padding."""
    sides = sorted(max(image.size) for image in images)
    side = min(224, max(16, sides[len(sides) // 2]))
    patch = patch_for(side)
    return int(-(-side // patch) * patch)


# ---------------------------------------------------------------------------------------------------------------
# The schedule of a new model: as many epochs as fit the time budget
# ---------------------------------------------------------------------------------------------------------------


def time_training_steps(
    model, dataset: Dataset, batch_size: int, steps: int = PROBE_STEPS, give_up_after: float = math.inf
) -> tuple[float, float]:
    """``(seconds per training step, seconds per image of an evaluation forward)``, measured on a copy of
    ``model`` (left untouched) with batches of ``dataset`` as the Trainer loads them: the transform, forward,
    backward, gradient clipping and an AdamW step. Two untimed steps first warm up kernels and the allocator; the
    median of ``steps`` timed ones ignores a stall of the machine. Stops early once a timed step exceeds
    ``give_up_after`` seconds (a thread count that has already lost)."""
    probe = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(probe.parameters(), lr=1e-6)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate)
    batches = iter(loader)

    def step() -> dict:
        nonlocal batches
        batch = next(batches, None)
        if batch is None:  # fewer images than probe steps: go round again
            batches = iter(loader)
            batch = next(batches)
        probe(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(probe.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return batch

    step()
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = step()
        times.append(time.perf_counter() - start)
        if times[-1] > give_up_after:
            break
    probe.eval()
    with torch.no_grad():
        start = time.perf_counter()
        probe(pixel_values=batch["pixel_values"])
        forward_seconds = (time.perf_counter() - start) / len(batch["labels"])
    return float(np.median(times)), forward_seconds


def plan_epochs(seconds: float, step_seconds: float, steps_per_epoch: int) -> tuple[int, int]:
    """``(num_train_epochs, max_steps)`` that fill ``seconds`` with steps of ``step_seconds``: whole epochs, from 1
    to MAX_EPOCHS, with ``max_steps = -1``; or, when not even one epoch fits, ``(1, the steps that fit)`` (at least
    one). The cosine schedule then ends when the time is up."""
    steps = int(seconds / step_seconds)
    if steps < steps_per_epoch:
        return 1, max(1, steps)
    return min(MAX_EPOCHS, steps // steps_per_epoch), -1


class StopAtDeadline(TrainerCallback):
    """Ends training at ``deadline`` (``time.monotonic()``) if the machine got slower than the timed steps said: the
    cosine schedule is then cut short near its end, and the run keeps to its budget."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() > self.deadline and not control.should_training_stop:
            logger.warning("Time budget spent: training stops at step %d of %d.", state.global_step, state.max_steps)
            control.should_training_stop = True
        return control


def fit_schedule_to_budget(
    model, train: Dataset, validation: Dataset | None, transform, training_args: TrainingArguments, seconds_left: float
) -> float:
    """Set ``num_train_epochs`` / ``max_steps`` of ``training_args`` so that training and the final evaluation take
    about ``seconds_left``; returns the seconds that the evaluation is expected to take. The timed steps run with every thread torch has and with one, and the faster count is
    kept: on a machine shared with other work, threads of small models mostly wait for each other."""
    batch_size = training_args.per_device_train_batch_size
    probe_data = train.with_transform(transform)  # its own random stream: the training crops stay as seeded
    timings = {}
    for threads in dict.fromkeys((1, torch.get_num_threads())):
        torch.set_num_threads(threads)
        fastest = min((timing[0] for timing in timings.values()), default=math.inf)
        timings[threads] = time_training_steps(model, probe_data, batch_size, give_up_after=2 * fastest)
    threads = min(timings, key=lambda count: timings[count][0])
    torch.set_num_threads(threads)
    step_seconds, forward_seconds = timings[threads]
    step_seconds *= training_args.gradient_accumulation_steps
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Every process must plan the same steps: the slowest one decides.
        slowest = torch.tensor([step_seconds, forward_seconds], dtype=torch.float64)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        step_seconds, forward_seconds = slowest.tolist()
    world = training_args.world_size
    batches = math.ceil(len(train) / (batch_size * world))
    steps_per_epoch = max(1, batches // training_args.gradient_accumulation_steps)
    eval_seconds = forward_seconds * len(validation) / world if validation is not None else 0.0
    # 5 % for what the probe does not see: the Trainer's bookkeeping, saving the model and the card.
    seconds = 0.95 * (seconds_left - eval_seconds)
    epochs, max_steps = plan_epochs(seconds, step_seconds, steps_per_epoch)
    training_args.num_train_epochs, training_args.max_steps = epochs, max_steps
    logger.info(
        "Time budget: %.3f s per step with %d thread(s) (%s), %d steps per epoch, %.0f s left for training -> %s "
        "(--time_budget_minutes; --num_train_epochs or --max_steps to set it yourself).",
        step_seconds, threads, ", ".join(f"{n}: {t[0]:.3f} s" for n, t in timings.items()), steps_per_epoch,
        seconds, f"{epochs} epochs" if max_steps < 0 else f"{max_steps} steps",
    )  # fmt: skip
    return eval_seconds


def resolve_augmentation(data_args: DataTrainingArguments, images: list[Image.Image], scratch: bool) -> None:
    """Fill in the augmentation settings the user left unset (see their ``--help``)."""
    if data_args.crop_scale_min is None:
        data_args.crop_scale_min = 0.8 if scratch else 0.5
    if data_args.hflip_prob is None:
        grayscale = bool(images) and all(image.mode in ("1", "L", "LA", "I", "I;16", "F") for image in images)
        data_args.hflip_prob = 0.0 if data_args.source == DIGITS or grayscale else 0.5


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    """``(ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments)`` from the command line
    (``argv``), or from a single ``.json`` file argument."""
    return parse_script_args((ModelArguments, DataTrainingArguments, TrainingArguments, RunArguments), argv, __doc__)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the script; returns the training and evaluation metrics (also written to ``output_dir``)."""
    started = time.monotonic()  # the time budget counts from here
    model_args, data_args, training_args, run_args = parse_args(argv)
    # The transforms need the raw `image` column; Trainer would drop it as unused by the model's forward.
    training_args.remove_unused_columns = False
    scratch = model_args.model_name_or_path is None
    setup_logging(training_args, logger)
    check_world_size(training_args)
    logger.info(
        "Data %s, model %s, output in %s",
        data_args.source,
        model_args.model_name_or_path or "new hfx-swin",
        training_args.output_dir,
    )
    checkpoint = resume_checkpoint(training_args, run_args.overwrite_output_dir)
    set_seed(training_args.seed)

    # Data first: a bad folder or column fails before any model is loaded.
    train, validation, names = load_data(model_args, data_args, training_args, argv)

    model, processor, image_size = build_model_and_processor(model_args, data_args, names)
    eval_transform = EvalTransform(processor, image_size)

    def train_transform(seed: int):
        if data_args.no_augmentation:
            return eval_transform
        return TrainTransform(processor, image_size, data_args.crop_scale_min, _hflip_prob(data_args), seed)

    train.set_transform(train_transform(training_args.seed))
    validation.set_transform(eval_transform)
    given = explicit_options(argv)
    budgeted = scratch and training_args.do_train and not {"num_train_epochs", "max_steps"} & given
    callbacks = []
    if budgeted:
        deadline = started + 60 * model_args.time_budget_minutes
        callbacks = fit_budget(model, train, validation, train_transform, training_args, checkpoint, deadline)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train if training_args.do_train else None,
        eval_dataset=validation if training_args.do_eval else None,
        processing_class=processor,
        data_collator=collate,
        compute_metrics=compute_metrics,
        callbacks=callbacks,
    )

    metrics: dict[str, float] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # model, config (with id2label) and image processor in output_dir
        train_metrics = {**result.metrics, "train_samples": len(train)}
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()
        metrics.update(train_metrics)
    if training_args.do_eval:
        eval_metrics = {**trainer.evaluate(), "eval_samples": len(validation)}
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)  # eval_results.json
        metrics.update(eval_metrics)
    if trainer.is_world_process_zero() and not training_args.do_train:  # evaluation only: still a usable folder
        trainer.save_model()
    # The model card (with --self_contained also the model code); --push_to_hub uploads the folder.
    budget = {"time_budget_minutes": model_args.time_budget_minutes} if budgeted else {}
    finish_output_dir(
        trainer,
        run_args,
        trained=training_args.do_train,
        extra_hyperparameters={"image_size": image_size, **augmentation_settings(data_args), **budget},
        **card_data(model_args, data_args, names),
    )
    return metrics


def load_data(
    model_args: ModelArguments,
    data_args: DataTrainingArguments,
    training_args: TrainingArguments,
    argv: list[str] | None,
):
    """``(train, validation, class names)``, cut to the ``--max_*_samples``; for a new model (no
    ``--model_name_or_path``) the scratch training defaults and, unless given, the image size from the training
    images; the augmentation settings left unset resolved from the images."""
    scratch = model_args.model_name_or_path is None
    with training_args.main_process_first(desc="loading data"):
        splits = load_splits(data_args, model_args.cache_dir, data_args.image_size or 32)
        train, validation, names = prepare_splits(splits, data_args, training_args.seed)
    train = take(train, data_args.max_train_samples)
    validation = take(validation, data_args.max_eval_samples)
    logger.info("%d training and %d evaluation images, %d classes", len(train), len(validation), len(names))
    sample = _image_sample(train) if data_args.source != DIGITS else []
    if scratch:
        apply_scratch_defaults(training_args, argv, SCRATCH_TRAINING, logger)
        if data_args.image_size is None and sample:
            data_args.image_size = infer_image_size(sample)
            logger.info("New model at %d pixels a side, from the training images (--image_size).", data_args.image_size)
    resolve_augmentation(data_args, sample, scratch)
    return train, validation, names


def fit_budget(
    model, train, validation, train_transform, training_args: TrainingArguments, checkpoint: str | None, deadline: float
) -> list:
    """Fit a new model's training schedule to the time left before ``deadline`` (``time.monotonic()`` seconds;
    ``train_transform(seed)`` makes the timing batches): sets ``training_args.max_steps`` (a resumed run keeps the
    one of the run it continues) and returns the callbacks that stop training in time for the evaluation."""
    if checkpoint is not None:  # a resumed run keeps the schedule of the run it continues
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            training_args.max_steps = json.load(f)["max_steps"]
        return []
    eval_seconds = fit_schedule_to_budget(
        model, train, validation if training_args.do_eval else None, train_transform(training_args.seed + 1),
        training_args, deadline - time.monotonic(),
    )  # fmt: skip
    if training_args.world_size > 1:  # processes that stopped at different steps would wait on each other
        return []
    return [StopAtDeadline(deadline - eval_seconds)]


def augmentation_settings(data_args: DataTrainingArguments) -> dict:
    """The training augmentation, as the model card lists it."""
    if data_args.no_augmentation:
        return {"augmentation": "none"}
    return {"crop_scale_min": data_args.crop_scale_min, "hflip_prob": _hflip_prob(data_args)}


if __name__ == "__main__":
    main()
