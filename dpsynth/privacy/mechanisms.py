"""Privacy mechanisms that a run may apply to private data (docs/contract.md, privacy rule 1).

Each mechanism is a frozen dataclass whose parameters fully determine its privacy loss under
add/remove-one adjacency. ``repeats`` is how many times it has been applied (``steps`` for DP-SGD,
``count`` otherwise); the accountants compose all mechanisms heterogeneously.

- ``SubsampledGaussian``: Poisson-subsampled Gaussian mechanism (DP-SGD; Abadi et al. 2016), noise
  std = ``noise_multiplier`` x clip norm, each example included independently with ``sample_rate``.
- ``Gaussian``: full-batch Gaussian mechanism (a histogram, a sum of clipped statistics); noise std =
  ``noise_multiplier`` x L2 sensitivity.
- ``Laplace``: Laplace mechanism, scale = ``noise_multiplier`` x L1 sensitivity (pure 1/multiplier-DP).
- ``PureEpsilon``: any pure epsilon-DP mechanism (randomized response); accounted as binary
  randomized response, which dominates every epsilon-DP mechanism (Kairouz et al. 2015).
- ``ShardSampledGaussian``: a Gaussian release of a block computed from ONE of K disjoint shards of a
  fixed, content-keyed partition, the shard picked uniformly at random per application (GS-WGAN's
  generator step); noise std = ``noise_multiplier`` x the block's L2 diameter over any change of one
  shard. Accounted as sampling 1 of K without replacement over a change of one shard's contents, which
  covers add/remove of one record (see the class).

``dp_event()`` states each mechanism, with all its repeats, as a ``dp_accounting`` ``DpEvent``: the
machine-readable record that ``privacy.json`` carries and ``dpsynth privacy verify`` recomputes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dp_accounting import dp_event as dpe

from dpsynth.errors import PrivacyError

#: Hashable description of a mechanism's loss, independent of its name and repeat count.
Spec = tuple


def check_positive(value: Any, what: str) -> float:
    """Return ``value`` as a float if it is a finite number > 0, else raise PrivacyError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PrivacyError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def check_delta(delta: Any) -> float:
    """Return ``delta`` as a float if it lies in (0, 1), else raise PrivacyError."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 < delta < 1.0:
        raise PrivacyError(f"delta must lie in (0, 1), got {delta!r}")
    return float(delta)


def check_sample_rate(sample_rate: Any) -> float:
    """Return ``sample_rate`` as a float if it lies in (0, 1], else raise PrivacyError."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0.0 < sample_rate <= 1.0:
        raise PrivacyError(f"sample rate must lie in (0, 1], got {sample_rate!r}")
    return float(sample_rate)


def check_count(count: Any, what: str, minimum: int = 0) -> int:
    """Return ``count`` if it is an integer >= ``minimum``, else raise PrivacyError."""
    is_integral = isinstance(count, int) or (isinstance(count, float) and count.is_integer())
    if isinstance(count, bool) or not is_integral or count < minimum:
        raise PrivacyError(f"{what} must be an integer >= {minimum}, got {count!r}")
    return int(count)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise PrivacyError(f"a mechanism needs a non-empty name, got {name!r}")


@dataclass(frozen=True)
class SubsampledGaussian:
    """Poisson-subsampled Gaussian mechanism applied ``steps`` times (DP-SGD)."""

    name: str
    noise_multiplier: float
    sample_rate: float
    steps: int = 0

    kind = "subsampled_gaussian"

    def __post_init__(self) -> None:
        _check_name(self.name)
        object.__setattr__(self, "noise_multiplier", check_positive(self.noise_multiplier, "noise multiplier"))
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))
        object.__setattr__(self, "steps", check_count(self.steps, "steps"))

    @property
    def repeats(self) -> int:
        return self.steps

    def with_repeats(self, repeats: int) -> SubsampledGaussian:
        return dataclasses.replace(self, steps=repeats)

    def spec(self) -> Spec:
        # Sampling every example is the plain Gaussian mechanism; one spec lets both share a PRV.
        if self.sample_rate == 1.0:
            return ("gaussian", self.noise_multiplier)
        return (self.kind, self.noise_multiplier, self.sample_rate)

    def dp_event(self) -> dpe.DpEvent:
        """All ``steps`` steps: ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)`` (q = 1: plain Gaussian)."""
        gaussian = dpe.GaussianDpEvent(self.noise_multiplier)
        step = gaussian if self.sample_rate == 1.0 else dpe.PoissonSampledDpEvent(self.sample_rate, gaussian)
        return _repeated(step, self.steps)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
        }


class _Counted:
    """Shared by the mechanisms applied ``count`` times on the full dataset (sample rate 1)."""

    name: str
    count: int

    def _check_common(self) -> None:
        _check_name(self.name)
        object.__setattr__(self, "count", check_count(self.count, "count"))

    @property
    def repeats(self) -> int:
        return self.count

    def with_repeats(self, repeats: int) -> Any:
        return dataclasses.replace(self, count=repeats)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "noise_multiplier": getattr(self, "noise_multiplier", None),
            "sample_rate": 1.0,
            "steps": self.count,
        }


@dataclass(frozen=True)
class Gaussian(_Counted):
    """Full-batch Gaussian mechanism applied ``count`` times (sample rate 1)."""

    name: str
    noise_multiplier: float
    count: int = 1

    kind = "gaussian"

    def __post_init__(self) -> None:
        self._check_common()
        object.__setattr__(self, "noise_multiplier", check_positive(self.noise_multiplier, "noise multiplier"))

    def spec(self) -> Spec:
        return ("gaussian", self.noise_multiplier)

    def dp_event(self) -> dpe.DpEvent:
        """``SelfComposed(Gaussian(sigma), count)``: noise std = sigma x L2 sensitivity."""
        return _repeated(dpe.GaussianDpEvent(self.noise_multiplier), self.count)


@dataclass(frozen=True)
class Laplace(_Counted):
    """Laplace mechanism applied ``count`` times; scale = ``noise_multiplier`` x L1 sensitivity."""

    name: str
    noise_multiplier: float
    count: int = 1

    kind = "laplace"

    def __post_init__(self) -> None:
        self._check_common()
        object.__setattr__(self, "noise_multiplier", check_positive(self.noise_multiplier, "noise multiplier"))

    def spec(self) -> Spec:
        return (self.kind, self.noise_multiplier)

    def dp_event(self) -> dpe.DpEvent:
        """``SelfComposed(Laplace(b), count)``: scale = b x L1 sensitivity, as dp_accounting defines it."""
        return _repeated(dpe.LaplaceDpEvent(self.noise_multiplier), self.count)


@dataclass(frozen=True)
class PureEpsilon(_Counted):
    """A pure ``epsilon``-DP mechanism (e.g. randomized response) applied ``count`` times."""

    name: str
    epsilon: float
    count: int = 1

    kind = "pure_epsilon"

    def __post_init__(self) -> None:
        self._check_common()
        object.__setattr__(self, "epsilon", check_positive(self.epsilon, "epsilon"))

    def spec(self) -> Spec:
        return (self.kind, self.epsilon)

    def dp_event(self) -> dpe.DpEvent:
        """``SelfComposed(RandomizedResponse(p, 2 buckets), count)`` with ``p = 2 / (1 + e^epsilon)``.

        Binary randomized response with that noise parameter is exactly epsilon-DP and dominates every
        epsilon-DP mechanism (the accounting above). dp_accounting's accountants accept this event only
        under replace-one adjacency, so ``dpsynth privacy verify`` does not certify it (add/remove).
        """
        return _repeated(dpe.RandomizedResponseDpEvent(2.0 / (1.0 + math.exp(self.epsilon)), 2), self.count)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "epsilon": self.epsilon}


@dataclass(frozen=True)
class ShardSampledGaussian:
    """A Gaussian release computed from one of ``num_shards`` disjoint shards, the shard drawn uniformly per
    application, applied ``steps`` times (GS-WGAN's sanitised generator step, Chen et al., arXiv:2006.08265).

    The private set is split into K shards by a fixed function of each record's content (K public, not
    derived from N), so adding or removing one record changes the contents of exactly one shard and moves
    no other record. (Replacing a record is not covered: the new content can key it to another shard, so
    two shards change; dpsynth states add/remove only.) One application picks a shard uniformly at random
    (secretly), computes a block from that shard alone (and released or public state), and adds Gaussian
    noise of std ``noise_multiplier`` x Delta to the whole block, Delta being the block's L2 diameter over
    every possible content of the shard (GS-WGAN: B rows clipped to C, Delta = 2 C sqrt(B)). On the
    "dataset" of K shards this is the Gaussian mechanism on a sample of size 1 drawn without replacement
    from K, over a change of one shard's contents: the analysis of Wang, Balle & Kasiviswanathan
    (AISTATS 2019, Theorem 27), which dp_accounting implements as
    ``SampledWithoutReplacementDpEvent(K, 1, Gaussian(sigma))`` under ``REPLACE_ONE`` (of one of the K
    shards: an accounting device at the shard level). A record-level add/remove neighbour changes one
    shard's contents, so the bound holds for dpsynth's add/remove adjacency and composes (RDP orders add)
    with the other mechanisms. The amplification applies once per application: all rows of the block
    share the drawn shard, so the block is ONE Gaussian, never B separately amplified ones.

    Only the RDP accountant composes it (dp_accounting has this event in RDP only; the PRV accountant
    refuses it). ``to_dict`` states ``sample_rate = 1/K``.
    """

    name: str
    noise_multiplier: float
    num_shards: int
    steps: int = 0

    kind = "shard_sampled_gaussian"

    def __post_init__(self) -> None:
        _check_name(self.name)
        object.__setattr__(self, "noise_multiplier", check_positive(self.noise_multiplier, "noise multiplier"))
        object.__setattr__(self, "num_shards", check_count(self.num_shards, "number of shards", minimum=1))
        object.__setattr__(self, "steps", check_count(self.steps, "steps"))

    @property
    def sample_rate(self) -> float:
        return 1.0 / self.num_shards

    @property
    def repeats(self) -> int:
        return self.steps

    def with_repeats(self, repeats: int) -> ShardSampledGaussian:
        return dataclasses.replace(self, steps=repeats)

    def spec(self) -> Spec:
        # One shard: every application reads the whole set, the plain Gaussian mechanism.
        if self.num_shards == 1:
            return ("gaussian", self.noise_multiplier)
        return (self.kind, self.noise_multiplier, self.num_shards)

    def dp_event(self) -> dpe.DpEvent:
        """``SelfComposed(SampledWithoutReplacement(K, 1, Gaussian(sigma)), steps)`` (K = 1: plain Gaussian)."""
        gaussian = dpe.GaussianDpEvent(self.noise_multiplier)
        if self.num_shards == 1:
            return _repeated(gaussian, self.steps)
        return _repeated(dpe.SampledWithoutReplacementDpEvent(self.num_shards, 1, gaussian), self.steps)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
        }


def _shards_from_rate(sample_rate: Any) -> int:
    """K of a recorded ``sample_rate = 1/K``; PrivacyError unless it is the reciprocal of an integer."""
    rate = check_sample_rate(sample_rate)
    shards = round(1.0 / rate)
    if shards < 1 or abs(1.0 / shards - rate) > 1e-12:
        raise PrivacyError(f"a shard-sampled Gaussian's sample rate must be 1/K for an integer K, got {sample_rate!r}")
    return shards


Mechanism = SubsampledGaussian | Gaussian | Laplace | PureEpsilon | ShardSampledGaussian
MECHANISM_TYPES = (SubsampledGaussian, Gaussian, Laplace, PureEpsilon, ShardSampledGaussian)


def mechanism_from_dict(data: dict) -> Mechanism:
    """Rebuild a mechanism from ``to_dict()`` output (used by ledger resume)."""
    kind = data.get("kind")
    try:
        if kind == SubsampledGaussian.kind:
            return SubsampledGaussian(data["name"], data["noise_multiplier"], data["sample_rate"], data["steps"])
        if kind == Gaussian.kind:
            return Gaussian(data["name"], data["noise_multiplier"], data["steps"])
        if kind == Laplace.kind:
            return Laplace(data["name"], data["noise_multiplier"], data["steps"])
        if kind == PureEpsilon.kind:
            return PureEpsilon(data["name"], data["epsilon"], data["steps"])
        if kind == ShardSampledGaussian.kind:
            shards = _shards_from_rate(data["sample_rate"])
            return ShardSampledGaussian(data["name"], data["noise_multiplier"], shards, data["steps"])
    except KeyError as missing:
        raise PrivacyError(f"mechanism record {data!r} lacks {missing}") from None
    raise PrivacyError(f"unknown mechanism kind {kind!r}")


def _repeated(event: dpe.DpEvent, repeats: int) -> dpe.DpEvent:
    """``event`` applied ``repeats`` times; a mechanism never applied released nothing (a no-op)."""
    return dpe.SelfComposedDpEvent(event, repeats) if repeats > 0 else dpe.NoOpDpEvent()


def composed_dp_event(mechanisms) -> dpe.ComposedDpEvent:
    """The whole composition as one ``ComposedDpEvent``, in order; mechanisms never applied are left out."""
    events = []
    for mechanism in mechanisms:
        if not isinstance(mechanism, MECHANISM_TYPES):
            raise PrivacyError(f"not a privacy mechanism: {mechanism!r}")
        if mechanism.repeats > 0:
            events.append(mechanism.dp_event())
    return dpe.ComposedDpEvent(events)


def canonical_composition(mechanisms) -> tuple[tuple[Spec, int], ...]:
    """Merge mechanisms with identical loss into ``((spec, total repeats), ...)``, sorted.

    The result is hashable (a cache key) and independent of names and order; mechanisms that were
    applied zero times are dropped, since they released nothing.
    """
    totals: dict[Spec, int] = {}
    for mechanism in mechanisms:
        if not isinstance(mechanism, MECHANISM_TYPES):
            raise PrivacyError(f"not a privacy mechanism: {mechanism!r}")
        if mechanism.repeats > 0:
            totals[mechanism.spec()] = totals.get(mechanism.spec(), 0) + mechanism.repeats
    return tuple(sorted(totals.items(), key=lambda item: repr(item[0])))
