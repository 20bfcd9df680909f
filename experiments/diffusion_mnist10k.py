"""Measurements of DPDM and PDP-Diffusion on mnist10k at eps 10 and 1, PDP at two lrs and from scratch.

Runs each configuration through ``dpsynth run`` (skipping any whose run directory already holds
diagnostics/metrics.json, so an interrupted sweep continues where it stopped), then reads every run directory
and prints one table row per run: spent eps, noise multiplier, DP steps, public pre-training time,
DP training time, sampling + evaluation time, and the downstream CNN's accuracy on the mnist10k
test split (2,000 real digits). The sample grids are each run's samples.png.

A control row, ``pdp-diffusion_public-only``, samples the pre-trained model right after the class
transfer (``class_init: names``) with zero DP steps, so nothing private is touched (eps 0): it shows
how much of PDP-Diffusion's accuracy the public glyphs alone give and how much DP fine-tuning adds.

    OMP_NUM_THREADS=2 python experiments/diffusion_mnist10k.py --runs experiments/out/diffusion_mnist10k [--json]

A run that fails stops the sweep with its error; rerun the command to continue.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

RUNS: dict[str, tuple[str, list[str]]] = {
    "pdp-diffusion_eps10": ("dpsynth/presets/pdp-diffusion/mnist10k_eps10.yaml", []),
    "dpdm_eps10": ("dpsynth/presets/dpdm/mnist10k_eps10.yaml", []),
    "pdp-diffusion_eps1": ("dpsynth/presets/pdp-diffusion/mnist10k_eps1.yaml", []),
    "dpdm_eps1": ("dpsynth/presets/dpdm/mnist10k_eps1.yaml", []),
    # Learning-rate sensitivity: Table 3's 5e-4 barely moves the pre-trained model in 200 noisy steps.
    "pdp-diffusion-lr5e-4_eps10": ("dpsynth/presets/pdp-diffusion/mnist10k_eps10.yaml", ["pdp-diffusion.lr=0.0005"]),
    "pdp-diffusion-lr5e-4_eps1": ("dpsynth/presets/pdp-diffusion/mnist10k_eps1.yaml", ["pdp-diffusion.lr=0.0005"]),
    # Pre-trained versus from scratch, both at lr 5e-4.
    "pdp-diffusion-scratch-lr5e-4_eps10": (
        "dpsynth/presets/pdp-diffusion/mnist10k_eps10.yaml",
        ["data.public=null", "pdp-diffusion.lr=0.0005"],
    ),
}

_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] (.*)$")


def _log_times(log: Path) -> dict[str, object]:
    """Seconds spent in each phase, from the timestamps of log.txt's phase lines."""
    stamps: list[tuple[datetime, str]] = []
    for line in log.read_text().splitlines():
        match = _STAMP.match(line)
        if match:
            stamps.append((datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"), match.group(2)))

    def first(prefix: str) -> tuple[datetime, str] | None:
        return next(((when, text) for when, text in stamps if text.startswith(prefix)), None)

    start, pretrained, finished = first("run ")[0], first("pre-trained model"), first("training finished in")
    times: dict[str, object] = {"total_s": (stamps[-1][0] - start).total_seconds()}
    if finished:
        training = float(re.search(r"in ([\d.]+)s", finished[1]).group(1))
        pretraining = (pretrained[0] - start).total_seconds() if pretrained else 0.0
        shown = ("cached" if "cache hit" in pretrained[1] else f"{pretraining / 60:.1f} min") if pretrained else "-"
        times.update(
            pretrain_s=pretraining,
            dp_training_s=training - pretraining,
            pretrain=shown,
            sample_and_evaluate_s=(stamps[-1][0] - finished[0]).total_seconds(),
        )
    return times


def summarise(run_dir: Path) -> dict[str, object]:
    privacy = json.loads((run_dir / "privacy.json").read_text())
    metrics = json.loads((run_dir / "diagnostics" / "metrics.json").read_text())
    # the DP-SGD mechanism (dp-adam, or PrivImage+G's dp-discriminator): the only subsampled one
    dp_adam = next(m for m in privacy["mechanisms"] if m.get("sample_rate", 1.0) < 1.0)
    accuracy = metrics["accuracy"]["cnn"] if "accuracy" in metrics else None
    return {
        "run": run_dir.name,
        "epsilon": privacy["epsilon"],
        "noise_multiplier": dp_adam["noise_multiplier"],
        "sample_rate": dp_adam["sample_rate"],
        "steps": dp_adam["steps"],
        "mechanisms": [m["name"] for m in privacy["mechanisms"]],
        "accuracy_cnn": accuracy,
        "samples_png": str(run_dir / "samples.png"),
        **_log_times(run_dir / "log.txt"),
    }


def run_once(run_dir: Path, config: str, overrides: list[str]) -> None:
    """``dpsynth run config --out run_dir`` unless the run finished; an interrupted run is resumed."""
    if (run_dir / "diagnostics" / "metrics.json").is_file():
        return
    command = [sys.executable, "-m", "dpsynth", "run", config, "--out", str(run_dir)]
    command += [arg for override in overrides for arg in ("--set", override)]
    if (run_dir / "config.yaml").is_file():
        command.append("--resume")
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def print_table(rows: list[dict[str, object]], extra: str, extra_cell: Callable[[dict], str]) -> None:
    """The markdown table of :func:`summarise` rows, with one more column ``extra`` before the accuracy."""
    print(f"| run | eps spent | sigma | q | DP steps | pre-training | DP training | {extra} | CNN accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        accuracy = row["accuracy_cnn"]
        shown = f"{accuracy['mean']:.2f} %" if isinstance(accuracy, dict) else str(accuracy)
        print(
            f"| {row['run']} | {row['epsilon']:.3f} | {row['noise_multiplier']:.3f} | {row['sample_rate']:.4f} | "
            f"{row['steps']} | {row.get('pretrain', '-')} | {row.get('dp_training_s', 0) / 60:.1f} min | "
            f"{extra_cell(row)} | {shown} |"
        )


PUBLIC_ONLY = "pdp-diffusion_public-only"


def public_only(source_run: Path, out: Path) -> None:
    """Sample the pre-trained (cached) model of ``source_run``'s config with no DP step; evaluate it."""
    from dpsynth.context import open_run
    from dpsynth.runner import evaluate_with_run_settings, write_samples

    ctx, method = open_run(source_run, echo=False)
    ctx = dataclasses.replace(ctx, log=lambda message: print(message, file=sys.stderr))  # not the source's log
    spec = method.model_spec(ctx)
    model = method.initial_model(ctx, spec).to(ctx.device).eval()  # a pre-training cache hit
    samples = method.sample(ctx, model, spec, ctx.config.generate.num)
    out.mkdir(parents=True, exist_ok=True)
    write_samples(out / "samples.npz", samples, ctx.num_classes)
    evaluate_with_run_settings(ctx, out / "samples.npz", ["accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("experiments/out/diffusion_mnist10k"))
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="run these only (default: all)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    names = args.only or list(RUNS)
    for name in names:
        run_once(args.runs / name, *RUNS[name])
    control = args.runs / PUBLIC_ONLY
    if not args.only and not (control / "samples.metrics.json").is_file():
        print(f"[{time.strftime('%H:%M:%S')}] {PUBLIC_ONLY}: sampling the pre-trained model", file=sys.stderr)
        public_only(args.runs / "pdp-diffusion_eps10", control)
    rows = [summarise(args.runs / name) for name in names]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print_table(rows, "sampling + eval", lambda row: f"{row.get('sample_and_evaluate_s', 0) / 60:.1f} min")
    if (control / "samples.metrics.json").is_file():
        shown = f"{json.loads((control / 'samples.metrics.json').read_text())['accuracy']['cnn']['mean']:.2f} %"
        print(f"| {PUBLIC_ONLY} (0 DP steps) | 0 | - | - | 0 | (cached) | 0 | - | {shown} |")


if __name__ == "__main__":
    main()
