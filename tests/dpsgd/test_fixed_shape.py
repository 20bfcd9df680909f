"""The fixed-shape private step (dpsynth.dpsgd.fixed_shape): masked rows contribute exactly zero, the device
sampler is Poisson at rate q, device per-record draws are the host's, overflow takes the exact path, and one
record moves the noiseless clipped sum by at most C. CPU only; graph capture itself is checked on CUDA by
experiments/gpu_engine_v4.sh."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from dpsynth.dpsgd import DPSGDEngine
from dpsynth.dpsgd.fixed_shape import (
    MASK,
    OVERFLOW_PROBABILITY,
    DevicePoissonSampler,
    FixedShapeStep,
    fixed_micro_batches,
    masked_clipped_sum,
    masked_loss,
    pack_included,
    poisson_capacity,
)
from dpsynth.dpsgd.per_example import PerExampleGradients, clipped_grad_sum
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.device_draws import DeviceRecordRandomness
from dpsynth.privacy.record_draws import RecordRandomness
from dpsynth.privacy.rng import NoiseSource

CLIP = 0.5
STRATEGIES = ("ghost", "instantiate", "exact", "auto")


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.norm = nn.GroupNorm(1, 3)
        self.head = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(x))).flatten(1))


def loss_fn(model_call, example):
    return F.cross_entropy(model_call(example["x"].unsqueeze(0)), example["y"].unsqueeze(0))


def dataset(n: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(n, 1, 4, 4, generator=g) * 3, "y": torch.randint(0, 3, (n,), generator=g)}


def realised_sum(model, strategy, data, indices):
    per_example = PerExampleGradients(model, loss_fn, strategy=strategy)
    batch = {key: value[indices] for key, value in data.items()}
    return clipped_grad_sum(per_example, [batch], CLIP)[0]


def masked_sum(model, strategy, data, included, capacity, physical=4):
    per_example = PerExampleGradients(model, masked_loss(loss_fn), strategy=strategy)
    packed = pack_included(included, capacity)
    rows = {key: value[packed.indices] for key, value in data.items()}
    micro = fixed_micro_batches(rows, packed.mask.to(torch.float32), physical)
    return masked_clipped_sum(per_example, micro, CLIP)[0]


def test_capacity_is_the_smallest_with_overflow_below_the_bound():
    n, q = 60_000, 256 / 60_000
    capacity = poisson_capacity(n, q)
    assert stats.binom.sf(capacity, n, q) < OVERFLOW_PROBABILITY <= stats.binom.sf(capacity - 1, n, q)
    assert poisson_capacity(10, 1.0) == 10


def test_packing_keeps_every_included_record_in_order():
    included = torch.tensor([False, True, True, False, True, False])
    packed = pack_included(included, 5)
    assert packed.mask.tolist() == [True, True, True, False, False]
    assert packed.indices[:3].tolist() == [1, 2, 4] and int(packed.count) == 3 and not bool(packed.overflow)
    assert bool(pack_included(included, 2).overflow)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_masked_fixed_shape_sum_equals_the_realised_records_sum(strategy):
    torch.manual_seed(0)
    model, data = TinyNet(), dataset()
    included = torch.tensor([True, False, True, True, False, False, True, False, False, True, False, False])
    expected = realised_sum(model, strategy, data, torch.nonzero(included).flatten())
    got = masked_sum(model, strategy, data, included, capacity=8)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_empty_sample_gives_a_zero_sum():
    torch.manual_seed(0)
    model, data = TinyNet(), dataset()
    got = masked_sum(model, "auto", data, torch.zeros(12, dtype=torch.bool), capacity=4)
    assert all(bool((value == 0).all()) for value in got.values())


def test_device_sampler_is_poisson_at_rate_q_and_independent():
    n, q, steps = 8, 0.3, 4000
    sampler = DevicePoissonSampler(n, q, torch.Generator().manual_seed(1), capacity=n)
    rows = torch.stack([sampler.sample() and sampler.last_included for _ in range(steps)]).numpy()
    for record in range(n):  # each record's inclusion frequency is Binomial(steps, q)
        assert stats.binomtest(int(rows[:, record].sum()), steps, q).pvalue > 1e-4
    both = int((rows[:, 0] & rows[:, 1]).sum())  # joint inclusion of two records is q^2 under independence
    assert stats.binomtest(both, steps, q * q).pvalue > 1e-4
    sizes = rows.sum(1)  # the realised size is Binomial(n, q): a chi-square test of its histogram
    observed = np.bincount(sizes, minlength=n + 1)
    expected = stats.binom.pmf(np.arange(n + 1), n, q) * steps
    keep = expected > 5
    chi2 = (((observed[keep] - expected[keep]) ** 2) / expected[keep]).sum()
    assert stats.chi2.sf(chi2, keep.sum() - 1) > 1e-4


def test_device_draws_equal_host_draws_and_ignore_the_rest_of_the_batch():
    keys = np.array([3, 2**63 + 5, 2**64 - 1, 12345678901234567], dtype=np.uint64)
    host = RecordRandomness.for_tests(keys, key=2**64 - 7)
    device = DeviceRecordRandomness(host, "cpu")
    step = torch.tensor(5)
    for order in ([0, 1, 2, 3], [3, 1], [2, 0, 3, 0]):
        indices = torch.tensor(order)
        mine, theirs = device.draws(step, indices), host.draws(5, indices)
        assert torch.equal(mine.rand(3, dtype=torch.float64), theirs.rand(3, dtype=torch.float64))
        assert torch.equal(mine.randn(2, 2), theirs.randn(2, 2))
        assert torch.equal(mine.randint(0, 1000, 4), theirs.randint(0, 1000, 4))
    alone = device.draws(step, torch.tensor([1])).randn(6)
    among = device.draws(step, torch.tensor([3, 0, 1, 2])).randn(6)
    assert torch.equal(alone[0], among[2])
    assert not torch.equal(alone, device.draws(torch.tensor(6), torch.tensor([1])).randn(6))


@pytest.mark.parametrize("strategy", ("ghost", "instantiate", "exact"))
def test_one_record_moves_the_noiseless_fixed_shape_sum_by_at_most_c(strategy):
    torch.manual_seed(1)
    model, data = TinyNet(), dataset()
    included = torch.ones(12, dtype=torch.bool)
    with_all = masked_sum(model, strategy, data, included, capacity=12)
    for removed in (0, 5, 11):
        without = included.clone()
        without[removed] = False
        other = masked_sum(model, strategy, data, without, capacity=12)
        distance = torch.sqrt(sum(((with_all[k] - other[k]) ** 2).sum() for k in with_all))
        assert float(distance) <= CLIP * (1 + 1e-5)
        assert float(distance) > 0


def make_step(capacity=None, q=0.5, ema=None):
    torch.manual_seed(2)
    model, data = TinyNet(), dataset()
    ledger = PrivacyLedger(target_epsilon=50.0, delta=1e-5, accountant="rdp")
    noise = NoiseSource(seed=0)
    engine = DPSGDEngine(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        masked_loss(loss_fn),
        ledger,
        noise_multiplier=1.0,
        max_grad_norm=CLIP,
        sample_rate=q,
        expected_batch_size=q * 12,
        max_physical_batch_size=4,
        ema_decay=ema,
        noise=noise,
    )
    keys = np.arange(12, dtype=np.uint64) * np.uint64(7919)
    randomness = DeviceRecordRandomness(RecordRandomness.for_tests(keys), "cpu")

    def build(indices, draws):  # per-record noise on the inputs, as a diffusion loss would draw it
        return {"x": data["x"][indices] + 0.1 * draws.randn(1, 4, 4), "y": data["y"][indices]}

    sampler = DevicePoissonSampler(12, q, torch.Generator().manual_seed(4), capacity=capacity)
    return FixedShapeStep(engine, randomness, build, sampler, physical=4), ledger


def spent(ledger):
    return next(m for m in ledger.mechanisms() if m.name == "dpsgd").steps


def test_fixed_shape_step_charges_once_per_step_and_updates_the_model():
    step, ledger = make_step(ema=0.9)
    before = [p.detach().clone() for p in step.engine.model.parameters()]
    for _ in range(3):
        stats_ = step()
    assert spent(ledger) == 3 and stats_.step == 3 and step.exact_steps == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, step.engine.model.parameters()))
    assert step.engine._ema.num_updates == 3


def test_overflow_takes_the_exact_path_and_charges_the_same_entry():
    step, ledger = make_step(capacity=1, q=0.9)  # P(at most one of 12 at q=0.9) is negligible
    step()
    step()
    assert step.exact_steps == 2 and spent(ledger) == 2 and step.engine.steps == 2
    assert [m.name for m in ledger.mechanisms()] == ["dpsgd"]


def test_capture_refuses_the_secure_noise_source():
    step, _ = make_step()
    step.engine.noise = NoiseSource(secure=True)
    with pytest.raises(Exception, match="not captured"):
        FixedShapeStep(step.engine, step.randomness, step.build, step.sampler, 4, capture=True)


def test_graph_key_is_validated_at_load():
    from dpsynth.dpsgd.section import DPSGDSection

    assert DPSGDSection(graph=True).private_training().graph is True
    assert DPSGDSection().private_training().graph == "auto"
    with pytest.raises(Exception, match="graph"):
        DPSGDSection(graph="yes")


def test_the_masked_loss_zeroes_masked_rows_and_scores_an_unmasked_public_example_as_it_is():
    linear = torch.nn.Linear(3, 1)

    def base(call, example):
        return call(example["x"]).sum()

    wrapped = masked_loss(base)
    x = torch.ones(1, 3)
    assert wrapped(linear, {"x": x, MASK: torch.tensor(0.0)}).item() == 0.0
    assert wrapped(linear, {"x": x, MASK: torch.tensor(1.0)}).item() == pytest.approx(base(linear, {"x": x}).item())
    assert wrapped(linear, {"x": x}).item() == pytest.approx(base(linear, {"x": x}).item())  # e.g. the clip probe
