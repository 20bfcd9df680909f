"""Noise schedules (closed forms, posterior, respacing) and timestep samplers."""

import math

import numpy as np
import pytest
import torch

from dpsynth.diffusion.schedules import (
    FINETUNING_MIXTURE,
    MNIST_MIXTURE,
    MixtureOfUniformTimesteps,
    UniformTimesteps,
    build_schedule,
    build_timestep_sampler,
)
from dpsynth.errors import ConfigError


def test_linear_alpha_bar_matches_closed_form():
    schedule = build_schedule("linear", 1000)
    betas = np.linspace(1e-4, 0.02, 1000)
    expected = np.cumprod(1 - betas)
    assert np.allclose(schedule.alphas_cumprod.numpy(), expected, rtol=1e-5, atol=1e-8)
    assert schedule.alphas_cumprod[0] == pytest.approx(1 - 1e-4)


def test_cosine_alpha_bar_matches_closed_form():
    schedule = build_schedule("cosine", 1000)
    s, T = 0.008, 1000
    t = np.arange(1, T + 1)

    def f(u):
        return np.cos((u / T + s) / (1 + s) * math.pi / 2) ** 2

    expected = f(t) / f(0)
    # β is clipped at 0.999 only at the very end (Nichol & Dhariwal), where ᾱ ≈ 0 anyway.
    unclipped = schedule.betas.numpy() < 0.999
    assert unclipped[:-1].all()
    assert np.allclose(schedule.alphas_cumprod.numpy()[unclipped], expected[unclipped], rtol=1e-4, atol=1e-7)
    assert schedule.alphas_cumprod[-1] < 1e-4


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_posterior_matches_product_of_gaussians(kind):
    schedule = build_schedule(kind, 1000)
    betas = schedule._tables64["betas"]
    abar = np.cumprod(1 - betas)
    x0, xt = torch.tensor([[[[0.3]]]]), torch.tensor([[[[-0.7]]]])
    for step in [1, 10, 500, 998]:
        # x_{t-1} | x0 ~ N(√ᾱ_{t-1} x0, 1-ᾱ_{t-1}); x_t | x_{t-1} ~ N(√α_t x_{t-1}, β_t)
        precision = 1 / (1 - abar[step - 1]) + (1 - betas[step]) / betas[step]
        mean = (
            math.sqrt(abar[step - 1]) * 0.3 / (1 - abar[step - 1]) + math.sqrt(1 - betas[step]) * -0.7 / betas[step]
        ) / precision
        got_mean, got_log_var = schedule.q_posterior(x0, xt, torch.tensor([step]))
        assert got_mean.item() == pytest.approx(mean, rel=1e-4, abs=1e-6)
        assert math.exp(got_log_var.item()) == pytest.approx(1 / precision, rel=1e-4)


def test_q_sample_and_predict_x0_are_inverse():
    schedule = build_schedule("cosine")
    x0, noise = torch.rand(4, 1, 3, 3) * 2 - 1, torch.randn(4, 1, 3, 3)
    t = torch.tensor([0, 100, 500, 900])
    x_t = schedule.q_sample(x0, t, noise)
    assert torch.allclose(schedule.predict_x0(x_t, t, noise), x0, atol=1e-3)
    assert torch.allclose(schedule.predict_eps(x_t, t, x0), noise, atol=1e-3)


def test_learned_variance_interpolates_between_beta_tilde_and_beta():
    schedule = build_schedule("linear")
    t, x = torch.tensor([50]), torch.zeros(1, 1, 2, 2)
    low = schedule.model_log_variance(t, x, "learned", -torch.ones_like(x))
    high = schedule.model_log_variance(t, x, "learned", torch.ones_like(x))
    assert torch.allclose(low, schedule.model_log_variance(t, x, "fixed_small"))
    assert torch.allclose(high, schedule.model_log_variance(t, x, "fixed_large"))
    assert (low < high).all()


def test_respace_keeps_alpha_bar_and_maps_timesteps():
    schedule = build_schedule("linear")
    spaced = schedule.respace(10)
    kept = spaced.timestep_map
    assert spaced.num_timesteps == 10 and kept[0] == 0 and kept[-1] == 999
    assert torch.allclose(spaced.alphas_cumprod, schedule.alphas_cumprod[kept], rtol=1e-5)
    assert torch.equal(schedule.respace(1000).alphas_cumprod, schedule.alphas_cumprod)
    with pytest.raises(ConfigError):
        schedule.respace(0)


def test_unknown_schedule_rejected():
    with pytest.raises(ConfigError):
        build_schedule("quadratic")


def test_uniform_sampler_range():
    draws = UniformTimesteps(1000).sample(20000, torch.Generator().manual_seed(0))
    assert draws.min() >= 0 and draws.max() <= 999
    assert draws.min() < 10 and draws.max() > 990


def _check_mixture(sampler, weights, boundaries, n=200_000):
    draws = sampler.sample(n, torch.Generator().manual_seed(1))
    assert draws.dtype == torch.long and draws.min() >= 0 and draws.max() < sampler.num_timesteps
    for weight, low, high in zip(weights, boundaries[:-1], boundaries[1:]):
        inside = (draws >= low) & (draws < high)
        tolerance = 5 * math.sqrt(weight * (1 - weight) / n) + 1e-9
        assert inside.float().mean().item() == pytest.approx(weight, abs=tolerance)
        # Uniform within the component: the mean of the draws sits at the interval's centre.
        component = draws[inside].double()
        centre, spread = (low + high - 1) / 2, (high - low) / math.sqrt(12)
        assert component.mean().item() == pytest.approx(centre, abs=5 * spread / math.sqrt(len(component)) + 0.5)
        assert component.min() == low and component.max() == high - 1


def test_mixture_sampler_defaults_are_the_papers_finetuning_setting():
    sampler = MixtureOfUniformTimesteps()
    assert FINETUNING_MIXTURE == ((0.015, 0.785, 0.2), (0, 30, 600, 1000))
    _check_mixture(sampler, *FINETUNING_MIXTURE)


def test_mnist_mixture_draws_with_declared_weights():
    _check_mixture(build_timestep_sampler("mixture_mnist"), *MNIST_MIXTURE)


def test_mixture_sampler_returns_an_empty_tensor_for_zero_draws():
    sampler = MixtureOfUniformTimesteps()
    drawn = sampler.sample(0, torch.Generator().manual_seed(0))
    assert drawn.shape == (0,) and drawn.dtype == torch.long


def test_mixture_probabilities_and_rescaling():
    sampler = MixtureOfUniformTimesteps((0.25, 0.75), (0, 500, 1000), num_timesteps=100)
    probs = sampler.probabilities()
    assert probs.sum().item() == pytest.approx(1.0)
    assert probs[:50].sum().item() == pytest.approx(0.25) and probs[0].item() == pytest.approx(0.25 / 50)
    assert sampler.sample(1000, torch.Generator().manual_seed(0)).max() < 100


def test_mixture_rejects_bad_parameters():
    with pytest.raises(ConfigError):
        MixtureOfUniformTimesteps((0.5, 0.6), (0, 10, 20))
    with pytest.raises(ConfigError):
        MixtureOfUniformTimesteps((0.5, 0.5), (0, 10))
    with pytest.raises(ConfigError):
        MixtureOfUniformTimesteps((0.5, 0.5), (0, 600, 30))
    with pytest.raises(ConfigError):
        build_timestep_sampler({"kind": "mixture", "weigths": [1.0]})


def test_build_timestep_sampler_specs():
    assert isinstance(build_timestep_sampler("uniform"), UniformTimesteps)
    custom = build_timestep_sampler({"kind": "mixture", "weights": [0.5, 0.5], "boundaries": [0, 100, 1000]})
    assert custom.lows.tolist() == [0, 100] and custom.highs.tolist() == [100, 1000]
