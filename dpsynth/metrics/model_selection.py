"""Model selection with synthetic data (Ghalebikesabi et al. (arXiv:2302.13861) §6).

A third party tunes models on the synthetic data; does their ranking carry over to the real data?
A grid of classifier configurations (architecture × learning rate × weight decay) is trained on the
synthetic set and on the real train split, and the rank correlations (Spearman ρ, Kendall τ) of
their accuracies are reported for the paper's two settings and for the direct transfer question:

* ``synthetic_vs_real_test`` (§6 first stage): models trained on synthetic data, accuracy on
  held-out synthetic data vs on the real test split;
* ``synthetic_vs_real_training`` (§6 second stage): trained and tested on synthetic data vs
  trained on real train and tested on real test;
* ``transfer``: trained on synthetic, tested on real vs trained on real, tested on real — does the
  synthetic ranking pick the configuration that is best on the real data?

Training on the real train split reads private data: like the audit, these figures are for the
data custodian and are not covered by the run's DP guarantee.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.stats
import torch

from dpsynth.data.transforms import uint8_to_tensor
from dpsynth.metrics.utility import TrainConfig, accuracy, split_synthetic, train_classifier

DEFAULT_GRID: tuple[dict[str, Any], ...] = tuple(
    {"model": model, "lr": lr, "weight_decay": wd}
    for model in ("logreg", "mlp", "cnn")
    for lr in (3e-4, 3e-3)
    for wd in (0.0,)
)


def as_long(values: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long)


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> dict[str, float | None]:
    """Spearman ρ and Kendall τ (tau-b) of two score lists; None where undefined (a constant list)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("rank correlation needs two score lists of equal length >= 2")
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return {"spearman": None, "kendall": None}
    spearman = scipy.stats.spearmanr(a, b).statistic
    kendall = scipy.stats.kendalltau(a, b).statistic
    return {
        key: (None if value is None or math.isnan(value) else float(value))
        for key, value in (("spearman", spearman), ("kendall", kendall))
    }


@dataclasses.dataclass
class GridResult:
    config: dict[str, Any]
    synthetic_on_synthetic: float  # trained on synthetic, tested on held-out synthetic (%)
    synthetic_on_real: float  # trained on synthetic, tested on the real test split (%)
    real_on_real: float  # trained on real train, tested on the real test split (%)


def model_selection(
    images: np.ndarray,
    labels: np.ndarray,
    real_images: np.ndarray,
    real_labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    *,
    grid: Sequence[dict[str, Any]] = DEFAULT_GRID,
    base: TrainConfig | None = None,
    seed: int = 0,
    device: str = "cpu",
    log: Callable[..., None] | None = None,
) -> dict[str, Any]:
    """Train every grid configuration on synthetic and on real data; report rank correlations.

    ``log(message, private=False)`` (the signature of :class:`~dpsynth.rundir.RunLog`) receives a
    progress line per configuration and, marked ``private=True``, the line quoting its accuracies (the
    real test split and the real train split, read without noise): for the run's
    ``diagnostics/log.txt`` only, never the console (:class:`dpsynth.eval.evaluate.EvaluationLog`).
    """
    base = base or TrainConfig()
    synthetic_train, synthetic_test = split_synthetic(len(images), 0.2, seed)
    x_syn, x_real, x_test = (uint8_to_tensor(v) for v in (images, real_images, test_images))
    y_syn_t, y_real_t, y_test_t = (np.asarray(v) for v in (labels, real_labels, test_labels))
    rows: list[GridResult] = []
    for number, entry in enumerate(grid, 1):
        if log:
            log(f"model selection: configuration {number}/{len(grid)} {entry}")
        config = dataclasses.replace(
            base, lr=entry.get("lr", base.lr), weight_decay=entry.get("weight_decay", base.weight_decay)
        )
        on_synthetic = train_classifier(
            entry["model"],
            x_syn[synthetic_train],
            as_long(y_syn_t[synthetic_train]),
            num_classes,
            config,
            seed=seed,
            device=device,
        ).model
        on_real = train_classifier(
            entry["model"], x_real, as_long(y_real_t), num_classes, config, seed=seed, device=device
        ).model
        row = GridResult(
            config=dict(entry),
            synthetic_on_synthetic=100
            * accuracy(on_synthetic, x_syn[synthetic_test], as_long(y_syn_t[synthetic_test])),
            synthetic_on_real=100 * accuracy(on_synthetic, x_test, as_long(y_test_t)),
            real_on_real=100 * accuracy(on_real, x_test, as_long(y_test_t)),
        )
        rows.append(row)
        if log:
            log(
                f"model selection {entry}: syn→syn {row.synthetic_on_synthetic:.1f}%, "
                f"syn→real {row.synthetic_on_real:.1f}%, real→real {row.real_on_real:.1f}%",
                private=True,
            )
    return summarize(rows)


def summarize(rows: Sequence[GridResult]) -> dict[str, Any]:
    """Rank correlations of the three settings and whether the synthetic choice is the real best."""
    syn_syn = [r.synthetic_on_synthetic for r in rows]
    syn_real = [r.synthetic_on_real for r in rows]
    real_real = [r.real_on_real for r in rows]
    chosen = int(np.argmax(syn_syn))
    real_order = np.argsort(real_real)[::-1]
    return {
        "synthetic_vs_real_test": rank_correlation(syn_syn, syn_real),
        "synthetic_vs_real_training": rank_correlation(syn_syn, real_real),
        "transfer": rank_correlation(syn_real, real_real),
        # Rank (1 = best) on real data of the configuration the synthetic data would pick.
        "selected_rank_on_real": int(np.where(real_order == chosen)[0][0]) + 1,
        "grid": [dataclasses.asdict(r) for r in rows],
    }
