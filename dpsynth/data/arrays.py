"""In-memory arrays as private splits or a public dataset (the Python API's ``fit(images, labels)``).

The arrays are split by the same record-wise, content-keyed rule as a dataset on disk
(:mod:`dpsynth.data.splits`): each record's hold-out draw depends on its own content and the config only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpsynth.data.section import DataSection
from dpsynth.errors import DataError


def _array_masks(keys: np.ndarray, data_cfg: DataSection, num_classes: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The record-wise train mask and val/test hold-outs of in-memory examples with content keys ``keys``:
    the content-keyed split of :func:`dpsynth.data.loading.split_masks`."""
    from dpsynth.data.loading import DEFAULT_TEST_SIZE, resolve_val_size, split_masks

    return split_masks(
        keys,
        own_val=False,
        own_test=False,
        documented=None,
        val_size=resolve_val_size(data_cfg.val_size, None),
        test_size=DEFAULT_TEST_SIZE,
        max_train=data_cfg.max_train,
        split_seed=data_cfg.split_seed,
        num_classes=num_classes,
    )


def array_train_size(images: np.ndarray, labels: Any, data_cfg: DataSection) -> int:
    """The train size :func:`split_arrays` leaves of these arrays (their content keys decide the split)."""
    from dpsynth.data.splits import content_keys

    keys = content_keys(as_nhwc(images), np.asarray(labels, np.int64))  # the layout and dtype fit keys on
    return int(_array_masks(keys, data_cfg, num_classes=1)[0].sum())


def split_arrays(images: np.ndarray, labels: Any, num_classes: int | None, data_cfg: DataSection) -> Any:
    """Private train/val/test splits of in-memory arrays, by the protocol of ``load_private``: record-wise
    keyed hold-outs (10 % test, then ``data.val_size`` or 10 % val), ``data.max_train`` as a fraction."""
    from dpsynth.data.dataset import PrivateSplits
    from dpsynth.data.transforms import prepare

    dataset = as_dataset(images, labels, num_classes, "private")
    keep, carved = _array_masks(dataset.record_keys, data_cfg, dataset.num_classes)
    parts = (
        dataset.subset(np.flatnonzero(keep), "private-train"),
        dataset.subset(np.flatnonzero(carved["val"]), "private-val"),
        dataset.subset(np.flatnonzero(carved["test"]), "private-test"),
    )
    size, channels = data_cfg.image_size, data_cfg.channels
    return PrivateSplits(*(prepare(part, size, channels) for part in parts))


def as_dataset(images: Any, labels: Any, num_classes: int | None, role: str) -> Any:
    from dpsynth.data.dataset import ImageDataset

    if isinstance(images, tuple):
        images, labels = images
    images = as_nhwc(images)
    if labels is None:
        labels, num_classes = np.zeros(len(images), np.int64), 1 if num_classes is None else num_classes
    elif num_classes is None:
        if role == "private":
            raise DataError(
                "pass num_classes with private labels: a class count read off the labels would "
                "be a function of the private data"
            )
        num_classes = int(np.max(labels)) + 1 if len(labels) else 1
    return ImageDataset(images, np.asarray(labels, np.int64), int(num_classes), name=role)


def as_nhwc(images: Any) -> np.ndarray:
    """``[N, H, W]`` grey arrays as ``[N, H, W, 1]``; anything else as it is."""
    images = np.asarray(images)
    return images[..., None] if images.ndim == 3 else images
