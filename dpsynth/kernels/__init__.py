"""Kernel feature maps with a declared norm bound, and moment matching: the shared layers of the
kernel methods (DP-MERF, DP-NTK, DP-Kernel). The private release of their mean embeddings is
:mod:`dpsynth.privacy.bounded_sum`; this package holds what runs on public randomness and released
values only. See docs/architecture.md, "Kernel methods"."""

from dpsynth.kernels.feature_map import FeatureMap, class_feature_means, feature_chunks
from dpsynth.kernels.moment_matching import (
    MomentMatchingResult,
    MomentMatchingSettings,
    moment_matching_loss,
    train_moment_matching,
)
from dpsynth.kernels.ntk import NTKFeatures, fc_1l, fc_2l
from dpsynth.kernels.rff import (
    RandomFourierFeatures,
    bandwidth_ladder,
    median_heuristic,
    median_ladder,
    noise_images,
)

__all__ = [
    "FeatureMap",
    "MomentMatchingResult",
    "MomentMatchingSettings",
    "NTKFeatures",
    "RandomFourierFeatures",
    "bandwidth_ladder",
    "class_feature_means",
    "fc_1l",
    "fc_2l",
    "feature_chunks",
    "median_heuristic",
    "median_ladder",
    "moment_matching_loss",
    "noise_images",
    "train_moment_matching",
]
