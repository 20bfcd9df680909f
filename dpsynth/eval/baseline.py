"""The DP-SGD classifier baseline of a run: what training a classifier directly on the private data at the
same (ε, δ) achieves, beside what the release's classifiers achieve.

Training it reads the private train split again, so it is a private mechanism of its own. dpsynth makes it
**a separate release**: its own run directory, ``RUN/baseline-dpsgd`` (method ``dpsgd-classifier``, the run's
``data`` section, so the same record-wise splits, and the run's ε, δ and accountant), with its own ledger and
``privacy.json``. The synthetic release keeps the guarantee it states; whoever holds both the release and the
baseline's results holds the composition of both, whose ε (one accountant over every mechanism of the two
ledgers, at the run's δ) is recorded beside the figure as ``combined_epsilon``. Charging it to the run's own
ledger instead would push a finished run past its target ε, which its ledger refuses; a separate release
states both guarantees truthfully.

The baseline's test accuracy (on the run's test split, with its 95 % interval) is a private diagnostic like
every other accuracy: it goes to ``metrics.json["accuracy_baselines"]["dpsgd_classifier"]`` and the
custodian's report, never the console (docs/evaluation.md, "The DP-SGD classifier baseline").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpsynth.config import BASELINE_METHOD
from dpsynth.errors import ConfigError
from dpsynth.rundir import DIAGNOSTICS_DIR, METRICS_FILE, PRIVACY_FILE
from dpsynth.sections import RunConfig

#: the baseline's run directory, inside the run it is the baseline of
BASELINE_DIR = "baseline-dpsgd"
BASELINE_KEY = "dpsgd_classifier"
#: what the entry says about its privacy, for whoever reads metrics.json
SEPARATE_RELEASE = (
    f"a separate release (its own run directory and {PRIVACY_FILE}) at the run's epsilon and delta; "
    "the release and the baseline together: combined_epsilon"
)


def baseline_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / BASELINE_DIR


#: the baseline's largest sample rate when its batch size is not set: B = min(the section's default, N / 10),
#: so a few hundred private images still give a plan (the default B = 256 would exceed N, q > 1); N is
#: public by the stated assumption, so a batch derived from it leaks nothing
BASELINE_MAX_SAMPLE_RATE = 0.1


def baseline_config(
    run_config: RunConfig, num_examples: int, overrides: Mapping[str, Any] | list[str] | None = None
) -> RunConfig:
    """The ``dpsgd-classifier`` config at the run's data section, privacy budget, device and seed, with the
    run's ``evaluate.dpsgd_baseline_settings`` and then ``overrides`` (dotted keys,
    ``{"dpsgd-classifier.steps": 50}`` or ``--set`` strings) checked as any config's are;
    unless set, the batch size follows :data:`BASELINE_MAX_SAMPLE_RATE` on ``num_examples``."""
    from dpsynth.config import deep_merge, overrides_to_tree, resolve_config

    run = run_config.to_dict()
    privacy = {key: run["privacy"][key] for key in ("epsilon", "delta", "accountant", "secure_rng")}
    raw = {
        "method": BASELINE_METHOD,
        "name": f"{run_config.name or run_config.method}-{BASELINE_DIR}",
        "data": run["data"],
        "privacy": privacy,
        "device": run["device"],
        "seed": run["seed"],
    }
    configured = {BASELINE_METHOD: dict(run_config.evaluate.dpsgd_baseline_settings)}
    tree = deep_merge(configured, overrides_to_tree(dict(overrides) if isinstance(overrides, Mapping) else overrides))
    config = resolve_config(deep_merge(raw, tree))
    if "batch_size" in tree.get(BASELINE_METHOD, {}):
        return config
    section = config.section
    batch = max(1, min(section.batch_size, int(num_examples * BASELINE_MAX_SAMPLE_RATE)))
    scaled = {"batch_size": batch, "physical_batch_size": min(section.physical_batch_size, batch)}
    return resolve_config(deep_merge(config.to_dict(), {BASELINE_METHOD: scaled}))


def check_can_train(run_dir: Path, run_config: RunConfig) -> None:
    """Refuse a baseline for a run that claims no ε (it would have no 'same ε' to train at) or that
    released a classifier itself (:func:`dpsynth.config.baseline_refusal`)."""
    from dpsynth.config import baseline_refusal

    refusal = baseline_refusal(run_config)
    if refusal is not None:
        raise ConfigError(f"{run_dir}: {refusal}")


def finished(run_dir: str | Path) -> bool:
    """Whether the baseline of ``run_dir`` was trained to the end (its accuracy is recorded)."""
    return baseline_entry(run_dir) is not None


def baseline_entry(run_dir: str | Path) -> dict[str, Any] | None:
    """``metrics.json["accuracy_baselines"]["dpsgd_classifier"]`` for ``run_dir``: the baseline's accuracy
    entry (mean, test size, interval, verdict), its ε and δ, where it lives, and the combined ε; None when
    no baseline was trained."""
    where = baseline_dir(run_dir)
    metrics = _read(where / DIAGNOSTICS_DIR / METRICS_FILE)
    privacy = _read(where / PRIVACY_FILE)
    accuracy = metrics.get("accuracy", {}).get(BASELINE_METHOD) if metrics else None
    if not isinstance(accuracy, Mapping) or not privacy:
        return None
    return {
        **accuracy,
        "epsilon": privacy.get("epsilon"),
        "delta": privacy.get("delta"),
        "run_dir": str(where),
        "privacy": SEPARATE_RELEASE,
        "combined_epsilon": combined_epsilon(_read(Path(run_dir) / PRIVACY_FILE), privacy),
    }


def combined_epsilon(first: Mapping[str, Any], second: Mapping[str, Any]) -> float | None:
    """ε at the first record's δ of every mechanism of two ``privacy.json`` records composed (the run's
    accountant); None when either claims no guarantee or cannot be read."""
    from dpsynth.privacy import compute_epsilon
    from dpsynth.privacy.mechanisms import mechanism_from_dict

    if not first or not second or "dp" != first.get("guarantee") or "dp" != second.get("guarantee"):
        return None
    mechanisms = [mechanism_from_dict(m) for record in (first, second) for m in record.get("mechanisms", [])]
    return compute_epsilon(mechanisms, float(first["delta"]), str(first.get("accountant", "prv")))


def _read(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
