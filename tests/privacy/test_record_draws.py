"""Per-record draws (dpsynth.privacy.record_draws): a record's random inputs depend on the record, the step
and a secret key only, never on the other records of its batch or on the run seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from dpsynth.diffusion.losses import make_multiplicity_batch
from dpsynth.diffusion.schedules import MixtureOfUniformTimesteps, UniformTimesteps
from dpsynth.dpsgd.engine import DPSGDEngine
from dpsynth.errors import ConfigError
from dpsynth.privacy.record_draws import RecordDraws, RecordRandomness
from dpsynth.seeding import splitmix64

KEYS = np.array([11, 2**64 - 5, 2**62 + 3, 7, 2**63, 2**63 - 1], dtype=np.uint64)


def _exact_splitmix64(z: int) -> int:
    """SplitMix64's finaliser in Python's unbounded integers, reduced modulo 2**64 by hand."""
    mask = 2**64 - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_the_mixer_matches_exact_64_bit_arithmetic():
    # numpy's uint64 multiply must wrap modulo 2**64, also for keys at and above 2**63.
    assert splitmix64(KEYS).tolist() == [_exact_splitmix64(int(v)) for v in KEYS]


@pytest.mark.parametrize("draw", ["rand", "randn", "randint"])
def test_a_records_draws_do_not_depend_on_the_other_records_or_their_order(draw):
    def draws(keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        source = RecordDraws(key=123, step=4, record_keys=keys)
        first = source.randint(0, 1000, 3) if draw == "randint" else getattr(source, draw)(2, 3)
        second = getattr(source, "rand")(5)  # the next call: its own sub-stream
        return first, second

    full_first, full_second = draws(KEYS)
    order = np.array([3, 0, 5])
    sub_first, sub_second = draws(KEYS[order])
    order = torch.from_numpy(order)
    assert torch.equal(full_first[order], sub_first) and torch.equal(full_second[order], sub_second)
    assert not torch.equal(full_first[0], full_first[1])  # different records, different draws


def test_draws_change_with_the_step_and_the_key():
    base = RecordDraws(1, 0, KEYS).randn(8)
    assert not torch.allclose(base, RecordDraws(1, 1, KEYS).randn(8))
    assert not torch.allclose(base, RecordDraws(2, 0, KEYS).randn(8))


def test_draws_have_the_stated_distributions():
    source = RecordDraws(9, 0, np.arange(4000, dtype=np.uint64))
    uniform = source.rand(25).flatten().double().numpy()
    normal = source.randn(25).flatten().double().numpy()
    integers = source.randint(3, 8, 25).flatten().numpy()
    assert stats.kstest(uniform, "uniform").pvalue > 1e-4
    assert stats.kstest(normal, "norm").pvalue > 1e-4
    counts = np.bincount(integers - 3, minlength=5)
    assert integers.min() == 3 and integers.max() == 7 and stats.chisquare(counts).pvalue > 1e-4


def test_the_secret_key_is_fresh_and_never_shown():
    keys = np.arange(5, dtype=np.uint64)
    one, two = RecordRandomness(keys), RecordRandomness(keys)
    index = torch.arange(5)
    assert not torch.equal(one.draws(0, index).randn(4), two.draws(0, index).randn(4))
    assert str(one._key) not in repr(one)
    fixed = RecordRandomness.for_tests(keys, key=3)
    assert torch.equal(fixed.draws(2, index).randn(4), RecordRandomness.for_tests(keys, key=3).draws(2, index).randn(4))


def test_a_diffusion_batch_gives_each_record_the_same_k_copies_in_any_batch():
    randomness = RecordRandomness.for_tests(np.arange(10, dtype=np.uint64) * 7919, key=5)
    images = torch.randn(10, 1, 6, 6)
    labels = torch.arange(10) % 3
    options = dict(flip=True, crop_padding=1, label_dropout=0.3, null_label=3)
    sampler = MixtureOfUniformTimesteps(num_timesteps=100)

    def batch(indices: list[int]) -> dict[str, torch.Tensor]:
        index = torch.tensor(indices)
        return make_multiplicity_batch(images[index], labels[index], 4, sampler, randomness.draws(0, index), **options)

    alone, crowded = batch([6]), batch([2, 9, 6, 0])
    for key in ("x0", "t", "noise", "label"):
        assert torch.equal(alone[key][0], crowded[key][2]), key


def test_inverse_cdf_timesteps_follow_the_sampler_probabilities():
    for sampler in (UniformTimesteps(50), MixtureOfUniformTimesteps(num_timesteps=50)):
        uniform = torch.rand(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        draws = sampler.from_uniform(uniform)
        empirical = torch.bincount(draws, minlength=50).double() / len(draws)
        assert float((empirical - sampler.probabilities()).abs().max()) < 0.005
        assert sampler.from_uniform(torch.tensor([0.0, 1.0 - 2**-53])).tolist() == [0, 49]


def test_private_training_refuses_dropout():
    # Dropout masks come from torch's generator by batch position: they are not per-record draws.
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="dropout"):
        DPSGDEngine(
            model,
            optimizer,
            lambda call, example: call(example["x"]).sum(),
            None,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sample_rate=0.1,
            expected_batch_size=4,
            max_physical_batch_size=4,
        )


def test_a_diffusion_config_with_dropout_fails_at_load():
    from dpsynth.api import Synthesizer
    from dpsynth.config import find_config

    with pytest.raises(ConfigError, match="dropout"):
        Synthesizer.from_config(find_config("dpdm/smoke"), {"dpdm.unet": {"dropout": 0.1}})
