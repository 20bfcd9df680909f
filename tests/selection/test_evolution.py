"""Private Evolution's selection step (dpsynth.selection.evolution): the k-hot nearest-neighbour votes (one record
moves one class's histogram by exactly its row), the lazy private embeddings read only after the charge, one
registered repeat per round, and the thresholded resampling within each class."""

from __future__ import annotations

import math

import pytest
import torch

from dpsynth.errors import BudgetExceededError, DataError
from dpsynth.privacy import Gaussian, NoiseSource, PrivacyLedger
from dpsynth.privacy.bounded_sum import BoundedSum, class_sums
from dpsynth.selection.evolution import PrivateVotes, resampling_weights, select_population, vote_and_select, vote_rows


def _neighbours(num_nearest: int):
    generator = torch.Generator().manual_seed(0)
    candidates = torch.randn(3, 6, 5, generator=generator)  # K = 3 classes, 6 candidates each, D = 5
    private = torch.randn(20, 5, generator=generator)
    labels = torch.arange(20) % 3
    full = class_sums([(vote_rows(private, labels, candidates, num_nearest), labels)], 6, 3, math.sqrt(num_nearest))[0]
    less = class_sums(
        [(vote_rows(private[1:], labels[1:], candidates, num_nearest), labels[1:])], 6, 3, math.sqrt(num_nearest)
    )[0]
    return private, labels, candidates, full, less


def test_removing_one_record_changes_one_bin_by_exactly_one():
    private, labels, candidates, full, less = _neighbours(1)
    difference = full - less
    assert torch.count_nonzero(difference) == 1 and float(difference.sum()) == 1.0
    nearest = int(torch.cdist(private[:1], candidates[int(labels[0])]).argmin())
    assert float(difference[int(labels[0]), nearest]) == 1.0  # the removed record's nearest, in its own class
    assert float(full.sum()) == len(private)  # every record votes once


def test_k_nearest_votes_move_k_bins_by_one_each():
    *_, full, less = _neighbours(3)
    difference = full - less
    assert torch.count_nonzero(difference) == 3 and set(difference[difference != 0].tolist()) == {1.0}
    assert float(difference.norm()) == pytest.approx(math.sqrt(3))


def test_threshold_and_uniform_fallback():
    histogram = torch.tensor([[5.0, 1.0, -2.0], [0.5, 0.2, -1.0]], dtype=torch.float64)
    weights, empty = resampling_weights(histogram, threshold=1.0)
    assert weights[0].tolist() == [4.0, 0.0, 0.0]
    assert empty == [1] and weights[1].tolist() == [1.0, 1.0, 1.0]  # all below H: uniform resampling
    weights, empty = resampling_weights(histogram, threshold=0.0)
    assert empty == [] and weights[1].tolist() == [0.5, 0.2, 0.0]


def test_the_population_is_resampled_within_each_class_block():
    """Class c's M draws index its own block [c M, (c + 1) M) of the class-major population, in proportion to its
    thresholded votes: a class with one candidate above H keeps only that one."""
    histogram = torch.tensor([[0.0, 9.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -1.0, -1.0, -1.0]])
    chosen, empty = select_population(histogram, 1.0, torch.Generator().manual_seed(0))
    assert chosen.shape == (12,) and empty == [2]
    assert chosen[:4].tolist() == [1] * 4
    assert all(4 <= i < 8 for i in chosen[4:8].tolist()) and all(8 <= i < 12 for i in chosen[8:].tolist())


class _Train:
    def __init__(self, labels):
        self.labels = labels


def test_each_round_is_one_registered_repeat_and_the_private_set_is_embedded_once_after_the_charge():
    calls = []

    def embed():
        calls.append(1)
        return torch.randn(12, 4, generator=torch.Generator().manual_seed(1))

    votes = PrivateVotes(_Train(torch.arange(12) % 3), embed, num_nearest=1, chunk=5)
    query = BoundedSum("votes", 1.0, 2.0, 3)
    refusing = PrivacyLedger(0.01, 1e-5)
    with pytest.raises(BudgetExceededError):
        vote_and_select(votes, torch.zeros(6, 4), query, refusing, NoiseSource(seed=0), 0.0, torch.Generator())
    assert calls == []  # a refused charge reads nothing private
    ledger, candidates = PrivacyLedger(10.0, 1e-5), torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    for expected in (1, 2):
        chosen, _, released = vote_and_select(
            votes, candidates, query, ledger, NoiseSource(seed=0), 0.0, torch.Generator().manual_seed(0)
        )
        assert ledger.mechanisms() == [Gaussian("votes", 2.0, expected)]
        assert released.sums.shape == (3, 2) and released.noise_std == 2.0 and chosen.shape == (6,)
    assert calls == [1]
    bad = PrivateVotes(_Train(torch.tensor([0, 3])), lambda: torch.zeros(2, 4), num_nearest=1, chunk=5)
    with pytest.raises(DataError, match="outside"):
        list(bad.chunks(torch.zeros(3, 2, 4)))
