"""The image dataset every part of dpsynth exchanges (docs/architecture.md, "Images and datasets").

Images are kept as ``uint8 [N, H, W, C]`` (the ``samples.npz`` contract) so that a dataset, a
synthetic sample set and a file on disk all look the same; models get float tensors through
:meth:`ImageDataset.to_tensors`, or a batch at a time through :meth:`ImageDataset.batch_tensors`.

The images may be a ``numpy.memmap`` of a shard on disk (:mod:`dpsynth.data.shards`): the dataset then
holds the map without reading it, and a subset of it is a *row selection* of that map (the selected
positions, never a copy of their pixels), so a private set far larger than memory can be split,
Poisson-sampled and trained on batch by batch (the records of a batch are read from the map's file by
positional reads, :func:`read_rows`, so no page of the map becomes resident). Reading
:attr:`ImageDataset.images` of such a selection copies the selected records into memory once (what a
subset always did): code that must stay flat in memory uses :meth:`~ImageDataset.batch_tensors`,
:meth:`~ImageDataset.chunks` and :attr:`~ImageDataset.record_keys` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dpsynth.data.splits import CONTENT_KEY_CHUNK, content_keys
from dpsynth.data.tensors import uint8_to_tensor
from dpsynth.errors import DataError

if TYPE_CHECKING:  # torch is imported lazily: listing datasets must not pay for it
    import torch


#: ``store_keys()``: the content keys of every record of a dataset's image store (a shard's cached keys).
KeySource = Callable[[], np.ndarray]


class ImageDataset:
    """A labelled image dataset: ``images`` uint8 [N, H, W, C], ``labels`` int64 [N] in [0, num_classes).

    Construction validates everything a later stage would otherwise trip over and raises
    :class:`~dpsynth.errors.DataError` with a one-line message. ``images`` may be a ``numpy.memmap``,
    held without a copy; ``rows`` (keyword only, set by :meth:`subset` of a memory-mapped dataset) selects
    the records of ``images`` this dataset holds, and ``store_keys`` returns the content keys of every
    record of ``images`` (a shard's cache, :func:`dpsynth.data.shards.read`), so that
    :attr:`record_keys` never hashes what is already known.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        num_classes: int,
        name: str = "dataset",
        class_names: list[str] | None = None,
        *,
        rows: np.ndarray | None = None,
        store_keys: KeySource | None = None,
    ) -> None:
        self.name, self.num_classes = name, num_classes
        self._store = _validated_images(images, name)
        self._rows = None if rows is None else _validated_rows(rows, len(self._store), name)
        self._store_keys = store_keys
        count = len(self._store) if self._rows is None else len(self._rows)
        self.labels = _validated_labels(labels, count, num_classes, name)
        self.class_names = None if class_names is None else [str(c) for c in class_names]
        if self.class_names is not None and len(self.class_names) != num_classes:
            raise DataError(f"{name}: {len(self.class_names)} class names for {num_classes} classes")

    def __repr__(self) -> str:
        kind = "memory-mapped " if self.memory_mapped else ""
        return (
            f"ImageDataset({self.name!r}, {len(self)} {kind}records of {self.image_shape}, {self.num_classes} classes)"
        )

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def memory_mapped(self) -> bool:
        """Whether the images are read from a ``numpy.memmap`` on demand rather than held in memory."""
        return isinstance(self._store, np.memmap)

    @property
    def rows(self) -> np.ndarray | None:
        """For a row selection of a memory-mapped store, the positions of this dataset's records in it."""
        return self._rows

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W), the shape of one image as a model sees it."""
        _, height, width, channels = self._store.shape
        return (channels, height, width)

    @property
    def images(self) -> np.ndarray:
        """uint8 [N, H, W, C]: the array itself (a memmap stays a memmap), or for a row selection of a
        memory-mapped store its records copied into memory, once."""
        if self._rows is None:
            return self._store
        return self._selected_images

    @functools.cached_property
    def _selected_images(self) -> np.ndarray:
        return self._store[self._rows]

    @functools.cached_property
    def record_keys(self) -> np.ndarray:
        """uint64 [N]: each record's content key (:func:`dpsynth.data.splits.content_keys`), which keys
        its per-record randomness in private training (:mod:`dpsynth.privacy.record_draws`) and its split.
        From the store's key source when it has one, else hashed a chunk of records at a time."""
        if self._store_keys is not None:
            keys = self._store_keys()
            return keys if self._rows is None else keys[self._rows]
        parts = [content_keys(images, labels) for images, labels in self.chunks()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)

    def subset(self, indices: Sequence[int] | np.ndarray, name: str | None = None) -> ImageDataset:
        """The examples at ``indices``, keeping classes and class names: copied from an in-memory dataset,
        a row selection (no pixel read) of a memory-mapped one."""
        index = np.asarray(indices, dtype=np.int64)
        name = name or self.name
        if not (self.memory_mapped or self._rows is not None):
            return ImageDataset(self._store[index], self.labels[index], self.num_classes, name, self.class_names)
        rows = index if self._rows is None else self._rows[index]
        return ImageDataset(
            self._store,
            self.labels[index],
            self.num_classes,
            name,
            self.class_names,
            rows=rows,
            store_keys=self._store_keys,
        )

    def renamed(self, name: str) -> ImageDataset:
        """The same records under another name (a row selection stays one)."""
        return ImageDataset(
            self._store,
            self.labels,
            self.num_classes,
            name,
            self.class_names,
            rows=self._rows,
            store_keys=self._store_keys,
        )

    def gather(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """uint8 [len(indices), H, W, C]: a copy of the images at ``indices``, read from the store (from a
        memory-mapped file, only those records: :func:`read_rows`)."""
        index = np.asarray(indices, dtype=np.int64)
        return read_rows(self._store, index if self._rows is None else self._rows[index])

    def chunks(self, size: int = CONTENT_KEY_CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(images, labels)`` of consecutive blocks of at most ``size`` records: the whole dataset in
        bounded memory (views of an in-memory array, copies read from a memory-mapped file)."""
        for start in range(0, len(self), size):
            stop = min(start + size, len(self))
            if self.memory_mapped or self._rows is not None:
                images = self.gather(np.arange(start, stop))
            else:
                images = self._store[start:stop]
            yield images, self.labels[start:stop]

    def batch_tensors(self, indices: torch.Tensor | Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 [B, C, H, W] in [-1, 1], int64 [B]) of the records at ``indices`` only: what a training
        step needs, without materialising the dataset (:meth:`to_tensors` converts every record)."""
        import torch

        index = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64)
        return uint8_to_tensor(self.gather(index)), torch.from_numpy(self.labels[index])

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 [N, C, H, W] scaled to [-1, 1], int64 [N]): pixel v maps to v / 127.5 - 1. Every record
        is converted: a memory-mapped dataset is read whole (training paths use :meth:`batch_tensors`)."""
        import torch

        return uint8_to_tensor(self.images), torch.from_numpy(self.labels.copy())


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What ``dpsynth datasets`` shows about a registered dataset.

    ``size`` is the total number of examples and ``splits`` the count per split
    (``{"train": 7000, ...}``; generated datasets give their default size); ``shape`` is (H, W, C);
    ``kind`` is ``"builtin"`` (ships with dpsynth), ``"generated"`` (made on first use) or
    ``"download"`` (the user fetches it, see :func:`dpsynth.data.download`).
    """

    name: str
    size: int
    shape: tuple[int, int, int]
    classes: int
    source: str
    licence: str
    kind: str
    description: str = ""
    splits: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        """A JSON-ready dict (for ``dpsynth datasets --json``)."""
        return {**dataclasses.asdict(self), "shape": list(self.shape)}


@dataclasses.dataclass
class PrivateSplits:
    """The private data of a run: ``train`` feeds the generator, ``val`` model selection, ``test`` evaluation."""

    train: ImageDataset
    val: ImageDataset
    test: ImageDataset

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.train.image_shape


def _validated_images(images: object, name: str) -> np.ndarray:
    if not isinstance(images, np.ndarray):
        raise DataError(f"{name}: images must be a numpy array, got {type(images).__name__}")
    if images.ndim != 4:
        raise DataError(f"{name}: images must have shape [N, H, W, C], got shape {images.shape}")
    if images.dtype != np.uint8:
        raise DataError(f"{name}: images must be uint8, got {images.dtype}")
    channels = images.shape[3]
    if channels not in (1, 3):
        raise DataError(f"{name}: images must have 1 or 3 channels, got {channels} (shape {images.shape})")
    if images.shape[1] == 0 or images.shape[2] == 0:
        raise DataError(f"{name}: images have an empty side, shape {images.shape}")
    return images


def read_rows(store: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``store[positions]``; for a whole memory-mapped file, by positional reads (``os.preadv``, one per run
    of consecutive positions) instead of page faults on the map.

    Why: the bytes are the same, but a fault maps the pages around the record too (the kernel's fault-around,
    which ``MADV_RANDOM`` does not stop), so the mapped resident pages grow with every record a run has ever
    touched: 1.3 GB after 100 Poisson batches of 256 from a 6 GB set (experiments/memmap_data.py), and each
    batch pays for new faults. Positional reads copy the records from the page cache and map nothing, at a
    cost that does not depend on N. A view of a memmap (a slice) falls back to indexing.
    """
    if not _whole_file_map(store) or not len(positions) or positions.min() < 0 or positions.max() >= len(store):
        return store[positions]  # numpy's indexing, and its IndexError for a bad position
    out = np.empty((len(positions), *store.shape[1:]), dtype=store.dtype)
    record = out[0].nbytes
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    with open(store.filename, "rb", buffering=0) as file:
        for start, stop in zip([0, *breaks], [*breaks, len(positions)]):
            want = (stop - start) * record
            if os.preadv(file.fileno(), [out[start:stop]], store.offset + int(positions[start]) * record) != want:
                raise DataError(f"{store.filename}: the file is shorter than its memory map (changed on disk?)")
    return out


def _whole_file_map(store: np.ndarray) -> bool:
    """Whether ``store`` is a C-contiguous ``numpy.memmap`` as opened (not a view of one), so that record i
    lies at ``offset + i * record bytes`` of ``filename``."""
    return (
        isinstance(store, np.memmap)
        and isinstance(store.base, mmap.mmap)
        and store.filename is not None
        and store.flags.c_contiguous
        and hasattr(os, "preadv")
    )


def _validated_rows(rows: object, count: int, name: str) -> np.ndarray:
    """The row selection as int32 when the store's positions fit (4 bytes a record instead of 8: at 2M
    records the selection is most of what a memory-mapped split holds in memory), else int64."""
    rows = np.asarray(rows)
    if rows.ndim != 1:
        raise DataError(f"{name}: a row selection must be a vector of positions, got shape {rows.shape}")
    if len(rows) and rows.dtype.kind not in "iu":
        raise DataError(f"{name}: a row selection must hold integer positions, got {rows.dtype}")
    if len(rows) and (rows.min() < 0 or rows.max() >= count):
        raise DataError(f"{name}: a row selection must lie in [0, {count})")
    return rows.astype(np.int32 if count <= np.iinfo(np.int32).max else np.int64, copy=False)


def _validated_labels(labels: object, count: int, num_classes: int, name: str) -> np.ndarray:
    if labels is None:
        raise DataError(f"{name}: labels are missing")
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"{name}: labels must have shape [N], got shape {labels.shape}")
    if len(labels) != count:
        raise DataError(f"{name}: {count} images but {len(labels)} labels")
    if labels.dtype.kind not in "iu":
        if labels.dtype.kind == "f" and np.all(np.isfinite(labels)) and np.all(labels == np.round(labels)):
            labels = labels.astype(np.int64)
        else:
            raise DataError(f"{name}: labels must be integers, got {labels.dtype}")
    if int(num_classes) < 1:
        raise DataError(f"{name}: num_classes must be at least 1, got {num_classes}")
    labels = labels.astype(np.int64)
    # the kind of problem only: a label value, the extremes or a count of bad labels are private
    if count and labels.min() < 0:
        raise DataError(f"{name}: labels must lie in [0, {num_classes}); a label is negative")
    if count and labels.max() >= num_classes:
        raise DataError(
            f"{name}: labels must lie in [0, {num_classes}); a label is {num_classes} or more "
            "(more classes than declared?)"
        )
    return labels
