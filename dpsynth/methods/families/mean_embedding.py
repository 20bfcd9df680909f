"""The shared skeleton of the mean-embedding methods: one noisy release of class-wise feature means, then a
generator fitted to it without further privacy cost.

DP-MERF (Harder et al., AISTATS 2021, arXiv:2002.11603, Algorithm 1) and DP-NTK (Yang et al.,
arXiv:2303.01687, §3) differ only in the feature map ``phi`` (random Fourier features, or the normalised
e-NTK of a fixed random network). Both:

1. **release** (the only private access): per class ``c`` the sum ``S_c = sum_{i: y_i = c} phi(x_i)`` of
   unit-norm features over *every* private training record, plus Gaussian noise, once
   (:func:`dpsynth.privacy.bounded_sum.release_bounded_sum`, charged to the ledger before anything is
   read). Under add/remove-one adjacency the ``K x D`` table moves by at most ``B = 1`` (one record touches
   one class: parallel composition). The class means are the noisy sums divided either by the noisy
   class counts released jointly with the sums (``denominator: noisy-counts``; each record adds ``w`` to
   its class's count coordinate, sensitivity ``sqrt(1 + w^2)``) or by the declared public ``N/K``
   (``denominator: declared``: N is public in dpsynth, the classes are *assumed* balanced; no count is
   read off the private data either way). The noisy target is checkpointed at once, so a resumed run
   never releases (or charges) twice;
2. **moment matching** (post-processing): a conditional generator is trained with Adam so that the
   per-class feature means of its samples match the released means
   (:func:`dpsynth.kernels.moment_matching.train_moment_matching`; labels uniform and public),
   checkpointed every ``checkpoint_every`` steps;
3. **generate**: balanced labels, latent codes from the run's ``sampling`` stream.

The plan is that one Gaussian mechanism, its σ calibrated so that it *and every mechanism the run spends
before it* (:meth:`MeanEmbeddingMethod.prior_mechanisms`, spent by :meth:`MeanEmbeddingMethod.spend_prior`)
meet the (ε, δ) target together: DPImageBench's DP-MERF calibrates for the full ε whatever else the run
spent (dp-merf.md, "privacy_history"). A method composes this module; method modules never import each
other.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from dpsynth.contract import Method, Phase, RunConfig, RunContext, Samples
from dpsynth.data.transforms import tensor_to_uint8, uint8_to_tensor
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.kernels.feature_map import FeatureMap
from dpsynth.kernels.moment_matching import MomentMatchingSettings, train_moment_matching
from dpsynth.models.gan import sample_conditional
from dpsynth.models.merf_generator import build_merf_generator
from dpsynth.privacy.bounded_sum import BoundedSum, BoundedSumRelease, release_bounded_sum
from dpsynth.privacy.mechanisms import Mechanism
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import Section
from dpsynth.seeding import stream_seed

#: checkpoint phases: the released target, the generator training, the released generator
RELEASE_PHASE = "release"
TRAINING_PHASE = "moment-matching"
FINAL_PHASE = "final"

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
    """Release a noisy class-wise mean embedding once, fit a generator to it, sample from the generator.

    A subclass sets ``name``, ``config_schema`` (a :class:`MeanEmbeddingSection`), :attr:`mechanism_name`
    and implements :meth:`feature_map`. A method that spends other mechanisms before the release (e.g. a
    private pre-processing step) lists them in :meth:`prior_mechanisms` and spends them in
    :meth:`spend_prior`; the release's σ is then calibrated for what is left.
    """

    #: the release's name in the ledger and privacy.json
    mechanism_name: ClassVar[str]
    #: the L2 bound of one record's feature: the feature maps here have norm exactly 1
    feature_bound: ClassVar[float] = 1.0

    def __init__(self) -> None:
        self._generator: torch.nn.Module | None = None

    # -- declared before any data is read ---------------------------------------------------------
    @classmethod
    def release_public_use(cls, config: RunConfig) -> Literal["none", "optional", "required"]:
        """Whether building the feature map reads the public dataset."""
        return "none"

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        return [
            Phase(
                "release",
                private=True,
                public=cls.release_public_use(config),
                description="one Gaussian release of the class-wise feature sums (and counts)",
            ),
            Phase("moment-matching", private=False, description="the generator fits the released means"),
            Phase("generate", private=False),
        ]

    @classmethod
    def prior_mechanisms(cls, config: RunConfig, num_examples: int) -> tuple[Mechanism, ...]:
        """Mechanisms the run spends before the release (none here); the release's σ leaves room for them."""
        return ()

    def spend_prior(self, ctx: RunContext) -> None:
        """Spend :meth:`prior_mechanisms` (nothing here); called by :meth:`fit` before the release."""

    @classmethod
    def query(
        cls, section: MeanEmbeddingSection, sigma: float, num_classes: int, num_examples: int, dim: int
    ) -> BoundedSum:
        """The declared release: feature bound 1, K classes, and the noisy counts or the declared N/K."""
        if section.denominator == "noisy-counts":
            weight = count_weight(section, dim)
            return BoundedSum(cls.mechanism_name, cls.feature_bound, sigma, num_classes, count_weight=weight)
        return BoundedSum(
            cls.mechanism_name, cls.feature_bound, sigma, num_classes, denominator=num_examples / num_classes
        )

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """One full-batch Gaussian release, σ calibrated with the prior mechanisms so the whole run meets ε."""
        section = config.section
        return plan_calibrated(
            config.privacy,
            self.prior_mechanisms(config, num_examples),
            # the mechanism is Gaussian(name, sigma) whatever K, D and w: they scale the noise, not sigma
            lambda sigma: self.query(section, sigma, 1, num_examples, 1).mechanism(),
        )

    # -- the run -------------------------------------------------------------------------------
    @abc.abstractmethod
    def feature_map(self, ctx: RunContext) -> FeatureMap:
        """The feature map, from public randomness and public data only (never the private records)."""

    def fit(self, ctx: RunContext) -> None:
        final = ctx.checkpoints.load(phase=FINAL_PHASE)
        if final is not None:  # resumed after training: nothing left to spend or fit
            self._generator = _load_generator(final, ctx.device)
            return
        self.spend_prior(ctx)
        feature_map = self.feature_map(ctx)
        target = self.release(ctx, feature_map)
        section = ctx.section
        spec = {
            "num_classes": ctx.num_classes,
            "channels": ctx.image_shape[0],
            "image_size": ctx.image_shape[1],
            "sizes": section.generator.sizes(),
        }
        generator = build_merf_generator(
            spec["num_classes"],
            spec["channels"],
            spec["image_size"],
            stream_seed(ctx.seed, "model-init", GENERATOR_INIT),
            **spec["sizes"],
        )
        resume = ctx.checkpoints.load(phase=TRAINING_PHASE)
        if resume is not None:
            ctx.curves.truncate_after(int(resume["step"]))
            ctx.log(f"{self.name}: generator training resumed at step {int(resume['step'])}")

        def checkpoint(state: dict[str, Any]) -> None:
            done = int(state["step"])
            recent = state["losses"][-section.checkpoint_every :]
            # The loss compares generated features with the released target: a public value.
            ctx.curves.log(done, moment_matching_loss=sum(recent) / max(len(recent), 1))
            ctx.checkpoints.save(state, phase=TRAINING_PHASE)

        result = train_moment_matching(
            generator,
            feature_map,
            target,
            section.training(stream_seed(ctx.seed, "sampling", TRAINING_DRAWS)),
            device=ctx.device,
            description=f"{self.name} generator",
            resume=resume,
            checkpoint_every=section.checkpoint_every,
            checkpoint=checkpoint,
        )
        if result.losses:
            ctx.log(f"{self.name}: moment-matching loss {result.losses[-1]:.4g} after {len(result.losses)} steps")
        generator.eval()
        ctx.checkpoints.save(
            {"generator": {k: v.detach().cpu() for k, v in generator.state_dict().items()}, "spec": spec},
            phase=FINAL_PHASE,
        )
        self._generator = generator

    def release(self, ctx: RunContext, feature_map: FeatureMap) -> torch.Tensor:
        """The released class means ``[K, dim]``: from the checkpoint if this run already released them, else
        released now (charged first) and checkpointed at once."""
        saved = ctx.checkpoints.load(phase=RELEASE_PHASE)
        charged = any(m.name == self.mechanism_name for m in ctx.ledger.mechanisms())
        if saved is not None:
            if not charged:
                raise PrivacyError(
                    f"{ctx.run_dir} holds a released '{self.mechanism_name}' target its ledger never charged"
                )
            ctx.log(f"{self.name}: released target restored from the checkpoint (already charged)")
            return saved["means"]
        if charged:
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
        ctx.checkpoints.save(
            {"means": means, "counts": released.counts, "noise_std": released.noise_std}, phase=RELEASE_PHASE
        )
        self._log_release(ctx, query, released)
        return means

    def _log_release(self, ctx: RunContext, query: BoundedSum, released: BoundedSumRelease) -> None:
        ctx.log(
            f"{self.name}: released the class sums of {released.means.shape[1]} features "
            f"(noise std {released.noise_std:.4g} per coordinate, sigma {query.noise_multiplier:.4g}); "
            f"eps={ctx.ledger.epsilon():.4f} of {ctx.ledger.target_epsilon}"
        )
        if released.counts is not None:  # noisy counts: released values, free to print
            counts = ", ".join(f"{v:.0f}" for v in released.counts.tolist())
            ctx.log(f"{self.name}: noisy class counts [{counts}]")

    def generate(self, ctx: RunContext, num: int) -> Samples:
        if self._generator is None:  # a fresh process (dpsynth generate)
            final = ctx.checkpoints.load(phase=FINAL_PHASE)
            if final is None:
                raise ConfigError(f"{ctx.run_dir} holds no trained {self.name} generator; run training first")
            self._generator = _load_generator(final, ctx.device)
        generator = self._generator
        labels = torch.from_numpy(balanced_labels(num, generator.num_classes))
        images = sample_conditional(
            generator,
            labels,
            seed=stream_seed(ctx.seed, "sampling", SAMPLES),
            batch_size=ctx.config.generate.batch_size,
            device=ctx.device,
        )
        return Samples(images=tensor_to_uint8(images), labels=labels.numpy())


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


def _load_generator(final: dict[str, Any], device: torch.device | str) -> torch.nn.Module:
    spec = final["spec"]
    generator = build_merf_generator(spec["num_classes"], spec["channels"], spec["image_size"], 0, **spec["sizes"])
    generator.load_state_dict(final["generator"])
    return generator.to(device).eval()
