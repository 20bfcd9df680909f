"""Readers for datasets on disk, one module per format, and the dispatch from a path to its format.

Every reader exposes ``read(path, split="train", **options) -> ImageDataset`` and
``splits(path) -> list[str]``; :func:`detect_format` decides which one a path needs.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

from dpsynth.data import shards
from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers import camelyon, celeba, cifar, flat, folder, idx, npz
from dpsynth.data.readers.common import IMAGE_SUFFIXES, require_path
from dpsynth.errors import DataError

FORMATS: dict[str, ModuleType] = {
    "npz": npz,
    "idx": idx,
    "cifar": cifar,
    "celeba": celeba,
    "camelyon17": camelyon,
    "folder": folder,
    "flat": flat,
    "shards": shards,
}


def detect_format(path: Path) -> str:
    """The format of ``path``; the most specific layouts are tried first."""
    path = require_path(path)
    if path.is_file():
        if path.suffix.lower() == ".npz":
            return "npz"
        if idx.is_idx(path):
            return "idx"
        raise DataError(f"{path}: unsupported file; {_file_hint(path)}")
    checks = (
        ("camelyon17", camelyon.is_camelyon),
        ("celeba", celeba.is_celeba),
        ("cifar", cifar.is_cifar),
        ("idx", idx.is_idx),
        ("shards", shards.is_shards),
        ("folder", folder.is_folder_tree),
        ("flat", flat.is_flat_folder),
    )
    for name, check in checks:
        if check(path):
            return name
    if (path / "train.npz").is_file():
        return "npz-dir"
    if flat.has_loose_images(path):
        raise DataError(f"{path}: images with no labels; {flat.ADD_LABELS}")
    raise DataError(
        f"{path}: no dataset recognised (expected class sub-folders of images, IDX files, CIFAR batches, "
        f"CelebA or Camelyon17 layout, train.npz, or images with a {flat.LABELS_FILE})"
    )


#: what to do with a file dpsynth does not read, by its suffix
_ARCHIVE_SUFFIXES = (".zip", ".tar", ".tgz", ".gz", ".bz2", ".xz", ".7z")
_FOLDER_LAYOUT = "root/<class>/<image>.png, one sub-folder per class"


def _file_hint(path: Path) -> str:
    """The fix for a single file that is not a dataset: what to turn it into, by its kind."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return (
            "a single .npy array holds no labels: save images and labels together with "
            "numpy.savez(PATH.npz, images=..., labels=..., num_classes=K)"
        )
    if suffix in _ARCHIVE_SUFFIXES:
        return f"unpack the archive and point data.private at the folder ({_FOLDER_LAYOUT})"
    if suffix in IMAGE_SUFFIXES:
        return f"a single image is not a dataset: point data.private at a folder of them ({_FOLDER_LAYOUT})"
    return f"give an .npz file (images, labels), an IDX images file or a folder ({_FOLDER_LAYOUT})"


def _module_and_path(path: Path, split: str) -> tuple[ModuleType, Path, str]:
    fmt = detect_format(path)
    if fmt == "npz-dir":
        split_file = path / f"{split}.npz"
        if not split_file.is_file():
            raise DataError(f"{path}: no {split}.npz")
        return npz, split_file, "train"
    return FORMATS[fmt], path, split


def read_path(path: str | Path, split: str = "train", **options: Any) -> ImageDataset:
    """Read ``split`` of the dataset at ``path`` with the reader its format needs.

    Options a reader does not take are refused by name, so a typo is not silently ignored.
    """
    path = require_path(path)
    module, target, inner_split = _module_and_path(path, split)
    accepted = set(inspect.signature(module.read).parameters) - {"path", "split"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise DataError(
            f"option '{unknown[0]}' does not apply to {module.__name__.rsplit('.', 1)[1]} data; "
            f"accepted: {', '.join(sorted(accepted)) or 'none'}"
        )
    return module.read(target, inner_split, **options)


def declares_classes(path: str | Path, **options: Any) -> bool:
    """Whether the dataset at ``path`` states its classes in metadata (class names, a class count, a
    mapping file, class folders, a fixed format) instead of leaving the count to its largest label."""
    path = require_path(path)
    fmt = detect_format(path)
    if fmt == "npz-dir":
        return npz.declares_classes(path / "train.npz")
    if fmt == "npz":
        return npz.declares_classes(path)
    if fmt == "idx":
        return idx.declares_classes(path, options.get("subset"))
    if fmt == "flat":
        return False  # labels.csv names classes that only dataset.yaml declares
    return True  # CIFAR (meta file or fixed 10/100/20), CelebA, Camelyon17, folder names


def undeclared_classes_hint(path: str | Path) -> str:
    """Where the classes of ``path`` are missing from: what its format could have declared them in."""
    if detect_format(require_path(path)) == "flat":
        return f"{flat.LABELS_FILE} labels the records but lists no classes: put classes: [...] in its dataset.yaml"
    return "no class_names or num_classes array in the file, no mapping file"


def detected_channels(path: str | Path) -> bool:
    """Whether the format decides grey or colour from the image files' contents (image folders only)."""
    return detect_format(require_path(path)) in ("folder", "flat")


def path_splits(path: str | Path) -> list[str]:
    """The splits the dataset at ``path`` provides."""
    path = require_path(path)
    fmt = detect_format(path)
    if fmt == "npz-dir":
        return [s for s in ("train", "val", "test") if (path / f"{s}.npz").is_file()]
    return FORMATS[fmt].splits(path)
