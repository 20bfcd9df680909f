"""Time DP-SGD steps of paper-scale diffusion models on random inputs: no dataset, no network.

Two workloads, each case in its own subprocess (its own peak memory, its own time limit), the rows
written to ``--json`` after every case so that a run cut short keeps what it measured:

``large-unet``
    A UNet of the paper's architecture at 32x32x3, 10 classes, K = 1, batch 32, L_simple: one
    non-private step (backward + Adam) and one ``DPSGDEngine`` step (per-example gradients, clipping,
    noise, Adam) per timed repetition, with seconds per step and peak memory
    (``torch.cuda.max_memory_allocated`` on GPU). Models: UNet presets (``16m``, ``80m``) and ``35m``,
    the 80m architecture at 128 base channels (38.3M parameters), dpsynth has no preset nearer 35M.

``presets``
    A packaged preset (e.g. ``dpdm/cifar10_eps10``, ``pdp-diffusion/cifar10_eps10``) at its full model
    size, logical batch B, multiplicity K and physical batch, built the way
    :class:`dpsynth.methods.families.diffusion.DiffusionMethod` builds them (model spec, loss, timestep
    sampler, augmentation, per-record draws, Adam, EMA, DPDM's public clip probe), with random
    images of the dataset's shape in place of the private data. A logical step of B examples is
    ``ceil(B / physical)`` micro-batches: the worker times a *partial* step of ``--micro``
    micro-batches (per micro-batch: building its inputs on the CPU and computing its clipped
    per-example gradients on the device; then noise, optimizer, EMA), projects the full step from it,
    and takes ``--full-steps`` full logical steps when the projection fits ``--full-budget-s``.
    The projection times the number of DP steps in the preset's privacy plan (``dpsynth run PRESET
    --dry-run --json``, run by the ``dry-runs`` command) gives projected DP training hours, set
    next to the toolkit's own estimates (docs/gpu.md, ``dpsynth/bench/suites/*.yaml``).

On a CUDA out-of-memory error a case is retried with half the physical batch (the logical batch and
the accounting do not depend on it), down to 1; every attempt is a row.

    python experiments/paper_scale_steps.py large-unet --device cuda --json large.json
    python experiments/paper_scale_steps.py dry-runs --presets dpdm/cifar10_eps10 --out /tmp/dry
    python experiments/paper_scale_steps.py presets --device cuda --presets dpdm/cifar10_eps10 --dry-run-dir /tmp/dry \\
        --json paper.json

``--tiny`` shrinks every model, batch and multiplicity (same code paths) for a CPU check in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: ``35m``: the paper's 80M CIFAR-10 architecture (mult 1,2,2,2, depth 2, attention at 16x16) at 128 channels.
LARGE_MODELS = {
    "16m": "16m",
    "35m": {"preset": "80m", "base_channels": 128},
    "80m": "80m",
}
TINY_UNET = {"base_channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_levels": [1]}
TINY_UNET["num_head_channels"] = 8
DEFAULT_PRESETS = "dpdm/cifar10_eps10,pdp-diffusion/cifar10_eps10,pdp-diffusion/mnist_eps10,privimage/cifar10_eps10"
# Used only when load_config fails (e.g. a method module mid-edit): the method's own defaults that matter here.
FALLBACK_DEFAULTS = {
    "pdp-diffusion": {"learn_sigma": False, "loss": "simple", "noise_schedule": "linear", "multiplicity": 128},
    "privimage": {"learn_sigma": False, "loss": "simple"},
    "dpdm": {"learn_sigma": True, "loss": "hybrid", "noise_schedule": "cosine"},
}


class CountingLedger:
    """Accounting is not timed: this ledger only counts the engine's charges."""

    def __init__(self):
        self.mechanisms, self.spent = [], 0

    def register(self, mechanism):
        self.mechanisms.append(mechanism)

    def spend(self, name, steps=1):
        self.spent += steps


# -- the worker: one case in one process -------------------------------------------------------------


class Clock:
    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def now(self):
        self.sync()
        return time.perf_counter()

    def reset_peak(self):
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()

    def memory(self) -> dict:
        if self.cuda:
            return {
                "cuda_peak_mib": self.torch.cuda.max_memory_allocated() / 2**20,
                "cuda_peak_reserved_mib": self.torch.cuda.max_memory_reserved() / 2**20,
            }
        return {"rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _median(values):
    return statistics.median(values) if values else None


def _mean(values):
    return statistics.fmean(values) if values else None


def _is_oom(exc: BaseException) -> bool:
    return "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"


def run_case(case: dict, row: dict) -> None:
    """Build the case's model, loss and inputs; time the non-private and the engine rows into ``row``
    (filled as it goes, so an error keeps what was measured before it)."""
    import numpy as np
    import torch

    from dpsynth.diffusion.generation import DiffusionModelSpec, build_diffusion_model
    from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch
    from dpsynth.diffusion.schedules import MixtureOfUniformTimesteps
    from dpsynth.dpsgd import DPSGDEngine
    from dpsynth.privacy.record_draws import RecordRandomness

    started = time.perf_counter()
    budget = float(case["budget_s"])

    def left() -> float:
        return budget - (time.perf_counter() - started)

    if case.get("threads"):
        torch.set_num_threads(int(case["threads"]))
    if case.get("reuse_freed_memory"):
        from dpsynth.dpsgd.allocator import reuse_freed_memory

        reuse_freed_memory()
    device = torch.device(case["device"])
    clock = Clock(device)
    torch.manual_seed(0)
    spec = DiffusionModelSpec(
        model=case["model"],
        image_size=case["image_size"],
        channels=case["channels"],
        num_classes=case["num_classes"],
        learn_sigma=case["learn_sigma"],
        noise_schedule=case["noise_schedule"],
        timesteps=case["timesteps"],
    )
    model = build_diffusion_model(spec).to(device).train()
    row["parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    schedule = spec.schedule()
    sampler = MixtureOfUniformTimesteps(case["timestep_weights"], case["timestep_boundaries"], spec.timesteps)
    loss_fn = make_loss_fn(schedule, kind=case["loss"], vlb_weight=case["vlb_weight"])
    batch, physical, k = case["batch_size"], case["physical"], case["multiplicity"]
    n_full = math.ceil(batch / physical)
    augment = dict(case["augment"], null_label=spec.num_classes)
    shape = (spec.channels, spec.image_size, spec.image_size)
    randomness = RecordRandomness(np.random.default_rng(1).integers(0, 2**63, batch, dtype=np.uint64))

    def make_micro(step: int, index: int, size: int | None = None, public: bool = False) -> dict:
        """Micro-batch ``index`` of logical step ``step``: random images, per-record draws (as train_private)."""
        start = (index * physical) % batch
        size = min(size or physical, batch - start)
        g = torch.Generator().manual_seed(1000 * step + index)
        x0 = torch.rand(size, *shape, generator=g) * 2 - 1
        labels = torch.randint(0, spec.num_classes, (size,), generator=g)
        chunk = torch.arange(start, start + size)
        draws = g if public else randomness.draws(step, chunk)
        example = make_multiplicity_batch(x0, labels, k, sampler, draws, **augment)
        return {key: value.to(device) for key, value in example.items()}

    # -- non-private: backward + Adam on one physical micro-batch (physical * K images) ---------------
    if "non-private" in case["rows"]:
        optimizer = flat = None
        try:
            optimizer = torch.optim.Adam(model.parameters(), lr=case["lr"], betas=tuple(case["betas"]))
            flat = {key: value.reshape(-1, *value.shape[2:]) for key, value in make_micro(0, 0).items()}

            def plain_step():
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model, flat).backward()
                optimizer.step()

            for _ in range(case["warmup"]):
                plain_step()
            clock.reset_peak()
            times = []
            for _ in range(case["reps"]):
                t0 = clock.now()
                plain_step()
                times.append(clock.now() - t0)
            row["non_private"] = {
                "images_per_step": physical * k,
                "median_s": _median(times),
                "times_s": times,
                **clock.memory(),
            }
        except Exception as exc:  # an OOM here must not stop the engine row
            row["non_private"] = {"error": f"{type(exc).__name__}: {exc}"[:500], "oom": _is_oom(exc)}
        finally:
            optimizer = flat = None
            model.zero_grad(set_to_none=True)
            clock.reset_peak()

    if "engine" not in case["rows"]:
        return

    # -- the engine: partial steps of `micro` micro-batches, then full logical steps if affordable -----
    from dpsynth.dpsgd import public_clip_norm
    from dpsynth.dpsgd.training import PrivateTraining, make_optimizer

    settings = PrivateTraining(
        batch_size=batch,
        lr=case["lr"],
        steps=1,
        betas=tuple(case["betas"]),
        physical_batch_size=physical,
        ema_decay=case["ema_decay"],
        strategy=case["strategy"],
    )
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], settings)
    engine = DPSGDEngine(
        model,
        optimizer,
        loss_fn,
        CountingLedger(),
        noise_multiplier=1.0,
        max_grad_norm=case["clip_norm"],
        sample_rate=case["sample_rate"],
        expected_batch_size=batch,
        max_physical_batch_size=physical,
        ema_decay=settings.ema_decay,
        strategy=settings.strategy,
    )
    row["engine_strategy"] = engine.strategy
    probe_size = int(case.get("clip_probe_batch") or 0)

    def probe() -> float:
        """DPDM §IV-B: the clip norm of each step from a public batch (costs a per-example pass)."""
        t0 = clock.now()
        engine.max_grad_norm = public_clip_norm(engine, make_micro(10**6, 0, size=probe_size, public=True))
        return clock.now() - t0

    def timed_step(step: int, micro: int) -> dict:
        record = {"build_s": [], "compute_s": []}

        def stream():
            for index in range(micro):
                t0 = clock.now()
                example = make_micro(step, index)
                t1 = clock.now()
                record["build_s"].append(t1 - t0)
                yield example
                record["compute_s"].append(clock.now() - t1)

        probe_s = probe() if probe_size else 0.0
        t0 = clock.now()
        engine.step(stream())
        total = clock.now() - t0
        record.update(
            micro_batches=micro,
            probe_s=probe_s,
            step_s=total + probe_s,
            # noise, optimizer, EMA and the accumulators: what a step costs beyond its micro-batches
            overhead_s=total - sum(record["build_s"]) - sum(record["compute_s"]),
        )
        return record

    micro = max(1, min(int(case["micro"]), n_full))
    row.update(n_micro_full=n_full, images_per_micro=physical * k)
    timed_step(0, 1)  # warm-up: kernels, Adam and EMA state, allocator
    clock.reset_peak()
    partials = []
    for rep in range(max(1, int(case["partial_reps"]))):
        if rep and left() < 2 * (partials[-1]["step_s"] + 5):
            break
        partials.append(timed_step(1 + rep, micro))
    row["engine_partial"] = {**partials[-1], "reps": len(partials), "all_step_s": [p["step_s"] for p in partials]}
    row["engine_partial"].update(clock.memory())
    build = _median([b for p in partials for b in p["build_s"]])
    compute = _median([c for p in partials for c in p["compute_s"]])
    overhead = _median([p["overhead_s"] for p in partials])
    probe_s = _median([p["probe_s"] for p in partials])
    projected = n_full * (build + compute) + overhead + probe_s
    row["per_micro"] = {"build_s": build, "compute_s": compute, "overhead_s": overhead, "probe_s": probe_s}
    row["projected_full_step_s"] = projected

    fulls, spent = [], 0.0
    for step in range(int(case["full_steps"])):
        if micro == n_full and step < len(partials):
            fulls.append(partials[step])  # the partial step was already a full one
            continue
        limit = min(float(case["full_budget_s"]) - spent, left() - 10)
        expected = fulls[-1]["step_s"] if fulls else projected
        if expected > limit:
            row["full_skipped"] = (
                f"full step {len(fulls) + 1}: {expected:.1f} s (projected), over the {limit:.1f} s left for full steps"
            )
            break
        fulls.append(timed_step(100 + step, n_full))
        spent += fulls[-1]["step_s"]
    if fulls:
        row["engine_full"] = {
            "steps": len(fulls),
            "median_s": _median([f["step_s"] for f in fulls]),
            "step_s": [f["step_s"] for f in fulls],
            "build_s_sum": [sum(f["build_s"]) for f in fulls],
            "compute_s_sum": [sum(f["compute_s"]) for f in fulls],
            "overhead_s": [f["overhead_s"] for f in fulls],
            "probe_s": [f["probe_s"] for f in fulls],
            **clock.memory(),
        }
    row["engine_peak"] = clock.memory()
    non_private = row.get("non_private", {}).get("median_s")
    if non_private:
        row["engine_micro_vs_non_private"] = compute / non_private


def worker_main(case: dict) -> dict:
    row = dict(case)
    started = time.perf_counter()
    try:
        run_case(case, row)
    except Exception as exc:
        row.update(
            error=f"{type(exc).__name__}: {exc}"[:1000], oom=_is_oom(exc), traceback=traceback.format_exc()[-3000:]
        )
    row["worker_wall_s"] = time.perf_counter() - started
    return row


# -- the driver ----------------------------------------------------------------------------------------


def python_env() -> dict:
    path = os.pathsep.join([str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return dict(os.environ, PYTHONPATH=path)


def run_in_subprocess(case: dict) -> dict:
    timeout = float(case["budget_s"]) + 90  # model build, imports, the last step's tail
    command = [sys.executable, __file__, "--worker", json.dumps(case)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=python_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {**case, "error": f"timeout after {timeout:.0f} s", "stderr_tail": tail}
    lines = done.stdout.strip().splitlines()
    try:
        row = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        row = {**case, "error": f"worker exited {done.returncode} without a result"}
    if done.returncode != 0 or "error" in row:
        row["stderr_tail"] = done.stderr[-3000:]
    row["subprocess_s"] = time.perf_counter() - started
    return row


def run_with_oom_retry(case: dict, deadline: float, min_case_s: float) -> list[dict]:
    rows = []
    while True:
        case = dict(case, budget_s=max(10.0, min(case["budget_s"], deadline - time.time() - 60)))
        print(f"[{time.strftime('%H:%M:%S')}] {case['name']} physical={case['physical']} ...", file=sys.stderr)
        row = run_in_subprocess(case)
        rows.append(row)
        print(f"    -> {summary_line(row)}", file=sys.stderr, flush=True)
        # Only an engine OOM is retried: a non-private OOM alone leaves the engine row measured.
        if not (row.get("oom") and case["physical"] > 1) or deadline - time.time() < min_case_s:
            return rows
        case = dict(case, physical=case["physical"] // 2, oom_retry_of=case["physical"])


def summary_line(row: dict) -> str:
    if "error" in row:
        return f"ERROR {row['error'][:300]}"
    parts = [f"{row.get('parameters', 0) / 1e6:.1f}M params"]
    np_row = row.get("non_private") or {}
    if "median_s" in np_row:
        parts.append(f"non-private {np_row['median_s']:.4f} s/step peak {_mem(np_row)}")
    elif np_row:
        parts.append(f"non-private {np_row.get('error', '')[:120]}")
    if "per_micro" in row:
        m = row["per_micro"]
        parts.append(
            f"engine micro {m['compute_s']:.4f} s (+build {m['build_s']:.4f} s) x {row['n_micro_full']}"
            f" + {m['overhead_s']:.4f} s, projected full step {row['projected_full_step_s']:.2f} s"
        )
    if "engine_full" in row:
        parts.append(f"full step {row['engine_full']['median_s']:.3f} s peak {_mem(row['engine_full'])}")
    elif "engine_partial" in row:
        parts.append(f"peak {_mem(row['engine_partial'])}")
    return "; ".join(parts)


def _mem(record: dict) -> str:
    if "cuda_peak_mib" in record:
        return f"{record['cuda_peak_mib']:.0f} MiB (cuda)"
    return f"{record.get('rss_peak_mib', 0):.0f} MiB (rss)"


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(target)


def meta(args) -> dict:
    import torch

    info = {
        "command": sys.argv,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": args.device,
        "tiny": args.tiny,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_total_mib"] = torch.cuda.get_device_properties(0).total_memory / 2**20
    return info


def base_case(args) -> dict:
    return {
        "device": args.device,
        "threads": args.threads or (1 if args.tiny else 0),
        "reuse_freed_memory": getattr(args, "reuse_freed_memory", False),
        "warmup": 1 if args.tiny else 2,
        "reps": 1 if args.tiny else args.reps,
        "strategy": "auto",
        "lr": 1e-3,
        "betas": [0.9, 0.999],
        "vlb_weight": 0.001,
        "clip_norm": 1.0,
        "augment": {},
        "clip_probe_batch": 0,
        "tiny": args.tiny,  # tiny: the projections below describe the shrunken case, not the preset
    }


def cmd_large_unet(args) -> None:
    deadline = time.time() + args.budget_s
    payload = {"meta": meta(args), "cases": []}
    for name in args.models:
        if name not in LARGE_MODELS:
            payload["cases"].append({"name": name, "error": f"unknown model; choose from {', '.join(LARGE_MODELS)}"})
            continue
        if deadline - time.time() < 30:
            payload["cases"].append({"name": name, "error": "skipped: out of time"})
            continue
        model = {**TINY_UNET, "preset": "0.8m"} if args.tiny else LARGE_MODELS[name]
        case = dict(
            base_case(args),
            name=f"unet-{name}",
            kind="large-unet",
            model=model,
            image_size=args.image,
            channels=3,
            num_classes=10,
            learn_sigma=False,
            noise_schedule="linear",
            timesteps=1000,
            loss="simple",
            timestep_weights=[1.0],
            timestep_boundaries=[0, 1000],
            multiplicity=1,
            batch_size=4 if args.tiny else args.batch,
            physical=4 if args.tiny else args.batch,
            sample_rate=0.01,
            ema_decay=None,
            rows=["non-private", "engine"],
            micro=1,
            partial_reps=1 if args.tiny else args.reps,
            full_steps=1 if args.tiny else args.reps,
            full_budget_s=60.0,
            budget_s=min(args.case_budget_s, deadline - time.time() - 20),
        )
        payload["cases"].extend(run_with_oom_retry(case, deadline, 30))
        write_json(args.json, payload)
    payload["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json(args.json, payload)
    print_rows(payload["cases"])


def preset_case(args, preset: str) -> dict:
    """The case of a packaged preset: its method section resolved by dpsynth's own config loader."""
    from dpsynth.config import find_config, read_yaml
    from dpsynth.data.registry import resolve

    source = "load_config"
    try:
        from dpsynth.config import load_config

        config = load_config(preset).to_dict()
        section = config[config["method"]]
    except Exception as exc:  # e.g. another method module mid-edit: fall back to the YAML and known defaults
        from dpsynth.methods.families.diffusion import PretrainedDiffusionSection

        raw = read_yaml(find_config(preset))
        method = raw["method"]
        section = {
            **PretrainedDiffusionSection().model_dump(),
            **FALLBACK_DEFAULTS.get(method, {}),
            **raw.get(method, {}),
        }
        config = {**raw, "method": method, "data": {"image_size": None, "channels": None, **raw.get("data", {})}}
        source = f"raw YAML (load_config failed: {type(exc).__name__}: {str(exc)[:200]})"
    method = config["method"]
    _, _, _, entry = resolve(config["data"]["private"])
    height, _, channels = entry.info.shape
    image_size = int(config["data"].get("image_size") or height)
    channels = int(config["data"].get("channels") or channels)
    num_classes = int(entry.info.classes)
    try:
        from dpsynth.data.sizes import planned_train_size

        num_examples = planned_train_size(config["data"])
    except Exception:
        num_examples = int(entry.info.splits.get("train", entry.info.size))
    try:  # the DP steps of the run, as the method's plan counts them (steps, or epochs * N / B)
        from dpsynth.methods import get_method

        schema = get_method(method).config_schema
        dp_steps = schema.model_validate(section).private_training().total_steps(num_examples)
    except Exception:
        dp_steps = section.get("steps") or math.ceil(float(section["epochs"]) * num_examples / section["batch_size"])
    model = {"preset": section["model"], **section["unet"]} if section.get("unet") else section["model"]
    augment = {"label_dropout": float(section.get("label_dropout", 0.0))}
    if method != "dpdm":  # PretrainedDiffusionMethod.augmentation: flips and crops of each copy
        augment.update(flip=bool(section.get("flip", False)), crop_padding=int(section.get("crop_padding", 0)))
    batch = int(section["batch_size"])
    physical = int(section["physical_batch_size"])
    multiplicity = int(section.get("multiplicity", 1))
    probe = (
        int(section.get("public_clip_batch", 0))
        if method == "dpdm" and section.get("adaptive_clipping", False) and config["data"].get("public")
        else 0
    )
    if args.tiny:
        model = {**TINY_UNET, "preset": "0.8m"}
        batch, physical, multiplicity = min(batch, 8), min(physical, 2), min(multiplicity, 2)
        probe = min(probe, 2)
        image_size = min(image_size, 16)
    return dict(
        base_case(args),
        name=preset,
        kind="preset",
        config_source=source,
        method=method,
        dataset=str(config["data"]["private"]),
        num_examples=num_examples,
        config_dp_steps=int(dp_steps),
        model=model,
        image_size=image_size,
        channels=channels,
        num_classes=num_classes,
        learn_sigma=bool(section["learn_sigma"]),
        noise_schedule=section["noise_schedule"],
        timesteps=int(section["timesteps"]),
        loss=section["loss"],
        vlb_weight=float(section.get("vlb_weight", 0.001)),
        timestep_weights=list(section["timestep_weights"]),
        timestep_boundaries=list(section["timestep_boundaries"]),
        multiplicity=multiplicity,
        augment=augment,
        batch_size=batch,
        physical=physical,
        sample_rate=min(1.0, batch / max(1, num_examples)),
        lr=float(section["lr"]),
        betas=list(section.get("betas", [0.9, 0.999])),
        clip_norm=float(section.get("clip_norm", 1.0)),
        ema_decay=section.get("ema_decay"),
        strategy=str(section.get("strategy", "auto")),
        clip_probe_batch=probe,
        rows=["non-private", "engine"],
        micro=args.micro,
        partial_reps=1 if args.tiny else 2,
        full_steps=args.full_steps,
        full_budget_s=args.full_budget_s,
    )


def dry_run_file(directory: str, preset: str) -> Path:
    return Path(directory) / (preset.replace("/", "__") + ".json")


def cmd_dry_runs(args) -> None:
    """``dpsynth run PRESET --dry-run --json`` for each preset (CPU only; no data is read)."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = dict(python_env(), CUDA_VISIBLE_DEVICES="")
    for preset in args.presets:
        started = time.perf_counter()
        command = [sys.executable, "-m", "dpsynth", "run", preset, "--dry-run", "--json"]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
            result = {"returncode": done.returncode, "stderr_tail": done.stderr[-1500:]}
            try:
                result["dry_run"] = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                result["stdout_tail"] = done.stdout[-1500:]
        except subprocess.TimeoutExpired:
            result = {"error": f"timeout after {args.timeout} s"}
        result.update(command=" ".join(command[1:]), wall_s=time.perf_counter() - started)
        dry_run_file(args.out, preset).write_text(json.dumps(result))
        status = result.get("returncode", result.get("error"))
        print(f"dry-run {preset}: {status} in {result['wall_s']:.1f} s", flush=True)


def toolkit_estimates(preset: str) -> dict:
    """What dpsynth itself estimates for ``preset``: the docs/gpu.md row and the bench suites' minutes."""
    import yaml

    found: dict = {}
    doc = REPO / "docs" / "gpu.md"
    if doc.is_file():
        method, _, name = preset.partition("/")
        stem = re.sub(r"_eps\d+$", "", name)
        for line in doc.read_text().splitlines():
            if line.startswith("|") and (f"`{preset}`" in line or f"`{method}/{stem}_eps{{1,10}}`" in line):
                found["docs_gpu_md_row"] = line.strip()
                break
    for suite in sorted((REPO / "dpsynth" / "bench" / "suites").glob("*.yaml")):
        try:
            data = yaml.safe_load(suite.read_text())
        except Exception:
            continue
        for entry in data.get("methods", []) or []:
            if preset in [str(p) for p in (entry.get("presets") or {}).values()]:
                found.setdefault("bench_suites", []).append(
                    {"suite": suite.stem, "estimated_minutes": entry.get("estimated_minutes")}
                )
    return found


def attach_plan(row: dict, dry_dir: str | None, wait_until: float) -> None:
    """Steps of the preset's privacy plan (from the dry-run) x the measured or projected step time."""
    mechanisms = []
    path = dry_run_file(dry_dir, row["name"]) if dry_dir else None
    while path is not None and not path.exists() and time.time() < wait_until:
        time.sleep(2)
    if path is None:
        pass
    elif not path.exists():
        row["dry_run"] = {"error": "no dry-run result (still running or failed)"}
    else:
        result = json.loads(path.read_text())
        plan = (result.get("dry_run") or {}).get("plan") or {}
        mechanisms = [m for m in plan.get("mechanisms", []) if m.get("kind") == "subsampled_gaussian"]
        row["dry_run"] = {
            "command": result.get("command"),
            "wall_s": result.get("wall_s"),
            "returncode": result.get("returncode"),
            "error": result.get("error"),
            "plan": plan,
            "stderr_tail": result.get("stderr_tail") if result.get("returncode") else None,
        }
    if mechanisms:
        steps, source = sum(int(m["steps"]) for m in mechanisms), "dry-run privacy plan"
    elif row.get("config_dp_steps"):
        steps, source = int(row["config_dp_steps"]), "config (steps, or epochs * N / B)"
    else:
        return
    step_s = (row.get("engine_full") or {}).get("median_s") or row.get("projected_full_step_s")
    if step_s:
        row["dp_steps"] = steps
        row["dp_steps_source"] = source
        row["step_s_used"] = step_s
        row["step_s_source"] = "measured full step" if row.get("engine_full") else "projected from partial steps"
        row["projected_dp_training_hours"] = steps * step_s / 3600


def cmd_presets(args) -> None:
    deadline = time.time() + args.budget_s
    payload = {"meta": meta(args), "cases": []}
    for preset in args.presets:
        if deadline - time.time() < args.min_case_s:
            payload["cases"].append({"name": preset, "error": "skipped: out of time"})
            continue
        try:
            case = preset_case(args, preset)
        except Exception as exc:
            payload["cases"].append({"name": preset, "error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        case["budget_s"] = min(args.case_budget_s, deadline - time.time() - 20)
        rows = run_with_oom_retry(case, deadline, args.min_case_s)
        for row in rows:
            row["toolkit_estimates"] = toolkit_estimates(preset)
            attach_plan(row, args.dry_run_dir, time.time() + 1)
        payload["cases"].extend(rows)
        write_json(args.json, payload)
    # Dry-runs run in the background; give the last ones a moment, then attach what exists.
    for row in payload["cases"]:
        if "dry_run" in row and (row["dry_run"].get("error") or "").startswith("no dry-run"):
            attach_plan(row, args.dry_run_dir, min(deadline, time.time() + args.wait_dry_run_s))
    payload["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json(args.json, payload)
    print_rows(payload["cases"])


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        line = f"{row.get('name')} (physical {row.get('physical')}): {summary_line(row)}"
        if row.get("projected_dp_training_hours") is not None:
            line += f"; {row['dp_steps']} DP steps -> {row['projected_dp_training_hours']:.3g} h"
        print(line)


def _csv(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker_main(json.loads(sys.argv[2])), default=str))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--device", default="cpu", help="cpu or cuda")
        p.add_argument("--threads", type=int, default=0, help="torch CPU threads per case (0: torch's default)")
        p.add_argument(
            "--reuse-freed-memory",
            action="store_true",
            help="both rows under the opt-in glibc allocator setting of dpsynth.dpsgd.allocator (as dpsgd_step.py)",
        )
        p.add_argument("--json", help="write the rows here (rewritten after every case)")
        p.add_argument("--budget-s", type=float, default=300, help="wall-clock budget of the whole command")
        p.add_argument("--case-budget-s", type=float, default=120, help="time one case may take")
        p.add_argument("--tiny", action="store_true", help="tiny models and batches (a CPU check of the code paths)")

    large = sub.add_parser("large-unet", help="non-private vs engine steps of large UNets at 32x32x3, K=1")
    common(large)
    large.add_argument("--models", type=_csv, default=list(LARGE_MODELS), help=f"from {','.join(LARGE_MODELS)}")
    large.add_argument("--batch", type=int, default=32)
    large.add_argument("--image", type=int, default=32)
    large.add_argument("--reps", type=int, default=3, help="timed steps per row")

    presets = sub.add_parser("presets", help="DP-SGD steps of packaged presets at full scale, on random inputs")
    common(presets)
    presets.add_argument("--presets", type=_csv, default=_csv(DEFAULT_PRESETS))
    presets.add_argument("--reps", type=int, default=3, help="timed non-private micro-batch steps")
    presets.add_argument("--micro", type=int, default=3, help="micro-batches in a timed partial step")
    presets.add_argument("--full-steps", type=int, default=2, help="full logical steps when affordable")
    presets.add_argument("--full-budget-s", type=float, default=30, help="take full steps only if one fits this")
    presets.add_argument("--min-case-s", type=float, default=45, help="start no case with less time left")
    presets.add_argument("--dry-run-dir", help="results of the dry-runs command (privacy plan: DP steps)")
    presets.add_argument("--wait-dry-run-s", type=float, default=30, help="wait this long for late dry-runs")

    dry = sub.add_parser("dry-runs", help="dpsynth run PRESET --dry-run --json for each preset, on the CPU")
    dry.add_argument("--presets", type=_csv, default=_csv(DEFAULT_PRESETS))
    dry.add_argument("--out", required=True)
    dry.add_argument("--timeout", type=float, default=120)

    args = parser.parse_args()
    {"large-unet": cmd_large_unet, "presets": cmd_presets, "dry-runs": cmd_dry_runs}[args.command](args)


if __name__ == "__main__":
    main()
