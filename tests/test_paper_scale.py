"""Every paper-scale preset proven runnable on the CPU before a GPU arrives: `make test-slow`
(docs/gpu.md, "Proven on the CPU: the slow paper-scale test").

For each preset (dpsynth.bench.paper.paper_scale_presets: not smoke, auto, mnist10k_* or demo), in a fresh
process: every network its method declares (Method.private_networks) is built at full size and trained for
2 DP steps (after one warm-up step) by the real DPSGDEngine with the preset's K, optimizer, EMA, strategy
and precision, then one sample batch's network call is run. What is *not* the preset's own:

* the data: random inputs of the dataset's shape (no dataset is read; none needs to be offline);
* the loss: the estimate's stand-in (sum of squares of the output), the network's cost being what is measured;
* the batch: a logical step is the preset's B in micro-batches; when that would take longer than the time
  budget, a step processes fewer micro-batches and the full step is extrapolated from them (virtual
  batching); a micro-batch larger than the memory cap, or slower than the budget, is split into smaller
  ones, the estimate then being compared at that size (the figure the dry run prints for the preset's own
  size is the same formula);
* the multiplicity: an example's K rows are trained together, so where they alone exceed the budget, K is cut
  to what the budget allows and the estimate compared at that K;
* the sample batch: one sampler step (one network call, no gradient) over at most the rows the budget
  allows, extrapolated to the sampler's calls.

Presets whose runs would be the same (the same networks, FLOPs, K, batches, optimizer, strategy, precision and
sample batch: most often a dataset's eps 1 and eps 10 presets) are measured once per session, the later ones
reusing the first one's rows (``run_signature``).

Checks: it completes; the dry run's peak memory per device (at the micro-batch used) is within 2x of the
measured peak resident memory the training added; the measured DP step time is within 2x of the dry run's
extrapolation on this CPU: (micro-batches x K rows x FLOPs per row) at this CPU's rate on the same network's
non-private forward/backward, times the engine's CPU overhead (BENCHMARKS.md "DP-SGD step": 1.07-1.27x).
Knobs: DPSYNTH_SLOW_BUDGET_S (seconds of DP compute per step, default 120), DPSYNTH_SLOW_MEMORY_GIB
(the memory cap, default 4), DPSYNTH_SLOW_PRESETS (comma-separated subset).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpsynth.bench.paper import paper_scale_presets

BUDGET_S = float(os.environ.get("DPSYNTH_SLOW_BUDGET_S", "120"))
MEMORY_CAP_GIB = float(os.environ.get("DPSYNTH_SLOW_MEMORY_GIB", "4"))
ENGINE_CPU_OVERHEAD = 1.3  # the engine's step over non-private training on the CPU (BENCHMARKS.md, 1.07-1.27x)
#: a one-thread CPU's FLOP/s on a shared machine, low on purpose: it only sizes micro-batches to the time budget
CPU_FLOPS_GUESS = 5e9
#: a preset whose private data is a placeholder path: the registered dataset of the same images stands in
STAND_IN_DATA = {"dp-imgsyn/cifar10_eps10_tinyimagenet": ["data.private=cifar10"]}
REPO = Path(__file__).resolve().parents[1]


def selected_presets() -> list[str]:
    chosen = os.environ.get("DPSYNTH_SLOW_PRESETS")
    return [name.strip() for name in chosen.split(",")] if chosen else paper_scale_presets()


@pytest.mark.slow
@pytest.mark.parametrize("preset", selected_presets())
def test_paper_scale_preset_runs_and_matches_its_dry_run_estimate(preset, tmp_path):
    signature = run_signature(preset)
    started = time.perf_counter()
    measured = MEASURED.get(signature)
    if measured is None:
        measured = MEASURED[signature] = {**run_worker(preset, tmp_path / "rows.json"), "preset": preset}
    else:
        print(f"\n{preset}: the same networks, batches and sample batch as {measured['preset']}, whose run covers it")
    rows = measured["networks"]
    # A method without a DP-SGD section (a one-shot noisy release) has no network to train privately; one with
    # such a section must declare its networks (Method.private_networks), or this test cannot prove it runs.
    assert rows or not measured["dpsgd_sections"], f"{preset}: {measured['dpsgd_sections']} declare no network"
    for row in rows:
        print(f"\n{preset} ({time.perf_counter() - started:.0f} s wall): " + json.dumps(row))
        memory = row["measured_peak_bytes"] / row["estimated_peak_bytes"]
        assert 0.5 <= memory <= 2.0, f"{row['key']}: measured / estimated peak memory = {memory:.2f}"
        timing = row["measured_step_s"] / row["predicted_step_s"]
        assert 0.5 <= timing <= 2.0, f"{row['key']}: measured / extrapolated DP step time = {timing:.2f}"
        assert row["steps_run"] == 2 and row["sample_rows"] >= 1


#: signature -> what the worker measured: presets that share one (most often a dataset's eps 1 and eps 10
#: presets, or MNIST's and FashionMNIST's) run the same step and differ in what this test does not exercise
#: (the noise, the learning rate, the number of steps)
MEASURED: dict[tuple, dict] = {}


def run_signature(preset: str) -> tuple:
    """Everything of ``preset`` that the worker's run depends on: per declared network its size, FLOPs and saved
    activations per row (so the architecture and image shape), K, the batch and micro-batch, the optimizer,
    EMA, clipping mode, strategy and precision; and the sample batch. Computed on the meta device."""
    from dpsynth.config import load_config
    from dpsynth.dpsgd.estimate import profile_network
    from dpsynth.methods import get_method

    config = load_config(preset, STAND_IN_DATA.get(preset, []))
    networks = get_method(config.method)().private_networks(config) or []
    parts = []
    for network in networks:
        profile, training = profile_network(network), network.training
        parts.append(
            (
                network.key,
                profile.parameters,
                profile.flops_per_row,
                profile.activation_bytes_per_row,
                network.rows_per_example,
                network.exact,
                network.sample_calls,
                training.batch_size,
                training.physical_batch_size,
                training.optimizer,
                training.ema_decay is not None,
                training.per_layer_clipping,
                training.strategy,
                training.precision,
            )
        )
    return config.method, config.generate.batch_size, tuple(parts)


def run_worker(preset: str, out: Path) -> dict:
    """The worker's measurement of ``preset``, in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    # glibc keeps freed heap memory resident and fragments it, so the resident peak would grow step after step
    # with what is no longer used; allocations from 64 KiB up are then given back to the system when freed,
    # as a GPU's caching allocator would reuse them (the estimate counts live tensors)
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    process = subprocess.run([sys.executable, __file__, preset, str(out)], env=env, capture_output=True, text=True)
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(out.read_text())


# -- the worker: one preset in one process -----------------------------------------------------------


class CountingLedger:
    """The accounting is not under test: this ledger takes every step."""

    def register(self, mechanism):
        self.mechanism = mechanism

    def spend(self, name, steps=1):
        pass


def resident_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_resident() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def measure_preset(preset: str) -> dict:
    import torch

    from dpsynth.config import load_config
    from dpsynth.data.sizes import planned_train_size
    from dpsynth.dpsgd.section import dpsgd_sections
    from dpsynth.methods import get_method

    torch.set_num_threads(1)
    config = load_config(preset, STAND_IN_DATA.get(preset, []))
    networks = get_method(config.method)().private_networks(config)
    try:
        num_examples = planned_train_size(config.data)
    except Exception:  # a dataset with options (celeba?attribute=...): N only sets the reported step count
        num_examples = None
    return {
        "dpsgd_sections": [key for key, _ in dpsgd_sections(config.section, config.method)],
        "networks": [measure_network(network, num_examples, config.generate.batch_size) for network in networks or []],
    }


def measure_network(network, num_examples: int | None, sample_batch: int) -> dict:
    from dpsynth.dpsgd import DPSGDEngine
    from dpsynth.dpsgd.estimate import (
        activation_bytes_per_example,
        estimate_network,
        profile_network,
        stand_in_loss,
        state_bytes,
    )
    from dpsynth.dpsgd.training import make_optimizer

    training, rows = network.training, network.rows_per_example
    size = num_examples or 10 * training.batch_size
    profile = profile_network(network)
    # One example's K rows go through the engine together; where they alone exceed the budget (PDP-Diffusion's
    # 86M UNet at K = 128: about 45 CPU-minutes an example), K is cut to what fits and the estimate is compared
    # at that K, as a split micro-batch is.
    rows = max(1, min(rows, int(BUDGET_S * CPU_FLOPS_GUESS / (profile.flops_per_row * ENGINE_CPU_OVERHEAD))))
    preset_rows, network = network.rows_per_example, dataclasses.replace(network, rows_per_example=rows)
    per_example = activation_bytes_per_example(profile, network)
    room = int(MEMORY_CAP_GIB * 2**30) - state_bytes(profile.parameters, training)
    in_budget = BUDGET_S * CPU_FLOPS_GUESS / (rows * profile.flops_per_row * ENGINE_CPU_OVERHEAD)
    physical = max(
        1, min(training.physical_batch_size, training.batch_size, room // max(per_example, 1), int(in_budget))
    )
    network = dataclasses.replace(network, training=dataclasses.replace(training, physical_batch_size=physical))
    estimate = estimate_network(network, size, profile)

    inputs = [_realistic(tensor) for tensor in network.inputs(physical * rows)]
    micro = {f"input{i}": tensor.reshape(physical, rows, *tensor.shape[1:]) for i, tensor in enumerate(inputs)}

    def loss_fn(model_call, example):
        return stand_in_loss(model_call(*(example[f"input{i}"] for i in range(len(inputs)))))

    def new_engine(model):
        return DPSGDEngine(
            model,
            make_optimizer([p for p in model.parameters() if p.requires_grad], training),
            loss_fn,
            CountingLedger(),
            noise_multiplier=1.0,
            max_grad_norm=training.clip_norm,
            sample_rate=min(1.0, training.batch_size / size),
            expected_batch_size=training.batch_size,
            max_physical_batch_size=physical,
            ema_decay=training.ema_decay,
            strategy=training.strategy,
            precision=training.precision,
        )

    # The first step of a process loads torch's kernels and thread pools (resident memory the estimate, which
    # counts tensors, does not model): take it on one example of a throw-away copy, then measure from there.
    new_engine(network.build().train()).step(iter([{key: value[:1] for key, value in micro.items()}]))
    gc.collect()
    baseline = resident_bytes("VmRSS")
    reset_peak_resident()
    model = network.build().train()
    engine = new_engine(model)
    started = time.perf_counter()
    engine.step(iter([micro]))  # warm-up: plans the taps, allocates the optimizer state
    first = time.perf_counter() - started
    per_step = max(1, min(estimate.micro_batches, math.floor(BUDGET_S / max(first, 1e-3))))
    micro_times = []
    for _ in range(2):
        started = time.perf_counter()
        engine.step(iter([micro] * per_step))
        micro_times.append((time.perf_counter() - started) / per_step)
    peak = resident_bytes("VmHWM") - baseline

    non_private = _non_private_seconds(model, inputs)
    rate = physical * rows * profile.flops_per_row / non_private  # this CPU's FLOP/s on this network
    sample_rows, sample_s = _sample_call(model, network, sample_batch, non_private / (physical * rows))
    measured_step = statistics.median(micro_times) * estimate.micro_batches
    return {
        "key": network.key,
        "parameters": profile.parameters,
        "rows_per_example": rows,
        "preset_rows_per_example": preset_rows,
        "batch_size": training.batch_size,
        "preset_physical_batch_size": training.physical_batch_size,
        "physical_batch_size": physical,
        "micro_batches_per_step_run": per_step,
        "micro_batches_per_step": estimate.micro_batches,
        "steps_run": len(micro_times),
        "estimated_peak_bytes": estimate.peak_bytes,
        "measured_peak_bytes": peak,
        "cpu_flops_per_s": rate,
        "measured_step_s": measured_step,
        "predicted_step_s": estimate.flops_per_step / rate * ENGINE_CPU_OVERHEAD,
        "cpu_hours_extrapolated": estimate.steps * measured_step / 3600,
        "estimated_gpu_hours": estimate.gpu_hours,
        "sample_rows": sample_rows,
        "sample_batch_s_extrapolated": sample_s * network.sample_calls * sample_batch / sample_rows,
    }


def _realistic(tensor):
    import torch

    return torch.randn_like(tensor) if tensor.is_floating_point() else tensor


def _non_private_seconds(model, inputs) -> float:
    """One ordinary forward and backward of the same micro-batch (the median of two, after the DP steps)."""
    from dpsynth.dpsgd.estimate import stand_in_loss

    times = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        stand_in_loss(model(*inputs)).backward()
        times.append(time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _sample_call(model, network, sample_batch: int, seconds_per_row: float) -> tuple[int, float]:
    """One sampler step: a no-gradient network call over the generate batch, or as many rows as the budget allows."""
    import torch

    rows = max(1, min(sample_batch, int(BUDGET_S / max(seconds_per_row, 1e-9))))
    inputs = [_realistic(tensor) for tensor in network.inputs(rows)]
    model.eval()
    started = time.perf_counter()
    with torch.no_grad():
        model(*inputs)
    return rows, time.perf_counter() - started


if __name__ == "__main__":
    preset_name, out_path = sys.argv[1], Path(sys.argv[2])
    out_path.write_text(json.dumps(measure_preset(preset_name)))
