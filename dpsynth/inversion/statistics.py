"""The private GroupNorm input statistics of DP-ImgSyn (TMLR 2024, §4.1): one bounded-sum Gaussian release.

Each private example's channel means and second moments of every GroupNorm input of the (DP-trained)
teacher, concatenated (:func:`~dpsynth.inversion.feature_stats.per_example_moments`), are clipped to L2 norm
``C``, summed, and released with Gaussian noise ``N(0, σ²C²)``. The noise is really added (the authors' public
code leaves it commented out, which gives no privacy). Under add/remove adjacency the number of private
examples is private too, so the divisor is a noisy count. Sum and count are one release of the shared
bounded-sum mechanism (:func:`statistics_query`); with ``sample_rate`` below 1 it reads only a Poisson
subsample of the records, so its cost does not grow with N. ``C`` comes from the config or from public
images (:func:`statistics_clip_norm`), never from private data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from pydantic import Field

from dpsynth.errors import ConfigError
from dpsynth.inversion.feature_stats import FeatureStatistics, GroupNormInputs, per_example_moments
from dpsynth.privacy.bounded_sum import (
    BoundedSum,
    BoundedSumRelease,
    release_bounded_sum,
    release_subsampled_bounded_sum,
)
from dpsynth.privacy.mechanisms import Mechanism
from dpsynth.schema import Section


class StatsSection(Section):
    """§4.1 statistics capture: the clipped-moment sum and the record count, one Gaussian release over the
    train split or a Poisson subsample of it (:func:`statistics_query`)."""

    noise_multiplier: float = Field(10.0, gt=0, description="sigma of the clipped-moment sum (noise std sigma*C)")
    count_noise_multiplier: float = Field(20.0, gt=0, description="sigma of the noisy count (sensitivity 1)")
    sample_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Poisson rate q of the records the statistics read (1: every record; < 1: one subsampled "
        "Gaussian, amplified by q, whose cost does not grow with N)",
    )
    clip_norm: float | None = Field(
        None, gt=0, description="C; null: the clip_quantile of per-example norms on public images (free)"
    )
    clip_quantile: float = Field(0.95, gt=0, le=1, description="quantile of public moment norms used as C")
    min_variance: float = Field(1e-4, ge=0, description="clamp of E[x^2] - mu^2 after noise")
    batch_size: int = Field(256, ge=1, description="forward batch for capture (does not change the mechanism)")


def statistics_query(stats: StatsSection, clip_norm: float, *, name: str) -> BoundedSum:
    """The §4.1 release as one bounded sum (ledger name ``name``): per record, its moment vector clipped to
    ``C`` and a count of 1.

    The paper's two Gaussians (the sum with noise ``σ_s·C``, the count with noise ``σ_c``) are released
    jointly as ``[sum, w·count] + N(0, σ²(C² + w²))`` with ``w = C·σ_s/σ_c`` and
    ``σ = (σ_s⁻² + σ_c⁻²)^(-1/2)``: the same noise on the sum and on the count, and the same privacy
    as the two composed (the Rényi divergences of Gaussians add). Joint, the pair can share one Poisson
    subsample (``stats.sample_rate`` < 1), accounted as one subsampled Gaussian; two mechanisms on one
    subsample could not each claim the amplification.
    """
    sigma_sum, sigma_count = float(stats.noise_multiplier), float(stats.count_noise_multiplier)
    return BoundedSum(
        name,
        bound=clip_norm,
        noise_multiplier=1.0 / math.hypot(1.0 / sigma_sum, 1.0 / sigma_count),
        sample_rate=float(stats.sample_rate),
        count_weight=clip_norm * sigma_sum / sigma_count,
    )


def statistics_mechanisms(stats: StatsSection, *, name: str) -> list[Mechanism]:
    """The mechanism the release will charge (its σ and rate do not depend on ``C``), for a plan that
    calibrates the mechanisms spent before it with this one reserved."""
    return [statistics_query(stats, clip_norm=1.0, name=name).mechanism(1)]


def moment_chunks(
    teacher: torch.nn.Module, images: torch.Tensor, batch_size: int, device: torch.device | str
) -> Iterator[torch.Tensor]:
    """Per-example moment vectors of ``images``, ``batch_size`` at a time (GroupNorm is per example)."""
    with torch.no_grad(), GroupNormInputs(teacher) as captured:
        for start in range(0, len(images), batch_size):
            teacher(images[start : start + batch_size].to(device))
            yield per_example_moments(captured.captured()).cpu()


def statistics_clip_norm(
    teacher: torch.nn.Module, stats: StatsSection, probe: Callable[[], torch.Tensor], device: torch.device | str
) -> float:
    """``stats.clip_norm`` if set, else the ``clip_quantile`` of the moment-vector norms of ``probe()``.

    ``probe()`` returns public images (or the noise initialisation), so C is free: a clip norm computed
    from private data would leak (docs/privacy.md). It is called only when C is not set.
    """
    if stats.clip_norm is not None:
        if not float(stats.clip_norm) > 0:
            raise ConfigError(f"stats.clip_norm must be positive, got {stats.clip_norm!r}")
        return float(stats.clip_norm)
    quantile = float(stats.clip_quantile)
    if not 0 < quantile <= 1:
        raise ConfigError(f"stats.clip_quantile must lie in (0, 1], got {quantile}")
    norms = torch.cat(list(moment_chunks(teacher, probe(), int(stats.batch_size), device))).norm(dim=1)
    return max(float(torch.quantile(norms.double(), quantile)), 1e-6)


def private_moment_release(
    teacher: torch.nn.Module,
    num_records: int,
    read: Callable[[np.ndarray], torch.Tensor],
    query: BoundedSum,
    ledger: Any,
    noise: Any,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> BoundedSumRelease:
    """Release ``query`` over the clipped per-example moment vectors of ``num_records`` private images.

    ``read(indices)`` returns the images at ``indices`` as float tensors; it is called only after the
    charge, ``batch_size`` records at a time, and (``query.sample_rate`` < 1) only for the records the
    Poisson coins keep. Each row (:func:`~dpsynth.inversion.feature_stats.per_example_moments`) is clipped to
    ``C``, so adding or removing one record moves the released vector by at most the query's sensitivity.
    """
    teacher.eval()
    with GroupNormInputs(teacher) as probe:
        dim = 2 * sum(probe.channels)

    def chunks(indices: torch.Tensor) -> Iterator[tuple[torch.Tensor, None]]:
        positions = np.asarray(indices, dtype=np.int64)
        for start in range(0, len(positions), batch_size):
            images = read(positions[start : start + batch_size])
            yield from ((rows, None) for rows in moment_chunks(teacher, images, len(images), device))

    if query.sample_rate == 1.0:
        return release_bounded_sum(chunks(torch.arange(num_records)), dim, query, ledger, noise)
    return release_subsampled_bounded_sum(chunks, num_records, dim, query, ledger, noise)


def release_feature_statistics(
    teacher: torch.nn.Module,
    train: Any,
    stats: StatsSection,
    clip_norm: float,
    ledger: Any,
    noise: Any,
    *,
    name: str,
    device: torch.device | str = "cpu",
) -> tuple[FeatureStatistics, float]:
    """Release the private GroupNorm input statistics of the ``train`` split (§4.1) and the noisy count that
    divides them.

    One :func:`statistics_query` release over the split (an ImageDataset) or its Poisson subsample, charged to
    ``ledger`` before any image is read; the means are the noisy sums over the noisy count clamped at 1 and
    the variances ``E[x²] − μ²`` clamped at ``stats.min_variance`` (post-processing).
    """
    query = statistics_query(stats, clip_norm, name=name)
    released = private_moment_release(
        teacher,
        len(train),
        lambda indices: train.batch_tensors(indices)[0],
        query,
        ledger,
        noise,
        int(stats.batch_size),
        device,
    )
    with GroupNormInputs(teacher) as probe:
        channels = probe.channels
    statistics = FeatureStatistics.from_moments(
        released.means[0].float(), channels, min_variance=float(stats.min_variance)
    )
    return statistics, max(float(released.counts[0]), query.min_count)
