"""Privacy audit: membership inference and a one-run canary audit (docs/audit.md).

Two complementary empirical checks of what a run leaks (DESIGN.md, "Evaluation protocol"):

* **Membership inference** (privimage.txt appendix A): an attacker scores every private train
  example (member) and every private val example (non-member); we report the ROC AUC and the true
  positive rate at a 10 % false positive rate (TPR@10%FPR; random guessing gives 0.10).
  Two attacks: the loss threshold attack on a released model (Yeom et al., 2018: low loss = member),
  and the nearest-neighbour distance attack on released samples (a member that the generator
  memorised lies close to some synthetic image).
* **Canary audit** (Steinke, Nasr & Jagielski, 2023, "Privacy Auditing with One (1) Training Run"):
  m canaries each enter the training set with probability 1/2, the trained model scores them, the
  auditor guesses the k+ highest-scoring as IN and the k- lowest as OUT, and the number of correct
  guesses becomes an ε lower bound at confidence 1 - β. A lower bound above the ledger's claimed ε
  proves a bug in the private training (or the accounting).

The audit reads private data but is not itself a ledger mechanism: its figures are for the data
custodian who runs it and are not differentially private. They must not be released alongside
the synthetic data as if they were covered by the run's guarantee (docs/audit.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from dpsynth.errors import DataError, PrivacyError

DEFAULT_FPR = 0.10


# --------------------------------------------------------------------------------------------
# Membership inference on arrays
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class AttackResult:
    """Outcome of one membership-inference attack; scores are "higher = more likely a member"."""

    attack: str
    auc: float
    tpr_at_fpr: float
    fpr: float
    num_members: int
    num_nonmembers: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def roc_curve(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ROC of the threshold attack "member iff score >= t", over every distinct threshold t.

    Returns (fpr, tpr), both starting at 0 (threshold +inf) and ending at 1. Tied scores move
    together, so a tie never counts as a partial detection.
    """
    members = _finite_scores(member_scores, "member")
    nonmembers = _finite_scores(nonmember_scores, "non-member")
    scores = np.concatenate([members, nonmembers])
    is_member = np.concatenate([np.ones(len(members)), np.zeros(len(nonmembers))])
    order = np.argsort(-scores, kind="stable")
    scores, is_member = scores[order], is_member[order]
    # Last position of each run of equal scores: the ROC only has points between distinct scores.
    boundaries = np.flatnonzero(np.diff(scores) != 0)
    last_of_tie = np.concatenate([boundaries, [len(scores) - 1]])
    true_positives = np.cumsum(is_member)[last_of_tie]
    false_positives = (last_of_tie + 1) - true_positives
    tpr = np.concatenate([[0.0], true_positives / len(members)])
    fpr = np.concatenate([[0.0], false_positives / len(nonmembers)])
    return fpr, tpr


def roc_auc(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> float:
    """Area under the ROC curve: P(member score > non-member score) + ½ P(tie)."""
    fpr, tpr = roc_curve(member_scores, nonmember_scores)
    return float(np.trapezoid(tpr, fpr))


def tpr_at_fpr(member_scores: np.ndarray, nonmember_scores: np.ndarray, fpr: float = DEFAULT_FPR) -> float:
    """Largest true positive rate of a threshold whose false positive rate is at most ``fpr``.

    This is the TPR@10%FPR of privimage.txt appendix A (with ``fpr=0.1``); an attack that guesses
    at random scores about ``fpr``.
    """
    if not 0.0 <= fpr <= 1.0:
        raise ValueError(f"fpr must lie in [0, 1], got {fpr}")
    curve_fpr, curve_tpr = roc_curve(member_scores, nonmember_scores)
    return float(curve_tpr[curve_fpr <= fpr + 1e-12].max())


def membership_attack(member_scores: np.ndarray, nonmember_scores: np.ndarray, attack: str,
                      fpr: float = DEFAULT_FPR) -> AttackResult:
    """AUC and TPR at ``fpr`` of an attack given its scores (higher = member)."""
    return AttackResult(
        attack=attack,
        auc=roc_auc(member_scores, nonmember_scores),
        tpr_at_fpr=tpr_at_fpr(member_scores, nonmember_scores, fpr),
        fpr=fpr,
        num_members=int(np.size(member_scores)),
        num_nonmembers=int(np.size(nonmember_scores)),
    )


def loss_attack(member_losses: np.ndarray, nonmember_losses: np.ndarray,
                fpr: float = DEFAULT_FPR) -> AttackResult:
    """Loss threshold attack (Yeom et al., 2018): a model fits its training examples better."""
    return membership_attack(-np.asarray(member_losses, np.float64),
                             -np.asarray(nonmember_losses, np.float64), "loss", fpr)


def nearest_neighbour_distances(queries: np.ndarray, references: np.ndarray, chunk: int = 512) -> np.ndarray:
    """Euclidean distance from each query image to its nearest reference image.

    Images are compared as flat vectors with pixels scaled to [0, 1]; ``queries`` and
    ``references`` must share their per-image shape (uint8 ``[N, H, W, C]`` or float).
    """
    queries_flat = _flat_unit(queries)
    references_flat = _flat_unit(references)
    if queries_flat.shape[1] != references_flat.shape[1]:
        raise DataError(f"cannot compare images of shape {np.shape(queries)[1:]} with {np.shape(references)[1:]}")
    if len(references_flat) == 0:
        raise DataError("nearest-neighbour attack needs at least one synthetic sample")
    reference_norms = np.einsum("ij,ij->i", references_flat, references_flat)
    nearest = np.empty(len(queries_flat))
    for start in range(0, len(queries_flat), chunk):
        block = queries_flat[start:start + chunk]
        # ||a - b||² = ||a||² - 2 a·b + ||b||², one matrix product per chunk.
        squared = (np.einsum("ij,ij->i", block, block)[:, None] - 2.0 * block @ references_flat.T
                   + reference_norms[None, :])
        nearest[start:start + chunk] = np.sqrt(np.maximum(squared.min(axis=1), 0.0))
    return nearest


def nearest_neighbour_attack(members: np.ndarray, nonmembers: np.ndarray, synthetic: np.ndarray,
                             fpr: float = DEFAULT_FPR) -> AttackResult:
    """Distance-to-closest-record attack on released samples: closer to a sample = member."""
    return membership_attack(-nearest_neighbour_distances(members, synthetic),
                             -nearest_neighbour_distances(nonmembers, synthetic), "nearest_neighbour", fpr)


def _finite_scores(scores: np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(scores, dtype=np.float64).ravel()
    if array.size == 0:
        raise DataError(f"membership inference needs at least one {what} score")
    if not np.all(np.isfinite(array)):
        raise DataError(f"{what} scores contain NaN or infinity")
    return array


def _flat_unit(images: np.ndarray) -> np.ndarray:
    array = np.asarray(images)
    flat = array.reshape(len(array), -1).astype(np.float64)
    return flat / 255.0 if array.dtype == np.uint8 else flat


# --------------------------------------------------------------------------------------------
# One-run ε lower bound (Steinke, Nasr & Jagielski, 2023)
# --------------------------------------------------------------------------------------------

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


def epsilon_lower_bound(num_canaries: int, num_guesses: int, num_correct: int, delta: float,
                        beta: float = 0.05, epsilon_max: float = 100.0) -> float:
    """The ε lower bound at confidence ``1 - β`` from an observed number of correct guesses.

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
    grid = np.linspace(0.0, root, 257)
    not_rejected = [eps for eps in grid if excess(float(eps)) > 0.0]
    return float(not_rejected[0]) if not_rejected else root


def _check_audit_counts(num_canaries: int, num_guesses: int, num_correct: int) -> None:
    if not 0 <= num_correct <= num_guesses <= num_canaries:
        raise PrivacyError(
            f"need 0 <= correct ({num_correct}) <= guesses ({num_guesses}) <= canaries ({num_canaries})"
        )


@dataclasses.dataclass
class GuessOutcome:
    """The auditor's guesses from canary scores and how many were right."""

    num_canaries: int
    num_guesses: int
    num_correct: int
    guesses: np.ndarray  # int8 [m]: +1 guessed IN, -1 guessed OUT, 0 abstain


def guess_membership(scores: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int) -> GuessOutcome:
    """Guess the ``k_plus`` highest-scoring canaries IN and the ``k_minus`` lowest OUT, then score.

    Ties in the scores are broken by canary order, which is independent of the inclusion bits.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise DataError("one score and one inclusion bit per canary are required")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > len(scores):
        raise PrivacyError(f"k+ = {k_plus} and k- = {k_minus} must be >= 0 and sum to at most {len(scores)}")
    order = np.argsort(-scores, kind="stable")
    guesses = np.zeros(len(scores), dtype=np.int8)
    guesses[order[:k_plus]] = 1
    if k_minus:
        guesses[order[-k_minus:]] = -1
    truth = np.where(included, 1, -1)
    correct = int(np.sum(guesses * truth > 0))
    return GuessOutcome(len(scores), k_plus + k_minus, correct, guesses)
