"""Datasets for dpsynth: the in-memory ``ImageDataset``, the registry, readers, built-ins, transforms.

Public API (docs/architecture.md, "Images and datasets"):

- :class:`ImageDataset`, :class:`DatasetInfo`, :class:`PrivateSplits`;
- :func:`list_datasets`, :func:`load_dataset` (a registered name or a path);
- :func:`load_private` (train/val/test for a run) and :func:`load_public`;
- :func:`download` for users with a network.

Importing this package is cheap: torch is imported only by ``ImageDataset.to_tensors`` and the
glyph generator, scikit-learn only by ``digits8x8``, and matplotlib never (its fonts are found
on disk).
"""

from dpsynth.data.dataset import DatasetInfo, ImageDataset, PrivateSplits
from dpsynth.data.fetch import data_root, download
from dpsynth.data.loading import load_private, load_public
from dpsynth.data.registry import list_datasets, load_dataset

__all__ = [
    "DatasetInfo",
    "ImageDataset",
    "PrivateSplits",
    "data_root",
    "download",
    "list_datasets",
    "load_dataset",
    "load_private",
    "load_public",
]
