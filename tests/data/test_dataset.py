"""ImageDataset validation and tensors, transforms and stratified splits."""

import numpy as np
import pytest
import torch

from dpsynth.data import DatasetInfo, ImageDataset, PrivateSplits
from dpsynth.data import transforms as T
from dpsynth.errors import DataError


def make(n=12, h=4, w=5, c=1, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, h, w, c), dtype=np.uint8)
    return ImageDataset(images, np.arange(n) % classes, classes, "toy", [f"c{i}" for i in range(classes)])


def test_to_tensors_scales_to_unit_range_in_nchw():
    ds = make(c=3)
    ds.images[0, 0, 0] = [0, 255, 128]
    x, y = ds.to_tensors()
    assert x.shape == (12, 3, 4, 5) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == ds.labels.tolist()
    assert x[0, :, 0, 0].tolist() == pytest.approx([-1.0, 1.0, 128 / 127.5 - 1], abs=1e-6)
    assert x.min() >= -1 and x.max() <= 1
    assert ds.image_shape == (3, 4, 5) and len(ds) == 12


def test_subset_keeps_classes_and_copies():
    ds = make()
    sub = ds.subset([5, 1])
    assert sub.labels.tolist() == [2, 1] and sub.num_classes == 3 and sub.class_names == ds.class_names
    sub.images[0] = 0
    assert ds.images[5].any()


def test_float_integer_labels_are_accepted_as_int64():
    ds = ImageDataset(np.zeros((2, 2, 2, 1), np.uint8), np.array([0.0, 1.0]), 2)
    assert ds.labels.dtype == np.int64


@pytest.mark.parametrize(
    "images, labels, classes, message",
    [
        (np.zeros((2, 3, 3, 1), np.float32), [0, 1], 2, "uint8"),
        (np.zeros((2, 3, 3), np.uint8), [0, 1], 2, r"\[N, H, W, C\]"),
        (np.zeros((2, 3, 3, 2), np.uint8), [0, 1], 2, "1 or 3 channels"),
        (np.zeros((2, 3, 3, 1), np.uint8), None, 2, "labels are missing"),
        (np.zeros((2, 3, 3, 1), np.uint8), [0, 1, 1], 2, "2 images but 3 labels"),
        (np.zeros((2, 3, 3, 1), np.uint8), [0, 2], 2, r"\[0, 2\)"),
        (np.zeros((2, 3, 3, 1), np.uint8), [-1, 0], 2, r"\[0, 2\)"),
        (np.zeros((2, 3, 3, 1), np.uint8), [0.5, 1], 2, "integers"),
    ],
)
def test_construction_rejects_bad_arrays(images, labels, classes, message):
    with pytest.raises(DataError, match=message):
        ImageDataset(images, labels, classes, "bad")


def test_class_names_must_match_class_count():
    with pytest.raises(DataError, match="class names"):
        ImageDataset(np.zeros((1, 2, 2, 1), np.uint8), [0], 2, "x", ["only-one"])


def test_dataset_info_serialises():
    info = DatasetInfo("d", 3, (8, 8, 1), 10, "src", "MIT", "builtin", splits={"train": 3})
    assert info.to_dict()["shape"] == [8, 8, 1] and info.to_dict()["splits"] == {"train": 3}


def test_private_splits_expose_shape_and_classes():
    ds = make()
    splits = PrivateSplits(ds, ds, ds)
    assert splits.num_classes == 3 and splits.image_shape == (1, 4, 5)


def test_grey_rgb_round_trip_and_luma():
    grey = make(c=1).images
    rgb = T.grey_to_rgb(grey)
    assert rgb.shape[3] == 3 and np.array_equal(T.rgb_to_grey(rgb), grey)
    red = np.zeros((1, 1, 1, 3), np.uint8)
    red[..., 0] = 255
    assert T.rgb_to_grey(red)[0, 0, 0, 0] == round(0.299 * 255)


def test_centre_crop_takes_the_middle():
    images = np.arange(36, dtype=np.uint8).reshape(1, 6, 6, 1)
    crop = T.centre_crop(images, 2)
    assert crop[0, :, :, 0].tolist() == [[14, 15], [20, 21]]
    with pytest.raises(DataError):
        T.centre_crop(images, 7)


def test_resize_and_fit_square():
    images = np.full((2, 10, 6, 1), 200, np.uint8)
    out = T.fit_square(images, 3)
    assert out.shape == (2, 3, 3, 1) and np.all(out == 200)
    assert T.resize(make(c=3).images, (8, 9)).shape == (12, 8, 9, 3)


def test_prepare_resizes_and_converts_channels():
    ds = T.prepare(make(h=8, w=8), image_size=4, channels=3)
    assert ds.image_shape == (3, 4, 4) and ds.num_classes == 3
    with pytest.raises(DataError, match="channels"):
        T.prepare(make(), channels=2)


def test_float_to_uint8_scales_from_the_declared_range_only():
    assert T.float_to_uint8(np.array([0.0, 1.0]), [0, 1]).tolist() == [0, 255]
    assert T.float_to_uint8(np.array([-1.0, 1.0]), [-1, 1]).tolist() == [0, 255]
    assert T.float_to_uint8(np.array([0.0, 255.0]), [0, 255]).tolist() == [0, 255]
    # values that happen to lie in [0, 1] are not rescaled as if the range were [0, 1]
    assert T.float_to_uint8(np.array([0.0, 0.5]), [0, 255]).tolist() == [0, 0]
    with pytest.raises(DataError, match=r"^NaN pixel values \(.*\); pixel values outside the declared pixel_range"):
        T.float_to_uint8(np.array([0.0, 1.5, -0.1, np.nan, 0.2]), [0, 1])
    with pytest.raises(DataError, match=r"^infinite pixel values \(.*numpy.isinf finds them\)$"):
        T.float_to_uint8(np.array([0.0, np.inf, 0.2]), [0, 1])
    with pytest.raises(DataError, match=r"^pixel values outside the declared pixel_range \[0, 1\] \(.*pixel_range"):
        T.float_to_uint8(np.array([0.0, 1.5, -0.1, 0.2]), [0, 1])
    with pytest.raises(DataError, match="low < high"):
        T.check_pixel_range([1, 0])
    assert np.array_equal(T.from_unit_range(T.to_unit_range(np.arange(256, dtype=np.uint8))), np.arange(256))


def test_stratified_split_is_proportional_disjoint_and_seeded():
    labels = np.repeat(np.arange(3), [50, 30, 20])
    keep, held = T.stratified_split(labels, 3, 10, seed=4)
    assert np.bincount(labels[held], minlength=3).tolist() == [5, 3, 2]
    assert len(np.intersect1d(keep, held)) == 0 and len(keep) + len(held) == 100
    again = T.stratified_split(labels, 3, 10, seed=4)[1]
    other = T.stratified_split(labels, 3, 10, seed=5)[1]
    assert np.array_equal(held, again) and not np.array_equal(held, other)


def test_stratified_quotas_sum_exactly():
    labels = np.repeat(np.arange(7), [13, 1, 29, 8, 8, 40, 2])
    for size in (0, 1, 7, 33, 101):
        quotas = T.stratified_quotas(labels, 7, size)
        assert quotas.sum() == size
        assert np.all(np.abs(quotas - np.bincount(labels) * size / 101) < 1)


def test_stratified_subset_keeps_every_class():
    labels = np.repeat(np.arange(4), [500, 500, 500, 2])
    subset = T.stratified_subset(labels, 4, 20, seed=0)
    counts = np.bincount(labels[subset], minlength=4)
    assert len(subset) == 20 and counts.min() >= 1
