"""DP-FETA: DP central images warm a diffusion model up ("easy"), then DP-SGD trains it on the private data ("hard").

Paper: Li, Gong, Li, Zhao, Hou & Wang, *From Easy to Hard: Building a Shortcut for Differentially Private
Image Synthesis*, IEEE S&P 2025, arXiv:2504.01395 (code: SunnierLee/DP-FETA; DPImageBench's
``data/dataset_loader.py`` ``CentralDataset`` and ``models/dpsgd_diffusion.py``).

1. **Central images** (§4.1): ``central.queries`` times, a Poisson sample of the private set at rate
   q = ``central.batch_size`` / N; for each class c the *sum* of the sample's class-c images, each
   downsampled by ``central.downsample`` (nearest neighbour, 28 -> 14) and flattened, plus Gaussian
   noise of std σ_c·B with B = sqrt(C·h·w), the largest L2 norm of a downsampled image with pixels in
   [0, 1]; then divided by the *public* expected class count b/K (or, with ``central.count_weight``, by
   the class counts released jointly). One release is one Poisson-subsampled Gaussian mechanism
   (classes are disjoint: one record moves one class sum by at most B); the R releases are one ledger
   entry ``central-images`` = SubsampledGaussian(σ_c, q, R), through the shared bounded-sum release
   (:mod:`dpsynth.privacy.bounded_sum`). Post-processing, as DP-FETA's code: clamp to [0, 1],
   bilinear upsampling to the full size, a 3x3 median blur and, for grey images, a 3x3 sharpening.
2. **Warm-up** (§4.2): the class-conditional diffusion model is trained without privacy on the K·R
   central images, each batch RandAugment-ed (2 operations, magnitude 1..9;
   :mod:`dpsynth.diffusion.augment`) so that a few dozen images do not simply get memorised. The
   central images are a DP release, so this is post-processing: no ledger entry.
3. **DP-SGD** (§4.3): DP-Adam on the private images from the warmed-up (EMA) weights, all parameters
   trainable, with noise multiplicity K copies per example, on the shared skeleton
   :class:`dpsynth.methods.families.diffusion.DiffusionMethod` (the one private loop, ``train_private``).

Latent space (``space: latent``; pixel space, the paper's, is the default): the central images stay pixel
statistics (the bound B of a record's contribution is in pixel units, and the release is unchanged); the warm-up
RandAugments them in pixel space and encodes each augmented batch with the public backbone (the run's
``backbone`` section, trained on ``data.public`` and cached; docs/backbone.md), which is post-processing of the
release; the hard stage DP-Adams the UNet on the latents of the private images, each encoded on its own inside
the batch builder (sensitivity unchanged), and samples are decoded by the public decoder. As in latent diffusion
(arXiv:2112.10752) and DP-LDM (arXiv:2305.15759).

The plan composes both mechanisms in one accountant: σ_c comes from the config (DPImageBench's split:
σ_c = 5 fixed, the release costs what it costs) and the DP-SGD σ is calibrated so that the whole plan
meets the target (:meth:`DPFETA.plan`).

Differences from DP-FETA's code: the class *sum* is noised and divided by a declared public count, not
the realised one (privacy notes below); the diffusion model is dpsynth's DDPM UNet with the ε-prediction
loss and mixture-of-uniform timesteps of Ghalebikesabi et al. (arXiv:2302.13861) rather than NCSN++ with
the EDM loss (docs/methods/dp-feta.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from pydantic import Field

from dpsynth.contract import Phase, RunConfig, RunContext, register_method
from dpsynth.data.tensors import uint8_to_tensor
from dpsynth.diffusion.augment import MAX_MAGNITUDE, rand_augment
from dpsynth.diffusion.generation import DiffusionModelSpec, build_diffusion_model
from dpsynth.diffusion.pretrain import PretrainSettings, Snapshots, train_diffusion
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods.families.diffusion import (
    MECHANISM,
    DiffusionMethod,
    DiffusionSection,
    LatentSpaceSection,
    backbone_phases,
    encode_on_backbone,
)
from dpsynth.privacy.accountants import compute_epsilon
from dpsynth.privacy.bounded_sum import (
    BoundedSum,
    BoundedSumRelease,
    release_bounded_sum,
    release_subsampled_bounded_sum,
)
from dpsynth.privacy.plan import PrivacyPlan
from dpsynth.schema import Section, with_defaults
from dpsynth.seeding import stream_seed

#: the ledger name of the central-image release (all its repeats), and the phases of the run
CENTRAL = "central-images"
WARMUP_PHASE = "warm-up"
#: private records per chunk of the central-image sums (memory only)
CHUNK = 1024
# DP-FETA's post-processing of a grey central image: cv2.filter2D with this kernel after a 3x3 median blur.
SHARPEN = ((0.0, -1.0, 0.0), (-1.0, 5.0, -1.0), (0.0, -1.0, 0.0))


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


class WarmupSection(Section):
    """The non-private warm-up on augmented central images (§4.2; DPImageBench: 2,000 epochs of the 50 images)."""

    steps: int = Field(2000, ge=1, description="Adam steps on the central images (DPImageBench: 2,000 epochs, 1 batch)")
    batch_size: int = Field(50, ge=1, description="central images per step, drawn with replacement")
    lr: float = Field(3e-4, gt=0, description="Adam learning rate")
    lr_warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up from 0")
    ema_decay: float = Field(0.999, gt=0, lt=1, description="EMA of the warm-up weights; DP-SGD starts from the EMA")
    augment_ops: int = Field(2, ge=0, description="RandAugment operations per image (0: no augmentation)")
    min_magnitude: int = Field(1, ge=0, le=MAX_MAGNITUDE, description="smallest RandAugment magnitude (of 10)")
    max_magnitude: int = Field(9, ge=0, le=MAX_MAGNITUDE, description="largest RandAugment magnitude (of 10)")
    checkpoint_every: int = Field(500, ge=1, description="steps between resumable warm-up snapshots")

    @pydantic.model_validator(mode="after")
    def _magnitudes_ordered(self) -> WarmupSection:
        if self.min_magnitude > self.max_magnitude:
            raise ValueError("warmup.min_magnitude must not exceed warmup.max_magnitude")
        return self


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


def central_query(section: DPFETAConfig, num_examples: int, num_classes: int = 1, bound: float = 1.0) -> BoundedSum:
    """The declared central-image release: bound B, σ_c, rate q = b / N and the public denominator b / K.

    The plan needs only its mechanism (σ_c, q), which neither the bound nor K changes.
    """
    central = section.central
    if not 0 < central.batch_size <= num_examples:
        raise ConfigError(
            f"dp-feta.central.batch_size must be in [1, {num_examples}] (the private train size), "
            f"got {central.batch_size}"
        )
    return BoundedSum(
        CENTRAL,
        bound,
        central.noise_multiplier,
        num_classes=num_classes,
        sample_rate=min(1.0, central.batch_size / num_examples),
        denominator=None if central.count_weight is not None else central.batch_size / num_classes,
        count_weight=central.count_weight,
    )


def downsampled_size(height: int, width: int, factor: float) -> tuple[int, int]:
    """(h, w) of an image downsampled by ``factor`` (at least one pixel each)."""
    return max(1, math.floor(height * factor)), max(1, math.floor(width * factor))


def central_features(images: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``[n, H, W, C]`` -> ``[n, C*h*w]`` float64 in [0, 1], nearest-neighbour downsampled to ``size``."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).to(torch.float64) / 255.0
    return F.interpolate(x, size=size, mode="nearest").flatten(1)


def central_images(
    release: BoundedSumRelease,
    channels: int,
    size: tuple[int, int],
    image_size: tuple[int, int],
    post_process: bool = True,
) -> np.ndarray:
    """The K released means as uint8 ``[K, H, W, C]`` images (post-processing only).

    As DP-FETA's code: clamp to [0, 1], bilinear upsampling to the full size, 8-bit; then a 3x3 median
    blur (edges replicated) and, for grey images, the 3x3 sharpening kernel (edges reflected), saturated
    to [0, 255].
    """
    means = release.means.reshape(-1, channels, *size).clamp(0.0, 1.0).to(torch.float32)
    upsampled = F.interpolate(means, size=image_size, mode="bilinear", align_corners=False)
    pixels = torch.floor(upsampled * 255.0).clamp(0, 255)
    if post_process:
        pixels = median_blur3(pixels)
        if channels == 1:
            kernel = torch.tensor(SHARPEN, dtype=pixels.dtype).reshape(1, 1, 3, 3)
            pixels = torch.round(F.conv2d(F.pad(pixels, (1, 1, 1, 1), mode="reflect"), kernel)).clamp(0, 255)
    return pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def median_blur3(pixels: torch.Tensor) -> torch.Tensor:
    """3x3 median of every channel of ``[n, C, H, W]``, edges replicated (cv2.medianBlur with ksize 3)."""
    n, channels, height, width = pixels.shape
    padded = F.pad(pixels, (1, 1, 1, 1), mode="replicate")
    windows = F.unfold(padded.reshape(n * channels, 1, height + 2, width + 2), kernel_size=3)
    return windows.median(dim=1).values.reshape(n, channels, height, width)


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

    # -- declared before any data is read ------------------------------------------------------
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

    # -- the easy stage ------------------------------------------------------------------------
    def fit(self, ctx: RunContext) -> None:
        from dpsynth.dpsgd import distributed

        if distributed.world_size() > 1:
            raise ConfigError("dp-feta's central-image release runs in one process; run it without torchrun")
        self._central = self.release_central_images(ctx)
        super().fit(ctx)

    def release_central_images(self, ctx: RunContext) -> tuple[np.ndarray, np.ndarray]:
        """The R·K central images (uint8 ``[R*K, H, W, C]``) and their labels; resumes query by query.

        Each release is charged before it reads anything (:mod:`dpsynth.privacy.bounded_sum`) and its images
        are checkpointed at once, so a resumed run never releases (or charges) a query twice.
        """
        section = ctx.section.central
        train = ctx.data.train
        channels, height, width = ctx.image_shape
        num_classes, num_records = ctx.num_classes, len(train)
        size = downsampled_size(height, width, section.downsample)
        query = central_query(ctx.section, num_records, num_classes, bound=math.sqrt(channels * size[0] * size[1]))
        if query.noise_multiplier != ctx.plan.noise_multiplier(CENTRAL):
            raise PrivacyError("the central-image sigma differs from the plan's")
        saved = ctx.checkpoints.load(phase=CENTRAL) or {"images": [], "labels": [], "queries": 0}
        images, labels, done = list(saved["images"]), list(saved["labels"]), int(saved["queries"])
        charged = sum(m.repeats for m in ctx.ledger.mechanisms() if m.name == CENTRAL)
        if charged != done:
            raise PrivacyError(
                f"the ledger holds {charged} central-image releases but the checkpoint {done}: a release was "
                "charged and lost, so this run cannot end on its plan; start a new run"
            )
        if done:
            ctx.log(f"central images: resumed after {done} of {section.queries} releases (already charged)")
        noise = ctx.noise_source()
        dim = channels * size[0] * size[1]

        def chunks(indices: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for chunk in indices.split(CHUNK):
                rows = chunk.numpy()
                yield central_features(train.images[rows], size), torch.from_numpy(train.labels[rows])

        for release_index in range(done, section.queries):
            if query.sample_rate < 1.0:
                release = release_subsampled_bounded_sum(chunks, num_records, dim, query, ctx.ledger, noise)
            else:
                release = release_bounded_sum(chunks(torch.arange(num_records)), dim, query, ctx.ledger, noise)
            images.append(central_images(release, channels, size, (height, width), section.post_process))
            labels.append(np.arange(num_classes, dtype=np.int64))
            ctx.checkpoints.save({"images": images, "labels": labels, "queries": release_index + 1}, phase=CENTRAL)
        released, released_labels = np.concatenate(images), np.concatenate(labels)
        ctx.log(
            f"central images: {section.queries} releases of {num_classes} images at {size[0]}x{size[1]}, "
            f"q={query.sample_rate:.4g}, sigma_c={query.noise_multiplier}, noise std per pixel of the means "
            f"{_mean_noise_std(query):.3g}"
        )
        self._write_figure(ctx, released, released_labels, num_classes, section.queries)
        return released, released_labels

    @staticmethod
    def _write_figure(
        ctx: RunContext, images: np.ndarray, labels: np.ndarray, num_classes: int, per_class: int
    ) -> None:
        """figures/central-images.png: the released central images (a DP release, one row per class)."""
        from dpsynth.report.grids import save_class_grid
        from dpsynth.rundir import FIGURES_DIR

        directory = ctx.run_dir / FIGURES_DIR
        directory.mkdir(parents=True, exist_ok=True)
        save_class_grid(images, labels, directory / "central-images.png", num_classes=num_classes, per_class=per_class)

    # -- the warm-up: the DP-SGD skeleton's initial model ---------------------------------------
    def initial_model(self, ctx: RunContext, spec: DiffusionModelSpec) -> torch.nn.Module:
        """The diffusion model warmed up (without privacy) on the RandAugment-ed central images; EMA weights.

        In latent space each augmented batch of central images (pixels) is encoded by the public backbone: the model
        warms up on the latents of a DP release, which is post-processing."""
        torch.manual_seed(stream_seed(ctx.seed, "model-init"))
        model = build_diffusion_model(spec)
        saved = ctx.checkpoints.load(phase=WARMUP_PHASE)
        if saved is not None and saved.get("done"):
            model.load_state_dict(saved["ema"])
            ctx.log("warm-up: finished earlier, weights restored from the checkpoint")
            return model
        if self._central is None:
            raise ConfigError("dp-feta: the central images must be released before the warm-up")
        images, labels = self._central
        section = ctx.section
        warmup = section.warmup
        backbone = self._backbone  # loaded by DiffusionMethod.fit before the initial model (latent space only)

        def augment(x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
            unit = (x0 + 1.0) / 2.0
            augmented = rand_augment(
                unit,
                generator,
                num_ops=warmup.augment_ops,
                min_magnitude=warmup.min_magnitude,
                max_magnitude=warmup.max_magnitude,
            )
            pixels = augmented * 2.0 - 1.0
            return pixels if backbone is None else encode_on_backbone(backbone, pixels)

        settings = PretrainSettings(
            steps=warmup.steps,
            batch_size=warmup.batch_size,
            lr=warmup.lr,
            warmup_steps=warmup.lr_warmup_steps,
            ema_decay=warmup.ema_decay,
            label_dropout=section.label_dropout,
            loss=section.loss,
            vlb_weight=section.vlb_weight,
            timestep_sampler={
                "kind": "mixture",
                "weights": list(section.timestep_weights),
                "boundaries": list(section.timestep_boundaries),
            },
            checkpoint_every=warmup.checkpoint_every,
        )
        snapshots = Snapshots(
            save=lambda state: ctx.checkpoints.save(state, phase=WARMUP_PHASE),
            load=lambda: ctx.checkpoints.load(phase=WARMUP_PHASE),
        )
        ema = train_diffusion(
            model,
            uint8_to_tensor(images),
            torch.from_numpy(labels),
            spec,
            settings,
            ctx.rng("augmentation"),
            device=ctx.device,
            log=ctx.log,
            augment=augment,
            snapshots=snapshots,
            desc="warm-up",
        )
        model.load_state_dict(ema.state_dict())
        ctx.checkpoints.save({"done": True, "ema": model.state_dict()}, phase=WARMUP_PHASE)
        ctx.log(f"warm-up: {warmup.steps} steps on {len(images)} central images (RandAugment, no privacy cost)")
        return model


def _mean_noise_std(query: BoundedSum) -> float:
    """The noise std of one central-image pixel before clamping: σ_c·B over the declared denominator (NaN when the
    means are divided by noisy counts instead)."""
    if not isinstance(query.denominator, float):
        return float("nan")
    return query.noise_std / query.denominator
