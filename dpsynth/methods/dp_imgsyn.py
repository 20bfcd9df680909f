"""DP-ImgSyn: dataset alignment for obfuscated, differentially private image synthesis.

Soufleri, Ravikumar & Roy, "DP-ImgSyn: Dataset Alignment for Obfuscated, Differentially Private Image
Synthesis", TMLR 2024 (openreview.net/forum?id=KleJZ9ZzYw). Three steps:

1. **Teacher** (§4.1): a GroupNorm classifier trained with DP-SGD on the private train split: the classifier
   family's skeleton (:class:`~dpsynth.methods.families.classifier.ClassifierMethod`) on the ``teacher``
   section. Its σ is calibrated with the statistics mechanism *reserved*, so the composed total after
   step 2 still meets the target ε.
2. **DP statistics** (§4.1): each private example's channel means and second moments of every GroupNorm
   input, clipped to L2 norm ``C``, summed, and released with Gaussian noise with a noisy count, as one
   bounded-sum release (:mod:`dpsynth.inversion.statistics`).
3. **Alignment and release** (§4.2–4.3, Algorithm 1): public images (or noise) are optimised on
   ``α_f R_feature + α_c CE + α_tv R_tv + α_l2 R_l2`` (Eq. 1–5) with the teacher frozen, and released with
   the teacher's soft labels (:mod:`dpsynth.inversion.alignment`): post-processing, no privacy cost.

``fit`` does steps 1–2; the released state is the teacher, the noisy statistics, C and the noisy count, so
``generate`` (step 3) runs in any later process. ``synthesis.iterations: 0`` is DP-ImgSyn(0): the public
images themselves, labelled by the teacher.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from dpsynth.contract import EvaluationProtocol, Phase, RunConfig, RunContext, Samples, register_method
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.inversion.alignment import ReleaseSection, SynthesisSection, align, initial_images, soft_label_release
from dpsynth.inversion.feature_stats import FeatureStatistics
from dpsynth.inversion.statistics import (
    StatsSection,
    release_feature_statistics,
    statistics_clip_norm,
    statistics_mechanisms,
)
from dpsynth.methods.families.classifier import ClassifierMethod, ClassifierSection
from dpsynth.privacy.mechanisms import Mechanism
from dpsynth.report.balance import balanced_labels
from dpsynth.schema import Section, with_defaults

TEACHER_MECHANISM = "dp-imgsyn-teacher"
STATS_MECHANISM = "dp-imgsyn-statistics"
#: test records the logged teacher accuracy reads (at 10^6 images the whole test split took a minute)
TEACHER_DIAGNOSTIC_RECORDS = 10_000
#: public images (at most) whose moment norms set C when ``stats.clip_norm`` is null
CLIP_PROBE_IMAGES = 512


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
class DPImgSyn(ClassifierMethod):
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
    mechanism = TEACHER_MECHANISM
    section_key = "teacher"
    role = "DP-ImgSyn teacher"
    diagnostic_records = TEACHER_DIAGNOSTIC_RECORDS

    def __init__(self) -> None:
        super().__init__()
        self.statistics: FeatureStatistics | None = None
        self.clip_norm: float | None = None
        self.noisy_count: float | None = None

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

    def reserved_mechanisms(self, config: RunConfig) -> list[Mechanism]:
        """The statistics release that follows the teacher (two Gaussians as one)."""
        return statistics_mechanisms(config.section.stats, name=STATS_MECHANISM)

    def build_network(self, ctx: RunContext) -> torch.nn.Module:
        """The teacher; one without GroupNorm fails here, before anything is spent (§4.1 needs its inputs)."""
        model = super().build_network(ctx)
        if not any(isinstance(module, torch.nn.GroupNorm) for module in model.modules()):
            spec = ctx.section.teacher
            raise ConfigError(f"teacher.model {spec.model!r} has no GroupNorm layer; DP-ImgSyn needs one (§4.1)")
        return model

    def fit(self, ctx: RunContext) -> None:
        """Train the DP teacher, then release the DP GroupNorm statistics (both on the ledger).

        The statistics are one release, kept by the runner's released checkpoint right after ``fit``. A run
        killed before its charge was stored published nothing of it and releases it on resume (the teacher
        resumes from its DP-SGD checkpoints); one whose stored ledger holds the charge but that has no released
        checkpoint lost a result it paid for, and repeating it would spend more than the plan: refused.
        """
        if ctx.releases_spent(STATS_MECHANISM):
            raise PrivacyError(
                f"{STATS_MECHANISM} was charged but the run stopped before its result was saved; repeating it "
                "would spend more than the plan: start a new run"
            )
        super().fit(ctx)
        stats = ctx.section.stats
        probe_size = min(CLIP_PROBE_IMAGES, (0 if ctx.public is None else len(ctx.public)) or CLIP_PROBE_IMAGES)
        self.clip_norm = statistics_clip_norm(
            self.model, stats, lambda: self._initial_images(ctx, probe_size, "clip-probe"), ctx.device
        )
        self.statistics, self.noisy_count = release_feature_statistics(
            self.model,
            ctx.data.train,
            stats,
            self.clip_norm,
            ctx.ledger,
            ctx.noise_source(),
            name=STATS_MECHANISM,
            device=ctx.device,
        )
        ctx.log(
            f"dp-imgsyn: statistics released (C={self.clip_norm:.4g}, noisy count {self.noisy_count:.1f}); "
            f"eps={ctx.ledger.epsilon():.4f} of {ctx.ledger.target_epsilon}"
        )

    def state_dict(self) -> dict[str, Any]:
        """The teacher's weights, the noisy statistics, C (public) and the noisy count."""
        return {
            **super().state_dict(),
            "statistics": self.statistics.state_dict(),
            "clip_norm": self.clip_norm,
            "noisy_count": self.noisy_count,
        }

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        super().load_state_dict(state, ctx)
        self.statistics = FeatureStatistics.from_state_dict(state["statistics"])
        self.clip_norm, self.noisy_count = float(state["clip_norm"]), float(state["noisy_count"])

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

    def _initial_images(self, ctx: RunContext, num: int, stream: str) -> torch.Tensor:
        return initial_images(ctx.section.synthesis, num, ctx.image_shape, ctx.public, ctx.rng(stream))

    def generate(self, ctx: RunContext, num: int) -> Samples:
        """Align ``num`` initial images to the private statistics (Algorithm 1) and label them (§4.3)."""
        initial = self._initial_images(ctx, num, "sampling")
        targets = torch.from_numpy(balanced_labels(num, ctx.num_classes))
        statistics = self.statistics.to(ctx.device)
        aligned = align(self.model, statistics, initial, targets, ctx.section.synthesis, ctx.device, log=ctx.log)
        return soft_label_release(self.model, aligned, targets, ctx.section.release, ctx.device)
