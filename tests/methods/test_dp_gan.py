"""DP-GAN: the common method contract, and tests that fail if its mechanism is made unsound: the plan is
T Poisson-subsampled Gaussian steps at q = B/N with the calibrated σ, the engine runs with exactly that σ and
clip norm, the per-example unit is a real record with its paired fake (the contract's inserted-record test
covers that the pair moves the clipped sum by at most C), and the generator only follows the released
discriminator on the configured schedule."""

from __future__ import annotations

import pytest
import torch

from dpsynth.config import find_config, load_config
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods import get_method
from dpsynth.methods.dp_gan import MECHANISM
from dpsynth.models.gan import discriminator_loss, generator_loss
from dpsynth.privacy import SubsampledGaussian
from dpsynth.testing import MethodContractTests

SMOKE = find_config("dp-gan/smoke")


class TestDPGANContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dp-gan/smoke`` preset."""

    method = "dp-gan"


def _plan(overrides=(), num_examples: int = 300):
    return get_method("dp-gan")().plan(load_config(SMOKE, list(overrides)), num_examples)


def test_plan_is_t_subsampled_gaussian_steps_at_b_over_n():
    plan = _plan(["dp-gan.steps=11", "dp-gan.batch_size=60"])
    [step] = plan.mechanisms
    assert step == SubsampledGaussian(MECHANISM, step.noise_multiplier, 60 / 300, 11)
    assert plan.calibrated == (MECHANISM,) and 9.99 - 0.01 <= plan.epsilon() <= 10.0
    assert _plan(["dp-gan.noise_multiplier=4.0"]).noise_multiplier(MECHANISM) == 4.0
    with pytest.raises(PrivacyError):
        _plan(["dp-gan.noise_multiplier=0.05"])
    with pytest.raises(ConfigError, match="dp-gan.batch_size"):
        _plan(["dp-gan.batch_size=301"])


def test_losses():
    real, fake = torch.tensor([2.0, 0.5]), torch.tensor([-3.0, 0.0])
    assert discriminator_loss(real, fake, "hinge").item() == pytest.approx((0 + 0.5) / 2 + (0 + 1) / 2)
    assert generator_loss(fake, "hinge").item() == pytest.approx(1.5)
    bce = discriminator_loss(real, fake, "bce").item()
    assert bce == pytest.approx(torch.nn.functional.softplus(-real).mean() + torch.nn.functional.softplus(fake).mean())
    with pytest.raises(ConfigError):
        discriminator_loss(real, fake, "wasserstein")


def test_engine_runs_with_the_planned_sigma_and_clip_norm_and_generator_follows_the_schedule(tmp_path, monkeypatch):
    """The engine's σ and C are the plan's; the generator takes ``generator_steps`` updates after every
    ``discriminator_steps``-th DP step only, and the released generator is the EMA."""
    import dpsynth.models.private_gan as private_gan
    from dpsynth.api import Synthesizer
    from dpsynth.dpsgd.engine import DPSGDEngine

    seen, generator_updates = {}, []
    step = DPSGDEngine.step

    def spy_step(engine, batch, max_grad_norm=None):
        seen.setdefault("sigma", engine.noise_multiplier)
        seen.setdefault("clip", engine.max_grad_norm)
        return step(engine, batch) if max_grad_norm is None else step(engine, batch, max_grad_norm)

    original_generator_step = private_gan.generator_step

    def spy_generator_step(*args, **kwargs):
        generator_updates.append(1)
        return original_generator_step(*args, **kwargs)

    monkeypatch.setattr(DPSGDEngine, "step", spy_step)
    monkeypatch.setattr(private_gan, "generator_step", spy_generator_step)
    overrides = {
        "dp-gan.steps": 4,
        "dp-gan.discriminator_steps": 2,
        "dp-gan.generator_steps": 3,
        "dp-gan.clip_norm": 0.7,
        "generate.num": 10,
        "generate.batch_size": 10,
        "evaluate.metrics": [],
        "evaluate.audit": False,
    }
    synth = Synthesizer.from_config(SMOKE, overrides).fit(out=tmp_path / "run")
    [spent] = synth.privacy["mechanisms"]
    assert seen["sigma"] == pytest.approx(spent["noise_multiplier"]) and seen["clip"] == 0.7
    assert len(generator_updates) == (4 // 2) * 3, "3 generator updates after each 2nd discriminator step"
    state = torch.load(tmp_path / "run" / "checkpoints" / "final-gan.pt", weights_only=False)
    loop = torch.load(tmp_path / "run" / "checkpoints" / f"{MECHANISM}.pt", weights_only=False)
    ema = loop["extra"]["ema"]["weights"]
    assert all(torch.equal(state["generator"][name], ema[name]) for name in ema), "the EMA is released"
