"""DPPM's randomized response over projection vectors (Eq. 6) — an UNSOUND mechanism, kept for comparison.

"Learning Differentially Private Probabilistic Models for Privacy-Preserving Image Generation",
§4.1 Eq. 6 and Algorithm 1 lines 5-11: for a batch of Gaussian projection vectors v_1..v_b, the set
v^-_i holds the k vectors of the batch nearest to v_i by cosine similarity (v_i itself included), and

    Pr[R(v_i) = v_i] = e^ε / (e^ε + k - 1),    Pr[R(v_i) = v'] = 1 / (e^ε + k - 1) for v' in v^-_i \\ {v_i}.

This is implemented exactly, but it does NOT make training differentially private, and dpsynth never
accounts it as such:

* the projection vectors are drawn independently of the data, so randomising them protects nothing
  — the privacy-relevant output (the trained weights) still depends on every private image;
* each example's influence on the weights is never bounded (no clipping), so no finite ε can hold;
* nothing is composed over the training iterations: each example is read in many steps.

Runs that use it carry ``"guarantee": "none"`` in ``privacy.json`` (see ``dpsynth.methods.dppm``); their plan
(:func:`randomized_response_plan`) lists the responses for transparency and claims no ε.
"""

from __future__ import annotations

import math

import torch

from dpsynth.errors import ConfigError
from dpsynth.privacy.mechanisms import PureEpsilon
from dpsynth.privacy.plan import PrivacyPlan
from dpsynth.privacy.section import PrivacySection


def keep_probability(epsilon: float, k: int) -> float:
    """e^ε / (e^ε + k - 1), the probability that R returns its input (Eq. 6), computed stably."""
    _check(epsilon, k)
    return 1.0 / (1.0 + (k - 1) * math.exp(-epsilon))


def nearest_by_cosine(vectors: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [b, k] of the k vectors nearest to each row by cosine similarity, the row itself first."""
    if vectors.dim() != 2:
        vectors = vectors.flatten(1)
    if not 2 <= k <= len(vectors):
        raise ConfigError(f"randomized response needs 2 <= k <= batch size ({len(vectors)}), got k={k}")
    unit = torch.nn.functional.normalize(vectors, dim=1)
    similarity = unit @ unit.T
    similarity.fill_diagonal_(math.inf)  # each vector is its own nearest neighbour, even with ties
    return similarity.topk(k, dim=1).indices


def randomized_response(
    vectors: torch.Tensor, epsilon: float, k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply Eq. 6 to every vector of the batch; return (v^r, index of the vector each row became)."""
    _check(epsilon, k)
    neighbours = nearest_by_cosine(vectors, k)
    count = len(vectors)
    keep = torch.rand(count, generator=generator) < keep_probability(epsilon, k)
    other = torch.randint(1, k, (count,), generator=generator)  # uniform over v^- \ {v_i}
    choice = torch.where(keep, torch.zeros_like(other), other)
    chosen = neighbours.cpu().gather(1, choice[:, None]).squeeze(1)
    return vectors[chosen.to(vectors.device)], chosen


def randomized_response_plan(
    privacy: PrivacySection, name: str, steps: int, batch_size: int, num_examples: int, key: str
) -> PrivacyPlan:
    """The plan of a training of ``steps`` batches with Eq. 6 at the nominal ``privacy.epsilon``: one pure-ε entry
    ``name`` per step, listed for transparency under guarantee "none" (no target ε, none claimed). Algorithm 1
    draws its batches without replacement, so ``batch_size`` (config key ``key``) may not exceed N."""
    if batch_size > num_examples:
        raise ConfigError(
            f"config key '{key}' = {batch_size}: randomized-response draws batches without replacement; "
            f"expected at most the private train size {num_examples}"
        )
    return PrivacyPlan((PureEpsilon(name, privacy.epsilon, count=steps),), None, privacy.delta, privacy.accountant)


def _check(epsilon: float, k: int) -> None:
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ConfigError(f"randomized response needs a positive finite epsilon, got {epsilon}")
    if int(k) != k or k < 2:
        raise ConfigError(f"randomized response needs an integer k >= 2 (Eq. 6), got {k}")
