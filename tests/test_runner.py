"""End-to-end through the runner with the cheapest method: run directory contents, δ warning, resume."""

import json
from pathlib import Path

import pytest
import yaml
from conftest import assert_one_line_error, interrupt_after_steps

BASE = (
    "method: dpsgd-classifier\nname: base\ndata: {private: mnist10k, max_train: 400}\n"
    "privacy: {epsilon: 2.0, delta: 1.0e-5}\n"
    "dpsgd-classifier: {model: logreg, steps: 6, batch_size: 80, checkpoint_every: 2, lr: 1.0}\n"
)


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(BASE)
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One run of BASE through the command line, trained once for the tests that read it (a copy each)."""
    from conftest import run_cli_in_process

    base = tmp_path_factory.mktemp("finished")
    (base / "base.yaml").write_text(BASE)
    result = run_cli_in_process("run", str(base / "base.yaml"), "--out", str(base / "run"))
    return base / "run", result


@pytest.fixture
def finished_copy(finished, tmp_path):
    import shutil

    run, result = finished
    return Path(shutil.copytree(run, tmp_path / "run")), result


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """BASE stopped by a Ctrl-C after 3 DP-SGD steps (its last checkpoint at step 2), once for the resume tests."""
    base = tmp_path_factory.mktemp("interrupted")
    (base / "base.yaml").write_text(BASE)
    with pytest.raises(KeyboardInterrupt):
        interrupt_after_steps(base / "base.yaml", base / "run", stop_after=3)
    return base / "run"


@pytest.fixture
def interrupted_copy(interrupted, tmp_path):
    import shutil

    return Path(shutil.copytree(interrupted, tmp_path / "run"))


def test_run_writes_contract_files_and_meets_budget(finished_copy):
    out, result = finished_copy
    assert result.returncode == 0, result.stderr
    for name in (
        "config.yaml",
        "privacy.json",
        "ledger.json",
        "log.txt",
        "report.html",
        "report-release.html",
        "diagnostics/metrics.json",
        "diagnostics/log.txt",
    ):
        assert (out / name).is_file(), name
    assert list((out / "checkpoints").glob("*.pt"))
    assert not (out / "metrics.json").exists()  # the classifier's test accuracy is a private diagnostic
    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy["guarantee"] == "dp" and privacy["accountant"] == "prv"
    assert any("dataset size N is public" in text for text in privacy["assumptions"])
    assert privacy["target_epsilon"] - 0.01 <= privacy["epsilon"] <= privacy["target_epsilon"]
    [mechanism] = privacy["mechanisms"]
    # q = B / N with N the train size the run loaded (content-keyed hold-outs: binomial, not fixed)
    from dpsynth.context import load_private_splits, read_run_config

    loaded = len(load_private_splits(read_run_config(out)).train)
    assert mechanism["steps"] == 6 and mechanism["sample_rate"] == pytest.approx(80 / loaded)
    assert yaml.safe_load((out / "config.yaml").read_text())["dpsgd-classifier"]["steps"] == 6
    accuracy = json.loads((out / "diagnostics" / "metrics.json").read_text())["accuracy"]["dpsgd-classifier"]["mean"]
    assert 1.0 < accuracy <= 100.0  # in percent, as every accuracy in metrics.json (chance alone is 10 %)


def test_log_lines_quoting_private_values_stay_in_diagnostics(finished_copy):
    out, _ = finished_copy
    released, full = (out / "log.txt").read_text(), (out / "diagnostics" / "log.txt").read_text()
    assert "test accuracy" in full and "test accuracy" not in released
    assert "training finished" in released


def test_delta_at_least_one_over_n_warns(cli, tmp_path, config_path):
    result = cli(
        "run",
        str(config_path),
        "--out",
        str(tmp_path / "r"),
        "--set",
        "privacy.delta=0.01",
        "--set",
        "dpsgd-classifier.steps=1",
    )
    assert result.returncode == 0, result.stderr
    assert any(line.startswith("warning: ") and "delta" in line.lower() for line in result.stderr.splitlines())


def test_resume_continues_the_same_ledger(interrupted_copy, config_path):
    from dpsynth.runner import run_config

    out = interrupted_copy
    # The state of the last checkpoint (step 2) is on disk, and privacy.json states it.
    assert _ledger_steps(out) == 2
    assert json.loads((out / "privacy.json").read_text())["mechanisms"][0]["steps"] == 2
    run_config(config_path, out=out, resume=True, echo=False)
    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy["mechanisms"][0]["steps"] == 6  # neither reset nor double counted
    steps = [json.loads(line)["step"] for line in (out / "curves.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6


def test_resume_refuses_a_changed_config(cli, finished_copy, config_path):
    out, _ = finished_copy
    result = cli("run", str(config_path), "--out", str(out), "--resume", "--set", "privacy.epsilon=3")
    assert_one_line_error(result, "privacy.epsilon")


def test_resume_refuses_without_the_ledger_state(cli, interrupted_copy, config_path):
    out = interrupted_copy
    (out / "ledger.json").unlink()
    result = cli("run", str(config_path), "--out", str(out), "--resume")
    assert_one_line_error(result, "ledger.json")
    assert json.loads((out / "privacy.json").read_text())["mechanisms"][0]["steps"] == 2  # untouched


def test_curves_and_log_never_run_ahead_of_the_stored_ledger(tmp_path, config_path):
    """Killed between checkpoints: no curve record or log line quotes a step ledger.json lacks."""
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        interrupt_after_steps(config_path, out, stop_after=3, overrides=["dpsgd-classifier.checkpoint_every=4"])
    stored = _ledger_steps(out)
    assert stored == 0  # the first checkpoint (step 4) was never reached
    curves = out / "curves.jsonl"
    steps = [json.loads(line)["step"] for line in curves.read_text().splitlines()] if curves.exists() else []
    assert all(step <= stored for step in steps), (steps, stored)
    assert "eps spent" not in (out / "log.txt").read_text()


def test_checkpoint_is_written_after_the_ledger_state(tmp_path, config_path, monkeypatch):
    """Killed while writing a checkpoint: ledger.json already holds the steps that checkpoint records."""
    from dpsynth import checkpoint

    original = checkpoint.atomic_write

    def failing(path, write, mode="wb"):
        if str(path).endswith(".pt"):
            raise KeyboardInterrupt
        return original(path, write, mode)

    monkeypatch.setattr(checkpoint, "atomic_write", failing)
    from dpsynth.runner import run_config

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_config(config_path, out=out, echo=False)
    assert _ledger_steps(out) == 2 and not list((out / "checkpoints").glob("*.pt"))
    curves = out / "curves.jsonl"
    assert not curves.exists() or max(json.loads(line)["step"] for line in curves.read_text().splitlines()) <= 2


def _ledger_steps(out):
    state = json.loads((out / "ledger.json").read_text())
    return sum(m["steps"] for m in state["mechanisms"])


def test_released_classifier_is_audited_by_its_losses(finished_copy):
    from dpsynth.eval.evaluate import evaluate

    out, _ = finished_copy
    audit = evaluate(out, ["audit"])["audit"]
    loss_attack = audit["membership_inference"]["loss"]
    assert loss_attack["num_members"] == loss_attack["num_nonmembers"] > 0
    assert 0.0 <= loss_attack["tpr_at_fpr"] <= 1.0
    assert "nearest_neighbour" not in audit["membership_inference"]  # a model, no samples
    assert "audit" in json.loads((out / "diagnostics" / "metrics.json").read_text())
    assert json.loads((out / "diagnostics" / "audit.json").read_text())["membership_inference"]
    assert not (out / "audit.json").exists() and not (out / "metrics.json").exists()


def test_a_run_without_released_state_is_refused_in_one_line_and_a_finished_one_reopens(tmp_path):
    """`open_run` restores the method's released state (the contract's `load_state_dict`); a run directory
    without it (an unfinished run, or one an earlier dpsynth made) is refused in one line, naming the file."""
    from dpsynth.api import Synthesizer
    from dpsynth.errors import ConfigError
    from dpsynth.testing import SHRINK

    run = tmp_path / "run"
    fitted = Synthesizer.from_config("dp-merf/smoke", SHRINK).fit(out=run)
    images, labels = fitted.sample(6)
    reopened_images, reopened_labels = Synthesizer.load(run).sample(6)
    assert reopened_images.shape == images.shape and reopened_labels.tolist() == labels.tolist()
    (run / "checkpoints" / "released.pt").unlink()
    with pytest.raises(ConfigError, match=r"released\.pt") as refused:
        Synthesizer.load(run).sample(6)
    assert "\n" not in str(refused.value)
