"""The training driver ``train_private`` keeps the guarantee a user relies on: the noise cannot be
replayed from the run seed, batches are sampled at the rate the ledger records, the noise follows
the clip norm of each step, and the Poisson coins come from the secure source when asked."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from dpsynth.contract import RunContext
from dpsynth.dpsgd.sampler import block_size
from dpsynth.dpsgd.training import PrivateTraining, train_private
from dpsynth.privacy import NoiseSource, PrivacyLedger
from dpsynth.privacy import rng as rng_module


class _Checkpoints:
    def load(self, phase: str) -> None:
        return None

    def save(self, state: dict, phase: str) -> None:
        pass


class _Curves:
    def log(self, step: int, **values: float) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass


class FakeContext:
    """The parts of ``RunContext`` that ``train_private`` reads."""

    def __init__(self, seed: int = 0, secure_rng: bool = False) -> None:
        self.seed = seed
        self.ledger = PrivacyLedger(target_epsilon=1e4, delta=1e-5, accountant="rdp")
        self.secure_rng = secure_rng
        self.checkpoints = _Checkpoints()
        self.curves = _Curves()
        self.lines: list[tuple[str, bool]] = []

    def log(self, message: str, private: bool = False) -> None:
        self.lines.append((message, private))

    def noise_source(self) -> NoiseSource:
        return NoiseSource(secure=self.secure_rng)

    releases_spent = RunContext.releases_spent
    resume = RunContext.resume


def keys(count: int) -> np.ndarray:
    """Stand-in content keys of ``count`` distinct records."""
    return np.arange(count, dtype=np.uint64)


def zero_gradient_loss(model_call, example):
    """A loss with zero gradient: the update is the DP noise alone."""
    return 0.0 * model_call(example["x"]).sum()


def make_rows(indices: torch.Tensor, draws: Any) -> dict[str, torch.Tensor]:
    return {"x": torch.ones(len(indices), 20)}


def settings(**overrides: Any) -> PrivateTraining:
    values = {
        "batch_size": 8,
        "lr": 1.0,
        "steps": 1,
        "optimizer": "sgd",
        "momentum": 0.0,
        "noise_multiplier": 2.0,
        "clip_norm": 0.5,
        "checkpoint_every": 10_000,
    }
    values.update(overrides)
    return PrivateTraining(**values)


def run_once(seed: int, **overrides: Any) -> torch.Tensor:
    """One DP step from the same seed, model and data; returns the parameter change."""
    torch.manual_seed(seed)
    model = nn.Linear(20, 50)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    train_private(FakeContext(seed), model, zero_gradient_loss, make_rows, keys(100), settings(**overrides))
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def test_the_same_seed_twice_gives_different_noise():
    # A noise generator seeded from the run seed (torch.initial_seed()) would replay: equal updates.
    first, second = run_once(seed=3), run_once(seed=3)
    assert first.abs().min() > 0 and second.abs().min() > 0
    assert not torch.allclose(first, second)
    # And they are independent draws: no correlation between the two noise vectors.
    correlation = torch.corrcoef(torch.stack([first, second]))[0, 1]
    assert abs(float(correlation)) < 5 / math.sqrt(first.numel())


def test_noise_std_follows_the_clip_norm_of_each_step():
    # DPDM changes C every step; the released noise must be sigma * C_t, not sigma * C_0.
    sigma, batch, steps, c0, c_t = 2.0, 8, 2, 0.5, 40.0
    torch.manual_seed(0)
    model = nn.Linear(20, 50)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    engine = train_private(
        FakeContext(),
        model,
        zero_gradient_loss,
        make_rows,
        keys(100),
        settings(steps=steps, clip_norm=c0, noise_multiplier=sigma),
        clip_norm_fn=lambda step, engine: c_t,
    )
    moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    expected = sigma * c_t / batch * math.sqrt(steps)  # two independent noisy SGD steps with lr 1
    assert engine.max_grad_norm == c_t
    assert float(moved.std()) == pytest.approx(expected, rel=0.1)  # 1,050 draws: ~2% sampling error


def test_batches_are_sampled_at_the_rate_the_ledger_records():
    num_examples, steps = 200, 300
    sizes: list[int] = []

    def counting_rows(indices: torch.Tensor, draws: Any) -> dict[str, torch.Tensor]:
        sizes.append(len(indices))
        return make_rows(indices, draws)

    ctx = FakeContext()
    model = nn.Linear(20, 1)
    # physical batch larger than any realised batch: one make_batch call per step
    train_private(
        ctx,
        model,
        zero_gradient_loss,
        counting_rows,
        keys(num_examples),
        settings(batch_size=10, steps=steps, physical_batch_size=num_examples),
    )
    recorded = next(m for m in ctx.ledger.mechanisms() if m.name == "dpsgd")
    assert recorded.steps == steps and len(sizes) == steps
    # Every example joins every step with probability q: the total is Binomial(N * T, q).
    assert stats.binomtest(sum(sizes), num_examples * steps, recorded.sample_rate).pvalue > 1e-4
    assert sum(sizes) / steps == pytest.approx(recorded.sample_rate * num_examples, rel=0.1)


def test_secure_rng_draws_the_poisson_coins_from_os_urandom(monkeypatch):
    uniform_calls: list[int] = []
    real = rng_module._urandom_uniform

    def spy(count: int):
        uniform_calls.append(count)
        return real(count)

    monkeypatch.setattr(rng_module, "_urandom_uniform", spy)
    sizes: list[int] = []

    def counting_rows(indices: torch.Tensor, draws: Any) -> dict[str, torch.Tensor]:
        sizes.append(len(indices))
        return make_rows(indices, draws)

    model = nn.Linear(20, 1)
    train_private(
        FakeContext(secure_rng=True),
        model,
        zero_gradient_loss,
        counting_rows,
        keys(100),
        settings(steps=3, physical_batch_size=100),
    )
    # one block of uniforms per step for the Poisson sample (dpsynth.dpsgd.sampler.poisson_indices; the
    # Gaussian noise draws 2 * ceil(n/2) uniforms per tensor: 20 and 2 here)
    assert uniform_calls.count(block_size(100, 8 / 100)) == 3
    assert len(sizes) == 3


def test_non_finite_examples_are_counted_in_a_private_log_line_only():
    """An example whose gradient is NaN contributes zero; the count reaches only a private log line."""

    def nan_for_the_second_row(model_call, example):
        loss = model_call(example["x"]).sum()
        return torch.where(example["x"][0, 0] > 1.5, loss * float("nan"), loss)

    def rows(indices: torch.Tensor, draws: Any) -> dict[str, torch.Tensor]:
        x = torch.ones(len(indices), 1, 20)
        x[indices == 1] = 2.0
        return {"x": x}

    ctx = FakeContext()
    model = nn.Linear(20, 3)
    engine = train_private(ctx, model, nan_for_the_second_row, rows, keys(2), settings=settings(batch_size=2, steps=40))
    assert engine.nonfinite_examples > 0 and all(torch.isfinite(p).all() for p in model.parameters())
    counted = [(m, private) for m, private in ctx.lines if "non-finite" in m]
    assert counted == [(counted[0][0], True)] and str(engine.nonfinite_examples) in counted[0][0]
    assert not any(str(engine.nonfinite_examples) in m for m, private in ctx.lines if not private and "non-finite" in m)


def test_graph_true_on_the_cpu_runs_the_fixed_shape_step_and_charges_each_step():
    ctx = FakeContext()
    model = nn.Linear(20, 50)
    before = [p.detach().clone() for p in model.parameters()]
    data = torch.ones(100, 20)

    def device_rows(indices: torch.Tensor, draws: Any) -> dict[str, torch.Tensor]:
        return {"x": data[indices] + draws.randn(20)}

    train_private(
        ctx, model, zero_gradient_loss, make_rows, keys(100), settings(steps=3, graph=True), device_batch=device_rows
    )
    assert next(m for m in ctx.ledger.mechanisms() if m.name == "dpsgd").steps == 3
    assert any("uncaptured fixed-shape batch of" in line for line, _ in ctx.lines)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_graph_without_a_device_builder_says_why_and_runs_eagerly():
    ctx = FakeContext()
    train_private(ctx, nn.Linear(20, 50), zero_gradient_loss, make_rows, keys(100), settings(graph=True))
    assert any("runs eagerly" in line for line, _ in ctx.lines)


def test_graph_auto_on_the_cpu_stays_eager_and_silent():
    ctx = FakeContext()
    train_private(ctx, nn.Linear(20, 50), zero_gradient_loss, make_rows, keys(100), settings(), device_batch=make_rows)
    assert not any("graph" in line or "fixed-shape" in line for line, _ in ctx.lines)
