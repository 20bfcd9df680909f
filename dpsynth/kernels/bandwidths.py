"""The random features of DP-MERF and DP-Kernel and their public length-scale rule, stated once.

Both methods embed images with unit-norm random Fourier features of a mix of Gaussian kernels
(:class:`~dpsynth.kernels.rff.RandomFourierFeatures`); the length scales come from a **public** rule, never
from private data (the original DP-MERF script reads its median heuristic off the *test* set):

* ``fixed``: the lengths in ``bandwidths`` (DPImageBench's values in the paper presets);
* ``noise-median``: a geometric ladder of ``num_bandwidths`` lengths, ``bandwidth_ratio`` apart, centred on
  ``median_scale`` x the median pairwise distance of ``median_points`` i.i.d. uniform [-1, 1] noise images of
  the data's shape (a function of the shape alone, about ``sqrt(2 d / 3)``);
* ``public-median``: the same ladder around the median distance of ``data.public``.

The default, a quarter of the noise median (2.0, 4.0, 8.1, 16.2 on 28 x 28 pixels), won on both public
stand-ins for mnist10k at both ε in ``experiments/merf_bandwidth_on_public.py`` (docs/methods/dp-merf.md).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import pydantic
from pydantic import Field

from dpsynth.errors import ConfigError
from dpsynth.kernels.rff import median_ladder, noise_images
from dpsynth.schema import Section

BandwidthRule = Literal["noise-median", "public-median", "fixed"]


class RandomFeatureSection(Section):
    """The keys of a random-Fourier-feature embedding: its size and its public length-scale rule."""

    num_features: int = Field(
        10_000, ge=2, description="D, an even number of random features (D/2 frequencies, cos and sin); paper 10,000"
    )
    bandwidth_rule: BandwidthRule | None = Field(
        None,
        description="fixed: the lengths in `bandwidths` | noise-median: a ladder around the median distance of "
        "uniform-noise images (data-independent) | public-median: around the median distance of data.public; "
        "null: fixed when `bandwidths` is set, else noise-median",
    )
    bandwidths: list[float] | None = Field(
        None,
        description="Gaussian length scales l on [-1, 1] pixels (fixed rule only); DP-MERF's l^2 = 105 on [0, 1] "
        "is l = 2 sqrt(105) = 20.49 here",
    )
    median_scale: float = Field(
        0.25, gt=0, description="the ladder's centre is median_scale x the median distance (median rules)"
    )
    num_bandwidths: int = Field(4, ge=1, le=64, description="length scales in the ladder (median rules)")
    bandwidth_ratio: float = Field(2.0, gt=1, description="ratio between neighbouring ladder lengths (median rules)")
    median_points: int = Field(2000, ge=2, description="points the median heuristic looks at (median rules)")

    @property
    def rule(self) -> BandwidthRule:
        """The rule in force: ``bandwidth_rule``, or (null) fixed when ``bandwidths`` is set, else noise-median."""
        if self.bandwidth_rule is not None:
            return self.bandwidth_rule
        return "fixed" if self.bandwidths is not None else "noise-median"

    @pydantic.model_validator(mode="after")
    def _rule_and_lengths_agree(self) -> RandomFeatureSection:
        if self.num_features % 2:
            raise ValueError(f"num_features must be even (cos and sin per frequency), got {self.num_features}")
        if self.rule == "fixed":
            if not self.bandwidths or not all(math.isfinite(value) and value > 0 for value in self.bandwidths):
                raise ValueError("bandwidth_rule 'fixed' needs bandwidths: a list of finite length scales > 0")
            scales = len(self.bandwidths)
        elif self.bandwidths is not None:
            raise ValueError(f"bandwidths are set but bandwidth_rule is {self.rule!r}: use 'fixed'")
        else:
            scales = self.num_bandwidths
        if scales > self.num_features // 2:
            raise ValueError(f"{self.num_features} features cannot cover {scales} bandwidths")
        return self

    def public_use(self) -> Literal["none", "required"]:
        """Whether the rule reads ``data.public``."""
        return "required" if self.rule == "public-median" else "none"


def public_bandwidths(
    section: RandomFeatureSection, shape: tuple[int, int, int], public: Any, seed: int, method: str
) -> tuple[float, ...]:
    """The length scales of ``section``'s public rule for images of ``shape`` (never private data); ``public``
    is the run's public dataset (read by ``public-median`` only), ``seed`` a public seed for the noise images
    and the median's subsample."""
    rule = section.rule
    if rule == "fixed":
        return tuple(float(v) for v in section.bandwidths or ())
    if rule == "noise-median":
        points = noise_images(section.median_points, shape, seed)
    else:
        if public is None or len(public) < 2:
            raise ConfigError(f"{method}: bandwidth_rule 'public-median' needs data.public")
        points = public.to_tensors()[0]
        if tuple(points.shape[1:]) != tuple(shape):
            raise ConfigError(f"{method}: public images {tuple(points.shape[1:])} differ from the private {shape}")
    return median_ladder(
        points,
        section.num_bandwidths,
        section.bandwidth_ratio,
        scale=section.median_scale,
        max_points=section.median_points,
        seed=seed,
    )
