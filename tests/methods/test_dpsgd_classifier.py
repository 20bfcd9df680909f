"""The DP-SGD classifier baseline: the common method contract, and its released model restored in a later process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dpsynth.contract import RELEASED_PHASE
from dpsynth.methods.dpsgd_classifier import DPSGDClassifier
from dpsynth.testing import MethodContractTests

REPO = Path(__file__).resolve().parents[2]


class TestDPSGDClassifierContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dpsgd-classifier/smoke`` preset."""

    method = "dpsgd-classifier"


def test_a_reopened_run_scores_with_the_released_weights(tmp_path, monkeypatch):
    """The released state is the weights alone; a later process (evaluate, audit) rebuilds the network from
    the config and gets the fitted classifier: the same weights and the same per-example losses."""
    from dpsynth.context import open_run
    from dpsynth.runner import run_config

    seen: dict = {}
    original_fit = DPSGDClassifier.fit

    def spying_fit(self, ctx):
        seen.update(method=self, ctx=ctx)
        return original_fit(self, ctx)

    monkeypatch.setattr(DPSGDClassifier, "fit", spying_fit)
    out = run_config(REPO / "dpsynth" / "presets" / "dpsgd-classifier" / "smoke.yaml", out=tmp_path / "run", echo=False)
    fitted = seen["method"]
    assert set(seen["ctx"].checkpoints.load(phase=RELEASED_PHASE)) == {"model"}
    ctx, method = open_run(out, echo=False)
    assert method is not fitted and method.test_accuracy is None
    weights = method.model.state_dict()
    assert all(torch.equal(value.cpu(), weights[key]) for key, value in fitted.model.state_dict().items())
    images, labels = ctx.data.test.images[:32], ctx.data.test.labels[:32]  # uint8 [N, H, W, C]
    assert np.allclose(
        method.example_losses(ctx, images, labels), fitted.example_losses(ctx, images, labels), atol=1e-6
    )
    metrics = method.released_metrics(ctx)["accuracy"]["dpsgd-classifier"]
    assert metrics["mean"] == 100.0 * fitted.test_accuracy  # recomputed from the restored weights
