"""DPPM's annealed HMC against NCSN's annealed Langevin dynamics at the same number of score evaluations.

The targets have a known density, so the score of every noise-perturbed level is exact and the
samples can be scored against the truth; nothing is trained and no data is read (seconds on a CPU):

- ``mixture``: 2-D, weights (0.8, 0.2) at (-5, -5) and (5, 5), unit variance: the example NCSN
  (Song & Ermon, arXiv:1907.05600, §3.2) uses to show that Langevin dynamics gets mode weights wrong
  without annealing. Scored by the error of the weight of the first mode, the mean within-mode
  standard deviation (1 is right) and the energy distance to exact samples.
- ``ill-conditioned``: a 64-D Gaussian N(0, diag(v)) with v log-spaced in [0.01, 1]: HMC's momentum
  should help where Langevin's step is limited by the narrowest direction. Scored by the mean
  |v_hat / v - 1| over dimensions and the energy distance.

Both samplers run :func:`dpsynth.diffusion.hmc.annealed_sample` over the same geometric ladder
(σ from 20 to 0.01, 10 levels) with ``iterations * leapfrog_steps`` score calls per level (HMC one
more per level for its first gradient); ``denoise`` is off, since σ_L = 0.01 is negligible here.
Each sampler gets a small grid of step sizes (the targets are public, so choosing on them is free)
and the best setting by energy distance is reported, together with the DPPM preset's own setting
(λ0 = 0.01, decay power 2) for HMC.

Every measure is the mean over ``--seeds`` runs (the split of chains between the mixture's modes is
decided at the large noise levels and varies from run to run).

    OMP_NUM_THREADS=1 python experiments/dppm_samplers.py [--chains 2000] [--budgets 20,100] [--seeds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from dpsynth.diffusion.hmc import MCMCSettings, annealed_sample
from dpsynth.diffusion.score_matching import geometric_sigmas

SIGMAS = geometric_sigmas(20.0, 0.01, 10)
HMC_STEPS = (0.001, 0.003, 0.01, 0.03, 0.1)  # λ0 at σ_L; λ = λ0 (σ_i/σ_L)(M/m)^power
HMC_POWERS = (2.0, 0.0)  # Algorithm 2's decay, and none
LANGEVIN_STEPS = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3)  # ε of α_i = ε σ_i²/σ_L² (NCSN: 2e-5 for σ_L = 0.01)
PRESET = {"step_size": 0.01, "step_decay_power": 2.0}  # the dppm presets' sampler


class Target:
    """A Gaussian mixture ``Σ w_j N(μ_j, s_j² I)``: exact samples and the exact score of every noise level."""

    def __init__(self, name: str, weights: list[float], means: torch.Tensor, variances: torch.Tensor) -> None:
        self.name, self.weights, self.means, self.variances = name, torch.tensor(weights), means, variances

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    def sample(self, count: int, generator: torch.Generator) -> torch.Tensor:
        components = torch.multinomial(self.weights, count, replacement=True, generator=generator)
        noise = torch.randn((count, self.dim), generator=generator)
        return self.means[components] + noise * self.variances[components].sqrt()

    def score(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        """∇ log of the target convolved with N(0, σ² I)."""
        variances = self.variances + sigma**2  # [J, D]
        diff = self.means[None] - x[:, None]  # [N, J, D]
        log_density = (
            self.weights.log()[None] - 0.5 * (diff**2 / variances[None]).sum(-1) - 0.5 * variances.log().sum(-1)[None]
        )
        responsibilities = torch.softmax(log_density, dim=1)  # [N, J]
        return (responsibilities[..., None] * diff / variances[None]).sum(1)


def targets() -> list[Target]:
    mixture = Target("mixture", [0.8, 0.2], torch.tensor([[-5.0, -5.0], [5.0, 5.0]]), torch.ones(2, 2))
    variances = torch.logspace(-2, 0, 64)[None]
    conditioned = Target("ill-conditioned", [1.0], torch.zeros(1, 64), variances)
    return [mixture, conditioned]


def energy_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """2 E|a - b| - E|a - a'| - E|b - b'| (zero iff the distributions agree)."""
    return float(2 * torch.cdist(a, b).mean() - torch.cdist(a, a).mean() - torch.cdist(b, b).mean())


def scores(target: Target, samples: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    result = {"energy_distance": energy_distance(samples, exact)}
    if target.name == "mixture":
        first = ((samples - target.means[0]).norm(dim=1) < (samples - target.means[1]).norm(dim=1)).float()
        result["weight_error"] = abs(float(first.mean()) - float(target.weights[0]))
        spreads = [samples[first == side].std(dim=0).mean() for side in (1.0, 0.0) if (first == side).sum() > 1]
        result["within_mode_std"] = float(torch.stack(spreads).mean()) if spreads else math.nan
    else:
        ratio = samples.var(dim=0) / target.variances[0]
        result["variance_error"] = float((ratio - 1).abs().mean())
    return result


def run_sampler(target: Target, settings: MCMCSettings, chains: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    start = torch.rand((chains, target.dim), generator=generator) * 2 - 1  # NCSN's uniform start

    def score(x: torch.Tensor, level: int) -> torch.Tensor:
        return target.score(x, float(SIGMAS[level]))

    began = time.perf_counter()
    result = annealed_sample(score, start, SIGMAS, settings, generator)
    seconds = time.perf_counter() - began
    finite = result.x[torch.isfinite(result.x).all(dim=1)]
    exact = target.sample(chains, torch.Generator().manual_seed(seed + 1))
    metrics = scores(target, finite, exact) if len(finite) > 1 else {"energy_distance": math.inf}
    return {
        **metrics,
        "diverged": chains - len(finite),
        "acceptance": result.acceptance_rate,
        "score_evaluations": result.score_evaluations,
        "seconds": seconds,
    }


def run_seeds(target: Target, settings: MCMCSettings, chains: int, seeds: int) -> dict[str, Any]:
    """The mean of every measure over ``seeds`` independent runs (mode weights vary from run to run)."""
    runs = [run_sampler(target, settings, chains, seed) for seed in range(seeds)]
    return {key: sum(run[key] for run in runs) / seeds for key in runs[0]}


def grid(budget: int) -> list[tuple[str, MCMCSettings]]:
    """Every setting compared at ``budget`` score calls per level: M x N = budget for both samplers."""
    leapfrog = 5 if budget % 5 == 0 else 1
    common = {"iterations": budget // leapfrog, "leapfrog_steps": leapfrog, "denoise": False}
    rows: list[tuple[str, MCMCSettings]] = []
    for power in HMC_POWERS:
        for step in HMC_STEPS:
            rows.append(("hmc", MCMCSettings("hmc", step_size=step, step_decay_power=power, **common)))
    rows.extend(("langevin", MCMCSettings("langevin", step_size=step, **common)) for step in LANGEVIN_STEPS)
    return rows


def benchmark(chains: int, budgets: list[int], seeds: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for target in targets():
        for budget in budgets:
            results = []
            for sampler, settings in grid(budget):
                measured = run_seeds(target, settings, chains, seeds)
                results.append({"sampler": sampler, "settings": settings, **measured})
                log(f"{target.name} budget {budget} {sampler} {settings.step_size:g}/{settings.step_decay_power:g}")
            for sampler in ("hmc", "langevin"):
                best = min((r for r in results if r["sampler"] == sampler), key=lambda r: r["energy_distance"])
                rows.append(_row(target, budget, f"{sampler} (best of grid)", best))
            preset = next(
                r
                for r in results
                if r["sampler"] == "hmc"
                and (r["settings"].step_size, r["settings"].step_decay_power) == tuple(PRESET.values())
            )
            rows.append(_row(target, budget, "hmc (dppm preset)", preset))
    return rows


def _row(target: Target, budget: int, label: str, result: dict[str, Any]) -> dict[str, Any]:
    settings = result["settings"]
    return {
        "target": target.name,
        "evals_per_level": budget,
        "sampler": label,
        "step_size": settings.step_size,
        "decay_power": settings.step_decay_power if settings.sampler == "hmc" else None,
        **{k: v for k, v in result.items() if k not in ("sampler", "settings")},
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| target | evals/level | sampler | step | power | energy dist. | mode-weight err. | within-mode std "
        "| variance err. | accept | total evals | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def cell(key: str, digits: int = 3) -> str:
            value = r.get(key)
            return "-" if value is None else f"{value:.{digits}g}"

        lines.append(
            f"| {r['target']} | {r['evals_per_level']} | {r['sampler']} | {r['step_size']:g} | {cell('decay_power')} "
            f"| {cell('energy_distance')} | {cell('weight_error')} | {cell('within_mode_std')} "
            f"| {cell('variance_error')} | {r['acceptance']:.2f} | {r['score_evaluations']:.0f} | {r['seconds']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=2000, help="independent chains per setting")
    parser.add_argument("--budgets", default="20,100", help="score evaluations per noise level, comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="runs per setting (seeds 0..n-1), averaged")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = benchmark(args.chains, budgets, args.seeds, log=lambda _: None)
    print(json.dumps({"rows": rows}) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
