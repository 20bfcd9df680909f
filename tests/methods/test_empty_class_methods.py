"""The methods whose releases are per class run on private data with a declared class that has no training
record (docs/privacy.md, "Refusals that depend on the data"): per-class means (dp-merf), kernel class sums
(dp-ntk, dp-kernel), central images (dp-feta) and bounded per-class statistics (dp-imgsyn) finish, release
every declared class's label and report, with the empty class named only in the private diagnostics."""

from __future__ import annotations

import numpy as np
import pytest

from dpsynth.api import Synthesizer
from dpsynth.config import find_config
from dpsynth.data import load_private
from dpsynth.testing import SHRINK

EMPTY = 3  # the mnist10k digit left out of the private data


@pytest.fixture(scope="module")
def without_a_digit(tmp_path_factory) -> str:
    """300 mnist10k train digits, none of them a 3, with all ten classes declared."""
    train = load_private("mnist10k").train
    keep = np.sort(np.random.default_rng(0).choice(np.flatnonzero(train.labels != EMPTY), 300, replace=False))
    path = tmp_path_factory.mktemp("data") / "without-3.npz"
    images, labels = train.subset(keep).images, train.subset(keep).labels
    np.savez(path, images=images, labels=labels, class_names=np.array([str(c) for c in range(10)]))
    return str(path)


@pytest.mark.parametrize("method", ["dp-merf", "dp-ntk", "dp-kernel", "dp-feta", "dp-imgsyn"])
def test_a_per_class_method_runs_and_releases_every_class_with_one_empty(method, without_a_digit, tmp_path):
    overrides = {**SHRINK, "data.private": without_a_digit, "data.max_train": None}
    if method == "dp-merf":  # one of them also evaluates on the (class-free) test split and reports
        overrides.update({"evaluate.metrics": ["accuracy"], "evaluate.seeds": 1})
    run = tmp_path / "run"
    synth = Synthesizer.from_config(find_config(f"{method}/smoke"), overrides).fit(out=run)
    labels = np.load(run / "samples.npz")["labels"]
    assert EMPTY in set(labels.tolist()) and len(set(labels.tolist())) == 10
    assert np.isfinite(synth.sample(10)[0].astype(np.float64)).all()
    assert f"declared class(es) [{EMPTY}]" in (run / "diagnostics" / "log.txt").read_text()
    assert "declared class" not in (run / "log.txt").read_text()
    assert (run / "report.html").is_file() and (run / "report-release.html").is_file()
