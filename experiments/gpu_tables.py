"""Markdown tables of the GPU measurements in ``experiments/results/gpu/`` (written by
``experiments/gpu_check.sh`` and the rerun recorded in BENCHMARKS.md; the H200 lease's files in ``h200/``),
so every GPU figure in the docs is regenerated from the stored JSON:

    python experiments/gpu_tables.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dpsgd_step import IMPLEMENTATIONS, MODELS, PRECISIONS  # this folder: the script's own directory is on sys.path

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


def _rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data["rows"] if isinstance(data, dict) else data


def step_table(path: Path) -> str:
    """One line per (model, K, implementation, precision): median step time and CUDA peak, each against the
    non-private row of the same precision; a row that failed shows its error."""
    rows = sorted(_rows(path), key=_order)
    base = {_cell(r): r for r in rows if r["implementation"] == "non-private" and r.get("median_s") is not None}
    lines = [
        "| model | K | implementation | median ms | × non-private | CUDA peak MiB | × non-private |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["implementation"] + (f" ({r['strategy']})" if r.get("strategy") not in (None, "-", "auto") else "")
        name += f" {r['precision']}" if r.get("precision", "fp32") != "fp32" else ""
        if r.get("median_s") is None:
            error = str(r.get("error", "no time")).splitlines()[-1][:80]
            lines.append(f"| {r['model']} | {r['k']} | {name} | failed: {error} | – | – | – |")
            continue
        b = base.get(_cell(r))
        time_ratio = f"{r['median_s'] / b['median_s']:.2f}" if b else "–"
        memory_ratio = f"{r['cuda_peak_mib'] / b['cuda_peak_mib']:.2f}" if b else "–"
        lines.append(
            f"| {r['model']} | {r['k']} | {name} | {r['median_s'] * 1e3:.1f} | {time_ratio} "
            f"| {r['cuda_peak_mib']:.0f} | {memory_ratio} |"
        )
    return "\n".join(lines)


def _order(row: dict) -> tuple:
    """Model, K, precision, then the implementations in the benchmark's order (unknown names last)."""

    def rank(names: tuple, name: str) -> int:
        return names.index(name) if name in names else len(names)

    return (
        rank(MODELS, row["model"]),
        row["k"],
        rank(PRECISIONS, row.get("precision", "fp32")),
        rank(IMPLEMENTATIONS, row["implementation"]),
        row.get("strategy") not in (None, "-", "auto"),
    )


def _cell(row: dict) -> tuple:
    return row["model"], row["k"], row.get("precision", "fp32")


def case_table(path: Path) -> str:
    """Large-model and paper-scale cases: non-private vs one full engine step (or its projection)."""
    lines = [
        "| case | parameters | physical batch | non-private s / micro-batch | engine s / step | step kind | "
        "engine CUDA peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in json.loads(path.read_text())["cases"]:
        if "non_private" not in case:
            lines.append(f"| {case['name']} | – | – | – | – | {case.get('error', 'not run')} | – |")
            continue
        full = case.get("engine_full") or {}
        measured = bool(full.get("steps"))
        step, kind = (full["median_s"], "measured") if measured else (case["projected_full_step_s"], "projected")
        peak = (case.get("engine_peak") or {}).get("cuda_peak_mib", math.nan)
        lines.append(
            f"| {case['name']} | {case['parameters'] / 1e6:.1f}M | {case['physical']} | "
            f"{case['non_private']['median_s']:.3f} | {step:.2f} | {kind} | {peak:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    for name in ("dpsgd_step_h100.json", "dpsgd_step_rerun_h100.json"):
        print(f"### {name}\n\n{step_table(RESULTS / name)}\n")
    for name in ("large_unet", "large_unet_rerun", "paper_scale", "paper_scale_rerun"):
        name = f"{name}_h100.json"
        print(f"### {name}\n\n{case_table(RESULTS / name)}\n")
    for name in ("dpsgd_step_call1_h200.json", "dpsgd_step_call2_h200.json"):
        print(f"### h200/{name}\n\n{step_table(RESULTS / 'h200' / name)}\n")
    print(f"### h200/large_unet_h200.json\n\n{case_table(RESULTS / 'h200' / 'large_unet_h200.json')}\n")


if __name__ == "__main__":
    main()
