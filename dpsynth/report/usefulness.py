"""How an accuracy is written for people: with its interval and test size, and what it means against the
majority class. The one place that formats them, for ``report.html`` and ``dpsynth evaluate --show``.

The figures come from ``metrics.json`` (:mod:`dpsynth.metrics.usefulness` computes them); they are
private diagnostics, so these lines belong in the custodian's report and in output the user asked for,
never in a log, the release report or the console by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: ``versus_majority`` → (tone of the report box, what it means); the values are metrics.usefulness's
VERDICTS = {
    "above": ("ok", "is better than always answering the majority class"),
    "within": ("note", "is not clearly better than always answering the majority class"),
    "at or below": ("warning", "is NO BETTER than always answering the majority class"),
}


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def format_accuracy(entry: Mapping[str, Any], digits: int = 1) -> str:
    """``68.5 ± 2.1 % (95 % interval 45.5–85.0 %, 18 test images)``: the mean, the seed std when there
    is a spread, and the interval and test size when the entry carries them; ``digits`` decimals."""
    mean, std = _number(entry.get("mean")), _number(entry.get("std"))
    if mean is None:
        return "—"
    text = f"{mean:.{digits}f} ± {std:.{digits}f} %" if std else f"{mean:.{digits}f} %"
    interval, size = entry.get("interval"), _number(entry.get("test_size"))
    bounds = [_number(v) for v in interval] if isinstance(interval, (list, tuple)) and len(interval) == 2 else []
    if size is not None and len(bounds) == 2 and None not in bounds:
        text += f" (95 % interval {bounds[0]:.{digits}f}–{bounds[1]:.{digits}f} %, {int(size)} test images)"
    return text


def _headline(accuracy: Any, baselines: Any) -> tuple[str, Mapping[str, Any], float] | None:
    """``(name, entry, majority rate)`` of the accuracy a run is judged by, or None without baselines."""
    if not isinstance(accuracy, Mapping) or not isinstance(baselines, Mapping):
        return None
    name, majority = baselines.get("headline"), _number(baselines.get("majority"))
    entry = accuracy.get(name) if isinstance(name, str) else None
    if not isinstance(entry, Mapping) or majority is None or entry.get("versus_majority") not in VERDICTS:
        return None
    return name, entry, majority


def headline_text(accuracy: Any, baselines: Any) -> str | None:
    """The headline accuracy in one cell: ``68.5 % (95 % interval ..., 18 test images); at or below the
    majority class (72.2 %)``, or None when ``metrics.json`` holds no baselines."""
    headline = _headline(accuracy, baselines)
    if headline is None:
        return None
    _, entry, majority = headline
    return f"{format_accuracy(entry)}; {entry['versus_majority']} the majority class ({majority:.1f} %)"


def _subject(name: str) -> str:
    """Who scored: ``the mean over the classifiers``, ``the cnn classifier``, ``the dpsgd-classifier``."""
    if name == "mean_of_models":
        return "the mean over the classifiers"
    return f"the {name}" if name.endswith("classifier") else f"the {name} classifier"


def verdict(accuracy: Any, baselines: Any) -> tuple[str, str] | None:
    """``(tone, sentence)`` on the run's headline accuracy against the majority class, or None when
    ``metrics.json`` holds no baselines (a run evaluated before they were recorded)."""
    headline = _headline(accuracy, baselines)
    if headline is None:
        return None
    name, entry, majority = headline
    tone, meaning = VERDICTS[entry["versus_majority"]]
    chance = _number(baselines.get("chance"))
    sentence = (
        f"The release {meaning}: {_subject(name)} scores {format_accuracy(entry)} on the private test split, "
        f"where always answering its majority class scores {majority:.1f} %"
        + (f" and guessing at random {chance:.1f} %." if chance is not None else ".")
    )
    return tone, sentence


INTERVAL_NOTE = (
    "95 % interval: Wilson score interval of the mean accuracy as a proportion of the test images; it "
    "covers the test-set sampling only, not the spread over classifier seeds (±) or over DP training runs."
)


def baseline_rows(baselines: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(what, accuracy)`` rows of the chance and majority-class rates, on the test size they were measured on,
    and of the DP-SGD classifier baseline when it was trained (``dpsynth evaluate --baseline``)."""
    size = _number(baselines.get("test_size"))
    on = f" of {int(size)} test images" if size is not None else ""
    rows = [
        (f"chance (1 / {baselines.get('num_classes', 'K')} classes)", baselines.get("chance")),
        (f"always answering the majority class{on}", baselines.get("majority")),
    ]
    formatted = [(what, "—" if _number(value) is None else f"{_number(value):.1f} %") for what, value in rows]
    dpsgd = baselines.get(DPSGD_KEY)
    if isinstance(dpsgd, Mapping) and _number(dpsgd.get("mean")) is not None:
        formatted.append((dpsgd_label(dpsgd), format_accuracy(dpsgd)))
    return formatted


#: ``accuracy_baselines`` key of the DP-SGD classifier baseline (dpsynth.eval.baseline.BASELINE_KEY)
DPSGD_KEY = "dpsgd_classifier"


def dpsgd_label(entry: Mapping[str, Any]) -> str:
    """``DP-SGD classifier on the private data at ε = 2 (a separate release; with this one ε = 2.9)``."""
    epsilon, combined = _number(entry.get("epsilon")), _number(entry.get("combined_epsilon"))
    at = f" at ε = {epsilon:.3g}" if epsilon is not None else ""
    together = f"; with this release, ε = {combined:.3g} in all" if combined is not None else ""
    return f"DP-SGD classifier trained on the private data{at} (a separate release{together})"


def versus_dpsgd(accuracy: Any, baselines: Any) -> str | None:
    """One sentence on the headline accuracy against the DP-SGD classifier baseline, or None without one."""
    headline = _headline(accuracy, baselines)
    dpsgd = baselines.get(DPSGD_KEY) if isinstance(baselines, Mapping) else None
    if headline is None or not isinstance(dpsgd, Mapping) or _number(dpsgd.get("mean")) is None:
        return None
    name, entry, _ = headline
    release, direct = float(entry["mean"]), float(dpsgd["mean"])
    low, high = (dpsgd.get("interval") or [direct, direct])[:2]
    if release < low:
        standing = "below it: training a classifier on the private data directly did better"
    elif release > high:
        standing = "above it"
    else:
        standing = "within its 95 % interval"
    return f"The {dpsgd_label(dpsgd)} scores {format_accuracy(dpsgd)}; {_subject(name)} on the release is {standing}."
