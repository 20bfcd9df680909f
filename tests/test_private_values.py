"""Private values never reach an error message, the console or the bench's results JSON (docs/privacy.md).

Each test plants distinctive private values (a label 987654, a pixel 123.456, an overlap of 7 records,
a secret a run prints) and checks that the message, the console or the JSON names the problem without
quoting any of them.
"""

import json
import sys

import pytest

from dpsynth.bench import load_suite
from dpsynth.bench.cells import FAILED, OVER_BUDGET, RUN_FAILED, PlannedRun, execute, plan_runs, write_record
from dpsynth.bench.table import cell_results, write_results
from dpsynth.privacy import PrivacyLedger
from dpsynth.rundir import LedgerStore, RunLog

SECRET = "987654"  # a private value a run prints or raises


# ------------------------------------------------------------------ RunLog


@pytest.mark.parametrize("store", [False, True])
def test_private_log_lines_stay_in_diagnostics_and_off_the_console(tmp_path, capfd, store):
    ledger_store = None
    if store:
        ledger_store = LedgerStore(tmp_path, PrivacyLedger(1.0, 1e-5, accountant="rdp"))
        ledger_store.persist()
    log = RunLog(tmp_path, echo=True, store=ledger_store)
    log("step 10 of 100, epsilon 0.5")
    log(f"test accuracy of the classifier: {SECRET} %", private=True)
    log(f"validation accuracy {SECRET}")  # caught by PRIVATE_LINE, not marked by the caller
    console = capfd.readouterr()
    assert "step 10 of 100" in console.err
    assert SECRET not in console.err + console.out
    assert SECRET not in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "diagnostics" / "log.txt").read_text().count(SECRET) == 2


# ------------------------------------------------------------------ bench results

SUITE = """dataset: mnist10k
settings: {pipeline_seeds: 1}
methods:
  - method: dpsgd-classifier
    estimated_minutes: 1
    presets:
      10: dpsgd-classifier/smoke
"""


class _FailingRun(PlannedRun):
    """A planned run whose command prints a private value and dies with it in its exception."""

    def run_command(self, resume: bool = False) -> list[str]:
        # the value is computed, so that the command (which the record keeps) does not quote it
        script = (
            "import sys; value = 987000 + 654; print(f'label {value} of record 3', file=sys.stderr); "
            "raise ValueError(f'pixel {value}')"
        )
        return [sys.executable, "-c", script]


def _planned(tmp_path) -> PlannedRun:
    (tmp_path / "suite.yaml").write_text(SUITE)
    suite = load_suite(tmp_path / "suite.yaml")
    [run] = plan_runs(suite, list(suite.cells), tmp_path / "out")
    return suite, run


def test_a_failing_run_leaves_no_private_output_in_its_record_or_the_results_json(tmp_path, monkeypatch):
    import dpsynth.bench.cells as cells

    monkeypatch.setattr(cells, "machine", lambda: {"cpu": "test"})
    suite, planned = _planned(tmp_path)
    run = _FailingRun(planned.cell, planned.seed, planned.run_dir, planned.overrides, planned.canary)
    record = execute(run, budget_s=600.0, log=lambda line: None)
    assert SECRET in run.log_path.read_text()  # the detail is kept beside the run, for the custodian
    assert record["status"] == FAILED and record["error"] == RUN_FAILED and record["exit_status"] == 1
    assert SECRET not in run.record_path.read_text()
    results = write_results(tmp_path / "results.json", suite, cell_results(suite, [run]))
    text = results.read_text()
    assert SECRET not in text
    [entry] = json.loads(text)["cells"][0]["runs"]
    assert entry["error"] == RUN_FAILED and entry["exit_status"] == 1


@pytest.mark.parametrize("status", [FAILED, OVER_BUDGET])
def test_an_older_record_with_raw_output_is_reduced_to_its_category(tmp_path, status):
    suite, run = _planned(tmp_path)
    attempt = {"wall_s": 1.0, "peak_mib": 1.0, "returncode": 1, "timed_out": False, "command": ""}
    raw = f"Traceback ... | DataError: label {SECRET} | pixel {SECRET}"
    write_record(run, {"run": run.name, "status": status, "steps": {"run": {"attempts": [attempt]}}, "error": raw})
    text = write_results(tmp_path / "results.json", suite, cell_results(suite, [run])).read_text()
    assert SECRET not in text
    assert "see the run's log" in json.loads(text)["cells"][0]["runs"][0]["error"]
