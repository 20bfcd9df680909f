"""load_private / load_public: split protocol, record-wise carving, max_train, preprocessing."""

import numpy as np
import pytest

from dpsynth.data import load_private, load_public
from dpsynth.data.registry import REGISTRY


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def fingerprints(ds):
    return {ds.images[i].tobytes() + bytes([ds.labels[i]]) for i in range(len(ds))}


def test_mnist10k_uses_its_own_val_split():
    splits = load_private("mnist10k")
    assert (len(splits.train), len(splits.val), len(splits.test)) == (7000, 1000, 2000)
    assert splits.train.name == "mnist10k-train" and splits.image_shape == (1, 28, 28)
    assert splits.train.class_names == [str(d) for d in range(10)]


def test_explicit_val_size_carves_a_seeded_disjoint_val_from_train():
    splits = load_private("digits8x8", val_size=0.2, split_seed=3)
    assert len(splits.train) + len(splits.val) == 1257
    assert abs(len(splits.val) - 0.2 * 1257) < 4 * np.sqrt(1257 * 0.2 * 0.8)  # binomial, not exact
    assert not fingerprints(splits.train) & fingerprints(splits.val)
    again = load_private("digits8x8", val_size=0.2, split_seed=3)
    assert np.array_equal(again.val.images, splits.val.images)
    other = load_private("digits8x8", val_size=0.2, split_seed=4)
    assert not np.array_equal(other.val.images, splits.val.images)


def test_max_train_keeps_about_that_many_of_a_registered_dataset_and_preprocessing_applies():
    splits = load_private("mnist10k", image_size=32, channels=3, max_train=200)
    assert abs(len(splits.train) - 200) <= 60 and np.all(np.bincount(splits.train.labels, minlength=10) > 5)
    assert splits.train.image_shape == (3, 32, 32) and splits.test.image_shape == (3, 32, 32)
    assert len(splits.test) == 2000  # only train is capped


def test_datasets_without_val_carve_the_dpimagebench_holdout():
    assert REGISTRY["mnist"].val_size == 5000 and REGISTRY["cifar10"].val_size == 5000
    assert "val" not in REGISTRY["mnist"].splits and "val" in REGISTRY["celeba"].splits


def test_path_without_test_split_gets_a_carved_test(tmp_path):
    labels = np.arange(100) % 4
    images = np.random.default_rng(0).integers(0, 256, (100, 6, 6, 3), dtype=np.uint8)
    np.savez(tmp_path / "mine.npz", images=images, labels=labels)
    splits = load_private(
        tmp_path / "mine.npz", val_size=0.1, test_size=0.2, channels=1, num_classes=4, colour_to_grey=True
    )
    assert len(splits.train) + len(splits.val) + len(splits.test) == 100
    assert 5 <= len(splits.test) <= 35 and 2 <= len(splits.val) <= 20
    assert splits.train.image_shape == (1, 6, 6) and splits.num_classes == 4
    assert splits.train.name == "mine.npz-train"


def test_splits_share_one_class_count(tmp_path):
    np.savez(
        tmp_path / "d.npz",
        train_images=np.zeros((6, 2, 2, 1), np.uint8),
        train_labels=[0, 1, 2, 0, 1, 2],
        val_images=np.zeros((2, 2, 2, 1), np.uint8),
        val_labels=[2, 2],
        test_images=np.zeros((2, 2, 2, 1), np.uint8),
        test_labels=[0, 1],
    )
    splits = load_private(tmp_path / "d.npz", num_classes=3)
    assert splits.train.num_classes == splits.val.num_classes == splits.test.num_classes == 3


def test_public_glyphs_generate_exactly_max_size_at_the_requested_size():
    public = load_public("glyphs-digits", image_size=32, max_size=30)
    assert len(public) == 30 and public.image_shape == (1, 32, 32)
    assert np.bincount(public.labels).tolist() == [3] * 10


def test_public_real_dataset_is_subsampled_stratified():
    public = load_public("mnist10k", max_size=100, channels=3)
    assert len(public) == 100 and public.image_shape == (3, 28, 28)
    assert np.all(np.bincount(public.labels, minlength=10) >= 8)
