"""Privacy audit of a finished run: membership inference and a canary audit (docs/audit.md).

Reached through ``dpsynth evaluate RUN --metrics audit,canary``. The pieces live by concern:

* :mod:`dpsynth.metrics.membership`: the membership-inference attacks on the run's released samples
  (and its released model, when the method has the ``example_losses`` hook), with ROC AUC and the
  TPR at a 10 % FPR and their Clopper–Pearson intervals;
* :mod:`dpsynth.metrics.canary`: the one-run canary audit (Steinke, Nasr & Jagielski, 2023), an
  **empirical lower bound** on ε at a stated confidence, never a proof of privacy or of its absence;
* :mod:`dpsynth.metrics.audit_stats`: the exact binomial statistics both rely on.

The audit reads private data but is not itself a ledger mechanism: its figures are for the data
custodian who runs it and are not differentially private. They must not be released alongside
the synthetic data as if they were covered by the run's guarantee.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.errors import DataError
from dpsynth.metrics.canary import canary_audit
from dpsynth.metrics.membership import DEFAULT_FPR, loss_attack, nearest_neighbour_attack
from dpsynth.rundir import AUDIT_FILE, PRIVACY_FILE, SAMPLES_FILE

NOTE = (
    "audit figures read private data and are not differentially private; the canary figure is an "
    "empirical lower bound on epsilon, not a proof"
)

CANARY_MAX_STEPS = 300


def audit_run(
    run_dir: Any,
    *,
    membership: bool = True,
    canary: bool = False,
    run_canary: bool = False,
    max_examples: int = 1000,
    fpr: float = DEFAULT_FPR,
    canary_options: dict[str, Any] | None = None,
    seed: int = 0,
    write: bool = True,
    private: Any = None,
) -> dict[str, Any]:
    """Audit a run directory; returns the figures and writes them to ``run_dir/audit.json``.

    ``private``: the run's private splits when the run directory cannot reload them (a run fitted on
    in-memory arrays; :mod:`dpsynth.eval.held_out`).

    * Nearest-neighbour attack on ``samples.npz`` (always, when samples exist): members are up to
      ``max_examples`` private train images, non-members as many private val images.
    * Loss attack when the run's method implements ``Method.example_losses(ctx, images uint8
      [N,H,W,C], labels int64 [N]) -> float array [N]`` (the per-example loss of its released
      model; the base class returns None: nothing to score; docs/audit.md).
    * With ``canary=True``, :func:`canary_audit` on the run's private train split at the σ and
      sample rate of the run's DP-SGD mechanism (from ``privacy.json``), for at most
      ``CANARY_MAX_STEPS`` steps; ``canary_options`` overrides its keyword arguments.
    * With ``run_canary=True``, :func:`~dpsynth.eval.run_canary.run_canary_audit`: the run's own method
      retrained with planted canaries (one more full training), for any training mechanism.

    The data are loaded exactly as the run loaded them (same config, same split seed).
    """
    from dpsynth.context import open_run
    from dpsynth.data.source import DatasetSource

    run_dir = Path(run_dir)
    source = None if private is None else DatasetSource(private=private)  # read by the run's one loader
    ctx, method = open_run(run_dir, echo=False, private=source, require_released=False)
    report: dict[str, Any] = {"membership_inference": {}, "skipped": {}, "note": NOTE}
    if membership:
        _membership_inference(report, run_dir, ctx, method, max_examples, fpr, seed)
    if canary:
        _file(report, "canary", _canary_for_run(run_dir, ctx, canary_options or {}, seed))
    if run_canary:
        from dpsynth.eval.run_canary import run_canary_audit

        _file(report, "run_canary", run_canary_audit(run_dir, seed=seed))
    if write:
        from dpsynth.checkpoint import atomic_write_json

        atomic_write_json(run_dir / AUDIT_FILE, report)
    return report


def _file(report: dict[str, Any], key: str, result: dict[str, Any]) -> None:
    """An audit's figures under ``key``, or its reason under ``skipped``."""
    if "skipped" in result:
        report["skipped"][key] = result["skipped"]
    else:
        report[key] = result


def _membership_inference(
    report: dict[str, Any], run_dir: Path, ctx: Any, method: Any, max_examples: int, fpr: float, seed: int
) -> None:
    """The nearest-neighbour attack on the samples and the loss attack on the released model, into ``report``."""
    members, nonmembers = _balanced_members(ctx.data.train, ctx.data.val, max_examples, seed)
    attacks, skipped = report["membership_inference"], report["skipped"]
    samples_path = run_dir / SAMPLES_FILE
    if samples_path.is_file():
        with np.load(samples_path) as archive:
            synthetic = archive["images"]
        attacks["nearest_neighbour"] = nearest_neighbour_attack(
            members.images, nonmembers.images, synthetic, fpr
        ).to_dict()
    else:
        skipped["nearest_neighbour"] = f"{SAMPLES_FILE} not found"
    member_losses = method.example_losses(ctx, members.images, members.labels)
    if member_losses is not None:
        nonmember_losses = method.example_losses(ctx, nonmembers.images, nonmembers.labels)
        attacks["loss"] = loss_attack(
            np.asarray(member_losses, np.float64), np.asarray(nonmember_losses, np.float64), fpr
        ).to_dict()
    else:
        skipped["loss"] = f"method {method.name!r} exposes no example_losses hook"


def _balanced_members(train: Any, val: Any, max_examples: int, seed: int) -> tuple[Any, Any]:
    """Equal-size random subsets of the private train (members) and val (non-members) splits."""
    count = min(len(train), len(val), int(max_examples))
    if count < 1:
        raise DataError("membership inference needs non-empty private train and val splits")
    generator = np.random.default_rng(seed)
    return (
        train.subset(np.sort(generator.choice(len(train), count, replace=False))),
        val.subset(np.sort(generator.choice(len(val), count, replace=False))),
    )


def _canary_for_run(run_dir: Any, ctx: Any, options: dict[str, Any], seed: int) -> dict[str, Any]:
    """The canary audit at the run's own DP-SGD noise multiplier and sample rate."""
    privacy_path = run_dir / PRIVACY_FILE
    if not privacy_path.is_file():
        return {"skipped": f"{PRIVACY_FILE} not found"}
    privacy = json.loads(privacy_path.read_text())
    dpsgd = [m for m in privacy.get("mechanisms", []) if m.get("kind") == "subsampled_gaussian" and m.get("steps")]
    if not dpsgd and "noise_multiplier" not in options:
        return {"skipped": "the run has no DP-SGD mechanism to mirror"}
    settings: dict[str, Any] = {
        "delta": float(privacy.get("delta", 1e-5)),
        "accountant": privacy.get("accountant", "prv"),
        "seed": seed,
    }
    if dpsgd:
        main = max(dpsgd, key=lambda m: m["steps"])
        settings.update(
            noise_multiplier=float(main["noise_multiplier"]),
            sample_rate=float(main["sample_rate"]),
            steps=min(int(main["steps"]), CANARY_MAX_STEPS),
        )
    settings["num_canaries"] = min(100, max(2, len(ctx.data.train) // 10))
    settings.update(options)
    result = canary_audit(ctx.data.train, **settings).to_dict()
    result["run_claimed_epsilon"] = privacy.get("epsilon")
    return result
