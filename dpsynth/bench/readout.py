"""Reading a finished run's own outputs: the numbers a bench cell reports, never recomputed.

``privacy.json`` gives the spent ε; ``diagnostics/metrics.json`` the run's own evaluation (accuracy
in percent, FID); ``diagnostics/audit.json`` the canary audit of ``dpsynth evaluate RUN --metrics
canary``. Every figure but ε reads private data without noise: a private diagnostic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpsynth.errors import DataError
from dpsynth.rundir import AUDIT_FILE, DIAGNOSTICS_DIR, METRICS_FILE, PRIVACY_FILE


def read_run_outputs(run_dir: Path) -> dict[str, Any]:
    """The privacy record and the run's own evaluation figures."""
    privacy = _read_json(run_dir / PRIVACY_FILE)
    metrics = _read_json(run_dir / DIAGNOSTICS_DIR / METRICS_FILE)
    return {
        "epsilon_target": privacy.get("target_epsilon"),
        "epsilon_spent": privacy.get("epsilon"),
        "delta": privacy.get("delta"),
        "guarantee": privacy.get("guarantee", "dp"),
        "accuracy": headline_accuracy(metrics.get("accuracy")),
        "fid": metrics.get("fid"),
        "evaluation": metrics.get("meta"),
    }


def headline_accuracy(accuracy: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's headline accuracy: ``mean_of_models`` when it trained several classifiers, else its one model.

    Returns ``{"model", "mean", "std", "runs"}`` (``runs``: the per-seed accuracies when reported)."""
    if not accuracy:
        return None
    if "mean_of_models" in accuracy:
        model, entry = "mean_of_models", accuracy["mean_of_models"]
    else:
        models = [name for name, value in accuracy.items() if isinstance(value, dict) and "mean" in value]
        if len(models) != 1:
            raise DataError(f"{METRICS_FILE}: cannot tell the headline accuracy among {models}")
        model, entry = models[0], accuracy[models[0]]
    return {"model": model, "mean": float(entry["mean"]), "std": float(entry["std"]), "runs": entry.get("runs")}


def read_canary(run_dir: Path) -> dict[str, Any]:
    """The canary audit's ε lower bound and its interval, or ``{"skipped": reason}``."""
    audit = _read_json(run_dir / DIAGNOSTICS_DIR / AUDIT_FILE)
    canary = audit.get("canary")
    if canary is None:
        return {"skipped": audit.get("skipped", {}).get("canary", f"no canary result in {AUDIT_FILE}")}
    keys = (
        "epsilon_lower_bound",
        "epsilon_interval",
        "confidence",
        "num_guesses",
        "num_correct",
        "num_canaries",
        "claimed_epsilon",
        "steps",
    )
    return {key: canary.get(key) for key in keys}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(f"{path} is missing: the run did not write it")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise DataError(f"{path}: not readable JSON") from None
