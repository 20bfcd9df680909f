"""The DP noise source: its draws have the law the accountant assumes, and only a test seed replays them."""

import math

import pytest
import torch
from scipy import stats

from dpsynth.privacy.rng import NoiseSource


@pytest.mark.parametrize(
    "source", [NoiseSource(seed=3), NoiseSource(), NoiseSource(secure=True)], ids=["seeded", "entropy", "secure"]
)
def test_normal_draws_are_gaussian_with_the_asked_std(source):
    draws = source.normal((200_000,), std=2.5, dtype=torch.float64)
    assert draws.dtype == torch.float64 and draws.shape == (200_000,)
    assert abs(float(draws.mean())) < 4 * 2.5 / math.sqrt(200_000)
    assert float(draws.std()) == pytest.approx(2.5, rel=0.01)
    assert stats.kstest(draws.numpy() / 2.5, "norm").pvalue > 1e-4


def test_normal_draws_come_in_the_asked_dtype_rounded_from_float64():
    seeded = NoiseSource(seed=4).normal((1000,), std=1.5, dtype=torch.float32)
    wide = NoiseSource(seed=4).normal((1000,), std=1.5, dtype=torch.float64)
    assert seeded.dtype == torch.float32
    assert torch.equal(seeded, wide.to(torch.float32))


def test_only_a_test_seed_replays_the_noise():
    assert torch.equal(NoiseSource(seed=9).normal((64,), 1.0), NoiseSource(seed=9).normal((64,), 1.0))
    assert not torch.equal(NoiseSource().normal((64,), 1.0), NoiseSource().normal((64,), 1.0))
    with pytest.raises(ValueError, match="cannot be seeded"):
        NoiseSource(secure=True, seed=1)


@pytest.mark.parametrize("source", [NoiseSource(seed=5), NoiseSource(secure=True)], ids=["seeded", "secure"])
def test_uniforms_are_float64_in_the_unit_interval(source):
    u = source.uniform(100_000)
    assert u.dtype == torch.float64
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-4
