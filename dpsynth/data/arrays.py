"""In-memory arrays as private splits or a public dataset (the Python API's ``fit(images, labels)``).

The arrays are split by the same record-wise, content-keyed rule as a dataset on disk
(:mod:`dpsynth.data.splits`): each record's hold-out draw depends on its own content and the config only.
They are declared like a file: the class count by ``num_classes`` (or ``data.num_classes``), the range
of float pixels by ``data.pixel_range``, and colour is dropped only with ``data.colour_to_grey``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpsynth.data.dataset import ImageDataset, PrivateSplits
from dpsynth.data.loading import (
    DECLARE_CLASSES,
    DEFAULT_TEST_SIZE,
    check_channels,
    check_records,
    resolve_val_size,
    split_masks,
)
from dpsynth.data.readers.npz import to_nhwc_uint8
from dpsynth.data.section import DataSection
from dpsynth.data.splits import content_keys
from dpsynth.data.transforms import prepare
from dpsynth.errors import DataError

#: how in-memory arrays are named in messages: they have no file name
ARRAYS_SOURCE = "the in-memory arrays"
#: the one wording of the missing labels of private arrays (fit and plan alike)
ARRAYS_NEED_LABELS = f"{ARRAYS_SOURCE}: private images need their labels: Synthesizer.fit(images, labels, ...)"


def _array_masks(keys: np.ndarray, data_cfg: DataSection, num_classes: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The record-wise train mask and val/test hold-outs of in-memory examples with content keys ``keys``:
    the content-keyed split of :func:`dpsynth.data.loading.split_masks`."""
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
        source=ARRAYS_SOURCE,
    )


def private_images(images: Any, data_cfg: DataSection) -> np.ndarray:
    """uint8 [N, H, W, C] private images from arrays as a user hands them over (NHWC, NHW or NCHW;
    uint8, integer 0..255, or float in ``data.pixel_range``), checked as a ``.npz`` file's are.

    :func:`array_train_size` and :func:`split_arrays` both key the records on this result, so a plan
    made from the arrays splits them exactly as the fit does.
    """
    return to_nhwc_uint8(as_array(images), ARRAYS_SOURCE, data_cfg.pixel_range)


def array_train_size(images: np.ndarray, labels: Any, data_cfg: DataSection) -> int:
    """The train size :func:`split_arrays` leaves of these arrays (their content keys decide the split)."""
    keys = content_keys(private_images(images, data_cfg), np.asarray(labels, np.int64))
    return int(_array_masks(keys, data_cfg, num_classes=1)[0].sum())


def split_arrays(images: np.ndarray, labels: Any, num_classes: int | None, data_cfg: DataSection) -> Any:
    """Private train/val/test splits of in-memory arrays, by the protocol of ``load_private``: record-wise
    keyed hold-outs (10 % test, then ``data.val_size`` or 10 % val), ``data.max_train`` as a fraction.
    ``num_classes`` None takes ``data.num_classes``; one of them must declare the class count."""
    if labels is None:
        raise DataError(ARRAYS_NEED_LABELS)
    declared = data_cfg.num_classes if num_classes is None else num_classes
    dataset = as_dataset(private_images(images, data_cfg), labels, declared, "private")
    check_records(dataset, ARRAYS_SOURCE)
    check_channels(dataset, data_cfg.channels, data_cfg.colour_to_grey, ARRAYS_SOURCE)
    keep, carved = _array_masks(dataset.record_keys, data_cfg, dataset.num_classes)
    parts = (
        dataset.subset(np.flatnonzero(keep), "private-train"),
        dataset.subset(np.flatnonzero(carved["val"]), "private-val"),
        dataset.subset(np.flatnonzero(carved["test"]), "private-test"),
    )
    size, channels = data_cfg.image_size, data_cfg.channels
    return PrivateSplits(*(prepare(part, size, channels) for part in parts))


def as_dataset(images: Any, labels: Any, num_classes: int | None, role: str) -> Any:

    if isinstance(images, tuple):
        images, labels = images
    images = as_nhwc(images)
    if labels is None:
        labels, num_classes = np.zeros(len(images), np.int64), 1 if num_classes is None else num_classes
    elif num_classes is None:
        if role == "private":
            raise DataError(f"{ARRAYS_SOURCE}: the number of classes is not declared; {DECLARE_CLASSES}")
        num_classes = int(np.max(labels)) + 1 if len(labels) else 1
    return ImageDataset(images, np.asarray(labels, np.int64), int(num_classes), name=role)


def as_array(images: Any) -> np.ndarray:
    """``images`` as one numpy array; a list of images of different sizes is refused with the fix."""
    try:
        array = np.asarray(images)
    except ValueError:  # numpy refuses a ragged list ("inhomogeneous shape")
        array = None
    if array is None or array.dtype == object:
        raise DataError(
            f"{ARRAYS_SOURCE}: the images differ in size; resize them to one size first and pass one uint8 "
            "array [N, H, W(, C)], or save them as an image folder and set data.image_size"
        )
    return array


def as_nhwc(images: Any) -> np.ndarray:
    """``[N, H, W]`` grey arrays as ``[N, H, W, 1]``; anything else as it is."""
    images = as_array(images)
    return images[..., None] if images.ndim == 3 else images
