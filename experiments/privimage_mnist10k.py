"""PrivImage's central claim on mnist10k: a privately selected public subset against other pre-training sets.

The paper (PrivImage, arXiv:2311.12850, §5.2) claims that pre-training on a privately *selected* public subset
beats pre-training on the whole public set. The PrivImage+D rows are the ``mnist10k-cpu`` suite's own cells
(``dpsynth bench mnist10k-cpu --only privimage-d``; its eps 1 cell releases the selection, the eps 10 cell
re-uses it), and the oracle row is the suite's ``pdp-diffusion`` cell, whose preset pre-trains on the ten digit
glyphs. This script adds, at eps 10 and the same budget (pdp-diffusion/mnist10k_eps10's fine-tuning: 0.3M UNet,
2,000 public pre-training steps, 200 DP steps), the controls:

- ``pdp-all-glyphs_eps10``: PDP-Diffusion pre-trained on all 62 glyph classes (``data.public=glyphs``);
- ``privimage-random_eps10``: PrivImage+D with a *random* selection of the same shape (k2 = 5 public classes
  per digit, drawn with a fixed public seed and relabelled like the real selection), re-used as a selection
  file, so it, too, is charged for a query (conservative: no private data chose it);
- ``pdp-scratch_eps10``: PDP-Diffusion with no public data.

Every control evaluates itself exactly as the suite's runs do (the suite's ``evaluate`` overrides: the CNN
over 3 classifier seeds, FID on 2,000 samples against the 2,000 test digits with the suite's cached reference
features), so the table compares like with like. Run the suite cells first.

    OMP_NUM_THREADS=2 python experiments/privimage_mnist10k.py [--only pdp-all-glyphs_eps10 ...] [--json]

Interrupted runs resume; finished ones are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from diffusion_mnist10k import run_once  # experiments/ is on sys.path when this script runs

from dpsynth.bench import load_suite
from dpsynth.bench.cells import evaluation_overrides
from dpsynth.bench.readout import read_run_outputs
from dpsynth.config import load_config

SUITE = "mnist10k-cpu"
RANDOM_SELECTION = "random_selection.json"
#: the suite's runs shown beside the controls: (run, what it pre-trained on)
SUITE_ROWS = {
    "privimage-d_eps10": "PrivImage selection (the eps 1 cell's, re-used)",
    "privimage-d_eps1": "PrivImage selection",
    "pdp-diffusion_eps10": "the 10 digit glyphs (oracle)",
}
CONTROLS: dict[str, tuple[str, list[str], str]] = {
    "pdp-all-glyphs_eps10": ("pdp-diffusion/mnist10k_eps10", ["data.public=glyphs"], "all 62 glyph classes"),
    "privimage-random_eps10": (
        "privimage/mnist10k_eps10",
        ["privimage.selection.reuse={runs}/" + RANDOM_SELECTION],
        "a random glyph subset of the selection's shape",
    ),
    "pdp-scratch_eps10": ("pdp-diffusion/mnist10k_eps10", ["data.public=null"], "nothing (from scratch)"),
}


def random_selection(released: Path, out: Path, seed: int = 0) -> None:
    """A selection file with each private row's public classes drawn uniformly (same k2), no private input.

    The noisy counts of the released file are kept only so that the file parses; nothing is chosen by them.
    """
    data = json.loads(released.read_text())
    rng = np.random.default_rng(seed)
    names = data["semantic_names"]
    for row in data["rows"]:
        picks = rng.choice(len(names), size=len(row["selected"]), replace=False)
        row["selected"] = [{"public_class": names[i], "index": int(i), "noisy_count": None} for i in picks]
    data["collisions"], data["sds"], data["selection_ratio"] = {}, None, None
    data["note"] = f"random control: public classes drawn with numpy default_rng({seed}), not by the query"
    out.write_text(json.dumps(data, indent=1))


def suite_evaluation(suite_runs: Path) -> list[str]:
    """The ``evaluate`` overrides the suite gives its pdp-diffusion eps 10 cell: every control evaluates so."""
    suite = load_suite(SUITE)
    [cell] = [c for c in suite.cells if c.label == "pdp-diffusion" and c.epsilon == 10]
    return evaluation_overrides(suite, cell, load_config(cell.preset), suite_runs.parent)


def run_control(name: str, evaluation: list[str], suite_runs: Path, runs: Path) -> None:
    """``dpsynth run`` of one control with the suite's ``evaluation`` overrides."""
    if name == "privimage-random_eps10" and not (runs / RANDOM_SELECTION).is_file():
        released = suite_runs / "privimage-d_eps1" / "selection.json"
        if not released.is_file():
            sys.exit(f"error: {released} is missing: run `dpsynth bench {SUITE} --only privimage-d` first")
        runs.mkdir(parents=True, exist_ok=True)
        random_selection(released, runs / RANDOM_SELECTION)
    preset, overrides, _ = CONTROLS[name]
    run_once(runs / name, preset, [*evaluation, *(item.format(runs=runs) for item in overrides)])


def row(run_dir: Path, pretrained_on: str) -> dict[str, object]:
    """The run's own figures (:func:`dpsynth.bench.readout.read_run_outputs`): ε spent, CNN accuracy, FID."""
    if not (run_dir / "diagnostics" / "metrics.json").is_file():
        return {"run": run_dir.name, "pretrained_on": pretrained_on, "status": "not run yet"}
    outputs = read_run_outputs(run_dir)
    accuracy = outputs["accuracy"]
    return {
        "run": run_dir.name,
        "pretrained_on": pretrained_on,
        "epsilon": outputs["epsilon_spent"],
        "accuracy_mean": accuracy["mean"],
        "accuracy_std": accuracy["std"],
        "fid": outputs["fid"],
    }


def print_table(rows: list[dict[str, object]]) -> None:
    print("| run | pre-trained on | ε spent | CNN accuracy % | FID (2,000 vs test) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "status" in r:
            print(f"| {r['run']} | {r['pretrained_on']} | {r['status']} | | |")
            continue
        std = f" ± {r['accuracy_std']:.2f}"
        fid = f"{r['fid']:.1f}" if r["fid"] is not None else "-"
        print(f"| {r['run']} | {r['pretrained_on']} | {r['epsilon']:.3f} | {r['accuracy_mean']:.2f}{std} | {fid} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite-runs", type=Path, default=Path("experiments/out") / SUITE, help="the suite's OUT/SUITE"
    )
    parser.add_argument(
        "--runs", type=Path, default=Path("experiments/out/privimage_controls"), help="the controls' runs"
    )
    parser.add_argument("--only", nargs="*", choices=sorted(CONTROLS), help="run these controls only (default: all)")
    parser.add_argument("--table-only", action="store_true", help="run nothing; print the table")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    if not args.table_only:
        evaluation = suite_evaluation(args.suite_runs)
        for name in args.only or list(CONTROLS):
            run_control(name, evaluation, args.suite_runs, args.runs)
    rows = [row(args.suite_runs / name, what) for name, what in SUITE_ROWS.items()]
    rows += [row(args.runs / name, what) for name, (_, _, what) in CONTROLS.items()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
