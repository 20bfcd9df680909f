"""DPPM on a trained model: annealed HMC (Algorithm 2) against annealed Langevin (NCSN), same score evaluations.

``experiments/dppm_samplers.py`` compares the samplers on targets with an exact score; this script does it on
the score model of a finished DPPM run (its released model; sampling costs no privacy). Per noise level
HMC spends M * N leapfrog evaluations plus one at the level's start, Langevin T steps, so the pairs
compared are (M, N) against T = M * N + 1, and both end with the same denoising step. HMC keeps the
run's λ0; Langevin gets ε = λ0², the same step (one leapfrog step from fresh momentum is a Langevin step
of size λ², :mod:`dpsynth.diffusion.hmc`), so neither is tuned on the private data. Each
sampler's samples are scored like the run's own (the CNN of the evaluation protocol on the real test
split, one classifier seed) and by FID against as many real test digits on TF-Inception features.

    OMP_NUM_THREADS=1 python experiments/dppm_samplers_mnist10k.py RUN_DIR --out experiments/out/dppm_samplers
        [--num 1000] [--budgets 1x4,2x4] [--json]

Everything read from the private data (test digits for the CNN and FID) is a private diagnostic; the
script writes only under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np


def sampler_variants(budgets: list[tuple[int, int]], step_size: float) -> list[tuple[str, dict[str, Any]]]:
    """(name, sampler overrides) pairs: HMC M x N and Langevin with the same score evaluations per level."""
    variants = []
    for iterations, leapfrog in budgets:
        hmc = {"kind": "hmc", "iterations": iterations, "leapfrog_steps": leapfrog, "step_size": step_size}
        steps = iterations * leapfrog + 1
        langevin = {"kind": "langevin", "iterations": 1, "leapfrog_steps": steps, "step_size": step_size**2}
        variants += [(f"hmc_{iterations}x{leapfrog}", hmc), (f"langevin_{steps}", langevin)]
    return variants


def draw(ctx: Any, method: Any, sampler: dict[str, Any], num: int) -> tuple[Any, list[str], float]:
    """(samples, the sampler's log lines, wall seconds) from the run's model with ``sampler`` overriding its own."""
    section = ctx.section.model_copy(update={"sampler": ctx.section.sampler.model_copy(update=sampler)})
    lines: list[str] = []
    local = dataclasses.replace(ctx, section=section, log=lines.append)
    started = time.time()
    samples = method.generate(local, num)
    return samples, lines, time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished dppm run directory")
    parser.add_argument("--out", type=Path, default=Path("experiments/out/dppm_samplers"))
    parser.add_argument("--num", type=int, default=1000, help="samples per sampler (and real test digits for FID)")
    parser.add_argument("--budgets", default="1x4", help="comma-separated HMC MxN; Langevin gets M*N+1 steps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from dpsynth.context import open_run
    from dpsynth.eval.evaluate import evaluate
    from dpsynth.metrics.fidelity import fid
    from dpsynth.metrics.inception import InceptionFeatures, reference_features
    from dpsynth.runner import write_samples

    budgets = [tuple(int(part) for part in item.split("x")) for item in args.budgets.split(",")]
    ctx, method = open_run(args.run_dir, echo=False)
    test = ctx.data.test
    reference = test.images[np.random.default_rng(0).permutation(len(test))[: args.num]]
    extractor = InceptionFeatures(progress=False)
    real = reference_features(reference, extractor, "run-test", "test", cache=args.out / "diagnostics", private=True)
    rows = []
    for name, sampler in sampler_variants(budgets, ctx.section.sampler.step_size):
        path = args.out / name / "samples.npz"
        samples, lines, wall = draw(ctx, method, sampler, args.num)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_samples(path, samples, ctx.num_classes)
        data = str(ctx.config.data.private)
        accuracy = evaluate(path, ["accuracy"], data=data, models=["cnn"], seeds=1)["accuracy"]
        rows.append(
            {
                "sampler": name,
                "score_evaluations_per_sample": _evaluations(sampler, ctx.section),
                "sampling_s": round(wall, 1),
                "log": lines,
                "accuracy": {model: result["mean"] for model, result in accuracy.items() if isinstance(result, dict)},
                "fid": fid(real, extractor(samples.images).astype(np.float64)),
            }
        )
    result = {"run": str(args.run_dir), "num": args.num, "rows": rows}
    (args.out / "samplers.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return
    print("| sampler | score evaluations per sample | sampling s | CNN accuracy | FID | note |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        accuracy = ", ".join(f"{value:.2f} %" for value in row["accuracy"].values())
        print(
            f"| {row['sampler']} | {row['score_evaluations_per_sample']} | {row['sampling_s']} | {accuracy} | "
            f"{row['fid']:.1f} | {' '.join(row['log'])} |"
        )


def _evaluations(sampler: dict[str, Any], section: Any) -> int:
    """Score evaluations per sample: per level M*N (+1 for HMC), times the levels, plus the denoising step."""
    per_level = sampler["iterations"] * sampler["leapfrog_steps"] + (1 if sampler["kind"] == "hmc" else 0)
    return section.noise.num_levels * per_level + (1 if section.sampler.denoise else 0)


if __name__ == "__main__":
    main()
