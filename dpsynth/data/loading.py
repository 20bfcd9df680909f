"""What a run asks for: the private train/val/test splits and the public dataset.

Split protocol (DESIGN.md "Evaluation protocol", after DPImageBench): generators see only
``train``; ``val`` is the dataset's own validation split when it has one, otherwise a
class-stratified hold-out carved from train with a fixed seed (MNIST family 55k/5k, CIFAR
45k/5k, others 10 %); ``test`` is the official test split. Splitting reads labels only to
stratify; it is a fixed, data-independent partition of the records, not a DP mechanism, and
every later read of train/val goes through the privacy ledger.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.data.dataset import ImageDataset, PrivateSplits
from dpsynth.data.readers.common import check_no_empty_class
from dpsynth.data.registry import accepted_options, load_dataset, parse_spec, resolve
from dpsynth.data.transforms import prepare, resolve_holdout, stratified_split, stratified_subset
from dpsynth.errors import DataError

DEFAULT_TEST_SIZE = 0.1  # carved from train only when a dataset has no test split


def _reader_options(spec: str | Path, image_size: int | None, options: dict[str, Any]) -> dict[str, Any]:
    """Pass ``image_size`` to readers that resize while reading (CelebA, folders, glyphs) to save memory."""
    _, _, spec_options, _ = resolve(spec)
    if image_size is None or "image_size" in options or "image_size" in spec_options:
        return dict(options)
    if _takes_image_size(spec):
        return {**options, "image_size": int(image_size)}
    return dict(options)


def _takes_image_size(spec: str | Path) -> bool:
    loader, _, _, entry = resolve(spec)
    accepted = accepted_options(loader)
    if accepted is not None:
        return "image_size" in accepted
    from dpsynth.data.readers import FORMATS, detect_format

    module = FORMATS.get(detect_format(Path(parse_spec(spec)[0]).expanduser()))
    return module is not None and "image_size" in inspect.signature(module.read).parameters


def _same_classes(splits: dict[str, ImageDataset]) -> dict[str, ImageDataset]:
    """Give every split the largest class count and the train class names."""
    num_classes = max(ds.num_classes for ds in splits.values())
    names = splits["train"].class_names if splits["train"].num_classes == num_classes else None
    return {
        key: ds if ds.num_classes == num_classes and ds.class_names == names
        else ImageDataset(ds.images, ds.labels, num_classes, ds.name, names)
        for key, ds in splits.items()
    }


def _named(dataset: ImageDataset, split: str, base: str) -> ImageDataset:
    return ImageDataset(dataset.images, dataset.labels, dataset.num_classes, f"{base}-{split}", dataset.class_names)


def load_private(
    spec: str | Path,
    image_size: int | None = None,
    channels: int | None = None,
    val_size: int | float | None = None,
    split_seed: int = 0,
    max_train: int | None = None,
    test_size: int | float = DEFAULT_TEST_SIZE,
    **options: Any,
) -> PrivateSplits:
    """The private splits of ``spec``, resized to ``image_size`` and converted to ``channels``.

    Args:
        val_size: ``None`` uses the dataset's own val split, or else its default hold-out
            (5,000 for MNIST-family and CIFAR, 10 % otherwise); a count or a fraction always
            carves val from train, stratified with ``split_seed``.
        max_train: keep a class-stratified subset of this many training examples (smoke runs).
        test_size: hold-out carved from train when the dataset has no test split.
        options: reader options (``size``, ``attribute``, ``root``, ...).
    """
    _, splits, _, entry = resolve(spec)
    options = _reader_options(spec, image_size, options)
    base = entry.info.name if entry else Path(str(spec)).name
    train = load_dataset(spec, "train", **options)
    if "test" in splits:
        test = load_dataset(spec, "test", **options)
    else:
        keep, held = stratified_split(train.labels, train.num_classes, resolve_holdout(test_size, len(train)),
                                      seed=split_seed + 1000)
        train, test = train.subset(keep), train.subset(held)
    if val_size is None and "val" in splits:
        val = load_dataset(spec, "val", **options)
    else:
        default = entry.val_size if entry else 0.1
        holdout = resolve_holdout(val_size if val_size is not None else default, len(train))
        keep, held = stratified_split(train.labels, train.num_classes, holdout, seed=split_seed)
        train, val = train.subset(keep), train.subset(held)
    parts = _same_classes({"train": train, "val": val, "test": test})
    train = parts["train"]
    check_no_empty_class(train.labels, train.class_names or [str(c) for c in range(train.num_classes)],
                         f"{base} train split")
    if max_train is not None:
        if int(max_train) < train.num_classes:
            raise DataError(f"max_train={max_train} is smaller than the {train.num_classes} classes")
        if int(max_train) < len(train):
            train = train.subset(stratified_subset(train.labels, train.num_classes, int(max_train), split_seed))
    parts["train"] = train
    prepared = {k: _named(prepare(ds, image_size, channels), k, base) for k, ds in parts.items()}
    return PrivateSplits(prepared["train"], prepared["val"], prepared["test"])


def load_public(
    spec: str | Path,
    image_size: int | None = None,
    channels: int | None = None,
    max_size: int | None = None,
    seed: int = 0,
    **options: Any,
) -> ImageDataset:
    """The public dataset (its train split): free to use, never charged to the privacy ledger.

    ``max_size`` caps the number of examples: generated datasets produce exactly that many,
    others keep a class-stratified subset drawn with ``seed``.
    """
    loader, _, spec_options, _ = resolve(spec)
    options = _reader_options(spec, image_size, options)
    accepted = accepted_options(loader)
    generated = accepted is not None and "size" in accepted
    if max_size is not None and generated and "size" not in options and "size" not in spec_options:
        options["size"] = int(max_size)
    public = load_dataset(spec, "train", **options)
    if max_size is not None and int(max_size) < len(public):
        if int(max_size) < 1:
            raise DataError(f"max_size must be positive, got {max_size}")
        public = public.subset(stratified_subset(public.labels, public.num_classes, int(max_size), seed))
    return prepare(public, image_size, channels)


def describe_counts(dataset: ImageDataset) -> str:
    """``"7000 images, 10 classes (min 604, max 789 per class)"``, for logs."""
    counts = np.bincount(dataset.labels, minlength=dataset.num_classes)
    return f"{len(dataset)} images, {dataset.num_classes} classes (min {counts.min()}, max {counts.max()} per class)"
