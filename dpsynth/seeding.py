"""Named streams of non-private randomness, derived from the run seed.

Data order (of public data: the order of private examples is Poisson sampling, part of the DP
mechanism), model initialisation, augmentation, clip-norm probes and sampling each get their own
generator, so more draws in one stream never shift another. DP noise and Poisson sampling never
come from here: they use the entropy-seeded sources (dpsynth.privacy.rng, dpsynth.dpsgd.sampler).
"""

from __future__ import annotations

import hashlib

import torch

RNG_STREAMS = ("data-order", "model-init", "augmentation", "clip-probe", "sampling")


def stream_seed(seed: int, stream: str, index: int = 0) -> int:
    """A 63-bit seed for (run seed, stream name, index), stable across processes and platforms."""
    if stream not in RNG_STREAMS:
        raise ValueError(f"unknown RNG stream {stream!r}; streams: {', '.join(RNG_STREAMS)}")
    digest = hashlib.sha256(f"{int(seed)}/{stream}/{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def stream_generator(seed: int, stream: str, index: int = 0) -> torch.Generator:
    """A CPU generator of the named stream."""
    return torch.Generator().manual_seed(stream_seed(seed, stream, index))
