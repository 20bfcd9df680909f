"""FID, KID, precision/recall and IS: closed forms on hand examples, then the real TF-Inception network on tiny sets."""

import math

import numpy as np
import pytest
import torch

from dpsynth.data import load_private
from dpsynth.metrics.fidelity import (
    compute_fidelity,
    feature_statistics,
    fid,
    frechet_distance,
    inception_score,
    kid,
    precision_recall,
)
from dpsynth.metrics.inception import InceptionFeatures, reference_features, tf_bilinear_matrix


def test_frechet_distance_matches_the_closed_form_for_diagonal_covariances():
    mu1, mu2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    var1, var2 = np.array([1.0, 4.0, 9.0]), np.array([4.0, 1.0, 1.0])
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2)
    assert frechet_distance(mu1, np.diag(var1), mu2, np.diag(var2)) == pytest.approx(expected)


@pytest.mark.parametrize("sizes", [(6, 5), (40, 30)], ids=["fewer-vectors-than-dims", "more-vectors-than-dims"])
def test_fid_of_features_equals_the_frechet_distance_of_their_statistics(sizes):
    """fid() takes a shortcut from the features when both sets have fewer vectors than dimensions (the
    Inception tests below run on 8 images); it gives the Fréchet distance of the fitted Gaussians either way."""
    rng = np.random.default_rng(3)
    real = rng.normal(size=(sizes[0], 16)) * np.linspace(0.5, 2.0, 16)
    fake = rng.normal(size=(sizes[1], 16)) @ rng.normal(size=(16, 16)) / 4 + 0.3
    expected = frechet_distance(*feature_statistics(real), *feature_statistics(fake))
    assert expected > 1.0 and fid(real, fake) == pytest.approx(expected, rel=1e-6)
    assert fid(real, real) == pytest.approx(0.0, abs=1e-9)


def test_inception_score_on_hand_examples():
    confident_and_diverse = np.eye(5)[np.arange(50) % 5]
    assert inception_score(confident_and_diverse, splits=5)[0] == pytest.approx(5.0)
    always_the_same_class = np.tile(np.eye(5)[0], (50, 1))
    assert inception_score(always_the_same_class, splits=5)[0] == pytest.approx(1.0)


def test_precision_recall_of_disjoint_clusters_is_zero():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(30, 8)), rng.normal(size=(30, 8)) + 100.0
    assert precision_recall(a, b) == (0.0, 0.0)
    assert precision_recall(a, a) == (1.0, 1.0)


def test_tf_bilinear_resize_matches_legacy_tensorflow_sampling():
    # TF-1 resize_bilinear(align_corners=False): source = destination * in / out, clamped at the edge.
    matrix = tf_bilinear_matrix(4, 8)
    signal = torch.tensor([0.0, 10.0, 20.0, 30.0])
    expected = torch.tensor([0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 30.0])
    torch.testing.assert_close(matrix @ signal, expected)


@pytest.fixture(scope="module")
def extractor():
    return InceptionFeatures(batch_size=8, progress=False)


@pytest.fixture(scope="module")
def digits():
    return load_private("mnist10k").test.images[::250]  # 8 images, every class (stored sorted)


@pytest.fixture(scope="module")
def features(extractor, digits):
    brighter = np.clip(digits.astype(np.int16) + 80, 0, 255).astype(np.uint8)
    return extractor(digits), extractor(brighter)


def test_network_input_is_tf_scaled_grey_repeated_299px(extractor, digits):
    x = extractor.preprocess(np.full((2, 28, 28, 1), 128, dtype=np.uint8))
    assert x.shape == (2, 3, 299, 299)
    assert torch.all(x == 0)  # (128 - 128) / 128
    x = extractor.preprocess(digits[:1])
    assert x.min() == -1.0 and x.max() <= 255 / 128 - 1 + 1e-6


def test_fid_kid_precision_recall_on_the_real_network(features):
    real, brighter = features
    assert real.shape == (8, 2048)
    assert fid(real, real) == pytest.approx(0.0, abs=1e-3)
    assert fid(real, brighter) > 10.0
    same = compute_fidelity(real, real, ["kid", "precision", "recall"], kid_subsets=2)
    assert same["precision"] == 1.0 and same["recall"] == 1.0
    # Unbiased MMD^2 of a set with itself is (2/n)(mean off-diagonal k - mean diagonal k): O(1/n), not 0.
    k = (real @ real.T / real.shape[1] + 1) ** 3
    n = len(real)
    expected = 2 / n * ((k.sum() - np.trace(k)) / (n * (n - 1)) - np.trace(k) / n)
    assert same["kid"]["mean"] == pytest.approx(expected, rel=1e-6)


def test_kid_is_near_zero_for_identical_sets_and_grows_with_a_shift():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(400, 64))
    same, _ = kid(a, a, num_subsets=3, subset_size=400)
    shifted, _ = kid(a, a + 1.0, num_subsets=3, subset_size=400)
    assert shifted > 0.5
    assert abs(same) < 0.01 * shifted


def test_reference_features_are_cached_on_disk(extractor, digits, tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path))
    first = reference_features(digits[:2], extractor, "mnist10k", "test", private=False)
    cached = list((tmp_path / "inception").glob("public-mnist10k-test-*.npz"))
    assert len(cached) == 1 and extractor.hash in cached[0].name
    np.testing.assert_array_equal(reference_features(digits[:2], extractor, "mnist10k", "test", private=False), first)
    # Different pixels → a different cache entry, never the stale one.
    reference_features(digits[2:4], extractor, "mnist10k", "test", private=False)
    assert len(list((tmp_path / "inception").glob("*.npz"))) == 2
    assert math.isfinite(float(first.sum()))


def test_private_features_stay_in_the_given_directory_marked_private(extractor, digits, tmp_path, monkeypatch):
    user_cache, run_cache = tmp_path / "user", tmp_path / "run" / "diagnostics" / "inception"
    monkeypatch.setenv("DPSYNTH_CACHE", str(user_cache))
    uncached = reference_features(digits[:2], extractor, "mnist10k", "train")  # private, no directory: no cache
    assert not user_cache.exists()
    first = reference_features(digits[:2], extractor, "mnist10k", "train", cache=run_cache)
    [stored] = run_cache.glob("*.npz")
    assert stored.name.startswith("private-")
    with np.load(stored) as archive:
        assert str(archive["privacy"]) == "private"
    np.testing.assert_array_equal(first, uncached)
    np.testing.assert_array_equal(
        reference_features(digits[:2], extractor, "mnist10k", "train", cache=run_cache), first
    )
    assert not user_cache.exists()
