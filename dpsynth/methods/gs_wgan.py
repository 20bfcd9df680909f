"""``gs-wgan``: a generator trained with sanitised gradients from K non-private critics on disjoint shards.

GS-WGAN (Chen, Orekondy & Fritz, "GS-WGAN: A Gradient-Sanitized Approach for Learning Differentially
Private Generators", NeurIPS 2020, arXiv:2006.08265). Only the gradient that flows from a critic into
the generator is privatised; the critics themselves are trained without noise and never released:

1. **Shards.** The private train split is partitioned into K shards by a function of each record's
   content (:func:`dpsynth.data.splits.shard_assignment`; K public, fixed), never by position, so
   adding or removing one record changes exactly one shard (the guarantee is add/remove one record).
2. **Warm start.** Critic k is trained (WGAN-GP, Gulrajani et al. arXiv:1704.00028) on shard k only,
   against its own throwaway generator, for ``pretrain_iters`` iterations; every critic starts from its
   own shard's training (the original code's loader loads the last shard's weights into every critic
   through a stale loop index, so that shard then influences every step and the 1/K argument fails).
3. **Generator steps.** Step t: one shard k is drawn uniformly from the DP noise source (after the step
   is spent in the ledger); the gradient of ``-D_k(G(z_b, c_b), c_b)`` with respect to each of B
   generated images (latents and labels public) is computed through critic k (after ``refresh_iters``
   further updates of a throw-away copy of it on shard k, kept for this step only), each row is clipped to
   C and Gaussian noise is added to the whole block
   (:func:`dpsynth.privacy.sanitised_block.release_sanitised_block`); the generator back-propagates the
   noisy block; then the critic ``t mod K`` (a public, round-robin schedule) takes ``critic_iters`` WGAN-GP
   updates on its shard against the new generator. An EMA of the generator is released.

Privacy: every critic's state is a function of its own shard, the released generator history and public
seeds only — never of the secret shard draws (the original updates the *drawn* critic, which makes the
critics' hidden state depend on past secret draws; here the persistent updates follow the public
round-robin schedule and the drawn critic's refresh is discarded). Each step is one Gaussian on the
B-row block with L2 sensitivity ``2 C sqrt(B)`` (any change of the drawn shard), amplified once by the
1-of-K draw: ledger mechanism ``gs-wgan-generator`` of kind ``shard_sampled_gaussian``, T steps, accounted
in RDP by dp_accounting's sampling-without-replacement bound (docs/privacy.md, "The shard-sampled
Gaussian"). Not B*T separately amplified mechanisms (the original's accounting), and not T unit-sensitivity
steps (DPImageBench's, which drops the factor B).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch
from pydantic import Field
from tqdm.auto import tqdm

from dpsynth.contract import Phase, RunConfig, RunContext, register_method
from dpsynth.data.splits import shard_assignment
from dpsynth.dpsgd.ema import EMA
from dpsynth.errors import ConfigError
from dpsynth.methods.families.gan import GANMethod, load_generator
from dpsynth.models.gan import GANArchitecture, GANSpec, generator_loss, wgan_gp_critic_loss
from dpsynth.privacy.mechanisms import ShardSampledGaussian
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.privacy.sanitised_block import SanitisedBlock, release_sanitised_block
from dpsynth.schema import AdamBetas, Section
from dpsynth.seeding import stream_seed

#: the ledger name of the sanitised generator steps
MECHANISM = "gs-wgan-generator"
#: checkpoint phases: the warm-started critics, the generator loop (with the critics), the released generator
CRITICS_PHASE = "gs-wgan-critics"
LOOP_PHASE = MECHANISM
RELEASE_PHASE = "final-gs-wgan"

# Indices of the non-private "sampling" streams (one generator per purpose, shard and step).
_WARM, _ROUND_ROBIN, _REFRESH, _LATENTS = 1, 2, 3, 4


class GSWGANConfig(Section):
    """The ``gs-wgan`` section (defaults: the paper's MNIST settings, DPImageBench ``configs/GS-WGAN``)."""

    num_shards: int = Field(1000, ge=1, description="K disjoint shards (one critic each); public, fixed")
    batch_size: int = Field(32, ge=1, description="B generated rows per generator step (the sanitised block)")
    steps: int = Field(20000, ge=1, description="T generator steps (each one ledger step)")
    clip_norm: float = Field(1.0, gt=0, description="C: each row of the block is clipped to this L2 norm")
    noise_multiplier: float | None = Field(
        None, gt=0, description="sigma: noise std / (2 C sqrt(B)) per coordinate; null: calibrated to the target eps"
    )
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
    z_dim: int = Field(10, ge=1, description="latent size")
    architecture: GANArchitecture = Field(
        "projection",
        description="the generator / critic pair of dpsynth.models.gan: projection | label-channels (as dp-gan's)",
    )
    generator_width: int = Field(64, ge=1, description="generator base width")
    critic_width: int = Field(64, ge=1, description="critic base width")
    critic_depth: int = Field(3, ge=1, le=4, description="strided convolutions of a critic")
    generator_ema: float | None = Field(0.999, gt=0, lt=1, description="EMA decay of the released generator")
    checkpoint_every: int = Field(500, ge=1, description="generator steps between checkpoints")


def sanitised_query(section: GSWGANConfig, noise_multiplier: float) -> SanitisedBlock:
    """The declaration of one generator step: B rows clipped to C, noise sigma * 2 C sqrt(B), 1 of K shards."""
    return SanitisedBlock(MECHANISM, section.batch_size, section.clip_norm, noise_multiplier, section.num_shards)


@register_method
class GSWGAN(GANMethod):
    name = "gs-wgan"
    summary = "generator trained on clipped + noised critic gradients; K non-private critics on content-keyed shards"
    paper = (
        "Chen, Orekondy & Fritz, GS-WGAN: A Gradient-Sanitized Approach for Learning Differentially Private "
        "Generators, NeurIPS 2020, arXiv:2006.08265"
    )
    config_schema = GSWGANConfig
    privacy_notes = (
        (
            "gs-wgan: each generator step is ONE Gaussian on the whole block of B sanitised rows (L2 sensitivity "
            "2 C sqrt(B): the drawn shard's critic may change every row), amplified once per step by drawing 1 "
            "of K shards of a content-keyed partition (accounted over a change of one shard's contents, "
            "which adding or removing one record is), composed over T steps in RDP. The paper's code composes "
            "B*T separately amplified mechanisms (optimistic: all rows share the drawn critic), and "
            "DPImageBench calibrates T unit-sensitivity steps (it drops the factor B): at their noise the "
            "stated eps does not hold."
        ),
        (
            "gs-wgan: shards are keyed by record content, never by position in a shuffled list (under "
            "add/remove one record would shift every later shard); every critic is warm-started and trained "
            "on its own shard only (DPImageBench loads the last shard's warm-start weights into every critic "
            "through a stale loop index); critics are updated on a public round-robin schedule, never because "
            "the secret draw picked them, so their hidden state leaks no past draw; the shard draws and the "
            "noise come from the entropy-seeded noise source, never the config seed."
        ),
    )

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        return [
            Phase("critics", private=True, description="warm-start one non-private critic per shard (never released)"),
            Phase("generator", private=True, description="sanitised critic gradients train the generator"),
            Phase("generate", private=False, description="class-balanced samples of the (EMA) generator"),
        ]

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        super().check_config(config)
        if config.privacy.accountant != "rdp":
            raise ConfigError(
                f"'privacy.accountant': gs-wgan's shard-sampled steps are accounted in RDP only (dp_accounting's "
                f"sampling-without-replacement bound); set privacy.accountant: rdp, got {config.privacy.accountant!r}"
            )

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """T shard-sampled Gaussian steps (one per generator step, K shards); σ calibrated unless given."""
        section = config.section
        return plan_calibrated(
            config.privacy,
            (),
            lambda sigma: ShardSampledGaussian(MECHANISM, sigma, section.num_shards, section.steps),
            noise_multiplier=section.noise_multiplier,
        )

    # ------------------------------------------------------------------------------------------ fit
    def fit(self, ctx: RunContext) -> None:
        section = ctx.section
        spec = _spec(ctx, section)
        finished = ctx.checkpoints.load(phase=LOOP_PHASE)
        if finished and finished.get("step", 0) >= section.steps and ctx.checkpoints.load(phase=RELEASE_PHASE):
            self._generator = load_released_generator(ctx)  # trained already (the critics were discarded)
            return
        images, labels = ctx.data.train.to_tensors()
        shards = shard_members(ctx.data.train.record_keys, section.num_shards, ctx.seed)
        bank = CriticBank(spec, section, ctx.device)
        bank.warm_start(ctx, images, labels, shards)
        self._generator = train_generator(ctx, section, spec, bank, images, labels, shards)
        discard_critics(ctx)

    def load_released(self, ctx: RunContext) -> Any:
        return load_released_generator(ctx)


def _spec(ctx: Any, section: GSWGANConfig) -> GANSpec:
    channels, height, width = ctx.image_shape
    if height != width:
        raise ConfigError(f"gs-wgan needs square images, got {height}x{width}")
    return GANSpec(
        ctx.num_classes,
        channels,
        height,
        z_dim=section.z_dim,
        generator_width=section.generator_width,
        discriminator_width=section.critic_width,
        discriminator_depth=section.critic_depth,
        architecture=section.architecture,
    )


def shard_members(record_keys: np.ndarray, num_shards: int, seed: int) -> list[torch.Tensor]:
    """Per shard, the dataset positions of its records ordered by content key: shard k's list (as a multiset
    of records, and its order) depends on shard k's records only."""
    keys = np.asarray(record_keys)
    assignment = shard_assignment(keys, num_shards, seed)
    order = np.lexsort((np.arange(len(keys)), keys))  # by content key; ties (identical records) by position
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for position in order:
        members[assignment[position]].append(int(position))
    return [torch.tensor(m, dtype=torch.long) for m in members]


def _adam(params: Any, section: GSWGANConfig) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=section.lr, betas=(section.betas[0], section.betas[1]))


class CriticBank:
    """K conditional critics, critic k trained on shard k only (never released)."""

    def __init__(self, spec: GANSpec, section: GSWGANConfig, device: Any) -> None:
        self.spec, self.section, self.device = spec, section, device
        self.critics: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []

    def _fresh(self, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        critic = self.spec.build_discriminator().to(self.device)
        return critic, _adam(critic.parameters(), self.section)

    def update(
        self,
        critic: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        members: torch.Tensor,
        images: torch.Tensor,
        labels: torch.Tensor,
        generator: torch.nn.Module,
        iters: int,
        rng: torch.Generator,
    ) -> None:
        """``iters`` WGAN-GP updates of ``critic`` on the records ``members`` (one shard) against ``generator``.

        Batches are drawn with replacement from the shard; all randomness comes from ``rng`` (public). An
        empty shard leaves the critic as it is.
        """
        if len(members) == 0 or iters == 0:
            return
        section, device = self.section, self.device
        for _ in range(iters):
            pick = members[torch.randint(0, len(members), (section.critic_batch_size,), generator=rng)]
            real, real_labels = images[pick].to(device), labels[pick].to(device)
            z = torch.randn(len(pick), generator.z_dim, generator=rng).to(device)
            mix = torch.rand(len(pick), generator=rng).to(device)
            with torch.no_grad():
                fake = generator(z, real_labels)
            loss = wgan_gp_critic_loss(
                critic, real, fake, real_labels, mix, gp_weight=section.gp_weight, drift=section.drift
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def warm_start(self, ctx: Any, images: torch.Tensor, labels: torch.Tensor, shards: list[torch.Tensor]) -> None:
        """Train critic k on shard k against its own throwaway generator (non-private; nothing released).

        Checkpointed every ~10 % of the critics (phase :data:`CRITICS_PHASE`); resumes from there.
        """
        section = self.section
        state = ctx.checkpoints.load(phase=CRITICS_PHASE) or {}
        done = int(state.get("done", 0))
        for k in range(done):
            critic, optimizer = self._fresh(stream_seed(ctx.seed, "model-init", 1))
            critic.load_state_dict(state["critics"][k])
            optimizer.load_state_dict(state["optimizers"][k])
            self.critics.append(critic)
            self.optimizers.append(optimizer)
        every = max(1, section.num_shards // 10)
        for k in tqdm(range(done, section.num_shards), desc="gs-wgan critics", unit="critic", leave=False):
            # Every critic (and every throwaway generator) starts from the same public initialisation.
            critic, optimizer = self._fresh(stream_seed(ctx.seed, "model-init", 1))
            if section.pretrain_iters:
                torch.manual_seed(stream_seed(ctx.seed, "model-init", 2))
                throwaway = self.spec.build()[0].to(self.device)
                g_optimizer = _adam(throwaway.parameters(), section)
                rng = ctx.rng("sampling", index=_index(_WARM, k, 0))
                for _ in range(section.pretrain_iters):
                    self.update(critic, optimizer, shards[k], images, labels, throwaway, section.critic_iters or 1, rng)
                    _generator_update(throwaway, critic, g_optimizer, section.critic_batch_size, rng, self.device)
                del throwaway, g_optimizer
            self.critics.append(critic)
            self.optimizers.append(optimizer)
            if (k + 1) % every == 0 or k + 1 == section.num_shards:
                ctx.checkpoints.save(self.state_dict() | {"done": k + 1}, phase=CRITICS_PHASE)
        ctx.log(f"gs-wgan: {section.num_shards} critics warm-started ({section.pretrain_iters} iterations each)")

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

    def refreshed(
        self, k: int, members: torch.Tensor, images: torch.Tensor, labels: torch.Tensor, generator: Any, rng: Any
    ) -> torch.nn.Module:
        """Critic k, or (``refresh_iters`` > 0) a copy of it updated on shard k that is discarded after the step."""
        if self.section.refresh_iters == 0:
            return self.critics[k]
        critic = copy.deepcopy(self.critics[k])
        optimizer = _adam(critic.parameters(), self.section)
        # A deep copy: load_state_dict may keep the original's moment tensors, which the refresh would then
        # update in place, so the kept critic would remember which shard the secret draw picked.
        optimizer.load_state_dict(copy.deepcopy(self.optimizers[k].state_dict()))
        self.update(critic, optimizer, members, images, labels, generator, self.section.refresh_iters, rng)
        return critic


def _index(purpose: int, a: int, b: int) -> int:
    """A distinct index of the non-private ``sampling`` stream per (purpose, shard or step, step)."""
    return (purpose << 56) | (a << 28) | b


def _generator_update(
    generator: torch.nn.Module, critic: torch.nn.Module, optimizer: Any, batch: int, rng: Any, device: Any
) -> None:
    """One non-private WGAN generator update against ``critic`` (the warm start's throwaway generator)."""
    z = torch.randn(batch, generator.z_dim, generator=rng).to(device)
    fake_labels = torch.randint(0, generator.num_classes, (batch,), generator=rng).to(device)
    loss = generator_loss(critic(generator(z, fake_labels), fake_labels), "wgan")
    params = list(generator.parameters())
    grads = torch.autograd.grad(loss, params)
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def critic_input_gradient(critic: torch.nn.Module, fakes: torch.Tensor, fake_labels: torch.Tensor) -> torch.Tensor:
    """Per row b, the gradient of the generator loss ``-D(x_b, c_b)`` with respect to the generated image x_b.

    The critic treats rows independently (GroupNorm, no batch statistics), so row b depends on x_b only.
    """
    fakes = fakes.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(-critic(fakes, fake_labels).sum(), fakes)
    return grad


def train_generator(
    ctx: Any,
    section: GSWGANConfig,
    spec: GANSpec,
    bank: CriticBank,
    images: torch.Tensor,
    labels: torch.Tensor,
    shards: list[torch.Tensor],
) -> torch.nn.Module:
    """T sanitised generator steps (module docstring); saves and returns the released (EMA) generator."""
    device = ctx.device
    query = sanitised_query(section, ctx.plan.noise_multiplier(MECHANISM))
    ledger = ctx.ledger
    ledger.register(query.mechanism(0))
    torch.manual_seed(stream_seed(ctx.seed, "model-init", 3))
    generator = spec.build()[0].to(device)
    optimizer = _adam(generator.parameters(), section)
    ema = EMA(generator, section.generator_ema) if section.generator_ema is not None else None
    start = 0
    state = ctx.checkpoints.load(phase=LOOP_PHASE)
    if state:
        start = int(state["step"])
        generator.load_state_dict(state["generator"])
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None:
            ema.load_state_dict(state["ema"])
        bank.load_state_dict(state["bank"])
        ctx.curves.truncate_after(start)
        ctx.log(f"resumed {MECHANISM} at step {start}")
    spent = next(m.repeats for m in ledger.mechanisms() if m.name == MECHANISM)
    if spent != start:
        raise ConfigError(f"gs-wgan: the ledger holds {spent} generator steps but the checkpoint is at {start}")
    ctx.log(
        f"gs-wgan: {section.steps} generator steps, K={section.num_shards} shards, B={section.batch_size}, "
        f"C={section.clip_norm}, sigma={query.noise_multiplier:.4f} (noise std {query.noise_std:.4g} per "
        f"coordinate), target eps={ledger.target_epsilon}"
    )
    noise = ctx.noise_source()

    def checkpoint(step: int) -> None:
        ctx.checkpoints.save(
            {
                "step": step,
                "generator": generator.state_dict(),
                "optimizer": optimizer.state_dict(),
                "ema": ema.state_dict() if ema is not None else None,
                "bank": bank.state_dict(),
            },
            phase=LOOP_PHASE,
        )

    for step in tqdm(range(start, section.steps), initial=start, total=section.steps, desc="gs-wgan", leave=False):
        # 1. public latents and labels of the B generated rows
        latents = ctx.rng("sampling", index=_index(_LATENTS, step, 0))
        z = torch.randn(section.batch_size, spec.z_dim, generator=latents).to(device)
        fake_labels = torch.randint(0, spec.num_classes, (section.batch_size,), generator=latents).to(device)
        fakes = generator(z, fake_labels)
        refresh_rng = ctx.rng("sampling", index=_index(_REFRESH, step, 0))

        def block(k: int) -> torch.Tensor:
            critic = bank.refreshed(k, shards[k], images, labels, generator, refresh_rng)
            return critic_input_gradient(critic, fakes, fake_labels)

        # 2. one sanitised release: spend, draw the shard, clip the rows, add the noise
        released = release_sanitised_block(query, block, ledger, noise)
        # 3. post-processing: back-propagate the released block (its batch mean) into the generator
        optimizer.zero_grad(set_to_none=True)
        fakes.backward(released / section.batch_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(generator)
        # 4. the round-robin critic follows the new generator (public schedule, its own shard only)
        r = step % section.num_shards
        bank.update(
            bank.critics[r],
            bank.optimizers[r],
            shards[r],
            images,
            labels,
            generator,
            section.critic_iters,
            ctx.rng("sampling", index=_index(_ROUND_ROBIN, step, 0)),
        )
        if (step + 1) % section.checkpoint_every == 0 or step + 1 == section.steps or step == start:
            ctx.curves.log(step + 1, epsilon=ledger.epsilon())
        if (step + 1) % section.checkpoint_every == 0 or step + 1 == section.steps:
            checkpoint(step + 1)
    released_net = ema.model if ema is not None else generator
    ctx.checkpoints.save(
        {"spec": dataclasses.asdict(spec), "generator": released_net.state_dict()}, phase=RELEASE_PHASE
    )
    ctx.log(f"gs-wgan: done, eps spent so far {ledger.epsilon():.4f} of {ledger.target_epsilon}")
    return released_net.eval()


def discard_critics(ctx: Any) -> None:
    """Once the generator is released, drop the critics (non-private functions of their shards) from the
    working checkpoints: only the released generator and the loop's step stay on disk."""
    loop = ctx.checkpoints.load(phase=LOOP_PHASE) or {}
    ctx.checkpoints.save({key: value for key, value in loop.items() if key != "bank"}, phase=LOOP_PHASE)
    ctx.checkpoints.save({"done": 0, "discarded": True}, phase=CRITICS_PHASE)


def load_released_generator(ctx: Any) -> torch.nn.Module:
    """The released (EMA) generator of a finished run."""
    return load_generator(ctx, "gs-wgan", RELEASE_PHASE)
