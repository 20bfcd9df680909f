"""Poisson sampling by geometric gaps (dpsynth.dpsgd.sampler.poisson_indices): the law of one coin per
example, independent across examples, in O(qN) draws; the sharded sampler's union is the same law."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from dpsynth.dpsgd import sampler as sampler_module
from dpsynth.dpsgd.distributed import ShardedPoissonSampler
from dpsynth.dpsgd.sampler import PoissonSampler, poisson_indices
from dpsynth.privacy.rng import NoiseSource

COUNT, RATE, DRAWS = 40, 0.2, 6000


def inclusion_matrix(draw, count: int = COUNT, draws: int = DRAWS) -> np.ndarray:
    """bool [draws, count]: which indices each sample holds (checking every sample is sorted and unique)."""
    included = np.zeros((draws, count), dtype=bool)
    for row in range(draws):
        indices = draw()
        assert indices.dtype == torch.int64 and torch.equal(indices, indices.unique())
        included[row, indices.numpy()] = True
    return included


def assert_bernoulli_law(included: np.ndarray, rate: float) -> None:
    """Each index in with probability q, the size Binomial(N, q), and pairs independent (q^2 together)."""
    draws, count = included.shape
    per_index = included.sum(0)
    p_values = [stats.binomtest(int(k), draws, rate).pvalue for k in per_index]
    assert min(p_values) > 1e-4 / count, per_index  # Bonferroni over the indices
    sizes = np.bincount(included.sum(1), minlength=count + 1)
    expected = stats.binom.pmf(np.arange(count + 1), count, rate) * draws
    keep = expected >= 5  # the chi-square approximation's usual rule
    observed = np.append(sizes[keep], sizes[~keep].sum())
    wanted = np.append(expected[keep], expected[~keep].sum())
    assert stats.chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue > 1e-4
    for first, second in ((0, 1), (0, count - 1), (count // 2, count // 2 + 1), (count - 2, count - 1)):
        both = int((included[:, first] & included[:, second]).sum())
        assert stats.binomtest(both, draws, rate * rate).pvalue > 1e-4, (first, second, both)


def test_geometric_gaps_give_one_independent_coin_per_example():
    generator = torch.Generator().manual_seed(0)
    sampler = PoissonSampler(COUNT, RATE, generator=generator)
    assert_bernoulli_law(inclusion_matrix(sampler.sample), RATE)


def test_the_law_holds_when_a_sample_needs_several_blocks_of_uniforms(monkeypatch):
    monkeypatch.setattr(sampler_module, "block_size", lambda remaining, rate: 3)
    noise = NoiseSource(seed=1)
    assert_bernoulli_law(inclusion_matrix(lambda: poisson_indices(COUNT, RATE, noise.uniform)), RATE)


def test_the_secure_source_samples_the_same_law():
    noise = NoiseSource(secure=True)
    assert_bernoulli_law(inclusion_matrix(lambda: poisson_indices(COUNT, RATE, noise.uniform), draws=3000), RATE)


def test_draws_grow_with_the_batch_not_with_the_dataset():
    drawn: list[int] = []
    noise = NoiseSource(seed=2)

    def counting(count: int) -> torch.Tensor:
        drawn.append(count)
        return noise.uniform(count)

    for _ in range(20):
        batch = poisson_indices(10**9, 64 / 10**9, counting)
        assert len(batch) < 200 and (len(batch) == 0 or int(batch.max()) < 10**9)
    assert max(drawn) < 200  # about qN + 4 sqrt(qN) + 16, never N


@pytest.mark.parametrize("count, rate", [(5, 1.0), (10**15, 1e-300), (1, 0.5)])
def test_edge_rates(count, rate):
    noise = NoiseSource(seed=3)
    batch = poisson_indices(count, rate, noise.uniform)
    if rate == 1.0:
        assert torch.equal(batch, torch.arange(count))
    assert len(batch) <= count and (len(batch) == 0 or 0 <= int(batch.min()) <= int(batch.max()) < count)


def test_sharded_samples_are_global_indices_whose_union_has_the_law():
    world, noises = 3, [NoiseSource(seed=10 + r) for r in range(3)]
    shards = [ShardedPoissonSampler(COUNT, RATE, noises[r], shard=r, shards=world) for r in range(world)]
    for rank, sampler in enumerate(shards):
        assert torch.equal(sampler.indices, torch.arange(rank, COUNT, world))
        assert set(sampler.sample().tolist()) <= set(sampler.indices.tolist())
    union = inclusion_matrix(lambda: torch.cat([s.sample() for s in shards]).sort().values, draws=4000)
    assert_bernoulli_law(union, RATE)
    empty = ShardedPoissonSampler(2, 0.5, NoiseSource(seed=4), shard=3, shards=4)
    assert len(empty.sample()) == 0 and len(empty.indices) == 0
