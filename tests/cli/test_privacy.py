"""``dpsynth privacy epsilon|noise``: handlers called directly and through the real CLI, against opacus."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli_in_process

from dpsynth.cli import privacy as privacy_cli
from dpsynth.privacy import CALIBRATION_TOLERANCE

REPO = Path(__file__).resolve().parents[2]
SETTINGS = [(1.0, 0.01, 1000, 1e-5), (2.0, 0.004, 3000, 1e-6), (5.0, 1.0, 10, 1e-5)]


def _parse(argv):
    parser = argparse.ArgumentParser()
    privacy_cli.register(parser.add_subparsers())
    return parser.parse_args(argv)


def _run(argv, capsys):
    args = _parse(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in argv else out


def _opacus_epsilon(accountant, sigma, q, steps, delta):
    # imported here: opacus takes seconds to import, in every test process that collects this module
    from opacus.accountants import PRVAccountant, RDPAccountant

    reference = PRVAccountant() if accountant == "prv" else RDPAccountant()
    reference.history = [(sigma, q, steps)]
    return reference.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
@pytest.mark.parametrize("sigma, q, steps, delta", SETTINGS)
def test_epsilon_matches_opacus(accountant, sigma, q, steps, delta, capsys):
    result = _run(
        [
            "privacy",
            "epsilon",
            "--noise-multiplier",
            str(sigma),
            "--sample-rate",
            str(q),
            "--steps",
            str(steps),
            "--delta",
            str(delta),
            "--accountant",
            accountant,
            "--json",
        ],
        capsys,
    )
    assert result["accountant"] == accountant and result["steps"] == steps and result["delta"] == delta
    assert result["epsilon"] == pytest.approx(_opacus_epsilon(accountant, sigma, q, steps, delta), rel=0.01)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_noise_spends_the_target_by_opacus_too(accountant, capsys):
    result = _run(
        [
            "privacy",
            "noise",
            "--epsilon",
            "2",
            "--sample-rate",
            "0.01",
            "--steps",
            "500",
            "--delta",
            "1e-5",
            "--accountant",
            accountant,
            "--json",
        ],
        capsys,
    )
    assert 2 - CALIBRATION_TOLERANCE <= result["epsilon"] <= 2
    check = _opacus_epsilon(accountant, result["noise_multiplier"], 0.01, 500, 1e-5)
    assert check == pytest.approx(2.0, abs=0.02)


def test_readable_output(capsys):
    out = _run(
        ["privacy", "epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
        capsys,
    )
    assert out.startswith("epsilon = ") and "prv accountant" in out and out.count("\n") == 1


def _cli(*argv):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "dpsynth.cli", *argv], env=env, capture_output=True, text=True, timeout=300
    )


def test_subprocess_json_and_errors():
    """The JSON on stdout alone, in a process of its own; the error line is checked in this process (that a
    process's stderr is the error line alone: tests/cli/test_cli.py's entry-point test)."""
    done = _cli(
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "0.01",
        "--steps",
        "1000",
        "--delta",
        "1e-5",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # exactly one JSON object on stdout
    assert result["epsilon"] == pytest.approx(_opacus_epsilon("prv", 1.0, 0.01, 1000, 1e-5), rel=0.01)
    failed = run_cli_in_process(
        "privacy", "noise", "--epsilon", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1.5"
    )
    assert failed.returncode != 0 and failed.stdout == ""
    assert failed.stderr.strip() == "error: delta must lie in (0, 1), got 1.5"
