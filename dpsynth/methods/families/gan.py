"""The GAN family: DP-GAN's recipe, GS-WGAN's sharded critics and sanitised step, the released generator.

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

GS-WGAN (Chen, Orekondy & Fritz, arXiv:2006.08265, Algorithm 1) privatises the generator's input gradient
instead; its pieces are here too, so that a method of the family composes them:

* :class:`CriticBank`: K non-private WGAN-GP critics, critic k warm-started and updated on shard k only
  (:func:`dpsynth.data.splits.shard_members`), checkpointed while it warms up, never released;
* :func:`sanitised_generator_step`: one generator update from one sanitised block
  (:func:`dpsynth.privacy.sanitised_block.release_sanitised_block`) of the drawn critic's input gradients.

Every method of the family releases one conditional generator: :class:`GANMethod` holds it as its released
state (:meth:`GANMethod.state_dict`) and samples it class-balanced.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from tqdm.auto import tqdm

from dpsynth.contract import Method, Phase, RunContext, Samples
from dpsynth.data.resident import ResidentRecords
from dpsynth.data.section import DataSection
from dpsynth.dpsgd.ema import EMA
from dpsynth.dpsgd.estimate import PrivateNetwork, planned_image_geometry
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.dpsgd.training import train_private
from dpsynth.errors import ConfigError
from dpsynth.models.gan import (
    GANArchitecture,
    GANPretrainSettings,
    GANSpec,
    critic_input_gradient,
    discriminator_loss,
    generator_step,
    sample_conditional,
    warm_start_gan,
    wgan_gp_updates,
)
from dpsynth.privacy.record_draws import Draws
from dpsynth.privacy.sanitised_block import SanitisedBlock, release_sanitised_block
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import AdamBetas, Section, with_defaults
from dpsynth.seeding import stream_seed

#: where :func:`train_dp_gan` also saves the generator for a caller that does not release it as its state


class PublicGANPretraining(Section):
    """Keys of an optional non-private pre-training of the GAN on public data (:func:`pretrain_on_public`)."""

    pretrain_steps: int = Field(
        0,
        ge=0,
        description="non-private GAN steps on public data before the private training (the networks start from "
        "them); 0: from scratch",
    )
    pretrain_batch_size: int = Field(64, ge=1, description="pre-training batch size")
    pretrain_lr: float = Field(2e-4, gt=0, description="pre-training Adam learning rate (both networks)")
    pretrain_betas: AdamBetas = Field([0.5, 0.999], description="pre-training Adam (beta1, beta2); DCGAN's")
    cache: bool = Field(True, description="cache the pre-trained GAN")

    def pretrain_settings(self) -> GANPretrainSettings:
        """The public pre-training's settings (DCGAN's alternating Adam, BCE)."""
        betas = (self.pretrain_betas[0], self.pretrain_betas[1])
        return GANPretrainSettings(self.pretrain_steps, self.pretrain_batch_size, self.pretrain_lr, betas)


class DPGANSection(
    PublicGANPretraining,
    with_defaults(
        DPSGDSection,
        "GANDPSGD",
        "DP-SGD keys of the discriminator, with DCGAN's Adam defaults.",
        steps=200,
        epochs=None,
        lr=2e-4,
        betas=[0.5, 0.999],
    ),
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


def pretrain_phases(section: PublicGANPretraining, description: str) -> list[Phase]:
    """The public ``pretrain`` phase (it needs ``data.public``) when ``section`` pre-trains, else none."""
    if not section.pretrain_steps:
        return []
    return [Phase("pretrain", private=False, public="required", description=description)]


def pretrain_on_public(
    ctx: Any, section: PublicGANPretraining, spec: GANSpec, nets: tuple[torch.nn.Module, torch.nn.Module]
) -> None:
    """Start ``nets`` (generator, discriminator) from a GAN pre-trained without privacy on ``data.public`` as
    loaded (cached; :func:`dpsynth.models.gan.pretrain_gan`), its classes mapped by
    :func:`dpsynth.models.gan.transfer_gan`. Public data only: no privacy cost. Nothing when
    ``pretrain_steps`` is 0."""
    if not section.pretrain_steps:
        return
    warm_start_gan(
        nets,
        ctx.public,
        spec,
        section.pretrain_settings(),
        seed=ctx.seed,
        public_spec=str(ctx.config.data.public),
        device=ctx.device,
        use_cache=section.cache,
        log=ctx.log,
    )


def square_spec(image_shape: tuple[int, int, int], num_classes: int, method: str, **networks: Any) -> GANSpec:
    """The GAN with ``networks``' sizes for (square) images of ``image_shape`` and ``num_classes`` classes."""
    channels, height, width = image_shape
    if height != width:
        raise ConfigError(f"{method} needs square images, got {height}x{width}")
    return GANSpec(num_classes, channels, height, **networks)


def gan_spec(ctx: Any, section: DPGANSection, method: str) -> GANSpec:
    """The GAN of ``section`` for the run's (square) image shape and classes."""
    return square_spec(ctx.image_shape, ctx.num_classes, method, **_networks(section))


def _networks(section: DPGANSection) -> dict[str, Any]:
    """``section``'s network sizes, as :class:`GANSpec` keywords."""
    return {
        "z_dim": section.z_dim,
        "generator_width": section.generator_width,
        "discriminator_width": section.discriminator_width,
        "discriminator_depth": section.discriminator_depth,
        "architecture": section.architecture,
    }


def discriminator_network(key: str, section: DPGANSection, data: DataSection) -> PrivateNetwork:
    """The DP-SGD-trained discriminator as a :class:`PrivateNetwork`: two rows per example (the real record
    and its paired fake), at the image shape and class count the ``data`` section declares."""
    (channels, size, _), classes = planned_image_geometry(data)
    spec = GANSpec(classes, channels, size, **_networks(section))

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

    Returns the released generator (its EMA when ``generator_ema`` is set), in eval mode; resumes both nets
    from the discriminator's checkpoint; the caller's released state holds it (:func:`generator_state`).
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

    def with_fakes(images: torch.Tensor, labels: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
        # Fakes come from latents and random labels only: no private value enters them. They join the real
        # records where those are (the host, or the device for the fixed-shape step, whose padded rows are masked).
        z, fake_labels = draws.randn(spec.z_dim), draws.randint(0, spec.num_classes)
        with torch.no_grad():
            fakes = (
                generator(z.to(ctx.device), fake_labels.to(ctx.device))
                if len(images)
                else torch.zeros(0, *image_shape, device=ctx.device)
            )
        return {"x": images, "y": labels, "fake": fakes.to(images.device), "fake_y": fake_labels}

    def make_batch(indices: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
        return with_fakes(*train.batch_tensors(indices), draws)

    resident = ResidentRecords(train.to_tensors, ctx.device)  # copied at the first fixed-shape step only

    def device_batch(indices: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
        return with_fakes(*resident(indices), draws)

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
        device_batch=device_batch,
    )
    released = ema.model if ema is not None else generator
    return released.eval()


def generator_state(spec: GANSpec, generator: torch.nn.Module) -> dict[str, Any]:
    """A released generator as ``{"spec", "generator"}`` (CPU tensors): a method's released state."""
    weights = {name: value.detach().cpu() for name, value in generator.state_dict().items()}
    return {"spec": dataclasses.asdict(spec), "generator": weights}


def generator_from_state(state: dict[str, Any], device: torch.device | str) -> torch.nn.Module:
    """The generator of :func:`generator_state`'s ``state``, on ``device``, in eval mode."""
    generator = GANSpec(**state["spec"]).build_generator()
    generator.load_state_dict(state["generator"])
    return generator.to(device).eval()


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

    A subclass trains it in ``fit`` and keeps it with its spec (:meth:`release`); the released state is that
    generator (:func:`generator_state`), and sampling is the family's, balanced over the classes with a fresh
    ``z`` per sample from the public ``sampling`` stream (post-processing, no privacy cost).
    """

    def __init__(self) -> None:
        self._spec: GANSpec | None = None
        self._generator: Any = None

    @classmethod
    def spec_for(cls, section: Any, image_shape: tuple[int, int, int], num_classes: int) -> GANSpec:
        """The GAN of ``section`` for the declared image shape and class count (no private value): what
        ``fit`` builds, and what ``dpsynth pretrain`` pre-trains on public data ahead of the run."""
        return square_spec(image_shape, num_classes, cls.name, **_networks(section))

    def release(self, spec: GANSpec, generator: torch.nn.Module) -> None:
        """Keep ``generator`` (of ``spec``) as the released model."""
        self._spec, self._generator = spec, generator.eval()

    def state_dict(self) -> dict[str, Any]:
        return generator_state(self._spec, self._generator)

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        self._spec = GANSpec(**state["spec"])
        self._generator = generator_from_state(state, ctx.device)

    def generate(self, ctx: RunContext, num: int) -> Samples:
        images, labels = sample_generator(
            self._generator,
            num,
            ctx.num_classes,
            seed=stream_seed(ctx.seed, "sampling"),
            device=ctx.device,
            batch=ctx.config.generate.batch_size,
        )
        return Samples(images=images, labels=labels)


# ------------------------------------------------------------------ GS-WGAN's sharded critics

#: purposes of the non-private ``sampling`` streams of the sharded critics and the sanitised steps (one
#: generator per purpose, shard and step; :func:`stream_index`)
WARM, ROUND_ROBIN, REFRESH, LATENTS = 1, 2, 3, 4


def stream_index(purpose: int, a: int, b: int = 0) -> int:
    """A distinct index of the non-private ``sampling`` stream per (purpose, shard or step, step)."""
    return (purpose << 56) | (a << 28) | b


class ShardCriticsSection(Section):
    """K non-private WGAN-GP critics on the shards of a content-keyed partition (GS-WGAN, arXiv:2006.08265)."""

    num_shards: int = Field(1000, ge=1, description="K disjoint shards (one critic each); public, fixed")
    pretrain_iters: int = Field(
        2000,
        ge=0,
        description="warm-start iterations per critic (each: critic_iters critic updates + 1 update "
        "of the critic's own throwaway generator)",
    )
    critic_iters: int = Field(
        5, ge=0, description="WGAN-GP updates per generator step of the round-robin critic (t mod K), kept"
    )
    refresh_iters: int = Field(
        0, ge=0, description="WGAN-GP updates of a throw-away copy of the drawn critic before its gradient is taken"
    )
    critic_batch_size: int = Field(32, ge=1, description="records per critic update (drawn from its shard)")
    gp_weight: float = Field(10.0, ge=0, description="WGAN-GP gradient-penalty weight")
    drift: float = Field(1e-3, ge=0, description="drift penalty on D(real)^2 (Karras et al.)")
    lr: float = Field(1e-4, gt=0, description="Adam learning rate of the generator and the critics")
    betas: AdamBetas = Field([0.5, 0.9], description="Adam (beta1, beta2), each in [0, 1)")
    critic_width: int = Field(64, ge=1, description="critic base width")
    critic_depth: int = Field(3, ge=1, le=4, description="strided convolutions of a critic")

    def adam(self, params: Any) -> torch.optim.Adam:
        """Adam with the section's ``lr`` and ``betas`` (the critics' and the generator's)."""
        return torch.optim.Adam(params, lr=self.lr, betas=(self.betas[0], self.betas[1]))


class CriticBank:
    """K conditional critics, critic k trained on shard k only (never released; GS-WGAN, Algorithm 1).

    Every critic's state is a function of its own shard, the generators it was trained against and public
    seeds only: it is warm-started on its shard, and later updated on the public round-robin schedule
    (:meth:`follow`), never because a secret draw picked it (:meth:`refreshed` works on a discarded copy).
    """

    def __init__(
        self, spec: GANSpec, section: ShardCriticsSection, device: Any, shards: list[np.ndarray], name: str
    ) -> None:
        self.spec, self.section, self.device, self.name = spec, section, device, name
        self.shards = [torch.as_tensor(members, dtype=torch.long) for members in shards]
        self.phase = f"{name}-critics"  # the warm start's checkpoint
        self.critics: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.public_start: dict[str, dict[str, torch.Tensor]] = {}  # see start_from

    def start_from(self, generator: torch.nn.Module, critic: torch.nn.Module) -> None:
        """Warm-start every critic from ``critic`` and every throwaway generator from ``generator`` (a GAN
        pre-trained on public data) instead of the public random initialisation."""
        self.public_start = {
            name: {key: value.detach().clone() for key, value in net.state_dict().items()}
            for name, net in (("critic", critic), ("generator", generator))
        }

    def _fresh(self, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        critic = self.spec.build_discriminator().to(self.device)
        if "critic" in self.public_start:
            critic.load_state_dict(self.public_start["critic"])
        return critic, self.section.adam(critic.parameters())

    def update(self, k: int, critic: Any, optimizer: Any, data: Any, generator: Any, iters: int, rng: Any) -> None:
        """``iters`` WGAN-GP updates of ``critic`` on shard k's records of ``data`` (images, labels)."""
        section = self.section
        wgan_gp_updates(
            critic,
            optimizer,
            self.shards[k],
            *data,
            generator,
            iters,
            rng,
            batch_size=section.critic_batch_size,
            gp_weight=section.gp_weight,
            drift=section.drift,
        )

    def warm_start(self, ctx: Any, data: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Train critic k on shard k against its own throwaway generator (non-private; nothing released).

        Checkpointed every ~10 % of the critics (phase :attr:`phase`); resumes from there.
        """
        section = self.section
        state = ctx.checkpoints.load(phase=self.phase) or {}
        done = int(state.get("done", 0))
        for k in range(done):
            critic, optimizer = self._fresh(stream_seed(ctx.seed, "model-init", 1))
            critic.load_state_dict(state["critics"][k])
            optimizer.load_state_dict(state["optimizers"][k])
            self.critics.append(critic)
            self.optimizers.append(optimizer)
        every = max(1, section.num_shards // 10)
        for k in tqdm(range(done, section.num_shards), desc=f"{self.name} critics", unit="critic", leave=False):
            # Every critic (and every throwaway generator) starts from the same public initialisation.
            critic, optimizer = self._fresh(stream_seed(ctx.seed, "model-init", 1))
            if section.pretrain_iters:
                torch.manual_seed(stream_seed(ctx.seed, "model-init", 2))
                throwaway = self.spec.build_generator().to(self.device)
                if "generator" in self.public_start:
                    throwaway.load_state_dict(self.public_start["generator"])
                g_optimizer = section.adam(throwaway.parameters())
                rng = ctx.rng("sampling", index=stream_index(WARM, k))
                for _ in range(section.pretrain_iters):
                    self.update(k, critic, optimizer, data, throwaway, section.critic_iters or 1, rng)
                    generator_step(throwaway, critic, g_optimizer, section.critic_batch_size, rng, "wgan")
                del throwaway, g_optimizer
            self.critics.append(critic)
            self.optimizers.append(optimizer)
            if (k + 1) % every == 0 or k + 1 == section.num_shards:
                ctx.checkpoints.save(self.state_dict() | {"done": k + 1}, phase=self.phase)
        ctx.log(f"{self.name}: {section.num_shards} critics warm-started ({section.pretrain_iters} iterations each)")

    def state_dict(self) -> dict[str, Any]:
        return {
            "critics": [critic.state_dict() for critic in self.critics],
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for critic, optimizer, weights, moments in zip(
            self.critics, self.optimizers, state["critics"], state["optimizers"]
        ):
            critic.load_state_dict(weights)
            optimizer.load_state_dict(moments)

    def refreshed(self, k: int, data: Any, generator: Any, rng: Any) -> torch.nn.Module:
        """Critic k, or (``refresh_iters`` > 0) a copy of it updated on shard k that is discarded after the step."""
        if self.section.refresh_iters == 0:
            return self.critics[k]
        critic = copy.deepcopy(self.critics[k])
        optimizer = self.section.adam(critic.parameters())
        # A deep copy: load_state_dict may keep the original's moment tensors, which the refresh would then
        # update in place, so the kept critic would remember which shard the secret draw picked.
        optimizer.load_state_dict(copy.deepcopy(self.optimizers[k].state_dict()))
        self.update(k, critic, optimizer, data, generator, self.section.refresh_iters, rng)
        return critic

    def follow(self, step: int, data: Any, generator: Any, rng: Any) -> None:
        """The round-robin critic ``step mod K`` (a public schedule) takes ``critic_iters`` updates against the
        new generator, on its own shard only."""
        r = step % self.section.num_shards
        self.update(r, self.critics[r], self.optimizers[r], data, generator, self.section.critic_iters, rng)

    def discard(self, ctx: Any, loop_phase: str) -> None:
        """Once the generator is released, drop the critics (non-private functions of their shards) from the
        working checkpoints: only the loop's step and released state stay on disk."""
        loop = ctx.checkpoints.load(phase=loop_phase) or {}
        ctx.checkpoints.save({key: value for key, value in loop.items() if key != "bank"}, phase=loop_phase)
        ctx.checkpoints.save({"done": 0, "discarded": True}, phase=self.phase)


def sanitised_generator_step(
    generator: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    query: SanitisedBlock,
    critic: Callable[[int], torch.nn.Module],
    ledger: Any,
    noise: Any,
    latents: torch.Generator,
) -> None:
    """One generator update of GS-WGAN (arXiv:2006.08265, Algorithm 1) from one sanitised release.

    B = ``query.rows`` public latents and labels (from ``latents``) are generated; the release spends the step,
    draws a shard k, takes the input gradient of ``critic(k)`` on each generated row, clips each row and adds
    the noise (:func:`~dpsynth.privacy.sanitised_block.release_sanitised_block`); the generator back-propagates
    the released block's batch mean, post-processing.
    """
    device = next(generator.parameters()).device
    z = torch.randn(query.rows, generator.z_dim, generator=latents).to(device)
    fake_labels = torch.randint(0, generator.num_classes, (query.rows,), generator=latents).to(device)
    fakes = generator(z, fake_labels)
    released = release_sanitised_block(
        query, lambda k: critic_input_gradient(critic(k), fakes, fake_labels), ledger, noise
    )
    optimizer.zero_grad(set_to_none=True)
    fakes.backward(released / query.rows)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
