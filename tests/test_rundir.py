"""The run directory module: the stored ledger state, its checks against privacy.json, write ordering, layering."""

import ast
import json
import re
from pathlib import Path

import pytest

from dpsynth.config import resolve_config
from dpsynth.context import restore_ledger
from dpsynth.errors import PrivacyError
from dpsynth.privacy import PrivacyLedger, SubsampledGaussian
from dpsynth.rundir import LedgerStore, RunLog, check_privacy_json

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
    restored = restore_ledger(tmp_path, resolve_config(CONFIG))
    assert restored.mechanisms() == ledger.mechanisms() and restored.notes == ledger.notes
    assert restored.epsilon() == ledger.epsilon()


def test_restore_refuses_a_state_of_another_budget(tmp_path):
    LedgerStore(tmp_path, ledger_with_steps(10, epsilon=8.0)).persist()
    with pytest.raises(PrivacyError, match="target_epsilon"):
        restore_ledger(tmp_path, resolve_config(CONFIG))


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


#: what dpsynth.rundir may import: it is the low-level half of a run (files), below everything that
#: knows configs, methods or data
RUNDIR_IMPORTS = {"dpsynth.checkpoint", "dpsynth.errors", "dpsynth.privacy", "dpsynth.privacy.verify"}


def test_evaluation_never_imports_the_runner():
    """Opening a run lives in dpsynth.context, so eval/* and the runner import each other in one direction."""
    offenders = {
        path.name for path in (REPO / "dpsynth" / "eval").glob("*.py") if "dpsynth.runner" in _imported_modules(path)
    }
    assert not offenders, offenders
    for module in ("context.py", "rundir.py"):
        imported = _imported_modules(REPO / "dpsynth" / module)
        assert not {name for name in imported if name.startswith(("dpsynth.runner", "dpsynth.eval"))}, module


def test_rundir_imports_nothing_above_privacy():
    imported = {name for name in _imported_modules(REPO / "dpsynth" / "rundir.py") if name.startswith("dpsynth")}
    assert imported <= RUNDIR_IMPORTS, imported - RUNDIR_IMPORTS


#: the run files named in dpsynth.rundir; dpsynth.privacy sits below it and names privacy.json in its messages
RUN_FILES = (
    "config.yaml",
    "ledger.json",
    "privacy.json",
    "samples.npz",
    "curves.jsonl",
    "report.html",
    "report-release.html",
    "dataset.json",
    "metrics.json",
    "audit.json",
    "selection.json",
    "log.txt",
)


def _strings(path: Path) -> list[str]:
    """The string constants of a module, f-string parts included, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_run_file_names_are_spelled_once():
    """Every run file name is a dpsynth.rundir constant; no other module spells it (docstrings aside)."""
    offenders = sorted(
        f"{path.relative_to(REPO)}: {name}"
        for path in (REPO / "dpsynth").rglob("*.py")
        if path.name != "rundir.py" and "privacy" not in path.relative_to(REPO / "dpsynth").parts[:1]
        for text in _strings(path)
        for name in RUN_FILES
        if re.search(rf"(?<![\w.]){re.escape(name)}", text)
    )
    assert not offenders, offenders


def test_only_rundir_reads_config_yaml():
    """``config.yaml`` is opened by dpsynth.rundir.read_config_text alone (read_config_file parses it)."""
    readers = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "dpsynth").rglob("*.py")
        if path.name != "rundir.py" and "CONFIG_FILE" in path.read_text() and "safe_load" in path.read_text()
    )
    assert not readers, readers
