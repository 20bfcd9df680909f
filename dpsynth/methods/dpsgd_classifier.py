"""``dpsgd-classifier``: a classifier trained with DP-SGD directly on the private data.

The "non-synthetic" baseline row of the seed papers' tables (e.g. Ghalebikesabi et al.,
"Differentially Private Diffusion Models Generate Useful Synthetic Images", arXiv:2302.13861,
Table 1). It releases a model, not samples: the classifier family's skeleton
(:class:`dpsynth.methods.families.classifier.ClassifierMethod`, shared with DP-ImgSyn's teacher) as it is,
plus the released model's test metrics.
"""

from __future__ import annotations

from typing import Any

from dpsynth.contract import RunContext, Samples, register_method
from dpsynth.errors import DPSynthError
from dpsynth.methods.families.classifier import ClassifierMethod, ClassifierSection, accuracy


@register_method
class DPSGDClassifier(ClassifierMethod):
    name = "dpsgd-classifier"
    summary = "baseline: a classifier trained with DP-SGD on the private data (releases a model, no samples)"
    paper = "Abadi et al., Deep Learning with Differential Privacy, arXiv:1607.00133"
    config_schema = ClassifierSection
    releases = "model"

    def released_metrics(self, ctx: RunContext) -> dict[str, Any]:
        """Metrics of the released model on the real test split (public evaluation)."""
        if self.test_accuracy is None:  # a later process: the released state holds the weights only
            self.test_accuracy = accuracy(self.model, ctx.data.test)
        # in percent, as every accuracy in metrics.json (docs/evaluation.md)
        return {"accuracy": {"dpsgd-classifier": {"mean": 100.0 * self.test_accuracy, "std": 0.0, "seeds": 1}}}

    def generate(self, ctx: RunContext, num: int) -> Samples:
        raise DPSynthError("dpsgd-classifier releases a classifier, not samples")
