"""DDPM / DDIM samplers and classifier-free guidance."""

import pytest
import torch
from conftest import TINY_UNET as TINY
from conftest import randomize
from torch import nn

from dpsynth.diffusion.samplers import guided_model_output, sample
from dpsynth.diffusion.schedules import DiffusionSchedule, build_schedule
from dpsynth.errors import ConfigError
from dpsynth.models.unet import build_unet


class OnePointOracle(nn.Module):
    """The exact ε-predictor for a dataset holding the single image ``point``:
    ε*(x_t, t) = (x_t - √ᾱ_t x*) / √(1-ᾱ_t). Optionally appends variance channels v = 0."""

    def __init__(self, point: torch.Tensor, schedule: DiffusionSchedule, learn_sigma: bool = False) -> None:
        super().__init__()
        self.point, self.schedule, self.learn_sigma = point, schedule, learn_sigma

    def forward(self, x, t, y=None):
        abar = self.schedule.alphas_cumprod[t].reshape(-1, 1, 1, 1)
        eps = (x - abar.sqrt() * self.point) / (1 - abar).sqrt()
        return torch.cat([eps, torch.zeros_like(eps)], 1) if self.learn_sigma else eps


@pytest.fixture(scope="module")
def point():
    return torch.linspace(-0.9, 0.9, 16).reshape(1, 4, 4)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("steps", [20, 1000])
def test_ddim_with_oracle_returns_the_data_point(point, kind, steps):
    schedule = build_schedule(kind)
    images = sample(
        OnePointOracle(point, schedule),
        schedule,
        None,
        (1, 4, 4),
        sampler="ddim",
        steps=steps,
        generator=torch.Generator().manual_seed(0),
        num_samples=3,
        progress=False,
    )
    assert images.shape == (3, 1, 4, 4)
    assert torch.allclose(images, point.expand(3, 1, 4, 4), atol=1e-4)


@pytest.mark.parametrize("variance,learn_sigma", [("fixed_small", False), ("fixed_large", False), ("learned", True)])
def test_ddpm_with_oracle_converges_to_the_data_point(point, variance, learn_sigma):
    schedule = build_schedule("linear")
    oracle = OnePointOracle(point, schedule, learn_sigma)
    images = sample(
        oracle,
        schedule,
        None,
        (1, 4, 4),
        sampler="ddpm",
        steps=50,
        variance=variance,
        generator=torch.Generator().manual_seed(0),
        num_samples=4,
        progress=False,
    )
    assert (images - point).abs().max() < 1e-2


def test_unclipped_ddim_eta_one_also_converges(point):
    schedule = build_schedule("cosine")
    images = sample(
        OnePointOracle(point, schedule),
        schedule,
        None,
        (1, 4, 4),
        steps=25,
        eta=1.0,
        clip_denoised=False,
        generator=torch.Generator().manual_seed(1),
        num_samples=2,
        progress=False,
    )
    assert (images - point).abs().max() < 1e-2


def test_guidance_zero_equals_the_conditional_model():
    schedule = build_schedule("linear")
    model = randomize(build_unet(TINY, 8, 1, 3, learn_sigma=True)).eval()
    labels = torch.tensor([0, 1, 2, 1])

    class ConditionalOnly(nn.Module):
        """The same network, refusing the null class: guidance 0 must never ask for it."""

        learn_sigma, num_classes, null_class = True, 3, 3

        def forward(self, x, t, y):
            assert y is not None and (y != 3).all()
            return model(x, t, y)

    x, t = torch.randn(4, 1, 8, 8), torch.tensor([10, 20, 30, 40])
    assert torch.equal(guided_model_output(model, x, t, labels, 0.0, 3, True), model(x, t, labels))
    kwargs = dict(sampler="ddpm", steps=5, progress=False)
    guided = sample(
        model, schedule, labels, (1, 8, 8), guidance=0.0, generator=torch.Generator().manual_seed(0), **kwargs
    )
    plain = sample(ConditionalOnly(), schedule, labels, (1, 8, 8), generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(guided, plain)


def test_guidance_combines_conditional_and_null_predictions():
    model = randomize(build_unet(TINY, 8, 1, 3, learn_sigma=True)).eval()
    x, t, labels = torch.randn(2, 1, 8, 8), torch.tensor([5, 500]), torch.tensor([0, 2])
    with torch.no_grad():
        guided = guided_model_output(model, x, t, labels, 2.0, 3, True)
        conditional, unconditional = model(x, t, labels), model(x, t, torch.tensor([3, 3]))
    expected_eps = 3.0 * conditional[:, :1] - 2.0 * unconditional[:, :1]
    assert torch.allclose(guided[:, :1], expected_eps, atol=1e-6)
    assert torch.allclose(guided[:, 1:], conditional[:, 1:])  # variance from the conditional pass
    assert not torch.allclose(guided, conditional)


def test_sample_batches_shapes_range_and_restores_training_mode(capsys):
    schedule = build_schedule("cosine")
    model = randomize(build_unet(TINY, 8, 1, 3)).train()
    images = sample(
        model,
        schedule,
        [0, 1, 2, 0, 1],
        (1, 8, 8),
        steps=3,
        guidance=1.5,
        batch_size=2,
        generator=torch.Generator().manual_seed(0),
        progress=False,
    )
    assert images.shape == (5, 1, 8, 8)
    assert images.min() >= -1 and images.max() <= 1
    assert model.training
    assert capsys.readouterr().err == ""
    sample(model, schedule, [0], (1, 8, 8), steps=2, progress=True)
    assert "sampling" in capsys.readouterr().err


def test_same_generator_seed_gives_the_same_samples():
    schedule = build_schedule("linear")
    model = randomize(build_unet(TINY, 8, 1, 3)).eval()

    def run(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return sample(model, schedule, [1, 2], (1, 8, 8), sampler="ddpm", steps=4, generator=generator, progress=False)

    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))


def test_bad_sampler_options_rejected():
    schedule = build_schedule("linear")
    model = build_unet(TINY, 8, 1, 3)
    with pytest.raises(ConfigError):
        sample(model, schedule, [0], (1, 8, 8), sampler="euler", progress=False)
    with pytest.raises(ConfigError):
        sample(model, schedule, [0], (1, 8, 8), sampler="ddpm", variance="learned", progress=False)
    with pytest.raises(ConfigError):
        sample(model, schedule, [0], (1, 8, 8), steps=2000, progress=False)
    with pytest.raises(ConfigError):
        sample(model, schedule, [0, 1], (3, 1, 8, 8), progress=False)
