"""``dp-merf``: a noisy random-feature mean embedding, released once, and a generator fitted to it.

Paper: Harder, Adamczewski, Park, "DP-MERF: Differentially Private Mean Embeddings with Random Features
for Practical Privacy-Preserving Data Generation", AISTATS 2021, arXiv:2002.11603 (Algorithm 1, §3-§5).

* Feature map (§2.2, the "sphere" variant): ``phi(x) = [cos(W x), sin(W x)] / sqrt(D/2)``, ``||phi(x)|| = 1``,
  ``W`` drawn from the run's public ``model-init`` stream
  (:class:`dpsynth.kernels.RandomFourierFeatures`). The paper uses one Gaussian kernel; here ``W``'s rows
  may mix several length scales (a mix of Gaussian kernels), all from a **public rule**
  (``bandwidth_rule``): ``fixed`` lengths, or a geometric ladder around the median pairwise distance of
  data-independent uniform-noise images (``noise-median``) or of the public dataset (``public-median``).
  Never from private data: the original script prints the median heuristic of the *test* set.
* Release (the only private access) and generator training: :mod:`dpsynth.methods.families.mean_embedding` (one Gaussian
  release of the class-wise feature sums, with jointly released noisy counts or a declared N/K; then
  moment matching on the paper's 0.17M-parameter generator, :mod:`dpsynth.models.merf_generator`).

Adjacency: add/remove one record (the paper and DPImageBench state replace-one, 2/n): the whole ``K x D``
table of sums moves by at most 1 (``sqrt(1 + w^2)`` with the counts), so one release is exactly
``Gaussian("rff-embedding", sigma)``, its σ calibrated with every other mechanism of the run.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from dpsynth.contract import RunConfig, RunContext, register_method
from dpsynth.errors import ConfigError
from dpsynth.kernels.feature_map import FeatureMap
from dpsynth.kernels.rff import RandomFourierFeatures, median_ladder, noise_images
from dpsynth.methods.families.mean_embedding import (
    BANDWIDTH_PROBE,
    FEATURE_MAP_INIT,
    MeanEmbeddingMethod,
    MeanEmbeddingSection,
)
from dpsynth.seeding import stream_seed

MECHANISM = "rff-embedding"

BandwidthRule = Literal["noise-median", "public-median", "fixed"]


class DPMerfConfig(MeanEmbeddingSection):
    """The ``dp-merf`` section: the random features and their public bandwidth rule, plus the shared release
    and generator keys (:class:`dpsynth.methods.families.mean_embedding.MeanEmbeddingSection`)."""

    num_features: int = Field(
        10_000, ge=2, description="D, an even number of random features (D/2 frequencies, cos and sin); paper 10,000"
    )
    bandwidth_rule: BandwidthRule = Field(
        "noise-median",
        description="fixed: the lengths in `bandwidths` | noise-median: a ladder around the median distance of "
        "uniform-noise images (data-independent) | public-median: around the median distance of data.public",
    )
    bandwidths: list[float] | None = Field(
        None,
        description="Gaussian length scales l on [-1, 1] pixels (fixed rule only); the paper's l^2 = 105 on [0, 1] "
        "is l = 2 sqrt(105) = 20.49 here",
    )
    median_scale: float = Field(
        0.25, gt=0, description="the ladder's centre is median_scale x the median distance (median rules)"
    )
    num_bandwidths: int = Field(4, ge=1, le=64, description="length scales in the ladder (median rules)")
    bandwidth_ratio: float = Field(2.0, ge=1, description="ratio between neighbouring ladder lengths (median rules)")
    median_points: int = Field(2000, ge=2, description="points the median heuristic looks at (median rules)")

    @pydantic.model_validator(mode="after")
    def _rule_and_lengths_agree(self) -> DPMerfConfig:
        if self.num_features % 2:
            raise ValueError(f"num_features must be even (cos and sin per frequency), got {self.num_features}")
        if self.bandwidth_rule == "fixed":
            if not self.bandwidths or not all(value > 0 for value in self.bandwidths):
                raise ValueError("bandwidth_rule 'fixed' needs bandwidths: a list of length scales > 0")
            if len(self.bandwidths) > self.num_features // 2:
                raise ValueError(f"{self.num_features} features cannot cover {len(self.bandwidths)} bandwidths")
        elif self.bandwidths is not None:
            raise ValueError(f"bandwidths are set but bandwidth_rule is {self.bandwidth_rule!r}: use 'fixed'")
        elif self.num_bandwidths > self.num_features // 2:
            raise ValueError(f"{self.num_features} features cannot cover {self.num_bandwidths} bandwidths")
        return self


def public_bandwidths(
    section: DPMerfConfig, shape: tuple[int, int, int], public: object, seed: int
) -> tuple[float, ...]:
    """The length scales of the random features, from ``section``'s public rule (never private data).

    ``noise-median`` looks at ``median_points`` images of i.i.d. uniform [-1, 1] pixels of the data's
    shape, drawn from a public seed: the value depends on the shape only (about sqrt(2 d / 3)).
    """
    if section.bandwidth_rule == "fixed":
        return tuple(float(v) for v in section.bandwidths or ())
    if section.bandwidth_rule == "noise-median":
        points = noise_images(section.median_points, shape, seed)
    else:
        if public is None or len(public) < 2:
            raise ConfigError("dp-merf: bandwidth_rule 'public-median' needs data.public")
        points = public.to_tensors()[0]
    return median_ladder(
        points,
        section.num_bandwidths,
        section.bandwidth_ratio,
        scale=section.median_scale,
        max_points=section.median_points,
        seed=seed,
    )


@register_method
class DPMerf(MeanEmbeddingMethod):
    name = "dp-merf"
    summary = (
        "random-feature mean embedding (a mix of public bandwidths) released once with Gaussian noise, "
        "then a generator fitted to it by moment matching"
    )
    paper = (
        "Harder, Adamczewski, Park, DP-MERF: Differentially Private Mean Embeddings with Random Features "
        "for Practical Privacy-Preserving Data Generation, AISTATS 2021 (arXiv:2002.11603)"
    )
    config_schema = DPMerfConfig
    mechanism_name = MECHANISM
    privacy_notes = (
        (
            "dp-merf: add/remove adjacency. One Gaussian release 'rff-embedding' of the class-wise SUMS of unit-norm "
            "random features (L2 sensitivity 1; sqrt(1 + w^2) when the class counts are released jointly with weight "
            "w), divided by those noisy counts or by the declared public N/K, never by counts read off the private "
            "data. The paper and DPImageBench state replace-one adjacency (sensitivity 2/n of the mean)."
        ),
        (
            "dp-merf: the release's sigma is calibrated for the whole run, with every mechanism spent before it; "
            "DPImageBench's DP-MERF ignores earlier spending (train.dp.privacy_history) and overspends when combined "
            "with another private step."
        ),
        (
            "dp-merf: the kernel length scales come from a public rule (fixed values, uniform-noise images or the "
            "public dataset), never from private data; the original script computes its median heuristic on the "
            "test set. The noise comes from the run's noise source, not from a fixed torch seed."
        ),
    )

    @classmethod
    def release_public_use(cls, config: RunConfig) -> Literal["none", "optional", "required"]:
        return "required" if config.section.bandwidth_rule == "public-median" else "none"

    def feature_map(self, ctx: RunContext) -> FeatureMap:
        section = ctx.section
        shape = ctx.image_shape
        lengths = public_bandwidths(section, shape, ctx.public, stream_seed(ctx.seed, "model-init", BANDWIDTH_PROBE))
        ctx.log(f"dp-merf: {section.bandwidth_rule} length scales " + ", ".join(f"{v:.3g}" for v in lengths))
        return RandomFourierFeatures(
            shape[0] * shape[1] * shape[2],
            section.num_features,
            lengths,
            seed=stream_seed(ctx.seed, "model-init", FEATURE_MAP_INIT),
            device=ctx.device,
        )
