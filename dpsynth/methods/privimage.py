"""PrivImage: DP semantic query, public-data selection, pre-training and DP fine-tuning (+D and +G).

Li, Gong, Li, Zhao, Hou & Wang, "PrivImage: Differentially Private Synthetic Image Generation using
Diffusion Models with Semantic-Aware Pretraining" (USENIX Security 2024, arXiv:2311.12850),
Algorithms 1-2, Theorem 3.1, appendix B.

1. Selection (Algorithm 2, lines 2-18; :func:`dpsynth.selection.select_for_run`): a classifier trained on
   the public labels (Eq. 4) gives every private image its top-k1 public classes; the per-class histogram
   is released with Gaussian noise std sqrt(k1)·σ_q (one ledger mechanism, ``semantic-query``); every
   private class keeps its top-k2 public classes, whose images, relabelled with the private class, form
   the pre-training set (k1 = k2 = k, appendix B). Released: ``selection.json``, ``figures/selection.png``.
2. PrivImage+D (``generator: diffusion``): PDP-Diffusion's flow on the selected subset
   (:class:`dpsynth.methods.families.diffusion.PretrainedDiffusionMethod`), in pixel space (the paper's) or,
   with ``space: latent``, on the latents of the public backbone (docs/backbone.md); the query and the
   selection stay in pixel space.
3. PrivImage+G (``generator: gan``): a conditional DCGAN pre-trained on the subset
   (:func:`dpsynth.selection.pretraining.pretrain_gan_on_selection`); DP fine-tuning trains only the
   discriminator with DP-SGD, the generator learns from the released discriminator
   (:func:`dpsynth.methods.families.gan.train_dp_gan`, post-processing).

The plan holds ``Gaussian("semantic-query", σ_q)`` — σ_q from ``selection.query_noise_multiplier``, a
re-used selection, or calibrated so the query alone is (``query_epsilon_share``·ε, δ)-DP — and the DP-Adam
(+D) or DP-discriminator (+G) subsampled Gaussian, σ calibrated to what is left. Soundness fixes against
the reference code (``privacy_notes``): the query noise comes from the run's noise source, never a fixed
seed; a re-used selection is charged again.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
import torch
from pydantic import Field

from dpsynth.contract import Phase, PrivateNetwork, RunConfig, RunContext, Samples, register_method
from dpsynth.errors import ConfigError
from dpsynth.methods.families.diffusion import (
    MECHANISM,
    LatentSpaceSection,
    PretrainedDiffusionMethod,
    PretrainedDiffusionSection,
    backbone_phases,
)
from dpsynth.methods.families.gan import (
    DPGANSection,
    build_gan,
    discriminator_network,
    gan_spec,
    generator_from_state,
    generator_state,
    sample_generator,
    train_dp_gan,
)
from dpsynth.models.gan import GANSpec
from dpsynth.privacy.mechanisms import Gaussian
from dpsynth.privacy.plan import PrivacyPlan
from dpsynth.schema import with_defaults
from dpsynth.seeding import stream_seed
from dpsynth.selection import QUERY_MECHANISM, SELECTION_PHASE, SelectionResult, SelectionSection, select_for_run
from dpsynth.selection.pretraining import pretrain_gan_on_selection

GAN_MECHANISM = "dp-discriminator"


class GANSection(DPGANSection):
    """PrivImage+G: a conditional DCGAN whose discriminator alone is trained with DP-SGD (§4.4, §5), pre-trained
    without privacy on the selected subset."""

    pretrain_steps: int = Field(2000, ge=1, description="non-private GAN steps on the selected subset")


PrivImageDiffusionSection = with_defaults(
    PretrainedDiffusionSection,
    "PrivImageDiffusionSection",
    "PrivImage+D's diffusion keys: pdp-diffusion's, with a light 1.8M UNet (§6.2) as default.",
    model="1.8m",
    learn_sigma=False,
    loss="simple",
    noise_schedule="linear",
    timestep_weights=[0.015, 0.785, 0.2],
    timestep_boundaries=[0, 30, 600, 1000],
    multiplicity=128,
    batch_size=4096,
    physical_batch_size=16,
    steps=4000,
    epochs=None,
    lr=0.0005,
    clip_norm=0.001,
    ema_decay=0.9999,
)


class PrivImageConfig(PrivImageDiffusionSection, LatentSpaceSection):  # type: ignore[misc, valid-type]
    """The ``privimage`` section: pdp-diffusion's keys (+D, with ``space``), the selection, and the GAN (+G)."""

    generator: Literal["diffusion", "gan"] = Field("diffusion", description="diffusion (PrivImage+D) | gan (+G)")
    selection: SelectionSection = Field(default_factory=SelectionSection, description="semantic query + selection")
    gan: GANSection = Field(default_factory=GANSection, description="PrivImage+G settings (generator: gan)")

    @pydantic.model_validator(mode="after")
    def _latent_space_is_diffusion_only(self) -> PrivImageConfig:
        if self.space == "latent" and self.generator == "gan":
            raise ValueError("space: latent is PrivImage+D's (generator: diffusion); the +G DCGAN works on pixels")
        return self


@register_method
class PrivImage(PretrainedDiffusionMethod):
    name = "privimage"
    summary = (
        "DP semantic query selects public pre-training data; then pdp-diffusion (+D) or a DP-discriminator GAN (+G)"
    )
    paper = (
        "Li et al., PrivImage: Differentially Private Synthetic Image Generation using Diffusion Models with "
        "Semantic-Aware Pretraining, arXiv:2311.12850"
    )
    config_schema = PrivImageConfig
    privacy_notes = (
        (
            "privimage: the semantic distribution (one histogram row per private class) is one Gaussian mechanism "
            "'semantic-query' with L2 sensitivity sqrt(k1) (Theorem 3.1) and noise from the run's noise source; "
            "one public re-implementation seeds this noise with 0, which gives no privacy."
        ),
        (
            "privimage: a selection re-used from an earlier run is charged again; PrivImage's reference code loads "
            "a cached selection and charges nothing for it."
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._selected: SelectionResult | None = None  # the released selection and the public subset it picks
        self._gan: tuple[GANSpec, torch.nn.Module] | None = None  # +G's released generator

    # -- declared before any data is read ------------------------------------------------------
    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        fine_tuning = (
            Phase(GAN_MECHANISM, private=True, description="DP-SGD on the GAN discriminator; the generator follows it")
            if config.section.generator == "gan"
            else Phase(MECHANISM, private=True, description="DP-Adam fine-tuning of the pre-trained diffusion model")
        )
        selection = Phase(
            SELECTION_PHASE,
            private=True,
            public="required",
            description="the semantic query classifier is trained on data.public and selects from it",
        )
        # space latent: the backbone is built after the selection (on the whole public set) and encodes the subset
        return [
            selection,
            *backbone_phases(config),
            Phase("pretrain", private=False, public="required", description="non-private pre-training on the subset"),
            fine_tuning,
            Phase("generate", private=False),
        ]

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        """Beyond the section's own checks: the selection must feed pre-training, and a re-used selection must
        be readable (its σ_q enters the plan)."""
        super().check_config(config)
        section = config.section
        if section.generator == "diffusion" and not section.pretrain.enabled:
            raise ConfigError(
                "privimage.pretrain.enabled: false would charge the selection and never use it; "
                "train from scratch with pdp-diffusion or dpdm instead"
            )
        section.selection.check(config.privacy.epsilon, config.privacy.delta, f"{cls.name}.selection")

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        """+D: the UNet (the shared diffusion skeleton's); +G: the discriminator (the generator is post-processing)."""
        if config.section.generator == "gan":
            return [discriminator_network(f"{self.name}.gan", config.section.gan, config.data)]
        return super().private_networks(config)

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """``semantic-query`` (Gaussian, count 1) plus the fine-tuning's subsampled Gaussian, σ calibrated to the rest.

        +D: ``dp-adam``, ``steps`` (or ``epochs·N/B``) steps at q = B/N; +G: ``dp-discriminator``,
        ``gan.steps`` at q = ``gan.batch_size``/N. A re-used selection is charged again: same mechanism.
        """
        section, privacy = config.section, config.privacy
        sigma_q = section.selection.query_sigma(privacy.epsilon, privacy.delta, f"{self.name}.selection")
        name = GAN_MECHANISM if section.generator == "gan" else MECHANISM
        training = (section.gan if section.generator == "gan" else section).private_training()
        key = f"{self.name}.gan" if name == GAN_MECHANISM else self.name
        return training.plan(privacy, num_examples, name=name, key=key, fixed=(Gaussian(QUERY_MECHANISM, sigma_q),))

    def fit(self, ctx: RunContext) -> None:
        """The selection (run, resumed or re-used: :func:`dpsynth.selection.select_for_run`), then +D or +G."""
        config = ctx.section
        self._selected = select_for_run(ctx, config.selection, key=f"{self.name}.selection")
        if config.generator == "gan":
            self.fit_gan(ctx, config)
        else:
            super().fit(ctx)

    # -- PrivImage+D hooks -------------------------------------------------------------------
    def pretraining_data(self, ctx: RunContext) -> tuple[Any, str] | None:
        return self._selected.pretraining_data(str(ctx.config.data.public))

    def label_transfer(self, ctx: RunContext, public: Any) -> tuple[str, list[str] | None, list[str] | None]:
        if self._selected.selection.conditional:  # the subset already carries the private labels: copy every row
            return "names", public.class_names, public.class_names
        return super().label_transfer(ctx, public)

    # -- PrivImage+G -------------------------------------------------------------------------
    def fit_gan(self, ctx: RunContext, config: PrivImageConfig) -> None:
        """Pre-train the GAN on the subset, then DP-GAN (:func:`dpsynth.methods.families.gan.train_dp_gan`)."""
        gan = config.gan
        spec = gan_spec(ctx, gan, self.name)
        nets = build_gan(ctx, spec)
        pretrain_gan_on_selection(ctx, self._selected, spec, gan.pretrain_settings(), nets, use_cache=gan.cache)
        released = train_dp_gan(ctx, gan, spec, *nets, mechanism=GAN_MECHANISM, desc="privimage+G discriminator")
        self._gan = (spec, released)

    # -- released state: +D the diffusion family's, +G the generator ---------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._gan is None:
            return super().state_dict()
        return {"gan": generator_state(*self._gan)}

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        if ctx.section.generator == "diffusion":
            super().load_state_dict(state, ctx)
            return
        self._gan = (GANSpec(**state["gan"]["spec"]), generator_from_state(state["gan"], ctx.device))

    def generate(self, ctx: RunContext, num: int) -> Samples:
        if self._gan is None:
            return super().generate(ctx, num)
        images, labels = sample_generator(
            self._gan[1], num, ctx.num_classes, seed=stream_seed(ctx.seed, "sampling"), device=ctx.device
        )
        return Samples(images=images, labels=labels)
