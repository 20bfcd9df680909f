"""Score-based MCMC samplers: Hamiltonian Monte Carlo (DPPM, Algorithm 2) and annealed Langevin (NCSN).

Both are pure step functions over a batch of independent chains, plus an annealing driver that runs
them across the noise ladder σ_1 > ... > σ_L of a noise-conditional score network.

**Hamiltonian dynamics** ("Learning Differentially Private Probabilistic Models ...", §4.2, Eq. 8,
Algorithm 2; Neal, "MCMC using Hamiltonian dynamics", 2011). Potential U(x) = -log p(x), so
∇U = -s(x) with s the score network; kinetic energy G(p) = pᵀp/2, so ∇G(p) = p. One outer iteration:

1. draw a fresh momentum p from the kinetic distribution (Gaussian, Rayleigh or Uniform, Fig. 3b);
2. N leapfrog steps: p ← p + λ/2 s(x); x ← x + λ p; p ← p + λ/2 s(x);
3. Metropolis: accept with probability min(1, exp(-(ΔU + ΔG))).

The network gives only the score, not U, so ΔU is integrated along the leapfrog path with the
trapezoid rule, ΔU ≈ -Σ_j ½ (s(x_j) + s(x_{j+1}))·(x_{j+1} - x_j), from scores the leapfrog already
computed (no extra network calls). The rule is exact when U is quadratic (a Gaussian target), so there
the chain leaves the target exactly invariant; for a learned score it is an approximation, and the
acceptance step can be switched off (the paper notes it may be skipped for long chains).
Only Gaussian momentum matches G(p) = pᵀp/2, so only it gives an exactly invariant chain; Rayleigh
(|N(0,1)| scaled to unit variance with a random sign per coordinate) and Uniform (on [-√3, √3], unit
variance) are the paper's ablation.

Step size: Algorithm 2 line 4 uses λ = λ0 (M/m)² at outer iteration m of M (large steps first, then
small ones). Across noise levels λ0 is scaled by σ_i/σ_L, the square root of NCSN's Langevin step
scaling (one leapfrog step from fresh Gaussian momentum is a Langevin step of size λ²).

**Annealed Langevin** (Song & Ermon, arXiv:1907.05600, Algorithm 1): at level i, α_i = ε σ_i²/σ_L²
and T steps x ← x + α_i/2 s(x, i) + √α_i z.

A ``mask`` (1 = free, 0 = fixed) keeps chosen coordinates fixed (DPPM's label row when sampling a
given class); fixed coordinates get no momentum and no Langevin move.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field

from dpsynth.errors import ConfigError
from dpsynth.schema import Section

KINETIC_DISTRIBUTIONS = ("gaussian", "rayleigh", "uniform")
MCMC_SAMPLERS = ("hmc", "langevin")
Score = Callable[[torch.Tensor], torch.Tensor]  # x [N, ...] -> score [N, ...]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).flatten(1).sum(1)


def _per_chain(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.view(-1, *([1] * (like.dim() - 1)))


def draw_momentum(
    shape: tuple[int, ...], kind: str, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A momentum of ``shape`` with unit-variance coordinates from the ``kind`` distribution."""
    if kind == "gaussian":
        return torch.randn(shape, generator=generator).to(device)
    if kind == "rayleigh":
        # Rayleigh(1) has E[r²] = 2; a random sign makes it a symmetric unit-variance coordinate.
        uniform = torch.rand(shape, generator=generator).clamp_min(1e-12)
        radius = torch.sqrt(-2.0 * torch.log(uniform)) / math.sqrt(2.0)
        sign = torch.randint(0, 2, shape, generator=generator).mul(2).sub(1)
        return (radius * sign).to(device)
    if kind == "uniform":
        return ((torch.rand(shape, generator=generator) * 2 - 1) * math.sqrt(3.0)).to(device)
    raise ConfigError(f"unknown kinetic distribution {kind!r}; choose one of {', '.join(KINETIC_DISTRIBUTIONS)}")


@dataclasses.dataclass
class HMCStep:
    """Result of one outer HMC iteration."""

    x: torch.Tensor  # the new states [N, ...]
    accepted: torch.Tensor  # bool [N]; all True without Metropolis
    score: torch.Tensor  # the score at the new states (reused by the next iteration)
    score_evaluations: int


def hmc_step(
    score: Score,
    x: torch.Tensor,
    step_size: float,
    leapfrog_steps: int,
    momentum: torch.Tensor,
    *,
    metropolis: bool = True,
    mask: torch.Tensor | None = None,
    current_score: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> HMCStep:
    """One outer iteration of Algorithm 2 (N leapfrog steps, then Metropolis) for a batch of chains."""
    if leapfrog_steps < 1:
        raise ConfigError(f"HMC needs at least one leapfrog step, got {leapfrog_steps}")
    evaluations = 0
    if current_score is None:
        current_score, evaluations = score(x), 1
    if mask is not None:
        momentum, current_score = momentum * mask, current_score * mask
    position, grad, p = x, current_score, momentum
    potential_change = torch.zeros(len(x), device=x.device, dtype=x.dtype)
    for _ in range(leapfrog_steps):
        p = p + 0.5 * step_size * grad
        moved = position + step_size * p
        new_grad = score(moved)
        evaluations += 1
        if mask is not None:
            new_grad = new_grad * mask
        potential_change -= _dot(0.5 * (grad + new_grad), moved - position)
        position, grad = moved, new_grad
        p = p + 0.5 * step_size * grad
    if not metropolis:
        return HMCStep(position, torch.ones(len(x), dtype=torch.bool, device=x.device), grad, evaluations)
    kinetic_change = 0.5 * (_dot(p, p) - _dot(momentum, momentum))
    log_accept = -(potential_change + kinetic_change)
    uniform = torch.rand(len(x), generator=generator).to(x.device)
    accepted = torch.log(uniform.clamp_min(1e-30)) < log_accept.nan_to_num(nan=-math.inf)
    chosen = _per_chain(accepted, x)
    return HMCStep(torch.where(chosen, position, x), accepted, torch.where(chosen, grad, current_score), evaluations)


def langevin_step(
    score_value: torch.Tensor, x: torch.Tensor, step_size: float, noise: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """x + α/2 s(x) + √α z (arXiv:1907.05600, Algorithm 1 line 6), moving only unmasked coordinates."""
    move = 0.5 * step_size * score_value + math.sqrt(step_size) * noise
    return x + (move if mask is None else move * mask)


@dataclasses.dataclass(frozen=True)
class MCMCSettings:
    """Settings of the annealed samplers; both use ``iterations * leapfrog_steps`` score calls per level."""

    sampler: str = "hmc"  # hmc | langevin
    iterations: int = 10  # M outer HMC iterations per noise level
    leapfrog_steps: int = 5  # N leapfrog steps per iteration (Metropolis every N steps)
    step_size: float = 0.05  # λ0 at the smallest σ (HMC) or ε of NCSN's α_i = ε σ_i²/σ_L² (Langevin)
    step_decay_power: float = 2.0  # λ = λ0 (M/m)^power within a level (Algorithm 2 line 4: 2)
    kinetic: str = "gaussian"
    metropolis: bool = True
    denoise: bool = True  # final x + σ_L² s(x, L) (Tweedie; arXiv:2006.09011 §4)

    def __post_init__(self) -> None:
        if self.sampler not in MCMC_SAMPLERS:
            raise ConfigError(f"unknown sampler {self.sampler!r}; choose one of {', '.join(MCMC_SAMPLERS)}")
        if self.kinetic not in KINETIC_DISTRIBUTIONS:
            raise ConfigError(f"unknown kinetic distribution {self.kinetic!r}")
        if self.iterations < 1 or self.leapfrog_steps < 1 or not self.step_size > 0:
            raise ConfigError("sampler iterations, leapfrog_steps and step_size must be positive")


class MCMCSection(Section):
    """The sampler keys of a config section: Algorithm 2's annealed HMC, or NCSN's annealed Langevin dynamics."""

    kind: Literal["hmc", "langevin"] = Field("hmc", description="hmc (Algorithm 2) or annealed Langevin (NCSN)")
    iterations: int = Field(10, ge=1, description="M outer HMC iterations per noise level")
    leapfrog_steps: int = Field(5, ge=1, description="N leapfrog steps per iteration; Langevin takes M*N steps")
    step_size: float = Field(0.01, gt=0, description="λ0 at σ_L (HMC), or ε of α_i = ε σ_i²/σ_L² (Langevin)")
    step_decay_power: float = Field(2.0, ge=0, description="λ = λ0 (M/m)^power (Algorithm 2 line 4: 2)")
    kinetic: Literal["gaussian", "rayleigh", "uniform"] = Field(
        "gaussian", description="momentum distribution (Fig. 3b)"
    )
    metropolis: bool = Field(True, description="Metropolis acceptance after each N leapfrog steps")
    denoise: bool = Field(True, description="final Tweedie step x + σ_L² s(x)")

    def settings(self) -> MCMCSettings:
        """The :class:`MCMCSettings` these keys describe (``kind`` is its ``sampler``)."""
        keys = {field.name for field in dataclasses.fields(MCMCSettings)} - {"sampler"}
        return MCMCSettings(sampler=self.kind, **self.model_dump(include=keys))


def hmc_step_size(step_size: float, iteration: int, iterations: int, power: float, sigma_ratio: float) -> float:
    """λ = λ0 (σ_i/σ_L) (M/m)^power for outer iteration ``iteration`` = m in 1..M (Algorithm 2 line 4)."""
    return step_size * sigma_ratio * (iterations / iteration) ** power


@dataclasses.dataclass
class MCMCResult:
    x: torch.Tensor
    acceptance_rate: float  # mean Metropolis acceptance over all HMC iterations (1.0 for Langevin)
    score_evaluations: int


def annealed_sample(
    score: Callable[[torch.Tensor, int], torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    settings: MCMCSettings,
    generator: torch.Generator,
    *,
    mask: torch.Tensor | None = None,
    on_level: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> MCMCResult:
    """Run the chains ``x`` through every noise level with HMC or Langevin; ``score(x, i)`` is s(x, σ_i).

    ``on_level(x, i)`` may reset the fixed coordinates at the start of level i (e.g. a clamped label
    row re-noised to σ_i).
    """
    sigma_min = float(sigmas[-1])
    accepted, proposals, evaluations = 0.0, 0, 0
    for level, sigma in enumerate(sigmas.tolist()):
        if on_level is not None:
            x = on_level(x, level)

        def level_score(z: torch.Tensor, _level: int = level) -> torch.Tensor:
            return score(z, _level)

        if settings.sampler == "langevin":
            alpha = settings.step_size * (sigma / sigma_min) ** 2
            for _ in range(settings.iterations * settings.leapfrog_steps):
                noise = torch.randn(x.shape, generator=generator).to(x.device)
                x = langevin_step(level_score(x), x, alpha, noise, mask)
                evaluations += 1
            continue
        current = None
        for iteration in range(1, settings.iterations + 1):
            lam = hmc_step_size(
                settings.step_size, iteration, settings.iterations, settings.step_decay_power, sigma / sigma_min
            )
            momentum = draw_momentum(tuple(x.shape), settings.kinetic, generator, x.device)
            step = hmc_step(
                level_score,
                x,
                lam,
                settings.leapfrog_steps,
                momentum,
                metropolis=settings.metropolis,
                mask=mask,
                current_score=current,
                generator=generator,
            )
            x, current = step.x, step.score
            accepted += float(step.accepted.float().sum())
            proposals += len(x)
            evaluations += step.score_evaluations
    if settings.denoise:
        last = len(sigmas) - 1
        update = sigma_min**2 * score(x, last)
        x = x + (update if mask is None else update * mask)
        evaluations += 1
    rate = accepted / proposals if proposals else 1.0
    return MCMCResult(x, rate, evaluations)
