"""A privacy plan: every mechanism a run will apply, fixed before any private data is read.

A method computes its plan from the resolved config and the private train size N alone (N is
treated as public, see docs/privacy.md). Noise multipliers left open in the config are calibrated
here, so the composition of the whole plan meets the target ε. The run then spends exactly this
plan (the runner checks the ledger against it after training), and ``dpsynth run --dry-run``
prints it without touching private data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from dpsynth.errors import PrivacyError
from dpsynth.privacy.accountants import compute_epsilon
from dpsynth.privacy.calibration import calibrate_mechanism
from dpsynth.privacy.mechanisms import Mechanism, SubsampledGaussian
from dpsynth.privacy.section import PrivacySection


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
    """The mechanisms of a run with their final repeat counts, against the run's (ε, δ) target.

    ``calibrated`` names the mechanisms whose σ was solved for so that the whole plan meets the
    target (at most one: the DP-SGD training). ``target_epsilon`` is None only for an explicit
    ``guarantee="none"`` run, which claims no ε.
    """

    mechanisms: tuple[Mechanism, ...]
    target_epsilon: float | None
    delta: float
    accountant: str = "prv"
    calibrated: tuple[str, ...] = ()

    @property
    def guarantee(self) -> str:
        """``"dp"``, or ``"none"`` for an explicitly unsound opt-in (no target, no ε claimed)."""
        return "none" if self.target_epsilon is None else "dp"

    def epsilon(self) -> float | None:
        """The ε the whole plan spends (None for a run without a DP guarantee)."""
        if self.target_epsilon is None:
            return None
        return compute_epsilon(list(self.mechanisms), self.delta, accountant=self.accountant)

    def mechanism(self, name: str) -> Mechanism:
        for mechanism in self.mechanisms:
            if mechanism.name == name:
                return mechanism
        raise PrivacyError(f"the privacy plan has no mechanism {name!r} (planned: {', '.join(self.names())})")

    def noise_multiplier(self, name: str) -> float:
        """σ of the planned mechanism ``name``: what ``fit`` must use."""
        return float(self.mechanism(name).noise_multiplier)

    def names(self) -> list[str]:
        return [m.name for m in self.mechanisms]

    def check_affordable(self) -> None:
        """Refuse a plan whose composition passes the target (e.g. a fixed σ that is too small)."""
        spent = self.epsilon()
        if spent is not None and spent > self.target_epsilon:
            raise PrivacyError(
                f"the planned mechanisms spend eps={spent:.4f}, more than the target "
                f"{self.target_epsilon}; raise a noise multiplier or lower the steps"
            )

    def check_spent(self, ledger: Any) -> None:
        """Raise PrivacyError unless ``ledger`` recorded exactly this plan, mechanism by mechanism."""
        planned = {m.name: m.to_dict() for m in self.mechanisms}
        spent = {m.name: m.to_dict() for m in ledger.mechanisms()}
        if planned != spent:
            differing = sorted(n for n in set(planned) | set(spent) if planned.get(n) != spent.get(n))
            raise PrivacyError(f"the run spent a different privacy plan than announced, at {', '.join(differing)}")

    def to_json(self) -> dict[str, Any]:
        """The plan as printed by ``--dry-run --json``: each mechanism, its own ε, and the total."""
        rows = []
        for mechanism in self.mechanisms:
            alone = (
                None
                if self.target_epsilon is None or mechanism.repeats == 0
                else compute_epsilon([mechanism], self.delta, accountant=self.accountant)
            )
            rows.append(
                {**mechanism.to_dict(), "epsilon_alone": alone, "calibrated": mechanism.name in self.calibrated}
            )
        return {
            "guarantee": self.guarantee,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon": self.epsilon(),
            "mechanisms": rows,
        }


def plan_with_dpsgd(
    privacy: PrivacySection,
    fixed: Sequence[Mechanism],
    *,
    name: str,
    sample_rate: float,
    steps: int,
    noise_multiplier: float | None = None,
) -> PrivacyPlan:
    """A plan of ``fixed`` one-off mechanisms plus ``steps`` DP-SGD steps under ``name``.

    With ``noise_multiplier`` None the DP-SGD σ is calibrated (:func:`calibrate_noise`, with the
    fixed mechanisms as its prior) so the whole plan lands in [target − 0.01, target]; a given σ is
    kept, and the plan is refused if it cannot meet the target.
    """
    return plan_calibrated(
        privacy,
        fixed,
        lambda sigma: SubsampledGaussian(name, sigma, sample_rate, steps),
        noise_multiplier=noise_multiplier,
    )


def plan_calibrated(
    privacy: PrivacySection,
    fixed: Sequence[Mechanism],
    make: Callable[[float], Mechanism],
    *,
    noise_multiplier: float | None = None,
) -> PrivacyPlan:
    """A plan of ``fixed`` mechanisms plus ``make(sigma)``, listed first, whose σ is calibrated unless given.

    With ``noise_multiplier`` None, σ is solved (:func:`calibrate_mechanism`, the fixed mechanisms as its
    prior) so the whole plan lands in [target − 0.01, target]; a given σ is kept, and the plan is refused if
    it cannot meet the target. ``make`` is any mechanism whose ε decreases in σ: DP-SGD steps
    (:func:`plan_with_dpsgd`), a bounded-sum release (a ``Gaussian`` or, Poisson-subsampled and repeated,
    a ``SubsampledGaussian``), ...
    """
    target, delta, accountant = privacy.epsilon, privacy.delta, privacy.accountant
    calibrated: tuple[str, ...] = ()
    if noise_multiplier is None:
        noise_multiplier = calibrate_mechanism(target, delta, make, prior=list(fixed), accountant=accountant)
        calibrated = (make(noise_multiplier).name,)
    plan = PrivacyPlan((make(float(noise_multiplier)), *fixed), target, delta, accountant, calibrated)
    plan.check_affordable()
    return plan
