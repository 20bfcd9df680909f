"""Benchmark one DP-SGD step: dpsynth's engine vs Opacus 1.6 (hooks / ghost / functorch), plain torch.func
vmap and a non-private step.

Same model, batch, optimizer (Adam) and machine for every row; each configuration runs in its own
subprocess so that peak memory (``ru_maxrss``, plus ``torch.cuda.max_memory_allocated`` on GPU) is
measured per configuration. Accounting is excluded everywhere (the engine gets a counting ledger):
the rows time gradients, clipping, noise and the optimizer step only. On the CPU every row runs with
the opt-in glibc allocator settings of dpsynth.dpsgd.allocator (freed memory reused), so the ratios
compare the steps' work, not their page faults. ``--rounds N`` repeats every (model, K) group's rows N times in
alternating order and reports the medians of the ratios within a round (paired: see :func:`run_rounds`).

Workloads (``--models``), batch 64 of 28x28x1 images:

- ``cnn``: the 1.1M-parameter conv classifier (``cnn-1.1m``) with cross-entropy;
- ``unet-0.8m`` / ``unet-6m``: the UNet presets with the L_simple diffusion loss;
- ``refinenet``: DPPM's ``cpu`` RefineNet (``dpsynth.models.refinenet``, imported lazily and skipped
  with a message when absent) with the denoising score-matching loss.

``--precision fp32,bf16``: the engine and non-private rows once per precision; ``bf16`` runs the forward and
backward under autocast (the engine's ``precision`` argument, dpsynth.dpsgd.precision.Autocast; the
non-private step under ``torch.autocast``, the standard recipe), and each bf16 row reports its time as a
ratio to the fp32 row of the same implementation in the same run (``x fp32``). Its ``x non-priv``
compares with the non-private row of the same precision. ``fp16`` (CUDA only) is the same with float16 and
the engine's static loss scale, which the non-private row applies too (scaled backward, unscaled gradients).

K > 1 (augmentation/timestep multiplicity, Ghalebikesabi et al. (arXiv:2302.13861) §4): the engine and the
torch.func row compute one gradient per example of the K-averaged loss; Opacus has no multiplicity,
so its hooks and functorch modes are emulated the only way they can be: B*K per-sample gradients,
averaged per example, then clipped by DPOptimizer. Opacus' ghost clipping never forms per-sample
gradients, so it cannot average K copies before clipping: that row is reported as not applicable.

    OMP_NUM_THREADS=1 python experiments/dpsgd_step.py --models cnn,unet-0.8m --k 1,4 --reps 3 [--json]
    OMP_NUM_THREADS=1 python experiments/dpsgd_step.py --models cnn,unet-0.8m --k 1 \
        --implementations non-private,engine --precision fp32,bf16
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCH, IMAGE, CHANNELS, CLASSES = 64, 28, 1, 10
SIGMA, CLIP, LR = 1.0, 1.0, 1e-3

MODELS = ("cnn", "unet-0.8m", "unet-6m", "refinenet")
IMPLEMENTATIONS = (
    "non-private",
    "engine",
    "opacus-hooks",
    "opacus-ghost",
    "opacus-functorch",
    "torch-func",
    "graph-non-private",
    "graph-engine",
)
#: The graph rows' private set: MNIST's size, so the fixed-shape buffer is the one a paper-scale run uses.
GRAPH_RECORDS = 60_000
PRECISIONS = ("fp32", "bf16", "fp16")  # fp16 needs CUDA: the engine refuses it on the CPU
MIXED = ("non-private", "engine")  # the rows that run once per --precision


class Unavailable(Exception):
    """A row that cannot run here (a workload whose module is absent, a mode without multiplicity)."""


# -- workloads ---------------------------------------------------------------------------------------


def build_workload(model_name: str, k: int):
    """Return ``(model, example_batch [B,K,...], per_example_loss, per_sample_losses)``.

    ``per_sample_losses(module, flat)`` returns one loss per row of the flattened ``[B*K, ...]`` batch;
    its mean is the non-private loss and its rows are what Opacus' ghost clipping clips.
    """
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
        labels = torch.randint(0, CLASSES, (BATCH, 1), generator=g).expand(BATCH, k).contiguous()
        batch = {"x": views.contiguous(), "y": labels}

        def example_loss(model_call, example):
            return F.cross_entropy(model_call(example["x"]), example["y"])

        def per_sample_losses(module, flat):
            return F.cross_entropy(module(flat["x"]), flat["y"], reduction="none")
    elif model_name.startswith("unet-"):
        from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch
        from dpsynth.diffusion.schedules import build_schedule, build_timestep_sampler
        from dpsynth.models.unet import build_unet

        model = build_unet(model_name.removeprefix("unet-"), IMAGE, CHANNELS, CLASSES)
        schedule = build_schedule("cosine", 1000)
        x0 = torch.rand(BATCH, CHANNELS, IMAGE, IMAGE, generator=g) * 2 - 1
        labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
        batch = make_multiplicity_batch(x0, labels, k, build_timestep_sampler(None, 1000), g)
        example_loss = make_loss_fn(schedule, "simple")

        def per_sample_losses(module, flat):
            x_t = schedule.q_sample(flat["x0"], flat["t"], flat["noise"])
            return (module(x_t, flat["t"], flat["label"]) - flat["noise"]).pow(2).flatten(1).mean(1)
    elif model_name == "refinenet":
        try:
            from dpsynth.models.refinenet import build_refinenet
        except ImportError as exc:
            raise Unavailable(f"refinenet skipped: dpsynth.models.refinenet is not available ({exc})") from exc

        sigmas = torch.logspace(0, -2, 10)
        model = build_refinenet("cpu", CHANNELS, sigmas)
        x = torch.rand(BATCH, 1, CHANNELS, IMAGE, IMAGE, generator=g).expand(BATCH, k, CHANNELS, IMAGE, IMAGE)
        batch = {
            "x": x.contiguous(),
            "level": torch.randint(0, len(sigmas), (BATCH, k), generator=g),
            "z": torch.randn(BATCH, k, CHANNELS, IMAGE, IMAGE, generator=g),
        }

        def dsm(module, x, level, z):
            # denoising score matching (Song & Ermon 2019, Eq. 2), weighted by sigma^2
            sigma = sigmas[level].view(-1, 1, 1, 1)
            return (sigma * module(x + sigma * z, level) + z).pow(2).flatten(1).sum(1) / 2

        def example_loss(model_call, example):
            return dsm(model_call, example["x"], example["level"], example["z"]).mean()

        def per_sample_losses(module, flat):
            return dsm(module, flat["x"], flat["level"], flat["z"])
    else:
        raise Unavailable(f"unknown model {model_name!r}; choose from {', '.join(MODELS)}")
    return model, batch, example_loss, per_sample_losses


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


def make_step(
    implementation: str,
    model,
    batch,
    example_loss,
    per_sample_losses,
    k: int,
    physical: int,
    strategy: str = "auto",
    precision: str = "fp32",
):
    """A closure that takes one full step of ``implementation`` on ``batch``."""
    import contextlib

    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    flat = flatten_k(batch)
    if implementation == "non-private":
        device = next(model.parameters()).device.type
        from dpsynth.dpsgd.precision import Precision

        mixed = Precision(precision)
        dtype, scale = mixed.dtype, mixed.loss_scale

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype) if dtype else contextlib.nullcontext():
                loss = per_sample_losses(model, flat).mean()
            (loss * scale).backward()  # outside autocast, as torch's AMP recipe has it
            if scale != 1:
                torch._foreach_div_([p.grad for p in model.parameters() if p.grad is not None], scale)
            optimizer.step()

        return step

    if implementation == "graph-non-private":
        return graph_non_private_step(model, flat, per_sample_losses)

    if implementation == "graph-engine":
        return graph_engine_step(model, batch, example_loss, physical, "auto" if strategy == "-" else strategy)

    if implementation == "engine":
        from dpsynth.dpsgd import DPSGDEngine

        engine = DPSGDEngine(
            model,
            optimizer,
            example_loss,
            CountingLedger(),
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            sample_rate=0.01,
            expected_batch_size=BATCH,
            max_physical_batch_size=physical,
            strategy=strategy,
            precision=precision,
        )
        return lambda: engine.step(batch)

    if implementation == "torch-func":
        return torch_func_step(model, optimizer, batch, example_loss, physical)

    if implementation == "opacus-ghost":
        return opacus_ghost_step(model, optimizer, flat, per_sample_losses, k)

    from opacus.grad_sample import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(
        model, batch_first=True, loss_reduction="mean", force_functorch=implementation == "opacus-functorch"
    )
    dp_optimizer = DPOptimizer(
        optimizer, noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=BATCH, loss_reduction="mean"
    )

    def step():
        dp_optimizer.zero_grad(set_to_none=True)
        per_sample_losses(gsm, flat).mean().backward()
        if k > 1:  # emulate multiplicity: average the K per-sample gradients of each example
            for p in model.parameters():
                p.grad_sample = p.grad_sample.view(BATCH, k, *p.shape).mean(1)
        dp_optimizer.step()

    return step


def graph_non_private_step(model, flat, per_sample_losses):
    """The non-private step (capturable Adam) captured once as a CUDA graph and replayed; on the CPU the same
    ops run eagerly (there is no graph to capture), so the CPU row only checks that the row runs."""
    import torch

    cuda = next(model.parameters()).device.type == "cuda"
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, capturable=cuda)

    def step():
        optimizer.zero_grad(set_to_none=False)
        per_sample_losses(model, flat).mean().backward()
        optimizer.step()

    if not cuda:
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def graph_engine_step(model, batch, example_loss, physical: int, strategy: str):
    """The engine's fixed-shape step (dpsynth.dpsgd.fixed_shape) over a private set of ``GRAPH_RECORDS`` records
    (the workload's 64 tiled) at q = 64 / N: device Poisson coins, a buffer of ``poisson_capacity(N, q)`` rows,
    device per-record draws for the diffusion timesteps and noise, captured as one CUDA graph on CUDA (on the CPU
    the same step runs uncaptured). The step also times the sampling and the one-boolean overflow read."""
    import numpy as np
    import torch

    from dpsynth.dpsgd import DPSGDEngine
    from dpsynth.dpsgd.fixed_shape import DevicePoissonSampler, FixedShapeStep, masked_loss
    from dpsynth.privacy.device_draws import DeviceRecordRandomness
    from dpsynth.privacy.record_draws import RecordRandomness
    from dpsynth.privacy.rng import NoiseSource

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    q = BATCH / GRAPH_RECORDS
    noise = NoiseSource()
    engine = DPSGDEngine(
        model,
        torch.optim.Adam(model.parameters(), lr=LR),
        masked_loss(example_loss),
        CountingLedger(),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        sample_rate=q,
        expected_batch_size=BATCH,
        max_physical_batch_size=10**9 if cuda else physical,  # one micro-batch of the whole buffer on a GPU
        strategy=strategy,
        noise=noise,
    )
    keys = np.arange(GRAPH_RECORDS, dtype=np.uint64)
    randomness = DeviceRecordRandomness(RecordRandomness(keys), device)

    def build(indices, draws):
        rows = {key: value[indices % BATCH] for key, value in batch.items()}
        if "noise" in rows:  # the diffusion workloads: timesteps and noise drawn per record on the device
            rows["t"] = draws.randint(0, 1000, *rows["t"].shape[1:]).to(rows["t"].dtype)
            rows["noise"] = draws.randn(*rows["noise"].shape[1:], dtype=rows["noise"].dtype)
        return rows

    sampler = DevicePoissonSampler(GRAPH_RECORDS, q, noise.generator(device))
    fixed = FixedShapeStep(engine, randomness, build, sampler, sampler.capacity if cuda else physical, capture=cuda)
    return fixed


def opacus_ghost_step(model, optimizer, flat, per_sample_losses, k: int):
    """Opacus' ghost clipping (``grad_sample_mode="ghost"``): norms from a first backward, then a
    second backward of the clip-weighted loss."""
    if k > 1:
        raise Unavailable("n/a: ghost clipping clips each of the B*K rows; it cannot average K copies first")
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(
        model, batch_first=True, loss_reduction="mean", max_grad_norm=CLIP, use_ghost_clipping=True
    )
    dp_optimizer = DPOptimizerFastGradientClipping(
        optimizer, noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=BATCH, loss_reduction="mean"
    )

    def step():
        dp_optimizer.zero_grad(set_to_none=True)
        losses = per_sample_losses(gsm, flat)
        DPTensorFastGradientClipping(gsm, dp_optimizer, losses, "mean").backward()
        dp_optimizer.step()

    return step


def torch_func_step(model, optimizer, batch, example_loss, physical: int):
    """Textbook DP-SGD with ``vmap(grad)``: every per-example gradient instantiated, flat clipping."""
    import torch
    from torch.func import functional_call, grad, vmap

    buffers = dict(model.named_buffers())

    def one_loss(params, example):
        return example_loss(lambda *a, **kw: functional_call(model, (params, buffers), a, kw), example)

    per_example = vmap(grad(one_loss), in_dims=(None, 0), randomness="different")
    noise = torch.Generator().manual_seed(1)

    def step():
        params = {name: p.detach() for name, p in model.named_parameters()}
        total = {name: torch.zeros_like(p) for name, p in params.items()}
        size = next(iter(batch.values())).shape[0]
        for start in range(0, size, physical):
            grads = per_example(params, {key: v[start : start + physical] for key, v in batch.items()})
            norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
            scale = (CLIP / (norms + 1e-6)).clamp(max=1.0)
            for name, g in grads.items():
                total[name].add_(torch.tensordot(scale, g, dims=1))
        for name, p in model.named_parameters():
            p.grad = (total[name] + SIGMA * CLIP * torch.randn(p.shape, generator=noise).to(p.device)) / BATCH
        optimizer.step()

    return step


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        + ("keepcost",)
    ]


def heap_peak_mib(step) -> float | None:
    """Peak bytes in use on the C heap (glibc ``mallinfo2``: allocated chunks plus mmapped blocks)
    during one more, untimed step, sampled every 0.5 ms by a thread: the memory the step holds,
    whatever freed memory the allocator keeps mapped (which ``ru_maxrss`` counts). None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    peak, done = [in_use()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], in_use())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        step()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], in_use()) / 2**20


def run_worker(config: dict) -> dict:
    import torch

    torch.set_num_threads(config["threads"])
    device = torch.device(config["device"])
    if device.type == "cpu":
        from dpsynth.dpsgd.allocator import reuse_freed_memory

        reuse_freed_memory()  # every row under the same allocator settings: the ratios compare work, not faults
    try:
        model, batch, example_loss, per_sample_losses = build_workload(config["model"], config["k"])
        model = model.to(device)
        batch = {key: value.to(device) for key, value in batch.items()}
        step = make_step(
            config["implementation"],
            model,
            batch,
            example_loss,
            per_sample_losses,
            config["k"],
            config["physical"],
            config["strategy"],
            config.get("precision", "fp32"),
        )
    except Unavailable as exc:
        return {**config, "error": str(exc)}
    parameters = sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for _ in range(config["warmup"]):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(config["reps"]):
        start = time.perf_counter() if cuda else time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() if cuda else time.process_time()) - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = {
        **config,
        "parameters": parameters,
        "median_s": statistics.median(times),
        "times_s": times,
        "peak_mib": peak,
        "step_rss_mib": peak - rss_before,
    }
    if cuda:
        row["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        row["heap_peak_mib"] = heap_peak_mib(step)  # after the timed steps: the sampler is not timed
    return row


# -- driver ----------------------------------------------------------------------------------------


def default_physical(k: int, device: str) -> int:
    """The engine's micro-batch in examples: 64 // K on a CPU (64 images per vmap call), the whole batch on a
    GPU, which is bound by kernel launches (an H200 run at K = 4 in micro-batches of 16 examples took 3.6x the
    K = 1 step) and which Opacus' rows get too (they take the B*K rows at once)."""
    return BATCH if device == "cuda" else max(1, BATCH // k)


def configurations(args) -> list[dict]:
    configs = []
    for model in args.models:
        for k in args.k:
            for implementation in args.implementations:
                physical = args.physical or default_physical(k, args.device)
                precisions = args.precision if implementation in MIXED else ["fp32"]
                for strategy in args.strategy if implementation == "engine" else ["-"]:
                    for precision in precisions:
                        configs.append(
                            {
                                "model": model,
                                "k": k,
                                "implementation": implementation,
                                "reps": args.reps,
                                "warmup": args.warmup,
                                "threads": args.threads,
                                "physical": physical,
                                "strategy": strategy,
                                "device": args.device,
                                "precision": precision,
                            }
                        )
    return configs


def run_in_subprocess(config: dict, timeout: float | None = None) -> dict:
    # The repository first, then whatever PYTHONPATH the caller set (e.g. a --target directory of wheels).
    path = os.pathsep.join([str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(config["threads"]))
    command = [sys.executable, __file__, "--worker", json.dumps(config)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**config, "error": f"timeout: no result within {timeout:g} s"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {**config, "error": lines[-1] if lines else "failed", "stderr_tail": "\n".join(lines[-25:])}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_rounds(configs: list[dict], rounds: int, timeout: float | None) -> list[dict]:
    """Run each (model, K) group's configurations ``rounds`` times, the group's order reversed every other
    round, and combine the rounds (:func:`combine_rounds`). A round's rows run one after the other, so their
    ratios compare steps taken a minute or so apart, not an hour: this VM's speed drifts by 10-20 % over a
    long run (BENCHMARKS.md), which the ratio of two rows' medians taken far apart would carry."""
    groups: dict[tuple[str, int], list[int]] = {}
    for index, config in enumerate(configs):
        groups.setdefault((config["model"], config["k"]), []).append(index)
    per_round: list[list[dict]] = [[{} for _ in configs] for _ in range(rounds)]
    for members in groups.values():
        for number in range(rounds):
            for index in members if number % 2 == 0 else members[::-1]:
                config = configs[index]
                print(f"running {config['model']} K={config['k']} {_name(config)} ...", file=sys.stderr, flush=True)
                row = run_in_subprocess(config, timeout)
                if "error" in row and row["error"].startswith("refinenet skipped"):
                    print(row["error"], file=sys.stderr)
                per_round[number][index] = row
    for rows in per_round:
        add_ratios(rows)
    return combine_rounds(per_round)


RATIOS = ("vs_non_private", "memory_vs_non_private", "heap_vs_non_private", "vs_opacus_best", "vs_fp32")
MEASURES = ("median_s", "peak_mib", "heap_peak_mib", "cuda_peak_mib", "step_rss_mib")


def combine_rounds(per_round: list[list[dict]]) -> list[dict]:
    """One row per configuration: the median over the rounds of each measure and of each ratio to the same
    round's rows (paired). The rounds' own values stay in ``round_values``. One round is returned as it is."""
    if len(per_round) == 1:
        return per_round[0]
    combined = []
    for rows in zip(*per_round):
        failed = next((row for row in rows if "error" in row), None)
        if failed is not None:
            combined.append(failed)
            continue
        row = dict(rows[0], rounds=len(rows), times_s=[t for r in rows for t in r["times_s"]])
        row["round_values"] = {
            key: [r.get(key) for r in rows] for key in (*MEASURES, *RATIOS) if rows[0].get(key) is not None
        }
        for key, values in row["round_values"].items():
            row[key] = statistics.median(values) if None not in values else None
        combined.append(row)
    return combined


def add_ratios(results: list[dict]) -> None:
    for row in results:
        if "error" in row:
            continue
        same = [r for r in results if r["model"] == row["model"] and r["k"] == row["k"] and "error" not in r]
        precision = row.get("precision", "fp32")
        base = next(
            (r for r in same if r["implementation"] == "non-private" and r.get("precision", "fp32") == precision), None
        )
        fp32 = next(
            (
                r
                for r in same
                if (r["implementation"], r["strategy"], r.get("precision", "fp32"))
                == (row["implementation"], row["strategy"], "fp32")
            ),
            None,
        )
        row["vs_fp32"] = row["median_s"] / fp32["median_s"] if fp32 and precision != "fp32" else None
        opacus = [r for r in same if r["implementation"].startswith("opacus")]
        best = min(opacus, key=lambda r: r["median_s"]) if opacus else None
        row["vs_non_private"] = row["median_s"] / base["median_s"] if base else None
        row["memory_vs_non_private"] = row["peak_mib"] / base["peak_mib"] if base else None
        heap, base_heap = row.get("heap_peak_mib"), base.get("heap_peak_mib") if base else None
        row["heap_vs_non_private"] = heap / base_heap if heap and base_heap else None
        row["vs_opacus_best"] = row["median_s"] / best["median_s"] if best else None
        graph_base = next((r for r in same if r["implementation"] == "graph-non-private"), None)
        row["vs_graph_non_private"] = row["median_s"] / graph_base["median_s"] if graph_base else None
        row["opacus_best"] = best["implementation"] if best else None


def _name(row: dict) -> str:
    name = f"engine ({row['strategy']})" if row["implementation"] == "engine" else row["implementation"]
    precision = row.get("precision", "fp32")
    return name if precision == "fp32" else f"{name} {precision}"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def print_table(results: list[dict]) -> None:
    header = (
        f"{'model':10} {'K':>2} {'implementation':26} {'median s':>9} {'x non-priv':>10} {'x fp32':>6} "
        f"{'x opacus best':>13} {'x graph np':>10} "
        f"{'peak MiB':>9} {'x non-priv mem':>14} {'heap MiB':>9} {'x non-priv heap':>15}"
    )
    print(header, file=sys.stderr)
    print("-" * len(header), file=sys.stderr)
    for r in results:
        if "error" in r:
            print(f"{r['model']:10} {r['k']:>2} {_name(r):26} {r['error']}", file=sys.stderr)
            continue
        print(
            f"{r['model']:10} {r['k']:>2} {_name(r):26} {r['median_s']:9.3f} {_ratio(r['vs_non_private']):>10} "
            f"{_ratio(r.get('vs_fp32')):>6} "
            f"{_ratio(r['vs_opacus_best']):>13} {_ratio(r.get('vs_graph_non_private')):>10} "
            f"{r['peak_mib']:9.0f} {_ratio(r['memory_vs_non_private']):>14} "
            f"{r.get('heap_peak_mib') or 0:9.0f} {_ratio(r.get('heap_vs_non_private')):>15}",
            file=sys.stderr,
        )


def _csv(kind):
    def parse(text: str):
        return [kind(item) for item in text.split(",") if item]

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        type=_csv(str),
        default=["cnn", "unet-0.8m"],
        help=f"comma-separated workloads from {','.join(MODELS)} ('unet' = unet-0.8m)",
    )
    parser.add_argument("--k", type=_csv(int), default=[1, 4], help="comma-separated multiplicities, e.g. 1,4")
    parser.add_argument(
        "--implementations",
        type=_csv(str),
        default=list(IMPLEMENTATIONS),
        help=f"comma-separated rows from {','.join(IMPLEMENTATIONS)}",
    )
    parser.add_argument("--reps", type=int, default=5, help="timed steps per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per configuration")
    parser.add_argument(
        "--physical",
        type=int,
        default=0,
        help="engine/torch-func micro-batch in examples (default 64 // K on a CPU, all 64 on cuda)",
    )
    parser.add_argument(
        "--strategy",
        type=_csv(str),
        default=["auto"],
        help="comma-separated engine strategies (auto,ghost,instantiate,timed,exact): one engine row each",
    )
    parser.add_argument(
        "--precision",
        type=_csv(str),
        default=["fp32"],
        help=f"comma-separated precisions from {','.join(PRECISIONS)} for the engine and non-private rows",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (GPU rows report torch.cuda peak memory too)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list on stdout")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per configuration; a row past it reports a timeout"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every (model, K) group's rows this many times, in alternating order, and report the median of "
        "the ratios within each round (paired): for a machine whose speed drifts",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    args.models = ["unet-0.8m" if m == "unet" else m for m in args.models]
    for name in [m for m in args.models if m not in MODELS]:
        print(f"skipping unknown model {name!r}; known: {', '.join(MODELS)}", file=sys.stderr)
    args.models = [m for m in args.models if m in MODELS]
    if [p for p in args.precision if p not in PRECISIONS]:
        parser.error(f"unknown precision in {args.precision}; choose from {', '.join(PRECISIONS)}")
    unknown = [i for i in args.implementations if i not in IMPLEMENTATIONS]
    if unknown:
        parser.error(f"unknown implementations {unknown}; choose from {', '.join(IMPLEMENTATIONS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    results = run_rounds(configurations(args), args.rounds, args.timeout)
    print_table(results)
    if args.rounds > 1:
        print(
            f"each value is the median over {args.rounds} rounds; each ratio the median of the ratios within a round",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
