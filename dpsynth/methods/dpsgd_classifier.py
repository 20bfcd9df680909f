"""``dpsgd-classifier``: a classifier trained with DP-SGD directly on the private data.

The "non-synthetic" baseline row of the seed papers' tables (e.g. dp-diffusion-finetuning.txt
Table 1, dp-imgsyn.txt Table 2). It releases a model, not samples. The same training serves as
DP-ImgSyn's teacher (dp-imgsyn.txt §4.1), so :func:`train_dp_classifier` is public.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dpsynth.data.transforms import uint8_to_tensor
from dpsynth.dpsgd.training import PrivateTraining, train_private
from dpsynth.methods.base import Method, RunContext, Samples, register_method

CLASSIFIER_DEFAULTS: dict[str, Any] = {
    "model": "cnn",  # dpsynth.models.classifiers name: logreg | mlp | cnn | resnet18 | wrn40-4 | resnet | resnext
    "preset": "cpu",  # cpu (small) or gpu (paper size)
    "batch_size": 256,  # expected Poisson batch size B
    "epochs": 10.0,
    "steps": None,  # overrides epochs when set
    "optimizer": "sgd",
    "lr": 2.0,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "max_grad_norm": 0.1,
    "noise_multiplier": None,  # null: calibrated to the budget
    "physical_batch_size": 128,
    "ema_decay": None,
    "checkpoint_every": 50,
}


def classification_loss(model_call: Any, example: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of one example (or of its K augmented copies, averaged)."""
    images, labels = example["x"], example["y"]
    if images.dim() == 3:  # a single view [C, H, W]
        images, labels = images.unsqueeze(0), labels.unsqueeze(0)
    return F.cross_entropy(model_call(images), labels)


def train_dp_classifier(ctx: RunContext, section: dict[str, Any], *, mechanism: str = "dpsgd",
                        reserve: Sequence[Any] = (), desc: str = "DP-SGD classifier") -> torch.nn.Module:
    """Train ``section['model']`` on the private train split with DP-SGD; return it (EMA if enabled)."""
    from dpsynth.models.classifiers import build_classifier

    channels, size, _ = ctx.image_shape
    model = build_classifier(section["model"], channels, ctx.num_classes, size, preset=section["preset"]).to(ctx.device)
    images, labels = ctx.data.train.to_tensors()

    def make_batch(indices: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"x": images[indices], "y": labels[indices]}

    settings = PrivateTraining.from_section({k: v for k, v in section.items() if k in CLASSIFIER_DEFAULTS})
    if settings.steps is not None:
        settings.epochs = None
    engine = train_private(ctx, model, classification_loss, make_batch, len(images), settings,
                           mechanism=mechanism, reserve=reserve, desc=desc)
    return engine.ema_model if settings.ema_decay else model


def accuracy(model: torch.nn.Module, dataset: Any) -> float:
    """Top-1 accuracy of ``model`` on an :class:`ImageDataset` (the real test split: public evaluation)."""
    from dpsynth.eval.utility import accuracy as tensor_accuracy

    return tensor_accuracy(model, *dataset.to_tensors())


@torch.no_grad()
def example_losses(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, device: torch.device,
                   batch_size: int = 512) -> np.ndarray:
    """Per-example cross-entropy of ``model`` on uint8 ``[N,H,W,C]`` images (the audit's loss attack)."""
    model.eval()
    inputs, targets = uint8_to_tensor(images), torch.as_tensor(labels, dtype=torch.int64)
    losses = [F.cross_entropy(model(inputs[i:i + batch_size].to(device)), targets[i:i + batch_size].to(device),
                              reduction="none").cpu() for i in range(0, len(inputs), batch_size)]
    return torch.cat(losses).numpy() if losses else np.zeros(0, np.float32)


@register_method
class DPSGDClassifier(Method):
    name = "dpsgd-classifier"
    summary = "baseline: a classifier trained with DP-SGD on the private data (releases a model, no samples)"
    paper = "Abadi et al. 2016; the non-synthetic row of the seed papers"
    defaults = CLASSIFIER_DEFAULTS
    releases_samples = False

    def fit(self, ctx: RunContext) -> None:
        self.model = train_dp_classifier(ctx, ctx.section)
        ctx.checkpoints.save({"model": self.model.state_dict()}, phase="final")
        self.test_accuracy = accuracy(self.model, ctx.data.test)
        ctx.log(f"test accuracy of the DP-SGD classifier: {self.test_accuracy:.4f}")

    def example_losses(self, ctx: RunContext, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Audit hook: per-example losses of the released classifier (docs/audit.md)."""
        from dpsynth.models.classifiers import build_classifier

        if getattr(self, "model", None) is None:
            channels, size, _ = ctx.image_shape
            self.model = build_classifier(ctx.section["model"], channels, ctx.num_classes, size,
                                          preset=ctx.section["preset"]).to(ctx.device)
            self.model.load_state_dict(ctx.checkpoints.load(phase="final")["model"])
        return example_losses(self.model, images, labels, ctx.device)

    def released_metrics(self, ctx: RunContext) -> dict[str, Any]:
        """Metrics of the released model on the real test split (public evaluation)."""
        return {"accuracy": {"dpsgd-classifier": {"mean": self.test_accuracy, "std": 0.0, "seeds": 1}}}

    def generate(self, ctx: RunContext, num: int) -> Samples:
        from dpsynth.errors import DPSynthError

        raise DPSynthError("dpsgd-classifier releases a classifier, not samples")
