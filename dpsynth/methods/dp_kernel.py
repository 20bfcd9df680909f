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

The loop (a release, then a generator step; checkpoints, resume at the ledger's release count, the released
generator, sampling) is the mean-embedding skeleton's per-step mode
(:class:`~dpsynth.methods.families.mean_embedding.MeanEmbeddingMethod`, ``release_every_step``); this module
states the section, the Poisson query, the public bandwidths and the generator choice.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from dpsynth.contract import RunConfig, RunContext, register_method
from dpsynth.errors import ConfigError
from dpsynth.kernels import MomentMatchingSettings, RandomFourierFeatures
from dpsynth.kernels.bandwidths import RandomFeatureSection
from dpsynth.kernels.feature_map import FeatureMap
from dpsynth.methods.families.mean_embedding import GENERATOR_INIT, MeanEmbeddingMethod, random_fourier_map
from dpsynth.models.gan import ConditionalGenerator
from dpsynth.models.merf_generator import build_merf_generator
from dpsynth.privacy.bounded_sum import BoundedSum
from dpsynth.seeding import stream_seed

#: the ledger name of the per-step embedding release (one SubsampledGaussian entry, T repeats)
MECHANISM = "dp-kernel-embedding"


class DPKernelSection(RandomFeatureSection):
    """The ``dp-kernel`` section: the per-step release, the kernel's random features and their public length-scale
    rule (:class:`dpsynth.kernels.bandwidths.RandomFeatureSection`, shared with dp-merf), the generator and its
    optimiser."""

    batch_size: int = Field(
        60, ge=1, description="expected Poisson batch size B of every release; q = B/N (DPImageBench: 60)"
    )
    steps: int = Field(3000, ge=1, description="T: releases, one generator step each (DPImageBench: 200,002)")
    noise_multiplier: float | None = Field(
        None, gt=0, description="sigma of every release (noise std sigma x sensitivity 1); null = calibrated to eps"
    )
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

    def training(self, seed: int) -> MomentMatchingSettings:
        """The generator's optimisation settings (public), latents and labels from ``seed``."""
        return MomentMatchingSettings(
            steps=self.steps,
            batch_size=self.gen_batch_size,
            lr=self.lr,
            lr_decay=self.lr_decay,
            decay_every=self.decay_every,
            seed=seed,
            optimizer=self.optimizer,
        )

    @model_validator(mode="after")
    def _check(self) -> DPKernelSection:
        if min(self.conv_channels) < 1:
            raise ValueError(f"conv_channels must be >= 1, got {list(self.conv_channels)}")
        return self


@register_method
class DPKernel(MeanEmbeddingMethod):
    name = "dp-kernel"
    summary = (
        "MMD generator against a multi-bandwidth kernel mean embedding (random features) re-released with "
        "Gaussian noise on every Poisson minibatch, composed over steps (sound version)"
    )
    paper = "Jiang, Sun, Yu, Functional Renyi Differential Privacy for Generative Modeling, NeurIPS 2023"
    config_schema = DPKernelSection
    mechanism_name = MECHANISM
    release_every_step = True
    samples_stream = 2  # the samples' stream it has always used (dp-merf and dp-ntk: 0)
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

    @classmethod
    def release_public_use(cls, config: RunConfig) -> Literal["none", "optional", "required"]:
        """Public points set the kernel's length scales under ``bandwidth_rule: public-median`` only."""
        return config.section.public_use()

    @classmethod
    def query(cls, section: Any, sigma: float, num_classes: int, num_examples: int, dim: int) -> BoundedSum:
        """The declared per-step release: unit-norm features summed per class over a Poisson sample at q = B/N,
        noise std sigma x sensitivity, divided by the public expected class size qN/K (or by noisy counts)."""
        if not 0 < section.batch_size <= num_examples:
            raise ConfigError(
                f"dp-kernel.batch_size must be in [1, {num_examples}] (the private train size), "
                f"got {section.batch_size}"
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

    @classmethod
    def running_target(cls, section: Any) -> bool:
        return section.target == "running_mean"

    def feature_map(self, ctx: RunContext) -> FeatureMap:
        """Random Fourier features of a mix of public length scales, ``W`` from the public ``model-init`` stream."""
        ctx.log(f"dp-kernel: target={ctx.section.target}")
        return random_fourier_map(ctx, self.name)

    def build_generator(self, ctx: RunContext) -> torch.nn.Module:
        """DP-MERF's generator or the GroupNorm DCGAN one, initialised from a public seed (the global RNG is left
        as it was)."""
        section: DPKernelSection = ctx.section
        channels, side, _ = ctx.image_shape
        seed = stream_seed(ctx.seed, "model-init", GENERATOR_INIT)
        if section.generator == "merf":
            sizes = {"z_dim": section.z_dim, "hidden": section.width, "conv_channels": tuple(section.conv_channels)}
            return build_merf_generator(ctx.num_classes, channels, side, seed, **sizes)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            return ConditionalGenerator(ctx.num_classes, channels, side, z_dim=section.z_dim, width=section.width)
