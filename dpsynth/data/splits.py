"""Record-wise train/val/test assignment that depends on the config alone, never on the data.

Each record ``i`` (its position in the file's split) gets one uniform draw per purpose from a
keyed hash of ``(split_seed, purpose, i)`` (SplitMix64, Steele et al., "Fast splittable
pseudorandom number generators", OOPSLA 2014). A record goes to a hold-out when its draw falls
below the hold-out's fraction. Because record ``i``'s draw involves no other record, adding or
removing one record leaves every other record's split unchanged: the split maps neighbouring
datasets to neighbouring splits, so the DP guarantee of whatever trains on ``train`` holds for the
original dataset too. Hold-out sizes are therefore binomial, not exact; stratification by label is
deliberately absent (it would read the labels and make the split data-dependent).
"""

from __future__ import annotations

import hashlib

import numpy as np

from dpsynth.errors import DataError

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
PURPOSES = {"test": 1, "val": 2, "max_train": 3}


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser, applied elementwise to uint64 values."""
    z = values.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def content_keys(images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """uint64 [N]: a 64-bit BLAKE2b hash of each record's pixel bytes, shape and label.

    A record's key is a function of the record alone: it does not change when other records are
    added, removed or reordered. Identical records (same bytes and label) share a key; that is
    harmless for DP, since each copy still contributes at most one clipped term.
    """
    images = np.ascontiguousarray(images)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(images) != len(labels):
        raise DataError(f"{len(images)} images but {len(labels)} labels")
    shape = repr(tuple(images.shape[1:])).encode()
    keys = np.empty(len(images), dtype=np.uint64)
    for i, (image, label) in enumerate(zip(images, labels)):
        digest = hashlib.blake2b(image.tobytes(), digest_size=8, person=b"dpsynth-record")
        digest.update(shape + b"/" + int(label).to_bytes(8, "little", signed=True))
        keys[i] = int.from_bytes(digest.digest(), "little")
    return keys


def record_uniforms(count: int, split_seed: int, purpose: str) -> np.ndarray:
    """float64 [count] in [0, 1): record i's draw for ``purpose``, a function of (split_seed, purpose, i) only."""
    if purpose not in PURPOSES:
        raise DataError(f"unknown split purpose '{purpose}'; use {', '.join(PURPOSES)}")
    key = _splitmix64(np.array([int(split_seed) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    key = _splitmix64(np.array([key ^ np.uint64(PURPOSES[purpose])], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        index = np.arange(count, dtype=np.uint64) * _GOLDEN + key
    return (_splitmix64(index) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def holdout_mask(count: int, fraction: float, split_seed: int, purpose: str) -> np.ndarray:
    """bool [count]: records whose draw for ``purpose`` falls below ``fraction``."""
    if not 0.0 <= fraction <= 1.0:
        raise DataError(f"a split fraction must lie in [0, 1], got {fraction}")
    return record_uniforms(count, split_seed, purpose) < fraction


def as_fraction(size: float, nominal: int | None, what: str) -> float:
    """A hold-out given as a fraction in (0, 1), or as a count of a dataset whose size is documented.

    A count is turned into a fraction of ``nominal`` (the registered dataset's documented size, metadata);
    for a dataset on disk there is no documented size, and dividing by the number of records read would
    make every record's split depend on how many others there are, so a count is refused there.
    """
    if isinstance(size, bool) or not isinstance(size, (int, float, np.integer, np.floating)):
        raise DataError(f"{what} must be a count or a fraction in (0, 1), got {size!r}")
    if isinstance(size, (float, np.floating)) and not float(size).is_integer():
        if not 0.0 < float(size) < 1.0:
            raise DataError(f"a fractional {what} must lie in (0, 1), got {size}")
        return float(size)
    count = int(size)
    if nominal is None:
        raise DataError(
            f"{what}={count} is a count, but a dataset on disk has no documented size; give a fraction in (0, 1)"
        )
    if not 0 < count < nominal:
        raise DataError(f"{what}={count} must lie between 1 and {nominal - 1} (documented size {nominal})")
    return count / nominal
