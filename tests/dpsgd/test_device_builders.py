"""Every DP-SGD family supplies a device-side batch builder: with ``graph: true`` its runs take the fixed-shape
step (uncaptured on the CPU, captured on CUDA), never the eager fallback, and spend exactly their plan (the
runner refuses a run whose ledger differs from it). That the fixed-shape step's sums equal the eager ones is
tests/dpsgd/test_fixed_shape.py's; that the device batches equal the host ones,
tests/diffusion/test_device_batch.py's."""

from __future__ import annotations

import json

import pytest

from dpsynth.api import Synthesizer
from dpsynth.testing import SHRINK, contract_cache

# preset, the section holding its DP-SGD keys (dppm: the score network's training section)
FAMILIES = [
    ("dpsgd-classifier/smoke", "dpsgd-classifier"),
    ("dp-gan/smoke", "dp-gan"),
    ("dppm/smoke", "dppm.training"),
    ("dpdm/smoke", "dpdm"),
    ("pdp-diffusion/smoke", "pdp-diffusion"),
]


@pytest.fixture(autouse=True)
def _test_cache(tmp_path_factory, monkeypatch):
    """Public pre-training caches where the contract tests' runs cache theirs (never the user's ~/.cache)."""
    monkeypatch.setenv("DPSYNTH_CACHE", str(contract_cache(tmp_path_factory)))


@pytest.mark.parametrize(("preset", "section"), FAMILIES, ids=[p for p, _ in FAMILIES])
def test_a_graph_run_takes_the_fixed_shape_step_and_spends_its_plan(tmp_path, preset, section):
    out = tmp_path / "run"
    overrides = {**SHRINK, f"{section}.graph": True, f"{section}.steps": 2}  # two steps: the path, not the model
    synthesizer = Synthesizer.from_config(preset, overrides).fit(out=out)  # the runner checks the plan
    log = (out / "log.txt").read_text()
    assert "runs eagerly" not in log
    assert "uncaptured" in log  # the fixed-shape step, without CUDA-graph capture on the CPU
    ledger = json.loads((out / "ledger.json").read_text())
    assert all(m["steps"] > 0 for m in ledger["mechanisms"])
    assert synthesizer.privacy["epsilon"] <= synthesizer.config["privacy"]["epsilon"]
