"""``dp-kernel``: a conditional generator trained by MMD against a kernel mean embedding re-released every step.

Paper: Jiang, Sun, Yu, "Functional Renyi Differential Privacy for Generative Modeling", NeurIPS 2023
(OpenReview GzlDKZlwie); code dihjiang/DP-kernel; DPImageBench ``models/dp_kernel.py``
(DPImageBench, arXiv:2503.14681). The paper releases, at every step, the kernel mean embedding of a
Poisson minibatch plus a scaled Gaussian process, and composes the steps like DP-SGD.

**Why the published code is not private.** DPImageBench (and, as far as seen, the original code) draws
the process at the generated points Y and adds it as a *constant*: the loss is
``mean K_YY - 2 mean (f_X(Y) + e) + c``, so its gradient in the generator is the gradient of the
*noiseless* private embedding ``f_X`` at Y. Every step hands the generator the exact private gradient;
no ε holds. The other defects (the private batch's labels drive the generator, a bare ``except``
releases the noiseless statistic when sampling fails, the std multiplier passed as a covariance
scale, fixed-size shuffled batches accounted as Poisson) are listed in :attr:`DPKernel.privacy_notes`.

**What dpsynth releases: the finite-feature version.** The kernel is a mix of Gaussian kernels,
approximated by unit-norm random Fourier features ``phi`` with a mix of public bandwidths
(:class:`~dpsynth.kernels.rff.RandomFourierFeatures`, W from a public seed), so the kernel mean
embedding is a finite vector. Every step t:

1. Poisson-sample the private set at rate q = B/N (coins from the run's DP noise source);
2. release ``S_c = sum_{i in batch, y_i = c} phi(x_i) + N(0, sigma^2 I)`` for every class c, divided by
   the declared public denominator qN/K (or, with ``count_weight``, by jointly released noisy counts):
   one Poisson-subsampled Gaussian with L2 sensitivity 1 under add/remove (rows have norm 1, classes
   are disjoint), :func:`~dpsynth.privacy.bounded_sum.release_subsampled_bounded_sum` with
   ``registered=True`` (the T steps are one ``SubsampledGaussian(sigma, q, T)`` ledger entry);
3. take one generator step on ``sum_c || mean_j phi(G(z_j, c)) - t_c ||^2`` where ``t`` is that release
   (``target: release``, the paper's per-step loss) or the mean of all releases so far
   (``target: running_mean``: post-processing of the same releases, each of which estimates the same
   full-data embedding). The generator's labels are uniform and public, its latents from a public seed.

The gradient is that of a function of released values only: the noise moves the generator (a test
fails if the update equals the update of the noiseless class means). The alternative of the spec, a
Gaussian process sampled jointly with its gradient at the M generated points, needs a Gaussian of
dimension M(d + 1) per step (47,100 for M = 60 MNIST images): a Cholesky factor of that size per step
is far off a CPU budget, and the process's gradient noise scales with the narrowest bandwidth just as
the random features' does. With random features the noise is an isotropic Gaussian of a fixed
dimension, the release is the shared bounded-sum mechanism, and no factorisation can fail.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from dpsynth.contract import Method, Phase, RunConfig, RunContext, Samples, register_method
from dpsynth.data.tensors import tensor_to_uint8
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.kernels import (
    MomentMatchingSettings,
    RandomFourierFeatures,
    bandwidth_ladder,
    feature_chunks,
    median_heuristic,
    train_moment_matching,
)
from dpsynth.models.gan import ConditionalGenerator, sample_conditional
from dpsynth.models.merf_generator import build_merf_generator
from dpsynth.privacy.bounded_sum import BoundedSum, BoundedSumRelease, release_subsampled_bounded_sum
from dpsynth.privacy.mechanisms import Mechanism
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.privacy.rng import NoiseSource
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import Section
from dpsynth.seeding import stream_seed

#: the ledger name of the per-step embedding release (one SubsampledGaussian entry, T repeats)
MECHANISM = "dp-kernel-embedding"
TRAIN_PHASE = "moment-matching"
FINAL_PHASE = "generator"
#: public points for the median heuristic when no public data is configured: uniform noise images
NOISE_POINTS = 1000


class DPKernelSection(Section):
    """The ``dp-kernel`` section: the per-step release, the kernel's features, the generator and its optimiser."""

    batch_size: int = Field(
        60, ge=1, description="expected Poisson batch size B of every release; q = B/N (DPImageBench: 60)"
    )
    steps: int = Field(3000, ge=1, description="T: releases, one generator step each (DPImageBench: 200,002)")
    noise_multiplier: float | None = Field(
        None, gt=0, description="sigma of every release (noise std sigma x sensitivity 1); null = calibrated to eps"
    )
    num_features: int = Field(
        10000, ge=2, description="D random Fourier features (even; split evenly over the bandwidths)"
    )
    bandwidths: list[float] | None = Field(
        None,
        min_length=1,
        description="fixed Gaussian length scales on [-1, 1] pixels (DPImageBench: [1, 2, 4, 8, 16]); "
        "null = a ladder around the median pairwise distance of public points (data.public, else noise images)",
    )
    bandwidth_count: int = Field(4, ge=1, description="length scales in the public ladder (bandwidths: null)")
    bandwidth_ratio: float = Field(2.0, gt=1, description="ratio between neighbouring scales of the ladder")
    target: Literal["release", "running_mean"] = Field(
        "release",
        description="what each generator step matches: this step's release (the paper's loss) or the mean of "
        "all releases so far (post-processing of the same releases)",
    )
    count_weight: float | None = Field(
        None,
        gt=0,
        description="w: release the class counts jointly (sensitivity sqrt(1 + w^2)) and divide by them; "
        "null = divide by the declared public qN/K",
    )
    generator: Literal["merf", "dcgan"] = Field(
        "merf",
        description="merf: DP-MERF's small FC+conv generator; dcgan: the GroupNorm DCGAN generator of models/gan.py",
    )
    z_dim: int = Field(10, ge=1, description="latent length (original DP-Kernel: 10; DPImageBench: 60)")
    width: int = Field(200, ge=1, description="merf: width of the first linear layer; dcgan: base channel width")
    conv_channels: tuple[int, int] = Field((16, 8), description="merf: channels of its two convolutions")
    gen_batch_size: int = Field(200, ge=1, description="generated images per step (public, uniform balanced labels)")
    optimizer: Literal["adam", "rmsprop"] = Field("adam", description="generator optimiser (DPImageBench: rmsprop)")
    lr: float = Field(1e-3, gt=0, description="generator learning rate (DPImageBench: 5e-5)")
    lr_decay: float = Field(1.0, gt=0, le=1, description="multiply the learning rate by this every decay_every steps")
    decay_every: int = Field(0, ge=0, description="steps between learning-rate decays; 0 = constant")
    checkpoint_every: int = Field(500, ge=1, description="steps between checkpoints (generator, optimiser, ledger)")

    @model_validator(mode="after")
    def _check(self) -> DPKernelSection:
        if self.num_features % 2:
            raise ValueError(f"num_features must be even, got {self.num_features}")
        scales = len(self.bandwidths) if self.bandwidths is not None else self.bandwidth_count
        if self.num_features // 2 < scales:
            raise ValueError(f"{self.num_features} features cannot cover {scales} bandwidths")
        if min(self.conv_channels) < 1:
            raise ValueError(f"conv_channels must be >= 1, got {list(self.conv_channels)}")
        if self.bandwidths is not None and not all(math.isfinite(v) and v > 0 for v in self.bandwidths):
            raise ValueError(f"bandwidths must be finite and > 0, got {self.bandwidths}")
        return self


def embedding_query(section: DPKernelSection, num_examples: int, num_classes: int, sigma: float) -> BoundedSum:
    """The declared per-step release: unit-norm features summed per class over a Poisson sample at q = B/N,
    noise std sigma x sensitivity, divided by the public expected class size qN/K (or by noisy counts)."""
    if not 0 < section.batch_size <= num_examples:
        raise ConfigError(
            f"dp-kernel.batch_size must be in [1, {num_examples}] (the private train size), got {section.batch_size}"
        )
    rate = section.batch_size / num_examples
    denominator = None
    if section.count_weight is None:
        denominator = tuple([rate * num_examples / num_classes] * num_classes)
    return BoundedSum(
        MECHANISM,
        bound=RandomFourierFeatures.bound,
        noise_multiplier=sigma,
        num_classes=num_classes,
        sample_rate=rate,
        denominator=denominator,
        count_weight=section.count_weight,
    )


def planned_mechanism(section: DPKernelSection, num_examples: int, sigma: float) -> Mechanism:
    """All T releases as one ledger entry, ``SubsampledGaussian(sigma, q, T)`` (a plain ``Gaussian`` when
    q = 1); the class count does not enter: the classes compose in parallel."""
    return embedding_query(section, num_examples, 1, sigma).mechanism(section.steps)


class EmbeddingReleases:
    """The per-step target of the generator: one registered subsampled release per call.

    ``self(step)`` charges one step of :data:`MECHANISM` (before reading anything), Poisson-samples the
    private set, sums the features of the sampled records per class, adds the noise and returns the
    released class means ``[K, D]`` -- or, with ``running``, the mean of every release so far. The running
    sums are released values (post-processing), so they may be checkpointed.
    """

    def __init__(
        self,
        feature_map: RandomFourierFeatures,
        images: torch.Tensor,
        labels: torch.Tensor,
        query: BoundedSum,
        ledger: Any,
        noise: NoiseSource,
        *,
        running: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        self.feature_map, self.images, self.labels = feature_map, images, labels
        self.query, self.ledger, self.noise, self.running, self.device = query, ledger, noise, running, device
        self.sums = torch.zeros(query.num_classes, feature_map.dim, dtype=torch.float64)
        self.counts = torch.zeros(query.num_classes, dtype=torch.float64)
        self.releases = 0
        self.last: BoundedSumRelease | None = None

    def _select(self, indices: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return feature_chunks(
            self.feature_map, self.images[indices], self.labels[indices], batch_size=512, device=self.device
        )

    def release(self) -> BoundedSumRelease:
        """One release (one ledger step), without updating the running mean."""
        return release_subsampled_bounded_sum(
            self._select, len(self.images), self.feature_map.dim, self.query, self.ledger, self.noise, registered=True
        )

    def __call__(self, step: int) -> torch.Tensor:
        release = self.release()
        self.last = release
        self.releases += 1
        self.sums += release.sums
        if release.counts is not None:
            self.counts += release.counts
        if not self.running:
            return release.means
        return self.running_means()

    def running_means(self) -> torch.Tensor:
        """The mean of all releases so far: summed noisy sums over R x the declared denominator, or over the
        summed noisy counts (clamped like one release's)."""
        if self.releases == 0:
            raise PrivacyError("no release yet")
        if self.query.count_weight is not None:
            return self.sums / self.counts.clamp(min=self.query.min_count * self.releases)[:, None]
        denominator = torch.tensor(self.query.denominator, dtype=torch.float64)[:, None]
        return self.sums / (self.releases * denominator)

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums.clone(), "counts": self.counts.clone(), "releases": self.releases}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums = state["sums"].clone()
        self.counts = state["counts"].clone()
        self.releases = int(state["releases"])


def build_generator(section: DPKernelSection, num_classes: int, channels: int, image_size: int, seed: int) -> Any:
    """The generator, initialised from a public seed (the global RNG is left as it was)."""
    if section.generator == "merf":
        return build_merf_generator(
            num_classes,
            channels,
            image_size,
            seed,
            z_dim=section.z_dim,
            hidden=section.width,
            conv_channels=tuple(section.conv_channels),
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return ConditionalGenerator(num_classes, channels, image_size, z_dim=section.z_dim, width=section.width)


def kernel_bandwidths(section: DPKernelSection, public: Any, image_shape: tuple[int, int, int], seed: int) -> tuple:
    """The length scales: the fixed list, or a ladder around the median pairwise distance of public points
    (the public images when given, else uniform noise images from a public seed); never private data."""
    if section.bandwidths is not None:
        return tuple(float(v) for v in section.bandwidths)
    if public is not None and len(public) >= 2:
        points, _ = public.to_tensors()
        if tuple(points.shape[1:]) != tuple(image_shape):
            raise ConfigError(
                f"dp-kernel: public images {tuple(points.shape[1:])} differ from the private shape {image_shape}"
            )
    else:
        generator = torch.Generator().manual_seed(int(seed))
        points = torch.rand(NOISE_POINTS, *image_shape, generator=generator) * 2 - 1
    base = median_heuristic(points, seed=seed)
    return bandwidth_ladder(base, section.bandwidth_count, section.bandwidth_ratio)


def moment_matching_settings(section: DPKernelSection, seed: int) -> MomentMatchingSettings:
    return MomentMatchingSettings(
        steps=section.steps,
        batch_size=section.gen_batch_size,
        lr=section.lr,
        lr_decay=section.lr_decay,
        decay_every=section.decay_every,
        seed=seed,
        optimizer=section.optimizer,
    )


def spent_steps(ledger: Any) -> int:
    """Releases of :data:`MECHANISM` the ledger has recorded (0 before the first)."""
    return sum(m.repeats for m in ledger.mechanisms() if m.name == MECHANISM)


@register_method
class DPKernel(Method):
    name = "dp-kernel"
    summary = (
        "MMD generator against a multi-bandwidth kernel mean embedding (random features) re-released with "
        "Gaussian noise on every Poisson minibatch, composed over steps (sound version)"
    )
    paper = "Jiang, Sun, Yu, Functional Renyi Differential Privacy for Generative Modeling, NeurIPS 2023"
    config_schema = DPKernelSection
    privacy_notes = (
        "dp-kernel: the generator is updated only through released values: each step releases the noisy "
        "per-class mean of unit-norm random Fourier features of a Poisson minibatch, and the generator's loss "
        "is its squared distance to that release. DPImageBench's code (models/dp_kernel.py) and, as far as seen, "
        "the original add the Gaussian-process noise as a constant at the generated points, so the generator "
        "follows the gradient of the noiseless private embedding: not private at any epsilon.",
        "dp-kernel: the generated labels are uniform and public; DPImageBench's get_gen_labels returns the "
        "private batch's labels (an unaccounted release of every batch's label histogram).",
        "dp-kernel: the noise is drawn from the run's DP noise source with the standard deviation sigma x "
        "sensitivity and is never skipped; DPImageBench passes the std multiplier as a covariance scale and "
        "releases the noiseless statistic when sampling fails (a bare except).",
        "dp-kernel: batches are Poisson samples (each record kept with probability q = B/N), as accounted; "
        "DPImageBench shuffles fixed-size batches and accounts them as Poisson. Adjacency is add/remove one "
        "record, sensitivity 1 (unit-norm features, disjoint classes), divided by the declared public "
        "expected class size qN/K or by jointly released noisy counts, never by a realised count.",
    )

    def __init__(self) -> None:
        self._generator: Any = None

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        public = "optional" if config.section.bandwidths is None else "none"
        return [
            Phase(
                TRAIN_PHASE,
                private=True,
                public=public,
                description="public points set the kernel's bandwidths (median heuristic)" if public != "none" else "",
            ),
            Phase("generate", private=False),
        ]

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """T Poisson-subsampled Gaussian releases at q = B/N, sigma calibrated to the target unless given."""
        section = config.section
        return plan_calibrated(
            config.privacy,
            (),
            lambda sigma: planned_mechanism(section, num_examples, sigma),
            noise_multiplier=section.noise_multiplier,
        )

    def fit(self, ctx: RunContext) -> None:
        section: DPKernelSection = ctx.section
        channels, side, _ = ctx.image_shape
        num_classes = ctx.num_classes
        generator = build_generator(section, num_classes, channels, side, stream_seed(ctx.seed, "model-init"))
        final = ctx.checkpoints.load(phase=FINAL_PHASE)
        if final is not None and spent_steps(ctx.ledger) == section.steps:
            generator.load_state_dict(final["generator"])
            self._generator = generator.eval()
            ctx.log("dp-kernel: already trained, nothing to resume")
            return

        train = ctx.data.train
        images, labels = train.to_tensors()
        num_examples = len(images)
        sigma = ctx.plan.noise_multiplier(MECHANISM)
        query = embedding_query(section, num_examples, num_classes, sigma)
        bandwidths = kernel_bandwidths(section, ctx.public, ctx.image_shape, stream_seed(ctx.seed, "model-init", 2))
        features = RandomFourierFeatures(
            channels * side * side,
            section.num_features,
            bandwidths,
            seed=stream_seed(ctx.seed, "model-init", 1),
            device=ctx.device,
        )
        releases = EmbeddingReleases(
            features,
            images,
            labels,
            query,
            ctx.ledger,
            ctx.noise_source(),
            running=section.target == "running_mean",
            device=ctx.device,
        )
        ctx.log(
            f"dp-kernel: {section.steps} releases, q={query.sample_rate:.4g}, sigma={sigma:.4f}, "
            f"{features.dim} random features, bandwidths {', '.join(f'{b:.3g}' for b in bandwidths)}, "
            f"target={section.target}, target eps={ctx.ledger.target_epsilon}"
        )

        start, resume = 0, None
        state = ctx.checkpoints.load(phase=TRAIN_PHASE)
        if state is not None:
            releases.load_state_dict(state["releases"])
            resume = state["trainer"]
            start = int(resume["step"])
        spent = spent_steps(ctx.ledger)
        if spent < start:
            raise PrivacyError(f"the ledger records {spent} releases but the checkpoint is at step {start}")
        if spent > start:
            # Steps released after the last checkpoint stay spent; they are not repeated.
            ctx.log(f"dp-kernel: {spent - start} release(s) after the last checkpoint were spent; continuing")
        if start or spent:
            ctx.log(f"resumed dp-kernel at release {spent} (generator from step {start})")
        ctx.curves.truncate_after(spent)

        def log_curve(step: int, loss: float) -> None:
            done = step + 1
            if done % section.checkpoint_every == 0 or done == section.steps or step == 0:
                # The loss is against the released target: a function of released values only.
                ctx.curves.log(done, epsilon=ctx.ledger.epsilon(), loss=loss)

        def checkpoint(trainer: dict[str, Any]) -> None:
            ctx.checkpoints.save({"trainer": trainer, "releases": releases.state_dict()}, phase=TRAIN_PHASE)

        train_moment_matching(
            generator,
            features,
            releases,
            moment_matching_settings(section, stream_seed(ctx.seed, "sampling", 1)),
            device=ctx.device,
            description="dp-kernel",
            resume=resume,
            start_step=spent,
            checkpoint_every=section.checkpoint_every,
            checkpoint=checkpoint,
            after_step=log_curve,
        )
        ctx.checkpoints.save({"generator": generator.state_dict()}, phase=FINAL_PHASE)
        self._generator = generator.eval()
        ctx.log(f"dp-kernel: done, eps spent {ctx.ledger.epsilon():.4f} of {ctx.ledger.target_epsilon}")

    def _released_generator(self, ctx: RunContext) -> Any:
        if self._generator is None:
            section: DPKernelSection = ctx.section
            channels, side, _ = ctx.image_shape
            generator = build_generator(section, ctx.num_classes, channels, side, stream_seed(ctx.seed, "model-init"))
            state = ctx.checkpoints.load(phase=FINAL_PHASE)
            if state is None:
                raise ConfigError("dp-kernel: the run has no trained generator (its training did not finish)")
            generator.load_state_dict(state["generator"])
            self._generator = generator.to(ctx.device).eval()
        return self._generator

    def generate(self, ctx: RunContext, num: int) -> Samples:
        """``num`` images with balanced public labels, from the released generator (no privacy cost)."""
        generator = self._released_generator(ctx)
        labels = torch.from_numpy(balanced_labels(num, ctx.num_classes))
        images = sample_conditional(
            generator,
            labels,
            seed=stream_seed(ctx.seed, "sampling", 2),
            batch_size=ctx.config.generate.batch_size,
            device=ctx.device,
        )
        return Samples(images=tensor_to_uint8(images), labels=labels.numpy().astype("int64"))
