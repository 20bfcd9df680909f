"""The in-memory image dataset every part of dpsynth exchanges (docs/architecture.md, "Images and datasets").

Images are kept as ``uint8 [N, H, W, C]`` (the ``samples.npz`` contract) so that a dataset, a
synthetic sample set and a file on disk all look the same; models get float tensors through
:meth:`ImageDataset.to_tensors`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dpsynth.data.splits import content_keys
from dpsynth.data.tensors import uint8_to_tensor
from dpsynth.errors import DataError

if TYPE_CHECKING:  # torch is imported lazily: listing datasets must not pay for it
    import torch


@dataclasses.dataclass
class ImageDataset:
    """A labelled image dataset: ``images`` uint8 [N, H, W, C], ``labels`` int64 [N] in [0, num_classes).

    Construction validates everything a later stage would otherwise trip over and raises
    :class:`~dpsynth.errors.DataError` with a one-line message.
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    name: str = "dataset"
    class_names: list[str] | None = None

    def __post_init__(self) -> None:
        self.images = _validated_images(self.images, self.name)
        self.labels = _validated_labels(self.labels, len(self.images), self.num_classes, self.name)
        if self.class_names is not None:
            self.class_names = [str(c) for c in self.class_names]
            if len(self.class_names) != self.num_classes:
                raise DataError(f"{self.name}: {len(self.class_names)} class names for {self.num_classes} classes")

    def __len__(self) -> int:
        return len(self.images)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W), the shape of one image as a model sees it."""
        _, height, width, channels = self.images.shape
        return (channels, height, width)

    @functools.cached_property
    def record_keys(self) -> np.ndarray:
        """uint64 [N]: each record's content key (:func:`dpsynth.data.splits.content_keys`), which keys
        its per-record randomness in private training (:mod:`dpsynth.privacy.record_draws`)."""
        return content_keys(self.images, self.labels)

    def subset(self, indices: Sequence[int] | np.ndarray, name: str | None = None) -> ImageDataset:
        """The examples at ``indices`` (copied), keeping classes and class names."""
        index = np.asarray(indices, dtype=np.int64)
        return ImageDataset(
            images=self.images[index],
            labels=self.labels[index],
            num_classes=self.num_classes,
            name=name or self.name,
            class_names=self.class_names,
        )

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 [N, C, H, W] scaled to [-1, 1], int64 [N]): pixel v maps to v / 127.5 - 1."""
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
