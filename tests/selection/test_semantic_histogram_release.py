"""PrivImage's semantic histogram is one bounded-sum release: k1-hot features per private class,
bound sqrt(k1), noise sqrt(k1) sigma_q per cell, one Gaussian in the ledger."""

from __future__ import annotations

import math

import numpy as np
import torch

from dpsynth.privacy import Gaussian, NoiseSource, PrivacyLedger
from dpsynth.selection import QUERY_MECHANISM, private_semantic_distribution, semantic_histogram


def test_the_semantic_histogram_is_the_exact_histogram_plus_one_draw_of_noise():
    rng = np.random.default_rng(0)
    k1, semantics, rows, count = 3, 11, 4, 50
    topk = torch.tensor(np.stack([rng.choice(semantics, k1, replace=False) for _ in range(count)]))
    labels = torch.tensor(rng.integers(0, rows, count))
    ledger = PrivacyLedger(10.0, 1e-5)
    noisy = private_semantic_distribution(topk, labels, rows, semantics, 2.0, ledger, NoiseSource(seed=8))
    exact = semantic_histogram(topk, labels, rows, semantics)
    assert exact.sum() == count * k1 and np.array_equal(exact, np.round(exact))  # k-hot rows are never scaled
    noise = NoiseSource(seed=8).normal((rows * semantics,), std=math.sqrt(k1) * 2.0, dtype=torch.float64)
    assert np.allclose(noisy, exact + noise.numpy().reshape(rows, semantics), atol=1e-9)
    assert ledger.mechanisms() == [Gaussian(QUERY_MECHANISM, 2.0, 1)]
