"""Camelyon17 patches in the WILDS layout (camelyon17_v1.0, Koh et al. 2021).

Layout::

    metadata.csv    ",patient,node,x_coord,y_coord,tumor,slide,center,split" (first column: row index)
    patches/patient_004_node_4/patch_patient_004_node_4_x_3328_y_21792.png    96 x 96 RGB

The label is ``tumor`` (0/1). Splits follow the WILDS "official" scheme: hospitals (``center``)
0, 3, 4 are in-distribution, 1 is the OOD validation hospital and 2 the test hospital; within
the in-distribution hospitals, ``split`` 0 is train and 1 is the in-distribution validation.
dpsynth calls these ``train``, ``val`` (WILDS ``id_val``), ``ood_val`` (WILDS ``val``) and
``test``.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers.common import dataset, load_image_files, require_path
from dpsynth.errors import DataError

OOD_VAL_CENTER, TEST_CENTER = 1, 2
COLUMNS = ("patient", "node", "x_coord", "y_coord", "tumor", "center", "split")
CLASS_NAMES = ["normal", "tumor"]
SPLITS = ("train", "val", "ood_val", "test")


def is_camelyon(path: Path) -> bool:
    return path.is_dir() and (path / "metadata.csv").is_file() and (path / "patches").is_dir()


def patch_path(root: Path, patient: int, node: int, x: int, y: int) -> Path:
    folder = f"patient_{patient:03d}_node_{node}"
    return root / "patches" / folder / f"patch_{folder}_x_{x}_y_{y}.png"


def read_metadata(path: Path) -> dict[str, np.ndarray]:
    """The columns dpsynth needs from ``metadata.csv``, as int64 arrays."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{path}: missing column '{missing[0]}' (needs {', '.join(COLUMNS)})")
        rows = list(reader)
    columns = {}
    for column in COLUMNS:
        try:
            columns[column] = np.asarray([int(float(row[column])) for row in rows], dtype=np.int64)
        except (ValueError, TypeError, OverflowError):  # the column, never the value: a tumour label is private
            raise DataError(f"{path}: column '{column}' holds a value that is not a finite number") from None
    return columns


def split_mask(meta: dict[str, np.ndarray], split: str) -> np.ndarray:
    centre = meta["center"]
    in_distribution = (centre != OOD_VAL_CENTER) & (centre != TEST_CENTER)
    masks = {
        "train": in_distribution & (meta["split"] == 0),
        "val": in_distribution & (meta["split"] == 1),
        "ood_val": centre == OOD_VAL_CENTER,
        "test": centre == TEST_CENTER,
    }
    if split not in masks:
        raise DataError(f"Camelyon17 has no '{split}' split; use {', '.join(SPLITS)}")
    return masks[split]


def splits(path: Path) -> list[str]:
    meta = read_metadata(path / "metadata.csv")
    return [s for s in SPLITS if split_mask(meta, s).any()]


def read(path: Path, split: str = "train", image_size: int | None = None, name: str | None = None) -> ImageDataset:
    """Read one split; ``image_size`` resizes the 96 x 96 patches while reading."""
    path = require_path(path)
    if not is_camelyon(path):
        raise DataError(f"{path}: expected metadata.csv and patches/ (WILDS Camelyon17 layout)")
    meta = read_metadata(path / "metadata.csv")
    mask = split_mask(meta, split)
    if not mask.any():
        raise DataError(f"{path}: the '{split}' split is empty")
    files = [
        patch_path(path, int(p), int(n), int(x), int(y))
        for p, n, x, y in zip(meta["patient"][mask], meta["node"][mask], meta["x_coord"][mask], meta["y_coord"][mask])
    ]
    absent = next((f for f in files if not f.is_file()), None)
    if absent is not None:
        raise DataError(f"Camelyon17 patch missing: {absent}")
    images = load_image_files(files, image_size=image_size, grey=False)
    return dataset(images, meta["tumor"][mask], name or f"camelyon17-{split}", class_names=CLASS_NAMES)
