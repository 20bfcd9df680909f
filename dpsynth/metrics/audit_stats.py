"""Statistics of the privacy audit: Clopper–Pearson intervals and the one-run ε lower bound.

Everything here works on counts only (no data, no model): exact binomial confidence intervals
(Clopper & Pearson, 1934) for the membership-inference rates, and the p-value and empirical ε
lower bound of Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS
2023, arXiv:2305.08846), Theorem 3 and Algorithm 2, with the largest ε a given number of guesses
could ever certify.
"""

from __future__ import annotations

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from dpsynth.errors import PrivacyError

DEFAULT_CONFIDENCE = 0.95


def clopper_pearson(successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """Exact two-sided ``confidence`` interval for a binomial proportion (Clopper & Pearson, 1934).

    The ends are Beta quantiles: ``B(α/2; x, n − x + 1)`` and ``B(1 − α/2; x + 1, n − x)`` with
    ``α = 1 − confidence``; 0 successes give a lower end of 0, ``n`` successes an upper end of 1.
    With no trials nothing is known, and the interval is [0, 1].
    """
    if not 0 <= successes <= trials:
        raise PrivacyError(f"need 0 <= successes ({successes}) <= trials ({trials})")
    if not 0.0 < confidence < 1.0:
        raise PrivacyError(f"confidence must lie in (0, 1), got {confidence}")
    if trials == 0:
        return 0.0, 1.0
    alpha = 1.0 - confidence
    lower = 0.0 if successes == 0 else float(scipy.stats.beta.ppf(alpha / 2, successes, trials - successes + 1))
    upper = (
        1.0 if successes == trials else float(scipy.stats.beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    )
    return lower, upper


def accuracy_epsilon(accuracy: float) -> float | None:
    """The ε of randomized response whose guesses are right with probability ``accuracy``.

    ``logit(accuracy)``, floored at 0 (a guess no better than chance shows nothing); ``None`` for
    ``accuracy = 1``, which no finite ε explains (JSON has no infinity).
    """
    if accuracy >= 1.0:
        return None
    return max(0.0, float(scipy.special.logit(accuracy)))


def audit_p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[at least ``num_correct`` right guesses] if the training is (ε, δ)-DP.

    Steinke, Nasr & Jagielski (2023), Theorem 3 (the (ε, δ) case of their main result): let
    ``S ∈ {-1, +1}^m`` be the uniform inclusion signs of the m canaries, ``T`` the auditor's
    guesses with ``||T||₁ = r`` non-abstentions and ``W = Σ_i max(0, T_i S_i)`` the correct ones.
    With ``f(v) = P[Binomial(r, p) >= v]`` and ``p = e^ε / (1 + e^ε)`` (the accuracy of ε-DP
    randomized response),

        P[W >= v] <= f(v) + 2 m δ · max_{1 <= i <= m} (f(v - i) - f(v)) / i.

    ``f(v - i) - f(v) = P[v - i <= Binomial(r, p) < v]`` only grows by the pmf terms below v; for
    i > v it stays at ``P[Binomial < v]`` while i grows, so the maximum is reached for i <= v.
    """
    _check_audit_counts(num_canaries, num_guesses, num_correct)
    if epsilon < 0 or not 0.0 <= delta <= 1.0:
        raise PrivacyError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    if num_correct == 0:
        return 1.0
    accuracy = float(scipy.special.expit(epsilon))
    tail = float(scipy.stats.binom.sf(num_correct - 1, num_guesses, accuracy))  # f(v)
    # pmf(v - 1), pmf(v - 2), ..., pmf(0): cumulative sums give f(v - i) - f(v) for i = 1..v.
    below = scipy.stats.binom.pmf(np.arange(num_correct - 1, -1, -1), num_guesses, accuracy)
    window = np.cumsum(below)
    slope = float(np.max(window / np.arange(1, num_correct + 1)))
    return min(1.0, tail + 2.0 * num_canaries * delta * slope)


def epsilon_lower_bound(
    num_canaries: int, num_guesses: int, num_correct: int, delta: float, beta: float = 0.05, epsilon_max: float = 100.0
) -> float:
    """The empirical ε lower bound at confidence ``1 - β`` from an observed number of correct guesses.

    Every ε whose p-value (:func:`audit_p_value`) is at most β is rejected: were the training
    (ε, δ)-DP, seeing this many correct guesses would have probability at most β. The bound is
    the infimum of the ε that are *not* rejected (Steinke et al. 2023, Algorithm 2 solves the same
    equation by bisection). The p-value is continuous in ε and tends to 1 as ε grows, so the root
    of ``p(ε) = β`` is found with Brent's method; a grid check below the root guards the claim
    "every smaller ε is rejected" against a non-monotone δ term.
    """
    _check_audit_counts(num_canaries, num_guesses, num_correct)
    if not 0.0 < beta < 1.0:
        raise PrivacyError(f"confidence parameter beta must lie in (0, 1), got {beta}")

    def excess(epsilon: float) -> float:
        return audit_p_value(num_canaries, num_guesses, num_correct, epsilon, delta) - beta

    if excess(0.0) > 0.0:
        return 0.0
    if excess(epsilon_max) <= 0.0:
        return epsilon_max
    root = float(scipy.optimize.brentq(excess, 0.0, epsilon_max, xtol=1e-9, rtol=1e-12))
    grid = np.linspace(0.0, root, 65)
    not_rejected = [eps for eps in grid if excess(float(eps)) > 0.0]
    return float(not_rejected[0]) if not_rejected else root


def max_certifiable_epsilon(num_canaries: int, num_guesses: int, delta: float, beta: float = 0.05) -> float:
    """The largest empirical ε lower bound ``num_guesses`` guesses can give: the bound if every one is right.

    An audit of this size cannot show more, whatever the training leaks; with δ = 0 it is
    ``logit(β^{1/r})`` (1.82 for r = 20 guesses at β = 0.05).
    """
    if num_guesses == 0:
        return 0.0
    return epsilon_lower_bound(num_canaries, num_guesses, num_guesses, delta, beta)


def _check_audit_counts(num_canaries: int, num_guesses: int, num_correct: int) -> None:
    if not 0 <= num_correct <= num_guesses <= num_canaries:
        raise PrivacyError(f"need 0 <= correct ({num_correct}) <= guesses ({num_guesses}) <= canaries ({num_canaries})")
