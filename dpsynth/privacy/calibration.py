"""Noise calibration: the DP-SGD noise multiplier that spends exactly the remaining budget.

docs/contract.md, privacy rule 2 fixes the budget before training; :func:`calibrate_noise` finds the noise
multiplier sigma for which the prior mechanisms (a PrivImage histogram, DP-ImgSyn statistics, noisy
validation) composed with ``steps`` Poisson-subsampled Gaussian steps land in
``[target - CALIBRATION_TOLERANCE, target]``. Epsilon decreases in sigma, so a bracketing root
search suffices; it interpolates in log-log (epsilon minus the prior's is close to a power of sigma) and
falls back to bisection so a slow side cannot stall it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from dpsynth.errors import PrivacyError
from dpsynth.privacy.accountants import check_accountant, compute_epsilon, rough_epsilon
from dpsynth.privacy.mechanisms import (
    Mechanism,
    SubsampledGaussian,
    check_count,
    check_delta,
    check_positive,
    check_sample_rate,
)

#: Width of the band below the target that a calibrated total must land in.
CALIBRATION_TOLERANCE = 0.01
_SIGMA_MIN, _SIGMA_MAX = 1e-3, 1e6
_MAX_ITERATIONS = 80


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    prior: Iterable[Mechanism] = (),
    accountant: str = "prv",
) -> float:
    """Return sigma such that ``prior`` + ``steps`` DP-SGD steps spend epsilon in [target - 0.01, target].

    Raises PrivacyError for invalid parameters, when the prior mechanisms alone already spend the
    target, or when no noise multiplier in [1e-3, 1e6] reaches it.
    """
    sample_rate = check_sample_rate(sample_rate)
    steps = check_count(steps, "steps", minimum=1)
    return calibrate_mechanism(
        target_epsilon,
        delta,
        lambda sigma: SubsampledGaussian("dpsgd", sigma, sample_rate, steps),
        prior,
        accountant,
    )


def calibrate_mechanism(
    target_epsilon: float,
    delta: float,
    make: Callable[[float], Mechanism],
    prior: Iterable[Mechanism] = (),
    accountant: str = "prv",
) -> float:
    """Return sigma such that ``prior`` + ``make(sigma)`` spend epsilon in [target - 0.01, target].

    ``make`` builds the mechanism being calibrated from its noise multiplier (DP-SGD steps, a bounded-sum
    release repeated ``R`` times, ...); its epsilon must decrease in sigma.
    """
    target = check_positive(target_epsilon, "target epsilon")
    delta = check_delta(delta)
    check_accountant(accountant)
    prior = tuple(prior)
    prior_epsilon = compute_epsilon(prior, delta, accountant)
    if prior_epsilon >= target:
        raise PrivacyError(
            f"the prior mechanisms alone spend epsilon={prior_epsilon:.4g}, "
            f"which leaves nothing of the target {target:g} for training"
        )

    # RDP at integer orders is cheap at any sigma and within ~10% of both accountants, so it gives the run's
    # accountant a close start: a PRV grid is then only built near the answer, where it stays small, and
    # the RDP accountant's fractional orders (its cost) are evaluated at a few sigmas only.
    start, slope = 1.0, -1.0
    rough_prior = rough_epsilon(prior, delta)
    if rough_prior < target - CALIBRATION_TOLERANCE:  # else the looser bound leaves it no room: start at 1

        def rough(sigma: float) -> float:
            return rough_epsilon(prior + (make(sigma),), delta)

        start = _solve_decreasing(rough, 1.0, target, rough_prior)
        # the rough curve's log-log slope there starts the accountant's secant (both curves bend alike)
        slope = _log_slope((start, rough(start)), (start * 1.01, rough(start * 1.01)), rough_prior) or -1.0
    return _solve_decreasing(
        lambda sigma: compute_epsilon(prior + (make(sigma),), delta, accountant), start, target, prior_epsilon, slope
    )


def _solve_decreasing(
    total: Callable[[float], float], start: float, target: float, floor: float, slope: float = -1.0
) -> float:
    """Return sigma with total(sigma) in [target - tolerance, target], for total decreasing in sigma.

    Steps follow the model total ~ floor + c sigma^slope (``floor`` is the prior mechanisms' epsilon): the first
    with the given ``slope``, later ones with the slope through the last two points (a secant in log-log), aimed
    at the middle of the band and kept inside the bracket once the root is bracketed (bisection in log sigma
    when the secant leaves it).
    """
    aim = target - CALIBRATION_TOLERANCE / 2
    low = high = None  # bracket ends: sigma with epsilon > target, resp. epsilon < target - tolerance
    previous = None
    sigma = start
    for _ in range(_MAX_ITERATIONS):
        if not _SIGMA_MIN <= sigma <= _SIGMA_MAX:
            raise PrivacyError(
                f"target epsilon {target:g} is unreachable with a noise multiplier in [{_SIGMA_MIN:g}, {_SIGMA_MAX:g}]"
            )
        epsilon = total(sigma)
        if target - CALIBRATION_TOLERANCE <= epsilon <= target:
            return sigma
        if epsilon > target:
            low = sigma if low is None else max(low, sigma)
        else:
            high = sigma if high is None else min(high, sigma)
        current = (sigma, epsilon)
        sigma = _next_sigma(current, previous, aim, floor, slope)
        if low is not None and high is not None and not low < sigma < high:
            sigma = math.sqrt(low * high)
        previous = current
    raise PrivacyError(
        f"noise calibration did not converge to epsilon in [{target - CALIBRATION_TOLERANCE:g}, {target:g}]"
    )


def _next_sigma(
    current: tuple[float, float], previous: tuple[float, float] | None, aim: float, floor: float, slope: float
) -> float:
    """A secant step in log-log (epsilon - floor ~ c sigma^slope); ``slope`` until two points fit one."""
    sigma, epsilon = current
    if not math.isfinite(epsilon):
        return sigma * 4
    if previous is not None:
        slope = _log_slope(current, previous, floor) or slope
    if aim <= floor:  # the prior alone is within half a band of the target: more noise reaches the band
        return sigma * 4
    if epsilon <= floor:
        return sigma / 4
    return sigma * ((aim - floor) / (epsilon - floor)) ** (1 / slope)


def _log_slope(point: tuple[float, float], other: tuple[float, float], floor: float) -> float | None:
    """d log(epsilon - floor) / d log sigma through two points; None where it is not a finite negative number."""
    (sigma, epsilon), (sigma_other, epsilon_other) = point, other
    if not (math.isfinite(epsilon) and math.isfinite(epsilon_other) and min(epsilon, epsilon_other) > floor):
        return None
    if sigma == sigma_other or epsilon == epsilon_other:
        return None
    slope = math.log((epsilon - floor) / (epsilon_other - floor)) / math.log(sigma / sigma_other)
    return slope if slope < 0 else None
