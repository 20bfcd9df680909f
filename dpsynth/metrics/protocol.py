"""One evaluation protocol per method: how downstream classifiers learn a release and which epoch is tested.

A method declares its protocol (:meth:`dpsynth.contract.Method.evaluation_protocol`); a run's ``evaluate``
section and a caller (``dpsynth evaluate`` flags, ``dpsynth.evaluate`` keywords) may override single fields,
and :func:`resolve_protocol` records where every overridden field came from, so that ``dpsynth run``,
``dpsynth evaluate RUN`` and the Python API report the same number for the same run and seeds
(docs/evaluation.md, "One protocol").

The default is the hard-label protocol of the seed papers and DPImageBench ("DPImageBench: A Unified
Benchmark for Differentially Private Image Synthesis", arXiv:2503.14681): classifiers trained from scratch
with cross-entropy on the synthetic labels, the epoch chosen on a held-out synthetic split (free).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pydantic
from pydantic import Field

from dpsynth.dpsgd.scaling import pixel_factor
from dpsynth.errors import ConfigError
from dpsynth.rundir import PRIVACY_FILE
from dpsynth.schema import Section

SEED_PAPER_MODELS = ("logreg", "mlp", "cnn")
BENCHMARK_MODELS = ("wrn-40-4", "resnet", "resnext")
SELECTIONS = ("synthetic", "private-val", "last")
LABELS = ("hard", "soft")
PRESETS = ("cpu", "gpu")
#: every metric ``dpsynth evaluate`` computes (``--metrics``, a config's ``evaluate.metrics``)
METRICS = ("accuracy", "fid", "is", "kid", "precision", "recall", "model_selection", "audit", "canary", "run_canary")
DEFAULT_METRICS = ("accuracy", "fid", "kid", "precision", "recall")
FIDELITY_METRICS = ("fid", "kid", "precision", "recall")
FID_REFERENCES = ("train", "test")  # the real split the fidelity metrics compare with
AUDIT_METRICS = ("audit", "canary", "run_canary")
#: where a field's value came from, lowest precedence first
METHOD, SIZE_RULE, EVALUATE_SECTION, CALL, SAMPLES = "method", "size rule", "evaluate section", "call", "samples"
#: the size rule (:func:`size_protocol`): a release of at least this many synthetic images is scored by its
#: method's protocol as declared; the smallest release of a shipped benchmark preset (mnist10k-cpu) is 2,000
FULL_PROTOCOL_SAMPLES = 1000
#: a smaller release: one classifier training reads at most this many 28x28 grey examples (the CNN's forward and
#: backward pass took 0.6 ms an example on one idle core, so about 3 s a training, a few seconds for three seeds
#: on 2 idle cores and well under a minute on a loaded one) ...
SMALL_RELEASE_EXAMPLES = 5_000
#: ... but never fewer epochs than the default protocol's
MIN_SIZED_EPOCHS = 10

Selection = Literal["synthetic", "private-val", "last"]


def parse_metrics(spec: str | Sequence[str] | None) -> list[str]:
    """``"fid,accuracy"`` or a list → validated metric names (default: accuracy and fidelity)."""
    if spec is None or spec == "" or spec == []:
        return list(DEFAULT_METRICS)
    names = [m.strip().lower() for m in (spec.split(",") if isinstance(spec, str) else spec) if m.strip()]
    unknown = [m for m in names if m not in METRICS]
    if unknown:
        raise ConfigError(f"unknown metric(s) {', '.join(unknown)} (known: {', '.join(METRICS)})")
    return list(dict.fromkeys(names))


@dataclasses.dataclass
class TrainConfig:
    """How a downstream classifier is trained (non-private: synthetic data are public)."""

    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    preset: str = "cpu"
    max_steps: int | None = None  # cap on optimisation steps (fast tests and smoke runs)
    val_fraction: float = 0.1  # held-out synthetic share for "synthetic" selection
    kd_temperature: float = 1.0  # T of dp-imgsyn Eq. 6/7 (the paper: 100 for MNIST, 10 for CelebA)
    eval_batch_size: int = 512


@dataclasses.dataclass(frozen=True)
class EvaluationProtocol:
    """The downstream-classifier protocol of a method (train on synthetic, test on the real test split).

    ``models`` None means the preset's family: ``logreg, mlp, cnn`` on ``cpu``, ``wrn-40-4, resnet,
    resnext`` on ``gpu``. ``labels="soft"`` distils the released soft labels at ``kd_temperature``
    (DP-ImgSyn (TMLR 2024) Eq. 6/7); samples without soft labels are learned from their hard labels.
    ``selection``: ``synthetic`` (best epoch on a held-out ``val_fraction`` of the synthetic set), ``last``
    or ``private-val`` (noisy, charged to the run's ledger; never a method default). No data augmentation:
    DPImageBench trains its classifiers on the synthetic tensors as they are, and so does every protocol here.
    """

    models: tuple[str, ...] | None = None
    preset: Literal["cpu", "gpu"] = "cpu"
    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_steps: int | None = None
    labels: Literal["hard", "soft"] = "hard"
    kd_temperature: float = 1.0
    selection: Selection = "synthetic"
    val_fraction: float = 0.1
    seeds: int = 3

    def __post_init__(self) -> None:
        if self.models is not None:
            object.__setattr__(self, "models", tuple(str(m) for m in self.models))
            if not self.models:
                raise ConfigError("evaluation protocol: models must name at least one classifier")
        checks = (
            (self.preset in PRESETS, f"preset must be one of {', '.join(PRESETS)}"),
            (self.labels in LABELS, f"labels must be one of {', '.join(LABELS)}"),
            (self.selection in SELECTIONS, f"selection must be one of {', '.join(SELECTIONS)}"),
            (int(self.epochs) >= 1, "epochs must be at least 1"),
            (int(self.batch_size) >= 1, "batch_size must be at least 1"),
            (float(self.lr) > 0, "lr must be positive"),
            (float(self.weight_decay) >= 0, "weight_decay must be non-negative"),
            (self.max_steps is None or int(self.max_steps) >= 1, "max_steps must be at least 1"),
            (float(self.kd_temperature) > 0, "kd_temperature must be positive"),
            (0 <= float(self.val_fraction) < 1, "val_fraction must be in [0, 1)"),
            (int(self.seeds) >= 1, "seeds must be at least 1"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"evaluation protocol: {message}")

    @property
    def model_names(self) -> tuple[str, ...]:
        """The classifiers to train: ``models``, or the preset's family."""
        if self.models is not None:
            return self.models
        return SEED_PAPER_MODELS if self.preset == "cpu" else BENCHMARK_MODELS

    def train_config(self) -> TrainConfig:
        """The :class:`TrainConfig` of one classifier training."""
        return TrainConfig(
            epochs=int(self.epochs),
            batch_size=int(self.batch_size),
            lr=float(self.lr),
            weight_decay=float(self.weight_decay),
            preset=self.preset,
            max_steps=None if self.max_steps is None else int(self.max_steps),
            val_fraction=float(self.val_fraction) if self.selection == "synthetic" else 0.0,
            kd_temperature=float(self.kd_temperature),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, ``models`` resolved to the classifiers actually trained."""
        fields = dataclasses.asdict(self)
        fields["models"] = list(self.model_names)
        return fields


FIELDS = tuple(field.name for field in dataclasses.fields(EvaluationProtocol))


@dataclasses.dataclass(frozen=True)
class Sizing:
    """One field the size rule set: its value and why (printed, and recorded in ``meta.protocol_sizing``)."""

    field: str
    value: Any
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "value": list(self.value) if isinstance(self.value, tuple) else self.value,
            "why": self.why,
        }


def size_protocol(
    protocol: EvaluationProtocol, num_samples: int, shape: Sequence[int] | None = None
) -> tuple[EvaluationProtocol, list[Sizing]]:
    """The size rule of the downstream evaluation (docs/evaluation.md, "Sized by the release"): the method's
    ``protocol`` for a release of ``num_samples`` synthetic images of ``shape`` (H, W, C), and each field it
    changed with why. Inputs are the release's size and image shape only (public: the release itself), so
    it spends no privacy and gives the same protocol to ``dpsynth run``, ``dpsynth evaluate`` and the API.

    * ``num_samples >= FULL_PROTOCOL_SAMPLES``: the protocol as declared (DPImageBench's classifiers at
      60,000 samples, every shipped benchmark preset's as it was);
    * below: classifiers at the ``cpu`` preset, those outside the seed papers' ``logreg, mlp, cnn`` replaced by
      ``cnn`` (a few hundred images do not train a network of millions of parameters better than the 0.1M
      CNN: the same argument as the ``auto`` presets' model tiers, Tramèr & Boneh, arXiv:2011.11660, §3), and
      epochs cut to ``max(MIN_SIZED_EPOCHS, ceil(SMALL_RELEASE_EXAMPLES / (num_samples * f)))``, ``f`` the
      pixel factor of the ``auto`` rule (C·H·W / 784, at least 0.25), so one training reads about
      ``SMALL_RELEASE_EXAMPLES`` 28x28 grey examples (seconds on a CPU); the seeds stay as declared.
    """
    n = int(num_samples)
    if n >= FULL_PROTOCOL_SAMPLES:
        return protocol, []
    height, width, channels = (tuple(int(v) for v in shape) if shape is not None else (28, 28, 1))[:3]
    factor = pixel_factor((channels, height, width))
    small = f"{n} synthetic images, under {FULL_PROTOCOL_SAMPLES}"
    sizings: list[Sizing] = []
    values: dict[str, Any] = {}
    declared = protocol.model_names
    models = tuple(dict.fromkeys(name if name in SEED_PAPER_MODELS else "cnn" for name in declared))
    if models != declared:
        why = f"{small}: too few to train {', '.join(declared)}; the seed papers' CNN (0.1M parameters) instead"
        values["models"] = models
        sizings.append(Sizing("models", models, why))
    if protocol.preset != "cpu":
        values["preset"] = "cpu"
        sizings.append(Sizing("preset", "cpu", f"{small}: the small networks of the same families"))
    cap = max(MIN_SIZED_EPOCHS, math.ceil(SMALL_RELEASE_EXAMPLES / (n * factor)))
    if protocol.epochs > cap:
        why = (
            f"{small}: at most max({MIN_SIZED_EPOCHS}, ceil({SMALL_RELEASE_EXAMPLES} / ({n} x {factor:.3g}))) epochs, "
            f"{SMALL_RELEASE_EXAMPLES} examples at 28x28 grey a training (was {protocol.epochs})"
        )
        values["epochs"] = cap
        sizings.append(Sizing("epochs", cap, why))
    sized = dataclasses.replace(protocol, **values) if values else protocol
    return sized, sizings


@dataclasses.dataclass(frozen=True)
class ResolvedProtocol:
    """A method's protocol after the size rule and the overrides, the seeds to train with and the source of
    each field that is not the method's."""

    protocol: EvaluationProtocol
    seeds: tuple[int, ...]
    overrides: dict[str, str]  # field -> SIZE_RULE | EVALUATE_SECTION | CALL | SAMPLES (the method's are absent)
    sizing: tuple[Sizing, ...] = ()  # what the size rule set, and why (kept where nothing overrode it)

    def meta(self) -> dict[str, Any]:
        """What ``metrics.json`` records under ``meta``: the protocol used and what overrode the method's."""
        meta = {"protocol": self.protocol.to_dict(), "protocol_overrides": dict(self.overrides)}
        if self.sizing:
            meta["protocol_sizing"] = [sizing.to_dict() for sizing in self.sizing]
        return meta


def resolve_protocol(
    base: EvaluationProtocol,
    section: Mapping[str, Any] | None = None,
    call: Mapping[str, Any] | None = None,
    seeds: int | Sequence[int] | None = None,
    sizing: Sequence[Sizing] = (),
) -> ResolvedProtocol:
    """``base`` (the method's, after the size rule's ``sizing``), overridden by the non-null fields of a run's
    ``evaluate`` ``section``, then by ``call`` (a CLI flag or a keyword given explicitly). ``seeds`` (a count or
    a list, from the call) sets the classifier seeds; a count ``n`` means seeds ``0 .. n-1``."""
    overrides: dict[str, str] = {sized.field: SIZE_RULE for sized in sizing}
    values = dataclasses.asdict(base)
    for source, layer in ((EVALUATE_SECTION, section or {}), (CALL, call or {})):
        for key, value in layer.items():
            if key not in FIELDS:
                raise ConfigError(f"unknown evaluation protocol field {key!r} (known: {', '.join(FIELDS)})")
            if value is None:
                continue
            values[key] = tuple(value) if key == "models" else value
            overrides[key] = source
    seed_list: tuple[int, ...] | None = None
    if seeds is not None:
        seed_list = tuple(range(seeds)) if isinstance(seeds, int) else tuple(int(s) for s in seeds)
        if not seed_list:
            raise ConfigError("seeds must be at least 1")
        values["seeds"] = len(seed_list)
        overrides["seeds"] = CALL
    protocol = EvaluationProtocol(**values)
    kept = tuple(sized for sized in sizing if overrides.get(sized.field) == SIZE_RULE)  # an explicit value wins
    return ResolvedProtocol(protocol, seed_list or tuple(range(protocol.seeds)), overrides, kept)


def without_soft_labels(resolved: ResolvedProtocol) -> ResolvedProtocol:
    """The protocol for samples that carry no soft labels: knowledge distillation needs them, so the
    classifiers learn the hard labels (recorded as an override from the samples)."""
    if resolved.protocol.labels == "hard":
        return resolved
    protocol = dataclasses.replace(resolved.protocol, labels="hard")
    return ResolvedProtocol(protocol, resolved.seeds, {**resolved.overrides, "labels": SAMPLES}, resolved.sizing)


# ------------------------------------------------------------------ the config section
class EvaluateSection(Section):
    """After-run evaluation. Null protocol keys keep the method's own evaluation protocol
    (``Method.evaluation_protocol``, docs/evaluation.md "One protocol"); a value overrides it and is
    recorded in ``diagnostics/metrics.json`` (``meta.protocol_overrides``)."""

    metrics: list[str] = Field(
        default_factory=list, description="metrics computed right after the run (and by `dpsynth evaluate RUN`)"
    )
    seeds: int | None = Field(None, ge=1, description="downstream training seeds; null: the method's protocol")
    models: list[str] | None = Field(None, description="downstream classifiers; null: the method's protocol")
    preset: Literal["cpu", "gpu"] | None = Field(None, description="classifier sizes; null: the method's protocol")
    epochs: int | None = Field(None, ge=1, description="downstream training epochs; null: the method's protocol")
    lr: float | None = Field(None, gt=0, description="downstream Adam learning rate; null: the method's protocol")
    batch_size: int | None = Field(None, ge=1, description="downstream batch size; null: the method's protocol")
    labels: Literal["hard", "soft"] | None = Field(
        None, description="hard: cross-entropy on labels; soft: distil soft_labels; null: the method's protocol"
    )
    kd_temperature: float | None = Field(
        None, gt=0, description="distillation temperature of soft labels (dp-imgsyn Eq. 7); null: the method's"
    )
    selection: Literal["synthetic", "last"] | None = Field(
        None, description="epoch selection: held-out synthetic or last; null: the method's protocol"
    )
    audit: bool = Field(False, description="membership-inference audit of the samples (not private: custodian only)")
    dpsgd_baseline: bool = Field(
        False,
        description="also train the DP-SGD classifier baseline at the run's epsilon (a separate release in "
        f"RUN/baseline-dpsgd with its own {PRIVACY_FILE}) and show its accuracy beside the release's",
    )
    dpsgd_baseline_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="keys of the baseline's dpsgd-classifier section (e.g. {steps: 50}); unset keys: its defaults, "
        "the batch capped at a tenth of the train set",
    )
    fid_samples: int | None = Field(
        None, ge=2, description="FID/KID/precision/recall on at most this many images per side; null: all of them"
    )
    fid_reference: Literal["train", "test"] = Field(
        "train", description="the real split the fidelity metrics compare the samples with"
    )
    fid_cache: str | None = Field(
        None,
        description="directory for the Inception features of the real (private) FID reference, shared by runs "
        "on the same data; keep it with the runs, never publish it; null: the run's diagnostics/inception",
    )

    @pydantic.field_validator("metrics")
    @classmethod
    def _known_metrics(cls, metrics: list[str]) -> list[str]:
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise ValueError(f"unknown metric {unknown[0]!r}; allowed: {', '.join(METRICS)}")
        return metrics
