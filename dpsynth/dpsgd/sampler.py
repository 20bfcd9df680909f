"""Poisson subsampling for DP-SGD.

The subsampled-Gaussian accountant assumes that every example enters every logical batch
independently with probability ``q`` (Abadi et al., 2016; docs/contract.md, privacy rule 3). The batch
size is therefore random, possibly zero, and the engine divides by the *expected* size ``q N``.

Which examples are sampled is part of the mechanism's randomness: a sampler that could be replayed
from a published seed would let anyone reconstruct each batch. The coin flips therefore come from
the run's DP :class:`~dpsynth.privacy.rng.NoiseSource` (entropy-seeded, or ``os.urandom`` with
``privacy.secure_rng``), never from the run seed; tests may pass their own generator.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from dpsynth.errors import PrivacyError
from dpsynth.privacy.rng import NoiseSource


def steps_per_epoch(sample_rate: float) -> int:
    """Logical steps that touch each example once in expectation: ``ceil(1 / q)``."""
    _check_rate(sample_rate)
    return math.ceil(1.0 / sample_rate)


class PoissonSampler:
    """Yields index tensors of Poisson-sampled logical batches.

    Args:
        num_examples: size ``N`` of the private dataset (or of this rank's shard of it).
        sample_rate: inclusion probability ``q`` of each example in each step.
        generator: deterministic source for tests only (overrides ``noise``).
        num_steps: how many batches one iteration yields (default: one epoch, ``ceil(1/q)``).
        noise: the run's DP noise source, which draws the coin flips (default: a fresh
            entropy-seeded one).
    """

    def __init__(
        self,
        num_examples: int,
        sample_rate: float,
        generator: torch.Generator | None = None,
        num_steps: int | None = None,
        noise: NoiseSource | None = None,
    ) -> None:
        if num_examples < 1:
            raise PrivacyError(f"Poisson sampling needs at least one example, got {num_examples}")
        _check_rate(sample_rate)
        self.num_examples = int(num_examples)
        self.sample_rate = float(sample_rate)
        self.num_steps = steps_per_epoch(sample_rate) if num_steps is None else int(num_steps)
        self.generator = generator
        self.noise = noise if noise is not None else NoiseSource()

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.num_examples

    def sample(self) -> torch.Tensor:
        """One logical batch: sorted int64 indices, each example kept with probability q."""
        if self.generator is not None:
            coins = torch.rand(self.num_examples, generator=self.generator)
        else:
            coins = self.noise.uniform(self.num_examples)
        keep = coins < self.sample_rate
        return keep.nonzero().flatten()

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.num_steps):
            yield self.sample()

    def __len__(self) -> int:
        return self.num_steps


def _check_rate(sample_rate: float) -> None:
    if not 0.0 < sample_rate <= 1.0:
        raise PrivacyError(f"sample rate must be in (0, 1], got {sample_rate}")
