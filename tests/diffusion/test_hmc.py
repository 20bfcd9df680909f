"""DPPM's samplers on targets with a known score: HMC (Algorithm 2) and annealed Langevin (NCSN)."""

from __future__ import annotations

import math

import pytest
import torch

from dpsynth.diffusion.hmc import MCMCSettings, annealed_sample, draw_momentum, hmc_step, hmc_step_size, langevin_step
from dpsynth.errors import ConfigError

MEAN = torch.tensor([1.0, -2.0])
COVARIANCE = torch.tensor([[1.0, 0.6], [0.6, 0.5]])
PRECISION = torch.linalg.inv(COVARIANCE)


def gaussian_score(x: torch.Tensor) -> torch.Tensor:
    return -(x - MEAN) @ PRECISION


def run_chains(
    x: torch.Tensor,
    iterations: int,
    step_size: float,
    leapfrog: int,
    metropolis: bool,
    generator: torch.Generator,
    kinetic: str = "gaussian",
) -> tuple[torch.Tensor, float]:
    current, accepted = None, []
    for _ in range(iterations):
        step = hmc_step(
            gaussian_score,
            x,
            step_size,
            leapfrog,
            draw_momentum(tuple(x.shape), kinetic, generator),
            metropolis=metropolis,
            current_score=current,
            generator=generator,
        )
        x, current = step.x, step.score
        accepted.append(step.accepted.float().mean().item())
    return x, sum(accepted) / len(accepted)


def test_hmc_recovers_mean_and_covariance_of_a_2d_gaussian():
    generator = torch.Generator().manual_seed(0)
    start = 3.0 * torch.randn(4000, 2, generator=generator)  # far from the target
    x, acceptance = run_chains(start, 60, 0.3, 5, True, generator)
    assert torch.allclose(x.mean(0), MEAN, atol=0.06)
    assert torch.allclose(torch.cov(x.T), COVARIANCE, atol=0.08)
    assert 0.5 < acceptance <= 1.0


def test_metropolis_keeps_the_gaussian_target_invariant_where_plain_leapfrog_does_not():
    # A step of 1.6 σ_min is stable but biased: uncorrected leapfrog inflates the variance along the
    # narrow axis by 1 / (1 - λ²/(4σ²)) ≈ 2.8. The trapezoid path integral of the score is exact for a
    # quadratic energy, so with Metropolis the chain must stay exactly on the target.
    generator = torch.Generator().manual_seed(1)
    narrow = torch.linalg.eigh(COVARIANCE)
    sigma_min, axis = narrow.eigenvalues[0].sqrt().item(), narrow.eigenvectors[:, 0]
    start = MEAN + torch.randn(20000, 2, generator=generator) @ torch.linalg.cholesky(COVARIANCE).T
    corrected, _ = run_chains(start, 15, 1.6 * sigma_min, 3, True, generator)
    uncorrected, _ = run_chains(start, 15, 1.6 * sigma_min, 3, False, generator)

    def variance(x: torch.Tensor) -> float:
        return ((x - MEAN) @ axis).var().item()

    assert variance(corrected) == pytest.approx(sigma_min**2, rel=0.06)
    assert torch.allclose(corrected.mean(0), MEAN, atol=0.03)
    assert variance(uncorrected) > 1.8 * sigma_min**2


@pytest.mark.parametrize("kind", ["gaussian", "rayleigh", "uniform"])
def test_momentum_distributions_have_unit_variance_and_zero_mean(kind):
    p = draw_momentum((200_000,), kind, torch.Generator().manual_seed(2))
    assert p.mean().item() == pytest.approx(0.0, abs=0.01)
    assert p.var().item() == pytest.approx(1.0, abs=0.02)
    if kind == "uniform":
        assert p.abs().max().item() <= math.sqrt(3.0)


def test_unknown_kinetic_distribution_is_a_config_error():
    with pytest.raises(ConfigError, match="kinetic"):
        draw_momentum((3,), "laplace")


def test_step_size_follows_algorithm_2_decay_and_sigma_scaling():
    assert hmc_step_size(0.01, 1, 10, 2.0, 1.0) == pytest.approx(1.0)  # λ0 (M/1)²
    assert hmc_step_size(0.01, 10, 10, 2.0, 1.0) == pytest.approx(0.01)
    assert hmc_step_size(0.01, 10, 10, 2.0, 4.0) == pytest.approx(0.04)


def test_mask_keeps_fixed_coordinates_in_place():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(50, 2, generator=generator)
    mask = torch.tensor([[1.0, 0.0]])
    step = hmc_step(
        gaussian_score, x, 0.3, 4, draw_momentum((50, 2), "gaussian", generator), mask=mask, generator=generator
    )
    assert torch.equal(step.x[:, 1], x[:, 1])
    assert not torch.equal(step.x[:, 0], x[:, 0])
    moved = langevin_step(gaussian_score(x), x, 0.1, torch.randn(50, 2, generator=generator), mask)
    assert torch.equal(moved[:, 1], x[:, 1])


@pytest.mark.parametrize("sampler", ["hmc", "langevin"])
def test_annealed_samplers_reach_a_gaussian_and_count_score_calls(sampler):
    # A noise-conditional score of N(MEAN, COVARIANCE + σ² I), annealed from σ = 0.4 to σ = 0.1.
    sigmas = torch.tensor([0.4, 0.2, 0.1])

    def score(x: torch.Tensor, level: int) -> torch.Tensor:
        smoothed = torch.linalg.inv(COVARIANCE + float(sigmas[level]) ** 2 * torch.eye(2))
        return -(x - MEAN) @ smoothed

    settings = MCMCSettings(
        sampler=sampler,
        iterations=20,
        leapfrog_steps=3,
        step_size=0.2 if sampler == "hmc" else 0.02,
        step_decay_power=0.0,
        denoise=False,
    )
    generator = torch.Generator().manual_seed(4)
    result = annealed_sample(score, torch.rand(3000, 2, generator=generator) * 2 - 1, sigmas, settings, generator)
    assert torch.allclose(result.x.mean(0), MEAN, atol=0.1)
    assert torch.allclose(torch.cov(result.x.T), COVARIANCE + 0.1**2 * torch.eye(2), atol=0.1)
    expected_calls = 3 * 20 * 3 + (3 if sampler == "hmc" else 0)  # HMC evaluates once at each level's start
    assert result.score_evaluations == expected_calls


def test_sampler_settings_reject_bad_values():
    with pytest.raises(ConfigError):
        MCMCSettings(sampler="ddim")
    with pytest.raises(ConfigError):
        MCMCSettings(step_size=0.0)


def test_the_sampler_section_gives_the_settings_its_keys_name():
    from dpsynth.diffusion.hmc import MCMCSection

    keys = {"iterations": 3, "leapfrog_steps": 2, "step_size": 0.2, "kinetic": "uniform", "metropolis": False}
    settings = MCMCSection(kind="langevin", **keys).settings()
    assert settings == MCMCSettings(sampler="langevin", step_decay_power=2.0, denoise=True, **keys)
    assert MCMCSection().settings().step_size == 0.01  # the section's default, not the dataclass's 0.05
