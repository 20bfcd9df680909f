"""How far a downstream accuracy can be trusted: its test-set size, a 95 % interval, chance and majority.

An accuracy measured on 18 test images says little on its own: 68.5 % there is compatible with anything
from about 45 % to 85 %, and a release that trains classifiers below the rate of always answering
the majority class is no use at all, whatever its mean. So every accuracy entry in ``metrics.json``
carries (docs/evaluation.md, "How far to trust an accuracy"):

* ``test_size``: the number n of test images it was measured on;
* ``interval``: the 95 % Wilson score interval of the entry's mean accuracy p̂ taken as a proportion of
  n images, in percent. Wilson rather than Clopper–Pearson because the mean over classifier seeds is
  not a whole number of correct images, and Wilson's interval is defined for any p̂ in [0, 1] (it is
  also closer to nominal coverage than the conservative exact interval). It measures the test-set
  sampling error only: not the spread over classifier seeds (the ``std``) nor the randomness of the
  DP training, which a second run would show;
* ``versus_majority``: ``"above"`` when the interval's lower end lies above the majority-class rate,
  ``"within"`` when the mean is above that rate but the interval reaches down to it (not
  distinguishable on n images), ``"at or below"`` when the mean itself is no better.

and ``metrics.json["accuracy_baselines"]`` holds ``test_size``, ``num_classes``, ``chance`` (100 / K),
``majority`` (the share of the test split's most common class, in percent) and ``headline`` (the entry
the run is judged by).

All of it is computed on the private test split without noise: a private diagnostic, for
``diagnostics/metrics.json`` and the custodian's ``report.html`` only, never the console or the release.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

CONFIDENCE = 0.95
Z_95 = 1.959963984540054  # the standard normal's 97.5 % quantile: a two-sided 95 % interval
INTERVAL_METHOD = "Wilson score, 95 %, of the mean accuracy as a proportion of the test images"
#: versus_majority values, from best to worst
ABOVE, WITHIN, AT_OR_BELOW = "above", "within", "at or below"


def wilson_interval(proportion: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion in [0, 1] observed on ``n`` trials, as ``(low, high)``.

    ``(p̂ + z²/2n ± z·sqrt(p̂(1 − p̂)/n + z²/4n²)) / (1 + z²/n)``; it stays inside [0, 1] and is not
    empty at p̂ = 0 or 1, unlike the normal approximation.
    """
    if n < 1:
        raise ValueError(f"an interval needs at least one trial, got n={n}")
    if not 0.0 <= proportion <= 1.0:
        raise ValueError(f"a proportion lies in [0, 1], got {proportion}")
    z2 = z * z
    centre = proportion + z2 / (2 * n)
    spread = z * math.sqrt(proportion * (1 - proportion) / n + z2 / (4 * n * n))
    scale = 1 + z2 / n
    # the interval always holds p̂ (exactly 0 or 1 at the ends); min/max only absorb float rounding
    low, high = (centre - spread) / scale, (centre + spread) / scale
    return max(0.0, min(proportion, low)), min(1.0, max(proportion, high))


def baselines(test_labels: np.ndarray, num_classes: int) -> dict[str, Any]:
    """``test_size``, ``num_classes``, ``chance`` and ``majority`` (both in percent) of a test split."""
    labels = np.asarray(test_labels, dtype=np.int64)
    if not len(labels):
        raise ValueError("accuracy baselines need a non-empty test split")
    counts = np.bincount(labels, minlength=num_classes)
    return {
        "test_size": int(len(labels)),
        "num_classes": int(num_classes),
        "chance": 100.0 / num_classes,
        "majority": 100.0 * float(counts.max()) / len(labels),
        "interval_method": INTERVAL_METHOD,
    }


def versus_majority(mean: float, interval: tuple[float, float], majority: float) -> str:
    """Where an accuracy stands against the majority-class rate (all in percent): above, within, at or below."""
    if mean <= majority:
        return AT_OR_BELOW
    return ABOVE if interval[0] > majority else WITHIN


def with_interval(entry: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """An accuracy entry (``{"mean", ...}`` in percent) with its test size, interval and majority verdict."""
    n = int(base["test_size"])
    low, high = wilson_interval(min(1.0, max(0.0, float(entry["mean"]) / 100.0)), n)
    interval = (100.0 * low, 100.0 * high)
    return {
        **entry,
        "test_size": n,
        "interval": list(interval),
        "versus_majority": versus_majority(float(entry["mean"]), interval, float(base["majority"])),
    }


def annotate_accuracy(
    accuracy: Mapping[str, Any], test_labels: np.ndarray, num_classes: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(accuracy with every entry annotated, baselines)`` for ``metrics.json["accuracy"]`` measured on
    the test split whose labels are ``test_labels`` (:func:`with_interval`, :func:`baselines`).

    The baselines name the ``headline`` entry, the one a run is judged by: ``mean_of_models`` when
    several classifiers were trained, else the one classifier (the first, should there be several
    without their mean).
    """
    base = baselines(test_labels, num_classes)
    annotated = {name: with_interval(entry, base) if _is_entry(entry) else entry for name, entry in accuracy.items()}
    names = [name for name, entry in annotated.items() if _is_entry(entry)]
    base["headline"] = "mean_of_models" if "mean_of_models" in names else next(iter(names), None)
    return annotated, base


def _is_entry(entry: Any) -> bool:
    return isinstance(entry, Mapping) and "mean" in entry
