"""Where one engine step's CPU time goes, against the non-private step it is compared with.

One process, the phases interleaved over ``--reps`` repetitions (medians; this VM's speed drifts between
runs, so only the ratios within one run mean much), with the engine step's ratio to a non-private step
(Adam included) taken pair by pair:

- ``non-private fwd+bwd``: the ordinary forward and backward on the B*K images (no optimizer);
- ``tapped fwd+bwd, no hooks``: the engine's vmapped forward and batched backward with every tap's
  reduction replaced by nothing, i.e. the backward without the weight gradients the taps skip;
- ``tapped fwd+bwd``: the same with the taps' per-example reductions (norms, instantiated gradients);
- within a full engine step: ``clip + sum``, ``noise`` and ``divide + optimizer``;
- ``per layer kind``: the taps' time by layer type, form (ghost or instantiated) and output size (a GroupNorm's
  per-example affine gradients come out of its own backward kernel, so they count in the fwd+bwd rows instead);
- the minor page faults and kernel time of three more steps of each kind (``--fault-steps N``: N, each listed
  with the heap break's move).

    OMP_NUM_THREADS=1 python experiments/engine_phases.py --model unet-0.8m --reps 6 [--k 4] [--strategy timed]
    OMP_NUM_THREADS=1 python experiments/engine_phases.py --model unet-6m --k 4 --physical 64 --reps 1 --fault-steps 7
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dpsgd_step  # noqa: E402  (the benchmark's workloads)

import dpsynth.dpsgd.engine as engine_module  # noqa: E402
import dpsynth.dpsgd.per_example as per_example  # noqa: E402
from dpsynth.dpsgd.taps import LayerGradient  # noqa: E402


def cpu_ms(function) -> float:
    start = time.process_time()
    function()
    return (time.process_time() - start) * 1000


def faults_and_kernel_ms(function) -> tuple[int, float, float | None]:
    """Minor page faults, kernel CPU ms and the heap break's move in MiB (glibc's ``sbrk(0)``; None elsewhere)
    over one call. Faults are first touches of freshly mapped pages; a break that moves down is the heap's top
    handed back to the kernel, whose pages a later step faults in again."""
    heap_break = _heap_break()
    before = resource.getrusage(resource.RUSAGE_SELF)
    function()
    after = resource.getrusage(resource.RUSAGE_SELF)
    moved = None if heap_break is None else (_heap_break() - heap_break) / 2**20
    return after.ru_minflt - before.ru_minflt, (after.ru_stime - before.ru_stime) * 1000, moved


def _heap_break() -> int | None:
    try:
        sbrk = ctypes.CDLL(None).sbrk
    except (OSError, AttributeError):
        return None
    sbrk.restype = ctypes.c_void_p
    return sbrk(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="unet-0.8m", choices=dpsgd_step.MODELS)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--k", type=int, default=1, help="multiplicity K (the micro-batch is 64 // K examples)")
    parser.add_argument("--physical", type=int, default=0, help="engine micro-batch in examples (default 64 // K)")
    parser.add_argument(
        "--strategy",
        default="auto",
        help="the engine's per-example gradient strategy (auto, timed); a comma-separated list (auto,timed) also "
        "times one more engine step per listed strategy in every repetition, each on its own copy of the model, in "
        "alternating order after the phases' step (paired ratios for each)",
    )
    parser.add_argument(
        "--fault-steps",
        type=int,
        default=3,
        help="steps of each kind whose page faults are counted; above 3 each step's count and heap break are listed",
    )
    parser.add_argument(
        "--default-allocator", action="store_true", help="leave glibc's malloc as it is (no reuse_freed_memory)"
    )
    args = parser.parse_args()
    if args.fault_steps < 1:
        parser.error("--fault-steps must be at least 1")
    torch.set_num_threads(1)
    try:  # the opt-in allocator settings (absent in older commits: this script compares commits too)
        from dpsynth.dpsgd.allocator import reuse_freed_memory
    except ImportError:
        reuse_freed_memory = None
    if reuse_freed_memory is not None and not args.default_allocator:
        reuse_freed_memory()
    model, batch, example_loss, per_sample_losses = dpsgd_step.build_workload(args.model, args.k)
    physical = args.physical or dpsgd_step.default_physical(args.k, "cpu")
    flat = dpsgd_step.flatten_k(batch)
    strategies = args.strategy.split(",")
    strategy = strategies[0]  # the phases' engine step
    compared = strategies if len(strategies) > 1 else []  # one more engine step each, alike for all
    # (keyword only when timed: this script also runs on commits from before the timed strategy)
    trial = {"trial_batch": physical} if strategy == "timed" else {}
    gradients = per_example.PerExampleGradients(model, example_loss, strategy=strategy, **trial)
    reduce_layer = per_example.layer_gradient

    def non_private() -> None:
        model.zero_grad(set_to_none=True)
        per_sample_losses(model, flat).mean().backward()

    def tapped() -> None:
        for micro in per_example.micro_batches(batch, physical):
            gradients.compute(micro)

    def without_hooks() -> None:
        per_example.layer_gradient = lambda tap, inputs, output_grad: LayerGradient({}, {})
        try:
            tapped()
        finally:
            per_example.layer_gradient = reduce_layer

    phases: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
    kinds: collections.Counter[str] = collections.Counter()

    recording = [False]  # the phases are those of the first strategy's engine step, after the warm-up

    def timed(name: str, function):
        def wrapper(*a, **k):
            start = time.process_time()
            result = function(*a, **k)
            if recording[0]:
                phases[name][-1] += (time.process_time() - start) * 1000
            return result

        return wrapper

    def by_kind(tap, inputs, output_grad):
        start = time.process_time()
        result = reduce_layer(tap, inputs, output_grad)
        form = "ghost" if tap.ghost else "instantiated"
        kinds[f"{type(tap.module).__name__} {form} {tuple(output_grad.shape[2:])}"] += time.process_time() - start
        return result

    step = dpsgd_step.make_step(
        "engine", model, batch, example_loss, per_sample_losses, args.k, physical, strategy=strategy
    )
    compared_steps = {
        name: dpsgd_step.make_step(
            "engine",
            dpsgd_step.build_workload(args.model, args.k)[0],
            batch,
            example_loss,
            per_sample_losses,
            args.k,
            physical,
            strategy=name,
        )
        for name in compared
    }
    plain = dpsgd_step.build_workload(args.model, args.k)[0]
    plain_step = dpsgd_step.make_step("non-private", plain, batch, example_loss, per_sample_losses, args.k, physical)

    engine_module.DPSGDEngine._add_noise = timed("noise", engine_module.DPSGDEngine._add_noise)
    engine_module.DPSGDEngine._apply = timed("divide + optimizer", engine_module.DPSGDEngine._apply)
    per_example.add_clipped_sum = timed("clip + sum", per_example.add_clipped_sum)
    for _ in range(2):
        non_private(), without_hooks(), tapped(), step(), plain_step()
        for other in compared_steps.values():
            other()

    def time_compared_steps(order: list[str]) -> None:
        for name in order:
            phases[f"engine step, {name}"].append(cpu_ms(compared_steps[name]))

    for rep in range(args.reps):
        phases["non-private step"].append(cpu_ms(plain_step))
        phases["non-private fwd+bwd"].append(cpu_ms(non_private))
        phases["tapped fwd+bwd, no hooks"].append(cpu_ms(without_hooks))
        per_example.layer_gradient = by_kind
        phases["tapped fwd+bwd"].append(cpu_ms(tapped))
        per_example.layer_gradient = reduce_layer
        for name in ("clip + sum", "noise", "divide + optimizer"):
            phases[name].append(0.0)
        recording[0] = True
        phases["engine step"].append(cpu_ms(step))
        recording[0] = False
        time_compared_steps(compared if rep % 2 == 0 else compared[::-1])  # alternating: none always runs last
    allocator = "glibc default" if args.default_allocator or reuse_freed_memory is None else "freed memory reused"
    print(f"{args.model}, batch {dpsgd_step.BATCH}, K = {args.k}, strategy {strategy}, one thread, {allocator}:")
    print(f"median CPU ms of {args.reps}")
    for name, values in phases.items():
        print(f"  {name:26s} {statistics.median(values):8.1f}")
    for name, function in (("non-private step", plain_step), ("engine step", step)):
        counts = [faults_and_kernel_ms(function) for _ in range(args.fault_steps)]
        faults, kernel = statistics.median(c[0] for c in counts), statistics.median(c[1] for c in counts)
        print(
            f"  {name}: {faults:.0f} minor page faults, {kernel:.0f} ms kernel time (median of {args.fault_steps} more)"
        )
        if args.fault_steps > 3:
            for number, (faults, kernel, moved) in enumerate(counts, 1):
                shift = "" if moved is None else f", heap break moved {moved:+.0f} MiB"
                print(f"    step {number}: {faults} faults, {kernel:.0f} ms kernel time{shift}")
    for name in ("engine step", *(f"engine step, {other}" for other in compared)):
        ratios = [e / n for e, n in zip(phases[name], phases["non-private step"])]
        print(f"  {name} / non-private step: median of the {args.reps} paired ratios {statistics.median(ratios):.3f}")
    print("per layer kind (mean ms per tapped fwd+bwd):")
    for kind, seconds in kinds.most_common():
        print(f"  {kind:40s} {seconds * 1000 / args.reps:8.1f}")


if __name__ == "__main__":
    main()
