"""The classifier family: a classifier trained with DP-SGD on the private train split, and its released weights.

:class:`ClassifierMethod` is the skeleton of the ``dpsgd-classifier`` baseline (Abadi et al., "Deep Learning
with Differential Privacy", arXiv:1607.00133, Algorithm 1) and of DP-ImgSyn's teacher (Soufleri et al.,
"DP-ImgSyn: Dataset Alignment for Obfuscated, Differentially Private Image Synthesis", TMLR 2024, §4.1): its
config section, its privacy plan (one DP-SGD mechanism, σ calibrated with the mechanisms a subclass spends
after it reserved), the training itself through :func:`dpsynth.dpsgd.training.train_private` (which
checkpoints and resumes its steps), the released state (the weights), and the per-example losses the audit
scores. A subclass states what differs: where its classifier section sits, the ledger name, the mechanisms it
reserves, what it adds to the network check and to the released state.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from pydantic import Field

from dpsynth.contract import Method, PrivateNetwork, RunConfig, RunContext
from dpsynth.data.resident import ResidentRecords
from dpsynth.data.section import DataSection
from dpsynth.data.transforms import uint8_to_tensor
from dpsynth.dpsgd.estimate import planned_image_geometry
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.dpsgd.training import train_private
from dpsynth.models.classifiers import CLASSIFIERS, build_classifier
from dpsynth.privacy.mechanisms import Mechanism
from dpsynth.privacy.plan import PrivacyPlan, plan_with_dpsgd
from dpsynth.schema import with_defaults
from dpsynth.seeding import stream_seed


class ClassifierSection(
    with_defaults(
        DPSGDSection,
        "ClassifierDPSGD",
        "DP-SGD keys with the classifier baseline's defaults.",
        optimizer="sgd",
        lr=2.0,
        clip_norm=0.1,
        physical_batch_size=128,
    )
):  # type: ignore[misc]
    """DP-SGD classifier settings (the ``dpsgd-classifier`` section; DP-ImgSyn's ``teacher``)."""

    model: str = Field("cnn", description=f"classifier: {' | '.join(CLASSIFIERS)}")
    preset: Literal["cpu", "gpu"] = Field("cpu", description="cpu (small) or gpu (paper size) network")

    @pydantic.field_validator("model")
    @classmethod
    def _known_model(cls, model: str) -> str:
        if model not in CLASSIFIERS:
            raise ValueError(f"expected one of {', '.join(CLASSIFIERS)}")
        return model


def classification_loss(model_call: Any, example: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of one example (or of its K augmented copies, averaged)."""
    images, labels = example["x"], example["y"]
    if images.dim() == 3:  # a single view [C, H, W]
        images, labels = images.unsqueeze(0), labels.unsqueeze(0)
    return F.cross_entropy(model_call(images), labels)


def classifier_network(key: str, section: ClassifierSection, data: DataSection) -> PrivateNetwork:
    """The :class:`PrivateNetwork` of a classifier section (``key``: its dotted config key), at the image shape
    and class count the ``data`` section declares (for the dry run's estimate; no data is read)."""
    (channels, size, _), classes = planned_image_geometry(data)

    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(rows, channels, size, size),)

    return PrivateNetwork(
        key=key,
        build=lambda: build_classifier(section.model, channels, classes, size, preset=section.preset),
        inputs=inputs,
        training=section.private_training(),
    )


class ClassifierMethod(Method):
    """A classifier trained with DP-SGD on the private train split (Abadi et al., Algorithm 1); releases its weights.

    ``fit`` trains it at the planned σ (so the run spends exactly what ``--dry-run`` announced), logs its test
    accuracy as a private diagnostic, and keeps it as :attr:`model`; :meth:`state_dict` is its weights, and
    :meth:`load_state_dict` rebuilds the network from the config and the run's shapes.
    """

    #: the ledger name of the DP-SGD mechanism (and of its step checkpoints)
    mechanism: ClassVar[str] = "dpsgd"
    #: the attribute of the method's section holding the :class:`ClassifierSection`; None: the section itself
    section_key: ClassVar[str | None] = None
    #: what the classifier is to the method: its progress bar and log lines
    role: ClassVar[str] = "DP-SGD classifier"
    #: test records the logged accuracy reads (None: the whole test split)
    diagnostic_records: ClassVar[int | None] = None

    def __init__(self) -> None:
        self.model: Any = None
        self.test_accuracy: float | None = None

    @classmethod
    def classifier_section(cls, section: Any) -> ClassifierSection:
        """The classifier's settings inside the method's ``section``."""
        return section if cls.section_key is None else getattr(section, cls.section_key)

    def reserved_mechanisms(self, config: RunConfig) -> list[Mechanism]:
        """The mechanisms ``fit`` spends after the classifier; its σ is calibrated with them counted."""
        return []

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """The reserved mechanisms, then ``steps`` (or ``epochs·N/B``) DP-SGD steps at q = B/N."""
        settings = self.classifier_section(config.section).private_training()
        return plan_with_dpsgd(
            config.privacy,
            self.reserved_mechanisms(config),
            name=self.mechanism,
            sample_rate=settings.batch_size / num_examples,
            steps=settings.total_steps(num_examples),
            noise_multiplier=settings.noise_multiplier,
        )

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        key = self.name if self.section_key is None else f"{self.name}.{self.section_key}"
        return [classifier_network(key, self.classifier_section(config.section), config.data)]

    def build_network(self, ctx: RunContext) -> torch.nn.Module:
        """The untrained network the classifier section names, for the run's image shape and classes."""
        section = self.classifier_section(ctx.section)
        channels, size, _ = ctx.image_shape
        torch.manual_seed(stream_seed(ctx.seed, "model-init"))
        return build_classifier(section.model, channels, ctx.num_classes, size, preset=section.preset).to(ctx.device)

    def train_classifier(self, ctx: RunContext) -> torch.nn.Module:
        """Train :meth:`build_network` with DP-SGD at the planned σ; return it (its EMA if enabled).

        Private batches are read a Poisson batch at a time (a memory-mapped set is never loaded whole);
        the loss has no random inputs. ``train_private`` checkpoints the steps (phase :attr:`mechanism`)
        and resumes from them.
        """
        model = self.build_network(ctx)
        train = ctx.data.train

        def make_batch(indices: torch.Tensor, draws: Any) -> dict[str, torch.Tensor]:
            images, labels = train.batch_tensors(indices)
            return {"x": images, "y": labels}

        resident = ResidentRecords(train.to_tensors, ctx.device)  # copied at the first fixed-shape step only

        def device_batch(indices: torch.Tensor, draws: Any) -> dict[str, torch.Tensor]:
            images, labels = resident(indices)
            return {"x": images, "y": labels}

        settings = self.classifier_section(ctx.section).private_training(ctx.plan.noise_multiplier(self.mechanism))
        engine = train_private(
            ctx,
            model,
            classification_loss,
            make_batch,
            train.record_keys,
            settings,
            mechanism=self.mechanism,
            desc=self.role,
            device_batch=device_batch,
        )
        return engine.ema_model if settings.ema_decay else model

    def fit(self, ctx: RunContext) -> None:
        """Train the classifier and log its test accuracy (the test split is not on the ledger: a private
        diagnostic, on at most :attr:`diagnostic_records` records)."""
        self.model = self.train_classifier(ctx).eval()
        self.test_accuracy = accuracy(self.model, ctx.data.test, max_records=self.diagnostic_records)
        ctx.log(f"{self.name}: {self.role} test accuracy {100 * self.test_accuracy:.2f} %", private=True)

    def state_dict(self) -> dict[str, Any]:
        """The released weights, as CPU tensors."""
        return {"model": {key: value.detach().cpu() for key, value in self.model.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        self.model = self.build_network(ctx)
        self.model.load_state_dict(state["model"])
        self.model.eval()

    def example_losses(self, ctx: RunContext, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Per-example losses of the released classifier, the audit's loss attack (docs/audit.md)."""
        return example_losses(self.model, images, labels, ctx.device)


@torch.no_grad()
def accuracy(model: torch.nn.Module, dataset: Any, batch_size: int = 512, max_records: int | None = None) -> float:
    """Top-1 accuracy in [0, 1] of ``model`` on an ImageDataset (the real test split: public evaluation), read
    ``batch_size`` records at a time; ``max_records`` tests the first that many only (a log line's diagnostic
    need not grow with N)."""
    model.eval()
    count = len(dataset) if max_records is None else min(len(dataset), max_records)
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, count, batch_size):
        images, labels = dataset.batch_tensors(np.arange(start, min(start + batch_size, count)))
        correct += int((model(images.to(device)).argmax(1).cpu() == labels).sum())
    return correct / max(count, 1)


@torch.no_grad()
def example_losses(
    model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, device: torch.device, batch_size: int = 512
) -> np.ndarray:
    """Per-example cross-entropy of ``model`` on uint8 ``[N,H,W,C]`` images (the audit's loss attack)."""
    model.eval()
    inputs, targets = uint8_to_tensor(images), torch.as_tensor(labels, dtype=torch.int64)
    losses = [
        F.cross_entropy(
            model(inputs[i : i + batch_size].to(device)), targets[i : i + batch_size].to(device), reduction="none"
        ).cpu()
        for i in range(0, len(inputs), batch_size)
    ]
    return torch.cat(losses).numpy() if losses else np.zeros(0, np.float32)
