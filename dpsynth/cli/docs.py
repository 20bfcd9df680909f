"""``dpsynth docs``: print or rewrite the generated parts of the docs (:mod:`dpsynth.reference`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "docs",
        help="the generated docs: API reference, README's method table; update rewrites them",
        description="Print a generated part of the docs, or rewrite every stale one in a checkout: docs/api.md, "
        "docs/config-reference.md, README.md's method table and BENCHMARKS.md's suite tables (from "
        "experiments/results/SUITE.json).",
    )
    sub = parser.add_subparsers(dest="docs_command", metavar="ACTION", required=True)
    sub.add_parser("api", help="print the Markdown API reference (docs/api.md)").set_defaults(func=cmd_docs_api)
    sub.add_parser("methods", help="print README.md's method table, from the method registry").set_defaults(
        func=cmd_docs_methods
    )
    update = sub.add_parser("update", help="rewrite every stale generated file of a checkout")
    update.add_argument("--root", default=".", help="the checkout's root (default: the current directory)")
    update.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 when a file is stale")
    update.set_defaults(func=cmd_docs_update)


def cmd_docs_api(args: argparse.Namespace) -> int:
    from dpsynth.reference import api_markdown

    sys.stdout.write(api_markdown())
    return 0


def cmd_docs_methods(args: argparse.Namespace) -> int:
    from dpsynth.reference import methods_table

    print(methods_table())
    return 0


def cmd_docs_update(args: argparse.Namespace) -> int:
    from dpsynth.reference import stale_files, update

    root = Path(args.root)
    paths = stale_files(root) if args.check else update(root)
    verb = "stale" if args.check else "rewritten"
    print("\n".join(f"{verb}: {path}" for path in paths) or "every generated file is current")
    return 1 if args.check and paths else 0
