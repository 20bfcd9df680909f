"""Learning-rate schedules as pure functions ``step -> multiplier`` of the base learning rate.

They plug into :func:`dpsynth.dpsgd.training.train_private` as ``lr_lambda`` (which wraps them in
``torch.optim.lr_scheduler.LambdaLR``), so a schedule never reads the data: it depends on the
step count only, which is public (docs/contract.md, privacy rule 4).

The three decay rules of DPDM (Chu et al. (IEEE Access 2023) §IV-A) are written exactly as the paper
states them, with ``lr'`` "the last learning rate" and the rate updated once per epoch:

* linear:       ``lr_e = lr_{e-1} / (1 + dr * e)``
* exponential:  ``lr_e = lr_initial * dr ** e``
* logarithmic:  ``lr_e = lr_{e-1} / (1 + log(e))``
* none:         ``lr_e = lr_fixed``

Epochs are numbered from 1 at the first update; before it (epoch 0) the rate is ``lr_initial``,
so every rule starts at multiplier 1. The linear and logarithmic rules are recursive, hence their
multipliers are products, ``prod_{k=1..e} 1 / (1 + dr k)`` and ``prod_{k=1..e} 1 / (1 + log k)``.
Table 1 of the paper lists ``dr = 0.002`` for logarithmic decay although its formula has no rate;
:class:`LogarithmicDecay` takes an optional ``rate`` multiplying ``log(e)`` whose default, 1,
reproduces the formula as printed.

Also here: ``constant``, ``cosine`` (with optional linear warm-up, the pre-training schedule of
Ghalebikesabi et al. (arXiv:2302.13861) Table 3 is a 5k-step linear warm-up), and ``multistep``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from dpsynth.errors import ConfigError

LRLambda = Callable[[int], float]

SCHEDULES = ("none", "constant", "linear", "exponential", "logarithmic", "cosine", "multistep")


def _epoch(step: int, steps_per_epoch: int) -> int:
    """Completed epochs after ``step`` optimizer steps (0 during the first epoch)."""
    return max(0, int(step)) // steps_per_epoch


@dataclasses.dataclass
class Constant:
    """``lr = lr_fixed``: the "No decay" row of Chu et al. (IEEE Access 2023) Table 1."""

    def __call__(self, step: int) -> float:
        return 1.0


@dataclasses.dataclass
class LinearDecay:
    """§IV-A linear decay ``lr_e = lr_{e-1} / (1 + dr * e)``, i.e. ``prod_{k<=e} 1 / (1 + dr k)``.

    The product has the closed form ``dr^e Γ(e + 1 + 1/dr) / Γ(1 + 1/dr)``, evaluated in log space
    so that long runs cost O(1) per step and never overflow.
    """

    decay_rate: float
    steps_per_epoch: int = 1

    def __call__(self, step: int) -> float:
        epoch = _epoch(step, self.steps_per_epoch)
        if epoch == 0 or self.decay_rate == 0:
            return 1.0
        inverse = 1.0 / self.decay_rate
        log_product = epoch * math.log(self.decay_rate) + math.lgamma(epoch + 1 + inverse) - math.lgamma(1 + inverse)
        return math.exp(-log_product)


@dataclasses.dataclass
class ExponentialDecay:
    """§IV-A exponential decay ``lr_e = lr_initial * dr^e``."""

    decay_rate: float
    steps_per_epoch: int = 1

    def __call__(self, step: int) -> float:
        return self.decay_rate ** _epoch(step, self.steps_per_epoch)


@dataclasses.dataclass
class LogarithmicDecay:
    """§IV-A logarithmic decay ``lr_e = lr_{e-1} / (1 + rate * log(e))`` (``rate = 1`` as printed)."""

    steps_per_epoch: int = 1
    rate: float = 1.0

    def __call__(self, step: int) -> float:
        epoch = _epoch(step, self.steps_per_epoch)
        return math.exp(-math.fsum(math.log1p(self.rate * math.log(k)) for k in range(2, epoch + 1)))


@dataclasses.dataclass
class Cosine:
    """Linear warm-up over ``warmup_steps``, then half a cosine from 1 down to ``final``."""

    total_steps: int
    warmup_steps: int = 0
    final: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.final + (1.0 - self.final) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclasses.dataclass
class MultiStep:
    """Multiply by ``gamma`` at each of the (step) ``milestones``."""

    milestones: Sequence[int]
    gamma: float = 0.1

    def __call__(self, step: int) -> float:
        return self.gamma ** sum(1 for milestone in self.milestones if step >= milestone)


@dataclasses.dataclass
class Warmup:
    """Linear warm-up from ``1 / warmup_steps`` to 1 over ``warmup_steps``, then ``inner``."""

    inner: LRLambda
    warmup_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return self.inner(step)


def make_lr_schedule(
    name: str | None,
    *,
    total_steps: int = 1,
    steps_per_epoch: int = 1,
    decay_rate: float | None = None,
    warmup_steps: int = 0,
    final: float = 0.0,
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
) -> LRLambda:
    """The schedule ``name`` (see :data:`SCHEDULES`) as a ``step -> multiplier`` callable.

    ``steps_per_epoch`` sets the "epoch" of the §IV-A rules (for DP-SGD, ``ceil(1 / q)``);
    ``decay_rate`` is their ``dr`` (for ``logarithmic`` the optional rate multiplying ``log e``).
    A bad name or parameter raises :class:`~dpsynth.errors.ConfigError`.
    """
    key = "none" if name is None else str(name).lower()
    if steps_per_epoch < 1:
        raise ConfigError(f"lr schedule: steps_per_epoch must be >= 1, got {steps_per_epoch}")
    if warmup_steps < 0:
        raise ConfigError(f"lr schedule: warmup_steps must be >= 0, got {warmup_steps}")
    schedule: LRLambda
    if key in ("none", "constant"):
        schedule = Constant()
    elif key == "linear":
        schedule = LinearDecay(_rate(key, decay_rate, low=0.0), steps_per_epoch)
    elif key == "exponential":
        rate = _rate(key, decay_rate, low=0.0)
        if rate > 1.0:
            raise ConfigError(f"lr schedule exponential: decay_rate must be in (0, 1], got {rate}")
        schedule = ExponentialDecay(rate, steps_per_epoch)
    elif key == "logarithmic":
        schedule = LogarithmicDecay(steps_per_epoch, 1.0 if decay_rate is None else _rate(key, decay_rate, low=0.0))
    elif key == "cosine":
        return Cosine(max(1, int(total_steps)), int(warmup_steps), float(final))
    elif key == "multistep":
        schedule = MultiStep(tuple(int(m) for m in milestones), float(gamma))
    else:
        raise ConfigError(f"unknown lr schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return Warmup(schedule, int(warmup_steps)) if warmup_steps > 0 else schedule


def _rate(name: str, value: float | None, low: float) -> float:
    if value is None:
        raise ConfigError(f"lr schedule {name} needs a decay_rate")
    if not isinstance(value, (int, float)) or value <= low:
        raise ConfigError(f"lr schedule {name}: decay_rate must be > {low}, got {value!r}")
    return float(value)
