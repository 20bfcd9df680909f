"""Score-matching objectives over a geometric ladder of noise levels (NCSN), and DPPM's sliced variant.

* Noise ladder (Song & Ermon, arXiv:1907.05600, §4.1): σ_1 > ... > σ_L geometric.
* Denoising score matching (ibid. Eq. 5-6): for x̃ = x + σ_i z, the target score is -z/σ_i; with the
  weight λ(σ) = σ² the per-sample loss is ½ ||σ_i s(x̃, i) + z||².
* Sliced score matching (Song, Garg, Shi & Ermon 2019, "Sliced Score Matching", arXiv:1905.07088,
  Eq. 8) with Gaussian projection vectors v: v^T ∇_x s(x) v + ½ (v^T s(x))². DPPM ("Learning
  Differentially Private Probabilistic Models ...", Eq. 5 and 7) writes it with a second vector v^r
  in the Hessian term, v^r^T ∇_x s v^r + ½ (v^T s)², where v^r is v after randomized response (Eq. 6);
  with v^r = v it is exactly sliced score matching. Here it is applied to the noise-perturbed data
  of every level, weighted by σ_i² like the denoising loss.

The Hessian-vector product v^T ∇_x s(x) v is one vector-Jacobian product through autograd
(``torch.func.vjp``), which also works inside ``torch.func.vmap(grad(...))``. Because this loss
differentiates the network with respect to its *input*, per-example gradient shortcuts that assume
the loss depends on a layer's weight only through that layer's output would be wrong; the loss
callable therefore declares ``differentiates_input = True`` and the DP-SGD engine uses its exact path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pydantic
import torch
from pydantic import Field
from torch.func import vjp

from dpsynth.errors import ConfigError
from dpsynth.privacy.record_draws import Draws
from dpsynth.schema import Section

OBJECTIVES = ("dsm", "ssm")
ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [N,...], level [N]) -> score [N,...]


def geometric_sigmas(sigma_max: float, sigma_min: float, num_levels: int) -> torch.Tensor:
    """σ_1 = sigma_max > ... > σ_L = sigma_min, a geometric sequence (arXiv:1907.05600, §4.1)."""
    if not 0 < sigma_min < sigma_max:
        raise ConfigError(f"noise levels need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}")
    if num_levels < 2:
        raise ConfigError(f"need at least 2 noise levels, got {num_levels}")
    return torch.logspace(torch.log10(torch.tensor(sigma_max)), torch.log10(torch.tensor(sigma_min)), num_levels)


class NoiseLadderSection(Section):
    """The keys of a geometric ladder of noise levels σ_1 > ... > σ_L (NCSN, arXiv:1907.05600, §4.1)."""

    sigma_max: float = Field(
        2.0, gt=0, description="largest noise level σ_1 (pixels in [-1, 1]; latents have about unit variance)"
    )
    sigma_min: float = Field(0.02, gt=0, description="smallest noise level σ_L; below sigma_max")
    num_levels: int = Field(10, ge=2, description="L, the number of geometric noise levels (NCSN §4.1: 10)")

    @pydantic.field_validator("sigma_min")
    @classmethod
    def _below_sigma_max(cls, sigma_min: float, info: pydantic.ValidationInfo) -> float:
        sigma_max = info.data.get("sigma_max")
        if sigma_max is not None and sigma_min >= sigma_max:
            raise ValueError(f"expected a value below noise.sigma_max = {sigma_max:g}")
        return sigma_min

    def sigmas(self) -> torch.Tensor:
        """The ladder these keys describe (:func:`geometric_sigmas`)."""
        return geometric_sigmas(self.sigma_max, self.sigma_min, self.num_levels)


def _flat_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).flatten(1).sum(1)


def denoising_score_loss(score: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Per-sample ½ ||σ s(x + σ z) + z||² (σ²-weighted denoising score matching); shape [N]."""
    sigma = sigma.view(-1, *([1] * (score.dim() - 1)))
    return 0.5 * (sigma * score + noise).flatten(1).pow(2).sum(1)


def sliced_score_loss(
    score_fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    v: torch.Tensor,
    v_hessian: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample v_h^T ∇_x s(x) v_h + ½ (v^T s(x))² (DPPM Eq. 7; v_h = v gives Eq. 8 of arXiv:1905.07088).

    ``score_fn`` maps a batch [N, ...] to scores [N, ...] without mixing samples, so the vector-Jacobian
    product of the batch gives each sample's v_h^T ∇_x s(x_i) at once.
    """
    v_hessian = v if v_hessian is None else v_hessian
    score, pullback = vjp(score_fn, x)
    (vjp_x,) = pullback(v_hessian)
    return _flat_dot(vjp_x, v_hessian) + 0.5 * _flat_dot(v, score).pow(2)


class ScoreMatchingLoss:
    """Per-example loss for the DP-SGD engine (``loss_fn(model_call, example)``) and for whole batches.

    ``example`` holds ``u`` [C, H, W] (one clean example) and, for its K copies, ``level`` [K],
    ``noise`` [K, C, H, W] and, for sliced score matching, ``v`` [K, C, H, W] and optionally ``v_r``
    (the projection vectors after randomized response; default v). The loss is the mean over the K
    copies, so clipping bounds the example's averaged gradient.
    """

    def __init__(self, objective: str, sigmas: torch.Tensor) -> None:
        if objective not in OBJECTIVES:
            raise ConfigError(f"unknown score-matching objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
        self.objective = objective
        self.sigmas = sigmas
        # The engine's fast per-layer gradient paths are exact only for losses that do not differentiate
        # through the input; sliced score matching does (its Hessian term).
        self.differentiates_input = objective == "ssm"

    def __call__(self, model_call: Callable[..., torch.Tensor], example: Mapping[str, torch.Tensor]) -> torch.Tensor:
        copies = example["noise"].shape[0]
        clean = example["u"].unsqueeze(0).expand(copies, *example["u"].shape)
        batch = {key: value for key, value in example.items() if key != "u"}
        return self.batch_losses(model_call, clean, batch).mean()

    def batch_losses(
        self, model_call: Callable[..., torch.Tensor], clean: torch.Tensor, batch: Mapping[str, Any]
    ) -> torch.Tensor:
        """Per-sample losses [N] for clean samples [N, C, H, W] and their ``level``/``noise``/``v``/``v_r``."""
        level = batch["level"]
        sigma = self.sigmas.to(clean.device)[level]
        perturbed = clean + sigma.view(-1, 1, 1, 1) * batch["noise"]
        weight = sigma.pow(2)
        if self.objective == "dsm":
            return denoising_score_loss(model_call(perturbed, level), batch["noise"], sigma)
        losses = sliced_score_loss(lambda x: model_call(x, level), perturbed, batch["v"], batch.get("v_r"))
        return weight * losses


def draw_perturbation(
    draws: Draws, copies: int, shape: tuple[int, ...], num_levels: int, projections: bool = False
) -> dict[str, torch.Tensor]:
    """Noise-level indices (uniform), Gaussian noise and, for sliced score matching, Gaussian
    projection vectors: ``copies`` of each per example, ``[count, copies, ...]``, example ``i``'s from
    row ``i`` of ``draws`` (per-record draws for private data, :mod:`dpsynth.privacy.record_draws`)."""
    drawn = {"level": draws.randint(0, num_levels, copies), "noise": draws.randn(copies, *shape)}
    if projections:
        drawn["v"] = draws.randn(copies, *shape)
    return drawn


#: public seed of the audit's noise draws: every model is scored on the same perturbations
AUDIT_NOISE_SEED = 1729


@torch.no_grad()
def example_denoising_losses(
    model_call: Callable[..., torch.Tensor],
    clean: torch.Tensor,
    sigmas: torch.Tensor,
    draws: int = 1,
    batch_size: int = 256,
) -> torch.Tensor:
    """Each sample's denoising score-matching loss averaged over every noise level and ``draws`` noises; [N].

    The membership-inference loss attack's score for a score model (lower: better fitted). Noise comes
    from the public :data:`AUDIT_NOISE_SEED` and is drawn per level for the whole set at once, so a sample's
    score does not depend on the batch it is scored in and two models see the same perturbations.
    """
    generator = torch.Generator().manual_seed(AUDIT_NOISE_SEED)
    loss = ScoreMatchingLoss("dsm", sigmas)
    total = torch.zeros(len(clean), dtype=torch.float64)  # float64: memorised examples would tie in float32
    for level in range(len(sigmas)):
        for _ in range(draws):
            noise = torch.randn(clean.shape, generator=generator)
            for start in range(0, len(clean), batch_size):
                part = slice(start, start + batch_size)
                count = len(clean[part])
                level_index = torch.full((count,), level, dtype=torch.long, device=clean.device)
                batch = {"level": level_index, "noise": noise[part].to(clean.device)}
                losses = loss.batch_losses(model_call, clean[part], batch)
                total[part] += losses.double().cpu()
    return total / (len(sigmas) * draws)
