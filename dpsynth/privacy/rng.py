"""Random sources for DP noise (DESIGN.md, privacy rule 5).

DP noise never derives from the run's seed. By default it comes from a torch generator seeded
from OS entropy, so a published config cannot replay it; ``secure=True`` draws every normal
variate from ``os.urandom`` bytes (Box-Muller over 53-bit uniforms), slower but cryptographic.
Only tests may ask for a fixed ``seed``.
"""

from __future__ import annotations

import math
import os
import secrets

import numpy as np
import torch


class NoiseSource:
    """Draws Gaussian noise for DP mechanisms.

    Args:
        secure: draw from ``os.urandom`` (cryptographic) instead of an entropy-seeded generator.
        seed: fixed seed for tests only; forbidden together with ``secure``.
    """

    def __init__(self, secure: bool = False, seed: int | None = None) -> None:
        if secure and seed is not None:
            raise ValueError("a secure noise source cannot be seeded")
        self.secure = secure
        self.deterministic = seed is not None
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed if seed is not None else secrets.randbits(63))

    def normal(self, shape: tuple[int, ...] | torch.Size, std: float, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return ``N(0, std^2)`` noise of ``shape`` on ``device``."""
        shape = tuple(shape)
        if self.secure:
            noise = torch.from_numpy(_urandom_normal(math.prod(shape))).reshape(shape)
        else:
            noise = torch.randn(shape, generator=self._generator, dtype=torch.float64)
        return (noise * std).to(device=device, dtype=dtype)

    def state_dict(self) -> dict:
        # The generator state is deliberately not saved: a resumed run draws fresh noise.
        return {"secure": self.secure}


def _urandom_normal(n: int) -> np.ndarray:
    """Standard normals from ``os.urandom`` by the Box-Muller transform."""
    pairs = (n + 1) // 2
    raw = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(pairs, 2)
    uniform = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)  # in (0, 1)
    radius = np.sqrt(-2.0 * np.log(uniform[:, 0]))
    angle = 2.0 * math.pi * uniform[:, 1]
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
