"""Downstream utility: train classifiers on synthetic data, test them on the real test split.

Protocols (docs/contract.md, "Evaluation protocol"):

* seed papers (PrivImage (arXiv:2311.12850) §4.3, dpdm, dppm): logistic regression, MLP, CNN;
* benchmark (DPImageBench): WRN-40-4, ResNet, ResNeXt and their mean (``preset="gpu"`` for the
  paper sizes, ``"cpu"`` for small versions of the same families).

Samples that carry ``soft_labels`` (DP-ImgSyn) are learned by knowledge distillation, the KL
divergence with temperature T of DP-ImgSyn (TMLR 2024) Eq. 6/7 (:func:`distillation_loss`).

Epoch selection (which epoch's weights are tested):

* ``"synthetic"`` (default, free): accuracy on a held-out part of the synthetic data;
* ``"private-val"``: a noisy count of correct predictions on the private validation split. Each
  evaluation is a Gaussian (or Laplace) mechanism with per-example sensitivity 1 under
  add/remove adjacency (one example changes the count by at most 1); all evaluations are charged
  to the run's ledger up front as one mechanism ``noisy-validation`` with ``count`` evaluations;
  the noise comes from :class:`~dpsynth.privacy.rng.NoiseSource`, never from the seed;
* ``"last"``: the last epoch, no selection.

Accuracies are reported in percent, mean ± std over seeds.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dpsynth.data.transforms import uint8_to_tensor
from dpsynth.errors import ConfigError, DataError, PrivacyError
from dpsynth.metrics.protocol import (  # noqa: F401  (re-exported)
    BENCHMARK_MODELS,
    SEED_PAPER_MODELS,
    SELECTIONS,
    TrainConfig,
)
from dpsynth.models.classifiers import build_classifier

NOISY_VALIDATION = "noisy-validation"


def distillation_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher_T ‖ student_T) · T², averaged over the batch (DP-ImgSyn (TMLR 2024) Eq. 6/7; Hinton et al., 2015).

    ``teacher_probs`` are the released soft labels (the teacher's softmax at T = 1). Softening
    them at temperature T is ``softmax(log p / T)``, equal to ``softmax(teacher_logits / T)``
    because log-probabilities differ from logits by a per-example constant; the student is
    softened the same way. The T² factor keeps gradient magnitudes comparable across T.
    """
    if temperature <= 0:
        raise ConfigError(f"distillation temperature must be positive, got {temperature}")
    teacher_log = torch.log_softmax(torch.log(teacher_probs.clamp_min(1e-12)) / temperature, dim=1)
    student_log = torch.log_softmax(student_logits / temperature, dim=1)
    kl = (teacher_log.exp() * (teacher_log - student_log)).sum(dim=1)
    return kl.mean() * temperature**2


@torch.no_grad()
def predict(model: torch.nn.Module, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Predicted classes for float images ``[N, C, H, W]`` (on the model's device)."""
    model.eval()
    device = next(model.parameters()).device
    predictions = [
        model(images[i : i + batch_size].to(device)).argmax(dim=1).cpu() for i in range(0, len(images), batch_size)
    ]
    return torch.cat(predictions) if predictions else torch.zeros(0, dtype=torch.long)


def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 512) -> float:
    """Share of correct predictions, in [0, 1]."""
    return float((predict(model, images, batch_size) == labels).double().mean())


# ---------------------------------------------------------------------------------------------
# Epoch selection
# ---------------------------------------------------------------------------------------------


class NoisyValidation:
    """Epoch selection on the private validation split through a noisy count of correct predictions.

    :meth:`charge` must be called once, before any evaluation, with the total number of
    evaluations; it registers ``Gaussian``/``Laplace(name="noisy-validation", noise_multiplier,
    count)`` with the ledger (which refuses if the budget would be exceeded). Each :meth:`score`
    then releases ``#correct + noise`` with noise std (Gaussian) or scale (Laplace)
    ``noise_multiplier × 1``; the count is only compared across epochs, never reported.
    """

    def __init__(
        self,
        ledger: Any,
        images: np.ndarray,
        labels: np.ndarray,
        noise_multiplier: float,
        mechanism: str = "gaussian",
        noise: Any = None,
    ) -> None:
        if ledger is None:
            raise PrivacyError("selection on the private validation split needs the run's privacy ledger")
        if mechanism not in ("gaussian", "laplace"):
            raise ConfigError(f"noisy validation mechanism must be gaussian or laplace, got {mechanism!r}")
        if not noise_multiplier or noise_multiplier <= 0:
            raise PrivacyError(f"noisy validation needs a positive noise multiplier, got {noise_multiplier!r}")
        from dpsynth.privacy.rng import NoiseSource

        self.ledger = ledger
        self.images = uint8_to_tensor(images)
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.noise_multiplier = float(noise_multiplier)
        self.mechanism = mechanism
        self.noise = noise if noise is not None else NoiseSource()
        self.remaining = 0

    def charge(self, evaluations: int) -> None:
        """Register ``evaluations`` noisy counts with the ledger, before any is computed."""
        from dpsynth.privacy.mechanisms import Gaussian, Laplace

        kind = Gaussian if self.mechanism == "gaussian" else Laplace
        self.ledger.charge(kind(name=NOISY_VALIDATION, noise_multiplier=self.noise_multiplier, count=evaluations))
        self.remaining += evaluations

    def _draw(self) -> float:
        scale = self.noise_multiplier  # × sensitivity 1
        if self.mechanism == "gaussian":
            return float(self.noise.normal((1,), std=scale)[0])
        # Laplace(b) = b (E1 − E2) with E = (Z1² + Z2²) / 2 ~ Exp(1), from the DP noise source's normals.
        z = self.noise.normal((4,), std=1.0).double()
        exp1, exp2 = (z[0] ** 2 + z[1] ** 2) / 2, (z[2] ** 2 + z[3] ** 2) / 2
        return float(scale * (exp1 - exp2))

    def score(self, model: torch.nn.Module) -> float:
        if self.remaining <= 0:
            raise PrivacyError("noisy validation used more often than charged to the ledger")
        self.remaining -= 1
        correct = int((predict(model, self.images) == self.labels).sum())
        return correct + self._draw()


class SyntheticValidation:
    """Epoch selection on held-out synthetic samples (free: no private data involved)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def score(self, model: torch.nn.Module) -> float:
        return accuracy(model, self.images, self.labels)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainedClassifier:
    model: torch.nn.Module
    best_epoch: int
    scores: list[float]  # selection score per epoch (empty with "last")


def train_classifier(
    name: str,
    images: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    config: TrainConfig,
    *,
    soft_labels: torch.Tensor | None = None,
    selector: Any = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> TrainedClassifier:
    """Train classifier ``name`` (Adam, cosine learning-rate decay); keep the epoch the selector scores best.

    ``soft_labels`` switch the loss from cross-entropy to :func:`distillation_loss`.
    """
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    channels, size = images.shape[1], images.shape[2]
    model = build_classifier(name, channels, num_classes, size, config.preset).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = max(1, math.ceil(len(images) / config.batch_size))
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    epochs = max(1, math.ceil(total_steps / steps_per_epoch))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))
    best_state, best_score, best_epoch, scores, step = None, -math.inf, epochs - 1, [], 0
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), config.batch_size):
            if step >= total_steps:
                break
            index = order[start : start + config.batch_size]
            logits = model(images[index].to(device))
            if soft_labels is not None:
                loss = distillation_loss(logits, soft_labels[index].to(device), config.kd_temperature)
            else:
                loss = F.cross_entropy(logits, labels[index].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
        if selector is not None:
            score = selector.score(model)
            scores.append(score)
            if score > best_score:
                best_score, best_epoch, best_state = score, epoch, copy.deepcopy(model.state_dict())
    if best_state is not None:
        model.load_state_dict(best_state)
    return TrainedClassifier(model=model, best_epoch=best_epoch, scores=scores)


def planned_epochs(num_train: int, config: TrainConfig) -> int:
    """Number of epochs (hence selector evaluations) :func:`train_classifier` will run."""
    steps_per_epoch = max(1, math.ceil(num_train / config.batch_size))
    total = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    return max(1, math.ceil(total / steps_per_epoch))


def split_synthetic(num: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) of the synthetic set; the held-out part is for selection only."""
    order = np.random.default_rng(seed).permutation(num)
    held_out = int(round(num * val_fraction))
    if held_out and num - held_out < 1:
        raise DataError(f"{num} synthetic samples are too few to hold out {val_fraction:.0%} for selection")
    return order[held_out:], order[:held_out]


def evaluate_utility(
    images: np.ndarray,
    labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    *,
    models: Sequence[str] = SEED_PAPER_MODELS,
    seeds: Sequence[int] = (0,),
    config: TrainConfig | None = None,
    soft_labels: np.ndarray | None = None,
    selection: str = "synthetic",
    validation: NoisyValidation | None = None,
    device: str | torch.device = "cpu",
    log: Callable[..., None] | None = None,
) -> dict[str, dict]:
    """Train each model on the synthetic set once per seed; test on the real test split.

    Returns ``{model: {"mean", "std", "runs": [accuracy %...], "epochs": [selected epoch...]}}``
    and, with two or more models, ``"mean_of_models"`` (the benchmark protocol's average).

    ``log(message, private=False)`` (the signature of :class:`~dpsynth.rundir.RunLog`) receives a
    progress line per classifier and, marked ``private=True``, the line quoting its test accuracy: a
    figure computed on the private test split without noise, for the run's ``diagnostics/log.txt``
    only, never the console (:class:`dpsynth.eval.evaluate.EvaluationLog`).
    """
    config = config or TrainConfig()
    if selection not in SELECTIONS:
        raise ConfigError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    if images.shape[1:] != test_images.shape[1:]:
        raise DataError(f"synthetic images {images.shape[1:]} and test images {test_images.shape[1:]} differ in shape")
    if selection == "private-val" and validation is None:
        raise PrivacyError("selection 'private-val' needs a NoisyValidation (private val split + ledger)")
    x_all, y_all = uint8_to_tensor(images), torch.as_tensor(labels, dtype=torch.long)
    soft_all = torch.as_tensor(soft_labels, dtype=torch.float32) if soft_labels is not None else None
    x_test, y_test = uint8_to_tensor(test_images), torch.as_tensor(test_labels, dtype=torch.long)
    fraction = config.val_fraction if selection == "synthetic" else 0.0
    plans = [(name, seed, *split_synthetic(len(x_all), fraction, seed)) for name in models for seed in seeds]
    if selection == "private-val":
        # Charge every evaluation before the first one is computed (privacy rule 2: budget fixed first).
        validation.charge(sum(planned_epochs(len(train_idx), config) for _, _, train_idx, _ in plans))
    results: dict[str, dict] = {name: {"runs": [], "epochs": []} for name in models}
    for number, (name, seed, train_idx, held_idx) in enumerate(plans, 1):
        if log:
            log(f"utility: training {name} seed {seed} ({number}/{len(plans)})")
        selector = {
            "synthetic": SyntheticValidation(x_all[held_idx], y_all[held_idx]) if len(held_idx) else None,
            "private-val": validation,
            "last": None,
        }[selection]
        trained = train_classifier(
            name,
            x_all[train_idx],
            y_all[train_idx],
            num_classes,
            config,
            soft_labels=soft_all[train_idx] if soft_all is not None else None,
            selector=selector,
            seed=seed,
            device=device,
        )
        test_accuracy = 100.0 * accuracy(trained.model, x_test, y_test, config.eval_batch_size)
        results[name]["runs"].append(test_accuracy)
        results[name]["epochs"].append(trained.best_epoch)
        if log:
            log(
                f"utility {name} seed {seed}: test accuracy {test_accuracy:.2f}% (epoch {trained.best_epoch})",
                private=True,
            )
    for entry in results.values():
        entry["mean"], entry["std"] = float(np.mean(entry["runs"])), float(np.std(entry["runs"]))
    if len(models) > 1:
        means = [results[name]["mean"] for name in models]
        results["mean_of_models"] = {"mean": float(np.mean(means)), "std": float(np.std(means))}
    return results
