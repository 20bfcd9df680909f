"""``dpsynth bench SUITE``: the command line over :func:`dpsynth.bench.bench`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dpsynth.bench import BenchOptions, available_suites, bench
from dpsynth.errors import ConfigError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark suite (every method at eps 1 and 10) and write the comparison table",
        description="Run every cell of SUITE (a packaged suite name or a YAML path) as its own "
        "'dpsynth run' subprocess into OUT/SUITE/<name>_eps<e>[_seed<s>]/, resumable; then write "
        "experiments/results/SUITE.json, the table between the suite's markers in BENCHMARKS.md and "
        f"docs/img/bench_SUITE.png. Packaged suites: {', '.join(available_suites())}.",
    )
    parser.add_argument("suite", help="packaged suite name (e.g. mnist10k-cpu) or a suite YAML path")
    parser.add_argument("--only", help="comma-separated entry names or method ids to run (default: all)")
    parser.add_argument("--epsilons", help="comma-separated epsilons to run, e.g. 1,10 (default: all of the suite)")
    parser.add_argument(
        "--out", default="experiments/out", help="root of the run directories (default experiments/out)"
    )
    parser.add_argument("--results", help="results JSON (default experiments/results/SUITE.json)")
    parser.add_argument(
        "--benchmarks-md", default="BENCHMARKS.md", help="Markdown file with the table (default BENCHMARKS.md)"
    )
    parser.add_argument("--plot", help="plot path (default docs/img/bench_SUITE.png)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key of every run (repeatable)",
    )
    parser.add_argument("--run-budget-min", type=float, help="wall minutes per run (default: the suite's)")
    parser.add_argument("--suite-budget-h", type=float, help="wall hours for the suite (default: the suite's)")
    parser.add_argument(
        "--dry-run", action="store_true", help="list the runs, their commands and estimated time; run nothing"
    )
    parser.add_argument(
        "--table-only", action="store_true", help="rebuild JSON, table and plot from finished runs; run nothing"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.dry_run and args.table_only:
        raise ConfigError("--dry-run and --table-only exclude each other")
    options = BenchOptions(
        only=_names(args.only),
        epsilons=[_epsilon(item) for item in _names(args.epsilons) or []] or None,
        out=Path(args.out),
        results=Path(args.results) if args.results else None,
        benchmarks_md=Path(args.benchmarks_md),
        plot=Path(args.plot) if args.plot else None,
        overrides=list(args.set),
        run_budget_minutes=args.run_budget_min,
        suite_budget_hours=args.suite_budget_h,
    )
    result = bench(args.suite, options, dry=args.dry_run, table_only=args.table_only)
    if args.json:
        print(json.dumps(result))
    elif args.dry_run:
        print(_dry_run_text(result))
    else:
        print(result["results"])
    return 0


def _names(text: str | None) -> list[str] | None:
    return [item.strip() for item in text.split(",") if item.strip()] if text else None


def _epsilon(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--epsilons: {text!r} is not a number") from None


def _dry_run_text(result: dict[str, Any]) -> str:
    lines = [f"suite {result['suite']}: {len(result['runs'])} run(s)"]
    for row in result["runs"]:
        flag = "  (estimate above the run budget)" if row["over_run_budget"] else ""
        lines.append(f"  {row['run']:<36}{row['status']:<10}~{row['estimated_minutes']:g} min{flag}")
        lines.append(f"    {row['command']}")
    if result.get("estimate_gpu"):
        lines += ["", *_estimate_table(result)]
    lines.append(
        f"estimated time left: {result['estimated_hours_left']:g} h ({result['estimated_hours_left_capped']:g} h with "
        f"each run stopped at its {result['run_budget_minutes']:g} min budget), against the "
        f"{result['suite_budget_hours']:g} h suite budget, on {result['budget_machine']}"
    )
    return "\n".join(lines)


def _estimate_table(result: dict[str, Any]) -> list[str]:
    """Each run's private-training estimate (dpsynth.dpsgd.estimate): ESTIMATES, labelled as such."""
    gpu = result["estimate_gpu"]
    lines = [
        f"private training ESTIMATES on one {gpu} (not measurements; DP training only: pre-training, sampling and "
        "evaluation excluded; docs/gpu.md, 'Estimates before a run'):",
        f"  {'run':<44}{'parameters':>12}{'peak GiB/device':>17}{f'{gpu} hours':>12}",
    ]
    for row in result["runs"]:
        estimate = row["estimate"]
        if "unavailable" in estimate:
            lines.append(f"  {row['run']:<44}  not available: {estimate['unavailable']}")
            continue
        fits = "" if estimate["fits"] else "  (does not fit: lower physical_batch_size)"
        lines.append(
            f"  {row['run']:<44}{estimate['parameters'] / 1e6:>11.2f}M{estimate['peak_gib']:>17.2f}"
            f"{estimate['gpu_hours']:>12,.3g}{fits}"
        )
    return lines
