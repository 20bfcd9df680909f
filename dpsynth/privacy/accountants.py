"""Accountants that compose heterogeneous mechanisms into one (epsilon, delta) guarantee.

Two accountants sit behind :func:`compute_epsilon`:

- ``"prv"`` (default): the privacy random variable accountant of Gopi, Lee & Wutschitz (2021),
  "Numerical Composition of Differential Privacy", using the ``prv_accountant`` package's privacy
  random variables, truncation, discretisation and error analysis. We report the *upper* end of its
  interval: the true epsilon lies within ``[estimate - EPS_ERROR, estimate + EPS_ERROR]`` except for a
  ``delta_error = DELTA_ERROR_FRACTION * delta`` slack (their Theorem 5.5), so ``estimate + EPS_ERROR``
  computed at ``delta - delta_error`` is a guarantee.
- ``"rdp"``: Renyi DP (Mironov 2017) via ``dp_accounting.rdp.RdpAccountant``, with its tight
  RDP-to-(epsilon, delta) conversion (Canonne, Kamath & Steinke 2020, Prop. 12). It alone composes the
  shard-sampled Gaussian (GS-WGAN): its RDP curve is dp_accounting's sampling-without-replacement bound
  over a change of one shard's contents (a bound for add/remove of one record, see
  :class:`~dpsynth.privacy.mechanisms.ShardSampledGaussian`), added order by order to the add/remove
  RDP curve of the other mechanisms. The PRV accountant has no privacy random variable for it and
  refuses such a composition with a one-line error.

Why the PRV accountant is wrapped rather than called as ``prv_accountant.PRVAccountant``: that class
sizes its grid as ``2L / mesh`` cells, an arbitrary length whose FFT can be 30x slower than a
nearby smooth length; we widen the same symmetric grid to an FFT-friendly size (a wider domain only
truncates less). We also round each repeat count up to a power of two when sizing the grid, so that
one discretisation serves every count in that bucket (the ledger searches over step counts), and
give pure-epsilon mechanisms their exact Renyi divergence (prv_accountant's ``PureDPMechanism.rdp``
understates it, which would only shrink the truncation domain).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable

import numpy as np
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp_module
from prv_accountant import GaussianMechanism, LaplaceMechanism, PoissonSubsampledGaussianMechanism, PureDPMechanism
from prv_accountant.discrete_privacy_random_variable import DiscretePrivacyRandomVariable
from prv_accountant.domain import Domain
from prv_accountant.privacy_random_variables import PrivacyRandomVariableTruncated
from scipy import integrate, special
from scipy.fft import irfft, next_fast_len, rfft

from dpsynth.errors import PrivacyError
from dpsynth.privacy.mechanisms import Mechanism, ShardSampledGaussian, Spec, canonical_composition, check_delta

# dp-accounting logs a warning per RDP order it cannot evaluate at large sample rates and drops that
# order, which only loosens the bound it returns; keep those lines out of the user's terminal.
logging.getLogger("absl").setLevel(logging.ERROR)

ACCOUNTANTS = ("prv", "rdp")
#: Width of the PRV accountant's epsilon interval on each side of its estimate (as in opacus).
EPS_ERROR = 0.01
#: The PRV accountant's delta slack, as a fraction of delta (as in opacus).
DELTA_ERROR_FRACTION = 1e-3
#: Largest PRV grid we build (cells); beyond it memory and time explode, and RDP is the tool.
MAX_PRV_GRID = 2**23

_INTEGER_ORDERS = tuple(range(2, 65)) + (96, 128, 256)

Composition = tuple  # ((spec, repeats), ...) from canonical_composition


def check_accountant(accountant: str) -> str:
    """Return ``accountant`` if it names a known accountant, else raise PrivacyError."""
    if accountant not in ACCOUNTANTS:
        raise PrivacyError(f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
    return accountant


def compute_epsilon(mechanisms: Iterable[Mechanism], delta: float, accountant: str = "prv") -> float:
    """Return an upper bound on epsilon at ``delta`` for the composition of ``mechanisms``.

    Mechanisms applied zero times count for nothing; an empty composition has epsilon 0.
    Results are cached, so asking again for the same composition costs nothing.
    """
    delta = check_delta(delta)
    check_accountant(accountant)
    return composition_epsilon(canonical_composition(mechanisms), delta, accountant)


@functools.lru_cache(maxsize=4096)
def composition_epsilon(composition: Composition, delta: float, accountant: str) -> float:
    """Epsilon of a canonical composition (see :func:`canonical_composition`); cached."""
    if not composition:
        return 0.0
    if accountant == "rdp":
        return _rdp_epsilon(composition, delta)
    return _prv_epsilon(composition, delta)


# ----------------------------------------------------------------------------------------- RDP


#: dp_accounting's default RDP orders, as a hashable key of the cached curves below
_ORDERS = tuple(rdp_module.DEFAULT_RDP_ORDERS)


def _single_event(spec: Spec, pure_as_bounded_divergence: bool) -> dp_event.DpEvent:
    """The add/remove ``DpEvent`` of ONE application of ``spec`` (not shard-sampled)."""
    kind = spec[0]
    if kind == "subsampled_gaussian":
        return dp_event.PoissonSampledDpEvent(spec[2], dp_event.GaussianDpEvent(spec[1]))
    if kind == "gaussian":
        return dp_event.GaussianDpEvent(spec[1])
    if kind == "laplace":
        return dp_event.LaplaceDpEvent(spec[1])
    # dp_accounting has no add/remove pure-DP event; two standard bounds on the Renyi divergence of an
    # epsilon-DP mechanism: D_a <= epsilon (trivially, zCDP with xi=eps, rho=0) and D_a <= a * eps^2 / 2
    # (Bun & Steinke 2016, Prop. 3.3: rho = eps^2/2).
    epsilon = spec[1]
    if pure_as_bounded_divergence:
        return dp_event.ZCDpEvent(rho=0.0, xi=epsilon)
    return dp_event.ZCDpEvent(rho=epsilon**2 / 2, xi=0.0)


@functools.lru_cache(maxsize=4096)
def _single_rdp(spec: Spec, pure_as_bounded_divergence: bool, orders: tuple[float, ...]) -> np.ndarray:
    """RDP curve at ``orders`` of ONE application of ``spec``, as ``RdpAccountant`` computes it; cached.

    Composition multiplies this curve by the repeat count, so the curve is computed once per
    (mechanism, sigma): the step-by-step epsilons of a run and repeated plans then cost only the conversion.
    """
    if spec[0] == ShardSampledGaussian.kind:
        return _shard_rdp(spec[1], spec[2], orders)
    if spec[0] == "subsampled_gaussian" and orders == _INTEGER_ORDERS:  # rough_epsilon's curve
        return _integer_order_rdp(spec[1], spec[2])
    accountant = RdpAccountant(orders=orders)
    accountant.compose(_single_event(spec, pure_as_bounded_divergence))
    curve = np.array(accountant._rdp, dtype=np.float64)  # the curve itself, not its epsilon
    curve.setflags(write=False)
    return curve


@functools.lru_cache(maxsize=256)
def _shard_rdp(noise_multiplier: float, num_shards: int, orders: tuple[float, ...]) -> np.ndarray:
    """RDP curve of ONE shard-sampled Gaussian step: sampling 1 of K without replacement, replace-one of a
    shard (Wang, Balle & Kasiviswanathan 2019, Theorem 27, as dp_accounting computes it; ~1 s per (sigma, K)).
    """
    accountant = RdpAccountant(orders=orders, neighboring_relation=NeighboringRelation.REPLACE_ONE)
    accountant.compose(
        dp_event.SampledWithoutReplacementDpEvent(num_shards, 1, dp_event.GaussianDpEvent(noise_multiplier))
    )
    curve = np.array(accountant._rdp, dtype=np.float64)
    curve.setflags(write=False)  # cached and shared
    return curve


def _rdp_epsilon(composition: Composition, delta: float, orders: tuple[float, ...] = _ORDERS) -> float:
    """Epsilon of ``composition`` by RDP: each mechanism's cached one-application curve times its repeat count,
    added order by order in composition order (what ``RdpAccountant.compose`` adds, in the same order), then
    dp_accounting's conversion to (epsilon, delta). The shard-sampled steps' curves (a change of one shard's
    contents) are added order by order to the add/remove curve of the others."""
    has_pure = any(spec[0] == "pure_epsilon" for spec, _ in composition)
    # Both pure-DP bounds are valid, so the smaller resulting epsilon is a valid bound too.
    variants = (True, False) if has_pure else (True,)
    best = math.inf
    for variant in variants:
        rdp = np.zeros(len(orders))
        shard = np.zeros(len(orders))
        for spec, repeats in composition:
            if spec[0] == ShardSampledGaussian.kind:
                shard += repeats * _single_rdp(spec, variant, orders)
            else:
                rdp += repeats * _single_rdp(spec, variant, orders)
        epsilon, _ = rdp_module.compute_epsilon(orders, rdp + shard, delta)
        best = min(best, float(epsilon))
    return best


def _integer_order_rdp(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at ``_INTEGER_ORDERS``, all orders in one array expression:
    D_a = log A_a / (a - 1), A_a = sum_k C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2)) (Mironov, Talwar
    & Zhang 2019, "Renyi Differential Privacy of the Sampled Gaussian Mechanism", Sec. 3.3). dp_accounting sums
    the same series term by term in Python (about ten times slower); the two agree to 1e-9 relative, and only
    :func:`rough_epsilon` (never recorded) reads it."""
    orders = np.array(_INTEGER_ORDERS, dtype=np.float64)[:, None]
    k = np.arange(int(orders.max()) + 1, dtype=np.float64)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = (
            special.gammaln(orders + 1)
            - special.gammaln(k + 1)
            - special.gammaln(orders - k + 1)
            + k * math.log(sample_rate)
            + (orders - k) * math.log1p(-sample_rate)
            + (k * k - k) / (2 * noise_multiplier**2)
        )
    terms = np.where(k <= orders, terms, -np.inf)  # a term per k = 0..a
    curve = special.logsumexp(terms, axis=1) / (orders[:, 0] - 1)
    curve.setflags(write=False)  # cached by _single_rdp and shared
    return curve


def rough_epsilon(mechanisms: Iterable[Mechanism], delta: float) -> float:
    """A quick upper bound on epsilon: RDP at integer orders only, where the subsampled Gaussian's curve has a
    closed form (the fractional orders' series make up nearly all of the RDP accountant's cost). It is usually a
    few percent looser than either accountant; calibration starts from it and then solves with the run's
    accountant, so it is never recorded."""
    composition = canonical_composition(mechanisms)
    return _rdp_epsilon(composition, check_delta(delta), _INTEGER_ORDERS) if composition else 0.0


# ----------------------------------------------------------------------------------------- PRV


class _RandomizedResponse(PureDPMechanism):
    """Pure epsilon-DP as binary randomized response, with its exact Renyi divergence.

    The privacy loss is +eps with probability e^eps / (1 + e^eps), else -eps, so
    D_a = log(p^a q^(1-a) + q^a p^(1-a)) / (a - 1).
    """

    def rdp(self, alpha: float) -> float:
        log_p = -math.log1p(math.exp(-self.eps))
        log_q = -self.eps + log_p
        moment = np.logaddexp(alpha * log_p + (1 - alpha) * log_q, alpha * log_q + (1 - alpha) * log_p)
        return float(moment / (alpha - 1))


def _privacy_random_variable(spec: Spec):
    kind = spec[0]
    if kind == ShardSampledGaussian.kind:
        raise PrivacyError(
            "the PRV accountant cannot compose a shard-sampled Gaussian (GS-WGAN's step: sampling 1 of K shards "
            "without replacement); use the rdp accountant (privacy.accountant: rdp)"
        )
    if kind == "subsampled_gaussian":
        return PoissonSubsampledGaussianMechanism(sampling_probability=spec[2], noise_multiplier=spec[1])
    if kind == "gaussian":
        return GaussianMechanism(noise_multiplier=spec[1])
    if kind == "laplace":
        # Privacy loss of Laplace(scale b) on sensitivity 1 is bounded by mu = 1 / b.
        return LaplaceMechanism(mu=1.0 / spec[1])
    return _RandomizedResponse(eps=spec[1])


def _bucket(repeats: int) -> int:
    """Round up to a power of two: the grid for the bucket serves every count inside it."""
    return 1 << max(0, repeats - 1).bit_length()


class _PRVGrid:
    """Discretised privacy random variables of a set of specs, sized for up to ``max_repeats`` each."""

    def __init__(self, specs: tuple[Spec, ...], max_repeats: tuple[int, ...], delta: float) -> None:
        self.delta_error = DELTA_ERROR_FRACTION * delta
        prvs = [_privacy_random_variable(spec) for spec in specs]
        half_width = _safe_half_width(specs, max_repeats, self.delta_error)
        # Mesh from Gopi et al., Theorem 5.5, for the bucket's total number of compositions.
        mesh = EPS_ERROR / math.sqrt(sum(max_repeats) / 2 * math.log(12 / self.delta_error))
        size = _fast_even_length(2 * math.ceil(half_width / mesh) + 2)
        if size > MAX_PRV_GRID:
            raise PrivacyError(
                f"this composition is too large for the PRV accountant (grid of {size} cells; "
                f"epsilon is roughly {half_width - 3:.3g}); use the rdp accountant"
            )
        # Symmetric grid aligned at 0, as Domain.create_aligned builds it (zero at index size/2 - 1).
        half_cells = size // 2 - 1
        domain = Domain(-half_cells * mesh, (half_cells + 1) * mesh, size)
        discrete = [
            _discretise(PrivacyRandomVariableTruncated(prv, domain.t_min(), domain.t_max()), domain) for prv in prvs
        ]
        self.base_domain = domain
        self.size = size
        self.spectra = [rfft(prv.pmf) for prv in discrete]
        self.mean_shifts = [prv.domain.shifts() for prv in discrete]

    def compose(self, repeats: tuple[int, ...]) -> DiscretePrivacyRandomVariable:
        """Compose every PRV ``repeats[i]`` times by one product in Fourier space.

        This is ``prv_accountant``'s Fourier self-composition extended to a product over different
        PRVs on the same grid (one inverse FFT instead of a tree of linear convolutions). Every
        discrete PRV has its zero at index ``size/2 - 1``; the circular convolution of N of them puts
        it at ``N (size/2 - 1)``, hence the roll, and the mean corrections add up.
        """
        spectrum = np.ones_like(self.spectra[0])
        for spectrum_i, count in zip(self.spectra, repeats):
            spectrum = spectrum * spectrum_i**count
        pmf = irfft(spectrum, n=self.size)
        total = sum(repeats)
        pmf = np.roll(pmf, total - 1 + (self.size // 2 if total % 2 == 0 else 0))
        shift = sum(count * mean_shift for count, mean_shift in zip(repeats, self.mean_shifts))
        return DiscretePrivacyRandomVariable(pmf, self.base_domain.shift_right(shift))

    def epsilon(self, repeats: tuple[int, ...], delta: float) -> float:
        _, _, upper = self.compose(repeats).compute_epsilon(delta, self.delta_error, EPS_ERROR)
        return max(0.0, float(upper))


def _safe_half_width(specs: tuple[Spec, ...], max_repeats: tuple[int, ...], delta_error: float) -> float:
    """Half width L of a grid that loses at most ``delta_error`` to truncation (Gopi et al. Remark 5.6).

    ``prv_accountant.accountant.compute_safe_domain_size`` with integer RDP orders only: fractional
    orders of the subsampled Gaussian converge slowly for large sample rates, and a coarser set of
    orders can only widen L, which stays safe.
    """
    total = sum(max_repeats)
    composed = sum(count * _prv_rdp(spec) for spec, count in zip(specs, max_repeats))
    half_width = _rdp_to_epsilon(composed, delta_error / 4)
    for spec in specs:
        half_width = max(half_width, _rdp_to_epsilon(_prv_rdp(spec), delta_error / 8 / total))
    return max(half_width, EPS_ERROR) + 3


@functools.lru_cache(maxsize=256)
def _prv_rdp(spec: Spec) -> np.ndarray:
    """The RDP curve of ``spec``'s privacy random variable at ``_INTEGER_ORDERS`` (``prv_accountant``'s
    ``rdp``), cached: every grid of a mechanism (one per repeat bucket) sizes itself from it."""
    prv = _privacy_random_variable(spec)
    return np.array([prv.rdp(order) for order in _INTEGER_ORDERS])


def _rdp_to_epsilon(rdp: np.ndarray, delta: float) -> float:
    """Epsilon of an RDP curve at ``_INTEGER_ORDERS``, by the conversion ``prv_accountant``'s ``RDP`` uses
    (Balle et al. 2020, Theorem 21: rdp - log(delta * a) / (a - 1) + log(1 - 1/a), minimised over a)."""
    orders = np.array(_INTEGER_ORDERS, dtype=np.float64)
    epsilons = rdp - np.log(delta * orders) / (orders - 1) + np.log1p(-1 / orders)
    return float(epsilons[np.nanargmin(epsilons)])


def _discretise(truncated: PrivacyRandomVariableTruncated, domain: Domain) -> DiscretePrivacyRandomVariable:
    """Cell-centred discretisation (Gopi et al. Sec. 5.1), as ``prv_accountant``'s ``CellCentred``.

    Same cells and mean correction, but the CDF is evaluated once per cell edge rather than twice;
    the CDF is the dominant cost of building a grid.
    """
    centres = domain.ts()
    edges = np.append(centres - domain.dt() / 2, centres[-1] + domain.dt() / 2)
    cdf = truncated.prv.cdf(np.clip(edges, truncated.t_min, truncated.t_max))
    masses = np.diff(np.asarray(cdf, dtype=np.float64)) / float(truncated.remaining_mass)
    # Shift the grid so the discrete mean equals the continuous one (mean correction).
    mean_shift = _truncated_mean(truncated) - float(np.dot(centres, masses))
    if not abs(mean_shift) < domain.dt() / 2:
        raise RuntimeError("discrete mean differs from the continuous mean")
    return DiscretePrivacyRandomVariable(
        masses, domain.shift_right(mean_shift), log_pmc_inf=float(np.log(1 - truncated.pm_inf))
    )


def _truncated_mean(truncated: PrivacyRandomVariableTruncated) -> float:
    """Mean of a truncated PRV, E[T] = t_max − ∫ F(t) dt over [t_min, t_max].

    ``prv_accountant`` integrates over fixed breakpoints that stop at ±0.1, which is inaccurate when
    the domain is wide (small σ, large sample rate) and makes its mean-correction check fail where
    the accountant is fine; breakpoints spaced logarithmically over the whole domain (as opacus'
    PRV accountant does) keep ``quad`` accurate.
    """
    t_min, t_max = float(truncated.t_min), float(truncated.t_max)
    prv, mass = truncated.prv, truncated.remaining_mass

    def cdf(t: float) -> float:
        # ``truncated.cdf`` at one point, with the same arithmetic (equal floats), without its two array-wide
        # ``where``s: quad calls this about 800 times per grid, and it was most of a grid's cost
        if t < t_min:
            return 0.0
        return float(prv.cdf(t) / mass) if t < t_max else 1.0

    def side(limit: float) -> np.ndarray:
        return np.geomspace(1e-5, limit, 12) if limit > 1e-5 else np.empty(0)

    points = np.unique(np.concatenate([[t_min], -side(-t_min), [0.0], side(t_max), [t_max]]))
    points = points[(points >= t_min) & (points <= t_max)]
    area = sum(integrate.quad(cdf, left, right, limit=500)[0] for left, right in zip(points[:-1], points[1:]))
    return t_max - area


def _fast_even_length(length: int) -> int:
    length = next_fast_len(length, real=True)
    while length % 2:
        length = next_fast_len(length + 1, real=True)
    return length


@functools.lru_cache(maxsize=4)
def _prv_grid(specs: tuple[Spec, ...], max_repeats: tuple[int, ...], delta: float) -> _PRVGrid:
    return _PRVGrid(specs, max_repeats, delta)


def _prv_epsilon(composition: Composition, delta: float) -> float:
    specs = tuple(spec for spec, _ in composition)
    repeats = tuple(count for _, count in composition)
    grid = _prv_grid(specs, tuple(_bucket(count) for count in repeats), delta)
    try:
        return grid.epsilon(repeats, delta)
    except (ValueError, RuntimeError) as failure:  # prv_accountant's numerical limits, as one line
        raise PrivacyError(f"PRV accountant failed ({failure}); use the rdp accountant") from None
