"""Two tiny, sound test methods for the shared run pipeline: a noisy class-means release (one Gaussian
mechanism, as the class-means plugin of docs/methods/authoring.md) sampled with balanced labels, and the
same release whose generator collapses every sample to class 0. Seconds on a few hundred 8x8 images."""

from __future__ import annotations

import math

import numpy as np
import torch

from dpsynth.contract import METHODS, Method, RunConfig, RunContext, Samples, register_method
from dpsynth.data.transforms import tensor_to_uint8
from dpsynth.privacy.bounded_sum import BoundedSum, release_bounded_sum
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.schema import Section

RELEASE = "test-means"


class MeansSection(Section):
    """No keys: the fake methods are configured by the run's privacy and data sections alone."""


class BalancedMeans(Method):
    name = "test-balanced-means"
    summary = "test only: noisy class means, balanced labels"
    config_schema = MeansSection

    def __init__(self) -> None:
        self.means: torch.Tensor | None = None

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        def release(sigma: float) -> object:
            return BoundedSum(RELEASE, 1.0, sigma, 1, count_weight=4.0).mechanism()

        return plan_calibrated(config.privacy, (), release)

    def fit(self, ctx: RunContext) -> None:
        saved = ctx.checkpoints.load(phase=RELEASE)
        if saved is not None:
            self.means = saved["means"]
            return
        images, labels = ctx.data.train.to_tensors()
        flat = images.flatten(1)
        sigma = ctx.plan.noise_multiplier(RELEASE)
        query = BoundedSum(RELEASE, math.sqrt(flat.shape[1]), sigma, ctx.num_classes, count_weight=4.0)
        released = release_bounded_sum([(flat, labels)], flat.shape[1], query, ctx.ledger, ctx.noise_source())
        self.means = released.means.clamp(-1, 1).reshape(ctx.num_classes, *ctx.image_shape)
        ctx.checkpoints.save({"means": self.means}, phase=RELEASE)

    def labels(self, num: int, num_classes: int) -> torch.Tensor:
        return torch.arange(num) % num_classes

    def generate(self, ctx: RunContext, num: int) -> Samples:
        if self.means is None:
            self.means = ctx.checkpoints.load(phase=RELEASE)["means"]
        labels = self.labels(num, ctx.num_classes)
        noise = torch.randn((num, *self.means.shape[1:]), generator=ctx.rng("sampling")) * 0.2
        images = tensor_to_uint8((self.means[labels] + noise).clamp(-1, 1))
        return Samples(images=images, labels=labels.numpy().astype(np.int64))


class CollapsedMeans(BalancedMeans):
    """A release collapsed to one label: every released sample carries class 0."""

    name = "test-collapsed-means"
    summary = "test only: noisy class means, every label 0"

    def labels(self, num: int, num_classes: int) -> torch.Tensor:
        return torch.zeros(num, dtype=torch.int64)


for method in (BalancedMeans, CollapsedMeans):
    if method.name not in METHODS:
        register_method(method)


def two_class_images(count: int = 240, side: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``count`` grey ``side`` x ``side`` uint8 images of two well-separated classes (dark, bright) and labels."""
    generator = np.random.default_rng(seed)
    labels = np.arange(count) % 2
    base = np.where(labels[:, None, None] == 1, 190, 60)
    images = np.clip(base + generator.integers(-40, 41, (count, side, side)), 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)
