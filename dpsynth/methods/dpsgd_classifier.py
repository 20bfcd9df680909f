"""``dpsgd-classifier``: a classifier trained with DP-SGD directly on the private data.

The "non-synthetic" baseline row of the seed papers' tables (e.g. Ghalebikesabi et al.,
"Differentially Private Diffusion Models Generate Useful Synthetic Images", arXiv:2302.13861,
Table 1). It releases a model, not samples. The training itself lives in
:mod:`dpsynth.methods.families.classifier`, shared with DP-ImgSyn's teacher.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpsynth.contract import Method, PrivateNetwork, RunConfig, RunContext, Samples, register_method
from dpsynth.errors import DPSynthError
from dpsynth.methods.families.classifier import (
    ClassifierSection,
    accuracy,
    build_section_classifier,
    classifier_network,
    example_losses,
    train_dp_classifier,
)
from dpsynth.privacy.plan import PrivacyPlan, plan_with_dpsgd

MECHANISM = "dpsgd"
FINAL_PHASE = "final"


@register_method
class DPSGDClassifier(Method):
    name = "dpsgd-classifier"
    summary = "baseline: a classifier trained with DP-SGD on the private data (releases a model, no samples)"
    paper = "Abadi et al., Deep Learning with Differential Privacy, arXiv:1607.00133"
    config_schema = ClassifierSection
    releases = "model"

    def __init__(self) -> None:
        self.model: Any = None
        self.test_accuracy: float | None = None

    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """One DP-SGD mechanism: ``steps`` (or ``epochs·N/B``) steps at q = B/N."""
        settings = config.section.private_training()
        return plan_with_dpsgd(
            config.privacy,
            (),
            name=MECHANISM,
            sample_rate=settings.batch_size / num_examples,
            steps=settings.total_steps(num_examples),
            noise_multiplier=settings.noise_multiplier,
        )

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        return [classifier_network(self.name, config.section, config.data)]

    def fit(self, ctx: RunContext) -> None:
        self.model = train_dp_classifier(ctx, ctx.section, mechanism=MECHANISM)
        ctx.checkpoints.save({"model": self.model.state_dict()}, phase=FINAL_PHASE)
        self.test_accuracy = accuracy(self.model, ctx.data.test)
        ctx.log(f"test accuracy of the DP-SGD classifier: {100 * self.test_accuracy:.2f} %", private=True)

    def _released_model(self, ctx: RunContext) -> Any:
        if self.model is None:
            self.model = build_section_classifier(ctx, ctx.section)
            self.model.load_state_dict(ctx.checkpoints.load(phase=FINAL_PHASE)["model"])
        return self.model

    def example_losses(self, ctx: RunContext, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Per-example losses of the released classifier (docs/audit.md)."""
        return example_losses(self._released_model(ctx), images, labels, ctx.device)

    def released_metrics(self, ctx: RunContext) -> dict[str, Any]:
        """Metrics of the released model on the real test split (public evaluation)."""
        if self.test_accuracy is None:
            self.test_accuracy = accuracy(self._released_model(ctx), ctx.data.test)
        # in percent, as every accuracy in metrics.json (docs/evaluation.md)
        return {"accuracy": {"dpsgd-classifier": {"mean": 100.0 * self.test_accuracy, "std": 0.0, "seeds": 1}}}

    def generate(self, ctx: RunContext, num: int) -> Samples:
        raise DPSynthError("dpsgd-classifier releases a classifier, not samples")
