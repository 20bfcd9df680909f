"""PrivImage: DP semantic query, public-data selection, pre-training and DP fine-tuning (+D and +G).

Li, Gong, Li, Zhao, Hou & Wang, "PrivImage: Differentially Private Synthetic Image Generation using
Diffusion Models with Semantic-Aware Pretraining" (USENIX Security 2024, arXiv:2311.12850),
Algorithms 1-2, Theorem 3.1, appendix B.

1. Selection (Algorithm 2, lines 2-18; :mod:`dpsynth.selection`): a classifier trained on the public
   labels (Eq. 4) gives every private image its top-k1 public classes; the per-class histogram is
   released with Gaussian noise std sqrt(k1)·σ_q (one ledger mechanism, ``semantic-query``); every
   private class keeps its top-k2 public classes and those public images, relabelled with the private
   class, form the pre-training set. k1 = k2 = k (appendix B). The selection is released:
   ``selection.json`` and ``figures/selection.png`` in the run directory.
2. PrivImage+D (``generator: diffusion``): PDP-Diffusion's flow on the selected subset —
   pre-training, then DP-Adam fine-tuning with augmentation multiplicity, mixture-of-uniform
   timesteps and EMA (:class:`dpsynth.methods.families.diffusion.PretrainedDiffusionMethod`).
3. PrivImage+G (``generator: gan``): a conditional DCGAN (:mod:`dpsynth.models.gan`) pre-trained on
   the subset; DP fine-tuning trains only the discriminator with DP-SGD through
   :func:`dpsynth.dpsgd.training.train_private`; the generator learns only from the released
   discriminator (post-processing, ``train_private``'s ``after_step`` hook).

Latent space (``space: latent``, +D only; pixel space, the paper's, is the default): the semantic query and the
selection stay in pixel space (the classifier reads public pixel images); the selected subset is encoded by the
public backbone (the run's ``backbone`` section, trained on the whole of ``data.public`` and cached;
docs/backbone.md), and pre-training, DP fine-tuning and sampling run on latents, as pdp-diffusion's
``space: latent``. Each private image is encoded on its own inside the batch builder (sensitivity unchanged);
samples are decoded by the public decoder. +G refuses ``space: latent`` at load.

The privacy plan (:meth:`PrivImage.plan`) holds ``Gaussian("semantic-query", σ_q)`` — σ_q from
``selection.query_noise_multiplier``, from a re-used selection, or calibrated so the query alone is
(``query_epsilon_share``·ε, δ)-DP — and the DP-Adam (+D) or DP-discriminator (+G) subsampled
Gaussian whose σ is calibrated to what is left. ``fit`` takes every σ from the plan.

Soundness fixes against the reference code (stated in ``privacy.json``): the query noise is drawn
from the run's noise source, never from a fixed seed; re-using an earlier selection charges its
mechanism again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pydantic
import torch
from pydantic import Field

from dpsynth.contract import Phase, PrivateNetwork, RunConfig, RunContext, Samples, register_method
from dpsynth.errors import ConfigError, DataError, PrivacyError
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
    load_generator,
    sample_generator,
    train_dp_gan,
)
from dpsynth.privacy.mechanisms import Gaussian
from dpsynth.privacy.plan import PrivacyPlan
from dpsynth.rundir import SELECTION_FILE
from dpsynth.schema import Section, with_defaults
from dpsynth.seeding import stream_seed
from dpsynth.selection.distribution import QUERY_MECHANISM

SELECTION_PHASE = "selection"
GAN_MECHANISM = "dp-discriminator"


class SelectionSection(Section):
    """The semantic query and the selection (§3.2-3.3, Algorithm 2, appendix B)."""

    k: int = Field(
        3,
        ge=1,
        description="public classes queried per private image and kept per private class "
        "(appendix B: k1 = k2 = k; paper: 5 for CIFAR-10, 10 for CelebA); at most the number of public classes",
    )
    k1: int | None = Field(None, ge=1, description="override of k for the query (L2 sensitivity sqrt(k1))")
    k2: int | None = Field(None, ge=1, description="override of k for the selection (top-k2 noisy counts)")
    conditional: bool = Field(
        True,
        description="one histogram row per private class, selected images relabelled "
        "with it; false: one histogram, public labels kept (CelebA)",
    )
    collisions: Literal["share", "exclusive"] = Field(
        "share",
        description="a public class in the top-k2 of several private classes: kept by each "
        "(share, as printed) or by the one where it ranks highest (exclusive)",
    )
    query_epsilon_share: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="sigma_q makes the query alone (share*eps, delta)-DP (analytic Gaussian); "
        "ignored when query_noise_multiplier is set or a selection is re-used",
    )
    query_noise_multiplier: float | None = Field(
        None, gt=0, description="sigma_q (cell noise std sqrt(k1)*sigma_q); the paper uses 484; null: from the share"
    )
    classifier: str = Field("cnn", description="semantic query classifier (dpsynth.models.classifiers)")
    classifier_preset: Literal["cpu", "gpu"] = Field("gpu", description="its width preset")
    classifier_epochs: int = Field(6, ge=1, description="epochs of Eq. 4 on the public data")
    classifier_batch_size: int = Field(128, ge=1, description="its batch size")
    classifier_lr: float = Field(1e-3, gt=0, description="its Adam learning rate")
    classifier_max_steps: int | None = Field(None, ge=1, description="cap on its steps (smoke runs)")
    cache: bool = Field(True, description="cache the semantic query classifier ($DPSYNTH_CACHE)")
    reuse: str | None = Field(
        None,
        description=f"an earlier run dir or {SELECTION_FILE} on the SAME private data: its selection (with its k, "
        "conditional and sigma_q) replaces the query, and its mechanism is charged again to this run",
    )


class GANSection(DPGANSection):
    """PrivImage+G: a conditional DCGAN whose discriminator alone is trained with DP-SGD (§4.4, §5), pre-trained
    without privacy on the selected subset."""

    pretrain_steps: int = Field(2000, ge=1, description="non-private GAN steps on the selected subset")
    pretrain_batch_size: int = Field(64, ge=1, description="pre-training batch size")
    pretrain_lr: float = Field(2e-4, gt=0, description="pre-training Adam learning rate")
    cache: bool = Field(True, description="cache the pre-trained GAN")


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


def query_sigma(config: RunConfig) -> float:
    """σ_q of the run: a re-used selection's, the configured one, or calibrated to the query's ε share.

    The calibration makes the query alone exactly (share·ε, δ)-DP (analytic Gaussian mechanism,
    :func:`dpsynth.selection.distribution.query_noise_multiplier`); fine-tuning gets what is left.
    """
    from dpsynth.selection.distribution import query_noise_multiplier, read_selection

    selection = config.section.selection
    if selection.reuse:
        try:
            return float(read_selection(selection.reuse).noise_multiplier)
        except DataError as err:
            raise ConfigError(f"privimage.selection.reuse: {err}") from None
    if selection.query_noise_multiplier is not None:
        return selection.query_noise_multiplier
    return query_noise_multiplier(config.privacy.epsilon, config.privacy.delta, selection.query_epsilon_share)


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
        self._subset: Any = None
        self._subset_key = ""
        self._conditional = True
        self._generator: torch.nn.Module | None = None

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
        selection = section.selection
        if selection.reuse and selection.query_noise_multiplier is not None:
            reused = query_sigma(config)
            if reused != selection.query_noise_multiplier:
                raise ConfigError(
                    f"privimage.selection.query_noise_multiplier is {selection.query_noise_multiplier} but the "
                    f"re-used selection was released with sigma_q={reused}; drop one of them"
                )
        elif selection.reuse:
            query_sigma(config)  # an unreadable selection is a config error at load

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
        section = config.section
        query = Gaussian(QUERY_MECHANISM, query_sigma(config))
        name = GAN_MECHANISM if section.generator == "gan" else MECHANISM
        training = (section.gan if section.generator == "gan" else section).private_training()
        key = f"{self.name}.gan" if name == GAN_MECHANISM else self.name
        return training.plan(config.privacy, num_examples, name=name, key=key, fixed=(query,))

    # -- selection ---------------------------------------------------------------------------
    def fit(self, ctx: RunContext) -> None:
        config = ctx.section
        self.select(ctx, config)
        if config.generator == "gan":
            self.fit_gan(ctx, config)
        else:
            super().fit(ctx)

    def select(self, ctx: RunContext, config: PrivImageConfig) -> None:
        """Run (or resume, or re-use and re-charge) the selection with the planned σ_q; write its released files."""
        from dpsynth.selection import Selection, private_query_settings, read_selection, reuse_selection, run_selection
        from dpsynth.selection.pipeline import finish_selection
        from dpsynth.selection.semantic import train_semantic_query

        if ctx.public is None:
            raise ConfigError("privimage selects from public data: set data.public (e.g. glyphs)")
        sigma = ctx.plan.noise_multiplier(QUERY_MECHANISM)
        settings = self._selection_settings(config)
        public_spec, private_spec = str(ctx.config.data.public), str(ctx.config.data.private)
        private_settings = private_query_settings(ctx.config.data)

        def query() -> Any:
            return train_semantic_query(
                ctx.public, public_spec, settings.query, device=ctx.device, use_cache=settings.cache, log=ctx.log
            )

        saved = ctx.checkpoints.load(phase=SELECTION_PHASE)
        if saved is not None and any(m.name == QUERY_MECHANISM for m in ctx.ledger.mechanisms()):
            result = finish_selection(Selection.from_json(saved["selection"]), ctx.public, query())
            ctx.log("selection: resumed from the checkpoint (already charged)")
        else:
            if config.selection.reuse:
                reused = read_selection(config.selection.reuse)
                if reused.noise_multiplier != sigma:
                    raise PrivacyError(
                        f"the re-used selection has sigma_q={reused.noise_multiplier}, the plan {sigma}: "
                        "the file changed after the run was planned"
                    )
                result = reuse_selection(
                    reused,
                    ctx.public,
                    private_spec=private_spec,
                    private_settings=private_settings,
                    ledger=ctx.ledger,
                    query=query(),
                )
                ctx.log(f"selection: re-used {config.selection.reuse}, its mechanism charged again")
            else:
                result = run_selection(
                    ctx.data.train,
                    ctx.public,
                    public_spec=public_spec,
                    private_spec=private_spec,
                    private_settings=private_settings,
                    settings=settings,
                    noise_multiplier=sigma,
                    ledger=ctx.ledger,
                    noise=ctx.noise_source(),
                    device=ctx.device,
                    log=ctx.log,
                )
            ctx.checkpoints.save({"selection": result.selection.to_json()}, phase=SELECTION_PHASE)
        self._release_selection(ctx, result)
        selection = result.selection
        self._subset, self._conditional = result.subset, selection.conditional
        self._subset_key = (
            f"{public_spec}|privimage-selection|{'/'.join(','.join(map(str, c)) for c in selection.chosen)}"
        )

    @staticmethod
    def _release_selection(ctx: RunContext, result: Any) -> None:
        """selection.json, figures/selection.png and the log lines: the noisy release and public values only."""
        from dpsynth.selection import write_selection

        selection = result.selection
        write_selection(ctx.run_dir, selection, ctx.public.labels, result.sds, result.query_accuracy)
        if result.query_accuracy is not None:
            ctx.log(f"semantic query: accuracy {result.query_accuracy:.3f} on the public set (public data only)")
        for row, classes in enumerate(selection.chosen):
            ctx.log(
                f"selection: class {selection.row_names[row]} <- "
                + ", ".join(f"{selection.semantic_names[s]} ({selection.noisy_counts[row, s]:.0f})" for s in classes)
            )
        ctx.log(
            f"selection: {result.ratio:.1%} of the {len(ctx.public)} public images selected "
            f"({len(result.subset)} pre-training images, shared classes counted once per class); "
            f"SDS full {result.sds.get('full', float('nan')):.3f}, "
            f"selected {result.sds.get('selected', float('nan')):.3f}"
        )

    @staticmethod
    def _selection_settings(config: PrivImageConfig) -> Any:
        from dpsynth.selection import SelectionSettings, SemanticQuerySettings

        s = config.selection
        query = SemanticQuerySettings(
            classifier=s.classifier,
            preset=s.classifier_preset,
            epochs=s.classifier_epochs,
            batch_size=s.classifier_batch_size,
            lr=s.classifier_lr,
            max_steps=s.classifier_max_steps,
        )
        return SelectionSettings(
            k1=s.k1 or s.k,
            k2=s.k2 or s.k,
            conditional=s.conditional,
            collisions=s.collisions,
            query=query,
            cache=s.cache,
        )

    # -- PrivImage+D hooks -------------------------------------------------------------------
    def pretraining_data(self, ctx: RunContext) -> tuple[Any, str] | None:
        return self._subset, self._subset_key

    def label_transfer(self, ctx: RunContext, public: Any) -> tuple[str, list[str] | None, list[str] | None]:
        if self._conditional:  # the subset already carries the private labels: copy every row
            return "names", public.class_names, public.class_names
        return super().label_transfer(ctx, public)

    # -- PrivImage+G -------------------------------------------------------------------------
    def fit_gan(self, ctx: RunContext, config: PrivImageConfig) -> None:
        """Pre-train the GAN on the subset, then DP-GAN (:func:`dpsynth.methods.families.gan.train_dp_gan`)."""
        from dpsynth.models.gan import GANPretrainSettings, pretrain_gan, transfer_gan

        gan = config.gan
        spec = gan_spec(ctx, gan, self.name)
        generator_net, discriminator = build_gan(ctx, spec)
        subset = self._subset
        pre_g, pre_d = pretrain_gan(
            subset,
            dataclasses.replace(spec, num_classes=subset.num_classes),
            GANPretrainSettings(gan.pretrain_steps, gan.pretrain_batch_size, gan.pretrain_lr, tuple(gan.betas)),
            seed=ctx.seed,
            public_spec=self._subset_key,
            device=ctx.device,
            use_cache=gan.cache,
            log=ctx.log,
        )
        transfer_gan(pre_g.cpu(), generator_net)
        transfer_gan(pre_d.cpu(), discriminator)
        self._generator = train_dp_gan(
            ctx, gan, spec, generator_net, discriminator, mechanism=GAN_MECHANISM, desc="privimage+G discriminator"
        )

    def generate(self, ctx: RunContext, num: int) -> Samples:
        if ctx.section.generator == "diffusion":
            return super().generate(ctx, num)
        if self._generator is None:
            self._generator = load_generator(ctx, self.name)
        images, labels = sample_generator(
            self._generator, num, ctx.num_classes, seed=stream_seed(ctx.seed, "sampling"), device=ctx.device
        )
        return Samples(images=images, labels=labels)
