"""Each tapped layer's form chosen by a timed trial (per-example gradient strategy ``"timed"``).

The book-keeping cost model (Bu et al., "Differentially Private Optimization on Large Model at Small Cost",
ICML 2023, arXiv:2210.00038, §3-4; :func:`dpsynth.dpsgd.taps.form_costs`) counts multiply-adds. What a form
costs on a machine also depends on how well its kernels run there, which no count sees: the ghost norm's
Grams are float64 and a ghost layer pays one more weight-gradient convolution in the clipped sum, while the
grouped per-example convolution of an instantiated layer runs well on some shapes and badly on others. On the
project's 2-core CPU, at a micro-batch of 64, the 6M UNet's 64 -> 128 convolution at 14x14 took 162 ms as a
ghost norm (the model's pick) and 59 ms instantiated, its 1x1 skip convolutions at 7x7 17 ms against 5.5 ms,
while its stride-2 convolution from 14x14 to 7x7 went the model's way, 55 ms against 174 ms
(``experiments/engine_micro.py forms``; BENCHMARKS.md, "DP-SGD step").

So under ``"timed"`` the plan times both forms of every layer that has both and whose modelled costs are
within :data:`TRIAL_RATIO` of each other (far apart, the model's pick stands and nothing is timed: a ghost
norm at 28x28 costs seconds), and keeps the faster. The model's pick is timed first; the other form is
abandoned when its warm-up run alone takes :data:`ABANDON_RATIO` times as long, so no trial costs more than
a few runs of the cheaper form. What is timed is what the step will run: the layer's
per-example gradient or factors (:func:`~dpsynth.dpsgd.taps.layer_gradient`), their norms, and the form's
share of the clipped sum. Either form yields the same clipped sum up to float rounding.

Privacy: the trial runs on random tensors of the layer's per-example shapes from a generator of its own
(seeded 0, so no draw of the run's generators and no private value), at the configured micro-batch size, not
the size of a sampled batch. The choice is a function of the architecture, the config and the machine's
speed, never of the private data.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch import nn

from dpsynth.dpsgd.taps import Tap, add_weighted_examples, check_ghost_norms, form_costs, has_ghost_form, layer_gradient

#: A layer is timed only if its modelled form costs are within this factor of each other.
TRIAL_RATIO = 4
#: Timed runs of each form (after one warm-up run); the minimum counts.
TRIAL_REPEATS = 3
#: The other form is abandoned after its warm-up run if that took this many times the model's pick.
ABANDON_RATIO = 3


@dataclasses.dataclass(frozen=True)
class FormTrial:
    """One layer's trial: seconds per micro-batch as a ghost norm and instantiated, and the form kept."""

    ghost_s: float
    instantiated_s: float

    @property
    def ghost(self) -> bool:
        return self.ghost_s <= self.instantiated_s


def needs_trial(tap: Tap) -> bool:
    """Whether ``tap``'s two forms are close enough in the cost model to be worth timing."""
    if not has_ghost_form(tap.module):
        return False
    ghost, instantiated = form_costs(tap.module, tap.input_shape, tap.output_shape)
    return max(ghost, instantiated) <= TRIAL_RATIO * max(1, min(ghost, instantiated))


def timed_forms(taps: list[Tap], batch: int, device: torch.device) -> tuple[list[Tap], dict[str, FormTrial]]:
    """``taps`` with the form of every close call (:func:`needs_trial`) set by timing both on ``batch``
    random examples, and the trials by layer name."""
    generator = torch.Generator(device=device).manual_seed(0)
    trials: dict[str, FormTrial] = {}
    chosen = []
    for tap in taps:
        if needs_trial(tap):
            trial = _trial(tap, batch, device, generator)
            trials[tap.module_name] = trial
            tap = dataclasses.replace(tap, ghost=trial.ghost)
        chosen.append(tap)
    return chosen, trials


def _trial(tap: Tap, batch: int, device: torch.device, generator: torch.Generator) -> FormTrial:
    module = tap.module
    dtype = module.weight.dtype
    if isinstance(module, nn.Embedding):
        inputs = torch.randint(0, module.num_embeddings, (batch, *tap.input_shape), device=device, generator=generator)
    else:
        inputs = torch.randn((batch, *tap.input_shape), device=device, dtype=dtype, generator=generator)
    output_grad = torch.randn((batch, *tap.output_shape), device=device, dtype=dtype, generator=generator)
    weights = torch.rand(batch, device=device, dtype=dtype, generator=generator)
    picked = _seconds(tap, inputs, output_grad, weights)  # the cost model's pick first
    other_form = dataclasses.replace(tap, ghost=not tap.ghost)
    other = _seconds(other_form, inputs, output_grad, weights, ABANDON_RATIO * picked)
    return FormTrial(*((picked, other) if tap.ghost else (other, picked)))


def _seconds(
    tap: Tap, inputs: torch.Tensor, output_grad: torch.Tensor, weights: torch.Tensor, abandon_after: float = math.inf
) -> float:
    """The minimum of the timed runs after a warm-up; only the warm-up's time if that exceeds ``abandon_after``."""
    times = []
    for _ in range(TRIAL_REPEATS + 1):
        _synchronise(inputs.device)
        start = time.perf_counter()
        _norm_and_sum(tap, inputs, output_grad, weights)
        _synchronise(inputs.device)
        times.append(time.perf_counter() - start)
        if times[0] > abandon_after:
            return times[0]
    return min(times[1:])


def _norm_and_sum(tap: Tap, inputs: torch.Tensor, output_grad: torch.Tensor, weights: torch.Tensor) -> None:
    """What a step runs for this layer: its gradient or factors, their norms, its share of the clipped sum."""
    layer = layer_gradient(tap, inputs, output_grad)
    check_ghost_norms(layer.factored.values())
    for grads in layer.materialised.values():
        torch.linalg.vector_norm(grads.flatten(1), dim=1)
        add_weighted_examples(torch.zeros(grads.shape[1:], device=grads.device, dtype=grads.dtype), weights, grads)
    for factored in layer.factored.values():
        factored.weighted_sum(weights)


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
