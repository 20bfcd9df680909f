"""Running a suite's cells: one ``dpsynth run`` subprocess per pipeline seed, resumable, under a budget.

Each run writes a normal run directory, ``OUT/SUITE/<name>_eps<e>[_seed<s>]/``, and the bench keeps its
own record beside it, ``<run dir>.json``: the attempts of each step (wall time, peak memory, exit status)
and, once the run finished, a snapshot of the numbers the run itself reported (``privacy.json``,
``diagnostics/metrics.json``, ``diagnostics/audit.json``). The snapshot is taken as soon as a step ends,
so a later ``dpsynth evaluate`` with other settings cannot change the table.

A run's steps: ``run`` (``dpsynth run PRESET --out DIR --set ...``; the bench only adds overrides of the
run's ``evaluate`` section, so the run's own evaluation reports the suite's metrics) and, for the first
pipeline seed of a cell when the suite asks for it, ``canary`` (``dpsynth evaluate DIR --metrics canary``).
A run directory holding ``config.yaml`` without a finished record is continued with ``--resume``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpsynth.bench.suite import RUNS_PLACEHOLDER, Cell, Suite
from dpsynth.checkpoint import atomic_write_json
from dpsynth.config import load_config
from dpsynth.context import read_run_config
from dpsynth.errors import DataError, DPSynthError
from dpsynth.report.html import flatten
from dpsynth.rundir import is_run_dir
from dpsynth.sections import RunConfig

FINISHED, FAILED, OVER_BUDGET, PENDING = "finished", "failed", "over_budget", "pending"
#: what a record (and so the results JSON) says about a step that went wrong: a fixed category and the
#: exit status, never the run's output or an exception's text, which may quote private values
#: (docs/privacy.md); the detail stays in ``<run dir>.log`` and the run's ``diagnostics/``
RUN_FAILED = "failed: see the run's log and its diagnostics/ (private)"
RUN_STOPPED = "stopped at the run budget: see the run's log and its diagnostics/ (private)"
NO_OUTPUTS = "exited cleanly without the outputs the bench reads: see the run's log and its diagnostics/ (private)"
ERROR_CATEGORIES = (RUN_FAILED, RUN_STOPPED, NO_OUTPUTS)
#: seconds a run gets to stop after SIGINT at its budget (it keeps its checkpoints) before SIGKILL
STOP_GRACE_S = 30.0
POLL_S = 0.1
#: directory (under OUT/SUITE) of the Inception features of the suite's private FID reference images
PRIVATE_FEATURES = "private-inception"


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """One pipeline seed of a cell: the commands to run and where."""

    cell: Cell
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]  # every --set of the run command
    canary: bool

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def record_path(self) -> Path:
        return self.run_dir.with_name(self.run_dir.name + ".json")

    @property
    def log_path(self) -> Path:
        return self.run_dir.with_name(self.run_dir.name + ".log")

    def run_command(self, resume: bool = False) -> list[str]:
        command = ["dpsynth", "run", self.cell.preset, "--out", str(self.run_dir)]
        command += [arg for item in self.overrides for arg in ("--set", item)]
        return command + (["--resume"] if resume else [])

    def canary_command(self) -> list[str]:
        return ["dpsynth", "evaluate", str(self.run_dir), "--metrics", "canary", "--json"]

    def changed_settings(self) -> list[str]:
        """The dotted keys whose value in the run's own ``config.yaml`` differs from what its preset and
        overrides resolve to now: a finished run made from an older version of its preset."""
        import yaml

        try:
            saved = dict(flatten(read_run_config(self.run_dir).to_dict()))
            planned = dict(flatten(load_config(self.cell.preset, list(self.overrides)).to_dict()))
        except (OSError, yaml.YAMLError, DPSynthError):  # no saved config, or a file the run read is gone
            return []
        return sorted(key for key in saved.keys() | planned.keys() if saved.get(key) != planned.get(key))

    def steps(self) -> list[str]:
        return ["run", "canary"] if self.canary else ["run"]

    def shell_command(self) -> str:
        """The exact shell command that reproduces this run (and its canary audit)."""
        commands = [self.run_command()] + ([self.canary_command()] if self.canary else [])
        return " && ".join(shlex.join(command) for command in commands)


def plan_runs(suite: Suite, cells: list[Cell], out: Path, extra: list[str] | None = None) -> list[PlannedRun]:
    """The runs of ``cells``: pipeline seeds per cell by its estimated cost, the bench's evaluation overrides."""
    settings = suite.settings
    runs = []
    for cell in cells:
        preset_config = load_config(cell.preset, cell.checked_overrides)
        own = [item.replace(RUNS_PLACEHOLDER, str(out / suite.name)) for item in cell.overrides]
        count = settings.pipeline_seeds if cell.estimated_minutes < settings.cheap_run_minutes else 1
        first = preset_config.seed
        for seed in range(first, first + count):
            suffix = f"_seed{seed}" if count > 1 else ""
            overrides = [*evaluation_overrides(suite, cell, preset_config, out), *own, *(extra or [])]
            if seed != first:
                overrides.append(f"seed={seed}")
            runs.append(
                PlannedRun(
                    cell=cell,
                    seed=seed,
                    run_dir=out / suite.name / f"{cell.label}_eps{cell.epsilon:g}{suffix}",
                    overrides=tuple(overrides),
                    canary=settings.canary and seed == first,
                )
            )
    return runs


def evaluation_overrides(suite: Suite, cell: Cell, config: RunConfig, out: Path) -> list[str]:
    """``--set evaluate.*`` items that make the run's own evaluation report the suite's metrics.

    Only keys whose value differs from the preset's are set, so a preset that already evaluates as
    the suite asks runs unchanged. A method that releases a model (the DP-SGD baseline) reports its
    test accuracy itself and gets none."""
    from dpsynth.methods import get_method

    if get_method(cell.method).releases != "samples":
        return []
    settings, current = suite.settings, config.evaluate.model_dump()
    wanted = {
        "metrics": list(dict.fromkeys([*current["metrics"], *settings.metrics])),
        "seeds": settings.classifier_seeds,
    }
    if "fid" in settings.metrics:
        wanted.update(fid_samples=settings.fid_samples, fid_reference=settings.fid_reference)
        # every run of the suite compares with the same real images: their (private) features are
        # extracted once, kept beside the suite's runs
        wanted["fid_cache"] = str(out / suite.name / PRIVATE_FEATURES)
    return [f"evaluate.{key}={_flow(value)}" for key, value in wanted.items() if current.get(key) != value]


def _flow(value: Any) -> str:
    return f"[{','.join(str(item) for item in value)}]" if isinstance(value, list) else str(value)


# ------------------------------------------------------------------------------ records
def read_record(run: PlannedRun) -> dict[str, Any]:
    if not run.record_path.is_file():
        return {"run": run.name, "status": PENDING, "steps": {}}
    try:
        return json.loads(run.record_path.read_text())
    except json.JSONDecodeError:
        raise DataError(f"{run.record_path}: not readable JSON; delete it to rerun {run.name}") from None


def write_record(run: PlannedRun, record: dict[str, Any]) -> None:
    atomic_write_json(run.record_path, record)


def step_wall(record: dict[str, Any], step: str) -> float:
    return float(sum(a["wall_s"] for a in record["steps"].get(step, {}).get("attempts", [])))


def spent_seconds(runs: list[PlannedRun]) -> float:
    """Wall seconds recorded so far by the suite's runs (every step, every attempt)."""
    return sum(step_wall(record, step) for run in runs for record in [read_record(run)] for step in record["steps"])


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": gpu,
        "cuda": torch.version.cuda if gpu else None,  # the CUDA build the GPU figures were measured with
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------ running
@dataclasses.dataclass
class Attempt:
    wall_s: float
    peak_mib: float | None
    returncode: int
    timed_out: bool
    command: str
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def execute(run: PlannedRun, budget_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Do the steps of ``run`` that are not done yet; return its updated record.

    The ``run`` step gets ``budget_s`` wall seconds in all, over every attempt; past it the run is
    stopped (it keeps its checkpoints) and recorded as over budget. A later call with a larger
    budget continues it with ``--resume``."""
    record = read_record(run)
    record.setdefault("machine", machine())
    for step in run.steps():
        state = record["steps"].setdefault(step, {"attempts": [], "done": False})
        if state["done"]:
            continue
        left = budget_s - step_wall(record, "run") if step == "run" else None
        if left is not None and left <= 0:
            record["status"] = OVER_BUDGET
            write_record(run, record)
            return record
        argv = run.run_command(resume=is_run_dir(run.run_dir)) if step == "run" else None
        argv = argv or run.canary_command()
        log(f"{run.name}: {shlex.join(argv)}")
        attempt = _attempt(argv, run.log_path, left)
        state["attempts"].append(attempt.to_dict())
        if attempt.interrupted:  # Ctrl-C of the bench: keep the attempt's time, then stop
            record["status"] = PENDING
            write_record(run, record)
            raise KeyboardInterrupt
        if attempt.returncode != 0:
            record["status"] = OVER_BUDGET if attempt.timed_out else FAILED
            record["error"] = RUN_STOPPED if attempt.timed_out else RUN_FAILED
            record["exit_status"] = attempt.returncode
            write_record(run, record)
            return record
        try:
            record.update(snapshot(run, step, record.get("result", {})))
        except DataError as exc:  # the step exited cleanly but left no figures to report
            log(f"{run.name}: {exc}")  # which output is missing (bench's own messages): the console only
            record["status"], record["error"], record["exit_status"] = FAILED, NO_OUTPUTS, 0
            write_record(run, record)
            return record
        state["done"] = True
        write_record(run, record)
    record["status"] = FINISHED
    record.pop("error", None)
    record.pop("exit_status", None)
    write_record(run, record)
    return record


def snapshot(run: PlannedRun, step: str, result: dict[str, Any]) -> dict[str, Any]:
    """The numbers the run reported itself, read right after ``step``."""
    from dpsynth.bench.readout import read_canary, read_run_outputs

    if step == "run":
        return {"result": read_run_outputs(run.run_dir)}
    return {"result": {**result, "canary": read_canary(run.run_dir)}}


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so that Python turns it into KeyboardInterrupt.

    A shell starts background jobs (``nohup dpsynth bench ... &``) with SIGINT ignored, children inherit
    that, and a Python started with SIGINT ignored never installs its handler: the budget's SIGINT would do
    nothing and the run would only stop at the SIGKILL after the grace period, its last checkpoint unsaved."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _attempt(argv: list[str], log_path: Path, timeout_s: float | None) -> Attempt:
    """Run ``argv`` (``dpsynth ...`` as ``python -m dpsynth ...``), its output appended to ``log_path``.

    The peak memory is the child's own high-water mark: ``VmHWM`` of ``/proc/PID/status`` (Linux),
    polled while it runs, else its ``ru_maxrss`` from ``os.wait4``. Not ``ru_maxrss`` alone: Linux folds
    the parent's resident set at fork into the child's ``ru_maxrss``, and this parent holds torch."""
    executable = [sys.executable, "-m", "dpsynth", *argv[1:]] if argv[0] == "dpsynth" else argv
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("a") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        process = subprocess.Popen(executable, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_default_sigint)
        try:
            status, usage, timed_out, hwm_kib = _wait(process, None if timeout_s is None else started + timeout_s)
        except KeyboardInterrupt:
            _stop(process)
            wall = round(time.monotonic() - started, 3)
            return Attempt(wall, None, 130, False, shlex.join(argv), interrupted=True)
    process.returncode = os.waitstatus_to_exitcode(status)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    peak_bytes = hwm_kib * 1024 if hwm_kib else usage.ru_maxrss * scale
    return Attempt(
        wall_s=round(time.monotonic() - started, 3),
        peak_mib=round(peak_bytes / 2**20, 1),
        returncode=process.returncode if not timed_out or process.returncode != 0 else 124,
        timed_out=timed_out,
        command=shlex.join(argv),
    )


def _wait(process: subprocess.Popen, deadline: float | None) -> tuple[int, Any, bool, int]:
    """(wait status, rusage, whether the deadline passed, the largest VmHWM seen in KiB or 0)."""
    timed_out, stop_sent, hwm_kib = False, 0.0, 0
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            return status, usage, timed_out, hwm_kib
        hwm_kib = max(hwm_kib, _high_water_kib(process.pid))
        now = time.monotonic()
        if deadline is not None and now > deadline and not timed_out:
            timed_out, stop_sent = True, now
            process.send_signal(signal.SIGINT)  # the run stops as on Ctrl-C, its checkpoints kept
        elif timed_out and now > stop_sent + STOP_GRACE_S:
            process.kill()
        time.sleep(POLL_S)


def _high_water_kib(pid: int) -> int:
    """The process' peak resident set (``VmHWM``) in KiB; 0 where /proc does not tell."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
