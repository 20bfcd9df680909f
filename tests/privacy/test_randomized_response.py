"""DPPM's randomized response over projection vectors (Eq. 6): exact probabilities, top-k by cosine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dpsynth.errors import ConfigError
from dpsynth.privacy.randomized_response import keep_probability, nearest_by_cosine, randomized_response


@pytest.mark.parametrize("epsilon,k", [(1.0, 10), (0.1, 4), (3.0, 2)])
def test_keep_probability_is_eq_6(epsilon, k):
    assert keep_probability(epsilon, k) == pytest.approx(math.exp(epsilon) / (math.exp(epsilon) + k - 1))


def test_neighbourhood_is_the_k_most_cosine_similar_vectors_with_the_vector_first():
    generator = torch.Generator().manual_seed(0)
    vectors = torch.randn(12, 5, generator=generator)
    vectors[3] = 7.0 * vectors[0]  # same direction, different length: cosine 1
    neighbours = nearest_by_cosine(vectors, 4)
    assert neighbours[:, 0].tolist() == list(range(12))
    assert neighbours[0, 1].item() == 3 and neighbours[3, 1].item() == 0
    unit = torch.nn.functional.normalize(vectors, dim=1)
    for i in range(12):
        others = [j for j in range(12) if j != i]
        ranked = sorted(others, key=lambda j: -float(unit[i] @ unit[j]))[:3]
        assert set(neighbours[i, 1:].tolist()) == set(ranked)


@pytest.mark.parametrize("epsilon,k", [(1.0, 10), (2.0, 4)])
def test_response_frequencies_match_eq_6_chi_square(epsilon, k):
    # Every row's response is an independent draw; its position in the row's neighbourhood (0 = itself)
    # must follow Eq. 6: e^ε/(e^ε+k-1) at 0 and 1/(e^ε+k-1) at each of the k-1 others.
    generator = torch.Generator().manual_seed(1)
    vectors = torch.randn(16, 8, generator=generator)
    neighbourhoods = nearest_by_cosine(vectors, k)
    counts = np.zeros(k)
    for _ in range(1500):
        _, chosen = randomized_response(vectors, epsilon, k, generator)
        matches = neighbourhoods == chosen[:, None]
        assert bool(matches.any(dim=1).all())  # only the row's top-k neighbourhood is ever returned
        counts += np.bincount(matches.int().argmax(dim=1).numpy(), minlength=k)
    keep = keep_probability(epsilon, k)
    expected = np.array([keep] + [(1 - keep) / (k - 1)] * (k - 1)) * counts.sum()
    assert chisquare(counts, expected).pvalue > 1e-3
    # The test has power: uniform responses over the neighbourhood are rejected.
    assert chisquare(counts, np.full(k, counts.sum() / k)).pvalue < 1e-6


def test_response_returns_the_chosen_vectors():
    generator = torch.Generator().manual_seed(2)
    vectors = torch.randn(10, 3, generator=generator)
    responded, chosen = randomized_response(vectors, 0.5, 3, generator)
    assert torch.equal(responded, vectors[chosen])


@pytest.mark.parametrize("epsilon,k", [(0.0, 3), (1.0, 1), (1.0, 11), (math.inf, 3)])
def test_bad_parameters_are_config_errors(epsilon, k):
    with pytest.raises(ConfigError):
        randomized_response(torch.randn(10, 3), epsilon, k, torch.Generator())
