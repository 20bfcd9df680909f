"""``evaluate`` keeps its private figures off the console (docs/privacy.md, "Trust boundary").

Downstream test accuracy, FID against the private train split and model-selection scores are private
diagnostics: for a run directory they go to ``diagnostics/metrics.json`` and the lines quoting them to
``diagnostics/log.txt``; for a bare samples file they are in the returned dict and ``<stem>.metrics.json``
only. The console (captured by ``dpsynth bench`` beside each run) shows progress and where they went.
"""

import json
import re

import pytest
from test_evaluate import PRIVATE_VAL, BlockMeans, _ledger, _run_dir, samples_file  # noqa: F401  (samples_file is a fixture)

from dpsynth.eval.evaluate import evaluate

FAST = {"models": ["logreg"], "seeds": 1, "protocol": {"max_steps": 5, "batch_size": 64}, "max_fid_samples": 20}
METRICS = ["accuracy", "fid", "model_selection"]


@pytest.fixture(autouse=True)
def block_means(monkeypatch, tmp_path):
    from dpsynth.metrics import inception

    monkeypatch.setattr(inception, "InceptionFeatures", BlockMeans)  # no Inception network in a unit test
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def _figures(result):
    """Every rendering of the private figures that a log or summary line could use."""
    values = [*result["accuracy"]["logreg"]["runs"], result["accuracy"]["logreg"]["mean"], result["fid"]]
    for row in result["model_selection"]["grid"]:
        values += [row["synthetic_on_real"], row["real_on_real"]]
    return {f"{value:.{digits}f}" for value in values for digits in (1, 2, 4)}


def _assert_quiet(console, result):
    text = console.out + console.err
    assert "test accuracy" not in text and "real→real" not in text
    assert not re.search(r"\d\s*%", text), text  # no percentage at all
    assert not [figure for figure in _figures(result) if figure in text], text


def test_evaluating_a_run_keeps_private_figures_in_diagnostics(samples_file, tmp_path, capfd):  # noqa: F811
    run_dir = _run_dir(tmp_path, samples_file)
    capfd.readouterr()
    result = evaluate(run_dir, METRICS, **FAST)
    console = capfd.readouterr()
    _assert_quiet(console, result)
    metrics_path = run_dir / "diagnostics" / "metrics.json"
    log_path = run_dir / "diagnostics" / "log.txt"
    assert str(metrics_path) in console.err and str(log_path) in console.err  # where, never what
    assert "utility: training logreg" in console.err  # progress stays visible

    written = json.loads(metrics_path.read_text())
    assert written["accuracy"] == result["accuracy"] and written["fid"] == result["fid"]
    assert written["model_selection"] == result["model_selection"]
    log = log_path.read_text()
    accuracy = result["accuracy"]["logreg"]["runs"][0]
    assert f"utility logreg seed 0: test accuracy {accuracy:.2f}%" in log
    assert log.count("real→real") == len(result["model_selection"]["grid"])
    assert not (run_dir / "log.txt").exists(), "the released log never receives evaluation lines"


def test_evaluating_a_bare_file_writes_its_figures_only_to_its_metrics_json(samples_file, capfd):  # noqa: F811
    capfd.readouterr()
    result = evaluate(samples_file, METRICS, data="mnist10k", **FAST)
    console = capfd.readouterr()
    _assert_quiet(console, result)
    metrics_path = samples_file.with_suffix(".metrics.json")
    assert str(metrics_path) in console.err
    assert json.loads(metrics_path.read_text())["accuracy"] == result["accuracy"]
    assert not list(samples_file.parent.glob("**/log.txt"))


def test_a_selection_charged_to_the_ledger_logs_its_accuracy_after_the_state(samples_file, tmp_path, capfd):  # noqa: F811
    """With private-val selection the accuracy lines wait for ledger.json, then land in diagnostics/log.txt."""
    run_dir = _run_dir(tmp_path, samples_file, _ledger())
    capfd.readouterr()
    result = evaluate(run_dir, ["accuracy"], **PRIVATE_VAL)
    console = capfd.readouterr()
    accuracy = result["accuracy"]["logreg"]["runs"][0]
    assert "test accuracy" not in console.err + console.out and f"{accuracy:.2f}" not in console.err + console.out
    log = (run_dir / "diagnostics" / "log.txt").read_text()
    assert f"utility logreg seed 0: test accuracy {accuracy:.2f}%" in log
    assert not (run_dir / "log.txt").exists()


def test_the_evaluate_command_prints_figures_only_when_asked(monkeypatch, capsys):
    """``dpsynth evaluate`` shows the protocol and where the metrics are; the private figures need --show."""
    import argparse

    import dpsynth.api
    from dpsynth.cli import evaluate as eval_cli

    result = {"accuracy": {"cnn": {"mean": 87.6543, "std": 1.2345}}, "fid": 123.4567}
    monkeypatch.setattr(dpsynth.api, "evaluate", lambda *args, **kwargs: result)
    parser = argparse.ArgumentParser()
    eval_cli.register(parser.add_subparsers())
    for flags, shown in (([], False), (["--show"], True)):
        eval_cli.run(parser.parse_args(["evaluate", "RUN", *flags]))
        out = capsys.readouterr().out
        assert ("87.65" in out and "123.4567" in out) == shown, out
        assert shown or "--show" in out
