"""Check the fixed-shape private step (dpsynth.dpsgd.fixed_shape) against the exact step, on any device.

Two copies of one model train for ``--steps`` steps from the same coins (two device generators with one test
seed) and σ = 0 (so the update is the clipped sum through Adam and the EMA, which both paths must agree on):

- ``fixed``: :class:`~dpsynth.dpsgd.fixed_shape.FixedShapeStep`, captured as a CUDA graph on CUDA (one capture,
  replayed every step: the step, the per-record draws' step counter and the EMA decay are read from device
  scalars) and uncaptured elsewhere;
- ``exact``: the engine's ordinary step over the realised records alone, with the same device per-record draws.

The parameters and EMA weights must agree to float rounding (max relative difference printed and written as
JSON). Workloads: ``cnn`` (cross-entropy) and ``unet-0.8m`` (L_simple with per-record timesteps and noise).

    python experiments/graph_capture_check.py --device cuda --models cnn,unet-0.8m --steps 5 --out results.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))


def check(model_name: str, device: str, steps: int, records: int, batch: int) -> dict:
    import numpy as np
    import torch
    from dpsgd_step import CountingLedger, build_workload

    from dpsynth.dpsgd import DPSGDEngine
    from dpsynth.dpsgd.fixed_shape import MASK, DevicePoissonSampler, FixedShapeStep, masked_loss
    from dpsynth.privacy.device_draws import DeviceRecordRandomness
    from dpsynth.privacy.record_draws import RecordRandomness
    from dpsynth.privacy.rng import NoiseSource

    model, base, example_loss, _ = build_workload(model_name, 1)
    model = model.to(device)
    base = {key: value.to(device) for key, value in base.items()}
    size = next(iter(base.values())).shape[0]
    q = batch / records
    randomness = DeviceRecordRandomness(RecordRandomness(np.arange(records, dtype=np.uint64)), device)

    def build(indices, draws):
        rows = {key: value[indices % size] for key, value in base.items()}
        if "noise" in rows:
            rows["t"] = draws.randint(0, 1000, *rows["t"].shape[1:]).to(rows["t"].dtype)
            rows["noise"] = draws.randn(*rows["noise"].shape[1:], dtype=rows["noise"].dtype)
        return rows

    def engine_of(net):
        return DPSGDEngine(
            net,
            # A large eps keeps Adam's update linear in small gradients: with the default eps a coordinate whose
            # gradient is rounding noise moves by +-lr on its sign alone, and the two paths' rounding differs.
            torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-3),
            masked_loss(example_loss),
            CountingLedger(),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            sample_rate=q,
            expected_batch_size=batch,
            max_physical_batch_size=10**9,
            ema_decay=0.99,
            noise=NoiseSource(seed=0),
        )

    twin = copy.deepcopy(model)  # before either engine exists: an engine's hooks must not be copied with the model
    fixed_engine, exact_engine = engine_of(model), engine_of(twin)

    def generator():
        return torch.Generator(device=device).manual_seed(7)

    fixed_sampler = DevicePoissonSampler(records, q, generator())
    exact_sampler = DevicePoissonSampler(records, q, generator(), capacity=fixed_sampler.capacity)
    capture = torch.device(device).type == "cuda"
    fixed = FixedShapeStep(fixed_engine, randomness, build, fixed_sampler, fixed_sampler.capacity, capture=capture)
    initial = [p.detach().clone() for p in twin.parameters()]
    step_counter = torch.zeros((), dtype=torch.int64, device=device)
    started = time.perf_counter()
    for step in range(steps):
        fixed()
        exact_sampler.sample()
        indices = torch.nonzero(exact_sampler.last_included).flatten()
        step_counter.fill_(step)
        inputs = build(indices, randomness.draws(step_counter, indices))
        inputs[MASK] = torch.ones(len(indices), device=device)
        exact_engine.step(inputs)
    if capture:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started

    def worst(a, b, start):
        """The largest difference between the two paths over all parameters, relative to the largest distance the
        exact path moved any parameter (a per-tensor ratio would blow up on tensors that barely move)."""
        pairs = list(zip(a, b, start))
        difference = max(float((x.detach() - y.detach()).abs().max()) for x, y, _ in pairs)
        moved = max(float((y.detach() - s).abs().max()) for _, y, s in pairs)
        return difference / max(moved, 1e-12)

    params = worst(fixed_engine.model.parameters(), exact_engine.model.parameters(), initial)
    ema = worst(fixed_engine.ema_model.parameters(), exact_engine.ema_model.parameters(), initial)
    return {
        "model": model_name,
        "device": device,
        "captured": capture,
        "steps": steps,
        "records": records,
        "capacity": fixed_sampler.capacity,
        "exact_path_steps": fixed.exact_steps,
        "max_rel_diff_params": params,
        "max_rel_diff_ema": ema,
        "agree": params < 1e-3 and ema < 1e-3,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="cnn,unet-0.8m")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--records", type=int, default=6400, help="N of the private set (the workload's 64 tiled)")
    parser.add_argument("--batch", type=int, default=64, help="expected batch qN")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = [check(name, args.device, args.steps, args.records, args.batch) for name in args.models.split(",")]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    if not all(row["agree"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
