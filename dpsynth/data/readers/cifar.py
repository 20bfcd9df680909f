"""CIFAR-10 / CIFAR-100 "python version" batches (https://www.cs.toronto.edu/~kriz/cifar.html).

CIFAR-10: ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta``; CIFAR-100:
``train``, ``test`` and ``meta``. Each batch is a pickled dict with byte-string keys: ``data``
uint8 [N, 3072] (1024 red, 1024 green, 1024 blue values, row-major 32 x 32) and ``labels``
(CIFAR-10) or ``fine_labels`` / ``coarse_labels`` (CIFAR-100).

The pickles are read with an unpickler that only resolves the numpy names needed to rebuild
an array, so a tampered file cannot run code.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import numpy as np

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers.common import dataset, reason, require_path
from dpsynth.errors import DataError

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}
_SUBFOLDERS = ("cifar-10-batches-py", "cifar-100-python")


class _ArrayOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle API
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def load_pickle(path: Path) -> dict:
    """A CIFAR batch dict with str keys (the files were written by Python 2 with byte keys)."""
    try:
        with open(path, "rb") as handle:
            content = _ArrayOnlyUnpickler(io.BytesIO(handle.read()), encoding="bytes").load()
    except pickle.UnpicklingError as err:
        # the unpickler quotes the byte it choked on, which can be a pixel: only our own refusal is shown
        shown = str(err) if str(err).startswith("refusing to load") else "not a valid pickle"
        raise DataError(f"cannot read CIFAR batch {path}: {shown}") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise DataError(f"cannot read CIFAR batch {path}: {reason(err)}") from None
    if not isinstance(content, dict):
        raise DataError(f"{path}: a CIFAR batch must be a dict, got {type(content).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in content.items()}


def locate(path: Path) -> Path | None:
    """The folder holding the batches: ``path`` itself or its ``cifar-*-python`` subfolder."""
    for folder in (path, *(path / sub for sub in _SUBFOLDERS)):
        if folder.is_dir() and (
            (folder / "batches.meta").is_file()
            or (folder / "data_batch_1").is_file()
            or ((folder / "meta").is_file() and (folder / "train").is_file())
        ):
            return folder
    return None


def is_cifar(path: Path) -> bool:
    return path.is_dir() and locate(path) is not None


def _is_cifar100(folder: Path) -> bool:
    return (folder / "meta").is_file() and not (folder / "batches.meta").is_file()


def splits(path: Path) -> list[str]:
    folder = locate(path)
    if folder is None:
        return []
    found = []
    if _is_cifar100(folder):
        found = [s for s in ("train", "test") if (folder / s).is_file()]
    else:
        if list(folder.glob("data_batch_*")):
            found.append("train")
        if (folder / "test_batch").is_file():
            found.append("test")
    return found


def _batch_files(folder: Path, split: str) -> list[Path]:
    if _is_cifar100(folder):
        return [folder / split] if (folder / split).is_file() else []
    if split == "test":
        return [folder / "test_batch"] if (folder / "test_batch").is_file() else []
    numbered = [p for p in folder.glob("data_batch_*") if re.fullmatch(r"data_batch_\d+", p.name)]
    return sorted(numbered, key=lambda p: int(p.name.rsplit("_", 1)[1])) if split == "train" else []


def _decode(batch: dict, label_key: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    if "data" not in batch:
        raise DataError(f"{path}: no 'data' entry in the CIFAR batch")
    if label_key not in batch:
        raise DataError(f"{path}: labels missing (no '{label_key}' entry)")
    data = np.asarray(batch["data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: CIFAR data must be uint8 [N, 3072], got {data.dtype} {data.shape}")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, np.asarray(batch[label_key], dtype=np.int64)


def _names(folder: Path, key: str) -> list[str] | None:
    meta_path = folder / ("meta" if _is_cifar100(folder) else "batches.meta")
    if not meta_path.is_file():
        return None
    names = load_pickle(meta_path).get(key)
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names] if names is not None else None


def read(path: Path, split: str = "train", label: str = "fine", name: str | None = None) -> ImageDataset:
    """Read the ``train`` or ``test`` split. CIFAR-100 ``label`` is ``"fine"`` (100) or ``"coarse"`` (20)."""
    path = require_path(path)
    folder = locate(path)
    if folder is None:
        raise DataError(f"{path}: no CIFAR python batches (data_batch_1 / batches.meta or train / meta)")
    cifar100 = _is_cifar100(folder)
    if label not in ("fine", "coarse"):
        raise DataError(f"CIFAR-100 label must be 'fine' or 'coarse', got '{label}'")
    label_key = f"{label}_labels" if cifar100 else "labels"
    files = _batch_files(folder, split)
    if not files:
        raise DataError(f"{folder}: no '{split}' split; found {', '.join(splits(folder)) or 'none'}")
    parts = [_decode(load_pickle(f), label_key, f) for f in files]
    images = np.ascontiguousarray(np.concatenate([p[0] for p in parts]))
    labels = np.concatenate([p[1] for p in parts])
    class_names = _names(folder, f"{label}_label_names" if cifar100 else "label_names")
    # Without a meta file the class count is still fixed by the dataset, not by the labels seen.
    num_classes = None if class_names else ((100 if label == "fine" else 20) if cifar100 else 10)
    default_name = ("cifar100" if cifar100 else "cifar10") + f"-{split}"
    return dataset(images, labels, name or default_name, num_classes=num_classes, class_names=class_names)
