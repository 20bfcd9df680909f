"""Private Evolution's selection step: DP nearest-neighbour votes of the private records, and the resampling.

Paper: Lin, Gopi, Kulkarni, Nori, Yekhanin, "Differentially Private Synthetic Data via Foundation Model APIs 1:
Images", ICLR 2024, arXiv:2305.15560: Algorithm 2 (the DP nearest-neighbour histogram) and Algorithm 1's
resampling of the population in proportion to it.

* **Votes** (:func:`vote_rows`, :class:`PrivateVotes`): every private record adds 1 to each of its ``num_nearest``
  nearest candidates (L2) among the candidates of its own class: a k-hot row of L2 norm ``sqrt(k)`` that depends
  on its own record only (the candidates are public). The K class histograms are one bounded-sum release
  (:func:`dpsynth.privacy.bounded_sum.release_bounded_sum`, bound ``sqrt(k)``, disjoint classes: parallel
  composition): one Gaussian mechanism per round under add/remove-one adjacency.
* **Settings** (:class:`EvolutionSection`): the population, the rounds and their variation degrees, the votes.
* **Selection** (:func:`resampling_weights`, :func:`select_population`): the noisy histogram minus the threshold
  H, clipped at 0, is the resampling distribution of each class (post-processing); an all-zero class falls back to
  uniform resampling. ``M`` candidates per class are drawn with replacement from a public generator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pydantic
import torch
from pydantic import Field

from dpsynth.errors import ConfigError, DataError
from dpsynth.privacy.bounded_sum import BoundedSum, BoundedSumRelease, release_bounded_sum
from dpsynth.privacy.rng import NoiseSource
from dpsynth.schema import Section

__all__ = [
    "EvolutionSection",
    "PrivateVotes",
    "resampling_weights",
    "select_population",
    "vote_and_select",
    "vote_rows",
]


class EvolutionSection(Section):
    """The keys of Algorithm 1's loop and Algorithm 2's votes: population, rounds, variation degrees, threshold,
    k nearest and the votes' noise multiplier."""

    population: int = Field(
        2000, ge=1, description="N_syn, candidates per round, split evenly over the K declared classes (N_syn % K = 0)"
    )
    rounds: int = Field(5, ge=1, description="T, vote rounds (each one Gaussian release of the K class histograms)")
    variation_degrees: list[int] = Field(
        [8, 10, 12, 14, 16],
        min_length=1,
        description="one per round: DDIM steps (of sample_steps) skipped before a variation starts; 0 = start at the "
        "noisiest step (most variation), sample_steps - 1 = one denoising step (least); DPImageBench's convention",
    )
    threshold: float = Field(
        0.0, ge=0, description="H: subtracted from every noisy vote count before clipping at 0 (paper Algorithm 2)"
    )
    num_nearest: int = Field(
        1, ge=1, description="k: a private record votes for its k nearest candidates (L2 sensitivity sqrt(k))"
    )
    noise_multiplier: float | None = Field(
        None, gt=0, description="sigma of every round's vote histogram (noise std sigma*sqrt(k)); null: calibrated"
    )

    @pydantic.model_validator(mode="after")
    def _one_degree_per_round(self) -> EvolutionSection:
        if len(self.variation_degrees) != self.rounds:
            raise ValueError(
                f"variation_degrees needs one degree per round: {self.rounds} rounds, "
                f"{len(self.variation_degrees)} degrees"
            )
        return self

    def check_population(self, num_classes: int, section: str) -> None:
        """ConfigError unless ``population`` splits evenly over K classes, each with at least ``num_nearest``
        candidates (``section``: the config section's name, for the message)."""
        if self.population % num_classes:
            raise ConfigError(
                f"{section}.population ({self.population}) must be divisible by the {num_classes} classes"
            )
        if self.population // num_classes < self.num_nearest:
            raise ConfigError(
                f"{section}.num_nearest ({self.num_nearest}) exceeds the {self.population // num_classes} "
                "candidates per class"
            )


def vote_rows(private: torch.Tensor, labels: torch.Tensor, candidates: torch.Tensor, num_nearest: int) -> torch.Tensor:
    """k-hot rows ``[n, M]``: record i marks its ``num_nearest`` nearest (L2) among its class's candidates.

    ``candidates`` is ``[K, M, D]`` (M per class), ``private`` ``[n, D]``, ``labels`` ``[n]``. A row depends on its
    own record only (and on the public candidates), so one record moves one class's histogram by its row.
    """
    rows = torch.zeros(len(private), candidates.shape[1], dtype=torch.float64)
    for label in labels.unique().tolist():
        members = (labels == label).nonzero().flatten()
        distances = torch.cdist(private[members].double(), candidates[label].double())
        nearest = distances.topk(num_nearest, dim=1, largest=False).indices
        rows[members.unsqueeze(1), nearest] = 1.0
    return rows


class PrivateVotes:
    """The vote chunks of a private set: its embeddings (``embed()``, computed once, at the first release, after
    its charge; never logged or saved) turned into k-hot rows against each round's candidates, ``chunk`` records
    at a time. ``train`` is the private dataset (its ``labels`` are read a chunk at a time)."""

    def __init__(self, train: Any, embed: Callable[[], torch.Tensor], num_nearest: int, chunk: int) -> None:
        self.train, self.embed, self.num_nearest, self.chunk = train, embed, num_nearest, chunk

    @functools.cached_property
    def embeddings(self) -> torch.Tensor:
        """The private records' embeddings ``[N, D]``: computed at the first release, after its charge."""
        return self.embed()

    def chunks(self, candidates: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(k-hot rows [n, M], labels [n])`` per chunk of private records; lazy: read after the charge."""
        embeddings = self.embeddings
        for start in range(0, len(embeddings), self.chunk):
            labels = torch.as_tensor(self.train.labels[start : start + self.chunk], dtype=torch.int64)
            if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= candidates.shape[0]):
                raise DataError(f"a label lies outside [0, {candidates.shape[0]})")
            yield vote_rows(embeddings[start : start + self.chunk], labels, candidates, self.num_nearest), labels


def resampling_weights(histogram: torch.Tensor, threshold: float) -> tuple[torch.Tensor, list[int]]:
    """``max(hist - H, 0)`` per class, an all-zero class made uniform; returns the weights and those classes.

    Post-processing of the released noisy histogram ``[K, M]``.
    """
    weights = (histogram - threshold).clamp(min=0.0)
    empty = (weights.sum(dim=1) <= 0).nonzero().flatten().tolist()
    for label in empty:
        weights[label] = 1.0
    return weights, empty


def select_population(
    histogram: torch.Tensor, threshold: float, generator: torch.Generator
) -> tuple[torch.Tensor, list[int]]:
    """Indices into the class-major population ``[K * M]``: M draws per class with replacement in proportion to the
    thresholded noisy votes (:func:`resampling_weights`), and the classes resampled uniformly."""
    num_classes, per_class = histogram.shape
    weights, empty = resampling_weights(histogram, threshold)
    chosen = torch.multinomial(weights, per_class, replacement=True, generator=generator)
    return (chosen + torch.arange(num_classes).unsqueeze(1) * per_class).flatten(), empty


def vote_and_select(
    votes: PrivateVotes,
    embeddings: torch.Tensor,
    query: BoundedSum,
    ledger: Any,
    noise: NoiseSource,
    threshold: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, list[int], BoundedSumRelease]:
    """One round of Algorithm 1's selection: the K vote histograms of the candidates' ``embeddings`` (``[K * M,
    D]``, class-major) released as one more repeat of ``query``'s registered mechanism, then
    :func:`select_population`. Returns the chosen indices, the uniformly resampled classes and the release."""
    num_classes = query.num_classes
    per_class = len(embeddings) // num_classes
    candidates = embeddings.reshape(num_classes, per_class, -1)
    released = release_bounded_sum(votes.chunks(candidates), per_class, query, ledger, noise, registered=True)
    chosen, empty = select_population(released.sums, threshold, generator)
    return chosen, empty, released
