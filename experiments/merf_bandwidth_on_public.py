"""DP-MERF's kernel length scales, compared on PUBLIC stand-ins for mnist10k only (never on mnist10k itself).

The mnist10k DP-MERF presets mix four Gaussian length scales a factor 2 apart around ``median_scale`` times
the median distance of uniform-noise images (a data-independent rule: about sqrt(2 d / 3) = 22.9 on 28x28
pixels in [-1, 1]). Which ``median_scale``, and whether a mix beats the paper's single length
(l^2 = 105 on [0, 1] pixels, l = 20.49 on [-1, 1]), is decided here on public data:

- stand-ins: ``glyphs-digits?size=7000&seed=1`` (printed digits, N = 7,000 like mnist10k, so the noise of the
  release is the same) and scikit-learn's handwritten ``digits8x8`` upscaled to 28x28 (N = 1,257);
- for each candidate and ε in {1, 10}: the release of the presets (10,000 random features, class sums with
  jointly released counts at w = 0.1, σ from the same calibration) on the stand-in's train split, then the
  **noisy mean-embedding classifier** on its test split: x goes to argmax_c <phi(x), t_c>, the class whose
  released mean embedding is nearest in the kernel's feature space. This is what the generator is fitted to;
  it costs seconds, where a full run (generator training and a downstream CNN) costs tens of minutes per
  candidate on a shared CPU. Mean over ``--repeats`` noise draws.

    OMP_NUM_THREADS=1 python experiments/merf_bandwidth_on_public.py [--repeats 3] [--out results.json]

``--full SCALE [SCALE ...]`` instead runs the whole ``dp-merf/mnist10k_eps1`` preset on the glyphs stand-in
(``data.private`` replaced; generator training shortened to ``--steps``, 5,000 samples, one CNN seed) for each
``median_scale`` and prints the downstream CNN's accuracy on the stand-in's test split (public data):

    OMP_NUM_THREADS=1 python experiments/merf_bandwidth_on_public.py --full 0.5 0.25 1.0 --seeds 0 1 2 --out-dir DIR

``--features D [D ...]`` adds the number of random features to the grid (the preset's when left out): fewer
features carry less release noise in all (its squared norm grows with D) at a coarser kernel approximation.

The printed table names the winner per stand-in and ε; the presets' ``# how chosen:`` lines cite this script.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from dpsynth.data import load_dataset
from dpsynth.data.dataset import ImageDataset
from dpsynth.data.transforms import resize, uint8_to_tensor
from dpsynth.kernels import RandomFourierFeatures, bandwidth_ladder, median_heuristic
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.bounded_sum import BoundedSum, release_bounded_sum
from dpsynth.privacy.calibration import calibrate_mechanism
from dpsynth.privacy.mechanisms import Gaussian
from dpsynth.privacy.rng import NoiseSource
from dpsynth.runner import run_config

PAPER_LENGTH = 2 * math.sqrt(105.0)  # DP-MERF's rff_sigma = l^2 = 105 on [0, 1] pixels
CANDIDATES = {
    "paper single l=20.49": None,
    "ladder x2 median": 2.0,
    "ladder x1 median": 1.0,
    "ladder x1/2 median": 0.5,
    "ladder x1/4 median": 0.25,
}


def stand_ins() -> dict[str, tuple[ImageDataset, ImageDataset]]:
    glyphs = "glyphs-digits?size=7000&seed=1"
    digits = {split: load_dataset("digits8x8", split) for split in ("train", "test")}
    upscaled = {
        split: ImageDataset(resize(ds.images, 28), ds.labels, 10, f"digits8x8-28-{split}")
        for split, ds in digits.items()
    }
    return {
        "glyphs-digits (N=7000)": (load_dataset(glyphs, "train"), load_dataset(glyphs, "test")),
        "digits8x8 upscaled (N=1257)": (upscaled["train"], upscaled["test"]),
    }


def lengths(candidate: float | None) -> tuple[float, ...]:
    if candidate is None:
        return (PAPER_LENGTH,)
    generator = torch.Generator().manual_seed(0)
    noise = torch.rand((2000, 1, 28, 28), generator=generator) * 2 - 1
    return bandwidth_ladder(candidate * median_heuristic(noise), 4, 2.0)


def features_of(rff: RandomFourierFeatures, dataset: ImageDataset) -> torch.Tensor:
    parts = []
    for start in range(0, len(dataset), 500):
        parts.append(rff(uint8_to_tensor(dataset.images[start : start + 500])))
    return torch.cat(parts).double()


def evaluate(
    train: ImageDataset, test: ImageDataset, candidate: float | None, epsilons: tuple[float, ...], repeats: int
) -> dict[float, float]:
    """The noisy mean-embedding classifier's test accuracy (%) per ε, averaged over ``repeats`` draws of W and noise."""
    sigmas = {eps: calibrate_mechanism(eps, 1e-5, lambda s: Gaussian("rff-embedding", s, 1)) for eps in epsilons}
    accuracies: dict[float, list[float]] = {eps: [] for eps in epsilons}
    labels = torch.as_tensor(train.labels)
    for repeat in range(repeats):
        rff = RandomFourierFeatures(784, 10_000, lengths(candidate), seed=repeat)
        train_features, test_features = features_of(rff, train), features_of(rff, test)
        for eps, sigma in sigmas.items():
            query = BoundedSum("rff-embedding", 1.0, sigma, 10, count_weight=0.1)
            release = release_bounded_sum(
                iter([(train_features, labels)]), rff.dim, query, PrivacyLedger(eps, 1e-5), NoiseSource(seed=repeat)
            )
            predicted = (test_features @ release.means.T).argmax(dim=1).numpy()
            accuracies[eps].append(float((predicted == test.labels).mean()))
    return {eps: 100.0 * float(np.mean(values)) for eps, values in accuracies.items()}


def full_runs(
    scales: list[float], steps: int, out: Path, seeds: list[int], features: list[int | None] | None = None
) -> list[dict]:
    """The mnist10k ε=1 preset on the glyphs stand-in, one run per ``median_scale``, number of features (``None``:
    the preset's) and run seed: downstream CNN accuracy (%)."""
    rows = []
    grid = [(scale, dim, seed) for seed in seeds for dim in (features or [None]) for scale in scales]
    for scale, dim, seed in grid:
        name = f"glyphs-eps1-scale{scale:g}" + (f"-D{dim}" if dim else "") + (f"-seed{seed}" if seed else "")
        run_dir = out / name
        overrides = [
            f"seed={seed}",
            "data.private=glyphs-digits?size=7000&seed=1",
            f"dp-merf.median_scale={scale}",
            *([f"dp-merf.num_features={dim}"] if dim else []),
            f"dp-merf.steps={steps}",
            f"dp-merf.decay_every={max(steps // 5, 1)}",
            "generate.num=5000",
            "evaluate.seeds=1",
        ]
        metrics = run_dir / "diagnostics" / "metrics.json"
        if not metrics.is_file():  # an interrupted run of this script resumes its run directory
            run_config("dp-merf/mnist10k_eps1", overrides, out=run_dir, resume=run_dir.is_dir(), echo=False)
        value = json.loads(metrics.read_text())["accuracy"]["cnn"]
        accuracy = float(value["mean"] if isinstance(value, dict) else value)
        rows.append(
            {
                "stand_in": "glyphs-digits (N=7000)",
                "epsilon": 1.0,
                "median_scale": scale,
                "num_features": dim or "preset",
                "seed": seed,
                "cnn": accuracy,
            }
        )
        print(
            f"full run, glyphs stand-in, eps 1, median_scale {scale:g}, features {dim or 'preset'}, seed {seed}: "
            f"CNN {accuracy:.2f} %",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--full", type=float, nargs="*", default=None, help="median_scale values for full runs")
    parser.add_argument("--steps", type=int, default=1000, help="generator steps of a full run")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0], help="run seeds of the full runs")
    parser.add_argument(
        "--features", type=int, nargs="*", default=None, help="numbers of random features of the full runs (preset's)"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("experiments/out/merf_bandwidth"))
    args = parser.parse_args()
    if args.full:
        rows = full_runs(args.full, args.steps, args.out_dir, args.seeds, args.features)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=2) + "\n")
        return
    rows = []
    for name, (train, test) in stand_ins().items():
        for label, candidate in CANDIDATES.items():
            for epsilon, accuracy in evaluate(train, test, candidate, (1.0, 10.0), args.repeats).items():
                rows.append({"stand_in": name, "epsilon": epsilon, "candidate": label, "accuracy": accuracy})
                print(f"{name:30s} eps {epsilon:4g}  {label:22s} {accuracy:6.2f} %", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
