"""The run directory on disk: its file names, its one reader of ``config.yaml``, and its ledger files.

Low-level: this module imports nothing above :mod:`dpsynth.privacy`. Opening a run (resolving its
config, loading its data, building its :class:`~dpsynth.contract.RunContext`) is :mod:`dpsynth.context`;
running one is :mod:`dpsynth.runner`. Every file name of a run directory is spelled here, once.
Layout (docs/privacy.md, "Trust boundary"):

* the release: ``samples.npz``/``.png``, ``privacy.json``, ``config.yaml``, ``curves.jsonl``,
  ``log.txt`` (lines that quote no private value), ``figures/``, ``report-release.html``;
* ``ledger.json``: the ledger's full state (every mechanism in order, repeat counts, notes). It is the
  authority on the privacy spent: every command that continues a run restores the ledger from it and
  refuses when it is missing or disagrees with ``privacy.json``. A run killed at any moment leaves a
  ledger state at least as large as anything the log, the curves or the metrics quote (``LedgerStore``);
* ``diagnostics/``: figures computed from private data without noise (metrics, audit, the full log,
  Inception features of private images). They are for the data custodian and are not covered by ε.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from dpsynth.checkpoint import CheckpointManager, CurveLog, atomic_write_json, atomic_write_text
from dpsynth.errors import DataError, PrivacyError

# ------------------------------------------------------------------ file names

CONFIG_FILE = "config.yaml"  # the resolved config (read by read_config_file alone)
LEDGER_FILE = "ledger.json"
PRIVACY_FILE = "privacy.json"
SAMPLES_FILE = "samples.npz"  # the samples.npz contract; its class grid is samples.png beside it
CURVES_FILE = "curves.jsonl"
LOG_FILE = "log.txt"
FIGURES_DIR = "figures"
CHECKPOINTS_DIR = "checkpoints"
REPORT_FILE = "report.html"
RELEASE_REPORT_FILE = "report-release.html"
SELECTION_FILE = "selection.json"  # PrivImage's released selection
DATASET_FILE = "dataset.json"  # image shape and classes of an arrays run: what generation needs
DPIMAGEBENCH_SAMPLES = "gen/gen.npz"  # where DPImageBench's eval.py looks for samples
DIAGNOSTICS_DIR = "diagnostics"
METRICS_FILE = "metrics.json"  # under diagnostics/
AUDIT_FILE = "audit.json"  # under diagnostics/
INCEPTION_CACHE_DIR = f"{DIAGNOSTICS_DIR}/inception"  # Inception features of private images
#: ``data.private`` / ``data.public`` of a run fitted on in-memory arrays (the Python API)
IN_MEMORY = "<arrays>"

# A safety net for log lines that quote a figure computed on private data without noise; methods
# should mark such lines themselves with ``ctx.log(message, private=True)``.
PRIVATE_LINE = re.compile(
    r"\b(test|val|validation|train|training)\s+(split\s+|set\s+)?(accuracy|loss)\b", re.IGNORECASE
)


# ------------------------------------------------------------------ config.yaml


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a run's ``config.yaml``."""
    return (Path(path) / CONFIG_FILE).is_file()


def read_config_text(run_dir: str | Path, errors: str = "strict") -> str:
    """The text of ``run_dir/config.yaml``; DataError when it is missing (the one place that opens it)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise DataError(f"{run_dir} is not a run directory (no {CONFIG_FILE})")
    return path.read_text(errors=errors)


def read_config_file(run_dir: str | Path) -> dict[str, Any]:
    """``run_dir/config.yaml`` as written, not resolved (:func:`dpsynth.context.read_run_config` resolves it).

    DataError when it is missing; ``yaml.YAMLError`` when it is not YAML; an empty file is ``{}``.
    """
    return yaml.safe_load(read_config_text(run_dir)) or {}


def write_config_file(run_dir: str | Path, config: dict[str, Any]) -> None:
    """Write ``run_dir/config.yaml`` atomically."""
    atomic_write_text(Path(run_dir) / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))


# ------------------------------------------------------------------ ledger.json and privacy.json


def read_ledger(run_dir: str | Path) -> Any:
    """The :class:`~dpsynth.privacy.PrivacyLedger` stored in ``run_dir/ledger.json``, not yet checked.

    PrivacyError (one line) when the state is missing or unreadable: continuing from an empty ledger
    would under-state the privacy spent.
    """
    from dpsynth.privacy import PrivacyLedger

    run_dir = Path(run_dir)
    path = run_dir / LEDGER_FILE
    if not path.is_file():
        raise PrivacyError(
            f"{run_dir} has no {LEDGER_FILE} (the privacy ledger state); refusing to continue "
            f"from an empty ledger, which would under-state the privacy spent"
        )
    try:
        state = json.loads(path.read_text())
        ledger = PrivacyLedger(
            state["target_epsilon"], state["delta"], accountant=state["accountant"], guarantee=state["guarantee"]
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PrivacyError(f"{path} is not a readable ledger state ({exc.__class__.__name__})") from None
    ledger.load_state_dict(state)
    return ledger


def check_privacy_json(run_dir: str | Path, ledger: Any, allow_lagging: bool = False) -> None:
    """Refuse unless ``privacy.json`` states exactly the ledger's composition (same mechanisms, same ε).

    With ``allow_lagging``, a missing ``privacy.json`` or one recording less than the state passes.
    """
    path = Path(run_dir) / PRIVACY_FILE
    if not path.is_file():
        if allow_lagging:
            return
        raise PrivacyError(f"{path} is missing but {LEDGER_FILE} is not; resume the run to rewrite it")
    try:
        written = json.loads(path.read_text())
        recorded = list(written["mechanisms"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PrivacyError(f"{path} is not a readable privacy statement ({exc.__class__.__name__})") from None
    state = [m.to_dict() for m in ledger.mechanisms()]
    epsilon = ledger.epsilon()
    if (
        recorded == state
        and written.get("guarantee") == ledger.guarantee
        and _same_epsilon(written.get("epsilon"), epsilon)
    ):
        return
    if allow_lagging and _is_prefix_of(recorded, state) and _at_most(written.get("epsilon"), epsilon):
        return
    raise PrivacyError(
        f"{path} (epsilon={written.get('epsilon')}, {len(recorded)} mechanisms) does not match "
        f"{LEDGER_FILE} (epsilon={epsilon}, {len(state)} mechanisms); refusing to rewrite it"
    )


def _same_epsilon(written: Any, composed: float | None) -> bool:
    if written is None or composed is None:
        return written is None and composed is None
    return isinstance(written, (int, float)) and math.isclose(written, composed, rel_tol=1e-9, abs_tol=1e-12)


def _at_most(written: Any, composed: float | None) -> bool:
    if written is None or composed is None:
        return written is None and composed is None
    return isinstance(written, (int, float)) and written <= composed + 1e-12


def _is_prefix_of(recorded: list[dict], state: list[dict]) -> bool:
    """Every recorded mechanism is in the state, with the same parameters and no more repeats."""
    by_name = {m["name"]: m for m in state}
    for mechanism in recorded:
        current = by_name.get(mechanism.get("name"))
        if current is None:
            return False
        count = "steps" if "steps" in mechanism else "count"
        same = {k: v for k, v in mechanism.items() if k != count} == {k: v for k, v in current.items() if k != count}
        if not same or mechanism.get(count, 0) > current.get(count, 0):
            return False
    return True


class LedgerStore:
    """Writes a run's ledger state (``ledger.json``, then ``privacy.json``) and orders the run's other writes.

    Log lines and curve records pass through :meth:`write_after_state`: written at once when the
    ledger on disk is the ledger in memory, otherwise held until the next :meth:`persist`, so no
    file ever quotes a step the stored state has not recorded (a crash loses the held lines, never
    the accounting).
    """

    def __init__(self, run_dir: str | Path, ledger: Any, writer: bool = True) -> None:
        self.run_dir, self.ledger = Path(run_dir), ledger
        self.writer = writer  # False on every torchrun rank but 0: it writes nothing, held lines are dropped
        self._written: dict | None = None
        self._held: list[Callable[[], None]] = []

    def persist(self) -> None:
        """Write the state if it changed since the last write; then the writes held for it."""
        if not self.writer:
            return
        state = self.ledger.state_dict()
        if state != self._written:
            atomic_write_json(self.run_dir / LEDGER_FILE, state)
            self.ledger.write(self.run_dir / PRIVACY_FILE)
            self._written = state
        self.flush()

    def assume_stored(self) -> None:
        """Declare the ledger in memory identical to the one on disk (just restored and verified)."""
        self._written = self.ledger.state_dict()

    def is_current(self) -> bool:
        return self._written is not None and self._written == self.ledger.state_dict()

    def write_after_state(self, write: Callable[[], None]) -> None:
        """Run ``write`` now if the stored state is current, else once the state is next persisted."""
        if not self.writer:
            return
        if self.is_current():
            self.flush()
            write()
        else:
            self._held.append(write)

    def flush(self) -> None:
        if not self.is_current():
            return
        held, self._held = self._held, []
        for write in held:
            write()


def diagnostics_dir(run_dir: str | Path) -> Path:
    """``run_dir/diagnostics``: figures computed on private data without noise (created on demand)."""
    path = Path(run_dir) / DIAGNOSTICS_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


# ------------------------------------------------------------------ the run's log, checkpoints and curves


class RunLog:
    """Timestamped lines: every line to ``diagnostics/log.txt``, lines free of private values also to ``log.txt``.

    ``log(message, private=True)`` marks a line that quotes a figure computed on private data without
    noise (a test accuracy, say); lines matching :data:`PRIVATE_LINE` are treated as private too.
    Only the released lines are echoed to stderr: a console is captured (``dpsynth bench`` keeps each
    run's output beside its results), so a private line goes to ``diagnostics/log.txt`` alone, with no
    placeholder (whether a private line is logged at all can depend on the data, e.g. a count of
    non-finite gradients logged only when non-zero). File writes wait for the ledger state
    (:class:`LedgerStore`); the echo does not.
    """

    def __init__(self, run_dir: Path, echo: bool = True, store: LedgerStore | None = None) -> None:
        self.run_dir, self.echo, self.store = Path(run_dir), echo, store
        self.path = self.run_dir / LOG_FILE

    def __call__(self, message: str, private: bool = False) -> None:
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}"
        private = private or bool(PRIVATE_LINE.search(message))
        if self.echo and not private:
            print(line, file=sys.stderr, flush=True)

        def write() -> None:
            targets = [diagnostics_dir(self.run_dir) / LOG_FILE] + ([] if private else [self.path])
            for target in targets:
                with open(target, "a") as handle:
                    handle.write(line + "\n")

        if self.store is None:
            write()
        else:
            self.store.write_after_state(write)


class ReadOnlyCheckpoints(CheckpointManager):
    """Checkpoints as a torchrun rank other than 0 sees them: it may read rank 0's, it never saves."""

    def save(self, state: dict[str, Any], phase: str = "main") -> None:
        return None


class DiscardedCurves(CurveLog):
    """The curves of a torchrun rank other than 0: rank 0 writes the run's."""

    def log(self, step: int, **values: float) -> None:
        return None

    def truncate_after(self, step: int) -> None:
        return None


def verify_run(run_dir: str | Path, **options: Any) -> dict[str, Any]:
    """``dpsynth privacy verify RUN``: :func:`dpsynth.privacy.verify.verify_record` of ``run_dir/privacy.json``
    (``options`` go to it)."""
    from dpsynth.privacy.verify import read_record, verify_record

    return verify_record(read_record(Path(run_dir) / PRIVACY_FILE), **options)
