"""Memory-mapped shards: a labelled uint8 image set on disk that trains with flat memory at any size.

A shard set is a directory (a ``data.private`` / ``data.public`` path like any other, recognised by its
``meta.json``)::

    OUT/meta.json             {"format": "dpsynth-shards", "version": 1, "height": H, "width": W,
                               "channels": C, "pixel_format": "uint8 NHWC, 0..255, C order",
                               "num_classes": K, "class_names": [...] | null,
                               "splits": {"train": N_train, "test": N_test, ...}}
    OUT/<split>/images.u8     N x H x W x C uint8, raw, row-major: read through numpy.memmap
    OUT/<split>/labels.npy    int64 [N]
    OUT/<split>/keys.npy      uint64 [N], the records' content keys (a private cache, below)
    OUT/<split>/keys.json     what the cached keys were computed from (sizes and mtimes of the files)

:func:`read` returns an :class:`~dpsynth.data.dataset.ImageDataset` that holds the memmap without
reading it; its subsets (the content-keyed train/val/test split of :func:`dpsynth.data.loading.load_private`)
are row selections of the map, and training reads one Poisson batch at a time
(:meth:`ImageDataset.batch_tensors`). The labels and the keys (16 bytes a record) are held in memory.

Content keys (:func:`dpsynth.data.splits.content_keys`, the hash of a record's pixel bytes, shape and label)
decide each record's split and key its per-record randomness; for a shard they are computed once, a
block of records at a time from ordinary reads of the file (so the resident memory stays one block, not
the pages of a whole map), and cached beside the images. They are a function of private content: the
cache lives with the data it describes, with the images file's permission bits, never in a user cache
directory; a cache whose files have changed since is recomputed. :func:`write_shards` computes them while
it writes.

Build a shard set from an iterable of images (any size, streamed) with :func:`write_shards`, or from any
dataset dpsynth reads (an ``.npz``, an image folder, a registered name; one split in memory at a time)
with :func:`dpsynth.data.make_shards.shards_from`, also ``python -m dpsynth.data.make_shards INPUT OUT``.
"""

from __future__ import annotations

import io
import json
import mmap
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.splits import CONTENT_KEY_CHUNK, content_keys
from dpsynth.errors import DataError

FORMAT, VERSION = "dpsynth-shards", 1
META, IMAGES, LABELS, KEYS, KEYS_META = "meta.json", "images.u8", "labels.npy", "keys.npy", "keys.json"
PIXEL_FORMAT = "uint8 NHWC, 0..255, C order"
SPLITS = ("train", "val", "test")


# -- reading ---------------------------------------------------------------------------------------


def is_shards(path: Path) -> bool:
    """Whether ``path`` is a shard directory (its ``meta.json`` names the format)."""
    meta = Path(path) / META
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_meta(path: Path) -> dict[str, Any]:
    """The validated ``meta.json`` of the shard directory ``path``."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot read {META} ({type(err).__name__})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"{path}: {META} is not a {FORMAT} v{VERSION} description")
    missing = [k for k in ("height", "width", "channels", "num_classes", "splits") if k not in meta]
    if missing:
        raise DataError(f"{path}: {META} lacks {', '.join(missing)}")
    return meta


def splits(path: Path) -> list[str]:
    """The splits the shard set holds, in train/val/test order."""
    return [s for s in SPLITS if s in read_meta(path)["splits"]]


def read(path: Path, split: str = "train", name: str | None = None) -> ImageDataset:
    """One split as an :class:`ImageDataset` over a read-only ``numpy.memmap`` (no pixel is read here)."""
    path = Path(path)
    meta = read_meta(path)
    if split not in meta["splits"]:
        raise DataError(f"{path}: no '{split}' split; available: {', '.join(splits(path))}")
    count, shape = int(meta["splits"][split]), _record_shape(meta)
    folder = path / split
    images = _open_images(folder / IMAGES, count, shape)
    labels = _load_labels(folder / LABELS, count)
    return ImageDataset(
        images,
        labels,
        int(meta["num_classes"]),
        name or f"{path.name}-{split}",
        meta.get("class_names"),
        store_keys=lambda: cached_keys(folder, count, shape),
    )


def _record_shape(meta: dict[str, Any]) -> tuple[int, int, int]:
    return int(meta["height"]), int(meta["width"]), int(meta["channels"])


def _open_images(file: Path, count: int, shape: tuple[int, int, int]) -> np.ndarray:
    expected = count * int(np.prod(shape))
    try:
        size = file.stat().st_size
    except OSError:
        raise DataError(f"{file}: missing") from None
    if size != expected:  # sizes only: the shapes are metadata
        raise DataError(f"{file}: {size} bytes, but {META} describes {count} records of {shape} ({expected} bytes)")
    if count == 0:  # numpy cannot map an empty file
        return np.zeros((0, *shape), dtype=np.uint8)
    images = np.memmap(file, dtype=np.uint8, mode="r", shape=(count, *shape))
    mapping = getattr(images, "_mmap", None)  # numpy's mmap.mmap object behind the array
    if mapping is not None and hasattr(mmap, "MADV_RANDOM"):
        # Poisson batches read scattered records: without this, each fault reads ahead ~128 KB around a
        # 3 KB record, multiplying the I/O and the resident pages by ~40 on a set larger than the page cache.
        mapping.madvise(mmap.MADV_RANDOM)
    return images


def _load_labels(file: Path, count: int) -> np.ndarray:
    try:
        labels = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"{file}: cannot read labels ({type(err).__name__})") from None
    if labels.shape != (count,):
        raise DataError(f"{file}: labels of shape {labels.shape}, but {META} describes {count} records")
    return labels


# -- content keys: computed in blocks, cached beside the shard --------------------------------------


def cached_keys(folder: Path, count: int, shape: tuple[int, int, int]) -> np.ndarray:
    """uint64 [count]: the content keys of the split in ``folder``, from its cache when that still describes
    the files (memory-mapped: a split's row selection gathers its keys from the file's pages instead of
    from an 8-bytes-a-record copy that glibc would keep resident once freed), else computed a block at a
    time and cached (when the folder is writable)."""
    stamp = _stamp(folder, count)
    try:
        if json.loads((folder / KEYS_META).read_text()) == stamp:
            keys = np.load(folder / KEYS, allow_pickle=False, mmap_mode="r")
            if keys.dtype == np.uint64 and keys.shape == (count,):
                return keys
    except (OSError, ValueError):
        pass  # no cache, or a broken one: recompute
    keys = _hash_file(folder / IMAGES, np.load(folder / LABELS, allow_pickle=False), shape)
    _store_keys(folder, keys, stamp)
    return keys


def _stamp(folder: Path, count: int) -> dict[str, Any]:
    """What the keys depend on, cheaply: the image and label files' sizes and modification times."""
    images, labels = (folder / IMAGES).stat(), (folder / LABELS).stat()
    return {
        "scheme": "content_keys/blake2b-64",
        "records": int(count),
        "images": [images.st_size, images.st_mtime_ns],
        "labels": [labels.st_size, labels.st_mtime_ns],
    }


def _hash_file(file: Path, labels: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """Content keys from ordinary reads of ``CONTENT_KEY_CHUNK`` records at a time: the resident memory
    is one block (the pages of a memmap read end to end would all count as resident)."""
    record = int(np.prod(shape))
    keys = np.empty(len(labels), dtype=np.uint64)
    with open(file, "rb") as stream:
        for start in range(0, len(labels), CONTENT_KEY_CHUNK):
            stop = min(start + CONTENT_KEY_CHUNK, len(labels))
            block = np.fromfile(stream, dtype=np.uint8, count=(stop - start) * record)
            keys[start:stop] = content_keys(block.reshape(stop - start, *shape), labels[start:stop])
    return keys


def _store_keys(folder: Path, keys: np.ndarray, stamp: dict[str, Any]) -> None:
    """Write the cache (keys first, then the stamp that validates them) with the images file's permission
    bits: the keys are as private as the pixels. A read-only folder keeps no cache."""
    mode = (folder / IMAGES).stat().st_mode & 0o666
    array = io.BytesIO()
    np.save(array, keys)
    try:
        _atomic_write(folder / KEYS, array.getvalue(), mode)
        _atomic_write(folder / KEYS_META, json.dumps(stamp).encode(), mode)
    except OSError:
        pass  # the data's folder is read-only: the keys are recomputed on the next read


def _atomic_write(target: Path, content: bytes, mode: int) -> None:
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_bytes(content)
    os.chmod(temporary, mode)
    os.replace(temporary, target)


# -- writing ---------------------------------------------------------------------------------------


def write_shards(
    images: Iterable[np.ndarray],
    labels: Sequence[int] | np.ndarray,
    out: str | Path,
    *,
    num_classes: int,
    class_names: Sequence[str] | None = None,
    split: str = "train",
) -> Path:
    """Write one split of a shard set from ``images`` (uint8 ``[H, W, C]`` images or ``[n, H, W, C]``
    blocks, streamed: never all in memory) and their ``labels``; return the split's folder.

    Further splits go into the same ``out`` with other ``split`` names; the image shape and the classes
    must agree with what ``meta.json`` already says. The content keys are computed as the blocks pass.
    """
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    out, labels = Path(out), np.asarray(labels, dtype=np.int64).reshape(-1)
    _check_classes(labels, num_classes, class_names)  # before anything is written
    folder = out / split
    folder.mkdir(parents=True, exist_ok=True)
    shape, written, keys = None, 0, []
    with open(folder / IMAGES, "wb") as stream:
        for block in images:
            block = _as_block(block, shape)
            shape = block.shape[1:]
            if written + len(block) > len(labels):
                raise DataError(f"more images than the {len(labels)} labels")
            stream.write(np.ascontiguousarray(block).tobytes())
            keys.append(content_keys(block, labels[written : written + len(block)]))
            written += len(block)
    if written != len(labels):
        raise DataError(f"{written} images but {len(labels)} labels")
    if shape is None:
        raise DataError("no images to write")
    np.save(folder / LABELS, labels)
    _update_meta(out, split, written, shape, num_classes, class_names)
    _store_keys(folder, np.concatenate(keys), _stamp(folder, written))
    return folder


def _as_block(block: np.ndarray, shape: tuple[int, ...] | None) -> np.ndarray:
    block = np.asarray(block)
    if block.ndim == 3:
        block = block[None]
    if block.dtype != np.uint8 or block.ndim != 4 or block.shape[3] not in (1, 3):
        raise DataError(
            f"images must be uint8 [H, W, C] or [n, H, W, C] with C 1 or 3, got {block.dtype} {block.shape}"
        )
    if shape is not None and block.shape[1:] != shape:
        raise DataError(f"images differ in shape: {block.shape[1:]} after {shape}")
    return block


def _check_classes(labels: np.ndarray, num_classes: int, class_names: Sequence[str] | None) -> None:
    if int(num_classes) < 1:
        raise DataError(f"num_classes must be at least 1, got {num_classes}")
    if class_names is not None and len(class_names) != num_classes:
        raise DataError(f"{len(class_names)} class names for {num_classes} classes")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):  # the kind of problem only
        raise DataError(f"labels must lie in [0, {num_classes})")


def _update_meta(
    out: Path, split: str, count: int, shape: tuple[int, ...], num_classes: int, class_names: Sequence[str] | None
) -> None:
    height, width, channels = (int(v) for v in shape)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "height": height,
        "width": width,
        "channels": channels,
        "pixel_format": PIXEL_FORMAT,
        "num_classes": int(num_classes),
        "class_names": None if class_names is None else [str(c) for c in class_names],
        "splits": {},
    }
    if (out / META).is_file():
        old = read_meta(out)
        mismatch = [k for k in ("height", "width", "channels", "num_classes", "class_names") if old.get(k) != meta[k]]
        if mismatch:
            raise DataError(f"{out}: split '{split}' disagrees with {META} on {', '.join(mismatch)}")
        meta["splits"] = old["splits"]
    meta["splits"][split] = count
    temporary = out / f".{META}.tmp"
    temporary.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(temporary, out / META)
