"""Atomic files and resumable checkpoints.

Every file is written to a temporary name in the same directory and moved into place with
``os.replace``, which is atomic on POSIX: a run killed at any moment leaves either the old
checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """Where dpsynth caches public artefacts (glyphs, pre-trained models, Inception statistics):
    ``$DPSYNTH_CACHE`` or ``~/.cache/dpsynth``."""
    return Path(os.environ.get("DPSYNTH_CACHE") or Path.home() / ".cache" / "dpsynth")


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Call ``write(fileobj)`` on a temporary file, fsync it, then move it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), mode="w")


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")


class CheckpointManager:
    """Saves and restores a method's training state under ``run_dir/checkpoints``, one file per phase.

    A method with several phases (a teacher, then statistics, then alignment) saves each under its
    own name, so resuming a later phase never retrains an earlier one. The ledger's state is not
    restored from here: ``ledger.json`` in the run directory is the authority (:mod:`dpsynth.rundir`).
    ``save`` writes that state first (through ``store``), then the log lines and curve records that
    waited for it, then the checkpoint; each file also carries a copy of the ledger state.
    """

    def __init__(self, directory: str | os.PathLike, ledger: Any = None, store: Any = None) -> None:
        self.directory = Path(directory)
        self.ledger = ledger
        self.store = store

    def path(self, phase: str = "main") -> Path:
        return self.directory / f"{phase}.pt"

    def save(self, state: dict[str, Any], phase: str = "main") -> None:
        payload = dict(state)
        payload["__serial__"] = time.time_ns()
        if self.ledger is not None:
            payload["__ledger__"] = self.ledger.state_dict()
        if self.store is not None:  # the state first; the lines and records it covers may follow
            self.store.persist()
        import torch

        atomic_write(self.path(phase), lambda f: torch.save(payload, f))

    def load(self, phase: str = "main") -> dict[str, Any] | None:
        """The last saved state of ``phase``, or None."""
        if not self.path(phase).exists():
            return None
        payload = self._read(self.path(phase))
        payload.pop("__ledger__", None)
        payload.pop("__serial__", None)
        return payload

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        import torch

        return torch.load(path, map_location="cpu", weights_only=False)


class CurveLog:
    """Training curves (ε spent, clip norm, public monitors) as JSON lines in ``curves.jsonl`` for the report.

    With a ``store`` (:class:`dpsynth.rundir.LedgerStore`) a record is written only once the ledger
    state that covers its step is on disk, so the curves never run ahead of the accounting.
    """

    def __init__(self, path: str | os.PathLike, store: Any = None) -> None:
        self.path = Path(path)
        self.store = store

    def log(self, step: int, **values: float) -> None:
        record = {"step": int(step), **{k: float(v) for k, v in values.items()}}

        def write() -> None:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

        if self.store is None:
            write()
        else:
            self.store.write_after_state(write)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint so curves are not logged twice."""
        if not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
        ]
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def read(self) -> list[dict[str, float]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
