"""Model-selection rank correlation (Ghalebikesabi et al. (arXiv:2302.13861) §6)."""

import numpy as np
import pytest

from dpsynth.data import load_private
from dpsynth.metrics.model_selection import GridResult, model_selection, rank_correlation, summarize
from dpsynth.metrics.utility import TrainConfig


def test_rank_correlation_on_a_hand_example():
    # One swapped pair among four: Spearman 1 - 6·(1+1)/(4·15) = 0.8; Kendall (5 - 1) / 6 = 2/3.
    result = rank_correlation([1, 2, 3, 4], [10, 20, 40, 30])
    assert result["spearman"] == pytest.approx(0.8)
    assert result["kendall"] == pytest.approx(2 / 3)
    assert rank_correlation([1, 2, 3], [3, 2, 1]) == {"spearman": pytest.approx(-1.0), "kendall": pytest.approx(-1.0)}
    assert rank_correlation([5, 5, 5], [1, 2, 3]) == {"spearman": None, "kendall": None}


def test_summary_reports_where_the_synthetic_choice_ranks_on_real_data():
    rows = [GridResult({"model": m}, s, s - 5, r) for m, s, r in (("a", 90, 70), ("b", 95, 80), ("c", 80, 85))]
    summary = summarize(rows)
    assert summary["selected_rank_on_real"] == 2  # synthetic picks "b", second best on real data
    assert summary["synthetic_vs_real_test"]["spearman"] == pytest.approx(1.0)
    assert summary["synthetic_vs_real_training"]["kendall"] == pytest.approx(-1 / 3)


def test_model_selection_on_real_data_as_its_own_synthetic_set():
    splits = load_private("mnist10k")
    rng = np.random.default_rng(0)
    train = rng.choice(len(splits.train), 600, replace=False)
    test = rng.choice(len(splits.test), 300, replace=False)
    grid = [{"model": "logreg", "lr": lr} for lr in (1e-5, 3e-3)]
    result = model_selection(
        splits.train.images[train],
        splits.train.labels[train],
        splits.train.images[train],
        splits.train.labels[train],
        splits.test.images[test],
        splits.test.labels[test],
        10,
        grid=grid,
        base=TrainConfig(epochs=2, batch_size=64),
    )
    accuracies = [row["real_on_real"] for row in result["grid"]]
    assert accuracies[1] > accuracies[0] + 10  # the tiny learning rate barely learns
    assert result["transfer"]["spearman"] == pytest.approx(1.0)
    assert result["selected_rank_on_real"] == 1
