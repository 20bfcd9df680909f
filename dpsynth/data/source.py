"""Where a run's data comes from: one :class:`DatasetSource` for a registered name, a path or in-memory arrays,
and :func:`load_source`, the one loader that turns it into the run's private splits and public set.

``dpsynth run`` names its datasets in the config (``data.private``, ``data.public``); the Python API's
``Synthesizer.fit(images, labels, public=...)`` may hand over arrays or a path instead. Both reach the same
loader: the source only says *which* data, and the config's ``data`` section says *how* it is read (image
size, channels, split seed, hold-outs, ``max_train``, pixel range). So arrays are split by the same
record-wise, content-keyed rule as a file (:func:`dpsynth.data.loading.split_masks`), pass the same
checks and fail with the same messages. What the source changes in the config (``data.private: <arrays>``,
the declared ``data.num_classes``) is :meth:`DatasetSource.data_changes`, applied on the config side by
:func:`dpsynth.config.config_for_source` for both entry points.

Nothing here reads a private value to decide anything: the class count of arrays is declared
(``num_classes``), never ``labels.max() + 1``, and the train size N comes from each record's own keyed
hold-out draw (N is public by the stated assumption, docs/privacy.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.data.arrays import ARRAYS_NEED_LABELS, array_train_size, as_array, as_dataset, split_arrays
from dpsynth.data.dataset import ImageDataset, PrivateSplits
from dpsynth.data.loading import check_overlap, load_for_run, load_private, private_options
from dpsynth.data.section import DataSection, as_data_section
from dpsynth.data.sizes import planned_train_size
from dpsynth.data.transforms import prepare
from dpsynth.errors import DataError
from dpsynth.rundir import IN_MEMORY


@dataclasses.dataclass(frozen=True, eq=False)
class Arrays:
    """Images in memory (uint8 ``[N, H, W(, C)]`` or NCHW, or floats in ``data.pixel_range``) and their
    int labels ``[N]`` (None: public images without labels). They are never written anywhere."""

    images: np.ndarray
    labels: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class DatasetSource:
    """The data of one run, private and public side.

    ``private``: a registered dataset name or path (str), :class:`Arrays`, the :class:`PrivateSplits` a run
    already drew (the DP-SGD baseline trains on its run's own train split; a reopened arrays run has only
    its recorded shape), or None for the config's ``data.private``. ``public``: a name or path, arrays, or
    None for the config's ``data.public``; ``with_public=False`` loads no public set at all.
    ``num_classes``: the declared class count (arrays need it, or ``data.num_classes``; for a file it sets
    ``data.num_classes``).
    """

    private: str | Arrays | PrivateSplits | None = None
    public: str | Arrays | None = None
    num_classes: int | None = None
    with_public: bool = True

    @classmethod
    def of(
        cls, images: Any = None, labels: Any = None, public: Any = None, num_classes: int | None = None
    ) -> DatasetSource:
        """The source of ``Synthesizer.fit(images, labels, public, num_classes=...)``: each argument as a
        name or path (str or Path), arrays (a list of equal-sized images becomes one array) or None."""
        if images is None and labels is not None:
            raise DataError("labels were given without images")
        private = _side(images, labels)
        if isinstance(private, Arrays) and labels is None:
            raise DataError(ARRAYS_NEED_LABELS)
        if isinstance(public, tuple):
            public = _side(*public) if len(public) == 2 else _side(public)
        else:
            public = _side(public)
        return cls(private, public, None if num_classes is None else int(num_classes))

    @property
    def private_arrays(self) -> bool:
        """Whether the private side is in-memory arrays (the run directory then keeps its ``dataset.json``)."""
        return isinstance(self.private, Arrays)

    @property
    def names_private(self) -> bool:
        """Whether the private side is new data for the run (a name, a path or arrays), not the config's or
        splits already drawn: an ``auto`` preset is then sized again for it."""
        return isinstance(self.private, (str, Arrays))

    def data_changes(self) -> dict[str, Any]:
        """The private side's keys of the config's ``data`` section: ``private`` (the name or path, or
        ``<arrays>``) and the declared ``num_classes``."""
        changes: dict[str, Any] = {}
        if isinstance(self.private, (str, Arrays)):
            changes["private"] = IN_MEMORY if isinstance(self.private, Arrays) else self.private
        if self.num_classes is not None:
            changes["num_classes"] = self.num_classes
        return changes

    def public_changes(self) -> dict[str, Any]:
        """The public side's key of the config's ``data`` section: ``public`` (the name or path, or ``<arrays>``)."""
        if self.public is None:
            return {}
        return {"public": IN_MEMORY if isinstance(self.public, Arrays) else self.public}

    def planning_inputs(self, data: DataSection) -> tuple[int | None, tuple[int, int, int] | None]:
        """(N, (C, H, W)) of the private side for the scaling rule: for arrays the train size their keyed
        split leaves and their shape under ``data.image_size`` / ``data.channels``; (None, None) otherwise
        (the rule reads the metadata of ``data.private``)."""
        if not isinstance(self.private, Arrays):
            return None, None
        images = np.asarray(self.private.images)
        stored = images
        if stored.ndim == 4 and stored.shape[-1] not in (1, 3) and stored.shape[1] in (1, 3):
            stored = stored.transpose(0, 2, 3, 1)  # NCHW, as the array reader takes it
        channels = stored.shape[-1] if stored.ndim == 4 else 1
        side = data.image_size
        shape = (data.channels or channels, side or stored.shape[1], side or stored.shape[2])
        return array_train_size(images, self.private.labels, data), shape

    def train_size(self, data: DataSection | Mapping[str, Any]) -> int:
        """The private train size N a run on this source trains on, before any record is loaded: the keyed
        split of arrays, the drawn train split, or the metadata of ``data.private``
        (:func:`dpsynth.data.sizes.planned_train_size`)."""
        data = as_data_section(data)
        if isinstance(self.private, PrivateSplits):
            return len(self.private.train)
        if isinstance(self.private, Arrays):
            return array_train_size(self.private.images, self.private.labels, data)
        return planned_train_size(data.model_copy(update=self.data_changes()))


def _side(images: Any, labels: Any = None) -> str | Arrays | None:
    if images is None:
        return None
    if isinstance(images, (str, Path)):
        return str(images)
    return Arrays(as_array(images), labels)  # one line when a list of images differs in size


def load_source(
    data: DataSection | Mapping[str, Any], source: DatasetSource | None = None
) -> tuple[PrivateSplits, ImageDataset | None, int]:
    """(private splits, public set or None, overlap count) of ``source`` read by the config's ``data``
    section: the one loader of ``dpsynth run``, ``Synthesizer.fit``, ``generate`` and the evaluations.

    Arrays are split by :func:`~dpsynth.data.arrays.split_arrays` (the content-keyed rule of
    :func:`~dpsynth.data.loading.load_private`); a name or path, or the config's own dataset, by
    :func:`~dpsynth.data.loading.load_for_run`. Public arrays are prepared at the private size and channels,
    and every public set is checked for overlap with every private split.
    """
    source = source or DatasetSource()
    data = as_data_section(data).model_copy(update=source.data_changes())
    private = source.private
    if isinstance(private, PrivateSplits):
        splits = private
    elif isinstance(private, Arrays):
        splits = split_arrays(private.images, private.labels, data.num_classes, data)
    else:
        splits = load_private(data.private, **private_options(data))
    if not source.with_public:
        return splits, None, 0
    if isinstance(source.public, Arrays):
        channels, size, _ = splits.train.image_shape
        public = prepare(as_dataset(source.public.images, source.public.labels, None, "public"), size, channels)
        return splits, public, check_overlap(splits, public, data.allow_overlap)
    named = source.public if source.public is not None else data.public
    if named == IN_MEMORY:  # a run's public arrays, which its directory does not keep
        named = None
    return load_for_run(data.model_copy(update={"public": named}), splits)
