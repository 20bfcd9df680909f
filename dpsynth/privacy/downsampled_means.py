"""Noisy class means of downsampled private images: DP-FETA's central images.

Paper: Li, Gong, Li, Zhao, Hou & Wang, *From Easy to Hard: Building a Shortcut for Differentially Private Image
Synthesis*, IEEE S&P 2025, arXiv:2504.01395, §4.1 (DPImageBench's ``CentralDataset``).

**Query.** A Poisson sample of the private images at rate q = b / N (coins from the noise source); every image
downsampled by ``factor`` (nearest neighbour, 28 -> 14 at 0.5) to ``h x w`` and flattened to a feature in
[0, 1]^(C·h·w); per class c the sum of the sample's class-c features plus Gaussian noise of std σ·B, with
B = sqrt(C·h·w) the largest L2 norm of such a feature (an all-white image reaches it, so clipping never bites); then
divided by the *public* expected class count b / K, or, with ``count_weight`` w, by the class counts released
jointly (sensitivity sqrt(B² + w²)). The classes are disjoint, so one record moves one class sum by at most B: one
release is ``SubsampledGaussian(σ, q)`` (``Gaussian(σ)`` at q = 1), charged before any image is read, through the
shared bounded-sum release (:mod:`dpsynth.privacy.bounded_sum`); R releases under one name are one ledger entry.

The reference code scales the noise to b / K but divides by the *realised* class count of the sample, so rare
classes get less noise than claimed and an empty class gives NaN; here the denominator is public (an empty class
is noise over b / K, finite).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from dpsynth.errors import ConfigError
from dpsynth.privacy.bounded_sum import (
    BoundedSum,
    BoundedSumRelease,
    LabelledChunk,
    release_bounded_sum,
    release_subsampled_bounded_sum,
)
from dpsynth.privacy.rng import NoiseSource

#: private records per chunk of the class sums (memory only)
CHUNK = 1024


def downsampled_size(height: int, width: int, factor: float) -> tuple[int, int]:
    """(h, w) of an image downsampled by ``factor`` (at least one pixel each)."""
    return max(1, math.floor(height * factor)), max(1, math.floor(width * factor))


def downsampled_features(images: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``[n, H, W, C]`` -> ``[n, C*h*w]`` float64 in [0, 1], nearest-neighbour downsampled to ``size``."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).to(torch.float64) / 255.0
    return F.interpolate(x, size=size, mode="nearest").flatten(1)


def downsampled_mean_query(
    name: str,
    image_shape: tuple[int, int, int],
    factor: float,
    noise_multiplier: float,
    *,
    num_classes: int,
    batch_size: int,
    num_records: int,
    count_weight: float | None = None,
    key: str = "central",
) -> BoundedSum:
    """The declared release of images of ``image_shape`` (C, H, W): bound B = sqrt(C·h·w), σ, rate q = b / N and the
    public denominator b / K (None with ``count_weight``: the means divide by the noisy counts). ``key`` names the
    config section in the error raised for a batch outside [1, N]."""
    if not 0 < batch_size <= num_records:
        raise ConfigError(f"{key}.batch_size must be in [1, {num_records}] (the private train size), got {batch_size}")
    channels, height, width = image_shape
    size = downsampled_size(height, width, factor)
    return BoundedSum(
        name,
        math.sqrt(channels * size[0] * size[1]),
        noise_multiplier,
        num_classes=num_classes,
        sample_rate=min(1.0, batch_size / num_records),
        denominator=None if count_weight is not None else batch_size / num_classes,
        count_weight=count_weight,
    )


def release_downsampled_means(
    images: np.ndarray,
    labels: np.ndarray,
    query: BoundedSum,
    size: tuple[int, int],
    ledger: object,
    noise: NoiseSource,
) -> BoundedSumRelease:
    """One release of ``query`` over uint8 ``images [N, H, W, C]`` (memory-mapped or not) downsampled to ``size``:
    charged to ``ledger`` first, then the Poisson sample (rate ``query.sample_rate``) read a chunk at a time."""

    def chunks(indices: torch.Tensor) -> Iterator[LabelledChunk]:
        for chunk in indices.split(CHUNK):
            rows = chunk.numpy()
            yield downsampled_features(images[rows], size), torch.from_numpy(labels[rows])

    dim = images.shape[-1] * size[0] * size[1]
    if query.sample_rate < 1.0:
        return release_subsampled_bounded_sum(chunks, len(images), dim, query, ledger, noise)
    return release_bounded_sum(chunks(torch.arange(len(images))), dim, query, ledger, noise)


def mean_noise_std(query: BoundedSum) -> float:
    """The noise std of one pixel of the released means before clamping: σ·B over the declared denominator (NaN
    when the means are divided by noisy counts instead)."""
    if not isinstance(query.denominator, float):
        return float("nan")
    return query.noise_std / query.denominator
