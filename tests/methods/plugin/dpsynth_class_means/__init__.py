"""``class-means``: the smallest real dpsynth method, shipped outside the package (docs/methods/authoring.md).

One private mechanism: the per-class sums of the private images (each clipped to the L2 norm of the
largest possible image, so nothing is scaled in practice) and the per-class counts, released together
with Gaussian noise once (:mod:`dpsynth.privacy.bounded_sum`, add/remove adjacency). Its σ is calibrated
so the release alone meets the run's target. The release is the noisy class means; a sample of class
``c`` is that mean plus Gaussian pixel noise of a public, configured scale: post-processing, no privacy
cost. A weak synthesizer, but a sound one, and it shows every piece a method has.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from dpsynth.contract import Method, RunConfig, RunContext, Samples
from dpsynth.data.transforms import tensor_to_uint8
from dpsynth.errors import PrivacyError
from dpsynth.privacy.bounded_sum import BoundedSum, release_bounded_sum
from dpsynth.privacy.plan import PrivacyPlan, plan_calibrated
from dpsynth.schema import Section

RELEASE = "class-means"


class ClassMeansConfig(Section):
    """The ``class-means`` section."""

    count_weight: float = Field(4.0, gt=0, description="w: each record adds w to its class count (joint release)")
    pixel_noise: float = Field(0.3, ge=0, description="std of the public Gaussian noise around a mean, per pixel")
    noise_multiplier: float | None = Field(None, gt=0, description="sigma of the release; null: calibrated")


class ClassMeans(Method):
    name = "class-means"
    summary = "noisy per-class mean images (one Gaussian release), sampled with public pixel noise"
    paper = "Dwork & Roth, The Algorithmic Foundations of Differential Privacy, 2014 (the Gaussian mechanism)"
    config_schema = ClassMeansConfig
    presets_dir = Path(__file__).parent / "presets"

    def __init__(self) -> None:
        self.means: torch.Tensor | None = None

    def query(self, config: RunConfig, num_classes: int, sigma: float, pixels: int) -> BoundedSum:
        """The declared release: every image has L2 norm at most sqrt(pixels) in [-1, 1]."""
        return BoundedSum(RELEASE, math.sqrt(pixels), sigma, num_classes, count_weight=config.section.count_weight)

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        def release(sigma: float) -> object:  # the mechanism alone: its ε does not depend on K or the image size
            return BoundedSum(RELEASE, 1.0, sigma, 1, count_weight=config.section.count_weight).mechanism()

        return plan_calibrated(config.privacy, (), release, noise_multiplier=config.section.noise_multiplier)

    def fit(self, ctx: RunContext) -> None:
        done, saved = ctx.resume(RELEASE, phase=RELEASE)  # a resumed run never releases twice
        if saved is None and done:
            raise PrivacyError("class-means: the release was charged but its result was lost; start a new run")
        if saved is None:
            images, labels = ctx.data.train.to_tensors()
            flat = images.flatten(1)
            query = self.query(ctx.config, ctx.num_classes, ctx.plan.noise_multiplier(RELEASE), flat.shape[1])
            released = release_bounded_sum([(flat, labels)], flat.shape[1], query, ctx.ledger, ctx.noise_source())
            means = released.means.clamp(-1, 1).reshape(ctx.num_classes, *ctx.image_shape)
            saved = {"step": 1, "means": means}
            ctx.checkpoints.save(saved, phase=RELEASE)
        self.means = saved["means"]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"means": self.means}  # what generate reads; the runner checkpoints and restores it

    def load_state_dict(self, state: dict[str, torch.Tensor], ctx: RunContext) -> None:
        self.means = state["means"]

    def generate(self, ctx: RunContext, num: int) -> Samples:
        generator = ctx.rng("sampling")
        labels = torch.arange(num) % len(self.means)
        noise = torch.randn((num, *self.means.shape[1:]), generator=generator) * ctx.section.pixel_noise
        images = tensor_to_uint8((self.means[labels] + noise).clamp(-1, 1))
        return Samples(images=images, labels=labels.numpy().astype(np.int64))
