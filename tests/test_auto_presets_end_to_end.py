"""Every method's ``auto`` preset, run to the end on a custodian's own data: `make test-own-data` (slow, hours).

For each registered method and each stand-in set (docs/own-data.md; built as in tests/test_auto_presets.py):
200 face/non-face-like 25×25 grey images of 2 classes, and scikit-learn's 1,797 8×8 digits, two runs:

* the image-per-class **folder** through the **CLI** (``dpsynth run METHOD/auto --set data.private=DIR``);
* the **arrays** through the **Python API** (``Synthesizer.from_config("METHOD/auto").fit(images, labels)``).

Each must finish within its preset's own ``auto.time_budget_s`` (the whole run on 2 CPU cores, the budget the
scaling rule sized it for), spend at most its target ε, and leave a release and a report. Knobs:
DPSYNTH_OWN_DATA_METHODS (comma-separated subset), DPSYNTH_OWN_DATA_SETS (faces, digits),
DPSYNTH_OWN_DATA_SLACK (the factor on the budget a loaded machine may take, default 1).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_auto_presets import BUILT_IN, DIGIT_CLASSES, FACE_CLASSES, digit_arrays, face_arrays, write_sets

from dpsynth.api import Synthesizer
from dpsynth.cli import main
from dpsynth.config import load_config
from dpsynth.methods import METHODS

SETS = {"faces": (face_arrays, FACE_CLASSES), "digits": (digit_arrays, DIGIT_CLASSES)}
SLACK = float(os.environ.get("DPSYNTH_OWN_DATA_SLACK", "1"))


def chosen(variable: str, every: list[str]) -> list[str]:
    names = os.environ.get(variable)
    picked = [name.strip() for name in names.split(",")] if names else every
    unknown = sorted(set(picked) - set(every))
    assert not unknown, f"{variable} names {unknown}, not among {every}"
    return picked


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("own-e2e")
    return {name: write_sets(root / name, *make(), classes)["folder"] for name, (make, classes) in SETS.items()}


def budget_s(method: str) -> float:
    auto = load_config(f"{method}/auto").auto
    assert auto is not None and auto.time_budget_s, f"{method}/auto declares no time budget"
    return float(auto.time_budget_s) * SLACK


def released(run_dir: Path, method: str) -> None:
    """The privacy record within the target, the release (samples, or the model for a model-releasing method)
    and both reports."""
    record = json.loads((run_dir / "privacy.json").read_text())
    assert 0 < record["epsilon"] <= record["target_epsilon"], record["statement"]
    if METHODS[method].releases == "model":
        assert any((run_dir / "checkpoints").glob("*")), "no released model"
    else:
        assert (run_dir / "samples.npz").is_file() and (run_dir / "samples.png").is_file()
    assert (run_dir / "report.html").is_file() and (run_dir / "log.txt").is_file()
    assert f"auto: {method} sized for N=" in (run_dir / "log.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("dataset", chosen("DPSYNTH_OWN_DATA_SETS", list(SETS)))
@pytest.mark.parametrize("method", chosen("DPSYNTH_OWN_DATA_METHODS", BUILT_IN))
def test_auto_preset_runs_from_a_folder_through_the_cli(method, dataset, folders, tmp_path, capsys):
    out = tmp_path / "run"
    start = time.monotonic()
    code = main(["run", f"{method}/auto", f"--set=data.private={folders[dataset]}", "--out", str(out)])
    seconds = time.monotonic() - start
    assert code == 0, capsys.readouterr().err[-2000:]
    assert "done: " in capsys.readouterr().err
    released(out, method)
    assert seconds <= budget_s(method), f"{method}/auto took {seconds:.0f} s, over its {budget_s(method):.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize("dataset", chosen("DPSYNTH_OWN_DATA_SETS", list(SETS)))
@pytest.mark.parametrize("method", chosen("DPSYNTH_OWN_DATA_METHODS", BUILT_IN))
def test_auto_preset_runs_from_arrays_through_the_api(method, dataset, tmp_path):
    make, classes = SETS[dataset]
    images, labels = make()
    start = time.monotonic()
    synth = Synthesizer.from_config(f"{method}/auto")
    synth.fit(images, labels, num_classes=len(classes), out=tmp_path / "run")
    seconds = time.monotonic() - start
    released(synth.run_dir, method)
    assert synth.privacy["epsilon"] <= synth.settings.privacy.epsilon
    assert seconds <= budget_s(method), f"{method}/auto took {seconds:.0f} s, over its {budget_s(method):.0f} s"
