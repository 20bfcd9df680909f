"""The shared skeleton of the mean-embedding methods: noisy releases of class-wise feature sums, and a
conditional generator fitted to them by moment matching.

DP-MERF (Harder et al., AISTATS 2021, arXiv:2002.11603, Algorithm 1) and DP-NTK (Yang et al.,
arXiv:2303.01687, §3) differ only in the feature map ``phi`` (random Fourier features, or the normalised
e-NTK of a fixed random network); DP-Kernel (Jiang, Sun, Yu, NeurIPS 2023, in its finite-feature form) in
releasing the embedding of a fresh Poisson minibatch before every generator step instead of once
(:attr:`MeanEmbeddingMethod.release_every_step`). All of them:

1. **release** (the only private access): per class ``c`` the sum ``S_c = sum_{i: y_i = c} phi(x_i)`` of
   unit-norm features plus Gaussian noise (:mod:`dpsynth.privacy.bounded_sum`, charged to the ledger
   before anything is read). Under add/remove-one adjacency the ``K x D`` table moves by at most ``B = 1``
   (one record touches one class: parallel composition); released class counts with weight ``w`` widen
   it to ``sqrt(1 + w^2)``.

   * *once* (DP-MERF, DP-NTK): over **every** private record; the class means are the noisy sums divided
     by the noisy class counts released jointly with them (``denominator: noisy-counts``) or by the
     declared public ``N/K`` (``denominator: declared``: N is public in dpsynth, the classes are *assumed*
     balanced; no count is read off the private data either way). The target is checkpointed at once
     (phase ``release``, ``step`` 1), so a resumed run never releases (or charges) it twice;
   * *every step* (DP-Kernel): over a Poisson sample at rate q = B/N, divided by the declared ``qN/K`` or
     by noisy counts; the T releases are one ``SubsampledGaussian(sigma, q, T)`` ledger entry
     (:class:`EmbeddingReleases`), their running sums checkpointed with the generator;
2. **moment matching** (post-processing): the generator is trained so that the per-class feature means of
   its samples match the released means (:func:`dpsynth.kernels.moment_matching.train_moment_matching`;
   labels uniform and public), checkpointed every ``checkpoint_every`` steps (phase ``moment-matching``);
   a resumed per-step run continues at the ledger's release count (:meth:`RunContext.resume`);
3. **generate**: balanced labels, latent codes from the run's ``sampling`` stream; the released state is
   the generator's weights (:meth:`MeanEmbeddingMethod.state_dict`).

The plan is that Gaussian mechanism, its σ calibrated so that it *and every mechanism the run spends
before it* (:meth:`MeanEmbeddingMethod.prior_mechanisms`, spent by :meth:`MeanEmbeddingMethod.spend_prior`)
meet the (ε, δ) target together: DPImageBench's DP-MERF calibrates for the full ε whatever else the run
spent (dp-merf.md, "privacy_history"). A method composes this module; method modules never import each
other.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from dpsynth.contract import Method, Phase, RunConfig, RunContext, Samples
from dpsynth.data.transforms import tensor_to_uint8, uint8_to_tensor
from dpsynth.errors import PrivacyError
from dpsynth.kernels.bandwidths import public_bandwidths
from dpsynth.kernels.feature_map import FeatureMap, feature_chunks
from dpsynth.kernels.moment_matching import MomentMatchingSettings, train_moment_matching
from dpsynth.kernels.rff import RandomFourierFeatures
from dpsynth.models.gan import sample_conditional
from dpsynth.models.merf_generator import build_merf_generator
from dpsynth.privacy.bounded_sum import (
    BoundedSum,
    BoundedSumRelease,
    release_bounded_sum,
    release_subsampled_bounded_sum,
)
from dpsynth.privacy.mechanisms import Mechanism
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.privacy.rng import NoiseSource
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import Section
from dpsynth.seeding import stream_seed

#: checkpoint phases: the single release's target, the generator training (with the per-step releases' sums)
RELEASE_PHASE = "release"
TRAINING_PHASE = "moment-matching"

#: ``model-init`` stream indices: the generator's initialisation, the feature map's public randomness
GENERATOR_INIT, FEATURE_MAP_INIT, BANDWIDTH_PROBE = 0, 1, 2
#: ``sampling`` stream indices: the released samples, the latent codes and labels of generator training
SAMPLES, TRAINING_DRAWS = 0, 1

Denominator = Literal["noisy-counts", "declared"]


class GeneratorSection(Section):
    """The conditional generator of DP-MERF's image experiments (:mod:`dpsynth.models.merf_generator`)."""

    z_dim: int = Field(5, ge=1, description="latent code length (DP-MERF's MNIST generator: 5)")
    hidden: int = Field(200, ge=1, description="width of the first fully connected layer (paper: 200)")
    conv_channels: list[int] = Field(
        [16, 8], min_length=2, max_length=2, description="channels of the two conv layers (paper: 16, 8)"
    )
    kernel_sizes: list[int] = Field(
        [5, 5], min_length=2, max_length=2, description="odd kernel sizes of the two conv layers (paper: 5, 5)"
    )
    batch_norm: bool = Field(True, description="BatchNorm after both fully connected layers (paper: on)")

    def sizes(self) -> dict[str, Any]:
        return {
            "z_dim": self.z_dim,
            "hidden": self.hidden,
            "conv_channels": tuple(self.conv_channels),
            "kernel_sizes": tuple(self.kernel_sizes),
            "batch_norm": self.batch_norm,
        }


class MeanEmbeddingSection(Section):
    """Keys every mean-embedding method shares: the release's denominator, the generator and its training."""

    denominator: Denominator = Field(
        "noisy-counts",
        description="noisy-counts: divide the noisy class sums by class counts released jointly with them "
        "(sensitivity sqrt(1 + count_weight^2)) | declared: divide by N/K (N public; assumes balanced classes)",
    )
    count_weight: float | None = Field(
        None,
        gt=0,
        le=10,
        description="w: each record adds w to its class's count coordinate (noisy-counts only; count noise std "
        "sigma*sqrt(1+w^2)/w); null: D^(-1/4) for D features, which minimises the worst-case error of the means",
    )
    release_batch_size: int = Field(500, ge=1, description="private records per feature chunk of the release (memory)")
    generator: GeneratorSection = Field(default_factory=GeneratorSection, description="the conditional generator")
    steps: int = Field(2000, ge=1, description="generator training steps (post-processing: no privacy cost)")
    batch_size: int = Field(200, ge=1, description="generated examples per training step (balanced public labels)")
    lr: float = Field(0.01, gt=0, description="Adam learning rate of the generator")
    lr_decay: float = Field(0.9, gt=0, le=1, description="learning-rate factor applied every decay_every steps")
    decay_every: int = Field(0, ge=0, description="steps between learning-rate decays; 0: constant rate")
    checkpoint_every: int = Field(500, ge=1, description="generator-training steps between checkpoints")

    def training(self, seed: int) -> MomentMatchingSettings:
        return MomentMatchingSettings(
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            lr_decay=self.lr_decay,
            decay_every=self.decay_every,
            seed=seed,
        )


class MeanEmbeddingMethod(Method):
    """Release noisy class-wise mean embeddings, fit a conditional generator to them, sample from the generator.

    A subclass sets ``name``, ``config_schema``, :attr:`mechanism_name` and implements :meth:`feature_map`.
    The skeleton reads ``steps``, ``checkpoint_every`` and ``training(seed)`` from the section (a
    :class:`MeanEmbeddingSection` has them); a section's ``noise_multiplier`` key, where it has one, fixes σ
    instead of calibrating it. What may differ is a hook: :attr:`release_every_step` with its own
    :meth:`query` (DP-Kernel's Poisson rate), :meth:`build_generator`, :meth:`running_target`, and mechanisms
    spent before the release (e.g. a private pre-processing step) in :meth:`prior_mechanisms` /
    :meth:`spend_prior`, for which the release's σ leaves room.
    """

    #: the release's name in the ledger and privacy.json
    mechanism_name: ClassVar[str]
    #: the L2 bound of one record's feature: the feature maps here have norm exactly 1
    feature_bound: ClassVar[float] = 1.0
    #: False: one release over every record, then moment matching (DP-MERF, DP-NTK); True: a release of a
    #: Poisson sample before every generator step, ``section.steps`` of them (DP-Kernel)
    release_every_step: ClassVar[bool] = False
    #: the ``sampling`` stream index of the released samples' latent codes
    samples_stream: ClassVar[int] = SAMPLES

    def __init__(self) -> None:
        self._generator: torch.nn.Module | None = None

    # -- declared before any data is read ---------------------------------------------------------
    @classmethod
    def release_public_use(cls, config: RunConfig) -> Literal["none", "optional", "required"]:
        """Whether building the feature map reads the public dataset."""
        return "none"

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        public = cls.release_public_use(config)
        if cls.release_every_step:
            return [
                Phase(
                    TRAINING_PHASE,
                    private=True,
                    public=public,
                    description="a release of a Poisson sample's class-wise feature sums before every generator step",
                ),
                Phase("generate", private=False),
            ]
        return [
            Phase(
                RELEASE_PHASE,
                private=True,
                public=public,
                description="one Gaussian release of the class-wise feature sums (and counts)",
            ),
            Phase(TRAINING_PHASE, private=False, description="the generator fits the released means"),
            Phase("generate", private=False),
        ]

    @classmethod
    def prior_mechanisms(cls, config: RunConfig, num_examples: int) -> tuple[Mechanism, ...]:
        """Mechanisms the run spends before the release (none here); the release's σ leaves room for them."""
        return ()

    def spend_prior(self, ctx: RunContext) -> None:
        """Spend :meth:`prior_mechanisms` (nothing here); called by :meth:`fit` before the release."""

    @classmethod
    def query(cls, section: Any, sigma: float, num_classes: int, num_examples: int, dim: int) -> BoundedSum:
        """The declared release: feature bound 1, K classes, and the noisy counts or the declared N/K."""
        if section.denominator == "noisy-counts":
            weight = count_weight(section, dim)
            return BoundedSum(cls.mechanism_name, cls.feature_bound, sigma, num_classes, count_weight=weight)
        return BoundedSum(
            cls.mechanism_name, cls.feature_bound, sigma, num_classes, denominator=num_examples / num_classes
        )

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """One Gaussian release (or ``steps`` subsampled ones as one entry), σ calibrated with the prior
        mechanisms so the whole run meets ε, unless the section fixes it."""
        section = config.section
        repeats = section.steps if self.release_every_step else 1
        return plan_calibrated(
            config.privacy,
            self.prior_mechanisms(config, num_examples),
            # the mechanism is (Subsampled)Gaussian(name, sigma[, q], repeats) whatever K, D and w: they scale the
            # noise, not sigma
            lambda sigma: self.query(section, sigma, 1, num_examples, 1).mechanism(repeats),
            noise_multiplier=getattr(section, "noise_multiplier", None),
        )

    # -- what a method states ------------------------------------------------------------------
    @abc.abstractmethod
    def feature_map(self, ctx: RunContext) -> FeatureMap:
        """The feature map, from public randomness and public data only (never the private records)."""

    def build_generator(self, ctx: RunContext) -> torch.nn.Module:
        """The conditional generator ``G(z, y)`` (with ``z_dim`` and ``num_classes``), initialised from the public
        ``model-init`` stream: DP-MERF's (:mod:`dpsynth.models.merf_generator`), sized by ``section.generator``."""
        channels, side, _ = ctx.image_shape
        seed = stream_seed(ctx.seed, "model-init", GENERATOR_INIT)
        return build_merf_generator(ctx.num_classes, channels, side, seed, **ctx.section.generator.sizes())

    @classmethod
    def running_target(cls, section: Any) -> bool:
        """Per-step releases: whether each step matches the mean of all releases so far (else the latest)."""
        return False

    # -- the run -------------------------------------------------------------------------------
    def fit(self, ctx: RunContext) -> None:
        """Release (once, or before every step), then fit the generator; resumable at its checkpoints."""
        self.spend_prior(ctx)
        feature_map = self.feature_map(ctx)
        section = ctx.section
        target: Any
        if self.release_every_step:
            target = self.step_releases(ctx, feature_map)
            start, state = ctx.resume(self.mechanism_name, TRAINING_PHASE)
            if state is not None:
                target.load_state_dict(state["releases"])
        else:
            target = self.release(ctx, feature_map)
            state = ctx.checkpoints.load(phase=TRAINING_PHASE)
            start = 0 if state is None else int(state["step"])
            ctx.curves.truncate_after(start)
            if start:
                ctx.log(f"{self.name}: generator training resumed at step {start}")
        generator = self.build_generator(ctx)

        def log_curve(step: int, loss: float) -> None:
            done = step + 1
            if step == 0 or done % section.checkpoint_every == 0 or done == section.steps:
                # The loss compares generated features with the released target: a public value.
                ctx.curves.log(done, epsilon=ctx.ledger.epsilon(), loss=loss)

        def checkpoint(trainer: dict[str, Any]) -> None:
            releases = {"releases": target.state_dict()} if self.release_every_step else {}
            ctx.checkpoints.save({**trainer, **releases}, phase=TRAINING_PHASE)

        result = train_moment_matching(
            generator,
            feature_map,
            target,
            section.training(stream_seed(ctx.seed, "sampling", TRAINING_DRAWS)),
            device=ctx.device,
            description=f"{self.name} generator",
            resume=state,
            start_step=start,
            checkpoint_every=section.checkpoint_every,
            checkpoint=checkpoint,
            after_step=log_curve,
        )
        if result.losses:
            ctx.log(f"{self.name}: moment-matching loss {result.losses[-1]:.4g} after {len(result.losses)} steps")
        self._generator = generator.eval()
        ctx.log(f"{self.name}: done, eps spent {ctx.ledger.epsilon():.4f} of {ctx.ledger.target_epsilon}")

    def release(self, ctx: RunContext, feature_map: FeatureMap) -> torch.Tensor:
        """The single release's class means ``[K, dim]``: from the checkpoint if this run already released them,
        else released now (charged first) and checkpointed at once."""
        done, saved = ctx.resume(self.mechanism_name, RELEASE_PHASE, curves=False)
        if saved is not None:
            ctx.log(f"{self.name}: released target restored from the checkpoint (already charged)")
            return saved["means"]
        if done:
            # The ledger state was written, then the process died before the target was: releasing
            # again would spend the mechanism twice, which the plan does not allow.
            raise PrivacyError(
                f"'{self.mechanism_name}' was charged but its released target was not saved; "
                "resuming would release (and charge) it twice: start a new run"
            )
        train = ctx.data.train
        query = self.query(
            ctx.section, ctx.plan.noise_multiplier(self.mechanism_name), ctx.num_classes, len(train), feature_map.dim
        )
        released = release_bounded_sum(
            private_feature_chunks(feature_map, train, ctx.section.release_batch_size, ctx.device),
            feature_map.dim,
            query,
            ctx.ledger,
            ctx.noise_source(),
        )
        means = released.means.to(torch.float32)
        state = {"step": 1, "means": means, "counts": released.counts, "noise_std": released.noise_std}
        ctx.checkpoints.save(state, phase=RELEASE_PHASE)
        self._log_release(ctx, query, released)
        return means

    def step_releases(self, ctx: RunContext, feature_map: FeatureMap) -> EmbeddingReleases:
        """The per-step releases over the private train split, σ the plan's (:class:`EmbeddingReleases`)."""
        images, labels = ctx.data.train.to_tensors()
        sigma = ctx.plan.noise_multiplier(self.mechanism_name)
        query = self.query(ctx.section, sigma, ctx.num_classes, len(images), feature_map.dim)
        ctx.log(
            f"{self.name}: {ctx.section.steps} releases, q={query.sample_rate:.4g}, sigma={sigma:.4f}, "
            f"{feature_map.dim} features, target eps={ctx.ledger.target_epsilon}"
        )
        running = self.running_target(ctx.section)
        noise = ctx.noise_source()
        return EmbeddingReleases(
            feature_map, images, labels, query, ctx.ledger, noise, running=running, device=ctx.device
        )

    def _log_release(self, ctx: RunContext, query: BoundedSum, released: BoundedSumRelease) -> None:
        ctx.log(
            f"{self.name}: released the class sums of {released.means.shape[1]} features "
            f"(noise std {released.noise_std:.4g} per coordinate, sigma {query.noise_multiplier:.4g}); "
            f"eps={ctx.ledger.epsilon():.4f} of {ctx.ledger.target_epsilon}"
        )
        if released.counts is not None:  # noisy counts: released values, free to print
            counts = ", ".join(f"{v:.0f}" for v in released.counts.tolist())
            ctx.log(f"{self.name}: noisy class counts [{counts}]")

    # -- the released state and sampling ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The released generator's weights (CPU tensors): all that sampling reads."""
        assert self._generator is not None, "fit or load_state_dict first"
        return {"generator": {k: v.detach().cpu() for k, v in self._generator.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        generator = self.build_generator(ctx)
        generator.load_state_dict(state["generator"])
        self._generator = generator.to(ctx.device).eval()

    def generate(self, ctx: RunContext, num: int) -> Samples:
        """``num`` images with balanced public labels from the released generator (post-processing)."""
        assert self._generator is not None, "fit or load_state_dict first"
        labels = torch.from_numpy(balanced_labels(num, ctx.num_classes))
        images = sample_conditional(
            self._generator,
            labels,
            seed=stream_seed(ctx.seed, "sampling", self.samples_stream),
            batch_size=ctx.config.generate.batch_size,
            device=ctx.device,
        )
        return Samples(images=tensor_to_uint8(images), labels=labels.numpy())


class EmbeddingReleases:
    """The per-step target of the generator: one registered Poisson-subsampled release per call (DP-Kernel).

    ``self(step)`` charges one step of the query's mechanism (before reading anything), Poisson-samples the
    private set (:func:`~dpsynth.privacy.bounded_sum.release_subsampled_bounded_sum`, ``registered=True``: the
    T steps are one ``SubsampledGaussian(sigma, q, T)`` ledger entry), sums the features of the sampled
    records per class, adds the noise and returns the released class means ``[K, D]`` -- or, with
    ``running``, the mean of every release so far. The running sums are released values (post-processing),
    so they may be checkpointed.
    """

    def __init__(
        self,
        feature_map: FeatureMap,
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


def random_fourier_map(ctx: RunContext, method: str) -> RandomFourierFeatures:
    """Unit-norm random Fourier features of the run's image shape with ``ctx.section``'s public length scales
    (a :class:`~dpsynth.kernels.bandwidths.RandomFeatureSection`), ``W`` from the public ``model-init`` stream:
    DP-MERF's and DP-Kernel's feature map."""
    section, shape = ctx.section, ctx.image_shape
    probe = stream_seed(ctx.seed, "model-init", BANDWIDTH_PROBE)
    lengths = public_bandwidths(section, shape, ctx.public, probe, method)
    ctx.log(f"{method}: {section.rule} length scales " + ", ".join(f"{v:.3g}" for v in lengths))
    return RandomFourierFeatures(
        math.prod(shape),
        section.num_features,
        lengths,
        seed=stream_seed(ctx.seed, "model-init", FEATURE_MAP_INIT),
        device=ctx.device,
    )


def count_weight(section: MeanEmbeddingSection, dim: int) -> float:
    """The count coordinate's weight w: the section's, or ``D^(-1/4)``.

    With unit-norm features, class-c mean mu_c and n_c records, the squared error of the released mean is about
    ``sigma^2 (1 + w^2) (D + |mu_c|^2 / w^2) / n_c^2`` (sum noise, plus the count noise scaling the mean); it is
    smallest at ``w^4 = |mu_c|^2 / D``, and ``|mu_c| <= 1`` gives ``w = D^(-1/4)`` without looking at the data
    (its excess error over the best w is of relative order ``D^(-1/2)``).
    """
    return float(section.count_weight) if section.count_weight is not None else float(dim) ** -0.25


def private_feature_chunks(
    feature_map: FeatureMap, dataset: Any, batch_size: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Lazily yield ``(features [n, dim], labels [n])`` of a private :class:`~dpsynth.data.ImageDataset`,
    converting ``batch_size`` records at a time (the whole set is never held as float tensors). Nothing
    is read until the release consumes it, i.e. after its ledger charge."""
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            images = uint8_to_tensor(dataset.images[start : start + batch_size]).to(device)
            labels = torch.as_tensor(dataset.labels[start : start + batch_size], dtype=torch.int64)
            yield feature_map(images), labels
