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


def test_private_val_selection_in_a_run_directory_is_charged_and_persisted(samples_file, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        "method: dpdm\nseed: 0\n"
        "data: {private: mnist10k, public: null, image_size: null, channels: null, val_size: null, "
        "split_seed: 0, max_train: null}\n"
        "privacy: {epsilon: 10.0, delta: 1.0e-5, accountant: prv}\n")
    (run_dir / "samples.npz").write_bytes(samples_file.read_bytes())
    options = dict(models=["logreg"], train=TrainConfig(epochs=2, batch_size=200, lr=3e-3),
                   selection="private-val", val_noise_multiplier=20.0)
    first = evaluate(run_dir, ["accuracy"], **options)
    privacy = json.loads((run_dir / "privacy.json").read_text())
    charged = [m for m in privacy["mechanisms"] if m["name"] == "noisy-validation"]
    assert len(charged) == 1 and charged[0]["steps"] == 2 and 0 < privacy["epsilon"] < 10  # count is written as steps
    assert (run_dir / "checkpoints" / "evaluate.pt").is_file()
    assert json.loads((run_dir / "metrics.json").read_text())["accuracy"] == first["accuracy"]
    # A second evaluation continues the same ledger: the charges add up, nothing is reset.
    evaluate(run_dir, ["accuracy"], **options)
    privacy_again = json.loads((run_dir / "privacy.json").read_text())
    assert [m["steps"] for m in privacy_again["mechanisms"] if m["name"] == "noisy-validation"] == [4]
    assert privacy_again["epsilon"] > privacy["epsilon"]
