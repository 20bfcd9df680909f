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


@pytest.fixture(scope="module")
def spied_run(tmp_path_factory):
    """One smoke run read by the two tests below (train once, assert many): 4 DP steps, 3 generator updates after
    every 2nd, C = 0.7, with spies on the engine's σ and C, on the generator updates and on the batch builder."""
    import dpsynth.methods.families.gan as private_gan
    from dpsynth.api import Synthesizer
    from dpsynth.dpsgd.engine import DPSGDEngine

    seen, generator_updates, captured = {}, [], {}
    step, train_private = DPSGDEngine.step, private_gan.train_private
    original_generator_step = private_gan.generator_step

    def spy_step(engine, batch, max_grad_norm=None):
        seen.setdefault("sigma", engine.noise_multiplier)
        seen.setdefault("clip", engine.max_grad_norm)
        return step(engine, batch) if max_grad_norm is None else step(engine, batch, max_grad_norm)

    def spy_generator_step(*args, **kwargs):
        generator_updates.append(1)
        return original_generator_step(*args, **kwargs)

    def keep_batch_builder(ctx, model, loss_fn, make_batch, record_keys, *args, **kwargs):
        captured.update(make_batch=make_batch, keys=record_keys)
        return train_private(ctx, model, loss_fn, make_batch, record_keys, *args, **kwargs)

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
    run_dir = tmp_path_factory.mktemp("dp-gan") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DPSGDEngine, "step", spy_step)
        patch.setattr(private_gan, "generator_step", spy_generator_step)
        patch.setattr(private_gan, "train_private", keep_batch_builder)
        synth = Synthesizer.from_config(SMOKE, overrides).fit(out=run_dir)
    return {"synth": synth, "run": run_dir, "seen": seen, "generator_updates": generator_updates, **captured}


def test_engine_runs_with_the_planned_sigma_and_clip_norm_and_generator_follows_the_schedule(spied_run):
    """The engine's σ and C are the plan's; the generator takes ``generator_steps`` updates after every
    ``discriminator_steps``-th DP step only, and the released generator is the EMA."""
    seen, run = spied_run["seen"], spied_run["run"]
    [spent] = spied_run["synth"].privacy["mechanisms"]
    assert seen["sigma"] == pytest.approx(spent["noise_multiplier"]) and seen["clip"] == 0.7
    assert len(spied_run["generator_updates"]) == (4 // 2) * 3, "3 generator updates after each 2nd discriminator step"
    from dpsynth.contract import RELEASED_PHASE

    state = torch.load(run / "checkpoints" / f"{RELEASED_PHASE}.pt", weights_only=False)
    loop = torch.load(run / "checkpoints" / f"{MECHANISM}.pt", weights_only=False)
    ema = loop["extra"]["ema"]["weights"]
    assert all(torch.equal(state["generator"][name], ema[name]) for name in ema), "the EMA is released"


def test_paired_fakes_get_their_own_latent_per_record_and_step(spied_run):
    """The fakes paired with the records of one class get distinct latents (not one per class or batch),
    a record's latent changes from step to step, and it does not depend on the rest of the batch: ruled out
    as the cause of the mnist10k run's collapse to one image per class (docs/methods/dp-gan.md)."""
    import numpy as np

    from dpsynth.models.gan import ConditionalGenerator, LabelChannelGenerator
    from dpsynth.privacy.record_draws import RecordRandomness

    latents = []

    def record_latents(module, args):
        if isinstance(module, (ConditionalGenerator, LabelChannelGenerator)):
            latents.append(args[0].detach().clone())

    make_batch, randomness = spied_run["make_batch"], RecordRandomness.for_tests(spied_run["keys"])
    handle = torch.nn.modules.module.register_module_forward_pre_hook(record_latents)
    try:
        everything = torch.arange(len(spied_run["keys"]))
        labels = make_batch(everything, randomness.draws(0, everything))["y"]
        one_class = everything[labels == labels[0]][:8]
        assert len(one_class) == 8
        latents.clear()
        make_batch(one_class, randomness.draws(0, one_class))
        make_batch(one_class, randomness.draws(1, one_class))
        make_batch(one_class[3:4], randomness.draws(0, one_class[3:4]))
    finally:
        handle.remove()
    step0, step1, alone = latents
    assert len(np.unique(step0.numpy(), axis=0)) == 8, "one latent per record, not per class or batch"
    assert not torch.isclose(step0, step1).all(dim=1).any(), "a record's latent is fresh at every step"
    assert torch.equal(alone[0], step0[3]), "a record's latent does not depend on the other records"
    assert step0.std().item() == pytest.approx(1.0, abs=0.3), "standard normal latents"


def test_released_samples_draw_one_latent_per_sample_and_the_generator_reads_it():
    """sample_generator draws a fresh z for every sample (not one per class or batch), and at the mnist10k
    preset's z_dim and width an untrained generator's output within one class varies with z by at least
    half as much as over all samples (z is not swamped by the label embedding at initialisation)."""
    from dpsynth.methods.families.gan import sample_generator
    from dpsynth.models.gan import GANSpec

    torch.manual_seed(0)
    generator, _ = GANSpec(10, 1, 28, z_dim=60, generator_width=32, discriminator_width=8).build()
    seen = []
    generator.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    images, labels = sample_generator(generator.eval(), 40, 10, seed=3, device="cpu", batch=15)
    latents = torch.cat(seen)
    assert len(latents) == 40 and len(torch.unique(latents, dim=0)) == 40
    assert sorted(labels.tolist()) == sorted(list(range(10)) * 4)
    same_class = images[labels == 2].astype(float)
    assert same_class.std(axis=0).mean() > 0.5 * images.astype(float).std(axis=0).mean()


# -- the label-channels architecture ------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "channels"), [(28, 1), (32, 3), (28, 3), (32, 1)])
def test_label_channel_generator_has_the_generator_interface_and_tanh_range(size, channels):
    from dpsynth.methods.families.gan import sample_generator
    from dpsynth.models.gan import GANSpec, LabelChannelDiscriminator, LabelChannelGenerator

    torch.manual_seed(0)
    spec = GANSpec(10, channels, size, z_dim=6, generator_width=4, discriminator_width=4, architecture="label-channels")
    generator, discriminator = spec.build()
    assert isinstance(generator, LabelChannelGenerator) and isinstance(discriminator, LabelChannelDiscriminator)
    assert (generator.num_classes, generator.channels, generator.image_size, generator.z_dim) == (10, channels, size, 6)
    images = generator(torch.randn(5, 6) * 50, torch.arange(5))  # large latents saturate the tanh
    assert images.shape == (5, channels, size, size) and images.abs().max() <= 1
    assert discriminator(images, torch.arange(5)).shape == (5,)
    pixels, labels = sample_generator(generator.eval(), 20, 10, seed=1, device="cpu", batch=7)
    assert pixels.shape == (20, size, size, channels) and sorted(labels.tolist()) == sorted(list(range(10)) * 2)
    for layer in discriminator.modules():
        assert not isinstance(layer, torch.nn.modules.batchnorm._BatchNorm), "no cross-example coupling"


@pytest.mark.parametrize("strategy", ["auto", "ghost", "instantiate"])
def test_label_channel_discriminator_per_example_gradients_match_autograd(strategy):
    """The two-call loss of dp-gan (a real record and its paired fake through the same discriminator), per
    example from the DP-SGD engine's taps, equals plain autograd on that example alone."""
    from dpsynth.dpsgd import PerExampleGradients
    from dpsynth.models.gan import GANSpec

    torch.manual_seed(1)
    spec = GANSpec(4, 1, 16, discriminator_width=4, discriminator_depth=2, architecture="label-channels")
    discriminator = spec.build_discriminator()
    batch = {
        "x": torch.randn(5, 1, 16, 16),
        "y": torch.randint(0, 4, (5,)),
        "fake": torch.randn(5, 1, 16, 16),
        "fake_y": torch.randint(0, 4, (5,)),
    }

    def loss_fn(model_call, example):
        real = model_call(example["x"].unsqueeze(0), example["y"].unsqueeze(0))
        fake = model_call(example["fake"].unsqueeze(0), example["fake_y"].unsqueeze(0))
        return discriminator_loss(real, fake, "hinge") + discriminator_loss(real, fake, "bce")

    got = PerExampleGradients(discriminator, loss_fn, strategy=strategy).compute(batch).full()
    params = dict(discriminator.named_parameters())
    assert set(got) == set(params)
    for i in range(5):
        loss = loss_fn(discriminator, {key: value[i] for key, value in batch.items()})
        want = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        for name, grad in want.items():
            assert torch.allclose(got[name][i], grad, atol=1e-6, rtol=1e-4), (strategy, i, name)


def test_smoke_run_with_the_label_channel_architecture(tmp_path):
    """A full run with ``architecture: label-channels``; the released generator is the run's released state,
    and a fresh process reloads it from there (no other generator checkpoint is written)."""
    from dpsynth.api import Synthesizer
    from dpsynth.contract import RELEASED_PHASE
    from dpsynth.rundir import CHECKPOINTS_DIR

    overrides = {
        "dp-gan.architecture": "label-channels",
        "generate.num": 10,
        "generate.batch_size": 10,
        "evaluate.metrics": [],
        "evaluate.audit": False,
    }
    synth = Synthesizer.from_config(SMOKE, overrides).fit(out=tmp_path / "run")
    [spent] = synth.privacy["mechanisms"]
    assert spent["name"] == MECHANISM and spent["steps"] == 4
    checkpoints = tmp_path / "run" / CHECKPOINTS_DIR
    assert not (checkpoints / "final-gan.pt").exists()  # the released checkpoint is the only copy
    state = torch.load(checkpoints / f"{RELEASED_PHASE}.pt", weights_only=False)
    assert state["spec"]["architecture"] == "label-channels"
    assert any(name.startswith("label_in.") for name in state["generator"])
    images, labels = Synthesizer.load(tmp_path / "run").sample(10)
    assert images.shape == (10, 28, 28, 1) and sorted(labels.tolist()) == list(range(10))


def test_unknown_architecture_is_refused():
    from dpsynth.models.gan import GANSpec

    with pytest.raises(ConfigError, match="dp-gan.architecture"):
        load_config(SMOKE, ["dp-gan.architecture=resnet"])
    with pytest.raises(ConfigError, match="architecture"):
        GANSpec(10, 1, 28, architecture="resnet")
    assert load_config(SMOKE, ["dp-gan.architecture=label-channels"]).section.architecture == "label-channels"


def test_transfer_maps_the_label_channels_to_another_label_space():
    """PrivImage+G pre-trains on a subset whose classes may differ: the class-indexed weights of the target
    start from the mean over the pre-trained classes, everything else is copied."""
    import dataclasses

    from dpsynth.models.gan import GANSpec, transfer_gan

    spec = GANSpec(6, 1, 28, z_dim=4, generator_width=4, discriminator_width=4, architecture="label-channels")
    pre_g, pre_d = dataclasses.replace(spec, num_classes=3).build()
    generator, discriminator = spec.build()
    transfer_gan(pre_g, generator)
    transfer_gan(pre_d, discriminator)
    assert torch.equal(generator.latent_in.weight, pre_g.latent_in.weight)
    assert torch.allclose(generator.label_in.weight[5], pre_g.label_in.weight.mean(0))
    assert torch.allclose(discriminator.label_in.weight[:, 5], pre_d.label_in.weight.mean(1))
    assert torch.equal(discriminator.image_in.weight, pre_d.image_in.weight)


def test_public_pre_training_needs_public_data_at_load_and_is_a_public_phase():
    with pytest.raises(ConfigError, match="needs public data but data.public is null"):
        load_config(SMOKE, ["dp-gan.pretrain_steps=3"])
    config = load_config(SMOKE, ["dp-gan.pretrain_steps=3", "data.public=glyphs-digits"])
    phases = get_method("dp-gan").phases(config)
    assert [(p.name, p.private, p.public) for p in phases][0] == ("pretrain", False, "required")
    assert [p.name for p in get_method("dp-gan").phases(load_config(SMOKE))] == ["train", "generate"]


class _Stop(Exception):
    pass


def test_a_pre_trained_run_starts_both_networks_from_the_public_gan(tmp_path, monkeypatch):
    """With ``pretrain_steps`` both networks enter the DP training as the GAN pre-trained on data.public (the one
    ``dpsynth pretrain`` cached ahead of the run, in the run's label space), and the plan is unchanged:
    pre-training reads public data only."""
    from pathlib import Path
    from types import SimpleNamespace

    from dpsynth.api import Synthesizer
    from dpsynth.methods import dp_gan
    from dpsynth.methods.families.gan import build_gan
    from dpsynth.models.gan import GANPretrainSettings, pretrain_gan
    from dpsynth.pretraining import pretrain

    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))
    entered = {}

    def stop_at_dp_training(ctx, section, spec, generator, discriminator, **kwargs):
        entered.update(spec=spec, public=ctx.public, generator=generator, discriminator=discriminator)
        raise _Stop

    monkeypatch.setattr(dp_gan, "train_dp_gan", stop_at_dp_training)
    overrides = {"dp-gan.pretrain_steps": 3, "data.public": "glyphs-digits", "data.max_public": 64}
    as_set = [f"{key}={value}" for key, value in overrides.items()]
    [built] = pretrain(SMOKE, as_set, log=lambda *_: None)  # `dpsynth pretrain`, ahead of the run
    assert built["kind"] == "gan" and not built["cached"] and Path(built["path"]).is_file()
    synth = Synthesizer.from_config(SMOKE, overrides)
    assert synth.plan(300).epsilon() == pytest.approx(_plan().epsilon())
    with pytest.raises(_Stop):
        synth.fit(out=tmp_path / "run")
    public, spec = entered["public"], entered["spec"]
    settings = GANPretrainSettings(3, 64, 2e-4, (0.5, 0.999))  # DCGAN's betas, not the DP training's
    expected = pretrain_gan(public, spec, settings, seed=0, public_spec="glyphs-digits", log=lambda *_: None)
    for net, want in zip((entered["generator"], entered["discriminator"]), expected):
        got = net.state_dict()
        assert all(torch.equal(got[name], value) for name, value in want.state_dict().items())
    from_scratch, _ = build_gan(SimpleNamespace(seed=0), spec)  # the run's own initialisation, moved by the steps
    assert not torch.equal(entered["generator"].project.weight, from_scratch.project.weight)
    assert pretrain(SMOKE, as_set, log=lambda *_: None) == [dict(built, cached=True)]  # the run read that file
