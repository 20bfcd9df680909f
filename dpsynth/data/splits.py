"""Record-wise train/val/test assignment keyed on each record's content, never on its position.

Each record gets one uniform draw per purpose (test, val, max_train) from the SplitMix64 finaliser
(Steele et al., "Fast splittable pseudorandom number generators", OOPSLA 2014) applied to
(its content key, ``split_seed``, purpose). The content key (:func:`content_keys`) is a BLAKE2b hash
of the record's own pixel bytes, shape and label, so a record's draws involve no other record and
not its position in the file: adding, removing, inserting or reordering records leaves every other
record's split unchanged. The split therefore maps neighbouring datasets to neighbouring splits, and
the DP guarantee of whatever trains on ``train`` holds for the original dataset too. A record goes
to a hold-out when its draw falls below the hold-out's fraction, so hold-out sizes are binomial, not
exact; stratification by label is deliberately absent (it would make one record's split depend on
the others').

Duplicates: records with identical bytes and label share a content key, hence every draw, so all
copies land in the same split. A copy can never sit in train while another copy is in test or val,
which keeps the evaluation honest (no train record is scored as held out).
"""

from __future__ import annotations

import hashlib

import numpy as np

from dpsynth.errors import DataError
from dpsynth.seeding import GOLDEN as _GOLDEN
from dpsynth.seeding import splitmix64 as _splitmix64

PURPOSES = {"test": 1, "val": 2, "max_train": 3, "shard": 4}

#: Records hashed per block by :func:`content_keys` (and read per block by ``ImageDataset.chunks``): a
#: non-contiguous or memory-mapped array is never copied or read whole (1024 x 96x96x3 = 28 MB at most).
CONTENT_KEY_CHUNK = 1024


def content_keys(images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """uint64 [N]: a 64-bit BLAKE2b hash of each record's pixel bytes, shape and label.

    A record's key is a function of the record alone: it does not change when other records are
    added, removed or reordered. Identical records (same bytes and label) share a key; that is
    harmless for DP, since each copy still contributes at most one clipped term. The records are
    hashed :data:`CONTENT_KEY_CHUNK` at a time, so the extra memory is one block whatever N.
    """
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(images) != len(labels):
        raise DataError(f"{len(images)} images but {len(labels)} labels")
    shape = repr(tuple(images.shape[1:])).encode()
    keys = np.empty(len(images), dtype=np.uint64)
    for start in range(0, len(images), CONTENT_KEY_CHUNK):
        block = np.ascontiguousarray(images[start : start + CONTENT_KEY_CHUNK])
        for i, image in enumerate(block, start):
            digest = hashlib.blake2b(image.tobytes(), digest_size=8, person=b"dpsynth-record")
            digest.update(shape + b"/" + int(labels[i]).to_bytes(8, "little", signed=True))
            keys[i] = int.from_bytes(digest.digest(), "little")
    return keys


#: Names the rule that maps (content key, split_seed, purpose) to a split: a record released by a run
#: (PrivImage's selection) records it, so a change of rule is never mistaken for the same split.
SPLIT_SCHEME = "content-key-splitmix64-v1"


def _purpose_key(split_seed: int, purpose: str) -> np.uint64:
    """One 64-bit key per (split_seed, purpose): the config's part of every record's draw."""
    if purpose not in PURPOSES:
        raise DataError(f"unknown split purpose '{purpose}'; use {', '.join(PURPOSES)}")
    key = _splitmix64(np.array([int(split_seed) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    return _splitmix64(np.array([key ^ np.uint64(PURPOSES[purpose])], dtype=np.uint64))[0]


def _as_keys(keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.ndim != 1 or keys.dtype != np.uint64:
        raise DataError(f"record keys must be a uint64 vector (content_keys), got {keys.dtype} {keys.shape}")
    return keys


def record_uniforms(keys: np.ndarray, split_seed: int, purpose: str) -> np.ndarray:
    """float64 [N] in [0, 1): each record's draw for ``purpose``, a function of (its key, split_seed, purpose) only.

    ``keys`` are the records' :func:`content_keys`; the draw mixes the key with the purpose's key
    twice, so draws for different purposes or seeds are unrelated even for the same record.
    """
    purpose_key = _purpose_key(split_seed, purpose)
    with np.errstate(over="ignore"):
        mixed = _splitmix64(_splitmix64(_as_keys(keys) ^ purpose_key) + _GOLDEN)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def holdout_mask(keys: np.ndarray, fraction: float, split_seed: int, purpose: str) -> np.ndarray:
    """bool [N]: records whose draw for ``purpose`` falls below ``fraction``."""
    if not 0.0 <= fraction <= 1.0:
        raise DataError(f"a split fraction must lie in [0, 1], got {fraction}")
    return record_uniforms(keys, split_seed, purpose) < fraction


def shard_assignment(keys: np.ndarray, num_shards: int, seed: int) -> np.ndarray:
    """int64 [N] in [0, num_shards): each record's shard of a fixed partition (GS-WGAN's critics), the floor of
    ``num_shards`` times its ``shard`` draw: a function of (its content key, ``seed``, ``num_shards``) only.

    Adding or removing one record changes the contents of exactly one shard and moves no other record (a
    split by position in a shuffled list would shift every later record); identical records share a shard.
    Replacing a record's content can move it to another shard (two shards change), so only add/remove maps
    to a change of one shard. ``num_shards`` is a public constant, never derived from the number of records.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise DataError(f"the number of shards must be an integer >= 1, got {num_shards!r}")
    shards = np.floor(record_uniforms(keys, seed, "shard") * int(num_shards)).astype(np.int64)
    return np.minimum(shards, int(num_shards) - 1)


def shard_members(keys: np.ndarray, num_shards: int, seed: int) -> list[np.ndarray]:
    """Per shard of :func:`shard_assignment`, the dataset positions of its records ordered by content key.

    Shard k's list (as a multiset of records, and its order) depends on shard k's records only, so whatever
    is trained on it in list order (GS-WGAN's critic k, Chen et al., arXiv:2006.08265, Algorithm 1) changes only
    when one of shard k's records does.
    """
    keys = np.asarray(keys)
    assignment = shard_assignment(keys, num_shards, seed)
    order = np.lexsort((np.arange(len(keys)), keys))  # by content key; ties (identical records) by position
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for position in order:
        members[assignment[position]].append(int(position))
    return [np.asarray(m, dtype=np.int64) for m in members]


def stand_in_keys(count: int) -> np.ndarray:
    """uint64 [count]: keys for callers that know only a record count, record i's key a hash of i.

    They give masks with the same distribution of sizes as a real file's, for planning before any
    record is read; they are *not* the keys of any file, so a split of real records must use
    :func:`content_keys` instead.
    """
    with np.errstate(over="ignore"):
        return _splitmix64(np.arange(int(count), dtype=np.uint64) * _GOLDEN)


def as_fraction(size: float, nominal: int | None, what: str, source: str = "a dataset on disk") -> float:
    """A hold-out given as a fraction in (0, 1), or as a count of a dataset whose size is documented.

    A count is turned into a fraction of ``nominal`` (the registered dataset's documented size, metadata);
    for a dataset on disk there is no documented size, and dividing by the number of records read would
    make every record's split depend on how many others there are, so a count is refused there.
    ``what`` names the setting (``data.val_size``) and ``source`` the data, for the message.
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
            f"{what}={count} is a count, but {source} has no documented size to take it from; give a fraction "
            f"in (0, 1) instead, e.g. {what}=0.1"
        )
    if not 0 < count < nominal:
        raise DataError(f"{what}={count} must lie between 1 and {nominal - 1} (documented size {nominal})")
    return count / nominal
