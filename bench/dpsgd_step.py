"""Benchmark one DP-SGD step: dpsynth's engine vs Opacus 1.6 (hooks / functorch) vs a non-private step.

Same model, batch, optimizer (Adam) and machine for every row; each configuration runs in its own
subprocess so that peak memory (``ru_maxrss``) is measured per configuration. Accounting is
excluded everywhere (the engine gets a counting ledger): the rows time gradients, clipping, noise
and the optimizer step only.

Models: the 1.1M-parameter conv classifier (``dpsynth.models.classifiers`` "cnn-1.1m") with
cross-entropy, and the 0.8M-parameter UNet (``dpsynth.models.unet`` preset "0.8m") with the
L_simple diffusion loss; batch 64 of 28x28x1 images.

K > 1 (augmentation/timestep multiplicity, dp-diffusion-finetuning.txt §4): the engine computes
one gradient per example of the K-averaged loss; Opacus has no multiplicity, so it is emulated the
only way it can be: B*K per-sample gradients, averaged per example, then clipped by DPOptimizer.

    OMP_NUM_THREADS=1 python bench/dpsgd_step.py --reps 5 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCH, IMAGE, CHANNELS, CLASSES = 64, 28, 1, 10
SIGMA, CLIP, LR = 1.0, 1.0, 1e-3

IMPLEMENTATIONS_K1 = ("non-private", "engine", "opacus-hooks", "opacus-functorch")
IMPLEMENTATIONS_KN = ("non-private", "engine", "opacus-hooks-emulation", "opacus-functorch-emulation")


# -- workloads ---------------------------------------------------------------------------------------

def build_workload(model_name: str, k: int):
    """Return ``(model, example_batch [B,K,...], per_example_loss, batched_loss)``."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if model_name == "cnn":
        from dpsynth.models.classifiers import build_classifier

        model = build_classifier("cnn-1.1m", CHANNELS, CLASSES, IMAGE)
        x = torch.randn(BATCH, 1, CHANNELS, IMAGE, IMAGE, generator=g)
        flips = torch.rand(BATCH, k, 1, 1, 1, generator=g) < 0.5  # K flipped/unflipped views
        views = torch.where(flips, x.flip(-1), x)
        batch = {"x": views.contiguous(), "y": torch.randint(0, CLASSES, (BATCH, 1), generator=g).expand(BATCH, k).contiguous()}

        def example_loss(model_call, example):
            return F.cross_entropy(model_call(example["x"]), example["y"])

        def batched_loss(module, flat):
            return F.cross_entropy(module(flat["x"]), flat["y"])
    else:
        from dpsynth.diffusion.losses import diffusion_loss, make_loss_fn, make_multiplicity_batch
        from dpsynth.diffusion.schedules import build_schedule, build_timestep_sampler
        from dpsynth.models.unet import build_unet

        model = build_unet("0.8m", IMAGE, CHANNELS, CLASSES)
        schedule = build_schedule("cosine", 1000)
        x0 = torch.rand(BATCH, CHANNELS, IMAGE, IMAGE, generator=g) * 2 - 1
        labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
        batch = make_multiplicity_batch(x0, labels, k, build_timestep_sampler(None, 1000), g)
        example_loss = make_loss_fn(schedule, "simple")

        def batched_loss(module, flat):
            return diffusion_loss(module, flat["x0"], flat["label"], flat["t"], flat["noise"], schedule)
    return model, batch, example_loss, batched_loss


def flatten_k(batch):
    """[B, K, ...] -> [B*K, ...]: the K views as independent samples (what Opacus sees)."""
    return {key: value.reshape(-1, *value.shape[2:]) for key, value in batch.items()}


class CountingLedger:
    """Accounting is not timed: this ledger only counts the engine's charges."""

    def __init__(self):
        self.mechanisms = []

    def register(self, mechanism):
        self.mechanisms.append(mechanism)

    def spend(self, name, steps=1):
        pass


# -- one step per implementation -----------------------------------------------------------------------

def make_step(implementation: str, model, batch, example_loss, batched_loss, k: int, physical: int = BATCH):
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    flat = flatten_k(batch)
    if implementation == "non-private":
        def step():
            optimizer.zero_grad(set_to_none=True)
            batched_loss(model, flat).backward()
            optimizer.step()
        return step

    if implementation == "engine":
        from dpsynth.dpsgd import DPSGDEngine

        engine = DPSGDEngine(model, optimizer, example_loss, CountingLedger(), noise_multiplier=SIGMA,
                             max_grad_norm=CLIP, sample_rate=0.01, expected_batch_size=BATCH,
                             max_physical_batch_size=physical)
        return lambda: engine.step(batch)

    from opacus.grad_sample import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean",
                           force_functorch=implementation.startswith("opacus-functorch"))
    dp_optimizer = DPOptimizer(optimizer, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                               expected_batch_size=BATCH, loss_reduction="mean")

    def step():
        dp_optimizer.zero_grad(set_to_none=True)
        batched_loss(gsm, flat).backward()
        if k > 1:  # emulate multiplicity: average the K per-sample gradients of each example
            for p in model.parameters():
                p.grad_sample = p.grad_sample.view(BATCH, k, *p.shape).mean(1)
        dp_optimizer.step()
    return step


def run_worker(config: dict) -> dict:
    import torch

    torch.set_num_threads(config["threads"])
    model, batch, example_loss, batched_loss = build_workload(config["model"], config["k"])
    parameters = sum(p.numel() for p in model.parameters())
    step = make_step(config["implementation"], model, batch, example_loss, batched_loss, config["k"],
                     config["physical"])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for _ in range(config["warmup"]):
        step()
    times = []
    for _ in range(config["reps"]):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**config, "parameters": parameters, "median_s": statistics.median(times), "times_s": times,
            "peak_rss_mib": peak, "step_rss_mib": peak - rss_before}


# -- driver ----------------------------------------------------------------------------------------

def configurations(args) -> list[dict]:
    configs = []
    for model in args.models:
        for k in args.ks:
            for implementation in (IMPLEMENTATIONS_K1 if k == 1 else IMPLEMENTATIONS_KN):
                physical = args.physical if args.physical else max(1, BATCH // k)
                configs.append({"model": model, "k": k, "implementation": implementation, "reps": args.reps,
                                "warmup": args.warmup, "threads": args.threads, "physical": physical})
    return configs


def run_in_subprocess(config: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(config["threads"]))
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(config)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {**config, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_ratios(results: list[dict]) -> None:
    for row in results:
        same = [r for r in results if r["model"] == row["model"] and r["k"] == row["k"] and "error" not in r]
        base = next((r for r in same if r["implementation"] == "non-private"), None)
        opacus = [r for r in same if r["implementation"].startswith("opacus")]
        best = min(opacus, key=lambda r: r["median_s"]) if opacus else None
        if "error" in row:
            continue
        row["vs_non_private"] = row["median_s"] / base["median_s"] if base else None
        row["vs_opacus_best"] = row["median_s"] / best["median_s"] if best else None
        row["opacus_best"] = best["implementation"] if best else None


def print_table(results: list[dict]) -> None:
    header = f"{'model':6} {'K':>2} {'implementation':28} {'phys':>4} {'median s':>9} {'x non-priv':>10} {'x opacus best':>13} {'peak MiB':>9} {'step MiB':>9}"
    print(header, file=sys.stderr)
    print("-" * len(header), file=sys.stderr)
    for r in results:
        if "error" in r:
            print(f"{r['model']:6} {r['k']:>2} {r['implementation']:28} error: {r['error']}", file=sys.stderr)
            continue
        phys = r["physical"] if r["implementation"] == "engine" else "-"
        print(f"{r['model']:6} {r['k']:>2} {r['implementation']:28} {phys:>4} {r['median_s']:9.3f} {r['vs_non_private']:10.2f} "
              f"{r['vs_opacus_best']:13.2f} {r['peak_rss_mib']:9.0f} {r['step_rss_mib']:9.0f}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed steps per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per configuration")
    parser.add_argument("--models", nargs="+", default=["cnn", "unet"], choices=["cnn", "unet"])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--physical", type=int, default=0,
                        help="engine micro-batch size in examples (default 64 // K: 64 images per vmap call)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    results = []
    for config in configurations(args):
        print(f"running {config['model']} K={config['k']} {config['implementation']} ...", file=sys.stderr, flush=True)
        results.append(run_in_subprocess(config))
    add_ratios(results)
    print_table(results)
    if args.json:
        print(json.dumps({"batch": BATCH, "image": [CHANNELS, IMAGE, IMAGE], "optimizer": "adam",
                          "threads": args.threads, "reps": args.reps, "results": results}))


if __name__ == "__main__":
    main()
