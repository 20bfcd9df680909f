"""``dpsynth run`` and ``dpsynth demo`` end with one summary line on stderr; stdout stays the run directory alone."""

from __future__ import annotations

import json

import numpy as np
import yaml

from dpsynth.cli import _finish_run
from dpsynth.runner import summary_line


def finished_run(tmp_path, guarantee="dp", samples=True):
    """A run directory as a finished dpsgd-classifier or dpdm run leaves it (the files the line reads)."""
    run = tmp_path / "runs" / "faces"
    run.mkdir(parents=True)
    method = "dpdm" if samples else "dpsgd-classifier"
    config = {"method": method, "privacy": {"epsilon": 2.0, "delta": 1e-5}, "data": {"private": "digits8x8"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    epsilon = 1.9987 if guarantee == "dp" else None
    (run / "privacy.json").write_text(json.dumps({"epsilon": epsilon, "guarantee": guarantee, "delta": 1e-5}))
    if samples:
        np.savez(run / "samples.npz", images=np.zeros((64, 8, 8, 1), np.uint8), labels=np.zeros(64, np.int64))
    return run


def test_the_summary_names_method_epsilon_samples_and_report(tmp_path):
    run = finished_run(tmp_path)
    line = summary_line(run)
    assert "\n" not in line and line.startswith("done: dpdm, ")
    assert "eps=1.999 spent of target 2 (delta=1e-05)" in line
    assert f"64 samples in {run / 'samples.npz'}" in line and f"report {run / 'report.html'}" in line


def test_a_model_release_and_a_run_without_guarantee_say_so(tmp_path):
    assert "released a model, no samples" in summary_line(finished_run(tmp_path / "a", samples=False))
    assert "NO privacy guarantee" in summary_line(finished_run(tmp_path / "b", guarantee="none"))


def test_stdout_stays_the_run_directory_and_the_summary_goes_to_stderr(tmp_path, capsys):
    run = finished_run(tmp_path)
    _finish_run(run)
    console = capsys.readouterr()
    assert console.out == f"{run}\n"  # scripts read this one line
    assert console.err.startswith("done: dpdm") and console.err.count("\n") == 1
