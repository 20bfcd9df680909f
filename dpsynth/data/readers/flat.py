"""A flat folder of images with a labels file: the layout of many exports and labelling tools::

    root/labels.csv        one row per image: its file name, its label (a header row names the columns)
    root/<image>.png       the images, directly inside root

``labels.csv``'s header names a file column (``file``, ``filename``, ``image``, ``path``, ``id`` or ``name``)
and a label column (``label``, ``class``, ``category`` or ``target``); other columns are ignored. A label
is a class name when the classes are named (``dataset.yaml``'s ``classes``, passed here as
``class_names``), otherwise a class index 0..K-1 (``num_classes`` declared). The classes are never read off
the labels (docs/privacy.md, "What is treated as public").

Nothing is lost or guessed: an image without a row, a row without an image, a file listed twice and a label
that is not a declared class each fail with one line naming ``labels.csv``'s row and the fix. A message
names row numbers and file names, never a label's value or a count of records.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers.common import (
    dataset,
    image_files,
    is_image_file,
    load_image_files,
    require_path,
)
from dpsynth.errors import DataError

LABELS_FILE = "labels.csv"
FILE_COLUMNS = ("file", "filename", "image", "path", "id", "name")
LABEL_COLUMNS = ("label", "class", "category", "target")
#: the fix for a flat folder with no labels, shared with the format dispatch
ADD_LABELS = (
    f"add {LABELS_FILE} (a header row 'file,label', then one row per image: its file name, its class) "
    "or sort the images into one sub-folder per class"
)


def has_loose_images(path: Path) -> bool:
    """Whether image files lie directly inside the folder ``path`` (stops at the first: format detection
    runs this on every lookup, and a flat folder may hold a million files)."""
    return path.is_dir() and any(is_image_file(child) for child in path.iterdir())


def is_flat_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding ``labels.csv`` and image files beside it."""
    return (path / LABELS_FILE).is_file() and has_loose_images(path)


def splits(path: Path) -> list[str]:
    return ["train"]


def read_rows(path: Path) -> list[tuple[str, str]]:
    """``(file name, label text)`` per data row of ``path/labels.csv``, in file order."""
    table = path / LABELS_FILE
    try:
        with table.open(newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{table}: cannot read it as CSV ({type(err).__name__})") from None
    if not rows:
        raise DataError(f"{table}: empty; {ADD_LABELS}")
    header = [cell.strip().lower() for cell in rows[0]]
    file_column = next((header.index(name) for name in FILE_COLUMNS if name in header), None)
    label_column = next((header.index(name) for name in LABEL_COLUMNS if name in header), None)
    if file_column is None or label_column is None:
        raise DataError(
            f"{table}: the first row must name a file column ({', '.join(FILE_COLUMNS)}) and a label column "
            f"({', '.join(LABEL_COLUMNS)}), e.g. 'file,label'"
        )
    width = max(file_column, label_column) + 1
    parsed = []
    for number, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue  # a blank line
        if len(row) < width or not row[file_column].strip() or not row[label_column].strip():
            raise DataError(f"{table}: row {number} lacks a file name or a label")
        parsed.append((row[file_column].strip(), row[label_column].strip()))
    if not parsed:
        raise DataError(f"{table}: a header and no rows; {ADD_LABELS}")
    return parsed


def listed_files(path: Path) -> list[Path]:
    """The image files ``labels.csv`` lists, in its row order (the record count needs nothing else)."""
    return [path / name for name, _ in read_rows(path)]


def read(
    path: Path,
    split: str = "train",
    image_size: int | None = None,
    grey: bool | None = None,
    name: str | None = None,
    class_names: Sequence[str] | None = None,
) -> ImageDataset:
    """Read the flat folder ``path`` (one split, ``train``); labels map through ``class_names`` when given."""
    path = require_path(path)
    if split != "train":
        raise DataError(f"{path}: a flat folder has one split, train; the test split is carved from it")
    rows = read_rows(path)
    files = _checked_files(path, [file_name for file_name, _ in rows])
    labels = _label_indices(path / LABELS_FILE, [label for _, label in rows], class_names)
    images = load_image_files(files, image_size=image_size, grey=grey)
    return dataset(images, labels, name or path.name, class_names=class_names)


def _checked_files(path: Path, names: list[str]) -> list[Path]:
    """The listed files, each an image directly in ``path``, listed once; every image there listed."""
    table = path / LABELS_FILE
    on_disk = {file.name for file in image_files(path)}
    seen: set[str] = set()
    for number, file_name in enumerate(names, start=2):
        if file_name in seen:
            raise DataError(f"{table}: row {number} lists {file_name} a second time; give each image one row")
        if file_name not in on_disk:
            raise DataError(
                f"{table}: row {number} lists {file_name}, which is not an image file directly in {path}; "
                "fix the name or remove the row"
            )
        seen.add(file_name)
    unlisted = sorted(on_disk - seen)
    if unlisted:
        raise DataError(
            f"{path}: image file(s) have no row in {LABELS_FILE} (first: {unlisted[0]}); "
            "add a row for each, or move them out of the folder"
        )
    return [path / file_name for file_name in names]


def _label_indices(table: Path, labels: list[str], class_names: Sequence[str] | None) -> np.ndarray:
    """Class indices of the label texts: names through ``class_names``, else integers (bounded later by
    the declared ``num_classes``, as every source's labels are)."""
    if class_names is not None:
        index = {class_name: position for position, class_name in enumerate(class_names)}
        for number, label in enumerate(labels, start=2):
            if label not in index:
                raise DataError(
                    f"{table}: the label of row {number} is not one of the {len(index)} classes declared in "
                    "dataset.yaml; fix the label or add the class to dataset.yaml's classes"
                )
        return np.asarray([index[label] for label in labels], dtype=np.int64)
    for number, label in enumerate(labels, start=2):
        if not label.isdigit():
            raise DataError(
                f"{table}: the label of row {number} is not a class index; name the classes in dataset.yaml "
                "(classes: [...], in label order) or write indices 0..K-1 with num_classes: K"
            )
    return np.asarray([int(label) for label in labels], dtype=np.int64)
