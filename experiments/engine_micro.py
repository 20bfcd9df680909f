"""Micro-benchmarks behind the engine's per-layer choices and its Python overhead, one thread, CPU time.

- ``forward``: the engine's vmapped forward of ONE example (every tap's reduction replaced by nothing), against
  the plain module's forward with gradients on the same example: the difference is the engine's fixed Python
  cost per micro-batch (dispatch of the taps and GroupNorms under vmap);
- ``output-tap``: 84 calls of ``OutputTap.apply`` (the 0.8M UNet's taps) against the same identity written as a
  new-style Function (``setup_context``), whose ``apply`` binds the forward's signature on every call;
- ``group-norm``: ``PerExampleGradients.compute`` of four GroupNorms with SiLUs at 64 x 32 x 28 x 28;
- ``conv-forms``: a convolution's per-example norm as a ghost norm (float64 Grams), as a grouped per-example
  weight gradient (the instantiated form), and the ordinary batched weight gradient, at B = 64;
- ``narrow-outputs``: the grouped per-example weight gradient of convolutions with 1 or 3 output channels, with
  the output channels padded to a block of 8 (``dpsynth.dpsgd.taps.OUTPUT_CHANNEL_BLOCK``) and without;
- ``forms``: the ``"timed"`` strategy's trial (``dpsynth.dpsgd.form_trial``) on every layer of ``--model`` that
  has both forms: each form's time (norm and clipped sum) at the CPU micro-batch, the cost model's pick, the
  trial's, and how long the plan with its trials took.

    OMP_NUM_THREADS=1 python experiments/engine_micro.py forward output-tap group-norm conv-forms narrow-outputs
    OMP_NUM_THREADS=1 python experiments/engine_micro.py forms --model unet-6m

Run it with ``PYTHONPATH`` at another checkout to time that code (``output-tap`` needs the current one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dpsgd_step  # noqa: E402  (the benchmark's workloads)

import dpsynth.dpsgd.per_example as per_example  # noqa: E402
from dpsynth.dpsgd.taps import LayerGradient  # noqa: E402


def cpu_ms(function, reps: int, statistic=statistics.median) -> float:
    function()  # warm-up
    times = []
    for _ in range(reps):
        start = time.process_time()
        function()
        times.append((time.process_time() - start) * 1000)
    return statistic(times)


def forward(reps: int) -> None:
    per_example.layer_gradient = lambda tap, inputs, output_grad: LayerGradient({}, {})
    for name in ("unet-0.8m", "cnn"):
        model, batch, example_loss, per_sample_losses = dpsgd_step.build_workload(name, 1)
        one = {key: value[:1] for key, value in batch.items()}
        gradients = per_example.PerExampleGradients(model, example_loss)
        params, constants = gradients.trainable(), gradients.constants()
        gradients.compute(one, params, constants)  # the plan
        engine_times: list[float] = []
        vmapped = gradients._forward

        def timed_forward(*args, **kwargs):
            start = time.process_time()
            result = vmapped(*args, **kwargs)
            engine_times.append((time.process_time() - start) * 1000)
            return result

        gradients._forward = timed_forward
        for _ in range(reps + 1):
            gradients.compute(one, params, constants)
        flat = dpsgd_step.flatten_k(one)
        image = "x0" if "x0" in flat else "x"
        for p in model.parameters():
            p.requires_grad_(False)
        leaf = flat[image].clone().requires_grad_(True)
        plain = cpu_ms(lambda: per_sample_losses(model, {**flat, image: leaf}).mean(), reps)
        engine = statistics.median(engine_times[1:])
        print(f"forward of one example, {name}: engine {engine:.1f} ms, plain module {plain:.1f} ms")


class _NewStyleTap(torch.autograd.Function):
    """The identity with ``setup_context``: what ``OutputTap`` was before it became old-style."""

    @staticmethod
    def forward(output, anchor, receive):
        return output.view_as(output)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.receive = inputs[2]

    @staticmethod
    def backward(ctx, output_grad):
        ctx.receive(output_grad)
        return output_grad, None, None


def output_tap(reps: int) -> None:
    from dpsynth.dpsgd.taps import OutputTap

    x, anchor = torch.randn(4, 4, requires_grad=True), torch.zeros((), requires_grad=True)
    for function in (OutputTap, _NewStyleTap):
        ms = cpu_ms(lambda: [function.apply(x, anchor, None) for _ in range(84)], reps * 20)
        print(f"84 taps, {function.__name__}: {ms:.2f} ms")


def group_norm(reps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.GroupNorm(8, 32), nn.SiLU())])

    def loss(model_call, example):
        return F.mse_loss(model_call(example["x"]), example["target"])

    batch = {"x": torch.randn(64, 1, 32, 28, 28), "target": torch.randn(64, 1, 32, 28, 28)}
    gradients = per_example.PerExampleGradients(model, loss)
    ms = cpu_ms(lambda: gradients.compute(batch), reps * 5, statistic=min)
    print(f"four GroupNorms at 64 x 32 x 28 x 28, PerExampleGradients.compute: {ms:.1f} ms (minimum)")


def conv_forms(reps: int) -> None:
    from dpsynth.dpsgd.taps import FactoredConv, _Conv

    for in_channels, out_channels, size in ((64, 128, 7), (128, 128, 7), (128, 128, 14), (256, 128, 14)):
        conv = _Conv.of(nn.Conv2d(in_channels, out_channels, 3, padding=1))
        a, g = torch.randn(64, in_channels, size, size), torch.randn(64, out_channels, size, size)
        ghost = cpu_ms(lambda: FactoredConv(conv, a, g, 64).pending, reps)
        grouped = cpu_ms(lambda: conv.per_example_weight_grads(a, g, 64).flatten(1).pow(2).sum(1), reps)
        batched = cpu_ms(lambda: conv.weight_grad(a, g), reps)
        print(
            f"conv {in_channels} -> {out_channels} at {size}x{size}, B = 64: ghost norm {ghost:.1f} ms, "
            f"grouped per-example {grouped:.1f} ms, batched weight gradient {batched:.1f} ms"
        )


def narrow_outputs(reps: int) -> None:
    """The grouped per-example weight gradient of convolutions with few output channels (a UNet's output
    convolution, an RGB head), with the output channels padded to a block of 8 and without."""
    from dpsynth.dpsgd import taps

    padded_block = taps.OUTPUT_CHANNEL_BLOCK
    for in_channels, out_channels, size, copies in ((32, 1, 28, 1), (32, 1, 28, 4), (64, 3, 32, 1), (128, 3, 32, 1)):
        conv = taps._Conv.of(nn.Conv2d(in_channels, out_channels, 3, padding=1))
        a = torch.randn(64 * copies, in_channels, size, size)
        g = torch.randn(64 * copies, out_channels, size, size)
        times = {}
        for block in (1, padded_block):
            original, taps.OUTPUT_CHANNEL_BLOCK = taps.OUTPUT_CHANNEL_BLOCK, block
            try:
                times[block] = cpu_ms(lambda: conv.per_example_weight_grads(a, g, 64), reps, statistic=min)
            finally:
                taps.OUTPUT_CHANNEL_BLOCK = original
        print(
            f"conv {in_channels} -> {out_channels} at {size}x{size}, B = 64, K = {copies}: grouped per-example "
            f"{times[1]:.1f} ms, padded to {padded_block} outputs {times[padded_block]:.1f} ms"
        )


def forms(model_name: str) -> None:
    """The timed strategy's trials for every layer of a benchmark model that has both forms (the trial's own
    repeats count, not ``--reps``)."""
    from dpsynth.dpsgd.taps import choose_ghost, has_ghost_form

    model, batch, example_loss, _ = dpsgd_step.build_workload(model_name, 1)
    physical = dpsgd_step.default_physical(1, "cpu")
    gradients = per_example.PerExampleGradients(model, example_loss, strategy="timed", trial_batch=physical)
    micro_batch = {key: value[:physical] for key, value in batch.items()}
    start = time.perf_counter()
    taps = gradients.taps(micro_batch)
    seconds = time.perf_counter() - start
    trials = next(iter(gradients.form_trials.values()))
    print(f"{model_name}, micro-batch {physical}: ms per micro-batch, norm and clipped sum (minimum of the trial)")
    model_ms = trial_ms = 0.0
    for tap in taps:
        if not has_ghost_form(tap.module):
            continue
        trial = trials.get(tap.module_name)
        model_pick = "ghost" if choose_ghost(tap.module, tap.input_shape, tap.output_shape, "auto") else "instantiated"
        if trial is None:
            print(f"  {tap.module_name:36s} {tuple(tap.output_shape)!s:18s} not timed; {model_pick}")
            continue
        times = {"ghost": trial.ghost_s * 1000, "instantiated": trial.instantiated_s * 1000}
        kept = "ghost" if trial.ghost else "instantiated"
        model_ms, trial_ms = model_ms + times[model_pick], trial_ms + times[kept]
        print(
            f"  {tap.module_name:36s} {tuple(tap.output_shape)!s:18s} ghost {times['ghost']:7.1f}  instantiated "
            f"{times['instantiated']:7.1f}  cost model: {model_pick:12s} trial: {kept}"
        )
    print(f"timed layers: {model_ms:.0f} ms as the cost model picks, {trial_ms:.0f} ms as the trial picks")
    print(f"the plan with its trials took {seconds:.1f} s")


BENCHMARKS = {
    "forward": forward,
    "output-tap": output_tap,
    "group-norm": group_norm,
    "conv-forms": conv_forms,
    "narrow-outputs": narrow_outputs,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmarks", nargs="+", choices=[*BENCHMARKS, "forms"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", default="unet-6m", help="forms: the benchmark model (dpsgd_step.py's MODELS)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.benchmarks:
        if name == "forms":
            forms(args.model)
        else:
            BENCHMARKS[name](args.reps)


if __name__ == "__main__":
    main()
