"""Every DP-SGD family supplies a device-side batch builder: with ``graph: true`` its runs take the fixed-shape
step (uncaptured on the CPU, captured on CUDA), never the eager fallback, and spend exactly their plan."""

from __future__ import annotations

import json

import pytest

from dpsynth.api import Synthesizer

# preset, the section holding its DP-SGD keys (dppm: the score network's training section)
FAMILIES = [
    ("dpsgd-classifier/smoke", "dpsgd-classifier"),
    ("dp-gan/smoke", "dp-gan"),
    ("dppm/smoke", "dppm.training"),
]


@pytest.mark.parametrize(("preset", "section"), FAMILIES, ids=[p for p, _ in FAMILIES])
def test_a_graph_run_takes_the_fixed_shape_step_and_spends_what_the_eager_run_spends(tmp_path, preset, section):
    def run(graph: bool) -> tuple[str, list[tuple[str, int, float]]]:
        out = tmp_path / f"graph-{graph}"
        Synthesizer.from_config(preset, [f"{section}.graph={str(graph).lower()}"]).fit(out=out)
        ledger = json.loads((out / "ledger.json").read_text())
        spent = [(m["name"], m["steps"], m["noise_multiplier"]) for m in ledger["mechanisms"]]
        return (out / "log.txt").read_text(), spent

    graph_log, graph_spent = run(True)
    assert "runs eagerly" not in graph_log
    assert "uncaptured" in graph_log  # the fixed-shape step, without CUDA-graph capture on the CPU
    eager_log, eager_spent = run(False)
    assert "uncaptured" not in eager_log
    assert graph_spent == eager_spent  # the same mechanisms, steps and sigma: the step's form is not the plan's
