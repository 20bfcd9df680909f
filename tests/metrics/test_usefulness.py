"""An accuracy's interval, test size and majority verdict (docs/evaluation.md, "How far to trust an accuracy")."""

import math

import numpy as np
import pytest

from dpsynth.metrics.usefulness import (
    ABOVE,
    AT_OR_BELOW,
    WITHIN,
    annotate_accuracy,
    baselines,
    versus_majority,
    wilson_interval,
)


@pytest.mark.parametrize(
    "proportion, n, expected",
    [
        (0.5, 100, (0.40383, 0.59617)),  # textbook value
        (0.0, 10, (0.0, 0.27753)),  # upper end z² / (n + z²): not empty at p̂ = 0, unlike the normal interval
        (1.0, 10, (0.72247, 1.0)),
        (0.685, 18, (0.45496, 0.84997)),  # the faces: 68.5 % on 18 test images
    ],
)
def test_wilson_interval_matches_the_closed_form(proportion, n, expected):
    low, high = wilson_interval(proportion, n)
    assert low == pytest.approx(expected[0], abs=1e-5) and high == pytest.approx(expected[1], abs=1e-5)


def test_wilson_interval_holds_the_estimate_is_symmetric_and_narrows_with_n():
    for proportion in (0.0, 0.1, 0.37, 0.5, 0.9, 1.0):
        low, high = wilson_interval(proportion, 50)
        mirror_low, mirror_high = wilson_interval(1 - proportion, 50)
        assert 0 <= low <= proportion <= high <= 1
        assert low == pytest.approx(1 - mirror_high) and high == pytest.approx(1 - mirror_low)
    widths = [high - low for low, high in (wilson_interval(0.7, n) for n in (18, 180, 1800))]
    assert widths[0] > widths[1] > widths[2] > 0


def test_wilson_interval_covers_about_95_percent_of_binomial_draws():
    """Coverage over every outcome of Binomial(n, p), weighted by its probability (exact, no sampling)."""
    n = 40
    outcomes = np.arange(n + 1)
    for p in (0.3, 0.7):
        pmf = np.array([math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in outcomes])
        covered = [low <= p <= high for low, high in (wilson_interval(k / n, n) for k in outcomes)]
        assert 0.92 < float(pmf[covered].sum()) < 0.99


def test_wilson_interval_refuses_no_trials_or_a_proportion_outside_zero_one():
    with pytest.raises(ValueError):
        wilson_interval(0.5, 0)
    with pytest.raises(ValueError):
        wilson_interval(1.2, 10)


def test_baselines_are_the_test_splits_size_chance_and_majority_rates():
    base = baselines(np.array([0, 0, 0, 1, 1, 2, 0, 0]), num_classes=4)
    assert base["test_size"] == 8 and base["num_classes"] == 4
    assert base["chance"] == 25.0 and base["majority"] == 62.5


@pytest.mark.parametrize(
    "mean, interval, verdict",
    [(68.5, (45.5, 85.0), AT_OR_BELOW), (80.0, (58.0, 92.0), WITHIN), (95.0, (91.0, 97.0), ABOVE)],
)
def test_versus_majority_says_below_within_or_above(mean, interval, verdict):
    assert versus_majority(mean, interval, majority=72.2) == verdict


def test_annotate_accuracy_adds_size_interval_and_verdict_to_every_entry_and_names_the_headline():
    labels = np.array([0] * 13 + [1] * 5)  # 18 test images, majority 72.2 %
    accuracy = {
        "cnn": {"mean": 68.5, "std": 1.0, "runs": [67.5, 69.5], "epochs": [3, 4]},
        "mlp": {"mean": 95.0, "std": 0.0, "runs": [95.0], "epochs": [2]},
        "mean_of_models": {"mean": 81.75, "std": 13.25},
    }
    annotated, base = annotate_accuracy(accuracy, labels, num_classes=2)
    assert base["majority"] == pytest.approx(100 * 13 / 18) and base["headline"] == "mean_of_models"
    assert annotated["cnn"]["runs"] == [67.5, 69.5] and annotated["cnn"]["epochs"] == [3, 4]  # kept
    assert annotated["cnn"]["test_size"] == 18 and annotated["cnn"]["versus_majority"] == AT_OR_BELOW
    assert annotated["cnn"]["interval"] == pytest.approx([45.496, 84.997], abs=1e-3)
    assert annotated["mean_of_models"]["versus_majority"] == WITHIN
    assert annotate_accuracy({"cnn": accuracy["cnn"]}, labels, 2)[1]["headline"] == "cnn"
