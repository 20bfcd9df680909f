"""DP-GAN training: DP-SGD on a conditional discriminator, the generator as post-processing.

The recipe of DP-GAN (Xie et al., "Differentially Private Generative Adversarial Network",
arXiv:1802.06739, Algorithm 1) as PrivImage+G (Li et al., arXiv:2311.12850, §4.4) uses it, kept here so
that every GAN method composes it instead of restating it:

* the discriminator is the only network that reads private data; it is trained with
  :func:`dpsynth.dpsgd.training.train_private`, and its per-example unit is a real record *and* its
  paired fake (the fake's latent and label come from the record's own row of the per-record draws, so
  the unit depends on no other record of the batch);
* after every ``discriminator_steps``-th noisy discriminator update the generator takes ``generator_steps`` Adam
  steps against the discriminator released so far (``after_step``): it reads only released weights and
  latents, so its training costs no privacy; its state (and its EMA, when ``generator_ema`` is set) is
  checkpointed with the discriminator's step.

The loss is the non-saturating one (``bce``, PrivImage+G's) or the hinge loss (DPImageBench's DP-GAN); the
per-example unit is the same either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from dpsynth.contract import Method, RunContext, Samples
from dpsynth.data.section import DataSection
from dpsynth.dpsgd.ema import EMA
from dpsynth.dpsgd.estimate import PrivateNetwork, planned_image_geometry
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.dpsgd.training import train_private
from dpsynth.errors import ConfigError
from dpsynth.models.gan import GANArchitecture, GANSpec, discriminator_loss, generator_step, sample_conditional
from dpsynth.privacy.record_draws import Draws
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import with_defaults
from dpsynth.seeding import stream_seed

#: the checkpoint phase of the released generator
GENERATOR_PHASE = "final-gan"


class DPGANSection(
    with_defaults(
        DPSGDSection,
        "GANDPSGD",
        "DP-SGD keys of the discriminator, with DCGAN's Adam defaults.",
        steps=200,
        epochs=None,
        lr=2e-4,
        betas=[0.5, 0.999],
    )
):  # type: ignore[misc]
    """A conditional DCGAN whose discriminator alone is trained with DP-SGD (``betas`` serve both nets)."""

    architecture: GANArchitecture = Field(
        "projection",
        description="projection (z + label embedding -> linear -> GroupNorm generator; projection-head "
        "discriminator) | label-channels (z and one-hot label through their own transposed convolutions, no "
        "normalisation; label as input channels of the discriminator, after Bie et al. arXiv:2302.02936)",
    )
    z_dim: int = Field(100, ge=1, description="latent size")
    generator_width: int = Field(80, ge=1, description="generator base width (80: ~1.8M parameters at 32x32)")
    discriminator_width: int = Field(64, ge=1, description="discriminator base width")
    discriminator_depth: int = Field(
        3, ge=1, le=4, description="strided convolutions of the discriminator (each halves the side)"
    )
    loss: Literal["bce", "hinge"] = Field(
        "bce",
        description="bce (non-saturating, DCGAN) | hinge (DPImageBench's DP-GAN); the per-example unit is "
        "a real record and its paired fake either way",
    )
    discriminator_steps: int = Field(
        1, ge=1, description="DP discriminator steps per round of generator updates (DPImageBench: 5)"
    )
    generator_steps: int = Field(1, ge=0, description="generator updates after each round of discriminator steps")
    generator_batch_size: int = Field(64, ge=1, description="latents per generator update")
    generator_lr: float | None = Field(None, gt=0, description="generator Adam learning rate; null: lr")
    generator_ema: float | None = Field(
        None, gt=0, lt=1, description="EMA decay of the released generator (post-processing); null: no EMA"
    )


def gan_spec(ctx: Any, section: DPGANSection, method: str) -> GANSpec:
    """The GAN of ``section`` for the run's (square) image shape and classes."""
    channels, height, width = ctx.image_shape
    if height != width:
        raise ConfigError(f"{method} needs square images, got {height}x{width}")
    return _section_spec(section, ctx.num_classes, channels, height)


def _section_spec(section: DPGANSection, classes: int, channels: int, size: int) -> GANSpec:
    """``section``'s networks for ``classes`` labels and ``channels`` x ``size`` x ``size`` images."""
    return GANSpec(
        classes,
        channels,
        size,
        section.z_dim,
        section.generator_width,
        section.discriminator_width,
        discriminator_depth=section.discriminator_depth,
        architecture=section.architecture,
    )


def discriminator_network(key: str, section: DPGANSection, data: DataSection) -> PrivateNetwork:
    """The DP-SGD-trained discriminator as a :class:`PrivateNetwork`: two rows per example (the real record
    and its paired fake), at the image shape and class count the ``data`` section declares."""
    (channels, size, _), classes = planned_image_geometry(data)
    spec = _section_spec(section, classes, channels, size)

    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        return torch.zeros(rows, channels, size, size), torch.zeros(rows, dtype=torch.long)

    return PrivateNetwork(
        key=key, build=lambda: spec.build()[1], inputs=inputs, training=section.private_training(), rows_per_example=2
    )


def build_gan(ctx: Any, spec: GANSpec) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Freshly initialised (generator, discriminator) from the run's ``model-init`` stream."""
    torch.manual_seed(stream_seed(ctx.seed, "model-init"))
    return spec.build()


def train_dp_gan(
    ctx: Any,
    section: DPGANSection,
    spec: GANSpec,
    generator: torch.nn.Module,
    discriminator: torch.nn.Module,
    *,
    mechanism: str,
    desc: str,
) -> torch.nn.Module:
    """DP-SGD the discriminator on the private train split for the planned σ; the generator follows it.

    Saves and returns the trained generator, its EMA when ``generator_ema`` is set (phase
    :data:`GENERATOR_PHASE`); resumes both nets from the discriminator's checkpoint.
    """
    generator, discriminator = generator.to(ctx.device), discriminator.to(ctx.device)
    g_lr = section.lr if section.generator_lr is None else section.generator_lr
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=g_lr, betas=tuple(section.betas))
    ema = EMA(generator, section.generator_ema) if section.generator_ema is not None else None
    state = ctx.checkpoints.load(phase=mechanism)
    if state and state.get("extra"):
        generator.load_state_dict(state["extra"]["generator"])
        g_optimizer.load_state_dict(state["extra"]["optimizer"])
        if ema is not None:
            ema.load_state_dict(state["extra"]["ema"])
    train = ctx.data.train  # read a Poisson batch at a time: a memory-mapped set is never loaded whole
    image_shape = (spec.channels, spec.image_size, spec.image_size)

    def make_batch(indices: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
        # Fakes come from latents and random labels only: no private value enters them.
        z, fake_labels = draws.randn(spec.z_dim), draws.randint(0, spec.num_classes)
        with torch.no_grad():
            fakes = (
                generator(z.to(ctx.device), fake_labels.to(ctx.device)).cpu()
                if len(indices)
                else torch.zeros(0, *image_shape)
            )
        images, labels = train.batch_tensors(indices)
        return {"x": images, "y": labels, "fake": fakes, "fake_y": fake_labels}

    def loss_fn(model_call: Any, example: dict[str, torch.Tensor]) -> torch.Tensor:
        real = model_call(example["x"].unsqueeze(0), example["y"].unsqueeze(0))
        fake = model_call(example["fake"].unsqueeze(0), example["fake_y"].unsqueeze(0))
        return discriminator_loss(real, fake, section.loss)

    def generator_follows(step: int, engine: Any) -> None:
        if (step + 1) % section.discriminator_steps:
            return
        latents = ctx.rng("sampling", index=1 + step)  # one stream per step: a resumed run draws the same
        for _ in range(section.generator_steps):
            generator_step(generator, discriminator, g_optimizer, section.generator_batch_size, latents, section.loss)
        if ema is not None:
            ema.update(generator)

    def extra_state() -> dict[str, Any]:
        extra = {"generator": generator.state_dict(), "optimizer": g_optimizer.state_dict()}
        if ema is not None:
            extra["ema"] = ema.state_dict()
        return extra

    train_private(
        ctx,
        discriminator,
        loss_fn,
        make_batch,
        ctx.data.train.record_keys,
        section.private_training(ctx.plan.noise_multiplier(mechanism)),
        mechanism=mechanism,
        after_step=generator_follows,
        state_extra=extra_state,
        desc=desc,
    )
    released = ema.model if ema is not None else generator
    ctx.checkpoints.save({"spec": dataclasses.asdict(spec), "generator": released.state_dict()}, phase=GENERATOR_PHASE)
    return released.eval()


def load_generator(ctx: Any, method: str, phase: str = GENERATOR_PHASE) -> torch.nn.Module:
    """The released generator of a finished run, saved as ``{"spec", "generator"}`` under ``phase``."""
    state = ctx.checkpoints.load(phase=phase)
    if not state:
        raise ConfigError(f"this {method} run has no trained generator (checkpoints/{phase}.pt)")
    generator, _ = GANSpec(**state["spec"]).build()
    generator.load_state_dict(state["generator"])
    return generator.to(ctx.device).eval()


@torch.no_grad()
def sample_generator(
    generator: torch.nn.Module, num: int, num_classes: int, *, seed: int, device: torch.device | str, batch: int = 500
) -> tuple[np.ndarray, np.ndarray]:
    """``num`` class-balanced (uint8 [N, H, W, C] images, labels) from a conditional generator (reads no
    private data)."""
    labels = torch.from_numpy(balanced_labels(num, num_classes))
    images = sample_conditional(generator, labels, seed=seed, batch_size=batch, device=device)
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return pixels, labels.numpy()


class GANMethod(Method):
    """The GAN family's skeleton: a method whose release is one conditional generator.

    A subclass trains it in ``fit`` (storing it in ``self._generator``) and says how a fresh process loads
    the released one (:meth:`load_released`); sampling is the family's, balanced over the classes with a
    fresh ``z`` per sample from the public ``sampling`` stream (post-processing, no privacy cost).
    """

    def __init__(self) -> None:
        self._generator: Any = None

    def load_released(self, ctx: RunContext) -> torch.nn.Module:
        """The released generator from the run directory (a fresh process, e.g. ``dpsynth generate``)."""
        raise NotImplementedError

    def generate(self, ctx: RunContext, num: int) -> Samples:
        if self._generator is None:
            self._generator = self.load_released(ctx)
        images, labels = sample_generator(
            self._generator,
            num,
            ctx.num_classes,
            seed=stream_seed(ctx.seed, "sampling"),
            device=ctx.device,
            batch=ctx.config.generate.batch_size,
        )
        return Samples(images=images, labels=labels)
