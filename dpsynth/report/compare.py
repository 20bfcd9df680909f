"""``dpsynth report RUN [RUN ...]``: several runs side by side in one HTML page (docs/report.md).

One row per run (method, dataset, ε, δ, guarantee, downstream accuracy, FID, audit figures) and
two trade-off plots, accuracy and FID against ε, one line per method. Runs without a DP guarantee
stay in the table, marked, but are left out of the plots: they have no ε to place them at.
Accuracy, FID and the audit are private diagnostics (computed on private data without noise):
the table marks them so, and ``release=True`` leaves them out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dpsynth.errors import DataError
from dpsynth.report.html import (
    COVERED,
    DIAGNOSTIC,
    coverage_badge,
    esc,
    html_page,
    html_section,
    html_table,
    image_tag,
    note,
    read_audit,
    read_json,
    read_metrics,
    warning_box,
)
from dpsynth.report.plots import tradeoff_png
from dpsynth.report.usefulness import headline_text
from dpsynth.rundir import CONFIG_FILE, METRICS_FILE, PRIVACY_FILE, RELEASE_REPORT_FILE, REPORT_FILE, read_config_file


@dataclasses.dataclass
class RunSummary:
    """The figures of one run that a comparison shows."""

    run: str
    path: str
    method: str | None
    dataset: str | None
    epsilon: float | None
    target_epsilon: float | None
    delta: float | None
    guarantee: str | None
    accuracy: float | None  # mean downstream accuracy over the classifiers in metrics.json
    accuracy_interval: str | None  # the headline accuracy with its 95 % interval, test size and majority verdict
    fid: float | None
    mia_tpr: float | None  # nearest-neighbour attack, TPR at 10 % FPR
    canary_lower_bound: float | None
    has_report: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize_run(run_dir: str | Path, release: bool = False) -> RunSummary:
    """Read what a comparison needs from a run directory; missing files leave blanks.

    ``release`` leaves the private diagnostics (accuracy, FID, audit figures) blank.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"{run_dir} is not a directory")
    if not any((run_dir / name).is_file() for name in (CONFIG_FILE, PRIVACY_FILE, METRICS_FILE)):
        raise DataError(f"{run_dir} is not a run directory (no {CONFIG_FILE}, {PRIVACY_FILE} or {METRICS_FILE})")
    config = _read_config(run_dir)
    privacy, _ = read_json(run_dir / PRIVACY_FILE)
    privacy = privacy if isinstance(privacy, Mapping) else {}
    metrics, _ = (None, None) if release else read_metrics(run_dir)
    metrics = metrics if isinstance(metrics, Mapping) else {}
    audit = {} if release else read_audit(run_dir) or {}
    guarantee = privacy.get("guarantee")
    nn_attack = (audit.get("membership_inference") or {}).get("nearest_neighbour") or {}
    return RunSummary(
        run=run_dir.resolve().name,
        path=str(run_dir),
        method=config.get("method"),
        dataset=(config.get("data") or {}).get("private"),
        epsilon=_number(privacy.get("epsilon")) if guarantee != "none" else None,
        target_epsilon=_number(privacy.get("target_epsilon")),
        delta=_number(privacy.get("delta")),
        guarantee=guarantee,
        accuracy=mean_accuracy(metrics.get("accuracy")),
        accuracy_interval=headline_text(metrics.get("accuracy"), metrics.get("accuracy_baselines")),
        fid=_number(metrics.get("fid")),
        mia_tpr=_number(nn_attack.get("tpr_at_fpr")),
        canary_lower_bound=_number((audit.get("canary") or {}).get("epsilon_lower_bound")),
        has_report=(run_dir / REPORT_FILE).is_file(),
    )


def mean_accuracy(accuracy: Any) -> float | None:
    """One accuracy figure from ``metrics.json["accuracy"]``.

    Accepts a number, or a mapping of classifier -> accuracy (a ``"mean"`` or ``"mean_of_models"``
    entry wins; otherwise the mean over classifiers, where a nested mapping such as
    ``{"mean", "std", "runs"}`` contributes its own ``"mean"``).
    """
    if _number(accuracy) is not None:
        return _number(accuracy)
    if not isinstance(accuracy, Mapping):
        return None
    for summary_key in ("mean", "mean_of_models"):  # the evaluator's own average wins
        if summary_key in accuracy and mean_accuracy(accuracy[summary_key]) is not None:
            return mean_accuracy(accuracy[summary_key])
    values = [mean_accuracy(v) for v in accuracy.values()]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def render_comparison(
    run_dirs: Sequence[str | Path], out: Path | None = None, release: bool = False
) -> tuple[str, list[RunSummary]]:
    """The comparison page and the summaries it shows; links are relative to ``out``'s folder.

    ``release`` leaves out the private diagnostics (accuracy, FID, audit) and links the runs' release reports.
    """
    if not run_dirs:
        raise DataError("give at least one run directory to report on")
    summaries = [summarize_run(path, release=release) for path in run_dirs]
    parts = [_runs_table(summaries, out, release)]
    unguaranteed = [s.run for s in summaries if s.guarantee == "none"]
    if unguaranteed:
        parts.insert(
            0,
            warning_box(
                'No privacy guarantee ("guarantee": "none") for: '
                + ", ".join(unguaranteed)
                + ". These runs are not plotted against ε."
            ),
        )
    violating = [
        s.run
        for s in summaries
        if s.canary_lower_bound is not None and s.epsilon is not None and s.canary_lower_bound > s.epsilon
    ]
    if violating:
        parts.insert(0, warning_box("Canary audit lower bound above the claimed ε for: " + ", ".join(violating)))
    if release:
        tradeoffs = note("Release version: accuracy and FID are private diagnostics and are left out.")
    else:
        tradeoffs = coverage_badge(DIAGNOSTIC) + _tradeoff_plots(summaries)
    body = html_section("runs", "Runs", "".join(parts)) + html_section(
        "tradeoffs", "Utility and fidelity against ε", tradeoffs
    )
    title = f"dpsynth comparison of {len(summaries)} run(s)" + (" (release)" if release else "")
    return html_page(title, body), summaries


def write_comparison(
    run_dirs: Sequence[str | Path], out: str | Path = REPORT_FILE, release: bool = False
) -> tuple[Path, list[RunSummary]]:
    """Write the comparison page to ``out`` and return its path and the run summaries."""
    out = Path(out)
    if out.is_dir():
        raise DataError(f"--out {out} is a directory; give a file name such as {out / REPORT_FILE}")
    from dpsynth.checkpoint import atomic_write_text

    page, summaries = render_comparison(run_dirs, out, release=release)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, page)
    return out, summaries


def _runs_table(summaries: Sequence[RunSummary], out: Path | None, release: bool = False) -> str:
    covered = ("run", "method", "dataset", "ε", "target ε", "δ", "guarantee")
    diagnostics = ("accuracy", "accuracy, 95 % interval", "FID", "MIA TPR@10%FPR (NN)", "canary ε lower bound")
    rows = []
    for s in summaries:
        name = esc(s.run)
        report = Path(s.path) / (RELEASE_REPORT_FILE if release else REPORT_FILE)
        if report.is_file():
            name = f'<a href="{esc(_relative_link(report, out))}">{name}</a>'
        row = [name, s.method, s.dataset, s.epsilon, s.target_epsilon, s.delta, s.guarantee]
        diagnostic = [s.accuracy, s.accuracy_interval, s.fid, s.mia_tpr, s.canary_lower_bound]
        rows.append(row if release else row + diagnostic)
    if release:
        return coverage_badge(COVERED) + html_table(covered, rows, raw_columns=(0,))
    legend = note(
        f"Columns {', '.join(covered[3:])}: {COVERED}. Columns {', '.join(diagnostics)}: {DIAGNOSTIC}, "
        "computed on private data without noise."
    )
    headers = covered + tuple(f"{h} (diagnostic)" for h in diagnostics)
    return legend + html_table(headers, rows, raw_columns=(0,))


def _tradeoff_plots(summaries: Sequence[RunSummary]) -> str:
    parts = []
    for attribute, label, lower_is_better in (("accuracy", "downstream accuracy", False), ("fid", "FID", True)):
        series: dict[str, list[tuple[float, float]]] = {}
        for s in summaries:
            value = getattr(s, attribute)
            if s.epsilon is not None and value is not None:
                series.setdefault(s.method or s.run, []).append((s.epsilon, value))
        png = tradeoff_png(series, label, lower_is_better)
        parts.append(
            image_tag(png, f"{label} against epsilon")
            if png
            else note(f"No run has both an ε and a {label} figure to plot.")
        )
    return "".join(parts)


def _relative_link(target: Path, out: Path | None) -> str:
    import os

    base = (out.parent if out is not None else Path.cwd()).resolve()
    return Path(os.path.relpath(target.resolve(), base)).as_posix()


def _read_config(run_dir: Path) -> dict[str, Any]:
    try:
        content = read_config_file(run_dir)
    except (OSError, yaml.YAMLError, DataError):
        return {}
    return content if isinstance(content, dict) else {}


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
