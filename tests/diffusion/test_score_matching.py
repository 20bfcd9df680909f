"""Score matching for DPPM: known scores recovered on a 2-D toy, Eq. 7 against a direct Jacobian, the
engine's per-example gradients of the sliced loss against an example-by-example reference."""

from __future__ import annotations

import pytest
import torch

from dpsynth.diffusion.score_matching import (
    ScoreMatchingLoss,
    denoising_score_loss,
    draw_perturbation,
    geometric_sigmas,
    sliced_score_loss,
)
from dpsynth.errors import ConfigError
from dpsynth.models.refinenet import RefineNet, RefineNetConfig
from dpsynth.privacy.record_draws import GeneratorDraws

MEAN = torch.tensor([0.5, -1.0])
COVARIANCE = torch.tensor([[1.0, 0.4], [0.4, 0.6]])


class AffineScore(torch.nn.Module):
    """s(x) = A x + b: the score family of Gaussians, so the minimiser is known exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def fit(loss_of_batch) -> AffineScore:
    """Minimise a full-batch loss (quadratic in A, b for both objectives) with L-BFGS."""
    torch.manual_seed(0)
    model = AffineScore()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_of_batch(model)
        loss.backward()
        return loss

    optimizer.step(closure)
    return model


def test_sliced_score_matching_recovers_the_score_of_a_2d_gaussian():
    generator = torch.Generator().manual_seed(1)
    data = MEAN + torch.randn(3000, 2, generator=generator) @ torch.linalg.cholesky(COVARIANCE).T
    projections = torch.randn(3000, 2, generator=generator)
    model = fit(lambda m: sliced_score_loss(m, data, projections).mean())
    precision = torch.linalg.inv(COVARIANCE)
    assert torch.allclose(model.linear.weight.detach(), -precision, atol=0.15)
    assert torch.allclose(model.linear.bias.detach(), precision @ MEAN, atol=0.25)  # P μ = (1.59, -2.73)


def test_denoising_score_matching_recovers_the_smoothed_score():
    generator = torch.Generator().manual_seed(2)
    sigma = torch.full((4000,), 0.5)
    data = MEAN + torch.randn(4000, 2, generator=generator) @ torch.linalg.cholesky(COVARIANCE).T
    noise = torch.randn(4000, 2, generator=generator)
    model = fit(lambda m: denoising_score_loss(m(data + 0.5 * noise), noise, sigma).mean())
    smoothed = torch.linalg.inv(COVARIANCE + 0.25 * torch.eye(2))  # score of N(μ, Σ + σ² I)
    assert torch.allclose(model.linear.weight.detach(), -smoothed, atol=0.1)


def test_sliced_loss_matches_eq_7_with_an_explicit_jacobian():
    torch.manual_seed(3)
    weight = torch.randn(3, 3)

    def score(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    x, v, v_r = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 3)
    losses = sliced_score_loss(score, x, v, v_r)
    for i in range(5):
        jacobian = torch.autograd.functional.jacobian(lambda z: torch.tanh(z @ weight), x[i])
        expected = v_r[i] @ jacobian @ v_r[i] + 0.5 * (v[i] @ score(x[i : i + 1])[0]) ** 2
        assert losses[i].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)


def test_geometric_ladder_and_bad_ladders():
    sigmas = geometric_sigmas(1.0, 0.01, 3)
    assert torch.allclose(sigmas, torch.tensor([1.0, 0.1, 0.01]))
    with pytest.raises(ConfigError):
        geometric_sigmas(0.01, 1.0, 3)
    with pytest.raises(ConfigError):
        ScoreMatchingLoss("ism", sigmas)


def test_only_the_sliced_loss_declares_that_it_differentiates_the_input():
    sigmas = geometric_sigmas(1.0, 0.1, 2)
    assert ScoreMatchingLoss("ssm", sigmas).differentiates_input is True
    assert ScoreMatchingLoss("dsm", sigmas).differentiates_input is False


class _Unlimited:
    """A ledger stand-in that allows every step (the test checks gradients, not accounting)."""

    def register(self, mechanism) -> None:
        pass

    def spend(self, name: str, steps: int = 1) -> None:
        pass


def test_engine_per_example_gradients_of_the_sliced_loss_equal_an_example_by_example_reference():
    # With zero noise and SGD at lr 1, one engine step moves the weights by -(1/B) Σ_i clip_C(g_i); the clip
    # norm is small enough that every example is clipped, so the update depends on each g_i separately.
    from dpsynth.dpsgd.engine import DPSGDEngine
    from dpsynth.privacy.rng import NoiseSource

    sigmas = geometric_sigmas(1.0, 0.1, 3)
    torch.manual_seed(4)
    # float64 throughout, so the update read back from the weights is exact to ~1e-12.
    model = RefineNet(RefineNetConfig(channels=1, num_levels=3, width=4), sigmas).double()
    loss_fn = ScoreMatchingLoss("ssm", sigmas.double())
    generator = torch.Generator().manual_seed(5)
    count, copies, shape = 4, 2, (1, 9, 8)
    drawn = draw_perturbation(GeneratorDraws(count, generator), copies, shape, 3, projections=True)
    batch = {"u": torch.randn(count, *shape, generator=generator).double(), **drawn}
    batch = {key: value.double() if value.is_floating_point() else value for key, value in batch.items()}

    clip = 1e-3
    reference = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for i in range(count):
        model.zero_grad()
        example = {key: value[i] for key, value in batch.items()}
        loss_fn(lambda *args: model(*args), example).backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        assert norm > clip
        for name, g in grads.items():
            reference[name] += g * (clip / norm)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = DPSGDEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        loss_fn,
        _Unlimited(),
        noise_multiplier=1e-12,
        max_grad_norm=clip,
        sample_rate=0.5,
        expected_batch_size=count,
        max_physical_batch_size=count,
        noise=NoiseSource(seed=0),
    )
    engine.step(batch)
    for name, p in model.named_parameters():
        update = (before[name] - p.detach()) * count
        assert torch.allclose(update, reference[name], atol=1e-12, rtol=1e-6), name


def test_audit_losses_average_every_level_with_public_noise_whatever_the_batch():
    from dpsynth.diffusion.score_matching import AUDIT_NOISE_SEED, example_denoising_losses

    sigmas = geometric_sigmas(1.0, 0.1, 3)
    model = RefineNet(RefineNetConfig(channels=1, num_levels=3, width=4), sigmas).eval()
    clean = torch.rand(5, 1, 6, 6) * 2 - 1
    generator = torch.Generator().manual_seed(AUDIT_NOISE_SEED)
    expected = torch.zeros(5, dtype=torch.float64)
    with torch.no_grad():
        for level in range(3):
            noise = torch.randn(clean.shape, generator=generator)
            batch = {"level": torch.full((5,), level), "noise": noise}
            expected += ScoreMatchingLoss("dsm", sigmas).batch_losses(model, clean, batch).double() / 3
    # Each loss is a float32 mean through a float32 network whose kernels sum in an order that depends on
    # the batch size and the machine (5e-6 apart on losses ~20 seen), so float64's default 1e-7 cannot
    # hold: 1e-5 relative (~80 float32 ulps) can. A level left out of the average, or noise drawn per
    # batch, moves a loss by O(1), far outside it.
    tolerance = {"rtol": 1e-5, "atol": 1e-5 * float(expected.abs().max())}
    torch.testing.assert_close(example_denoising_losses(model, clean, sigmas), expected, **tolerance)
    torch.testing.assert_close(example_denoising_losses(model, clean, sigmas, batch_size=2), expected, **tolerance)
    assert not torch.allclose(example_denoising_losses(model, clean.flip(0), sigmas), expected.flip(0))
