"""``evaluate`` and the ``dpsynth evaluate`` command on a bare samples file."""

import json

import numpy as np
import pytest

from dpsynth.data import load_private
from dpsynth.errors import ConfigError, DataError
from dpsynth.eval.evaluate import evaluate, parse_metrics
from dpsynth.eval.utility import TrainConfig


@pytest.fixture(scope="module")
def samples_file(tmp_path_factory):
    """Real mnist10k train digits posing as a synthetic release (a stratified random subset)."""
    train = load_private("mnist10k").train
    index = np.random.default_rng(0).choice(len(train), 400, replace=False)
    path = tmp_path_factory.mktemp("run") / "release.npz"
    np.savez(path, images=train.images[index], labels=train.labels[index])
    return path


def test_parse_metrics():
    assert parse_metrics("fid, accuracy") == ["fid", "accuracy"]
    assert "accuracy" in parse_metrics(None)
    with pytest.raises(ConfigError, match="unknown metric"):
        parse_metrics("fid,sharpness")


def test_evaluate_bare_npz_writes_metrics_json(samples_file, tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path))
    result = evaluate(samples_file, ["accuracy", "fid", "is"], data="mnist10k", models=["logreg"], seeds=2,
                      train=TrainConfig(epochs=15, batch_size=64, lr=3e-3), max_fid_samples=6)
    assert set(result["accuracy"]["logreg"]) >= {"mean", "std", "runs"}
    assert result["accuracy"]["logreg"]["mean"] > 75.0
    assert result["fid"] > 0.0
    assert result["is"] is None and "logits" in result["notes"]["is"]
    written = json.loads(samples_file.with_suffix(".metrics.json").read_text())
    assert written["accuracy"]["logreg"]["runs"] == result["accuracy"]["logreg"]["runs"]


def test_bare_npz_needs_a_dataset(samples_file):
    with pytest.raises(DataError, match="--data"):
        evaluate(samples_file, ["accuracy"], write=False)


def test_cli_json_and_errors(cli, samples_file):
    ok = cli("evaluate", str(samples_file), "--data", "mnist10k", "--metrics", "accuracy", "--models", "logreg",
             "--max-steps", "30", "--json")
    assert ok.returncode == 0, ok.stderr
    payload = json.loads(ok.stdout)
    assert list(payload["accuracy"]) == ["logreg"] and 0 <= payload["accuracy"]["logreg"]["mean"] <= 100
    bad = cli("evaluate", str(samples_file), "--data", "mnist10k", "--metrics", "beauty")
    assert bad.returncode != 0 and "error: unknown metric" in bad.stderr
