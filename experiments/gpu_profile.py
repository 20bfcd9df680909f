"""Where a DP-SGD step spends its GPU time: torch.profiler over the engine and the non-private step.

Uses experiments/dpsgd_step.py's workloads (batch 64, 28x28x1, Adam). For each model and row it warms up,
profiles ``--steps`` steps, and prints the operators with the most device time, the kernel launches per step
and the device time per step; ``--json`` also writes them. Guides engine work on GPUs (BENCHMARKS.md, "GPU").

    python3 experiments/gpu_profile.py --device cuda --models cnn,unet-0.8m --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dpsgd_step import build_workload, make_step  # noqa: E402


def profile_row(model_name: str, implementation: str, strategy: str, device: str, steps: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, batch, example_loss, per_sample_losses = build_workload(model_name, 1)
    model = model.to(device)
    batch = {key: value.to(device) for key, value in batch.items()}
    step = make_step(implementation, model, batch, example_loss, per_sample_losses, 1, 64, strategy)
    cuda = device == "cuda"
    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    time_key = "device_time_total" if cuda else "cpu_time_total"

    def device_us(event) -> float:
        return float(getattr(event, time_key, 0.0) or getattr(event, "cuda_time_total", 0.0) or 0.0)

    kernels = [e for e in prof.events() if cuda and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    rows = sorted(events, key=device_us, reverse=True)
    table = [
        {"op": e.key, "calls_per_step": e.count / steps, "device_ms_per_step": device_us(e) / steps / 1e3}
        for e in rows[:top]
    ]
    return {
        "model": model_name,
        "implementation": implementation,
        "strategy": strategy,
        "kernel_launches_per_step": len(kernels) / steps if cuda else None,
        "kernel_ms_per_step": sum(k.device_time for k in kernels) / steps / 1e3 if cuda else None,
        "top_ops": table,
        "table": events.table(sort_by=time_key, row_limit=top),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="cnn,unet-0.8m")
    parser.add_argument("--rows", default="non-private:auto,engine:auto,engine:instantiate")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = []
    for model_name in args.models.split(","):
        for row in args.rows.split(","):
            implementation, strategy = row.split(":")
            try:
                result = profile_row(model_name, implementation, strategy, args.device, args.steps, args.top)
            except Exception as exc:  # one failing row must not cost the others
                result = {
                    "model": model_name,
                    "implementation": implementation,
                    "strategy": strategy,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            results.append(result)
            print(
                f"== {model_name} {implementation} ({strategy}): "
                f"{result.get('kernel_launches_per_step')} kernel launches/step, "
                f"{result.get('kernel_ms_per_step')} kernel ms/step {result.get('error', '')}"
            )
            print(result.get("table", ""))
            if args.json:
                Path(args.json).write_text(
                    json.dumps([{k: v for k, v in r.items() if k != "table"} for r in results], indent=1)
                )


if __name__ == "__main__":
    main()
