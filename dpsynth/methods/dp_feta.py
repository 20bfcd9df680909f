"""DP-FETA: DP central images warm a diffusion model up ("easy"), then DP-SGD trains it on the private data ("hard").

Paper: Li, Gong, Li, Zhao, Hou & Wang, *From Easy to Hard: Building a Shortcut for Differentially Private
Image Synthesis*, IEEE S&P 2025, arXiv:2504.01395 (code: SunnierLee/DP-FETA; DPImageBench's
``data/dataset_loader.py`` ``CentralDataset`` and ``models/dpsgd_diffusion.py``).

1. **Central images** (§4.1): ``central.queries`` = R releases of the noisy class means of a Poisson sample of the
   downsampled private images (:mod:`dpsynth.privacy.downsampled_means`: bound B = sqrt(C·h·w), noise σ_c·B, the
   public denominator b/K); one ledger entry ``central-images`` = SubsampledGaussian(σ_c, q, R), resumed release by
   release (:meth:`RunContext.resume`). Post-processing as DP-FETA's code (:mod:`dpsynth.data.filters`): clamp,
   bilinear upsampling, a 3x3 median blur and, for grey images, a 3x3 sharpening.
2. **Warm-up** (§4.2): the class-conditional diffusion model is trained without privacy on the K·R central images,
   RandAugment-ed (:mod:`dpsynth.diffusion.augment`) so that a few dozen images are not simply memorised
   (:func:`dpsynth.diffusion.pretrain.warm_up`; post-processing of the release, no ledger entry).
3. **DP-SGD** (§4.3): DP-Adam on the private images from the warmed-up (EMA) weights, all parameters trainable,
   with noise multiplicity K, on the shared skeleton :class:`dpsynth.methods.families.diffusion.DiffusionMethod`.

Latent space (``space: latent``; pixel space, the paper's, is the default): the central images stay pixel statistics
(B is in pixel units); the warm-up RandAugments them in pixel space and encodes each augmented batch with the public
backbone (post-processing of the release); DP-Adam trains on the latents of the private images, each encoded on its
own (sensitivity unchanged), and samples are decoded by the public decoder (arXiv:2112.10752, arXiv:2305.15759).

The plan composes both mechanisms in one accountant: σ_c comes from the config (DPImageBench's split) and the
DP-SGD σ is calibrated so that the whole plan meets the target (:meth:`DPFETA.plan`). Differences from DP-FETA's
code: the class *sum* is noised and divided by a declared public count, not the realised one (privacy notes); the
diffusion model is dpsynth's DDPM UNet with the ε-prediction loss and mixture-of-uniform timesteps of Ghalebikesabi
et al. (arXiv:2302.13861) rather than NCSN++ with the EDM loss (docs/methods/dp-feta.md).
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from dpsynth.contract import Phase, RunConfig, RunContext, register_method
from dpsynth.data.filters import upsample_to_uint8
from dpsynth.diffusion.augment import rand_augmenter
from dpsynth.diffusion.generation import DiffusionModelSpec
from dpsynth.diffusion.pretrain import warm_up
from dpsynth.diffusion.public import backbone_phases, encode_on_backbone
from dpsynth.diffusion.section import DiffusionSection, LatentSpaceSection, WarmupSection, warmup_settings
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods.families.diffusion import MECHANISM, DiffusionMethod
from dpsynth.privacy.accountants import compute_epsilon
from dpsynth.privacy.bounded_sum import BoundedSum
from dpsynth.privacy.downsampled_means import (
    downsampled_mean_query,
    downsampled_size,
    mean_noise_std,
    release_downsampled_means,
)
from dpsynth.privacy.plan import PrivacyPlan
from dpsynth.rundir import FIGURES_DIR
from dpsynth.schema import Section, with_defaults

#: the ledger name of the central-image release (all its repeats), and the phases of the run
CENTRAL = "central-images"
WARMUP_PHASE = "warm-up"


class CentralImagesSection(Section):
    """The central-image release (§4.1; DPImageBench ``configs/DP-FETA/mnist_28_eps*.yaml``, MNIST values)."""

    queries: int = Field(5, ge=1, description="R (sample_num): Poisson-subsampled releases, K central images each")
    batch_size: int = Field(6000, ge=1, description="expected Poisson sample b of every release; sample rate q = b / N")
    noise_multiplier: float = Field(
        5.0, gt=0, description="sigma_c: noise std sigma_c * B on every class-sum pixel, B = sqrt(C*h*w)"
    )
    downsample: float = Field(
        0.5, gt=0, le=1, description="ds: nearest-neighbour downsampling of each image before the sum (28 -> 14)"
    )
    count_weight: float | None = Field(
        None,
        gt=0,
        description="null: divide the noisy sums by the public expected class count b/K; w: release the class "
        "counts jointly (sensitivity sqrt(B^2 + w^2)) and divide by them",
    )
    post_process: bool = Field(
        True, description="3x3 median blur, then (grey images) 3x3 sharpening, as DP-FETA's code (free)"
    )


_DPFETADefaults = with_defaults(
    DiffusionSection,
    "DPFETADefaults",
    "DP-FETA's hard stage (DPImageBench configs/DP-FETA/mnist_28_eps*.yaml).",
    model="4m",  # DPImageBench: NCSN++ of ~3.8M parameters; the closest dpsynth UNet preset
    learn_sigma=False,
    loss="simple",  # ε-prediction loss (dpsynth has no EDM loss; docs/methods/dp-feta.md)
    noise_schedule="linear",
    timestep_weights=[0.015, 0.785, 0.2],  # Ghalebikesabi et al. Table 3 (the DDPM counterpart of EDM's P_mean)
    timestep_boundaries=[0, 30, 600, 1000],
    multiplicity=32,  # DPImageBench: noise multiplicity 32
    batch_size=4096,  # DPImageBench: 4,096 (Poisson)
    physical_batch_size=16,
    epochs=150.0,  # DPImageBench: 150 epochs
    lr=0.0003,  # DPImageBench: Adam 3e-4
    clip_norm=0.001,  # DPImageBench: 1e-3
    ema_decay=0.999,  # DPImageBench: 0.999
)


class DPFETAConfig(_DPFETADefaults, LatentSpaceSection):  # type: ignore[misc, valid-type]
    """The ``dp-feta`` section: DP-SGD diffusion keys (hard stage, with ``space``) plus ``central`` and ``warmup``."""

    central: CentralImagesSection = Field(
        default_factory=CentralImagesSection, description="the DP central-image release (easy stage data)"
    )
    warmup: WarmupSection = Field(
        default_factory=WarmupSection, description="non-private warm-up on the augmented central images"
    )


def central_query(
    section: DPFETAConfig, num_examples: int, image_shape: tuple[int, int, int] = (1, 1, 1), num_classes: int = 1
) -> BoundedSum:
    """The declared central-image release of images of ``image_shape`` (the plan needs only its σ_c and q = b / N,
    which neither the shape nor K changes)."""
    central = section.central
    return downsampled_mean_query(
        CENTRAL,
        image_shape,
        central.downsample,
        central.noise_multiplier,
        num_classes=num_classes,
        batch_size=central.batch_size,
        num_records=num_examples,
        count_weight=central.count_weight,
        key="dp-feta.central",
    )


@register_method
class DPFETA(DiffusionMethod):
    name = "dp-feta"
    summary = (
        "DP central images (noisy class sums over Poisson samples) warm a diffusion model up on RandAugment-ed "
        "copies, then DP-Adam trains it on the private data"
    )
    paper = (
        "Li et al., From Easy to Hard: Building a Shortcut for Differentially Private Image Synthesis, "
        "IEEE S&P 2025, arXiv:2504.01395"
    )
    config_schema = DPFETAConfig
    privacy_notes = (
        (
            "dp-feta: each central image is the noisy class SUM of the Poisson sample divided by the public "
            "expected class count b/K (or by noisy counts released with it), with noise std sigma_c * sqrt(C*h*w), "
            "the largest norm of one downsampled image: one record moves one class sum by at most that bound. "
            "DP-FETA's and DPImageBench's code scale the noise to the expected count b/K but divide by the "
            "realised count of the sample, so rare classes and downward fluctuations get less noise than "
            "claimed and an empty class gives NaN; here an empty class is noise over b/K (finite)."
        ),
        (
            "dp-feta: the central-image noise and the Poisson samples come from the run's noise source; the "
            "reference code fixes its seeds (set_seeds(rank, 0), Opacus secure_mode off), which makes them "
            "replayable."
        ),
        (
            "dp-feta: the central images and the DP-SGD steps are composed in one accountant; the warm-up on the "
            "central images is post-processing and costs nothing."
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._central: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        return [
            Phase(CENTRAL, private=True, description="noisy class sums of Poisson samples at reduced resolution"),
            *backbone_phases(config),  # space latent: built after the release, encodes the warm-up batches
            Phase(WARMUP_PHASE, private=False, description="non-private training on RandAugment-ed central images"),
            Phase(MECHANISM, private=True, description="DP-Adam on the private images from the warmed-up weights"),
            Phase("generate", private=False),
        ]

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """``central-images`` (σ_c from the config, R repeats at q = b/N) plus DP-Adam, whose σ is calibrated so the
        composition meets the target (DPImageBench's split: the release is fixed, DP-SGD gets the rest)."""
        section = config.section
        training = section.private_training()
        training.check_batch(num_examples, self.name)
        central = central_query(section, num_examples).mechanism(section.central.queries)
        alone = compute_epsilon([central], config.privacy.delta, accountant=config.privacy.accountant)
        if alone >= config.privacy.epsilon:
            raise PrivacyError(
                f"the central-image release alone spends eps={alone:.3f} of the target {config.privacy.epsilon}; "
                f"raise {self.name}.central.noise_multiplier or lower central.queries or central.batch_size"
            )
        return training.plan(config.privacy, num_examples, name=MECHANISM, key=self.name, fixed=(central,))

    def fit(self, ctx: RunContext) -> None:
        from dpsynth.dpsgd import distributed

        if distributed.world_size() > 1:
            raise ConfigError("dp-feta's central-image release runs in one process; run it without torchrun")
        self._central = self.release_central_images(ctx)
        super().fit(ctx)

    def release_central_images(self, ctx: RunContext) -> tuple[np.ndarray, np.ndarray]:
        """The central images (uint8 ``[R*K, H, W, C]``) and their labels, checkpointed release by release.

        Each release is charged before it reads anything; a release charged but not checkpointed (a run killed in
        between) stays spent and is not repeated (:meth:`RunContext.resume`), so the run still ends on its plan.
        """
        central, train = ctx.section.central, ctx.data.train
        channels, height, width = ctx.image_shape
        size = downsampled_size(height, width, central.downsample)
        query = central_query(ctx.section, len(train), ctx.image_shape, ctx.num_classes)
        if query.noise_multiplier != ctx.plan.noise_multiplier(CENTRAL):
            raise PrivacyError("the central-image sigma differs from the plan's")
        start, saved = ctx.resume(CENTRAL, CENTRAL, curves=False)  # DP-Adam's curves come later
        images, labels = (list(saved["images"]), list(saved["labels"])) if saved else ([], [])
        noise = ctx.noise_source()
        for step in range(start, central.queries):
            release = release_downsampled_means(train.images, train.labels, query, size, ctx.ledger, noise)
            images.append(upsample_to_uint8(release.means, channels, size, (height, width), central.post_process))
            labels.append(np.arange(ctx.num_classes, dtype=np.int64))
            ctx.checkpoints.save({"step": step + 1, "images": images, "labels": labels}, phase=CENTRAL)
        ctx.log(
            f"central images: {len(images)} releases of {ctx.num_classes} images at {size[0]}x{size[1]}, "
            f"q={query.sample_rate:.4g}, sigma_c={query.noise_multiplier}, noise std per pixel of the means "
            f"{mean_noise_std(query):.3g}"
        )
        released = np.concatenate([np.zeros((0, height, width, channels), np.uint8), *images])
        released_labels = np.concatenate([np.zeros(0, np.int64), *labels])
        if images:  # figures/central-images.png: the released central images (a DP release), one row per class
            from dpsynth.report.grids import save_class_grid

            figure = ctx.run_dir / FIGURES_DIR / "central-images.png"
            save_class_grid(released, released_labels, figure, ctx.num_classes, per_class=len(images))
        return released, released_labels

    def initial_model(self, ctx: RunContext, spec: DiffusionModelSpec) -> torch.nn.Module:
        """The model warmed up (without privacy) on the RandAugment-ed central images (EMA weights); in latent
        space each augmented batch is encoded by the public backbone. Random when every release was lost."""
        model = super().initial_model(ctx, spec)
        if self._central is None or len(self._central[0]) == 0:
            ctx.log("warm-up: no central image survived a resume; DP-Adam starts from the random model")
            return model
        warmup, backbone = ctx.section.warmup, self._backbone  # the backbone: latent space only
        encode = None if backbone is None else (lambda pixels: encode_on_backbone(backbone, pixels))
        augment = rand_augmenter(warmup.augment_ops, warmup.min_magnitude, warmup.max_magnitude, encode)
        return warm_up(
            ctx, model, *self._central, spec, warmup_settings(ctx.section), phase=WARMUP_PHASE, augment=augment
        )
