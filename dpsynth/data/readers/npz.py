"""``.npz`` files: the ``samples.npz`` contract, and the format users hand dpsynth most easily.

Keys (``numpy.load(..., allow_pickle=False)``):

- ``images`` and ``labels``: the whole file is the ``train`` split; images shaped NHWC, NHW (grey)
  or NCHW (C in {1, 3});
- optionally ``split`` (int codes 0 train, 1 val, 2 test, as in ``mnist10k.npz``) to carry splits;
- or per-split keys ``train_images`` / ``train_labels``, ``val_images`` ..., ``test_images`` ...;
- or the DPImageBench samples layout: ``x`` (NCHW float in [0, 1]) and ``y`` (int labels), one split;
- optionally ``class_names`` (str array), ``num_classes`` (int) and ``pixel_range`` ([low, high]).

Pixel range: integer images are 0..255 by format; float images need a declared range (the
``pixel_range`` option, i.e. ``data.pixel_range``, or a ``pixel_range`` array in the file; the
``x``/``y`` layout declares [0, 1]). It is never inferred from the values, and a value outside it
(or NaN, or infinite) is an error that names the kind of problem, never the value or how many there
are. Channels come from the array's shape, never from its values.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers.common import dataset, first_line, require_path
from dpsynth.data.transforms import check_pixel_range, count_outside, float_to_uint8
from dpsynth.errors import DataError

SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
BENCH_KEYS = ("x", "y")  # DPImageBench samples: x NCHW float in [0, 1], y int labels
BENCH_RANGE = (0.0, 1.0)
UINT8_RANGE = (0.0, 255.0)
SAVEZ_HINT = "numpy.savez(PATH, images=..., labels=..., num_classes=K) writes one"


def _not_an_archive(path: Path) -> str | None:
    """Why ``path`` is not an ``.npz`` archive, or None when that is not the reason numpy could not read it.

    numpy falls back to unpickling a file that is neither an archive nor an ``.npy`` array, and its
    refusal then suggests ``allow_pickle``: the wrong fix for a file that is not an archive at all.
    """
    if not path.is_file() or zipfile.is_zipfile(path):
        return None
    with open(path, "rb") as handle:
        if handle.read(2) == b"PK":  # a damaged archive: numpy's own reason says more
            return None
    return f"not an .npz archive (images and labels saved together); {SAVEZ_HINT}"


def _open_archive(path: Path) -> Any:
    """numpy's lazy reader of the ``.npz`` at ``path`` (no pickles); DataError, with the fix, when it is none."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise DataError(f"{path}: {_not_an_archive(path) or 'cannot read it: ' + first_line(err)}") from None
    if isinstance(loaded, np.ndarray):
        raise DataError(f"{path}: a single .npy array, not an .npz archive of named arrays; {SAVEZ_HINT}")
    return loaded


def _array(archive: Any, key: str, path: Path) -> np.ndarray:
    """One array of an open archive; an object array (pickled) is refused with what to store instead."""
    try:
        return archive[key]
    except ValueError as err:
        if "allow_pickle" in str(err):  # what numpy.savez makes of a list of images of different sizes
            raise DataError(
                f"{path}: array '{key}' holds Python objects (images of different sizes?); store one numeric "
                "array [N, H, W(, C)] of equal-size images (resize them first), or use an image folder with "
                "data.image_size"
            ) from None
        raise DataError(f"{path}: cannot read array '{key}': {first_line(err)}") from None
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise DataError(f"{path}: cannot read array '{key}': {first_line(err)}") from None


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every array in an ``.npz`` file (no pickles)."""
    with _open_archive(path) as archive:
        return {key: _array(archive, key, path) for key in archive.files}


def splits(path: Path) -> list[str]:
    arrays = load_arrays(path)
    if "split" in arrays:
        return [s for s, code in SPLIT_CODES.items() if np.any(arrays["split"] == code)]
    per_split = [s for s in SPLIT_CODES if f"{s}_images" in arrays]
    return per_split or ["train"]


def array_keys(path: Path) -> list[str]:
    """The array names in an ``.npz`` file, without loading any array."""
    with _open_archive(path) as archive:
        return list(archive.files)


def declares_classes(path: Path) -> bool:
    """Whether the file states its classes (``class_names`` or ``num_classes``) instead of leaving them to labels."""
    return bool({"class_names", "num_classes"} & set(array_keys(path)))


def declared_range(arrays: dict[str, np.ndarray], pixel_range: object, source: str) -> tuple[float, float] | None:
    """The pixel range the file's format, its ``pixel_range`` array or the caller declares (they must agree)."""
    stated = [check_pixel_range(pixel_range)] if pixel_range is not None else []
    if "pixel_range" in arrays:
        stated.append(check_pixel_range(np.asarray(arrays["pixel_range"]).ravel().tolist()))
    if "x" in arrays and "images" not in arrays:
        stated.append(BENCH_RANGE)
    if len(set(stated)) > 1:
        raise DataError(f"{source}: conflicting pixel ranges declared: {sorted(set(stated))}")
    return stated[0] if stated else None


def to_nhwc_uint8(images: np.ndarray, source: str, pixel_range: object = None) -> np.ndarray:
    """uint8 [N, H, W, C] from uint8/integer/float NHWC, NHW or NCHW arrays, scaled from the declared range."""
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4:
        raise DataError(f"{source}: images must be [N, H, W, C] or [N, H, W], got shape {images.shape}")
    if images.shape[3] not in (1, 3) and images.shape[1] in (1, 3):
        images = images.transpose(0, 2, 3, 1)
    if images.shape[3] not in (1, 3):
        raise DataError(f"{source}: images must have 1 or 3 channels, got shape {images.shape}")
    if images.dtype.kind in "iu":
        if pixel_range is not None and check_pixel_range(pixel_range) != UINT8_RANGE:
            raise DataError(f"{source}: integer images are 0..255 by format; pixel_range {pixel_range} does not apply")
        if images.dtype == np.uint8:
            return np.ascontiguousarray(images)
        if count_outside(images, *UINT8_RANGE):  # the kind of problem only, never a value or a count
            raise DataError(
                f"{source}: integer images hold pixel values outside 0..255 (the format's range); store them "
                "as uint8 0..255, or as floats with their range declared in data.pixel_range"
            )
        return np.ascontiguousarray(images.astype(np.uint8))
    if images.dtype.kind == "f":
        if pixel_range is None:
            raise DataError(
                f"{source}: float images need a declared pixel range (data.pixel_range, e.g. [0, 1], "
                "[-1, 1] or [0, 255]); it is never inferred from the values"
            )
        try:
            return np.ascontiguousarray(float_to_uint8(images, pixel_range))
        except DataError as err:
            raise DataError(f"{source}: {err}") from None
    raise DataError(f"{source}: images must be numeric, got {images.dtype}")


def to_bench_arrays(images: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 NHWC images and labels as DPImageBench's ``gen.npz`` arrays: ``x`` float32 NCHW in [0, 1]
    (``pixel / 255``, which :func:`to_nhwc_uint8` maps back to the same bytes) and ``y`` int64."""
    if images.dtype != np.uint8 or images.ndim != 4:
        raise DataError(f"DPImageBench export expects uint8 [N, H, W, C] images, got {images.dtype} {images.shape}")
    x = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / np.float32(255.0)
    return {"x": x, "y": np.asarray(labels, dtype=np.int64)}


def read(
    path: Path, split: str = "train", pixel_range: list[float] | None = None, name: str | None = None
) -> ImageDataset:
    """Read one split of an ``.npz`` dataset; ``pixel_range`` declares the range of float images."""
    path = require_path(path)
    return read_arrays(load_arrays(path), path, split, pixel_range, name)


def read_arrays(
    arrays: dict[str, np.ndarray],
    path: Path,
    split: str = "train",
    pixel_range: list[float] | None = None,
    name: str | None = None,
) -> ImageDataset:
    """:func:`read` of the arrays already loaded from the ``.npz`` at ``path`` (named in errors)."""
    declared = declared_range(arrays, pixel_range, str(path))
    if "images" not in arrays and all(k in arrays for k in BENCH_KEYS):
        arrays = {**arrays, "images": arrays["x"], "labels": arrays["y"]}
    images_key, labels_key = (
        (f"{split}_images", f"{split}_labels") if f"{split}_images" in arrays else ("images", "labels")
    )
    if images_key not in arrays:
        found = ", ".join(sorted(arrays)) or "nothing"
        raise DataError(f"{path}: no '{images_key}' array (found {found}); {SAVEZ_HINT}")
    if labels_key not in arrays:
        raise DataError(f"{path}: labels missing (no '{labels_key}' array); {SAVEZ_HINT}")
    images = to_nhwc_uint8(arrays[images_key], str(path), declared)
    labels = np.asarray(arrays[labels_key])
    if labels.ndim == 2 and labels.shape[0] == len(images) and labels.shape[1] > 1:
        raise DataError(f"{path}: labels must be class indices [N], got one-hot/soft shape {labels.shape}")
    if images_key == "images" and "split" in arrays:
        if split not in SPLIT_CODES:
            raise DataError(f"{path}: unknown split '{split}'")
        keep = np.asarray(arrays["split"]) == SPLIT_CODES[split]
        if len(keep) != len(images):
            raise DataError(f"{path}: 'split' has {len(keep)} entries for {len(images)} images")
        if not keep.any():
            raise DataError(f"{path}: no '{split}' split")
        images, labels = images[keep], labels[keep] if len(labels) == len(keep) else labels
    elif images_key == "images" and split != "train":
        raise DataError(f"{path}: no '{split}' split (the file holds one set of images, the train split)")
    class_names = [str(c) for c in arrays["class_names"]] if "class_names" in arrays else None
    num_classes = int(arrays["num_classes"]) if "num_classes" in arrays else None
    return dataset(images, labels, name or path.stem, num_classes=num_classes, class_names=class_names)
