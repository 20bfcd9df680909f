"""Canary audit of a run's own training: the method retrained with planted canaries, scored by its loss.

The one-run audit of Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS
2023, arXiv:2305.08846), applied to the run's **method** rather than to a stand-in. The engine-level
audit (:mod:`dpsynth.metrics.canary`) mirrors a run's DP-SGD σ and sample rate on a small classifier: it
tests the engine and its accounting, and has nothing to mirror when a run trains without DP-SGD. This
audit instead:

1. takes the run's private train split and config, unchanged;
2. picks m examples with a public seed and gives each a wrong label (the canaries); the rest is the
   fixed training set, and each canary joins it with probability ½ (secret inclusion bits);
3. trains the run's method on that set with the run's own config and a fresh ledger, exactly as the
   run trained (the training phase only: nothing is sampled or released);
4. scores each canary by minus its loss under the trained model (the method's ``example_losses`` hook,
   e.g. DPPM's denoising score-matching loss of the image with its wrong label row), guesses the k+
   best IN and the k- worst OUT, and turns the correct guesses into an empirical ε lower bound.

So it applies to any training mechanism, DPPM's randomized-response mode (which claims no ε)
included, and it measures what the trained model actually memorises. A bound above the ε the audit
training's ledger claims is evidence, at the stated confidence, that the claim is wrong; a bound of 0
shows nothing about the claim. It costs one full training of the method. Like every audit it reads
private data without noise: a private diagnostic, never part of the release.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.metrics.canary import bound_summary, choose_canaries, guess_counts, guess_membership, inclusion_bits

RUN_CANARY_DIR = "canary-run"  # under the run's diagnostics directory
MAX_CANARIES = 500


def run_canary_audit(
    run_dir: str | Path,
    *,
    num_canaries: int | None = None,
    k_plus: int | None = None,
    k_minus: int | None = None,
    beta: float = 0.05,
    seed: int = 0,
    inclusion_seed: int | None = None,
    echo: bool = False,
) -> dict[str, Any]:
    """Retrain the run's method with canaries planted in its private train split; the empirical ε bound.

    ``num_canaries`` defaults to a tenth of the train split, at most :data:`MAX_CANARIES` (500 of 7,000
    mnist10k digits: 100 guesses, which can certify up to ε ≈ 3.5 at δ = 1e-5 and 95 %; 100 canaries
    could certify only 1.8). Returns :func:`~dpsynth.metrics.canary.bound_summary`'s figures plus the audit
    training's claimed ε (None under a ledger with guarantee ``none``), or ``{"skipped": reason}`` when
    the method has no ``example_losses`` hook. ``seed`` drives the public choices (canaries and their wrong labels);
    the inclusion bits come from OS entropy unless a test passes ``inclusion_seed``. The audit
    training lives in ``diagnostics/canary-run`` and is started afresh on every call (its inclusion
    bits are not stored, so an interrupted audit cannot be continued)."""
    from dpsynth.context import build_context, make_ledger, open_run, plan_training, train_run
    from dpsynth.contract import Method
    from dpsynth.data import ImageDataset, PrivateSplits
    from dpsynth.rundir import CHECKPOINTS_DIR, LedgerStore, diagnostics_dir

    started = time.time()
    run_ctx, method = open_run(run_dir, echo=False, require_released=False)
    if type(method).example_losses is Method.example_losses:
        return {"skipped": f"method {method.name!r} exposes no example_losses hook"}
    train = run_ctx.data.train
    num_canaries = num_canaries or min(MAX_CANARIES, max(2, len(train) // 10))
    k_plus, k_minus = guess_counts(num_canaries, k_plus, k_minus)
    canary_index, base_index, wrong_labels = choose_canaries(train, num_canaries, seed)
    included = inclusion_bits(num_canaries, inclusion_seed)
    labels = train.labels.copy()
    labels[canary_index] = wrong_labels
    kept = np.concatenate([base_index, canary_index[included]])
    audited = ImageDataset(
        train.images[kept], labels[kept], train.num_classes, "private-train+canaries", train.class_names
    )

    config = run_ctx.config
    audit_dir = diagnostics_dir(Path(run_dir)) / RUN_CANARY_DIR
    shutil.rmtree(audit_dir, ignore_errors=True)
    (audit_dir / CHECKPOINTS_DIR).mkdir(parents=True)
    ledger = make_ledger(config)
    trainer, plan = plan_training(config, len(audited))
    store = LedgerStore(audit_dir, ledger)
    splits = PrivateSplits(audited, run_ctx.data.val, run_ctx.data.test)
    ctx = build_context(config, audit_dir, splits, run_ctx.public, ledger, echo=echo, store=store, plan=plan)
    train_run(trainer, ctx, store)  # the run's own training function
    canary_images = train.images[canary_index]
    losses = np.asarray(trainer.example_losses(ctx, canary_images, wrong_labels), dtype=np.float64)
    outcome = guess_membership(-losses, included, k_plus, k_minus)
    claimed = ledger.epsilon()
    claimed = None if claimed is None else float(claimed)
    return {
        **bound_summary(outcome, config.privacy.delta, beta, claimed),
        "claimed_epsilon": claimed,
        "guarantee": ledger.guarantee,
        "k_plus": k_plus,
        "k_minus": k_minus,
        "canary_kind": "mislabelled, scored by the method's example_losses",
        "audited": f"the run's own method ({method.name}) retrained on its train split with the canaries",
        "seconds": time.time() - started,
    }
