"""The noisy bounded-sum release: per-class sums of norm-bounded per-example features, plus Gaussian noise.

One mechanism with many users (docs/privacy.md, "The bounded-sum release"): DP-MERF's random-feature
mean embedding (Harder et al., AISTATS 2021, arXiv:2002.11603, §3, Eq. 5-6), DP-NTK's e-NTK mean
embedding (Yang et al., arXiv:2303.01687, §3), DP-FETA's central images (Li et al., IEEE S&P 2025,
arXiv:2504.01395, §4.1; the class *sum* noised, then divided by a public denominator), PrivImage's
semantic histogram (Li et al., arXiv:2311.12850, Theorem 3.1) and DP-ImgSyn's clipped moment sums with
their noisy count (the one-class case, with ``count_weight``; DP-ImgSyn (TMLR 2024) §4.1).

**Mechanism.** Every private record ``i`` brings a feature ``f_i`` in R^D and a label ``y_i`` in
[0, K). The feature is clipped to a *declared* L2 bound ``B`` (a row over the bound is scaled down,
never trusted; a non-finite row counts as zero), and the release is

    S = [sum_{i: y_i = c} clip_B(f_i)]_{c < K}  (+ optionally  w * [#{i: y_i = c}]_{c < K})

plus ``N(0, (sigma * Delta)^2 I)`` on every coordinate. The classes are disjoint, so one record
touches one row: under add/remove-one adjacency the whole ``K x D`` table moves by at most ``B`` in L2
(parallel composition, no factor K), and with the counts appended (one Gaussian on the concatenation
``[sums, w * counts]``) by at most ``Delta = sqrt(B^2 + w^2)``. Optionally each record first enters a
Poisson subsample with rate ``q`` (coins from the :class:`~dpsynth.privacy.rng.NoiseSource`, drawn
after the charge). One release is therefore ``Gaussian(name, sigma)`` (q = 1) or
``SubsampledGaussian(name, sigma, q)`` (q < 1), noise std = sigma x L2 sensitivity; releasing again
under the same name adds repeats, so ``repeats`` releases compose as one ledger entry whose
``dp_event`` is ``SelfComposed([PoissonSampled(q,] Gaussian(sigma)[)], repeats)``.

**Denominator.** The released means divide the noisy sums by a *declared public* denominator (a
constant, or one per class, fixed before the data is read: e.g. the dataset size N, or DP-FETA's
expected class count qN/K), or, with ``count_weight``, by the noisy counts released jointly with
the sums (clamped below at ``min_count``: post-processing). Dividing by a realised count would make
the mean's sensitivity depend on private data; neither option does that.

The mechanism is charged to the ledger *before* anything is computed from private data: a refused
charge (:class:`~dpsynth.errors.BudgetExceededError`) leaves the private chunks unread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dpsynth.errors import DataError, PrivacyError
from dpsynth.privacy.mechanisms import (
    Gaussian,
    SubsampledGaussian,
    check_count,
    check_positive,
    check_sample_rate,
)
from dpsynth.privacy.rng import NoiseSource

#: One chunk of private records: features ``[n, D]`` and labels ``[n]`` (None: the one-class case).
LabelledChunk = tuple[torch.Tensor, torch.Tensor | None]

# Keeps the scale finite in the branch torch.where evaluates but does not pick (a zero row).
_NORM_EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class BoundedSum:
    """A bounded-sum release, declared before any private data is read (all fields are public).

    Args:
        name: the mechanism's name in the ledger and ``privacy.json``.
        bound: ``B``, the declared L2 bound of one record's feature (rows over it are scaled to it).
        noise_multiplier: ``sigma``; the noise std is ``sigma * sensitivity``.
        num_classes: ``K`` disjoint rows (1: one sum over all records).
        sample_rate: Poisson rate ``q`` (1: every record, a full-batch Gaussian).
        denominator: the declared public divisor of the means: one number, or one per class; None
            divides by 1 (the raw noisy sums, e.g. a histogram). Never a count read off private data.
        count_weight: ``w``: release the per-class counts jointly with the sums (each record adds
            ``w`` to its class's count coordinate) and divide the means by the noisy counts; the
            sensitivity becomes ``sqrt(B^2 + w^2)``. Exclusive with ``denominator``.
        min_count: lower clamp of the noisy counts before dividing (post-processing; keeps an empty
            class's mean finite).
    """

    name: str
    bound: float
    noise_multiplier: float
    num_classes: int = 1
    sample_rate: float = 1.0
    denominator: float | tuple[float, ...] | None = None
    count_weight: float | None = None
    min_count: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PrivacyError(f"a bounded-sum release needs a non-empty name, got {self.name!r}")
        object.__setattr__(self, "bound", check_positive(self.bound, "the feature bound B"))
        object.__setattr__(self, "noise_multiplier", check_positive(self.noise_multiplier, "noise_multiplier"))
        object.__setattr__(self, "num_classes", check_count(self.num_classes, "num_classes", minimum=1))
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))
        object.__setattr__(self, "min_count", check_positive(self.min_count, "min_count"))
        if self.count_weight is not None:
            object.__setattr__(self, "count_weight", check_positive(self.count_weight, "count_weight"))
            if self.denominator is not None:
                raise PrivacyError("give either a declared denominator or a count_weight (noisy counts), not both")
        object.__setattr__(self, "denominator", self._checked_denominator())

    def _checked_denominator(self) -> float | tuple[float, ...] | None:
        if self.denominator is None:
            return None
        if not isinstance(self.denominator, Sequence):
            return check_positive(self.denominator, "denominator")
        values = tuple(check_positive(value, "denominator") for value in self.denominator)
        if len(values) != self.num_classes:
            raise PrivacyError(f"a per-class denominator needs {self.num_classes} values, got {len(values)}")
        return values

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the released vector under add/remove-one: ``B``, or ``sqrt(B^2 + w^2)``."""
        return math.hypot(self.bound, self.count_weight or 0.0)

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise on every released coordinate: ``sigma * sensitivity``."""
        return self.noise_multiplier * self.sensitivity

    def mechanism(self, repeats: int = 1) -> Gaussian | SubsampledGaussian:
        """The ledger entry of ``repeats`` releases (0: the declaration for ``ledger.register``)."""
        if self.sample_rate == 1.0:
            return Gaussian(self.name, self.noise_multiplier, repeats)
        return SubsampledGaussian(self.name, self.noise_multiplier, self.sample_rate, repeats)


@dataclasses.dataclass(frozen=True)
class BoundedSumRelease:
    """What one release publishes (float64 CPU tensors); nothing here is an exact private value.

    ``sums``: noisy per-class sums ``[K, D]``; ``counts``: noisy per-class counts ``[K]`` (only with
    ``count_weight``); ``means``: ``sums`` over the declared denominator or the clamped noisy counts.
    """

    sums: torch.Tensor
    counts: torch.Tensor | None
    means: torch.Tensor
    noise_std: float


def clip_to_bound(features: torch.Tensor, bound: float) -> torch.Tensor:
    """Scale every row ``v`` to ``min(1, B / ||v||_2) v``; a row with a NaN or infinity becomes zero.

    A zeroed row still adds at most ``B`` (nothing at all), so the sensitivity holds whatever the
    feature extractor returns.
    """
    # A row's norm is NaN or infinite exactly when the row holds a NaN or an infinity (or its squares
    # overflow, and such a row is scaled to zero anyway): one reduction instead of an elementwise test,
    # which costs ten times as much on the e-NTK's 636,010-entry rows.
    norms = features.norm(dim=1, keepdim=True)
    finite = torch.isfinite(norms)
    # Rows within the bound are left exactly as they are (a k-hot histogram row stays integral).
    scale = torch.where(norms > bound, bound / norms.clamp(min=_NORM_EPS), torch.ones_like(norms))
    clipped = features * scale
    # 0 x inf and NaN x anything are NaN: zero the non-finite rows themselves
    return clipped.masked_fill_(~finite, 0.0)


def class_sums(
    chunks: Iterable[LabelledChunk], dim: int, num_classes: int, bound: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact (noiseless) clipped per-class sums ``[K, D]`` and counts ``[K]``, float64 on the CPU.

    Never released: :func:`release_bounded_sum` adds the noise, tests compare neighbours with it.
    The sums accumulate on the chunks' device and reach the CPU once: copying every chunk there made
    DP-NTK's release on a GPU (55,084 rows of 636,010 features) spend minutes in host copies and adds.
    """
    sums: torch.Tensor | None = None
    counts = torch.zeros(num_classes, dtype=torch.float64)
    for features, labels in chunks:
        rows = _rows_of(features, labels, dim, num_classes)
        clipped = clip_to_bound(features.detach().to(torch.float64), bound)
        if sums is None:
            sums = torch.zeros(num_classes, dim, dtype=torch.float64, device=clipped.device)
        sums.index_add_(0, rows.to(sums.device), clipped.to(sums.device))
        counts += torch.bincount(rows.cpu(), minlength=num_classes).to(torch.float64)
    if sums is None:
        return torch.zeros(num_classes, dim, dtype=torch.float64), counts
    return sums.cpu(), counts


def _rows_of(features: torch.Tensor, labels: torch.Tensor | None, dim: int, num_classes: int) -> torch.Tensor:
    """The row (class) of every record of a chunk, checked without quoting a private value."""
    if features.ndim != 2 or features.shape[1] != dim:
        raise ValueError(f"every chunk must be [n, {dim}], got shape {tuple(features.shape)}")
    if labels is None:
        if num_classes != 1:
            raise DataError(f"labels are needed for a release with {num_classes} classes")
        return torch.zeros(features.shape[0], dtype=torch.int64, device=features.device)
    labels = labels.to(torch.int64).reshape(-1)
    if labels.shape[0] != features.shape[0]:
        raise ValueError(f"a chunk has {features.shape[0]} feature rows but {labels.shape[0]} labels")
    if labels.numel() and bool((labels < 0).any()):
        raise DataError("a label is negative")
    if labels.numel() and bool((labels >= num_classes).any()):
        raise DataError(f"a label is {num_classes} or more")
    return labels.to(features.device)


def poisson_sample(num_records: int, sample_rate: float, noise: NoiseSource) -> torch.Tensor:
    """Sorted int64 indices, each of ``num_records`` records kept independently with probability ``q``.

    The coins come from the DP noise source: which records were sampled is part of the mechanism's
    randomness, as unpredictable as its noise (docs/privacy.md, "Randomness of the mechanisms").
    """
    num_records = check_count(num_records, "num_records")
    return (noise.uniform(num_records) < check_sample_rate(sample_rate)).nonzero().flatten()


def release_bounded_sum(
    chunks: Iterable[LabelledChunk],
    dim: int,
    query: BoundedSum,
    ledger: Any,
    noise: NoiseSource,
    *,
    registered: bool = False,
) -> BoundedSumRelease:
    """Release ``query`` over every record (sample rate 1): charge, then sum, then add noise once.

    Args:
        chunks: ``(features [n, D], labels [n] | None)`` pairs; may be a lazy generator that reads
            private data, consumed only after the charge succeeded.
        dim: ``D``, the feature length.
        query: the declared release (its ``sample_rate`` must be 1; see
            :func:`release_subsampled_bounded_sum`).
        ledger: the run's :class:`~dpsynth.privacy.PrivacyLedger`.
        noise: the DP noise source (never the run seed).
        registered: account the release as one step of the repeated mechanism
            ``query.mechanism(0)`` (``ledger.register`` + ``ledger.spend``: a dictionary look-up, for a
            release per training step) instead of charging a one-off mechanism (a composition).
    """
    if query.sample_rate != 1.0:
        raise PrivacyError(
            f"'{query.name}' has sample rate {query.sample_rate:g}: use release_subsampled_bounded_sum, "
            "which draws the Poisson sample"
        )
    _account(query, ledger, registered)
    return _noisy_release(chunks, dim, query, noise)


def release_subsampled_bounded_sum(
    select: Callable[[torch.Tensor], Iterable[LabelledChunk]],
    num_records: int,
    dim: int,
    query: BoundedSum,
    ledger: Any,
    noise: NoiseSource,
    *,
    registered: bool = False,
) -> BoundedSumRelease:
    """Release ``query`` over a Poisson subsample of rate ``query.sample_rate`` of the ``num_records`` records.

    After the charge, every record is kept with probability ``q`` (:func:`poisson_sample`) and
    ``select(indices)`` yields the chunks of the kept records only. The realised sample size is
    private and is not returned; a declared denominator should be the expected size (e.g. ``qN/K``
    per class), never the realised one.
    """
    _account(query, ledger, registered)
    indices = poisson_sample(num_records, query.sample_rate, noise)
    return _noisy_release(select(indices), dim, query, noise)


def _account(query: BoundedSum, ledger: Any, registered: bool) -> None:
    """Record one release before any private data is read; raises (recording nothing) past the budget."""
    if registered:
        # Registering again is a no-op for the same parameters and refuses other ones, so the step
        # spent is always the mechanism this release applies (never a differently noised namesake).
        ledger.register(query.mechanism(0))
        ledger.spend(query.name, 1)
    else:
        ledger.charge(query.mechanism(1))


def _noisy_release(
    chunks: Iterable[LabelledChunk], dim: int, query: BoundedSum, noise: NoiseSource
) -> BoundedSumRelease:
    dim = check_count(dim, "dim", minimum=1)
    sums, counts = class_sums(chunks, dim, query.num_classes, query.bound)
    exact = sums.reshape(-1)
    if query.count_weight is not None:
        exact = torch.cat([exact, query.count_weight * counts])
    # One draw for the whole concatenated vector: one Gaussian mechanism, one noise vector.
    noisy = exact + noise.normal(exact.shape, std=query.noise_std, dtype=torch.float64)
    noisy_sums = noisy[: query.num_classes * dim].reshape(query.num_classes, dim)
    noisy_counts = None
    if query.count_weight is not None:
        noisy_counts = noisy[query.num_classes * dim :] / query.count_weight
        means = noisy_sums / noisy_counts.clamp(min=query.min_count)[:, None]
    else:
        means = noisy_sums / _denominator(query)
    return BoundedSumRelease(noisy_sums, noisy_counts, means, query.noise_std)


def _denominator(query: BoundedSum) -> torch.Tensor:
    """The declared divisor, shaped to broadcast over ``[K, D]`` (1 when none was declared)."""
    if query.denominator is None:
        return torch.tensor(1.0, dtype=torch.float64)
    if isinstance(query.denominator, tuple):
        return torch.tensor(query.denominator, dtype=torch.float64)[:, None]
    return torch.tensor(query.denominator, dtype=torch.float64)
