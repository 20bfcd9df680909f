"""IDX files: MNIST, Fashion-MNIST, KMNIST and EMNIST (gzipped or not).

Format (http://yann.lecun.com/exdb/mnist/): a big-endian header ``0x00 0x00 <type> <ndim>``
followed by ``ndim`` uint32 sizes, then the data in C order. Images are ``idx3`` (N, rows,
cols) and labels ``idx1`` (N). EMNIST stores each image transposed (column-major), so its
images are transposed back; its ``*-mapping.txt`` maps stored labels to character codes
(``letters`` labels run 1..26 and are mapped to 0..25).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers.common import dataset, read_bytes, require_path
from dpsynth.errors import DataError

_IMAGES = re.compile(r"^(?P<prefix>.*?)(?P<split>train|t10k|test)-images[-.]idx3-ubyte(\.gz)?$")
_SPLIT_ALIASES = {"train": "train", "t10k": "test", "test": "test"}
_TYPE_UINT8 = 0x08


def parse_idx(data: bytes, source: Path) -> np.ndarray:
    """The uint8 array stored in IDX bytes ``data``."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{source} is not an IDX file (bad magic number)")
    if data[2] != _TYPE_UINT8:
        raise DataError(f"{source}: only unsigned-byte IDX data is supported, found type 0x{data[2]:02x}")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{source}: truncated IDX header")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape, dtype=np.int64))
    if len(data) - header != expected:
        raise DataError(f"{source}: IDX header promises {shape} ({expected} bytes), file holds {len(data) - header}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _image_files(folder: Path) -> dict[tuple[str, str], Path]:
    """{(prefix, split): images file} for every IDX image file in ``folder``."""
    found = {}
    for path in sorted(folder.iterdir()):
        match = _IMAGES.match(path.name)
        if match and path.is_file():
            found.setdefault((match["prefix"], _SPLIT_ALIASES[match["split"]]), path)
    return found


def labels_file(images_file: Path) -> Path:
    """The labels file next to an images file (same name, ``labels-idx1``)."""
    name = re.sub(r"images([-.])idx3", r"labels\1idx1", images_file.name)
    candidates = [
        images_file.with_name(name),
        images_file.with_name(name.removesuffix(".gz")),
        images_file.with_name(name.removesuffix(".gz") + ".gz"),
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise DataError(f"labels missing: no {name} next to {images_file}")


def is_idx(path: Path) -> bool:
    """Whether ``path`` is an IDX images file or a folder holding some."""
    if path.is_file():
        return bool(_IMAGES.match(path.name))
    return path.is_dir() and bool(_image_files(path))


def splits(path: Path) -> list[str]:
    """Splits available at ``path`` (a single file is the train split)."""
    if path.is_file():
        return ["train"]
    return sorted({split for _, split in _image_files(path)})


def declares_classes(path: Path, subset: str | None = None) -> bool:
    """Whether the class list comes from a mapping file (EMNIST) rather than from the largest label."""
    if path.is_file():
        images = path
    else:
        files = _image_files(path)
        prefix = _choose_prefix(files, subset, path) if files else ""
        images = next((f for (p, _), f in sorted(files.items()) if p == prefix), None)
        if images is None:
            return False
    return images.with_name(_IMAGES.match(images.name)["prefix"] + "mapping.txt").is_file()


def _choose_prefix(files: dict[tuple[str, str], Path], subset: str | None, folder: Path) -> str:
    prefixes = sorted({prefix for prefix, _ in files})
    if subset is not None:
        matching = [p for p in prefixes if p.rstrip("-_").endswith(subset) or p.rstrip("-_") == subset]
        if len(matching) != 1:
            raise DataError(
                f"{folder}: no IDX subset '{subset}'; found {', '.join(p.rstrip('-_') or '(none)' for p in prefixes)}"
            )
        return matching[0]
    if len(prefixes) > 1:
        raise DataError(
            f"{folder} holds several IDX datasets ({', '.join(p.rstrip('-_') for p in prefixes)}); "
            f"choose one with subset="
        )
    return prefixes[0]


def read_mapping(path: Path) -> tuple[np.ndarray, list[str]]:
    """EMNIST ``*-mapping.txt``: (stored label of each class, class names from the first char code)."""
    stored, names = [], []
    for line in path.read_text().splitlines():
        fields = line.split()
        if not fields:
            continue
        try:
            stored.append(int(fields[0]))
            names.append(chr(int(fields[1])))
        except (ValueError, IndexError):
            raise DataError(f"{path}: bad mapping line '{line}'") from None
    return np.asarray(stored, dtype=np.int64), names


def read(
    path: Path,
    split: str = "train",
    subset: str | None = None,
    transpose: bool | None = None,
    class_names: list[str] | None = None,
    name: str | None = None,
) -> ImageDataset:
    """Read one split of an IDX dataset from a folder (or one images file).

    ``subset`` picks among several datasets in one folder (EMNIST: ``letters``, ``balanced``, ...);
    ``transpose`` defaults to True for files whose name starts with ``emnist``.
    """
    path = require_path(path)
    if path.is_file():
        images_path = path
    else:
        files = _image_files(path)
        if not files:
            raise DataError(f"{path}: no *-images-idx3-ubyte files")
        prefix = _choose_prefix(files, subset, path)
        if (prefix, split) not in files:
            raise DataError(
                f"{path}: no '{split}' split; found {', '.join(sorted(s for p, s in files if p == prefix))}"
            )
        images_path = files[(prefix, split)]
    images = parse_idx(read_bytes(images_path), images_path)
    labels = parse_idx(read_bytes(labels_file(images_path)), labels_file(images_path)).astype(np.int64)
    if images.ndim != 3:
        raise DataError(f"{images_path}: expected idx3 images [N, rows, cols], got shape {images.shape}")
    if labels.ndim != 1:
        raise DataError(f"{images_path}: expected idx1 labels [N], got shape {labels.shape}")
    if transpose if transpose is not None else images_path.name.startswith("emnist"):
        images = images.transpose(0, 2, 1)
    mapping = images_path.with_name(_IMAGES.match(images_path.name)["prefix"] + "mapping.txt")
    if mapping.is_file():
        stored, mapped_names = read_mapping(mapping)
        labels = _remap(labels, stored, images_path)
        class_names = class_names or mapped_names
    return dataset(np.ascontiguousarray(images[..., None]), labels, name or images_path.stem, class_names=class_names)


def _remap(labels: np.ndarray, stored: np.ndarray, source: Path) -> np.ndarray:
    """Stored labels -> class indices 0..K-1 in mapping order."""
    lookup = {int(value): index for index, value in enumerate(stored)}
    if not np.isin(labels, stored).all():  # which label, or how many, is private: the kind of problem only
        raise DataError(f"{source}: a stored label is not in the mapping file ({len(stored)} classes mapped)")
    return np.asarray([lookup[int(v)] for v in labels], dtype=np.int64) if len(labels) else labels
