"""The suite's outputs: ``experiments/results/SUITE.json``, the Markdown table between markers, the plot.

One row per cell (entry × ε). With one pipeline seed a cell shows exactly the run's own figures. With
several, accuracy is the mean of the runs' means ± the pooled standard deviation by the law of total
variance (the mean within-run variance plus the variance of the run means: with equal classifier
seeds per run, the population std over every classifier training of every run); FID is the mean
over runs, the spent ε the largest, the canary bound that of the first seed's audit.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from dpsynth.bench.cells import (
    ERROR_CATEGORIES,
    FAILED,
    FINISHED,
    OVER_BUDGET,
    RUN_FAILED,
    RUN_STOPPED,
    PlannedRun,
    read_record,
)
from dpsynth.bench.suite import Cell, Suite
from dpsynth.checkpoint import atomic_write_json, atomic_write_text
from dpsynth.errors import DataError
from dpsynth.rundir import DIAGNOSTICS_DIR, METRICS_FILE, PRIVACY_FILE

DIAGNOSTIC_NOTE = (
    "accuracy (real test split), FID and the canary bound read private data without noise: private "
    "diagnostics for the data custodian, not covered by epsilon"
)
#: marks a table row carried over from the results JSON (:func:`carry_recorded`)
CARRIED_MARK = "†"


def cell_results(suite: Suite, runs: list[PlannedRun]) -> list[dict[str, Any]]:
    """Every cell of ``runs`` with its figures (from each run's record), in suite order."""
    cells: dict[Cell, list[PlannedRun]] = {}
    for run in runs:
        cells.setdefault(run.cell, []).append(run)
    return [_cell_result(suite, cell, members) for cell, members in cells.items()]


def _cell_result(suite: Suite, cell: Cell, runs: list[PlannedRun]) -> dict[str, Any]:
    records = [read_record(run) for run in runs]
    statuses = [record.get("status") for record in records]
    status = FINISHED if all(s == FINISHED for s in statuses) else _worst(statuses)
    per_run = [_run_entry(run, record) for run, record in zip(runs, records)]
    entry: dict[str, Any] = {
        "method": cell.method,
        "name": cell.label,
        "baseline": cell.baseline,
        "preset": cell.preset,
        "status": status,
        "epsilon": {"target": cell.epsilon, "spent": None},
        "accuracy_mean": None,
        "accuracy_std": None,
        "fid": None,
        "canary_epsilon_lower": None,
        "wall_s": None,
        "peak_mib": None,
        "pipeline_seeds": [run.seed for run in runs],
        "classifier_seeds": None,
        "command": " && ".join(run.shell_command() for run in runs),
        "machine": records[0].get("machine"),
        "runs": per_run,
    }
    if status == FINISHED:
        entry.update(_figures([record["result"] for record in records]))
        entry["wall_s"] = round(sum(r["wall_s"] for r in per_run) / len(per_run), 1)
        peaks = [r["peak_mib"] for r in per_run if r["peak_mib"] is not None]
        entry["peak_mib"] = max(peaks) if peaks else None
    return entry


def _worst(statuses: list[str | None]) -> str:
    for status in ("failed", "over_budget"):
        if status in statuses:
            return status
    return "pending"


def _run_entry(run: PlannedRun, record: dict[str, Any]) -> dict[str, Any]:
    attempts = record.get("steps", {}).get("run", {}).get("attempts", [])
    peaks = [a["peak_mib"] for a in attempts if a.get("peak_mib") is not None]
    return {
        "seed": run.seed,
        "run_dir": str(run.run_dir),
        "status": record.get("status"),
        "command": run.shell_command(),
        "wall_s": round(sum(a["wall_s"] for a in attempts), 1),  # the run step, every attempt (resumes)
        "peak_mib": max(peaks) if peaks else None,
        "result": record.get("result"),
        "error": error_category(record),
        "exit_status": record.get("exit_status"),
    }


def error_category(record: dict[str, Any]) -> str | None:
    """The record's error as one of the bench's fixed categories: a record written by an older bench may
    hold the tail of a run's output or an exception's text, which never reach the results JSON."""
    error = record.get("error")
    if error is None or error in ERROR_CATEGORIES:
        return error
    return RUN_STOPPED if record.get("status") == OVER_BUDGET else RUN_FAILED


def _figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    spent = [r["epsilon_spent"] for r in results]
    figures: dict[str, Any] = {
        "epsilon": {
            "target": results[0]["epsilon_target"],
            "spent": None if any(e is None for e in spent) else max(spent),
        },
        "delta": results[0]["delta"],
        "guarantee": results[0]["guarantee"],
    }
    accuracies = [r["accuracy"] for r in results]
    if all(a is not None for a in accuracies):
        mean, std = pooled(accuracies)
        runs = [a.get("runs") for a in accuracies]
        figures.update(
            accuracy_mean=mean,
            accuracy_std=std,
            accuracy_model=accuracies[0]["model"],
            classifier_seeds=len(runs[0]) if runs[0] else None,
        )
    fids = [r.get("fid") for r in results]
    if all(f is not None for f in fids):
        figures["fid"] = sum(fids) / len(fids)
    canary = results[0].get("canary")
    if canary is not None:
        figures["canary"] = canary
        figures["canary_epsilon_lower"] = canary.get("epsilon_lower_bound")
    return figures


def pooled(accuracies: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean of the runs' means and the pooled std (law of total variance); one run: its own mean and std."""
    means = [float(a["mean"]) for a in accuracies]
    if len(means) == 1:
        return means[0], float(accuracies[0]["std"])
    grand = sum(means) / len(means)
    within = sum(float(a["std"]) ** 2 for a in accuracies) / len(accuracies)
    between = sum((m - grand) ** 2 for m in means) / len(means)
    return grand, math.sqrt(within + between)


# ------------------------------------------------------------------------------ recorded cells
def carry_recorded(
    path: Path, suite: Suite, runs: list[PlannedRun], cells: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``cells``, where a cell none of whose runs has a run directory or record here is replaced by the cell
    recorded for it in the results JSON at ``path``, stamped ``carried_over``.

    Run directories are not committed: without this, ``dpsynth bench SUITE --only X`` on a fresh clone would
    blank every row recorded in the JSON. A cell run here is always recomputed from its runs; a recorded cell
    is carried verbatim (never completed or recomputed), and only when it is of the same method, name, ε and
    preset. An unreadable JSON, or one of another suite, carries nothing."""
    recorded = _recorded_cells(path, suite.name)
    here = {run.cell for run in runs if run.run_dir.exists() or run.record_path.exists()}
    planned = dict.fromkeys(run.cell for run in runs)  # the cells of cell_results(suite, runs), in its order
    return [
        fresh if cell in here else _carried(fresh, recorded.get((cell.method, cell.label, cell.epsilon, cell.preset)))
        for cell, fresh in zip(planned, cells, strict=True)
    ]


def _recorded_cells(path: Path, suite_name: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, not UTF-8, not JSON: a fresh table, as without a file
        return {}
    if not isinstance(data, dict) or data.get("suite") != suite_name or not isinstance(data.get("cells"), list):
        return {}
    stamp = {"from": str(path)} | ({"generated": data["generated"]} if data.get("generated") else {})
    recorded = {}
    for cell in data["cells"]:
        key = _cell_key(cell)
        if key is not None:
            earlier = cell.get("carried_over")  # carried before: keep the date it was recorded on
            recorded[key] = {**cell, "carried_over": earlier if isinstance(earlier, dict) else stamp}
    return recorded


def _cell_key(cell: Any) -> tuple[Any, ...] | None:
    try:
        return cell["method"], cell["name"], float(cell["epsilon"]["target"]), cell["preset"]
    except (TypeError, KeyError, ValueError):
        return None


def _carried(fresh: dict[str, Any], cell: dict[str, Any] | None) -> dict[str, Any]:
    """The recorded ``cell`` when it has every field of a fresh one, a status other than pending, and the table
    can show it (a hand-edited or older file's cell that it cannot is left out); else ``fresh``. Each run's error
    is reduced to its category, as :func:`error_category` does for records: an older file may hold raw output."""
    if cell is None or not fresh.keys() <= cell.keys() or cell["status"] not in (FINISHED, FAILED, OVER_BUDGET):
        return fresh
    try:
        _row(cell)
        runs = [{**run, "error": error_category(run)} for run in cell["runs"]]
    except (TypeError, KeyError, ValueError, AttributeError):
        return fresh
    return {**cell, "runs": runs}


# ------------------------------------------------------------------------------ JSON
def write_results(path: Path, suite: Suite, cells: list[dict[str, Any]]) -> Path:
    settings = suite.settings
    atomic_write_json(
        path,
        {
            "suite": suite.name,
            "source": str(suite.source),
            "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": settings.model_dump(),
            "note": DIAGNOSTIC_NOTE,
            "cells": cells,
        },
    )
    return path


# ------------------------------------------------------------------------------ Markdown
def markers(suite_name: str) -> tuple[str, str]:
    return f"<!-- bench:{suite_name}:start -->", f"<!-- bench:{suite_name}:end -->"


def markdown_section(suite: Suite, cells: list[dict[str, Any]], plot: Path | None) -> str:
    """The text between the markers: what was run, under which budget, the table and the plot."""
    settings = suite.settings
    measured = [c for c in cells if c["machine"] and c["status"] == FINISHED]
    machines = {json.dumps(c["machine"], sort_keys=True) for c in measured}
    lines = [
        f"Suite `{suite.name}` ({suite.schema.description or suite.schema.dataset}), written by "
        f"`dpsynth bench {suite.name}` from each run's own `{PRIVACY_FILE}` and `{DIAGNOSTICS_DIR}/{METRICS_FILE}`; "
        "do not edit between the markers.",
        "",
        f"- Budget: {settings.run_budget_minutes:g} min per run, {settings.suite_budget_hours:g} h for the suite, "
        f"on {settings.budget_machine}. {_seed_rule(settings)}; classifier seeds: {settings.classifier_seeds}.",
        "- Accuracy: the run's own downstream evaluation on the real test split, in %, mean ± std "
        "(several pipeline seeds: pooled std). "
        + (
            f"FID: {settings.fid_samples:,} samples against the {settings.fid_reference} split. "
            if "fid" in settings.metrics
            else ""
        )
        + (
            "Canary: the one-run ε lower bound (Steinke, Nasr & Jagielski, arXiv:2305.08846) of the first seed."
            if settings.canary
            else ""
        ),
        f"- {DIAGNOSTIC_NOTE[0].upper()}{DIAGNOSTIC_NOTE[1:]}.",
    ]
    # records that differ only in what the line does not show (the Python version) make one line
    for described in sorted({_describe_machine(json.loads(machine)) for machine in machines}):
        lines.append(f"- Machine: {described}.")
    carried = sorted(
        {str(c["carried_over"].get("generated", "an earlier run")) for c in cells if c.get("carried_over")}
    )
    if carried:
        lines.append(
            f"- {CARRIED_MARK}: carried over as recorded in the results JSON of {', '.join(carried)}: the cell's run "
            "directories are not on the machine that wrote this table, so its recorded figures are kept as they are."
        )
    lines += [
        "",
        "| method | preset | ε target | ε spent | accuracy % | classifier | FID | canary ε ≥ "
        "| seeds (runs × classifiers) | wall / run | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # cells run with different thread counts: each row says its own, so a wall time is read against its machine
    threads = len({_threads(c) for c in measured}) > 1
    lines += [
        _row(cell, threads)
        for cell in sorted(cells, key=lambda c: (not c["baseline"], c["name"], c["epsilon"]["target"]))
    ]
    if plot is not None:
        lines += ["", f"![accuracy against ε, {suite.name}]({plot.as_posix()})"]
    return "\n".join(lines)


def _threads(cell: dict[str, Any]) -> str | None:
    return (cell.get("machine") or {}).get("omp_num_threads")


def _row(cell: dict[str, Any], threads: bool = False) -> str:
    name = f"{cell['name']} (baseline: DP-SGD on the private data)" if cell["baseline"] else cell["name"]
    name += f" {CARRIED_MARK}" if cell.get("carried_over") else ""
    target = f"{cell['epsilon']['target']:g}"
    if cell["status"] != FINISHED:
        shown = {"over_budget": "over budget", "failed": "failed", "pending": "not run yet"}[cell["status"]]
        return f"| {name} | `{cell['preset']}` | {target} | {shown} | | | | | | | |"
    spent = cell["epsilon"]["spent"]
    trainings = len(cell["pipeline_seeds"]) * (cell["classifier_seeds"] or 1)
    spread = trainings > 1 or cell.get("accuracy_model") == "mean_of_models"  # else the std of a single number
    accuracy = (
        "-"
        if cell["accuracy_mean"] is None
        else f"{cell['accuracy_mean']:.2f}" + (f" ± {cell['accuracy_std']:.2f}" if spread else "")
    )
    classifier = str(cell.get("accuracy_model") or "-").replace("mean_of_models", "mean of models")
    fid = "-" if cell["fid"] is None else f"{cell['fid']:.1f}"
    canary = "-" if cell["canary_epsilon_lower"] is None else f"{cell['canary_epsilon_lower']:.2f}"
    seeds = f"{len(cell['pipeline_seeds'])} × {cell['classifier_seeds'] or 1}"
    peak = "-" if cell["peak_mib"] is None else f"{cell['peak_mib']:.0f}"
    wall = _duration(cell["wall_s"]) + (f" ({_threads(cell) or 'all'} thr.)" if threads else "")
    return (
        f"| {name} | `{cell['preset']}` | {target} | {'none claimed' if spent is None else f'{spent:.3f}'} "
        f"| {accuracy} | {classifier} | {fid} | {canary} | {seeds} | {wall} | {peak} |"
    )


def _seed_rule(settings: Any) -> str:
    if settings.pipeline_seeds == 1:
        return "One pipeline seed per cell"
    return (
        f"Pipeline seeds: {settings.pipeline_seeds} where a run is estimated under "
        f"{settings.cheap_run_minutes:g} min, else 1"
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _describe_machine(machine: dict[str, Any]) -> str:
    parts = [f"{machine.get('cpu')}, {machine.get('cores')} cores"]
    if machine.get("omp_num_threads"):
        parts.append(f"OMP_NUM_THREADS={machine['omp_num_threads']}")
    parts.append(f"torch {machine.get('torch')}")
    parts.append(f"GPU {machine['gpu']}" if machine.get("gpu") else "no GPU")
    if machine.get("cuda"):
        parts.append(f"CUDA {machine['cuda']}")
    return ", ".join(parts)


def update_markdown(path: Path, suite_name: str, section: str) -> None:
    """Replace the text between the suite's markers in ``path`` (appending the section when they are
    absent, creating the file when it is missing); nothing outside the markers changes."""
    start, end = markers(suite_name)
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    block = f"{start}\n{section}\n{end}"
    has_start, has_end = start in text, end in text
    if has_start != has_end or text.count(start) > 1 or text.count(end) > 1:
        raise DataError(f"{path}: expected one {start} and one {end} marker; fix the file by hand")
    if has_start:
        before, rest = text.split(start, 1)
        if end not in rest:
            raise DataError(f"{path}: the {end} marker comes before {start}")
        after = rest.split(end, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip("\n") + f"\n\n## Benchmark suite `{suite_name}`\n\n{block}\n"
    atomic_write_text(path, text)


# ------------------------------------------------------------------------------ plot
def write_plot(path: Path, suite: Suite, cells: list[dict[str, Any]]) -> Path | None:
    """Accuracy against ε per method (error bars: std), the baseline as a dashed line; None when no
    cell has an accuracy yet."""
    done = [c for c in cells if c["status"] == FINISHED and c["accuracy_mean"] is not None]
    if not done:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(c["name"] for c in done):
        points = sorted((c for c in done if c["name"] == name), key=lambda c: c["epsilon"]["target"])
        eps = [c["epsilon"]["target"] for c in points]
        means = [c["accuracy_mean"] for c in points]
        stds = [c["accuracy_std"] for c in points]
        if points[0]["baseline"]:
            axes.plot(eps, means, "k--", linewidth=1.5, label=f"{name} (DP-SGD baseline)")
            axes.fill_between(
                eps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], color="k", alpha=0.1
            )
        else:
            axes.errorbar(eps, means, yerr=stds, marker="o", capsize=3, label=name)
    axes.set_xscale("log")
    axes.set_xticks(suite.epsilons, [f"{e:g}" for e in suite.epsilons])
    axes.set_xlabel("ε (target)")
    axes.set_ylabel("downstream accuracy on the real test split (%)")
    axes.set_title(f"dpsynth bench {suite.name}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def relative_link(target: Path, markdown: Path) -> Path:
    """``target`` as a link from the Markdown file's directory."""
    return Path(os.path.relpath(target.resolve(), markdown.resolve().parent))
