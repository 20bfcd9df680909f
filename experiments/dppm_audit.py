"""DPPM's two privacy modes under the same audits: does the paper's randomized response leak where DP-SGD does not?

For each finished run (e.g. ``dppm/mnist10k_eps10`` with DP-SGD and ``dppm/mnist10k_eps10_randomized_response``,
the paper's mechanism at the same nominal ε), ``dpsynth evaluate RUN --metrics audit,run_canary``:

- membership inference (docs/audit.md): the nearest-neighbour attack on the released samples and the loss
  attack on the released score model (its denoising score-matching loss), members = private train digits,
  non-members = as many private val digits; ROC AUC and TPR at 10 % FPR with Clopper-Pearson intervals;
- the method canary audit: the run's method retrained with mislabelled canaries (a tenth of the train split,
  at most 500, each included with probability ½), scored by the same loss; the one-run empirical ε lower
  bound at 95 % (Steinke, Nasr & Jagielski, arXiv:2305.08846) with its interval.

    OMP_NUM_THREADS=1 python experiments/dppm_audit.py RUN_DIR [RUN_DIR ...] [--json]

Every figure reads private data without noise: a private diagnostic for the data custodian. The canary audit
retrains the method (one full training per run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def audit(run_dir: Path) -> dict[str, Any]:
    from dpsynth.api import evaluate

    privacy = json.loads((run_dir / "privacy.json").read_text())
    result = evaluate(run_dir, ["audit", "run_canary"])["audit"]
    return {"run": str(run_dir), "guarantee": privacy.get("guarantee"), "epsilon": privacy.get("epsilon"), **result}


def _interval(values: Any) -> str:
    return "[" + ", ".join("∞" if v is None else f"{v:.2f}" for v in values) + "]" if values else ""


def rows(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| run | guarantee | ε claimed | attack | AUC | TPR at 10 % FPR [95 % CI] "
        "| canary ε ≥ [95 % CI of the guess ε] | correct / guesses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        canary = result.get("run_canary") or {}
        bound = f"{canary['epsilon_lower_bound']:.2f} {_interval(canary['epsilon_interval'])}" if canary else "-"
        guesses = f"{canary['num_correct']} / {canary['num_guesses']}" if canary else "-"
        claimed = "none" if result["epsilon"] is None else f"{result['epsilon']:.3f}"
        for name, attack in result["membership_inference"].items():
            lines.append(
                f"| {Path(result['run']).name} | {result['guarantee']} | {claimed} | {name} | {attack['auc']:.3f} | "
                f"{attack['tpr_at_fpr']:.3f} {_interval(attack['tpr_interval'])} | {bound} | {guesses} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="finished dppm run directories")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [audit(run) for run in args.runs]
    print(json.dumps(results) if args.json else "\n".join(rows(results)))


if __name__ == "__main__":
    main()
