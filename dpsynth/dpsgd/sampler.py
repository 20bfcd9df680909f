"""Poisson subsampling for DP-SGD.

The subsampled-Gaussian accountant assumes that every example enters every logical batch
independently with probability ``q`` (Abadi et al., 2016; docs/contract.md, privacy rule 3). The batch
size is therefore random, possibly zero, and the engine divides by the *expected* size ``q N``.

Which examples are sampled is part of the mechanism's randomness: a sampler that could be replayed
from a published seed would let anyone reconstruct each batch. The uniforms therefore come from
the run's DP :class:`~dpsynth.privacy.rng.NoiseSource` (entropy-seeded, or ``os.urandom`` with
``privacy.secure_rng``), never from the run seed; tests may pass their own generator.

The sample is drawn in O(qN) time and memory, not by one coin per example (:func:`poisson_indices`):
a coin per example of 1.6M cost 14-22 ms of CPU a step against 0.5 ms for the gaps, at B = 256
(experiments/memmap_data.py, a shared 2-core machine), and it grows with N while the batch does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

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
        """One logical batch: sorted int64 indices, each example kept independently with probability q."""
        return poisson_indices(self.num_examples, self.sample_rate, self._uniforms)

    def _uniforms(self, count: int) -> torch.Tensor:
        if self.generator is not None:
            return torch.rand(count, generator=self.generator, dtype=torch.float64)
        return self.noise.uniform(count)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.num_steps):
            yield self.sample()

    def __len__(self) -> int:
        return self.num_steps


def poisson_indices(count: int, rate: float, uniforms: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Sorted int64 indices of ``range(count)``, each included independently with probability ``rate``.

    In a sequence of independent Bernoulli(q) trials, the position of the first success and the gaps
    between successive ones are independent Geometric(q) variables on {1, 2, ...} (the waiting-time view
    of the binomial: Devroye, "Non-Uniform Random Variate Generation", Springer 1986, ch. X). Adding such
    gaps until they pass ``count`` therefore yields exactly the set one coin per index would, from about
    ``q * count + 1`` uniforms instead of ``count``. A gap is drawn by inversion,
    ``G = 1 + floor(log(1 - U) / log(1 - q))`` for ``U`` uniform on [0, 1): ``P(G > k) = (1 - q)^k``.
    ``uniforms(n)`` returns n float64 uniforms in [0, 1) (the DP noise source's). Uniforms left over in
    the last block are discarded: they are independent of the gaps used, so the sample is unaffected.
    """
    if rate >= 1.0:
        return torch.arange(count, dtype=torch.int64)
    log_stay = math.log1p(-rate)
    found, position = [], -1  # position: the last index drawn so far (-1 before the first)
    while True:
        block = block_size(count - 1 - position, rate)
        u = uniforms(block).to(torch.float64)
        gaps = torch.floor(torch.log1p(-u) / log_stay) + 1
        # Clamped past the end before the cast: a gap of 1/q * 745 can exceed int64 for a tiny q.
        positions = position + torch.cumsum(gaps.clamp(max=count + 1).to(torch.int64), 0)
        inside = positions[positions < count]  # increasing: a prefix of the block
        found.append(inside)
        if len(inside) < block:
            return torch.cat(found)
        position = int(positions[-1])


def block_size(remaining: int, rate: float) -> int:
    """Uniforms drawn at once for ``remaining`` indices: the expected count plus four standard deviations
    and a margin, so that one block almost always reaches the end."""
    expected = rate * remaining
    return int(expected + 4.0 * math.sqrt(expected) + 16)


def _check_rate(sample_rate: float) -> None:
    if not 0.0 < sample_rate <= 1.0:
        raise PrivacyError(f"sample rate must be in (0, 1], got {sample_rate}")
