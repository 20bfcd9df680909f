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
   (:func:`dpsynth.methods.families.gan.sanitised_generator_step`); the generator back-propagates the
   noisy block; then the critic ``t mod K`` (a public, round-robin schedule) takes ``critic_iters`` WGAN-GP
   updates on its shard against the new generator. An EMA of the generator is released.

The critics are the GAN family's :class:`~dpsynth.methods.families.gan.CriticBank`; this module states the
plan, the loop and its checkpoints.

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

from typing import Any

import torch
from pydantic import Field
from tqdm.auto import tqdm

from dpsynth.contract import Phase, RunConfig, RunContext, register_method
from dpsynth.data.splits import shard_members
from dpsynth.dpsgd.ema import EMA
from dpsynth.errors import ConfigError
from dpsynth.methods.families.gan import (
    LATENTS,
    REFRESH,
    ROUND_ROBIN,
    CriticBank,
    GANMethod,
    PublicGANPretraining,
    ShardCriticsSection,
    pretrain_on_public,
    pretrain_phases,
    sanitised_generator_step,
    square_spec,
    stream_index,
)
from dpsynth.models.gan import GANArchitecture, GANSpec
from dpsynth.privacy.mechanisms import ShardSampledGaussian
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.privacy.sanitised_block import SanitisedBlock
from dpsynth.seeding import stream_seed

#: the ledger name of the sanitised generator steps
MECHANISM = "gs-wgan-generator"
#: checkpoint phase of the generator loop (with the critics until the generator is released; key "step")
LOOP_PHASE = MECHANISM


class GSWGANConfig(ShardCriticsSection, PublicGANPretraining):
    """The ``gs-wgan`` section (defaults: the paper's MNIST settings, DPImageBench ``configs/GS-WGAN``): the
    critics' keys (:class:`~dpsynth.methods.families.gan.ShardCriticsSection`) and the generator's."""

    batch_size: int = Field(32, ge=1, description="B generated rows per generator step (the sanitised block)")
    steps: int = Field(20000, ge=1, description="T generator steps (each one ledger step)")
    clip_norm: float = Field(1.0, gt=0, description="C: each row of the block is clipped to this L2 norm")
    noise_multiplier: float | None = Field(
        None, gt=0, description="sigma: noise std / (2 C sqrt(B)) per coordinate; null: calibrated to the target eps"
    )
    z_dim: int = Field(10, ge=1, description="latent size")
    architecture: GANArchitecture = Field(
        "projection",
        description="the generator / critic pair of dpsynth.models.gan: projection | label-channels (as dp-gan's)",
    )
    generator_width: int = Field(64, ge=1, description="generator base width")
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
            *pretrain_phases(config.section, "non-private GAN on data.public: the generator's and critics' start"),
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

    @classmethod
    def spec_for(cls, section: Any, image_shape: tuple[int, int, int], num_classes: int) -> GANSpec:
        """The generator and critic pair of ``section`` (the critics' widths, as GS-WGAN's)."""
        return square_spec(
            image_shape,
            num_classes,
            cls.name,
            z_dim=section.z_dim,
            generator_width=section.generator_width,
            discriminator_width=section.critic_width,
            discriminator_depth=section.critic_depth,
            architecture=section.architecture,
        )

    # ------------------------------------------------------------------------------------------ fit
    def fit(self, ctx: RunContext) -> None:
        section = ctx.section
        spec = self.spec_for(section, ctx.image_shape, ctx.num_classes)
        images, labels = ctx.data.train.to_tensors()
        shards = shard_members(ctx.data.train.record_keys, section.num_shards, ctx.seed)
        bank = CriticBank(spec, section, ctx.device, shards, name=self.name)
        self.release(spec, train_generator(ctx, section, spec, bank, (images, labels)))
        bank.discard(ctx, LOOP_PHASE)


def train_generator(
    ctx: Any, section: GSWGANConfig, spec: GANSpec, bank: CriticBank, data: tuple[torch.Tensor, torch.Tensor]
) -> torch.nn.Module:
    """T sanitised generator steps (module docstring), resumed through ``ctx.resume``; returns the released
    (EMA) generator. The critics are warm-started first unless the loop had already finished."""
    query = sanitised_query(section, ctx.plan.noise_multiplier(MECHANISM))
    ledger = ctx.ledger
    ledger.register(query.mechanism(0), planned=section.steps)
    torch.manual_seed(stream_seed(ctx.seed, "model-init", 3))
    generator = spec.build_generator().to(ctx.device)
    if section.pretrain_steps:
        public_critic = spec.build_discriminator().to(ctx.device)
        pretrain_on_public(ctx, section, spec, (generator, public_critic))
        bank.start_from(generator, public_critic)
    optimizer = section.adam(generator.parameters())
    ema = EMA(generator, section.generator_ema) if section.generator_ema is not None else None
    start, state = ctx.resume(MECHANISM, LOOP_PHASE)
    if state:
        generator.load_state_dict(state["generator"])
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None:
            ema.load_state_dict(state["ema"])
    if start < section.steps:
        bank.warm_start(ctx, data)
        if state:
            bank.load_state_dict(state["bank"])
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
        refresh = ctx.rng("sampling", index=stream_index(REFRESH, step))
        sanitised_generator_step(
            generator,
            optimizer,
            query,
            lambda k: bank.refreshed(k, data, generator, refresh),
            ledger,
            noise,
            ctx.rng("sampling", index=stream_index(LATENTS, step)),
        )
        if ema is not None:
            ema.update(generator)
        bank.follow(step, data, generator, ctx.rng("sampling", index=stream_index(ROUND_ROBIN, step)))
        if (step + 1) % section.checkpoint_every == 0 or step + 1 == section.steps or step == start:
            ctx.curves.log(step + 1, epsilon=ledger.epsilon())
        if (step + 1) % section.checkpoint_every == 0 or step + 1 == section.steps:
            checkpoint(step + 1)
    ctx.log(f"gs-wgan: done, eps spent so far {ledger.epsilon():.4f} of {ledger.target_epsilon}")
    return ema.model if ema is not None else generator
