"""What a run's private training will cost, before it runs: parameters, memory per device, GPU hours.

``dpsynth run PRESET --dry-run`` prints it for every network a method trains with DP-SGD, and
``dpsynth bench SUITE --dry-run`` for every cell of a suite. A method declares its networks through
:meth:`dpsynth.contract.Method.private_networks` (:class:`PrivateNetwork`: how to build the network at
the run's size, its inputs, its DP-SGD settings and its multiplicity K); nothing here reads data.

How each figure is made (docs/gpu.md, "Estimates before a run"):

* **parameters**: counted on the network built at the run's size (on the ``meta`` device: no memory).
* **activation memory per example**: *computed from layer shapes*, not measured: one forward of one row
  on the ``meta`` device, summing the bytes of every tensor autograd saves for the backward (weights
  excluded), times K rows per example; plus what the engine keeps per example for the clipped sum
  (:mod:`dpsynth.dpsgd.taps`: a ghost-norm layer's output gradient, an instantiated layer's per-example
  weight gradient, whichever the book-keeping cost model picks for the layer).
* **peak memory per device**: weights, the summed (then noisy) gradient, the optimizer's state (Adam:
  two slots, SGD with momentum: one), the EMA copy, plus ``physical_batch_size`` examples' activation
  memory (virtual batching: the logical batch B never sits in memory at once).
* **FLOPs**: the forward and backward of one row counted by :class:`torch.utils.flop_counter.FlopCounterMode`
  (matrix products and convolutions), times K rows, times B examples per DP step.
* **GPU hours**: DP steps × (micro-batches × a fixed cost per micro-batch + FLOPs / an effective rate), for
  each :data:`GPU_CLASSES` entry. Both constants are *assumptions* fitted to the engine's H100 rows in
  BENCHMARKS.md ("GPU: H100"), not peak datasheet figures; the A100 row scales the
  rate by the two cards' dense TF32 peaks. These are estimates, labelled as such wherever they are printed.

Pre-training on public data, sampling and evaluation are not included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dpsynth.data.registry import resolve
from dpsynth.data.section import DataSection
from dpsynth.data.sizes import planned_image_shape
from dpsynth.dpsgd.fixed_shape import step_form
from dpsynth.dpsgd.section import dpsgd_sections
from dpsynth.dpsgd.taps import GRAM_BLOCK_BYTES, choose_ghost, layer_geometry, tappable_modules
from dpsynth.dpsgd.training import PrivateTraining
from dpsynth.errors import ConfigError, DataError

GIB = 2**30
FLOAT_BYTES = 4  # parameters, gradients, optimizer state and the clipped sum stay fp32 under every precision
ACTIVATION_METHOD = "computed from layer shapes (autograd's saved tensors of one meta-device forward)"
#: optimizer slots per parameter (Adam's two moments; SGD's momentum buffer when momentum > 0)
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2}


@dataclasses.dataclass(frozen=True)
class GPUClass:
    """A named GPU and the throughput the estimate assumes for the DP-SGD engine on it."""

    name: str
    memory_gib: float
    #: effective FLOP/s of an engine micro-batch's non-private FLOP count, fp32 (TF32 convolutions)
    flops_per_s: float
    #: fixed seconds per micro-batch (kernel launches of the per-layer taps), plus a part per parameter
    micro_batch_s: float
    micro_batch_s_per_parameter: float
    #: rate multiplier under ``precision: bf16``/``fp16`` (the dense bf16/TF32 peak ratio of the card)
    half_speedup: float = 2.0

    def step_seconds(self, micro_batches: int, flops: float, parameters: int, half: bool) -> float:
        fixed = micro_batches * (self.micro_batch_s + self.micro_batch_s_per_parameter * parameters)
        return fixed + flops / (self.flops_per_s * (self.half_speedup if half else 1.0))


#: Fitted to BENCHMARKS.md's H100 engine rows (0.8M/6M/35M/80M UNets; dpdm, privimage and pdp-diffusion
#: presets): ~1e14 FLOP/s on large micro-batches, ~0.1 s a micro-batch on small ones. The A100's rate is
#: the H100's times 156/495 (dense TF32 peaks); its fixed costs are assumed equal.
GPU_CLASSES: dict[str, GPUClass] = {
    "H100": GPUClass("NVIDIA H100 80GB", 80.0, 1.0e14, 0.1, 1.2e-9),
    "A100": GPUClass("NVIDIA A100 80GB", 80.0, 1.0e14 * 156 / 495, 0.1, 1.2e-9),
}
DEFAULT_GPU = "H100"


@dataclasses.dataclass(frozen=True)
class PrivateNetwork:
    """A network a method trains with DP-SGD, as the dry run's estimate needs it.

    ``build()`` returns the network at the run's full size and ``inputs(rows)`` the positional inputs of
    one forward over ``rows`` rows; both create their tensors on torch's current default device, so the
    estimate builds them on ``meta`` (nothing allocated) and the slow paper-scale test on the CPU.
    ``rows_per_example`` is K (multiplicity: copies, timesteps or a real/fake pair per example).
    """

    key: str  # dotted config key of its DP-SGD section, e.g. "dpdm" or "dp-imgsyn.teacher"
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[torch.Tensor, ...]]
    training: PrivateTraining
    rows_per_example: int = 1
    #: the loss differentiates the network's input (sliced score matching): the engine's exact loop
    exact: bool = False
    #: network calls over ``generate.batch_size`` rows that make one sample batch (sampler steps), 0: none
    sample_calls: int = 0


@dataclasses.dataclass(frozen=True)
class NetworkProfile:
    """What one row costs a network, computed from layer shapes on the ``meta`` device."""

    parameters: int
    flops_per_row: float  # forward + backward
    activation_bytes_per_row: int  # tensors saved for the backward
    ghost_output_bytes_per_row: int  # output gradients the ghost-norm layers keep
    instantiated: tuple[tuple[int, int], ...]  # (parameters, output bytes per row) of instantiated layers
    ghost_gram_bytes_per_example: int = 0  # the float64 Gram matrices of the largest ghost-norm layer


def planned_image_geometry(data: DataSection) -> tuple[tuple[int, int, int], int]:
    """``((C, H, W), classes)`` a run's private images will have, from the ``data`` keys, the registry or the
    files' headers (:func:`~dpsynth.data.sizes.planned_image_shape`: no pixel is read); the class count is the
    registry's or ``data.num_classes``."""
    try:
        channels, height, width = planned_image_shape(data)
    except DataError:  # a path that does not exist here: the data keys may still say everything
        channels, height, width = data.channels, data.image_size, data.image_size
    try:
        entry = resolve(data.private)[3]
    except DataError:
        entry = None
    classes = data.num_classes or (entry.info.classes if entry is not None else None)
    if None in (height, width, channels, classes):
        raise ConfigError(
            f"the estimate needs the image shape and class count of {data.private!r}, which is not a registered "
            "dataset: set data.image_size, data.channels and data.num_classes"
        )
    return (int(channels), int(height), int(width)), int(classes)


#: profiles by network architecture, inputs, K and strategy: a suite's ε = 1 and ε = 10 cells share a network
_PROFILES: dict[tuple[Any, ...], NetworkProfile] = {}


def profile_network(network: PrivateNetwork) -> NetworkProfile:
    """Parameters, FLOPs and saved activations of one row, on the ``meta`` device (nothing is computed)."""
    with torch.device("meta"):
        model = network.build()
        inputs = network.inputs(1)
    shapes = tuple((tuple(t.shape), t.dtype) for t in inputs)
    # repr() omits a bare nn.Parameter's shape (e.g. a table sized by the noise levels), so two networks with
    # the same layers but other parameter shapes would share a profile: the parameter shapes are part of the key
    parameters = tuple((name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters())
    key = (repr(model), parameters, shapes, network.rows_per_example, network.training.strategy)
    if key not in _PROFILES:
        _PROFILES[key] = _trace_profile(model, inputs, network)
    return _PROFILES[key]


def _trace_profile(model: nn.Module, inputs: tuple[torch.Tensor, ...], network: PrivateNetwork) -> NetworkProfile:
    parameters = {id(p) for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}  # by identity: a tensor saved by two operations is stored once

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        weight = id(tensor) in parameters or (tensor._base is not None and id(tensor._base) in parameters)
        if not weight:  # a weight (or its transpose) is saved by reference: no memory of its own
            saved[id(tensor)] = tensor
        return tensor

    layers = _record_layer_shapes(model)
    with FlopCounterMode(display=False) as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model(*inputs)
        stand_in_loss(output).backward()
    for handle in layers.handles:
        handle.remove()
    ghost, instantiated, grams = _engine_kept_bytes(layers.shapes, network)
    return NetworkProfile(
        parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        flops_per_row=float(counter.get_total_flops()),
        activation_bytes_per_row=sum(t.numel() * t.element_size() for t in saved.values()),
        ghost_output_bytes_per_row=ghost,
        instantiated=instantiated,
        ghost_gram_bytes_per_example=grams,
    )


def stand_in_loss(output: Any) -> torch.Tensor:
    """A scalar of the network's output(s): the losses are a few elementwise operations on it, so the
    network's own forward and backward are what cost (the slow test runs the engine on the same loss)."""
    tensors = [output] if isinstance(output, torch.Tensor) else list(output)
    return sum(t.float().square().mean() for t in tensors)


@dataclasses.dataclass
class _LayerShapes:
    shapes: list[tuple[nn.Module, tuple[int, ...], tuple[int, ...]]]
    handles: list[Any]


def _record_layer_shapes(model: nn.Module) -> _LayerShapes:
    """Forward hooks on the layers the engine taps, recording their (input, output) shapes of one row."""
    record = _LayerShapes([], [])
    for module in tappable_modules(model).values():

        def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                record.shapes.append((mod, tuple(args[0].shape[1:]), tuple(output.shape[1:])))

        record.handles.append(module.register_forward_hook(hook))
    return record


def _engine_kept_bytes(
    shapes: Sequence[tuple[nn.Module, tuple[int, ...], tuple[int, ...]]], network: PrivateNetwork
) -> tuple[int, tuple[tuple[int, int], ...], int]:
    """Per row, the output-gradient bytes the ghost-norm layers keep; (parameters, output bytes per row) of the
    layers whose per-example gradient is instantiated (:func:`dpsynth.dpsgd.taps.choose_ghost` decides on one
    example's K rows, as the engine does); and per example, the two float64 ``[K T, K T]`` Gram matrices of
    the largest ghost-norm layer (one layer's are held at a time)."""
    rows = network.rows_per_example
    ghost_bytes, instantiated, grams = 0, [], 0
    for module, input_shape, output_shape in shapes:
        out_bytes = math.prod(output_shape) * FLOAT_BYTES
        own = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        shaped = (rows, *input_shape), (rows, *output_shape)
        if choose_ghost(module, *shaped, network.training.strategy):
            ghost_bytes += out_bytes
            grams = max(grams, 2 * 8 * layer_geometry(module, *shaped)[0] ** 2)
        else:
            instantiated.append((own, out_bytes))
    return ghost_bytes, tuple(instantiated), grams


@dataclasses.dataclass(frozen=True)
class NetworkEstimate:
    """The estimate of one privately trained network (every figure an estimate, see the module doc)."""

    key: str
    parameters: int
    rows_per_example: int
    batch_size: int  # expected logical batch B
    physical_batch_size: int
    steps: int
    precision: str
    activation_bytes_per_example: int
    state_bytes: int
    peak_bytes: int  # per device, one process
    flops_per_step: float
    gpu_hours: dict[str, float]
    fits: dict[str, bool]
    max_physical_batch: dict[str, int]  # the largest physical_batch_size whose estimate fits the card
    step: str = ""  # how the step runs (dpsynth.dpsgd.fixed_shape.step_form): fixed-shape/captured, or eager and why

    @property
    def micro_batches(self) -> int:
        return math.ceil(self.batch_size / self.physical_batch_size)

    def to_json(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["activation_mib_per_example"] = round(self.activation_bytes_per_example / 2**20, 3)
        values["peak_gib_per_device"] = round(self.peak_bytes / GIB, 3)
        values["gpu_hours"] = {name: float(f"{hours:.4g}") for name, hours in self.gpu_hours.items()}
        return values


def estimate_network(
    network: PrivateNetwork,
    num_examples: int,
    profile: NetworkProfile | None = None,
    *,
    device: str = "cpu",
    secure_rng: bool = False,
) -> NetworkEstimate:
    """The estimate of ``network`` trained on ``num_examples`` private examples (N: public by assumption), on the
    run's ``device`` (``auto``: CUDA where there is one) with its ``privacy.secure_rng``."""
    profile = profile or profile_network(network)
    training = network.training
    rows = network.rows_per_example
    half = training.precision in ("bf16", "fp16")
    per_example = activation_bytes_per_example(profile, network)
    state = state_bytes(profile.parameters, training)
    physical = min(training.physical_batch_size, max(1, training.batch_size))
    steps = training.total_steps(num_examples)
    flops = float(training.batch_size) * rows * profile.flops_per_row
    micro = math.ceil(training.batch_size / physical)
    hours = {
        name: steps * gpu.step_seconds(micro, flops, profile.parameters, half) / 3600
        for name, gpu in GPU_CLASSES.items()
    }
    # the float64 copies behind one block of examples' ghost norms (at most dpsynth.dpsgd.taps.GRAM_BLOCK_BYTES)
    blocks = min(GRAM_BLOCK_BYTES, physical * profile.ghost_gram_bytes_per_example)
    peak = peak_bytes(state, per_example, physical, network.exact) + blocks
    room = {name: int(gpu.memory_gib * GIB) - state for name, gpu in GPU_CLASSES.items()}
    return NetworkEstimate(
        key=network.key,
        parameters=profile.parameters,
        rows_per_example=rows,
        batch_size=training.batch_size,
        physical_batch_size=physical,
        steps=steps,
        precision=training.precision,
        activation_bytes_per_example=per_example,
        state_bytes=state,
        peak_bytes=peak,
        flops_per_step=flops,
        gpu_hours=hours,
        fits={name: peak <= GPU_CLASSES[name].memory_gib * GIB for name in GPU_CLASSES},
        max_physical_batch={name: max(0, left // max(per_example, 1)) for name, left in room.items()},
        step=step_form(training.graph, _planned_device(device), secure_rng=secure_rng)[1],
    )


def _planned_device(name: str) -> torch.device:
    """The device a run configured with ``name`` trains on here (``auto``: CUDA where there is one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def activation_bytes_per_example(profile: NetworkProfile, network: PrivateNetwork) -> int:
    """Saved activations of K rows (halved under bf16/fp16 autocast) plus what the engine keeps per example."""
    rows = network.rows_per_example
    saved = profile.activation_bytes_per_row * rows
    if network.training.precision in ("bf16", "fp16"):
        saved //= 2
    kept = profile.ghost_output_bytes_per_row * rows + profile.ghost_gram_bytes_per_example
    kept += sum(min(own * FLOAT_BYTES, out * rows) for own, out in profile.instantiated)
    return int(saved + kept)


def state_bytes(parameters: int, training: PrivateTraining) -> int:
    """Weights, the summed gradient, the optimizer's slots and the EMA copy, all fp32."""
    optimizer = training.optimizer.lower()
    slots = OPTIMIZER_SLOTS.get(optimizer, 1 if training.momentum > 0 else 0)
    copies = 2 + slots + (1 if training.ema_decay else 0)
    return parameters * FLOAT_BYTES * copies


def peak_bytes(state: int, per_example: int, physical: int, exact: bool) -> int:
    """Per device: the state plus one micro-batch's examples (the exact loop holds one example and its
    per-example gradient at a time, so the micro-batch does not multiply it)."""
    return state + per_example * (1 if exact else physical)


@dataclasses.dataclass(frozen=True)
class TrainingEstimate:
    """Every privately trained network of a run; ``undeclared``: DP-SGD sections no network was declared for."""

    num_examples: int
    networks: tuple[NetworkEstimate, ...]
    undeclared: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "estimate": True,
            "num_examples": self.num_examples,
            "activation_memory": ACTIVATION_METHOD,
            "gpu_classes": {name: dataclasses.asdict(gpu) for name, gpu in GPU_CLASSES.items()},
            "networks": [network.to_json() for network in self.networks],
            "undeclared": list(self.undeclared),
            "excluded": "public pre-training, sampling and evaluation",
        }

    def gpu_hours(self, gpu: str = DEFAULT_GPU) -> float:
        return sum(network.gpu_hours[gpu] for network in self.networks)

    def peak_bytes(self) -> int:
        return max((network.peak_bytes for network in self.networks), default=0)

    def text(self) -> str:
        """The dry run's section, every figure labelled an estimate."""
        lines = [
            "private training estimate (ESTIMATES, not measurements; docs/gpu.md, 'Estimates before a run'):",
        ]
        if not self.networks and not self.undeclared:
            lines.append("  no network is trained with DP-SGD")
        for net in self.networks:
            lines += [
                f"  {net.key}: {net.parameters / 1e6:.2f}M parameters, B={net.batch_size} x K={net.rows_per_example}"
                f" in micro-batches of {net.physical_batch_size} ({net.micro_batches} a step), {net.steps} DP steps,"
                f" {net.precision}",
                f"    activation memory per example: {net.activation_bytes_per_example / 2**20:.1f} MiB,"
                f" {ACTIVATION_METHOD}",
                f"    peak memory per device: {net.peak_bytes / GIB:.2f} GiB"
                f" (state {net.state_bytes / GIB:.2f} GiB + {net.physical_batch_size} examples)",
                f"    FLOPs per DP step: {net.flops_per_step:.3g} (forward + backward, counted on layer shapes)",
                f"    step: {net.step}",
            ]
            for name, gpu in GPU_CLASSES.items():
                fit = (
                    ""
                    if net.fits[name]
                    else (
                        f"; does NOT fit its {gpu.memory_gib:g} GiB: set physical_batch_size <= "
                        f"{net.max_physical_batch[name]}"
                    )
                )
                lines.append(f"    estimated DP training on one {gpu.name}: {_hours(net.gpu_hours[name])}{fit}")
        for key in self.undeclared:
            lines.append(f"  {key}: trained with DP-SGD, but its method declares no network (Method.private_networks)")
        lines.append(
            "  assumptions: GPU time = steps x (micro-batches x fixed cost + FLOPs / effective rate), fitted to the "
            "H100 rows of BENCHMARKS.md; pre-training, sampling and evaluation not included"
        )
        return "\n".join(lines)


def _hours(hours: float) -> str:
    return f"~{hours * 60:.1f} min" if hours < 1 else f"~{hours:,.1f} h"


def estimate_training(
    networks: Sequence[PrivateNetwork],
    num_examples: int,
    undeclared: Sequence[str] = (),
    *,
    device: str = "cpu",
    secure_rng: bool = False,
) -> TrainingEstimate:
    """The estimate of every network in ``networks`` on ``num_examples`` private examples."""
    return TrainingEstimate(
        num_examples=int(num_examples),
        networks=tuple(
            estimate_network(network, num_examples, device=device, secure_rng=secure_rng) for network in networks
        ),
        undeclared=tuple(undeclared),
    )


def check_networks_build(method: Any, config: Any) -> None:
    """Build ``method``'s private networks on the ``meta`` device (no memory, no arithmetic), so that a geometry a
    network cannot take (an image side its generator cannot reach, or its UNet would halve to 1x1) fails with that
    network's one-line ConfigError before any data is read or public model pre-trained. Nothing is checked when the
    image shape or class count is known only once the data is loaded (arrays handed to the API)."""
    try:
        networks = method.private_networks(config) or ()
    except (ConfigError, DataError):
        return
    with torch.device("meta"):
        for network in networks:
            network.build()


def estimate_run(method: Any, config: Any, num_examples: int) -> TrainingEstimate:
    """The estimate of a run: ``method.private_networks(config)`` (:meth:`dpsynth.contract.Method.private_networks`)
    on ``num_examples`` examples. A method that declares none (``None``) while its section holds DP-SGD
    sections gets those sections' keys listed as undeclared, so a missing declaration shows."""
    networks = method.private_networks(config)
    undeclared = [] if networks is not None else [key for key, _ in dpsgd_sections(config.section, config.method)]
    return estimate_training(
        networks or (), num_examples, undeclared, device=config.device, secure_rng=config.privacy.secure_rng
    )
