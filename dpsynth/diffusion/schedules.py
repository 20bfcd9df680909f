"""Noise schedules and timestep samplers.

* β schedules: linear (Ho et al. 2020; the "linear" rows of Ghalebikesabi et al. (arXiv:2302.13861) Table 3)
  and cosine (Nichol & Dhariwal 2021, used by Chu et al. (IEEE Access 2023) §III-A and §V-C:
  ᾱ_t = f(t)/f(0), f(t) = cos²(((t/T)+s)/(1+s) · π/2), s = 0.008, β_t clipped at 0.999).
* :class:`DiffusionSchedule` precomputes ᾱ_t, the forward marginal q(x_t|x_0) (dpdm eq. 3-4) and
  the posterior q(x_{t-1}|x_t, x_0) (dpdm eq. 9), and exposes them as pure functions of
  ``(t, x, model_output)`` in the style of diffusers' schedulers. Timesteps are 0-indexed:
  ``t = 0`` is the first noising step, ``t = T - 1`` the last.
* Timestep samplers: uniform over {0, ..., T-1}, and the mixture of uniforms
  t ~ Σ_i w_i U{l_i, u_i} of Ghalebikesabi et al. (arXiv:2302.13861) §4 ("Modified timestep sampling").

All tensor functions index the precomputed tables with a tensor ``t`` and use no data-dependent
Python control flow, so they run under ``torch.func.vmap``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from dpsynth.errors import ConfigError

_T = TypeVar("_T")

__all__ = [
    "linear_betas",
    "cosine_betas",
    "make_betas",
    "DiffusionSchedule",
    "build_schedule",
    "TimestepSampler",
    "UniformTimesteps",
    "MixtureOfUniformTimesteps",
    "build_timestep_sampler",
    "FINETUNING_MIXTURE",
    "MNIST_MIXTURE",
    "IMAGENET_MIXTURE",
]


def linear_betas(
    num_timesteps: int = 1000, beta_start: float | None = None, beta_end: float | None = None
) -> np.ndarray:
    """Linear β_t from 1e-4 to 0.02 (Ho et al.), rescaled by 1000/T as in improved DDPM so that
    other T keep the same overall noise level."""
    scale = 1000.0 / num_timesteps
    start = beta_start if beta_start is not None else scale * 1e-4
    end = beta_end if beta_end is not None else scale * 0.02
    return np.linspace(start, end, num_timesteps, dtype=np.float64)


def cosine_betas(num_timesteps: int = 1000, offset: float = 0.008, max_beta: float = 0.999) -> np.ndarray:
    """β_t = 1 - ᾱ_t / ᾱ_{t-1} of the cosine schedule, clipped at ``max_beta`` to avoid the
    singularity at t = T (Nichol & Dhariwal §3.2)."""
    steps = np.arange(num_timesteps + 1, dtype=np.float64) / num_timesteps
    f = np.cos((steps + offset) / (1 + offset) * math.pi / 2) ** 2
    return np.minimum(1.0 - f[1:] / f[:-1], max_beta)


def make_betas(kind: str, num_timesteps: int = 1000) -> np.ndarray:
    """β schedule by name: ``"linear"`` or ``"cosine"``."""
    if num_timesteps < 1:
        raise ConfigError(f"num_timesteps must be positive, got {num_timesteps}")
    if kind == "linear":
        return linear_betas(num_timesteps)
    if kind == "cosine":
        return cosine_betas(num_timesteps)
    raise ConfigError(f"unknown noise schedule {kind!r}; choose 'linear' or 'cosine'")


def tensors_on(holder: _T, device: torch.device | str) -> _T:
    """A shallow copy of ``holder`` with each tensor attribute on ``device``.

    A captured private step (:mod:`dpsynth.dpsgd.fixed_shape`) may not copy host tensors inside the graph, so a
    schedule or timestep sampler used there holds its tables on the device beforehand; ``.to(t.device)`` on them
    is then a no-op. The host path keeps its own copy, so it never reads device tables back.
    """
    moved = copy.copy(holder)
    for name, value in vars(holder).items():
        if isinstance(value, torch.Tensor):
            setattr(moved, name, value.to(device))
    return moved


def _extract(table: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """``table[t]`` reshaped to broadcast against a tensor of rank ``ndim`` whose leading dims are ``t``'s."""
    values = table.to(t.device)[t]
    return values.reshape(values.shape + (1,) * (ndim - t.dim()))


class DiffusionSchedule:
    """Precomputed tables of a discrete Gaussian diffusion and pure functions of ``(t, x, output)``.

    ``timestep_map`` maps this schedule's indices to the model's timesteps: it is the identity for
    a full schedule and a subsequence for a respaced one (:meth:`respace`, improved DDPM §4), so a
    sampler can take fewer steps while feeding the model the timesteps it was trained on.
    """

    def __init__(self, betas: np.ndarray, timestep_map: Sequence[int] | None = None, name: str = "custom") -> None:
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or betas.size == 0 or (betas <= 0).any() or (betas >= 1).any():
            raise ConfigError("betas must be a non-empty 1-D array in (0, 1)")
        self.name = name
        self.num_timesteps = int(betas.size)
        alphas = 1.0 - betas
        alphas_cumprod = np.cumprod(alphas)
        alphas_cumprod_prev = np.append(1.0, alphas_cumprod[:-1])
        # Posterior q(x_{t-1} | x_t, x_0) = N(coef_x0 x_0 + coef_xt x_t, β̃_t) (dpdm eq. 9).
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        # β̃_0 = 0; improved DDPM clips its log to β̃_1 so the learned-variance interpolation is finite.
        posterior_log_variance = np.log(
            np.append(posterior_variance[1] if betas.size > 1 else betas[0], posterior_variance[1:])
        )
        tables = {
            "betas": betas,
            "log_betas": np.log(betas),
            "alphas_cumprod": alphas_cumprod,
            "alphas_cumprod_prev": alphas_cumprod_prev,
            "sqrt_alphas_cumprod": np.sqrt(alphas_cumprod),
            "sqrt_one_minus_alphas_cumprod": np.sqrt(1.0 - alphas_cumprod),
            "sqrt_recip_alphas_cumprod": np.sqrt(1.0 / alphas_cumprod),
            "sqrt_recipm1_alphas_cumprod": np.sqrt(1.0 / alphas_cumprod - 1.0),
            "posterior_variance": posterior_variance,
            "posterior_log_variance_clipped": posterior_log_variance,
            "posterior_mean_coef_x0": betas * np.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod),
            "posterior_mean_coef_xt": (1.0 - alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - alphas_cumprod),
        }
        self._tables64 = tables  # float64 originals, for respacing
        for key, value in tables.items():
            setattr(self, key, torch.tensor(value, dtype=torch.float32))
        mapping = np.arange(self.num_timesteps) if timestep_map is None else np.asarray(timestep_map)
        self.timestep_map = torch.tensor(mapping, dtype=torch.long)

    # -- forward process ------------------------------------------------------------------------
    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = √ᾱ_t x_0 + √(1-ᾱ_t) ε (dpdm eq. 4)."""
        return (
            _extract(self.sqrt_alphas_cumprod, t, x0.dim()) * x0
            + _extract(self.sqrt_one_minus_alphas_cumprod, t, x0.dim()) * noise
        )

    def q_posterior(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and clipped log-variance of the posterior q(x_{t-1} | x_t, x_0) (dpdm eq. 9)."""
        mean = (
            _extract(self.posterior_mean_coef_x0, t, x_t.dim()) * x0
            + _extract(self.posterior_mean_coef_xt, t, x_t.dim()) * x_t
        )
        log_variance = _extract(self.posterior_log_variance_clipped, t, x_t.dim()).expand_as(x_t)
        return mean, log_variance

    # -- model output to distribution ----------------------------------------------------------
    def predict_x0(self, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """x̂_0 = (x_t - √(1-ᾱ_t) ε̂) / √ᾱ_t."""
        return (
            _extract(self.sqrt_recip_alphas_cumprod, t, x_t.dim()) * x_t
            - _extract(self.sqrt_recipm1_alphas_cumprod, t, x_t.dim()) * eps
        )

    def predict_eps(self, x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """ε implied by x_t and an x_0 estimate (used after clipping x̂_0 in DDIM)."""
        return (_extract(self.sqrt_recip_alphas_cumprod, t, x_t.dim()) * x_t - x0) / _extract(
            self.sqrt_recipm1_alphas_cumprod, t, x_t.dim()
        )

    def model_log_variance(
        self, t: torch.Tensor, x_t: torch.Tensor, variance: str, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Log-variance of p(x_{t-1}|x_t).

        ``"learned"``: improved DDPM's interpolation log Σ = u log β_t + (1-u) log β̃_t with
        u = (v + 1)/2 from the model's extra output channels (dpdm §III-A, eq. 5).
        ``"fixed_small"``: β̃_t; ``"fixed_large"``: β_t (with β̃_1 at t = 0, as Ho et al.).
        """
        ndim = x_t.dim()
        log_small = _extract(self.posterior_log_variance_clipped, t, ndim)
        if variance == "learned":
            if v is None:
                raise ConfigError("learned variance needs a model with learn_sigma=True")
            fraction = (v + 1.0) / 2.0
            return fraction * _extract(self.log_betas, t, ndim) + (1.0 - fraction) * log_small
        if variance == "fixed_small":
            return log_small.expand_as(x_t)
        if variance == "fixed_large":
            large = torch.cat([self.posterior_variance[1:2], self.betas[1:]]) if self.num_timesteps > 1 else self.betas
            return torch.log(_extract(large, t, ndim)).expand_as(x_t)
        raise ConfigError(f"unknown variance {variance!r}; choose 'learned', 'fixed_small' or 'fixed_large'")

    def p_mean_log_variance(
        self,
        model_output: torch.Tensor,
        x_t: torch.Tensor,
        t: torch.Tensor,
        variance: str = "fixed_small",
        learn_sigma: bool = False,
        clip_denoised: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Mean, log-variance, x̂_0 and ε̂ of p_θ(x_{t-1} | x_t) from an ε-prediction output."""
        eps, v = split_output(model_output, learn_sigma)
        x0 = self.predict_x0(x_t, t, eps)
        if clip_denoised:
            x0 = x0.clamp(-1.0, 1.0)
        mean, _ = self.q_posterior(x0, x_t, t)
        log_variance = self.model_log_variance(t, x_t, variance, v)
        return {"mean": mean, "log_variance": log_variance, "x0": x0, "eps": eps}

    # -- respacing ------------------------------------------------------------------------------
    def respace(self, num_steps: int) -> DiffusionSchedule:
        """A schedule over ``num_steps`` evenly spaced timesteps of this one, with β recomputed so
        that ᾱ matches at the kept steps (improved DDPM §4, "Improving sampling speed")."""
        if not 1 <= num_steps <= self.num_timesteps:
            raise ConfigError(f"steps must be in [1, {self.num_timesteps}], got {num_steps}")
        kept = np.unique(np.round(np.linspace(0, self.num_timesteps - 1, num_steps)).astype(np.int64))
        alphas_cumprod = self._tables64["alphas_cumprod"][kept]
        betas = 1.0 - alphas_cumprod / np.append(1.0, alphas_cumprod[:-1])
        original = self.timestep_map.numpy()[kept]
        return DiffusionSchedule(np.clip(betas, 1e-12, 0.999), timestep_map=original, name=f"{self.name}/{num_steps}")

    def to_model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """Map this schedule's indices to the timesteps the model was trained on."""
        return self.timestep_map.to(t.device)[t]

    def to(self, device: torch.device | str) -> DiffusionSchedule:
        """This schedule with its tables on ``device`` (:func:`tensors_on`)."""
        return tensors_on(self, device)

    def __repr__(self) -> str:
        return f"DiffusionSchedule({self.name!r}, T={self.num_timesteps})"


def split_output(model_output: torch.Tensor, learn_sigma: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split a model output into ε̂ and (when the variance is learned) v, along the channel dim."""
    if not learn_sigma:
        return model_output, None
    eps, v = model_output.chunk(2, dim=-3)
    return eps, v


def build_schedule(kind: str = "linear", num_timesteps: int = 1000) -> DiffusionSchedule:
    """The ``kind`` ("linear" / "cosine") schedule with ``num_timesteps`` steps (T = 1000 by default)."""
    return DiffusionSchedule(make_betas(kind, num_timesteps), name=kind)


# -- timestep samplers -------------------------------------------------------------------------


class TimestepSampler:
    """Draws training timesteps in {0, ..., T-1} from a fixed distribution (given by :meth:`probabilities`)."""

    num_timesteps: int

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` timesteps from ``generator`` (public data only; private batches use :meth:`from_uniform`)."""
        return self.from_uniform(torch.rand(n, generator=generator, dtype=torch.float64))

    def to(self: _T, device: torch.device | str) -> _T:
        """This sampler with its tables on ``device`` (:func:`tensors_on`)."""
        return tensors_on(self, device)

    def from_uniform(self, uniform: torch.Tensor) -> torch.Tensor:
        """Timesteps by the inverse CDF of uniforms in [0, 1), elementwise (any shape): a private
        record's timesteps then come from its own per-record draws (:mod:`dpsynth.privacy.record_draws`)."""
        raise NotImplementedError

    def probabilities(self) -> torch.Tensor:
        """The probability of every timestep, float64 ``[T]``."""
        raise NotImplementedError


class UniformTimesteps(TimestepSampler):
    """t ~ U{0, ..., T-1}: the standard objective of Ho et al. (Ghalebikesabi et al. (arXiv:2302.13861) eq. 1)."""

    def __init__(self, num_timesteps: int = 1000) -> None:
        if num_timesteps < 1:
            raise ConfigError(f"num_timesteps must be positive, got {num_timesteps}")
        self.num_timesteps = num_timesteps

    def from_uniform(self, uniform: torch.Tensor) -> torch.Tensor:
        steps = torch.floor(uniform.to(torch.float64) * self.num_timesteps).long()
        return steps.clamp(0, self.num_timesteps - 1)

    def probabilities(self) -> torch.Tensor:
        return torch.full((self.num_timesteps,), 1.0 / self.num_timesteps, dtype=torch.float64)

    def __repr__(self) -> str:
        return f"UniformTimesteps(T={self.num_timesteps})"


# Table 3 of Ghalebikesabi et al. (arXiv:2302.13861): (weights, boundaries l_1, u_1 = l_2, u_2 = l_3, u_3).
# The fine-tuning setting (CIFAR-10 and Camelyon17) is the default; the paper's text of §5.5 says
# "{30, ..., 60}" for the middle component but Table 3 and §4 ("{30, ..., 600}") give 600.
FINETUNING_MIXTURE = ((0.015, 0.785, 0.2), (0, 30, 600, 1000))
MNIST_MIXTURE = ((0.05, 0.9, 0.05), (0, 200, 800, 1000))  # training from scratch on MNIST (§5.3)
IMAGENET_MIXTURE = ((0.03, 0.77, 0.2), (0, 30, 800, 1000))  # ImageNet32 pre-training


class MixtureOfUniformTimesteps(TimestepSampler):
    """t ~ Σ_i w_i U{l_i, u_i} (Ghalebikesabi et al. (arXiv:2302.13861) §4, Algorithm 1, Table 3).

    Components are given by ``weights`` and ``boundaries`` ``(l_1, u_1 = l_2, ..., u_K)`` on the
    paper's T = 1000 scale and rescaled to ``num_timesteps``. Component i covers the half-open
    range {l_i, ..., u_i - 1}, so adjacent components share no timestep and u_K = T gives the last
    0-indexed timestep T - 1. Defaults: the paper's fine-tuning setting (0.015, 0.785, 0.2) over
    {0, 30, 600, 1000}.
    """

    def __init__(
        self,
        weights: Sequence[float] = FINETUNING_MIXTURE[0],
        boundaries: Sequence[float] = FINETUNING_MIXTURE[1],
        num_timesteps: int = 1000,
        reference_timesteps: int = 1000,
    ) -> None:
        weights_array = np.asarray(weights, dtype=np.float64)
        bounds = np.asarray(boundaries, dtype=np.float64)
        if weights_array.ndim != 1 or bounds.shape != (weights_array.size + 1,):
            raise ConfigError("a timestep mixture needs K weights and K + 1 boundaries")
        if (weights_array < 0).any() or abs(weights_array.sum() - 1.0) > 1e-6:
            raise ConfigError(f"timestep mixture weights must be non-negative and sum to 1, got {list(weights)}")
        if bounds[0] < 0 or bounds[-1] > reference_timesteps or (np.diff(bounds) <= 0).any():
            raise ConfigError(
                f"timestep mixture boundaries must increase within [0, {reference_timesteps}], got {list(boundaries)}"
            )
        scaled = np.round(bounds * num_timesteps / reference_timesteps).astype(np.int64)
        if (np.diff(scaled) <= 0).any():
            raise ConfigError(f"timestep mixture boundaries {list(boundaries)} collapse at T={num_timesteps}")
        self.num_timesteps = num_timesteps
        self.weights = torch.tensor(weights_array, dtype=torch.float64)
        self.lows = torch.tensor(scaled[:-1], dtype=torch.long)
        self.highs = torch.tensor(scaled[1:], dtype=torch.long)

    def from_uniform(self, uniform: torch.Tensor) -> torch.Tensor:
        # One uniform picks the component (where it falls in the cumulative weights) and, rescaled
        # within that component's share, the offset inside it; a zero-weight component is never hit.
        uniform = uniform.to(torch.float64)
        upper = torch.cumsum(self.weights, 0)
        component = torch.searchsorted(upper, uniform.reshape(-1), right=True).clamp_max(len(upper) - 1)
        within = (uniform.reshape(-1) - (upper - self.weights)[component]) / self.weights[component]
        lows, widths = self.lows[component], (self.highs - self.lows)[component]
        offsets = torch.floor(within.clamp(0.0, 1.0) * widths).long()
        return (lows + offsets.clamp(0).minimum(widths - 1)).reshape(uniform.shape)

    def probabilities(self) -> torch.Tensor:
        probs = torch.zeros(self.num_timesteps, dtype=torch.float64)
        for weight, low, high in zip(self.weights, self.lows, self.highs):
            probs[low:high] += weight / (high - low)
        return probs

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{w:.3g}·U{{{int(low)},{int(h) - 1}}}" for w, low, h in zip(self.weights, self.lows, self.highs)
        )
        return f"MixtureOfUniformTimesteps({parts})"


def build_timestep_sampler(spec: str | Mapping[str, Any] | None, num_timesteps: int = 1000) -> TimestepSampler:
    """Sampler from a config value: ``"uniform"``, ``"mixture"`` (paper defaults), ``"mixture_mnist"``,
    or ``{"kind": "mixture", "weights": [...], "boundaries": [...]}``."""
    if spec is None or spec == "uniform":
        return UniformTimesteps(num_timesteps)
    if spec == "mixture":
        return MixtureOfUniformTimesteps(num_timesteps=num_timesteps)
    if spec == "mixture_mnist":
        return MixtureOfUniformTimesteps(*MNIST_MIXTURE, num_timesteps=num_timesteps)
    if isinstance(spec, Mapping):
        options = dict(spec)
        kind = options.pop("kind", "mixture")
        if kind == "uniform" and not options:
            return UniformTimesteps(num_timesteps)
        unknown = sorted(set(options) - {"weights", "boundaries"})
        if kind != "mixture" or unknown:
            raise ConfigError(
                f"bad timestep sampler {dict(spec)!r}; use kind 'uniform' or 'mixture' with 'weights' and 'boundaries'"
            )
        return MixtureOfUniformTimesteps(
            options.get("weights", FINETUNING_MIXTURE[0]),
            options.get("boundaries", FINETUNING_MIXTURE[1]),
            num_timesteps=num_timesteps,
        )
    raise ConfigError(f"unknown timestep sampler {spec!r}; choose 'uniform', 'mixture' or 'mixture_mnist'")
