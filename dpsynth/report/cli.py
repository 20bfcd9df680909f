"""``dpsynth report RUN [RUN ...] [--out FILE] [--json]``: the comparison page of several runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand to the ``dpsynth`` parser."""
    parser = subparsers.add_parser(
        "report", help="compare runs side by side in one HTML report",
        description="Write one HTML page comparing runs (method, dataset, epsilon, delta, guarantee, "
                    "accuracy, FID, audit) with accuracy and FID plotted against epsilon.")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    parser.add_argument("--out", default="report.html", help="output HTML file (default ./report.html)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from dpsynth.report.compare import write_comparison

    path, summaries = write_comparison(args.runs, args.out)
    if args.json:
        print(json.dumps({"report": str(path), "runs": [s.to_dict() for s in summaries]}, allow_nan=False))
    else:
        print(f"compared {len(summaries)} run(s)", file=sys.stderr)
        print(str(path))
    return 0
