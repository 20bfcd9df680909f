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

from dpsynth.contract import RunConfig, RunContext, register_method
from dpsynth.kernels.bandwidths import RandomFeatureSection
from dpsynth.kernels.feature_map import FeatureMap
from dpsynth.methods.families.mean_embedding import MeanEmbeddingMethod, MeanEmbeddingSection, random_fourier_map

MECHANISM = "rff-embedding"


class DPMerfConfig(MeanEmbeddingSection, RandomFeatureSection):
    """The ``dp-merf`` section: the random features and their public bandwidth rule
    (:class:`dpsynth.kernels.bandwidths.RandomFeatureSection`), plus the shared release and generator keys
    (:class:`dpsynth.methods.families.mean_embedding.MeanEmbeddingSection`)."""


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
        return config.section.public_use()

    def feature_map(self, ctx: RunContext) -> FeatureMap:
        return random_fourier_map(ctx, self.name)
