"""``dp-ntk``: a noisy empirical-NTK mean embedding, released once, and a generator fitted to it.

Paper: Yang, Adamczewski, Sutherland, Li, Park, "Differentially Private Neural Tangent Kernels (DP-NTK) for
Privacy-Preserving Data Generation", arXiv:2303.01687 (JAIR 81, 2024), §3.

* Feature map: ``phi(x) = g(x) / ||g(x)||`` with ``g(x)`` the gradient, with respect to every parameter of a
  small network frozen at a random initialisation (public seed), of the sum of its outputs; the paper's
  MNIST network ``fc_1l`` (Linear(d, 800) -> ReLU -> LayerNorm -> Linear(800, K)) or its CIFAR network
  ``fc_2l`` (widths 32, 256). Computed in closed form per layer (:class:`dpsynth.kernels.NTKFeatures`), not
  by per-example double backprop. Inputs enter the network in [0, 1] (dpsynth's [-1, 1] pixels mapped by
  ``(x + 1) / 2``), the paper's pixel range: unlike a Gaussian kernel the e-NTK is not shift-invariant.
* Release and generator training: :mod:`dpsynth.methods.families.mean_embedding`, over **every** private training record
  (DPImageBench's code embeds only the first minibatch of 5,000 / 2,500 images).

Adjacency: add/remove one record. DPImageBench's code halves its RDP σ (sensitivity 1/n) while its README
states 2/n; here the released vector is the class-wise feature *sums* (sensitivity 1, ``sqrt(1 + w^2)``
with the jointly released counts), one ``Gaussian("ntk-embedding", sigma)`` with σ calibrated for the run.
"""

from __future__ import annotations

from typing import Literal

import pydantic
import torch
from pydantic import Field

from dpsynth.contract import RunContext, register_method
from dpsynth.kernels.feature_map import FeatureMap
from dpsynth.kernels.ntk import NTKFeatures, fc_1l, fc_2l
from dpsynth.methods.families.mean_embedding import FEATURE_MAP_INIT, MeanEmbeddingMethod, MeanEmbeddingSection
from dpsynth.seeding import stream_seed

MECHANISM = "ntk-embedding"


class DPNTKConfig(MeanEmbeddingSection):
    """The ``dp-ntk`` section: the e-NTK network, plus the shared release and generator keys
    (:class:`dpsynth.methods.families.mean_embedding.MeanEmbeddingSection`)."""

    network: Literal["fc_1l", "fc_2l"] = Field(
        "fc_1l", description="fc_1l: Linear-ReLU-LayerNorm-Linear (paper's MNIST) | fc_2l: two hidden layers (CIFAR)"
    )
    widths: list[int] = Field(
        [800],
        min_length=1,
        max_length=2,
        description="hidden widths: one for fc_1l (paper 800), two for fc_2l (32, 256)",
    )
    release_batch_size: int = Field(
        32, ge=1, description="private records per feature chunk of the release (each row has #params entries)"
    )

    @pydantic.model_validator(mode="after")
    def _widths_fit_the_network(self) -> DPNTKConfig:
        expected = 1 if self.network == "fc_1l" else 2
        if len(self.widths) != expected or not all(width >= 1 for width in self.widths):
            raise ValueError(f"network {self.network} needs {expected} hidden width(s) >= 1, got {self.widths}")
        return self


class UnitRangeInputs(FeatureMap):
    """``inner`` applied to ``(x + 1) / 2``: [-1, 1] pixels enter the feature map in [0, 1]."""

    def __init__(self, inner: FeatureMap) -> None:
        self.inner, self.dim, self.bound = inner, inner.dim, inner.bound

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.inner.features((inputs + 1) / 2)

    def class_sums(self, inputs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        return self.inner.class_sums((inputs + 1) / 2, labels, num_classes)


@register_method
class DPNTK(MeanEmbeddingMethod):
    name = "dp-ntk"
    summary = (
        "normalised empirical-NTK mean embedding of a fixed random network released once with Gaussian noise, "
        "then a generator fitted to it by moment matching"
    )
    paper = (
        "Yang, Adamczewski, Sutherland, Li, Park, Differentially Private Neural Tangent Kernels (DP-NTK) for "
        "Privacy-Preserving Data Generation, arXiv:2303.01687 (JAIR 2024)"
    )
    config_schema = DPNTKConfig
    mechanism_name = MECHANISM
    privacy_notes = (
        (
            "dp-ntk: add/remove adjacency. One Gaussian release 'ntk-embedding' of the class-wise SUMS of unit-norm "
            "e-NTK features over every private training record (L2 sensitivity 1; sqrt(1 + w^2) with the class counts "
            "released jointly with weight w), divided by those noisy counts or by the declared public N/K. "
            "DPImageBench's code embeds only its first minibatch and halves its sigma while its README states 2/n."
        ),
        (
            "dp-ntk: the release's sigma is calibrated for the whole run, with every mechanism spent before it. The "
            "noise comes from the run's noise source, once; the clean embedding is never stored (the original code "
            "adds noise in place for several epsilons in turn and saves the clean embedding)."
        ),
    )

    def feature_map(self, ctx: RunContext) -> FeatureMap:
        section = ctx.section
        channels, height, width = ctx.image_shape
        seed = stream_seed(ctx.seed, "model-init", FEATURE_MAP_INIT)
        size = channels * height * width
        if section.network == "fc_1l":
            network = fc_1l(size, ctx.num_classes, width=section.widths[0], seed=seed)
        else:
            network = fc_2l(size, ctx.num_classes, widths=(section.widths[0], section.widths[1]), seed=seed)
        features = NTKFeatures(network.to(ctx.device))
        ctx.log(f"dp-ntk: {section.network} e-NTK features of {features.dim} parameters")
        return UnitRangeInputs(features)
