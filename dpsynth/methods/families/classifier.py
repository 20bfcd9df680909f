"""A classifier trained with DP-SGD on the private train split, through the shared driver.

Shared by the ``dpsgd-classifier`` baseline (Abadi et al., "Deep Learning with Differential
Privacy", arXiv:1607.00133) and DP-ImgSyn's teacher (Soufleri et al., "DP-ImgSyn: Dataset
Alignment for Obfuscated, Differentially Private Image Synthesis", TMLR 2024, §4.1): its config
section, its privacy plan, the training itself, and the per-example losses the audit scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from pydantic import Field

from dpsynth.data.section import DataSection
from dpsynth.data.transforms import uint8_to_tensor
from dpsynth.dpsgd.estimate import PrivateNetwork, planned_image_geometry
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.dpsgd.training import train_private
from dpsynth.models.classifiers import CLASSIFIERS, build_classifier
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


def build_section_classifier(ctx: Any, section: ClassifierSection) -> torch.nn.Module:
    """The (untrained) network a classifier section names, for the run's image shape and classes."""
    channels, size, _ = ctx.image_shape
    torch.manual_seed(stream_seed(ctx.seed, "model-init"))
    return build_classifier(section.model, channels, ctx.num_classes, size, preset=section.preset).to(ctx.device)


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


def train_dp_classifier(
    ctx: Any,
    section: ClassifierSection,
    *,
    mechanism: str = "dpsgd",
    reserve: Sequence[Any] = (),
    desc: str = "DP-SGD classifier",
) -> torch.nn.Module:
    """Train ``section.model`` on the private train split with DP-SGD; return it (EMA if enabled).

    σ is the planned one (``ctx.plan``), so the run spends exactly what ``--dry-run`` announced.
    """
    model = build_section_classifier(ctx, section)
    train = ctx.data.train  # read a Poisson batch at a time: a memory-mapped set is never loaded whole

    def make_batch(indices: torch.Tensor, draws: Any) -> dict[str, torch.Tensor]:
        images, labels = train.batch_tensors(indices)
        return {"x": images, "y": labels}  # no random inputs

    settings = section.private_training(ctx.plan.noise_multiplier(mechanism))
    engine = train_private(
        ctx,
        model,
        classification_loss,
        make_batch,
        ctx.data.train.record_keys,
        settings,
        mechanism=mechanism,
        reserve=reserve,
        desc=desc,
    )
    return engine.ema_model if settings.ema_decay else model


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
