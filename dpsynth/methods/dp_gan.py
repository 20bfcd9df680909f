"""``dp-gan``: a conditional GAN whose discriminator alone is trained with DP-SGD, from scratch.

DP-GAN (Xie et al., "Differentially Private Generative Adversarial Network", arXiv:1802.06739) as
DPImageBench benchmarks it (``models/dpsgd_gan.py``): not the paper's weight-clipped WGAN, but DP-SGD on
the discriminator (Poisson batches, per-example clipping, Gaussian noise), the hinge loss, several
discriminator steps per generator step and an EMA of the generator, which is what is released. The
generator reads only the released discriminator and public latents, so its training is post-processing.

The mechanism is one Poisson-subsampled Gaussian per discriminator step (ledger name
``dp-discriminator``, add/remove adjacency, sensitivity C): each sampled real record and the fake
paired with it (latent and label from the record's own row of the per-record draws) are ONE
per-example unit, clipped together (docs/privacy.md, "Per-record randomness"). Everything is shared
with PrivImage+G in :mod:`dpsynth.methods.families.gan`; this module only wires it. By default it starts
from scratch, as DPImageBench's table rows do (``public_data.name=null``); ``pretrain_steps`` > 0 starts both
networks from a GAN pre-trained without privacy on ``data.public`` (DPImageBench's shipped DP-GAN configs
enable ImageNet pre-training), which costs no privacy.
"""

from __future__ import annotations

from dpsynth.contract import Phase, PrivateNetwork, RunConfig, RunContext, register_method
from dpsynth.methods.families.gan import (
    DPGANSection,
    GANMethod,
    build_gan,
    discriminator_network,
    pretrain_on_public,
    pretrain_phases,
    train_dp_gan,
)
from dpsynth.privacy.plan import PrivacyPlan
from dpsynth.schema import with_defaults

#: the ledger name of the discriminator's DP-SGD steps
MECHANISM = "dp-discriminator"


class DPGANConfig(
    with_defaults(
        DPGANSection,
        "DPGANDefaults",
        "DP-GAN's keys with DPImageBench's recipe where it fits (hinge loss, Adam betas (0, 0.999), "
        "generator EMA 0.999).",
        loss="hinge",
        betas=[0.0, 0.999],
        generator_ema=0.999,
        z_dim=60,
    )
):  # type: ignore[misc]
    """The ``dp-gan`` section: the shared DP-GAN keys (:class:`dpsynth.methods.families.gan.DPGANSection`)."""


@register_method
class DPGAN(GANMethod):
    name = "dp-gan"
    summary = "GAN with a DP-SGD discriminator (real + paired fake per example), generator as post-processing"
    paper = (
        "Xie et al., Differentially Private Generative Adversarial Network, arXiv:1802.06739 "
        "(DPImageBench's DP-SGD variant, Chen et al., arXiv:2503.14681)"
    )
    config_schema = DPGANConfig
    privacy_notes = (
        (
            "dp-gan: each DP-SGD step of the discriminator clips the gradient of one real record together "
            "with the fake paired with it (one per-example unit, sensitivity C under add/remove); the fake's "
            "latent and label are the record's own per-record draws, so no other record shifts them. The "
            "generator reads only the released discriminator: post-processing, no ledger entry."
        ),
        (
            "dp-gan: the DP noise and the Poisson batches come from an entropy-seeded source, never from the "
            "config seed (DPImageBench fixes the seed before make_private, so its noise is replayable), and no "
            "statistic of the private data (DPImageBench logs FID against private-train statistics) is logged."
        ),
    )

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        pretrain = pretrain_phases(config.section, "non-private GAN on data.public")
        start = "from the public GAN" if pretrain else "from scratch"
        return [
            *pretrain,
            Phase("train", private=True, description=f"DP-SGD discriminator {start}; the generator follows it"),
            Phase("generate", private=False, description="class-balanced samples of the (EMA) generator"),
        ]

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        """The discriminator (the generator is post-processing)."""
        return [discriminator_network(self.name, config.section, config.data)]

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """``steps`` (or ``epochs·N/B``) DP-SGD discriminator steps at q = B/N; σ calibrated unless given."""
        training = config.section.private_training()
        return training.plan(config.privacy, num_examples, name=MECHANISM, key=self.name)

    def fit(self, ctx: RunContext) -> None:
        section = ctx.section
        spec = self.spec_for(section, ctx.image_shape, ctx.num_classes)
        generator, discriminator = build_gan(ctx, spec)
        pretrain_on_public(ctx, section, spec, (generator, discriminator))
        released = train_dp_gan(
            ctx,
            section,
            spec,
            generator,
            discriminator,
            mechanism=MECHANISM,
            desc="dp-gan discriminator",
        )
        self.release(spec, released)
