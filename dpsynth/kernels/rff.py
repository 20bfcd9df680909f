"""Random Fourier features of a Gaussian kernel (or a mix of Gaussian kernels), norm exactly 1.

DP-MERF (Harder et al., "DP-MERF: Differentially Private Mean Embeddings with Random Features for
Practical Privacy-Preserving Data Generation", AISTATS 2021, arXiv:2002.11603, §2.2 and §3, the
"sphere" variant) approximates the Gaussian kernel ``k(x, y) = exp(-||x - y||^2 / (2 l^2))`` by
Rahimi & Recht's random features (NeurIPS 2007):

    phi(x) = [cos(W x), sin(W x)] / sqrt(D / 2),   W in R^{D/2 x d},  W_jk ~ N(0, 1 / l^2),

so ``phi(x) . phi(y) = (2/D) sum_j cos(w_j . (x - y))``, an unbiased estimate of ``k(x, y)``, and
``||phi(x)||^2 = (2/D) sum_j (cos^2 + sin^2) = 1`` for every x: the declared bound B = 1 needs no
clipping. (DP-MERF's ``rff_sigma`` is l^2, the *squared* length scale: 105 for MNIST in [0, 1];
dpsynth's pixels are in [-1, 1], which doubles every distance, so the same kernel has l^2 = 420.)

**A mix of bandwidths.** Frequency j draws its row from ``N(0, I / l_s^2)`` with ``s = j mod S``, so
the features approximate ``sum_s (n_s / (D/2)) k_{l_s}`` (equal weights when S divides D/2), the
multi-bandwidth kernel DP-Kernel uses (dp-kernel.md) and that lifts DP-MERF's accuracy on MNIST.

**Bandwidths are public.** ``W`` is drawn from a public seed (it may be published); the length scales
come from a fixed list or from :func:`median_heuristic` on *public* points (a public dataset, or
noise images) and :func:`bandwidth_ladder`; never from private data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dpsynth.errors import ConfigError
from dpsynth.kernels.feature_map import FeatureMap, flatten_inputs


class RandomFourierFeatures(FeatureMap):
    """``phi(x) = [cos(W x), sin(W x)] / sqrt(D/2)`` with ``W`` from a public seed (``bound`` = 1).

    Args:
        input_dim: ``d``, the length of a flattened input.
        num_features: ``D`` (even): D/2 frequencies, each giving a cosine and a sine.
        bandwidths: the length scales ``l_s`` (one, or a mix); frequency j uses ``l_{j mod S}``.
        seed: the public seed of ``W`` (e.g. a stream of the run seed): same seed, same features.
        device: where ``W`` lives and the features are computed.
    """

    bound = 1.0

    def __init__(
        self,
        input_dim: int,
        num_features: int,
        bandwidths: float | Sequence[float],
        seed: int,
        device: torch.device | str = "cpu",
    ) -> None:
        scales = _checked_bandwidths(bandwidths)
        if num_features < 2 or num_features % 2:
            raise ConfigError(f"the number of random features must be even and >= 2, got {num_features}")
        half = num_features // 2
        if half < len(scales):
            raise ConfigError(f"{num_features} random features cannot cover {len(scales)} bandwidths")
        self.input_dim, self.dim, self.bandwidths = int(input_dim), int(num_features), scales
        generator = torch.Generator().manual_seed(int(seed))
        gaussian = torch.randn(half, self.input_dim, generator=generator, dtype=torch.float64)
        per_row = torch.tensor(scales, dtype=torch.float64)[torch.arange(half) % len(scales)]
        self.frequencies = (gaussian / per_row[:, None]).to(device=device, dtype=torch.float32)

    def to(self, device: torch.device | str) -> RandomFourierFeatures:
        """Move ``W`` to ``device`` (in place); returns self."""
        self.frequencies = self.frequencies.to(device)
        return self

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        flat = flatten_inputs(inputs).to(self.frequencies.dtype)
        if flat.shape[1] != self.input_dim:
            raise ConfigError(f"the random features expect inputs of length {self.input_dim}, got {flat.shape[1]}")
        projection = flat @ self.frequencies.T
        scale = 1.0 / math.sqrt(self.dim // 2)
        return torch.cat([torch.cos(projection), torch.sin(projection)], dim=1) * scale

    def kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The kernel the features approximate, exactly: ``[N, M]`` of ``sum_s w_s exp(-|x-y|^2 / 2 l_s^2)``."""
        squared = torch.cdist(flatten_inputs(x).double(), flatten_inputs(y).double()) ** 2
        half = self.dim // 2
        weights = [len(range(s, half, len(self.bandwidths))) / half for s in range(len(self.bandwidths))]
        return sum(w * torch.exp(-squared / (2 * scale**2)) for w, scale in zip(weights, self.bandwidths))


def median_heuristic(public_points: torch.Tensor, max_points: int = 2000, seed: int = 0) -> float:
    """The median pairwise L2 distance of (at most ``max_points`` of) ``public_points``.

    The classic bandwidth rule (Gretton et al., JMLR 2012, §8). Feed it *public* points only — a
    public dataset, or noise images — never private ones: a bandwidth read off private data is an
    unaccounted release (DP-MERF's original script computes it on the test set; dp-merf.md).
    """
    flat = flatten_inputs(public_points).double()
    if len(flat) < 2:
        raise ConfigError("the median heuristic needs at least two public points")
    if len(flat) > max_points:
        generator = torch.Generator().manual_seed(int(seed))
        flat = flat[torch.randperm(len(flat), generator=generator)[:max_points]]
    distances = torch.pdist(flat)
    return float(distances.median())


def bandwidth_ladder(base: float, count: int, ratio: float = 2.0) -> tuple[float, ...]:
    """``count`` length scales in a geometric ladder centred on ``base``: ``base * ratio^(k - (count-1)/2)``.

    E.g. ``bandwidth_ladder(l, 4)`` = (l/2.83, l/1.41, 1.41 l, 2.83 l): a mix around one public
    reference scale, for :class:`RandomFourierFeatures`.
    """
    if not base > 0 or not ratio > 0 or count < 1:
        raise ConfigError(f"a bandwidth ladder needs base > 0, ratio > 0 and count >= 1, got {base}, {ratio}, {count}")
    return tuple(float(base * ratio ** (k - (count - 1) / 2)) for k in range(count))


def noise_images(count: int, shape: Sequence[int], seed: int) -> torch.Tensor:
    """``count`` images of i.i.d. uniform [-1, 1] pixels of ``shape``, from a public seed: data-independent
    points for :func:`median_heuristic` when no public dataset is configured (their median distance depends on
    the shape only, about ``sqrt(2 d / 3)``)."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.rand((int(count), *shape), generator=generator) * 2 - 1


def median_ladder(
    public_points: torch.Tensor, count: int, ratio: float, scale: float = 1.0, max_points: int = 2000, seed: int = 0
) -> tuple[float, ...]:
    """:func:`bandwidth_ladder` of ``count`` length scales around ``scale`` x the :func:`median_heuristic` of
    ``public_points``: the public bandwidth rule of DP-MERF and DP-Kernel (never private points)."""
    median = median_heuristic(public_points, max_points=max_points, seed=seed)
    return bandwidth_ladder(scale * median, count, ratio)


def _checked_bandwidths(bandwidths: float | Sequence[float]) -> tuple[float, ...]:
    values = (bandwidths,) if isinstance(bandwidths, (int, float)) else tuple(bandwidths)
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
        raise ConfigError(f"bandwidths must be finite numbers > 0, got {bandwidths!r}")
    return tuple(float(v) for v in values)
