"""The run directory module: the stored ledger state, its checks against privacy.json, write ordering, layering."""

import ast
import json
from pathlib import Path

import pytest

from dpsynth.errors import PrivacyError
from dpsynth.privacy import PrivacyLedger, SubsampledGaussian
from dpsynth.rundir import LedgerStore, RunLog, check_privacy_json, restore_ledger

REPO = Path(__file__).resolve().parents[1]
CONFIG = {
    "method": "dpsgd-classifier",
    "dpsgd-classifier": {},
    "privacy": {"epsilon": 5.0, "delta": 1e-5, "accountant": "rdp"},
}  # RDP: fast


def ledger_with_steps(steps: int, epsilon: float = 5.0) -> PrivacyLedger:
    ledger = PrivacyLedger(epsilon, 1e-5, accountant="rdp")
    ledger.register(SubsampledGaussian("dpsgd", 1.0, 0.01, 0))
    if steps:
        ledger.spend("dpsgd", steps)
    return ledger


def test_restore_round_trips_the_stored_state(tmp_path):
    ledger = ledger_with_steps(100)
    ledger.note("a note kept with the state")
    LedgerStore(tmp_path, ledger).persist()
    restored = restore_ledger(tmp_path, CONFIG)
    assert restored.mechanisms() == ledger.mechanisms() and restored.notes == ledger.notes
    assert restored.epsilon() == ledger.epsilon()


def test_restore_refuses_a_state_of_another_budget(tmp_path):
    LedgerStore(tmp_path, ledger_with_steps(10, epsilon=8.0)).persist()
    with pytest.raises(PrivacyError, match="target_epsilon"):
        restore_ledger(tmp_path, CONFIG)


def test_a_lagging_privacy_json_passes_only_for_resume(tmp_path):
    """A crash between writing ledger.json and privacy.json leaves privacy.json behind the state."""
    LedgerStore(tmp_path, ledger_with_steps(10)).persist()
    ahead = ledger_with_steps(20)
    check_privacy_json(tmp_path, ahead, allow_lagging=True)
    with pytest.raises(PrivacyError, match="does not match"):
        check_privacy_json(tmp_path, ahead)
    behind = ledger_with_steps(5)  # privacy.json records more than the state: never acceptable
    with pytest.raises(PrivacyError, match="does not match"):
        check_privacy_json(tmp_path, behind, allow_lagging=True)
    (tmp_path / "privacy.json").unlink()
    check_privacy_json(tmp_path, ahead, allow_lagging=True)
    with pytest.raises(PrivacyError, match="missing"):
        check_privacy_json(tmp_path, ahead)


def test_log_lines_wait_for_the_state_they_follow(tmp_path):
    ledger = ledger_with_steps(0)
    store = LedgerStore(tmp_path, ledger)
    store.persist()
    log = RunLog(tmp_path, echo=False, store=store)
    log("before any step")
    assert "before any step" in (tmp_path / "log.txt").read_text()
    ledger.spend("dpsgd", 3)
    log("after three steps")
    log("quotes a private figure", private=True)
    assert "after three steps" not in (tmp_path / "log.txt").read_text()  # held: ledger.json says 0 steps
    store.persist()
    assert json.loads((tmp_path / "ledger.json").read_text())["mechanisms"][0]["steps"] == 3
    released = (tmp_path / "log.txt").read_text()
    assert "after three steps" in released and "quotes a private figure" not in released
    full = (tmp_path / "diagnostics" / "log.txt").read_text().splitlines()
    assert [line.split("] ", 1)[1] for line in full] == [
        "before any step",
        "after three steps",
        "quotes a private figure",
    ]


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


# eval/audit.py is being reorganised elsewhere; it must import open_run from dpsynth.rundir too, after
# which this set is empty.
AWAITING_RUNDIR: set[str] = set()


def test_evaluation_never_imports_the_runner():
    """Run-directory concerns live in dpsynth.rundir, so eval/* and the runner import each other in one direction."""
    offenders = {
        path.name for path in (REPO / "dpsynth" / "eval").glob("*.py") if "dpsynth.runner" in _imported_modules(path)
    }
    assert offenders <= AWAITING_RUNDIR, offenders
    assert "dpsynth.runner" not in _imported_modules(REPO / "dpsynth" / "rundir.py")
