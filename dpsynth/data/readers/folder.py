"""Image-folder trees: one sub-folder per class, class names sorted (the torchvision ImageFolder layout).

Two layouts are recognised::

    root/<class>/<image>.png                    one split, called "train"
    root/{train,val,test}/<class>/<image>.png   one tree per split

Images are grey when every file is grey, RGB otherwise (alpha is dropped). All images must
have one size unless ``image_size`` is given, in which case each is centre-cropped to a square
and resized while it is read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers.common import (
    IMAGE_SUFFIXES,
    dataset,
    image_files,
    load_image_files,
    require_path,
)
from dpsynth.errors import DataError

SPLIT_FOLDERS = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "test"}


def _subfolders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _split_layout(path: Path) -> dict[str, Path] | None:
    """{split: folder} when every sub-folder of ``path`` is a split name and one is train."""
    folders = _subfolders(path)
    if folders and all(f.name.lower() in SPLIT_FOLDERS for f in folders):
        layout = {SPLIT_FOLDERS[f.name.lower()]: f for f in folders}
        if "train" in layout:
            return layout
    return None


def is_folder_tree(path: Path) -> bool:
    """Whether ``path`` looks like a class-per-folder tree (some sub-folder holds an image)."""
    if not path.is_dir():
        return False
    roots = list((_split_layout(path) or {"train": path}).values())
    return any(
        child.is_file() and child.suffix.lower() in IMAGE_SUFFIXES
        for root in roots
        for folder in _subfolders(root)
        for child in folder.iterdir()
    )


def splits(path: Path) -> list[str]:
    return sorted((_split_layout(path) or {"train": path}).keys())


def train_root(path: Path) -> Path:
    """The folder holding the train split's class folders: ``path/train`` in the split layout, else ``path``."""
    return (_split_layout(path) or {"train": path})["train"]


def class_names_of(path: Path) -> list[str]:
    """Class names: the sorted sub-folders of the train tree."""
    return [f.name for f in _subfolders(train_root(path))]


def read(
    path: Path,
    split: str = "train",
    image_size: int | None = None,
    grey: bool | None = None,
    name: str | None = None,
) -> ImageDataset:
    """Read one split; a class folder with no image in it declares a class with no record (not an error:
    whether a run exists must not depend on a per-class count)."""
    path = require_path(path)
    if not path.is_dir():
        raise DataError(f"{path} is not a folder of class sub-folders")
    layout = _split_layout(path) or {"train": path}
    if split not in layout:
        raise DataError(f"{path}: no '{split}' split; found {', '.join(sorted(layout))}")
    classes = class_names_of(path)
    if not classes:
        raise DataError(f"{path}: no class sub-folders")
    root = layout[split]
    files: list[Path] = []
    labels: list[int] = []
    for index, cls in enumerate(classes):
        folder = root / cls
        members = image_files(folder) if folder.is_dir() else []
        files += members
        labels += [index] * len(members)
    unknown = sorted({f.name for f in _subfolders(root)} - set(classes))
    if unknown:
        raise DataError(f"{root}: class folder '{unknown[0]}' does not exist in the train split")
    label_array = np.asarray(labels, dtype=np.int64)
    if not files:
        raise DataError(f"{root}: no images found ({', '.join(IMAGE_SUFFIXES)})")
    images = load_image_files(files, image_size=image_size, grey=grey)
    return dataset(images, label_array, name or path.name, class_names=classes)
