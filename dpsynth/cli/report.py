"""``dpsynth report RUN [RUN ...] [--out FILE] [--json]``: the comparison page of several runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dpsynth.rundir import RELEASE_REPORT_FILE, REPORT_FILE


def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand to the ``dpsynth`` parser."""
    parser = subparsers.add_parser(
        "report",
        help="compare runs side by side in one HTML report",
        description="Write one HTML page comparing runs (method, dataset, epsilon, delta, guarantee, "
        "accuracy, FID, audit) with accuracy and FID plotted against epsilon.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    parser.add_argument(
        "--out",
        default=None,
        help=f"output HTML file (default ./{REPORT_FILE}; with --release and one RUN, RUN/{RELEASE_REPORT_FILE})",
    )
    parser.add_argument(
        "--release",
        action="store_true",
        help="leave out every private diagnostic (metrics computed on private data, the audit): "
        f"write each RUN/{RELEASE_REPORT_FILE}, and with several runs a comparison without them",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from dpsynth.report.compare import write_comparison

    if args.release:
        path, summaries = _write_release(args.runs, args.out)
    else:
        path, summaries = write_comparison(args.runs, args.out or REPORT_FILE)
    if args.json:
        print(json.dumps({"report": str(path), "runs": [s.to_dict() for s in summaries]}, allow_nan=False))
    else:
        print(f"compared {len(summaries)} run(s)", file=sys.stderr)
        print(str(path))
    return 0


def _write_release(runs: list[str], out: str | None) -> tuple[Any, list[Any]]:
    """Each run's ``report-release.html``; one run: that page (at ``out`` if given), several: a release comparison."""
    from dpsynth.report.compare import summarize_run, write_comparison
    from dpsynth.report.html import write_report

    summaries = [summarize_run(run, release=True) for run in runs]  # a clear error for a path that is not a run
    pages = [write_report(run, release=True, out=out if len(runs) == 1 else None) for run in runs]
    if len(runs) == 1:
        return pages[0], summaries
    return write_comparison(runs, out or REPORT_FILE, release=True)
