"""Count the aten ops one DP-SGD step issues: the CPU proxy for a GPU's kernel launches.

On a GPU the engine's step is host-bound (experiments/gpu_profile.py: thousands of small kernels per step,
each paying Python and launch overhead), so the number of ops it issues matters as much as their FLOPs.
This counts them on the CPU with a ``TorchDispatchMode`` (every aten op that reaches a backend, after
autograd and vmap have decomposed the step: what a GPU would launch; views, allocations and metadata
ops, which launch nothing, are counted apart) for the non-private step and the engine's strategies, on
experiments/dpsgd_step.py's workloads (batch 64, 28x28x1, Adam, K=1), and prints the top ops by calls.

    OMP_NUM_THREADS=1 python experiments/engine_ops.py --models cnn,unet-0.8m [--top 15] [--json OUT.json]
    OMP_NUM_THREADS=1 python experiments/engine_ops.py --foreach-adam   # Adam as a GPU runs it (foreach)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dpsgd_step import build_workload, make_step  # noqa: E402

ROWS = ("non-private:-", "engine:auto", "engine:ghost", "engine:instantiate")

# Ops that only make a new view, allocate or read metadata: no kernel on a GPU.
_NO_KERNEL = {
    "aten.empty.memory_format",
    "aten.empty_strided.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
    "aten.promote_types.default",
    "aten.detach.default",
    "aten.alias.default",
    "aten.lift_fresh.default",
    "aten._unsafe_view.default",
    "aten.unsqueeze_.default",
    "aten.squeeze_.default",
    "aten.as_strided_.default",
    "aten.t_.default",
    "aten.transpose_.default",
    "aten.resize_.default",
}


def _is_view(func) -> bool:
    import torch

    return torch.Tag.view_copy not in func.tags and (
        func.is_view or torch.Tag.inplace_view in func.tags or str(func) in _NO_KERNEL
    )


def count_ops(step, steps: int) -> tuple[Counter, Counter]:
    """``(kernel ops, view ops)`` per op name, summed over ``steps`` steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kernels: Counter[str] = Counter()
    views: Counter[str] = Counter()  # and the other ops that launch no kernel

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            (views if _is_view(func) else kernels)[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        for _ in range(steps):
            step()
    return kernels, views


def count_row(model_name: str, implementation: str, strategy: str, steps: int, foreach_adam: bool = False) -> dict:
    import torch

    torch.set_num_threads(1)
    model, batch, example_loss, per_sample_losses = build_workload(model_name, 1)
    strategy_arg = "auto" if strategy == "-" else strategy
    adam = torch.optim.Adam
    if foreach_adam:  # what Adam runs on a GPU by default: a few foreach ops for all parameters

        class ForeachAdam(adam):
            def __init__(self, params, **kwargs) -> None:
                super().__init__(params, foreach=True, **kwargs)

        torch.optim.Adam = ForeachAdam
    try:
        step = make_step(implementation, model, batch, example_loss, per_sample_losses, 1, 64, strategy_arg)
    finally:
        torch.optim.Adam = adam
    step()  # the engine plans its taps on the first step; Adam creates its state
    kernels, views = count_ops(step, steps)
    return {
        "model": model_name,
        "implementation": implementation,
        "strategy": strategy,
        "ops_per_step": sum(kernels.values()) / steps,
        "view_ops_per_step": sum(views.values()) / steps,
        "top_ops": [(op, n / steps) for op, n in kernels.most_common()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,unet-0.8m")
    parser.add_argument("--rows", default=",".join(ROWS), help="implementation:strategy pairs")
    parser.add_argument("--steps", type=int, default=2, help="counted steps per row (after one warm-up step)")
    parser.add_argument("--top", type=int, default=12, help="ops listed per row, by calls per step")
    parser.add_argument(
        "--foreach-adam",
        action="store_true",
        help="Adam with foreach=True, its default on a GPU (on the CPU it loops over the parameters)",
    )
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    results = []
    for model_name in args.models.split(","):
        for row in args.rows.split(","):
            implementation, strategy = row.split(":")
            result = count_row(model_name, implementation, strategy, args.steps, args.foreach_adam)
            results.append(result)
            name = implementation if implementation == "non-private" else f"engine ({strategy})"
            print(
                f"{model_name:10} {name:22} {result['ops_per_step']:8.0f} ops/step "
                f"(+{result['view_ops_per_step']:.0f} views/allocations)",
                flush=True,
            )
            for op, calls in result["top_ops"][: args.top]:
                print(f"    {calls:7.0f}  {op}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
