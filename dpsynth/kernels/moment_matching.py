"""Moment matching: fit a conditional generator so its per-class feature means match a released target.

DP-MERF (Harder et al., AISTATS 2021, arXiv:2002.11603, §3, Eq. 7) and DP-NTK (Yang et al.,
arXiv:2303.01687, §3, Eq. 6) train the generator ``G(z, y)`` by minimising the MMD, under a finite
feature map ``phi``, between the generated data and the released embedding, class by class:

    L(G) = sum_c || (1/|B_c|) sum_{j in B_c} phi(G(z_j, c)) - t_c ||^2,

where ``t_c`` is the released (noisy) class-``c`` mean embedding and ``B_c`` the generated examples
labelled ``c``. With a finite feature map this squared distance *is* the MMD^2 of the kernel
``phi(x) . phi(y)`` between the generated class and the target's mean embedding.

This is post-processing: the trainer reads the released target only, never private data, so it
costs no privacy. Labels are public and uniform (each batch is balanced over the K classes; a class
absent from a batch is left out of that step's loss), never the private label frequencies
(dp-kernel.md: DPImageBench's private-label generator is an unaccounted leak). ``target`` may be a
callable giving a fresh target each step: DP-Kernel releases a new noisy embedding per step (each
release charged to the ledger by the callable, through :mod:`dpsynth.privacy.bounded_sum`), and the
gradient flows through ``phi(G(z, y))`` only, i.e. through released values, never through a
private embedding.

Deterministic from a public seed: the latent codes and labels come from a torch generator seeded by
``settings.seed``; the generator's initialisation is the caller's (e.g.
:func:`dpsynth.models.merf_generator.build_merf_generator`).

**Resumable.** With ``checkpoint_every`` and a ``checkpoint`` callable the trainer hands its whole state
(:class:`TrainerState`: step, generator, optimiser, schedule, the latent generator's state, the losses so
far) to ``checkpoint`` every ``checkpoint_every`` steps; ``resume=`` that state continues exactly where it
stopped, so a resumed run ends with the same generator as an uninterrupted one. ``start_step`` may skip
ahead of the saved state: DP-Kernel's per-step releases spent after its last checkpoint are not repeated.
``after_step(step, loss)`` sees every update (e.g. to log a curve).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from dpsynth.errors import ConfigError
from dpsynth.kernels.feature_map import FeatureMap, class_feature_means
from dpsynth.report.balance import balanced_labels

#: A released target ``[K, dim]``, or a callable ``step -> [K, dim]`` that releases one per step.
Target = torch.Tensor | Callable[[int], torch.Tensor]

OPTIMIZERS = ("adam", "rmsprop")


@dataclasses.dataclass(frozen=True)
class MomentMatchingSettings:
    """Optimisation settings (all public). DP-MERF's MNIST recipe: Adam, lr 0.01, x0.9 per epoch;
    DP-Kernel's (DPImageBench ``configs/DP-Kernel/*.yaml``): RMSprop, lr 5e-5."""

    steps: int = 2000
    batch_size: int = 200
    lr: float = 1e-2
    lr_decay: float = 0.9  # multiplied into the learning rate every ``decay_every`` steps
    decay_every: int = 0  # 0: constant learning rate
    seed: int = 0
    optimizer: str = "adam"  # "adam" | "rmsprop"

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0 or not 0 < self.lr_decay <= 1:
            raise ConfigError(f"invalid moment-matching settings {self}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.decay_every < 0:
            raise ConfigError(f"decay_every must be >= 0, got {self.decay_every}")


@dataclasses.dataclass
class MomentMatchingResult:
    """The loss after each step (a function of released values only: it may be logged)."""

    losses: list[float]


#: The trainer's state as handed to ``checkpoint`` and accepted by ``resume``: a dict with ``step`` (steps
#: done), ``generator``, ``optimizer`` and ``scheduler`` state dicts, ``rng`` (the latent generator's state)
#: and ``losses``.
TrainerState = dict[str, Any]


def moment_matching_loss(
    feature_map: FeatureMap, images: torch.Tensor, labels: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """``sum_c ||mean phi(images of class c) - target_c||^2`` over the classes present in ``labels``."""
    means, present = class_feature_means(feature_map, images, labels, target.shape[0])
    return ((means - target.to(means.dtype)) ** 2)[present].sum()


def train_moment_matching(
    generator: nn.Module,
    feature_map: FeatureMap,
    target: Target,
    settings: MomentMatchingSettings,
    *,
    device: torch.device | str = "cpu",
    progress: bool = True,
    description: str = "moment matching",
    resume: Mapping[str, Any] | None = None,
    checkpoint_every: int = 0,
    checkpoint: Callable[[TrainerState], None] | None = None,
    start_step: int | None = None,
    after_step: Callable[[int, float], None] | None = None,
) -> MomentMatchingResult:
    """Fit ``generator`` (a module ``G(z, labels)`` with ``z_dim`` and ``num_classes``) to ``target``.

    ``target`` is ``[K, dim]`` (the released class means), or a callable ``step -> [K, dim]``. The
    generator is left in eval mode. ``checkpoint(state)`` is called after every ``checkpoint_every``-th
    step (0: never); ``resume`` is such a state (from the same settings), continued from its step, or from
    ``start_step`` (not before the state's step) when given.
    """
    if checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    generator.to(device).train()
    optimizer_class = torch.optim.RMSprop if settings.optimizer == "rmsprop" else torch.optim.Adam
    optimizer = optimizer_class(generator.parameters(), lr=settings.lr)
    scheduler = (
        torch.optim.lr_scheduler.StepLR(optimizer, settings.decay_every, settings.lr_decay)
        if settings.decay_every
        else None
    )
    rng = torch.Generator().manual_seed(int(settings.seed))
    losses: list[float] = []
    start = 0
    if resume is not None:
        start = int(resume["step"])
        if not 0 <= start <= settings.steps:
            raise ConfigError(f"cannot resume moment matching at step {start} of {settings.steps}")
        generator.load_state_dict(resume["generator"])
        optimizer.load_state_dict(resume["optimizer"])
        if scheduler is not None and resume.get("scheduler") is not None:
            scheduler.load_state_dict(resume["scheduler"])
        rng.set_state(resume["rng"])
        losses = [float(v) for v in resume["losses"]]
    if start_step is not None:
        if not start <= start_step <= settings.steps:
            raise ConfigError(
                f"cannot start moment matching at step {start_step} (state at {start}, {settings.steps} steps)"
            )
        start = start_step

    def state(done: int) -> TrainerState:
        return {
            "step": done,
            "generator": {k: v.detach().cpu().clone() for k, v in generator.state_dict().items()},
            # copies: the live optimiser keeps updating its moment tensors in place
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "scheduler": None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
            "rng": rng.get_state(),
            "losses": list(losses),
        }

    bar = tqdm(
        range(start, settings.steps),
        total=settings.steps,
        initial=start,
        desc=description,
        unit="step",
        leave=False,
        disable=not progress,
    )
    for step in bar:
        step_target = (target(step) if callable(target) else target).to(device=device, dtype=torch.float32)
        labels = torch.from_numpy(balanced_labels(settings.batch_size, generator.num_classes, rng))
        z = torch.randn(settings.batch_size, generator.z_dim, generator=rng)
        images = generator(z.to(device), labels.to(device))
        loss = moment_matching_loss(feature_map, images, labels.to(device), step_target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
        if after_step is not None:
            after_step(step, losses[-1])
        if checkpoint is not None and checkpoint_every and (step + 1) % checkpoint_every == 0:
            checkpoint(state(step + 1))
    generator.eval()
    return MomentMatchingResult(losses)
