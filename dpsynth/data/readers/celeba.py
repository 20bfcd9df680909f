"""CelebA, aligned and cropped (http://mmlab.ie.cuhk.edu.hk/projects/CelebA.html).

Layout (``root`` or ``root/celeba``)::

    img_align_celeba/000001.jpg ...     178 x 218 RGB
    list_attr_celeba.txt                line 1: count; line 2: 40 attribute names;
                                        then "000001.jpg  -1  1 ..." (1 = has the attribute)
    list_eval_partition.txt (optional)  "000001.jpg 0" with 0 train, 1 val, 2 test

The label is one attribute (default ``Male``: class 0 "not Male", class 1 "Male"), or
``attribute="hair"``: 4 classes Black/Blond/Brown/Gray_Hair, keeping the images that carry
exactly one of them. Images are centre-cropped to ``crop`` (140, the usual face crop) and
resized to ``image_size`` (64) while reading, so the full 202,599 images fit in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers.common import dataset, load_image_files, require_path
from dpsynth.errors import DataError

ATTRIBUTES_FILE = "list_attr_celeba.txt"
PARTITION_FILE = "list_eval_partition.txt"
IMAGES_FOLDER = "img_align_celeba"
HAIR = ["Black_Hair", "Blond_Hair", "Brown_Hair", "Gray_Hair"]
PARTITION_CODES = {"train": 0, "val": 1, "test": 2}


def locate(path: Path) -> Path | None:
    for folder in (path, path / "celeba"):
        if (folder / ATTRIBUTES_FILE).is_file():
            return folder
    return None


def is_celeba(path: Path) -> bool:
    return path.is_dir() and locate(path) is not None


def read_attributes(path: Path) -> tuple[list[str], list[str], np.ndarray]:
    """(file names, attribute names, int8 [N, 40] of -1/1) from ``list_attr_celeba.txt``."""
    lines = path.read_text().splitlines()
    if len(lines) < 2:
        raise DataError(f"{path}: expected a count line and an attribute-name line")
    names = lines[1].split()
    files, rows = [], []
    for number, line in enumerate(lines[2:], start=3):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != len(names) + 1:
            raise DataError(f"{path}:{number}: expected {len(names) + 1} fields, found {len(fields)}")
        files.append(fields[0])
        try:
            rows.append([int(v) for v in fields[1:]])
        except ValueError:
            raise DataError(f"{path}:{number}: attribute values must be -1 or 1") from None
    return files, names, np.asarray(rows, dtype=np.int8).reshape(len(rows), len(names))


def read_partition(path: Path) -> dict[str, int]:
    """{file name: partition code} from ``list_eval_partition.txt``."""
    partition = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not fields[1].isdigit():
            raise DataError(f"{path}:{number}: expected '<file> <0|1|2>'")
        partition[fields[0]] = int(fields[1])
    return partition


def labels_for(attribute: str, names: list[str], values: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(keep mask, labels, class names) for one attribute or the 4-class ``hair`` variant."""
    if attribute == "hair":
        missing = [h for h in HAIR if h not in names]
        if missing:
            raise DataError(f"CelebA attributes lack {missing[0]}")
        has = values[:, [names.index(h) for h in HAIR]] == 1
        keep = has.sum(axis=1) == 1
        return keep, has.argmax(axis=1).astype(np.int64), [h.removesuffix("_Hair") for h in HAIR]
    if attribute not in names:
        raise DataError(f"unknown CelebA attribute '{attribute}'; choose 'hair' or one of {', '.join(names)}")
    column = values[:, names.index(attribute)]
    return np.ones(len(column), dtype=bool), (column == 1).astype(np.int64), [f"not {attribute}", attribute]


def splits(path: Path) -> list[str]:
    folder = locate(path)
    if folder is None:
        return []
    if not (folder / PARTITION_FILE).is_file():
        return ["train"]
    codes = set(read_partition(folder / PARTITION_FILE).values())
    return [s for s, c in PARTITION_CODES.items() if c in codes]


def read(
    path: Path,
    split: str = "train",
    attribute: str = "Male",
    image_size: int | None = 64,
    crop: int | None = 140,
    name: str | None = None,
) -> ImageDataset:
    """Read one split; without a partition file every image is in ``train``."""
    path = require_path(path)
    folder = locate(path)
    if folder is None:
        raise DataError(f"{path}: no {ATTRIBUTES_FILE}")
    files, names, values = read_attributes(folder / ATTRIBUTES_FILE)
    keep, labels, class_names = labels_for(attribute, names, values)
    if (folder / PARTITION_FILE).is_file():
        if split not in PARTITION_CODES:
            raise DataError(f"CelebA has no '{split}' split; use train, val or test")
        partition = read_partition(folder / PARTITION_FILE)
        code = PARTITION_CODES[split]
        keep &= np.asarray([partition.get(f, -1) == code for f in files], dtype=bool)
    elif split != "train":
        raise DataError(f"{folder}: no {PARTITION_FILE}, so only the 'train' split exists")
    chosen = [folder / IMAGES_FOLDER / f for f, k in zip(files, keep) if k]
    if not chosen:
        raise DataError(f"{folder}: no images in the '{split}' split for attribute '{attribute}'")
    images = load_image_files(chosen, image_size=image_size, grey=False, crop=crop)
    return dataset(images, labels[keep], name or f"celeba-{attribute}", class_names=class_names)
