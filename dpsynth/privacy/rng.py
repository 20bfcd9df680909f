"""Random sources for DP noise (docs/contract.md, privacy rule 5).

DP noise never derives from the run's seed. By default it comes from generators seeded from OS
entropy, so a published config cannot replay it; ``secure=True`` draws every normal variate from
``os.urandom`` bytes (Box-Muller over 53-bit uniforms), slower but cryptographic. Only tests may
ask for a fixed ``seed``.

On the CPU the draws come from numpy's ``SFC64`` generator: float64 normals by its ziggurat, whose
tail is drawn by Marsaglia's tail method and reaches 13.7 sigma instead of ending where a Box-Muller
transform of 53-bit uniforms ends (radius 8.6 sigma), and 2x faster than torch's float64 normals
(16 against 33 ms for the 1.1M-parameter CNN's noise, one thread). On an accelerator the normals are
drawn there, in float64 (Box-Muller of 53-bit uniforms), not in float32: 32-bit uniforms end the radius
at 6.8 sigma, which an exact Gaussian pair passes with probability 1.2e-10, so a step of 10^8 coordinates
would differ from the analysed mechanism with probability up to 6e-3, far above any delta a run targets
(float64: 5e-9).

The same source covers *all* of a mechanism's randomness: the Gaussian noise and the Poisson
batch sampling of DP-SGD (:meth:`NoiseSource.uniform`; the subsampled-Gaussian analysis assumes the
batch draw is as unpredictable as the noise), and the noise of noisy validation and of the
released statistics elsewhere. A run's config builds it
(:meth:`dpsynth.privacy.section.PrivacySection.noise_source`).
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
        self._seed = seed
        self._generator = np.random.Generator(np.random.SFC64(seed if seed is not None else secrets.randbits(128)))
        self._accelerator_generators: dict[torch.device, torch.Generator] = {}

    def _on(self, device: torch.device) -> torch.Generator:
        """An entropy-seeded generator on an accelerator (its own seed, never written anywhere): noise for a
        model on a GPU is drawn there, since drawing 10^8 normals on the CPU and copying them over costs
        seconds per step (measured on an H100, BENCHMARKS.md)."""
        if device not in self._accelerator_generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(secrets.randbits(63) if self._seed is None else self._seed + 1)
            self._accelerator_generators[device] = generator
        return self._accelerator_generators[device]

    def generator(self, device: torch.device | str) -> torch.Generator:
        """A torch generator on ``device`` seeded from OS entropy (never the run seed; a test seed in tests): the
        coins of device Poisson sampling (:mod:`dpsynth.dpsgd.fixed_shape`). Refused for a secure source, whose
        draws come from ``os.urandom`` on the host."""
        if self.secure:
            raise ValueError("a secure noise source draws on the host: it has no device generator")
        device = torch.device(device)
        if device.type == "cpu" and device not in self._accelerator_generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(secrets.randbits(63) if self._seed is None else self._seed + 2)
            self._accelerator_generators[device] = generator
        return self._on(device)

    def normal(
        self,
        shape: tuple[int, ...] | torch.Size,
        std: float,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Return ``N(0, std^2)`` noise of ``shape`` on ``device``."""
        shape, device = tuple(shape), torch.device(device)
        if self.secure:
            noise = torch.from_numpy(_urandom_normal(math.prod(shape))).reshape(shape)
        elif device.type not in ("cpu", "mps"):  # MPS has no float64: its noise is drawn on the CPU
            noise = torch.randn(shape, generator=self._on(device), device=device, dtype=torch.float64)
            return noise.mul_(std).to(dtype)
        else:
            noise = torch.from_numpy(self._generator.standard_normal(math.prod(shape))).reshape(shape)
        return noise.mul_(std).to(device=device, dtype=dtype)

    def uniform(self, count: int) -> torch.Tensor:
        """``count`` float64 draws from U(0, 1): the coin flips of Poisson sampling."""
        if self.secure:
            return torch.from_numpy(_urandom_uniform(count))
        return torch.from_numpy(self._generator.random(count))

    def state_dict(self) -> dict:
        # The generator state is deliberately not saved: a resumed run draws fresh noise.
        return {"secure": self.secure}


def _urandom_uniform(n: int) -> np.ndarray:
    """Uniforms in (0, 1) from 53 random bits of ``os.urandom`` each."""
    raw = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
    return ((raw >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def _urandom_normal(n: int) -> np.ndarray:
    """Standard normals from ``os.urandom`` by the Box-Muller transform."""
    pairs = (n + 1) // 2
    uniform = _urandom_uniform(2 * pairs).reshape(pairs, 2)
    radius = np.sqrt(-2.0 * np.log(uniform[:, 0]))
    angle = 2.0 * math.pi * uniform[:, 1]
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
