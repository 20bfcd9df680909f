"""Membership inference: threshold attacks, their ROC, and TPR at a fixed FPR with exact intervals.

An attacker scores every private train example (member) and every private val example (non-member),
higher meaning "more likely a member"; the run's leak shows as a true-positive rate above the
false-positive rate at a low FPR (TPR@10%FPR, PrivImage: Li et al., "PrivImage: Differentially
Private Synthetic Image Generation using Diffusion Models with Semantic-Aware Pretraining",
arXiv:2311.12850, appendix A). Two attacks: the loss threshold attack on a released model (Yeom et
al., 2018: low loss = member) and the nearest-neighbour distance attack on released samples (a
member that the generator memorised lies close to some synthetic image).

The TPR and the FPR reached come with Clopper–Pearson intervals (:mod:`dpsynth.metrics.audit_stats`):
with a few hundred examples a TPR of 0.12 at 10 % FPR is not distinguishable from guessing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dpsynth.errors import DataError
from dpsynth.metrics.audit_stats import DEFAULT_CONFIDENCE, clopper_pearson

DEFAULT_FPR = 0.10


@dataclasses.dataclass
class AttackResult:
    """Outcome of one membership-inference attack; scores are "higher = more likely a member".

    ``fpr`` is the false-positive rate allowed, ``achieved_fpr`` the one the chosen threshold
    reaches (at most ``fpr``). ``tpr_interval`` and ``achieved_fpr_interval`` are two-sided
    Clopper–Pearson intervals at ``confidence`` (see :func:`rate_intervals`).
    """

    attack: str
    auc: float
    tpr_at_fpr: float
    fpr: float
    num_members: int
    num_nonmembers: int
    achieved_fpr: float
    true_positives: int
    false_positives: int
    tpr_interval: list[float]
    achieved_fpr_interval: list[float]
    confidence: float

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


def threshold_counts(
    member_scores: np.ndarray, nonmember_scores: np.ndarray, fpr: float = DEFAULT_FPR
) -> tuple[int, int]:
    """(true positives, false positives) of the lowest threshold whose false-positive rate is at most ``fpr``.

    The TPR only grows as the threshold falls, so this threshold has the largest TPR allowed; it
    depends on the non-member scores alone.
    """
    if not 0.0 <= fpr <= 1.0:
        raise ValueError(f"fpr must lie in [0, 1], got {fpr}")
    curve_fpr, curve_tpr = roc_curve(member_scores, nonmember_scores)
    last = int(np.flatnonzero(curve_fpr <= fpr + 1e-12)[-1])
    return (
        int(np.rint(curve_tpr[last] * np.size(member_scores))),
        int(np.rint(curve_fpr[last] * np.size(nonmember_scores))),
    )


def tpr_at_fpr(member_scores: np.ndarray, nonmember_scores: np.ndarray, fpr: float = DEFAULT_FPR) -> float:
    """Largest true positive rate of a threshold whose false positive rate is at most ``fpr``.

    This is PrivImage's TPR@10%FPR (appendix A, with ``fpr=0.1``); an attack that guesses at
    random scores about ``fpr``.
    """
    true_positives, _ = threshold_counts(member_scores, nonmember_scores, fpr)
    return true_positives / np.size(member_scores)


def rate_intervals(
    true_positives: int,
    num_members: int,
    false_positives: int,
    num_nonmembers: int,
    confidence: float = DEFAULT_CONFIDENCE,
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Clopper–Pearson intervals of the TPR and of the FPR reached at one threshold.

    The threshold depends on the non-member scores only (:func:`threshold_counts`), so given it
    the member count above it is binomial and the TPR interval is exact. The FPR interval treats
    the threshold as fixed although the same non-members chose it, so it is approximate.
    """
    return (
        clopper_pearson(true_positives, num_members, confidence),
        clopper_pearson(false_positives, num_nonmembers, confidence),
    )


def membership_attack(
    member_scores: np.ndarray,
    nonmember_scores: np.ndarray,
    attack: str,
    fpr: float = DEFAULT_FPR,
    confidence: float = DEFAULT_CONFIDENCE,
) -> AttackResult:
    """AUC and TPR at ``fpr`` of an attack given its scores (higher = member), with intervals."""
    num_members, num_nonmembers = int(np.size(member_scores)), int(np.size(nonmember_scores))
    true_positives, false_positives = threshold_counts(member_scores, nonmember_scores, fpr)
    tpr_interval, fpr_interval = rate_intervals(
        true_positives, num_members, false_positives, num_nonmembers, confidence
    )
    return AttackResult(
        attack=attack,
        auc=roc_auc(member_scores, nonmember_scores),
        tpr_at_fpr=true_positives / num_members,
        fpr=fpr,
        num_members=num_members,
        num_nonmembers=num_nonmembers,
        achieved_fpr=false_positives / num_nonmembers,
        true_positives=true_positives,
        false_positives=false_positives,
        tpr_interval=list(tpr_interval),
        achieved_fpr_interval=list(fpr_interval),
        confidence=confidence,
    )


def loss_attack(member_losses: np.ndarray, nonmember_losses: np.ndarray, fpr: float = DEFAULT_FPR) -> AttackResult:
    """Loss threshold attack (Yeom et al., 2018): a model fits its training examples better."""
    return membership_attack(
        -np.asarray(member_losses, np.float64), -np.asarray(nonmember_losses, np.float64), "loss", fpr
    )


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
        block = queries_flat[start : start + chunk]
        # ||a - b||² = ||a||² - 2 a·b + ||b||², one matrix product per chunk.
        squared = (
            np.einsum("ij,ij->i", block, block)[:, None] - 2.0 * block @ references_flat.T + reference_norms[None, :]
        )
        nearest[start : start + chunk] = np.sqrt(np.maximum(squared.min(axis=1), 0.0))
    return nearest


def nearest_neighbour_attack(
    members: np.ndarray, nonmembers: np.ndarray, synthetic: np.ndarray, fpr: float = DEFAULT_FPR
) -> AttackResult:
    """Distance-to-closest-record attack on released samples: closer to a sample = member."""
    return membership_attack(
        -nearest_neighbour_distances(members, synthetic),
        -nearest_neighbour_distances(nonmembers, synthetic),
        "nearest_neighbour",
        fpr,
    )


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
