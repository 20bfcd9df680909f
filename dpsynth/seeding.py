"""Named streams of non-private randomness, derived from the run seed.

Data order (of public data: the order of private examples is Poisson sampling, part of the DP
mechanism), model initialisation, augmentation, clip-norm probes and sampling each get their own
generator, so more draws in one stream never shift another. DP noise and Poisson sampling never
come from here: they use the entropy-seeded sources (dpsynth.privacy.rng, dpsynth.dpsgd.sampler).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily: the data layer uses splitmix64 and must stay light to import
    import torch

RNG_STREAMS = ("data-order", "model-init", "augmentation", "clip-probe", "sampling")


def stream_seed(seed: int, stream: str, index: int = 0) -> int:
    """A 63-bit seed for (run seed, stream name, index), stable across processes and platforms."""
    if stream not in RNG_STREAMS:
        raise ValueError(f"unknown RNG stream {stream!r}; streams: {', '.join(RNG_STREAMS)}")
    digest = hashlib.sha256(f"{int(seed)}/{stream}/{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_everything(seed: int) -> None:
    """Seed the global non-private randomness (Python, NumPy, torch: initialisation, sampling). DP noise never
    uses it."""
    import random

    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def stream_generator(seed: int, stream: str, index: int = 0) -> torch.Generator:
    """A CPU generator of the named stream."""
    import torch

    return torch.Generator().manual_seed(stream_seed(seed, stream, index))


#: SplitMix64's increment (the golden ratio in 64 bits): consecutive counters ``k * GOLDEN`` mix apart
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser (Steele et al., "Fast splittable pseudorandom number generators",
    OOPSLA 2014) applied elementwise to uint64 values, wrapping modulo 2^64. It keys the per-record
    draws of the split (:mod:`dpsynth.data.splits`) and of private training
    (:mod:`dpsynth.privacy.record_draws`)."""
    z = np.asarray(values).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
