"""The run directory: opening a run, its config, its data, and the one file that holds its privacy ledger.

Shared by the runner (``run``, ``--resume``, ``generate``) and by evaluation and audit, which must
never import the runner. Layout (docs/privacy.md, "Trust boundary"):

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

from dpsynth.checkpoint import CheckpointManager, CurveLog
from dpsynth.errors import ConfigError, DPSynthError, PrivacyError

LEDGER_FILE = "ledger.json"
PRIVACY_FILE = "privacy.json"
DIAGNOSTICS_DIR = "diagnostics"
LOG_FILE = "log.txt"
FIGURES_DIR = "figures"
#: ``data.private`` / ``data.public`` of a run fitted on in-memory arrays (the Python API)
IN_MEMORY = "<arrays>"

# A safety net for log lines that quote a figure computed on private data without noise; methods
# should mark such lines themselves with ``ctx.log(message, private=True)``.
PRIVATE_LINE = re.compile(
    r"\b(test|val|validation|train|training)\s+(split\s+|set\s+)?(accuracy|loss)\b", re.IGNORECASE
)


# ------------------------------------------------------------------ config, data, ledger


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved ``config.yaml`` of a run directory."""
    from dpsynth.config import resolve_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise DPSynthError(f"{run_dir} is not a run directory (no config.yaml)")
    return resolve_config(yaml.safe_load(path.read_text()))


def load_private_splits(config: dict[str, Any]) -> Any:
    """The private train/val/test splits exactly as the run with ``config`` loads them."""
    from dpsynth.data import load_private
    from dpsynth.data.loading import private_options

    return load_private(config["data"]["private"], **private_options(config["data"]))


def load_run_data(config: dict[str, Any], splits: Any = None) -> tuple[Any, Any]:
    """Load the private splits (unless given) and the public set named by ``config['data']``; public
    images that also appear in the private splits are refused unless ``data.allow_overlap``."""
    from dpsynth.data.loading import load_for_run

    data_cfg = dict(config["data"])
    if data_cfg["public"] == IN_MEMORY:  # handed to the Python API as arrays, attached by the caller
        data_cfg["public"] = None
    splits, public, _ = load_for_run(data_cfg, splits)
    return splits, public


def make_ledger(config: dict[str, Any]) -> Any:
    """A fresh, empty ledger with the budget of ``config['privacy']``; a method's explicitly unsound opt-in
    (``Method.ledger_guarantee``, e.g. DPPM's randomized response) gets one that claims no ε."""
    from dpsynth.methods import get_method
    from dpsynth.privacy import PrivacyLedger

    privacy = config["privacy"]
    method = get_method(config["method"])
    guarantee = method.ledger_guarantee(config[method.name])
    target = privacy["epsilon"] if guarantee == "dp" else None
    return PrivacyLedger(target, privacy["delta"], accountant=privacy["accountant"], guarantee=guarantee)


def restore_ledger(run_dir: str | Path, config: dict[str, Any], allow_lagging_privacy: bool = False) -> Any:
    """The run's ledger, restored from ``ledger.json`` and checked against ``privacy.json`` and the config.

    Refuses (``PrivacyError``, one line) when the state is missing or unreadable, when its budget is not
    the config's, or when it does not match ``privacy.json``: continuing from a wrong state could
    rewrite ``privacy.json`` with a smaller ε. ``allow_lagging_privacy`` (``--resume`` only) accepts a
    ``privacy.json`` that is missing or records a prefix of the state: a crash between the two writes.
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
    _check_budget(ledger, make_ledger(config), path)
    check_privacy_json(run_dir, ledger, allow_lagging=allow_lagging_privacy)
    return ledger


def _check_budget(ledger: Any, configured: Any, path: Path) -> None:
    # A state that claims no guarantee can never over-state privacy, whatever the config's budget says.
    fields = ("delta", "accountant") + (("guarantee", "target_epsilon") if ledger.guarantee == "dp" else ())
    for field in fields:
        if getattr(ledger, field) != getattr(configured, field):
            raise PrivacyError(
                f"{path} has {field}={getattr(ledger, field)!r} but config.yaml has "
                f"{getattr(configured, field)!r}; the ledger state belongs to another run"
            )


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
        from dpsynth.checkpoint import atomic_write_json

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


# ------------------------------------------------------------------ the run context


def resolve_device(name: str) -> Any:
    """The run's device; under torchrun a bare ``cuda`` (or ``auto``) is this process's ``cuda:LOCAL_RANK``."""
    import torch

    from dpsynth.dpsgd.distributed import local_device

    if name == "auto":
        return local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if name == "cuda":
        name = str(local_device(torch.device("cuda")))
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but no CUDA device is available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}") from None


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


def build_context(
    config: dict[str, Any],
    run_dir: Path,
    splits: Any,
    public: Any,
    ledger: Any,
    echo: bool = True,
    store: LedgerStore | None = None,
    plan: Any = None,
    scratch: Path | None = None,
) -> Any:
    """The :class:`RunContext` of a run; ``store`` (default: a new one) orders its writes after the ledger's.

    A store with ``writer=False`` (a torchrun rank other than 0) gives a context that writes nothing
    under ``run_dir``: no log, curve or checkpoint files, and ``ctx.run_dir`` is the rank's own
    ``scratch`` directory, so a method writing a figure there cannot touch the run either.
    """
    from dpsynth.methods import RunContext, get_method

    method = get_method(config["method"])
    store = store or LedgerStore(run_dir, ledger)
    writer = store.writer
    if not writer and scratch is None:
        raise ConfigError("a context that does not write the run needs a scratch directory")
    return RunContext(
        config=config,
        section=config[method.name],
        run_dir=run_dir if writer else scratch,
        data=splits,
        public=public,
        ledger=ledger,
        device=resolve_device(config["device"]),
        seed=int(config["seed"]),
        log=RunLog(run_dir, echo=echo and writer, store=store),
        checkpoints=(CheckpointManager if writer else ReadOnlyCheckpoints)(run_dir / "checkpoints", ledger, store),
        curves=(CurveLog if writer else DiscardedCurves)(run_dir / "curves.jsonl", store=store),
        plan=plan,
    )


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


def open_run(run_dir: str | Path, echo: bool = True, private: Any = None) -> tuple[Any, Any]:
    """Rebuild the context of a finished run (generate, evaluate, audit): its data and its verified ledger.

    Refuses when ``ledger.json`` is missing or does not match ``privacy.json`` (:func:`restore_ledger`).
    ``private`` replaces loading the private splits (a run fitted on in-memory arrays).
    """
    from dpsynth.methods import get_method

    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    ledger = restore_ledger(run_dir, config)
    splits, public = load_run_data(config, private)
    store = LedgerStore(run_dir, ledger)
    store.assume_stored()  # restore_ledger verified it equal to the files on disk
    ctx = build_context(config, run_dir, splits, public, ledger, echo=echo, store=store)
    return ctx, get_method(config["method"])()
