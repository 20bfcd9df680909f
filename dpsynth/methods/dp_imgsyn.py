"""DP-ImgSyn: dataset alignment for obfuscated, differentially private image synthesis.

Soufleri, Ravikumar & Roy, "DP-ImgSyn: Dataset Alignment for Obfuscated, Differentially Private Image
Synthesis", TMLR 2024 (openreview.net/forum?id=KleJZ9ZzYw). Three steps:

1. **Teacher** (§4.1): a GroupNorm classifier trained with DP-SGD on the private train split through
   the shared driver :func:`dpsynth.dpsgd.training.train_private`. Its σ is calibrated with the
   statistics mechanisms *reserved*, so the composed total after step 2 still meets the target ε.
2. **DP statistics** (§4.1): each private example's channel means and second moments of every
   GroupNorm input, concatenated, clipped to L2 norm ``C``, summed, and released with Gaussian
   noise ``N(0, σ²C²)``. The noise is really added (the authors' public code leaves it commented
   out, which gives no privacy). Under add/remove adjacency the number of private examples is
   private too, so the divisor is a noisy count. Sum and count are one release of the shared
   bounded-sum mechanism (:func:`statistics_query`); with ``stats.sample_rate`` below 1 it reads
   only a Poisson subsample of the records, so its cost does not grow with N (the own-data rule
   sets the rate for large sets).
3. **Alignment and release** (§4.2–4.3, Algorithm 1): public images (or Gaussian noise, optionally
   low-pass filtered, A.6) get uniform target labels (A.1.3) and are optimised for ``k`` Adam steps
   on ``α_f R_feature + α_c CE + α_tv R_tv + α_l2 R_l2`` (Eq. 1–5) with the teacher frozen; the
   teacher's soft labels at temperature ``T`` are released with them. This step reads only the
   teacher, the noisy statistics and public data, so it is post-processing and costs no privacy.

``synthesis.iterations: 0`` is DP-ImgSyn(0): the public images themselves, labelled by the teacher.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from pydantic import Field
from tqdm.auto import tqdm

from dpsynth.contract import (
    EvaluationProtocol,
    Method,
    Phase,
    PrivateNetwork,
    RunConfig,
    RunContext,
    Samples,
    register_method,
)
from dpsynth.data.transforms import tensor_to_uint8, uint8_to_tensor
from dpsynth.errors import ConfigError
from dpsynth.methods.families.classifier import (
    ClassifierSection,
    classifier_network,
    example_losses,
    train_dp_classifier,
)
from dpsynth.methods.families.classifier import accuracy as classifier_accuracy
from dpsynth.models.feature_stats import FeatureStatistics, GroupNormInputs, feature_loss, per_example_moments
from dpsynth.privacy.bounded_sum import (
    BoundedSum,
    BoundedSumRelease,
    release_bounded_sum,
    release_subsampled_bounded_sum,
)
from dpsynth.privacy.plan import PrivacyPlan, plan_with_dpsgd
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import Section, with_defaults

TEACHER_MECHANISM = "dp-imgsyn-teacher"
STATS_MECHANISM = "dp-imgsyn-statistics"
STATS_PHASE = "dp-imgsyn-statistics"
#: test records the logged teacher accuracy reads (at 10^6 images the whole test split took a minute)
TEACHER_DIAGNOSTIC_RECORDS = 10_000


TeacherSection = with_defaults(
    ClassifierSection,
    "TeacherSection",
    "The DP-SGD teacher (§4.1). Table 5 (MNIST, ε=10): ResNet-18 with GroupNorm, 14 epochs, batch 128, lr 0.01, "
    "C=1; σ is calibrated to the budget, not fixed.",
    model="resnet18",
    preset="gpu",
    batch_size=128,
    epochs=14.0,
    lr=0.01,
    clip_norm=1.0,
    physical_batch_size=64,
)


class StatsSection(Section):
    """§4.1 statistics capture: the clipped-moment sum and the record count, one Gaussian release over the
    train split or a Poisson subsample of it (:func:`statistics_query`)."""

    noise_multiplier: float = Field(10.0, gt=0, description="sigma of the clipped-moment sum (noise std sigma*C)")
    count_noise_multiplier: float = Field(20.0, gt=0, description="sigma of the noisy count (sensitivity 1)")
    sample_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Poisson rate q of the records the statistics read (1: every record; < 1: one subsampled "
        "Gaussian, amplified by q, whose cost does not grow with N)",
    )
    clip_norm: float | None = Field(
        None, gt=0, description="C; null: the clip_quantile of per-example norms on public images (free)"
    )
    clip_quantile: float = Field(0.95, gt=0, le=1, description="quantile of public moment norms used as C")
    min_variance: float = Field(1e-4, ge=0, description="clamp of E[x^2] - mu^2 after noise")
    batch_size: int = Field(256, ge=1, description="forward batch for capture (does not change the mechanism)")


class SynthesisSection(Section):
    """§4.2, Algorithm 1, A.1.2 (Adam, lr 0.1, betas (0.5, 0.99), batch 80), Table 7 weights."""

    init: Literal["public", "noise"] = Field("public", description="start from public images or Gaussian noise")
    noise_std: float = Field(1.0, gt=0, description="std of the N(0, std^2) initialisation (A.2, A.4)")
    blur_kernel: int = Field(0, ge=0, description="Gaussian low-pass of the noise init (A.6); 0 = off, else odd")
    blur_sigma: float | None = Field(None, gt=0, description="blur sigma; null: 0.3*((k-1)/2 - 1) + 0.8")
    iterations: int = Field(10, ge=0, description="k alignment steps (Table 2: 10 for MNIST); 0 = DP-ImgSyn(0)")
    early_stop_patience: int = Field(
        0, ge=0, description=">0: stop a batch once R_tv rose this many steps in a row (Fig. 4b)"
    )
    lr: float = Field(0.1, gt=0, description="Adam learning rate on the images")
    betas: list[float] = Field([0.5, 0.99], min_length=2, max_length=2, description="Adam (beta1, beta2)")
    batch_size: int = Field(80, ge=1, description="images aligned together")
    alpha_feature: float = Field(10.0, ge=0, description="weight of R_feature (Eq. 5)")
    alpha_ce: float = Field(1.0, ge=0, description="weight of the cross-entropy (Eq. 5)")
    alpha_tv: float = Field(2.5e-5, ge=0, description="weight of R_tv (Eq. 3)")
    alpha_l2: float = Field(3e-8, ge=0, description="weight of R_l2 (Eq. 4)")

    @pydantic.field_validator("blur_kernel")
    @classmethod
    def _odd_kernel(cls, kernel: int) -> int:
        if kernel > 1 and kernel % 2 == 0:
            raise ValueError("expected 0, 1 or an odd kernel size")
        return kernel

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: list[float]) -> list[float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError("expected two numbers in [0, 1)")
        return betas


class ReleaseSection(Section):
    """§4.3: soft labels p_M(x) at temperature T; hard labels from the targets or the teacher.

    The hard labels default to the targets each image was aligned to (A.1.3: balanced over the classes),
    so the release follows the requested label distribution. The teacher's argmax follows a DP teacher
    instead, and a weak one (a small set at a small ε) can put every image in one class; the soft labels
    carry the teacher's view either way."""

    temperature: float = Field(1.0, gt=0, description="softmax temperature T of the released soft labels")
    labels: Literal["teacher", "target"] = Field(
        "target",
        description="target (the balanced A.1.3 labels each image was aligned to) | teacher (argmax of the "
        "soft label; can collapse to one class when the DP teacher is weak)",
    )


class StudentSection(Section):
    """A.1.4 student, the method's evaluation protocol (``DPImgSyn.evaluation_protocol``): SGD 0.1,
    momentum 0.9, wd 1e-4, multistep x0.1 at 120/150/180 of 200 epochs, batch 256, KD temperature 100
    for MNIST/FashionMNIST (Eq. 7)."""

    model: str = Field("resnet18", description="student classifier")
    preset: Literal["cpu", "gpu"] = Field("gpu", description="cpu (small) or gpu (paper size) network")
    optimizer: Literal["sgd", "adam"] = Field(
        "sgd",
        description="sgd (the paper; the shared downstream trainer uses Adam instead, see evaluation_protocol) | adam",
    )
    epochs: int = Field(200, ge=1, description="training epochs")
    batch_size: int = Field(256, ge=1, description="batch size")
    lr: float = Field(0.1, gt=0, description="learning rate (applied with optimizer adam)")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(1e-4, ge=0, description="weight decay")
    milestones: list[int] = Field([120, 150, 180], description="epochs where the SGD lr is multiplied by gamma")
    gamma: float = Field(0.1, gt=0, description="multistep lr factor")
    temperature: float = Field(100.0, gt=0, description="KD temperature (Eq. 7)")


class DPImgSynConfig(Section):
    """The ``dp-imgsyn`` section."""

    teacher: TeacherSection = Field(default_factory=TeacherSection, description="DP-SGD GroupNorm teacher (§4.1)")
    stats: StatsSection = Field(default_factory=StatsSection, description="DP GroupNorm statistics (§4.1)")
    synthesis: SynthesisSection = Field(default_factory=SynthesisSection, description="alignment (§4.2)")
    release: ReleaseSection = Field(default_factory=ReleaseSection, description="soft-label release (§4.3)")
    student: StudentSection = Field(default_factory=StudentSection, description="KD student (A.1.4)")


@register_method
class DPImgSyn(Method):
    """DP-SGD GroupNorm teacher + DP GroupNorm statistics; public images aligned to them; soft labels."""

    name = "dp-imgsyn"
    summary = "DP-SGD GroupNorm teacher, DP GroupNorm input statistics, public images aligned to them, soft labels"
    paper = (
        "Soufleri et al., DP-ImgSyn: Dataset Alignment for Obfuscated, Differentially Private Image Synthesis, "
        "TMLR 2024"
    )
    privacy_notes = (
        (
            "dp-imgsyn: the GroupNorm statistics are released with Gaussian noise sigma*C on the clipped "
            "per-example sum (paper §4.1); the authors' public code leaves this noise commented out, which "
            "gives no privacy, and is not followed. The divisor of the means is a noisy count (noise sigma_c), "
            "because the number of private examples is private under add/remove adjacency; sum and count are "
            "one Gaussian release of [sum, w*count] (w = C*sigma/sigma_c), whose noise multiplier "
            "(sigma^-2 + sigma_c^-2)^-1/2 is the two composed. With stats.sample_rate below 1 both are "
            "computed on one Poisson subsample and accounted once as a subsampled Gaussian."
        ),
    )
    config_schema = DPImgSynConfig

    def __init__(self) -> None:
        self.teacher: torch.nn.Module | None = None
        self.statistics: FeatureStatistics | None = None

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        init_public = config.section.synthesis.init == "public"
        return [
            Phase("teacher", private=True, description="DP-SGD teacher on the private train split (§4.1)"),
            Phase(
                "statistics",
                private=True,
                public="optional",
                description="DP GroupNorm statistics; public images set the clip norm when clip_norm is null",
            ),
            Phase(
                "alignment",
                private=False,
                public="required" if init_public else "none",
                description="synthesis.init 'public' starts from public images; set data.public or use init: noise",
            ),
        ]

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """The teacher's DP-SGD, then the statistics sum and the noisy count (two Gaussians).

        The teacher's σ is calibrated with both Gaussians counted, so the total meets the target.
        """
        section = config.section
        teacher = section.teacher
        steps = teacher.private_training().total_steps(num_examples)
        return plan_with_dpsgd(
            config.privacy,
            statistics_mechanisms(section.stats),
            name=TEACHER_MECHANISM,
            sample_rate=teacher.batch_size / num_examples,
            steps=steps,
            noise_multiplier=teacher.noise_multiplier,
        )

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        """The teacher (the statistics release is one pass of it, no training)."""
        return [classifier_network(f"{self.name}.teacher", config.section.teacher, config.data)]

    # ------------------------------------------------------------------ fit
    def fit(self, ctx: RunContext) -> None:
        """Train the DP teacher, then release the DP GroupNorm statistics (both on the ledger)."""
        stored = ctx.checkpoints.load(phase=STATS_PHASE)
        if stored is not None:  # resumed after both private phases: nothing left to spend
            self._restore(ctx, stored)
            ctx.log("dp-imgsyn: teacher and statistics restored from checkpoint; no privacy spent")
            return
        teacher = train_teacher(ctx)
        teacher.eval()
        # test split: not on the ledger; a private diagnostic for the log, on a bounded share at large N
        accuracy = classifier_accuracy(teacher, ctx.data.test, max_records=TEACHER_DIAGNOSTIC_RECORDS)
        ctx.log(f"dp-imgsyn: teacher test accuracy {accuracy:.4f}")
        clip_norm = statistics_clip_norm(ctx, teacher)
        statistics, noisy_count = capture_private_statistics(ctx, teacher, clip_norm)
        ctx.log(
            f"dp-imgsyn: statistics released (C={clip_norm:.4g}, noisy count {noisy_count:.1f}); "
            f"eps={ctx.ledger.epsilon():.4f} of {ctx.ledger.target_epsilon}"
        )
        ctx.checkpoints.save(
            {
                "teacher": teacher.state_dict(),
                "statistics": statistics.state_dict(),
                "clip_norm": clip_norm,
                "noisy_count": noisy_count,
                "teacher_test_accuracy": accuracy,
            },
            phase=STATS_PHASE,
        )
        self.teacher, self.statistics = teacher, statistics

    def _restore(self, ctx: RunContext, stored: dict[str, Any]) -> None:
        teacher = build_teacher(ctx)
        teacher.load_state_dict(stored["teacher"])
        self.teacher = teacher.eval()
        self.statistics = FeatureStatistics.from_state_dict(stored["statistics"])

    def _ensure_trained(self, ctx: RunContext) -> None:
        if self.teacher is None or self.statistics is None:
            stored = ctx.checkpoints.load(phase=STATS_PHASE)
            if stored is None:
                raise ConfigError(f"{ctx.run_dir} holds no trained dp-imgsyn teacher; run training first")
            self._restore(ctx, stored)

    def example_losses(self, ctx: RunContext, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Audit hook: per-example losses of the teacher, whose outputs the soft labels release."""
        self._ensure_trained(ctx)
        return example_losses(self.teacher, images, labels, ctx.device)

    @classmethod
    def evaluation_protocol(cls, config: RunConfig) -> EvaluationProtocol:
        """The KD student of §4.3 and A.1.4, from the ``student`` section: the released soft labels are
        distilled at the section's temperature (Eq. 6/7; T = 100 for MNIST/FashionMNIST), with the
        section's classifier, epochs, batch size and weight decay, and the **last** epoch is tested: the
        paper trains the student on a fixed schedule and reports the final model, mean over three seeds
        (Table 3). The shared trainer is Adam with cosine decay; a section asking for the paper's SGD keeps
        everything else but takes the trainer's Adam learning rate (SGD's 0.1 diverges under Adam).
        """
        student = config.section.student
        adam = str(student.optimizer).lower() == "adam"
        return EvaluationProtocol(
            models=(str(student.model),),
            preset=student.preset,
            epochs=int(student.epochs),
            batch_size=int(student.batch_size),
            lr=float(student.lr) if adam else EvaluationProtocol.lr,
            weight_decay=float(student.weight_decay),
            labels="soft",
            kd_temperature=float(student.temperature),
            selection="last",
            seeds=3,
        )

    # ------------------------------------------------------------- generate
    def generate(self, ctx: RunContext, num: int) -> Samples:
        """Align ``num`` initial images to the private statistics (Algorithm 1) and label them."""
        self._ensure_trained(ctx)
        synthesis = ctx.section.synthesis
        initial = initial_images(ctx, num)
        targets = torch.from_numpy(balanced_labels(num, ctx.num_classes))
        aligned = align(
            self.teacher, self.statistics.to(ctx.device), initial, targets, synthesis, ctx.device, log=ctx.log
        )
        return release(self.teacher, aligned, targets, ctx.section.release, ctx.device)


# ---------------------------------------------------------------------- teacher
def build_teacher(ctx: RunContext) -> torch.nn.Module:
    """The GroupNorm teacher named by ``teacher.model`` / ``teacher.preset`` (untrained)."""
    from dpsynth.models.classifiers import build_classifier

    spec = ctx.section.teacher
    channels, height, _ = ctx.image_shape
    model = build_classifier(spec.model, channels, ctx.num_classes, height, preset=spec.preset)
    if not any(isinstance(m, torch.nn.GroupNorm) for m in model.modules()):
        raise ConfigError(f"teacher.model {spec.model!r} has no GroupNorm layer; DP-ImgSyn needs one (§4.1)")
    return model.to(ctx.device)


def statistics_query(stats: StatsSection, clip_norm: float) -> BoundedSum:
    """The §4.1 release as one bounded sum: per record, its moment vector clipped to ``C`` and a count of 1.

    The paper's two Gaussians (the sum with noise ``σ_s·C``, the count with noise ``σ_c``) are released
    jointly as ``[sum, w·count] + N(0, σ²(C² + w²))`` with ``w = C·σ_s/σ_c`` and
    ``σ = (σ_s⁻² + σ_c⁻²)^(-1/2)``: the same noise on the sum and on the count, and the same privacy
    as the two composed (the Rényi divergences of Gaussians add). Joint, the pair can share one Poisson
    subsample (``stats.sample_rate`` < 1), accounted as one subsampled Gaussian; two mechanisms on one
    subsample could not each claim the amplification.
    """
    sigma_sum, sigma_count = float(stats.noise_multiplier), float(stats.count_noise_multiplier)
    return BoundedSum(
        STATS_MECHANISM,
        bound=clip_norm,
        noise_multiplier=1.0 / math.hypot(1.0 / sigma_sum, 1.0 / sigma_count),
        sample_rate=float(stats.sample_rate),
        count_weight=clip_norm * sigma_sum / sigma_count,
    )


def statistics_mechanisms(stats: StatsSection) -> list[Any]:
    """The mechanism step 2 will charge (its σ and rate do not depend on ``C``); the teacher's calibration
    reserves it."""
    return [statistics_query(stats, clip_norm=1.0).mechanism(1)]


def train_teacher(ctx: RunContext) -> torch.nn.Module:
    """DP-SGD training of the teacher on the private train split (§4.1, Table 5).

    The shared classifier training (:mod:`dpsynth.methods.families.classifier`) through ``train_private``,
    under its own ledger name, at the planned σ (calibrated with the statistics mechanisms counted).
    """
    build_teacher(ctx)  # fail fast on an architecture without GroupNorm, before spending anything
    return train_dp_classifier(ctx, ctx.section.teacher, mechanism=TEACHER_MECHANISM, desc="DP-ImgSyn teacher")


# ------------------------------------------------------------------- statistics
def _moment_chunks(
    teacher: torch.nn.Module, images: torch.Tensor, batch_size: int, device: torch.device
) -> Iterator[torch.Tensor]:
    """Per-example moment vectors of ``images``, ``batch_size`` at a time (GroupNorm is per example)."""
    with torch.no_grad(), GroupNormInputs(teacher) as captured:
        for start in range(0, len(images), batch_size):
            teacher(images[start : start + batch_size].to(device))
            yield per_example_moments(captured.captured()).cpu()


def statistics_clip_norm(ctx: RunContext, teacher: torch.nn.Module) -> float:
    """``stats.clip_norm`` if set, else the ``clip_quantile`` of moment-vector norms on public data.

    Computed from public images (or, without a public set, from the noise initialisation), so it
    is free (a clip norm computed from private data would leak; docs/privacy.md).
    """
    stats = ctx.section.stats
    if stats.clip_norm is not None:
        if not float(stats.clip_norm) > 0:
            raise ConfigError(f"stats.clip_norm must be positive, got {stats.clip_norm!r}")
        return float(stats.clip_norm)
    probe = initial_images(ctx, min(512, _public_size(ctx) or 512), stream="clip-probe")
    norms = torch.cat(list(_moment_chunks(teacher, probe, int(stats.batch_size), ctx.device))).norm(dim=1)
    quantile = float(stats.clip_quantile)
    if not 0 < quantile <= 1:
        raise ConfigError(f"stats.clip_quantile must lie in (0, 1], got {quantile}")
    return max(float(torch.quantile(norms.double(), quantile)), 1e-6)


def private_moment_release(
    teacher: torch.nn.Module,
    num_records: int,
    read: Callable[[np.ndarray], torch.Tensor],
    query: BoundedSum,
    ledger: Any,
    noise: Any,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> BoundedSumRelease:
    """Release ``query`` over the clipped per-example moment vectors of ``num_records`` private images.

    ``read(indices)`` returns the images at ``indices`` as float tensors; it is called only after the
    charge, ``batch_size`` records at a time, and (``query.sample_rate`` < 1) only for the records the
    Poisson coins keep. Each row (:func:`~dpsynth.models.feature_stats.per_example_moments`) is clipped to
    ``C``, so adding or removing one record moves the released vector by at most the query's sensitivity.
    """
    teacher.eval()
    with GroupNormInputs(teacher) as probe:
        dim = 2 * sum(probe.channels)

    def chunks(indices: torch.Tensor) -> Iterator[tuple[torch.Tensor, None]]:
        positions = np.asarray(indices, dtype=np.int64)
        for start in range(0, len(positions), batch_size):
            images = read(positions[start : start + batch_size])
            yield from ((rows, None) for rows in _moment_chunks(teacher, images, len(images), device))

    if query.sample_rate == 1.0:
        return release_bounded_sum(chunks(torch.arange(num_records)), dim, query, ledger, noise)
    return release_subsampled_bounded_sum(chunks, num_records, dim, query, ledger, noise)


def capture_private_statistics(
    ctx: RunContext, teacher: torch.nn.Module, clip_norm: float, noise: Any = None
) -> tuple[FeatureStatistics, float]:
    """Release the private GroupNorm input statistics (§4.1) and the noisy count that divides them.

    One :func:`statistics_query` release over the train split (or its Poisson subsample), charged to the
    ledger before any image is read; the means are the noisy sums over the noisy count clamped at 1
    (post-processing). ``noise`` defaults to a fresh entropy-seeded
    :class:`~dpsynth.privacy.rng.NoiseSource` (tests may pass a seeded one).
    """
    stats = ctx.section.stats
    if noise is None:
        noise = ctx.noise_source()
    train = ctx.data.train
    query = statistics_query(stats, clip_norm)
    released = private_moment_release(
        teacher,
        len(train),
        lambda indices: train.batch_tensors(indices)[0],
        query,
        ctx.ledger,
        noise,
        int(stats.batch_size),
        ctx.device,
    )
    with GroupNormInputs(teacher) as probe:
        channels = probe.channels
    statistics = FeatureStatistics.from_moments(
        released.means[0].float(), channels, min_variance=float(stats.min_variance)
    )
    return statistics, max(float(released.counts[0]), query.min_count)


# ------------------------------------------------------------------ alignment
def gaussian_blur(images: torch.Tensor, kernel_size: int, sigma: float | None = None) -> torch.Tensor:
    """Separable Gaussian low-pass filter with reflect padding (A.6; Haddad et al. 1991)."""
    if kernel_size <= 1:
        return images
    if kernel_size % 2 == 0:
        raise ConfigError(f"synthesis.blur_kernel must be odd, got {kernel_size}")
    sigma = 0.3 * ((kernel_size - 1) * 0.5 - 1) + 0.8 if sigma is None else float(sigma)
    offsets = torch.arange(kernel_size, dtype=images.dtype) - (kernel_size - 1) / 2
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = kernel / kernel.sum()
    channels = images.shape[1]
    pad = kernel_size // 2
    mode = "reflect" if min(images.shape[2:]) > pad else "replicate"
    x = F.pad(images, (pad, pad, pad, pad), mode=mode)
    x = F.conv2d(x, kernel.view(1, 1, 1, -1).repeat(channels, 1, 1, 1), groups=channels)
    return F.conv2d(x, kernel.view(1, 1, -1, 1).repeat(channels, 1, 1, 1), groups=channels)


def _public_size(ctx: RunContext) -> int:
    return 0 if ctx.public is None else len(ctx.public)


def initial_images(ctx: RunContext, num: int, stream: str = "sampling") -> torch.Tensor:
    """``num`` starting images in [-1, 1]-scale, ``[num, C, H, W]`` (Algorithm 1 line 1).

    ``init: public`` draws public images without replacement (cycling through fresh permutations
    when ``num`` exceeds the public set); ``init: noise`` draws ``N(0, noise_std²)``, optionally
    blurred (A.6). Both draw from the run seed's named ``stream``: this is not DP noise and touches no private data.
    """
    synthesis = ctx.section.synthesis
    generator = ctx.rng(stream)
    if synthesis.init == "public":
        if ctx.public is None:
            raise ConfigError("synthesis.init is 'public' but data.public is not set; set one or use init: noise")
        public_images, _ = ctx.public.to_tensors()
        if tuple(public_images.shape[1:]) != tuple(ctx.image_shape):
            raise ConfigError(
                f"public images {tuple(public_images.shape[1:])} do not match the private {tuple(ctx.image_shape)}"
            )
        rounds = math.ceil(num / len(public_images))
        order = torch.cat([torch.randperm(len(public_images), generator=generator) for _ in range(rounds)])
        return public_images[order[:num]].clone()
    if synthesis.init == "noise":
        noise = torch.randn((num, *ctx.image_shape), generator=generator) * float(synthesis.noise_std)
        noise = gaussian_blur(noise, int(synthesis.blur_kernel), synthesis.blur_sigma)
        return noise.clamp(-1.0, 1.0)
    raise ConfigError(f"synthesis.init must be 'public' or 'noise', got {synthesis.init!r}")


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """``R_tv = sum_ij sqrt((x_{i,j+1} − x_ij)² + (x_{i+1,j} − x_ij)²)`` (Eq. 3), summed over the batch."""
    right = images[..., :-1, 1:] - images[..., :-1, :-1]
    down = images[..., 1:, :-1] - images[..., :-1, :-1]
    return torch.sqrt(right.pow(2) + down.pow(2) + 1e-8).sum()


def synthesis_loss(
    teacher: torch.nn.Module,
    captured: GroupNormInputs,
    images: torch.Tensor,
    targets: torch.Tensor,
    statistics: FeatureStatistics,
    weights: SynthesisSection,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``R_total = α_f R_feature + α_c R_classif + α_tv R_tv + α_l2 R_l2`` (Eq. 5) and its parts."""
    logits = teacher(images)
    parts = {
        "feature": feature_loss(captured.captured(), statistics),
        "ce": F.cross_entropy(logits, targets),
        "tv": total_variation(images),
        "l2": images.pow(2).sum(),  # Eq. 4
    }
    total = (
        float(weights.alpha_feature) * parts["feature"]
        + float(weights.alpha_ce) * parts["ce"]
        + float(weights.alpha_tv) * parts["tv"]
        + float(weights.alpha_l2) * parts["l2"]
    )
    return total, {name: float(value.detach()) for name, value in parts.items()}


def align_batch(
    teacher: torch.nn.Module,
    statistics: FeatureStatistics,
    images: torch.Tensor,
    targets: torch.Tensor,
    synthesis: SynthesisSection,
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Algorithm 1 lines 3–7 on one batch: ``k`` Adam steps on the images, teacher frozen.

    Pixels are kept in the valid [-1, 1] range after every step (they are released as uint8).
    With ``early_stop_patience = p > 0`` the batch stops once ``R_tv`` rose ``p`` steps in a row:
    the paper finds accuracy falls when the image prior starts degrading (§5.2, Fig. 4b).
    Returns the aligned images and one record of the loss terms per iteration.
    """
    iterations = int(synthesis.iterations)
    if iterations < 0:
        raise ConfigError(f"synthesis.iterations must be >= 0, got {iterations}")
    x = images.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=float(synthesis.lr), betas=tuple(synthesis.betas))
    history: list[dict[str, float]] = []
    patience, rises = int(synthesis.early_stop_patience), 0
    with GroupNormInputs(teacher) as captured:
        for _ in range(iterations):
            optimizer.zero_grad(set_to_none=True)
            total, parts = synthesis_loss(teacher, captured, x, targets, statistics, synthesis)
            total.backward()
            optimizer.step()
            with torch.no_grad():
                x.clamp_(-1.0, 1.0)
            history.append({"total": float(total.detach()), **parts})
            rises = rises + 1 if len(history) > 1 and parts["tv"] > history[-2]["tv"] else 0
            if patience > 0 and rises >= patience:
                break
    return x.detach(), history


def align(
    teacher: torch.nn.Module,
    statistics: FeatureStatistics,
    initial: torch.Tensor,
    targets: torch.Tensor,
    synthesis: SynthesisSection,
    device: torch.device,
    log: Any = None,
) -> torch.Tensor:
    """Align all images batch by batch (progress bar on stderr); returns ``[N, C, H, W]`` on CPU."""
    teacher.eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)  # only x̂ is optimised (§4.2)
    batch_size = int(synthesis.batch_size)
    if batch_size < 1:
        raise ConfigError(f"synthesis.batch_size must be positive, got {batch_size}")
    aligned, first, last = [], None, None
    starts = range(0, len(initial), batch_size)
    for start in tqdm(starts, desc="DP-ImgSyn alignment", unit="batch", dynamic_ncols=True, leave=False):
        images, history = align_batch(
            teacher,
            statistics,
            initial[start : start + batch_size].to(device),
            targets[start : start + batch_size].to(device),
            synthesis,
        )
        aligned.append(images.cpu())
        if history:
            first = first or history[0]
            last = history[-1]
    if log is not None and first is not None:
        log(
            f"dp-imgsyn alignment: k={synthesis.iterations}, R_feature {first['feature']:.4g} -> "
            f"{last['feature']:.4g}, CE {first['ce']:.4g} -> {last['ce']:.4g} (first / last batch)"
        )
    return torch.cat(aligned) if aligned else initial[:0]


# --------------------------------------------------------------------- release
@torch.no_grad()
def release(
    teacher: torch.nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor,
    spec: ReleaseSection,
    device: torch.device,
    batch_size: int = 512,
) -> Samples:
    """Quantise the images to uint8 and label them with the teacher's soft labels (§4.3).

    Soft labels are computed on the *released* (quantised) pixels, so a student sees exactly the
    image the label belongs to.
    """
    temperature = float(spec.temperature)
    if not temperature > 0:
        raise ConfigError(f"release.temperature must be positive, got {temperature}")
    if spec.labels not in ("teacher", "target"):
        raise ConfigError(f"release.labels must be 'teacher' or 'target', got {spec.labels!r}")
    pixels = tensor_to_uint8(images)
    quantised = uint8_to_tensor(pixels)
    soft = []
    for start in range(0, len(quantised), batch_size):
        logits = teacher(quantised[start : start + batch_size].to(device)).float().cpu()
        soft.append(torch.softmax(logits / temperature, dim=1))
    soft_labels = torch.cat(soft) if soft else torch.zeros(0, 0)
    labels = soft_labels.argmax(1) if spec.labels == "teacher" else targets
    return Samples(
        images=np.ascontiguousarray(pixels),
        labels=labels.numpy().astype(np.int64),
        soft_labels=soft_labels.numpy().astype(np.float32),
    )
