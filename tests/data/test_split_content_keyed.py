"""The private split is keyed on each record's content: no record's split depends on the others or the order.

For every registered method, its packaged ``smoke`` preset's data section is pointed at a ~300-record
``.npz`` file and loaded through the path a run uses (``dpsynth.runner.load_run_data``). Removing the
first record, inserting one at the front or in the middle, or shuffling the file must leave every
common record in the same split: train, val, test, or dropped by ``max_train``.
"""

from __future__ import annotations

import numpy as np
import pytest

import dpsynth.methods  # noqa: F401  (registers the packaged methods)
from dpsynth.config import find_config, load_config, with_changes
from dpsynth.contract import METHODS
from dpsynth.data import load_private
from dpsynth.data.loading import split_masks
from dpsynth.data.splits import content_keys, record_uniforms
from dpsynth.errors import DataError
from dpsynth.runner import load_run_data

RECORDS = 300
NAMES = np.array(list("abc"))
METHOD_NAMES = sorted(name for name, cls in METHODS.items() if cls.__module__.startswith("dpsynth."))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def records(count: int, shape: tuple[int, int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` random uint8 records, distinct with overwhelming probability, labels cycling over 3 classes."""
    images = np.random.default_rng(seed).integers(0, 256, (count, *shape), dtype=np.uint8)
    return images, np.arange(count) % len(NAMES)


def variants(shape: tuple[int, int, int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The base file and its four edits: drop the first record, insert at the front / in the middle, shuffle."""
    images, labels = records(RECORDS, shape, seed=0)
    extra_images, extra_labels = records(2, shape, seed=1)
    middle = RECORDS // 2
    order = np.random.default_rng(2).permutation(RECORDS)
    return {
        "base": (images, labels),
        "drop-first": (images[1:], labels[1:]),
        "insert-front": (np.concatenate([extra_images[:1], images]), np.concatenate([extra_labels[:1], labels])),
        "insert-middle": (
            np.concatenate([images[:middle], extra_images[1:], images[middle:]]),
            np.concatenate([labels[:middle], extra_labels[1:], labels[middle:]]),
        ),
        "shuffle": (images[order], labels[order]),
    }


def placement(splits, images: np.ndarray) -> dict[bytes, str]:
    """{record bytes: train | val | test | dropped} for every record of the file (prepare is the identity here)."""
    where = {image.tobytes(): name for name in ("train", "val", "test") for image in getattr(splits, name).images}
    return {image.tobytes(): where.get(image.tobytes(), "dropped") for image in images}


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_each_record_keeps_its_split_when_others_are_removed_inserted_or_reordered(tmp_path, method):
    config = load_config(find_config(f"{method}/smoke"))
    data = config.data
    side = data.image_size or 28
    files = {}
    for name, (images, labels) in variants((side, side, data.channels or 1)).items():
        files[name] = tmp_path / f"{name}.npz"
        np.savez(files[name], images=images, labels=labels, class_names=NAMES)
    if not isinstance(data.max_train, float):
        if data.max_train is not None:  # a count needs a registered dataset's documented size
            with pytest.raises(DataError, match="give a fraction"):
                load_run_data(with_changes(config, {"data": {"private": str(files["base"])}}))
        config = with_changes(config, {"data": {"max_train": 0.6}})

    def where(name: str) -> dict[bytes, str]:
        splits, _ = load_run_data(with_changes(config, {"data": {"private": str(files[name])}}))
        return placement(splits, np.load(files[name])["images"])

    before = where("base")
    assert set(before.values()) == {"train", "val", "test", "dropped"}, "every split is exercised"
    for name in ("drop-first", "insert-front", "insert-middle", "shuffle"):
        after = where(name)
        common = before.keys() & after.keys()
        assert len(common) >= RECORDS - 1
        moved = sorted({(before[k], after[k]) for k in common if before[k] != after[k]})
        assert not moved, f"{name}: records moved between splits {moved}"


def test_duplicates_share_their_split_and_draws_depend_on_the_record_alone(tmp_path):
    images, labels = records(RECORDS, (8, 8, 1), seed=3)
    keys = content_keys(images, labels)
    draws = record_uniforms(keys, 7, "val")
    assert np.array_equal(record_uniforms(keys[::-1], 7, "val"), draws[::-1])
    assert np.array_equal(record_uniforms(keys[:10], 7, "val"), draws[:10])
    assert not np.array_equal(record_uniforms(keys, 8, "val"), draws)
    assert not np.array_equal(record_uniforms(keys, 7, "test"), draws)
    relabelled = content_keys(images, (labels + 1) % 3)
    assert not np.any(relabelled == keys), "the label is part of a record's content"
    # Every record has a copy: each pair sits in one split, never one copy in train and one in test.
    doubled = np.concatenate([images, images[::-1]])
    np.savez(tmp_path / "dup.npz", images=doubled, labels=np.concatenate([labels, labels[::-1]]), class_names=NAMES)
    splits = load_private(tmp_path / "dup.npz", val_size=0.2, test_size=0.2, split_seed=5)
    sizes = {name: len(getattr(splits, name)) for name in ("train", "val", "test")}
    assert all(size % 2 == 0 and size > 0 for size in sizes.values()), sizes
    seen = [{image.tobytes() for image in getattr(splits, name).images} for name in ("train", "val", "test")]
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])


def test_a_max_train_count_is_an_expected_count_that_no_other_record_changes():
    # An exact-size sample would let an added record push a kept one out (two changes, not one).
    images, labels = records(RECORDS, (4, 4, 1), seed=4)
    keys = content_keys(images, labels)
    options = dict(
        own_val=True, own_test=True, documented=RECORDS, val_size=0.1, test_size=0.1, split_seed=1, num_classes=3
    )
    keep, _ = split_masks(keys, max_train=100, **options)
    order = np.random.default_rng(0).permutation(RECORDS)
    shuffled, _ = split_masks(keys[order], max_train=100, **options)
    assert abs(int(keep.sum()) - 100) <= 4 * np.sqrt(100 * (1 - 100 / RECORDS)) and np.array_equal(
        shuffled, keep[order]
    )
    dropped, _ = split_masks(keys[1:], max_train=100, **options)  # one record fewer: no other record moves
    assert np.array_equal(dropped, keep[1:])
    extra = records(1, (4, 4, 1), seed=99)
    grown, _ = split_masks(np.concatenate([content_keys(*extra), keys]), max_train=100, **options)
    assert np.array_equal(grown[1:], keep)
