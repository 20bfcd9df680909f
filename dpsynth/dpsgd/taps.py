"""Faster per-example weight gradients for Linear and small Conv2d layers ("taps").

Under ``vmap(grad)`` a weight gradient is materialised per example by batched kernels that are
slow on CPU in two cases we measured:

* ``nn.Linear`` fed one row (or a few K rows) per example: the per-example gradient is an outer
  product computed by a ``bmm`` with inner size K, e.g. 64 x 400 x 2048 for a 1.1M-parameter
  classifier head, which is memory bound (~0.1 s). With the layer input ``A_i`` ``[T, in]`` and
  the gradient at its output ``G_i`` ``[T, out]`` (T = K x other leading dims) the gradient is
  ``G_i^T A_i``; its squared norm is ``sum((A_i A_i^T) * (G_i G_i^T))`` (the "ghost norm" of
  Goodfellow 2015 / Li et al. 2022), and the clipped sum ``sum_i s_i G_i^T A_i`` is one GEMM over
  all rows. Nothing of size ``B x out x in`` is ever formed. Used when ``T^2 <= in * out``;
  otherwise the gradient is materialised with one batched matmul.
* ``nn.Conv2d`` on small feature maps (at most ``CONV_TAP_MAX_POSITIONS`` output positions): the
  grouped convolution vmap uses for per-example weight gradients is slower than unfold (im2col)
  followed by one batched GEMM (measured 11 ms vs 18 ms at 7x7, 64 -> 64 channels; at 28x28 the
  grouped convolution wins, so large maps stay with vmap).

Mechanism: the tapped weight is passed to the model as a constant (vmap computes no gradient for
it); a forward hook records the layer input and adds a zero "probe" to its output, and the
gradient with respect to the probe is exactly ``G``. Only layers called once per forward are
tapped (a shared layer would need one probe per call); biases stay with vmap.

Per-layer strategy (book-keeping, Bu et al., "Differentially Private Optimization on Large Model
at Small Cost", ICML 2023, arXiv:2210.00038, §3-4): each tapped layer keeps ``A`` and ``G`` from
the *one* backward pass and computes its per-example norms either as a ghost norm, costing
``T^2 (in + out)`` per example, or by instantiating ``G_i^T A_i``, costing ``T in out``
(:func:`prefers_ghost`). The clipped sum is then one GEMM of the clip-weighted ``G`` with ``A``, so
no second backward is needed. Under ``strategy="auto"`` a Conv2d on a large map (more than
``CONV_TAP_MAX_POSITIONS`` output positions) is tapped only when its ghost norm is the cheaper
choice; otherwise vmap instantiates its gradient with a grouped convolution, which measured faster
than im2col there. ``strategy="ghost"`` taps every single-call Linear/Conv2d with a ghost norm
(least memory).
"""

from __future__ import annotations

import dataclasses
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

CONV_TAP_MAX_POSITIONS = 64


@dataclasses.dataclass(frozen=True)
class Tap:
    """A layer whose weight gradient is computed from its input and its output gradient."""

    module_name: str
    weight_name: str
    module: nn.Module
    output_shape: tuple[int, ...]  # per example (no batch dimension)
    ghost: bool = True  # norms by the ghost norm (else the per-example gradient is instantiated)


def tappable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Linear and Conv2d layers whose trainable weight a tap can handle."""
    found = {}
    for name, module in model.named_modules():
        if not (getattr(module, "weight", None) is not None and module.weight.requires_grad):
            continue
        plain_conv = (
            type(module) is nn.Conv2d
            and module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
        if type(module) is nn.Linear or plain_conv:
            found[name] = module
    return found


def prefers_ghost(rows: int, in_features: int, out_features: int) -> bool:
    """The book-keeping cost model: a ghost norm costs ``rows^2 (in + out)`` multiply-adds per
    example, an instantiated gradient ``rows * in * out``; pick the cheaper."""
    return rows * (in_features + out_features) <= in_features * out_features


def layer_geometry(
    module: nn.Module, input_shape: tuple[int, ...], output_shape: tuple[int, ...]
) -> tuple[int, int, int]:
    """``(rows T, in, out)`` of the per-example factors ``A [T, in]`` and ``G [T, out]``."""
    if isinstance(module, nn.Conv2d):
        rows = output_shape[0] * output_shape[-1] * output_shape[-2]
        return rows, module.in_channels * module.kernel_size[0] * module.kernel_size[1], module.out_channels
    rows = 1
    for size in output_shape[:-1]:
        rows *= size
    return rows, module.in_features, module.out_features


def keep_tap(
    module: nn.Module, input_shape: tuple[int, ...], output_shape: tuple[int, ...], strategy: str = "auto"
) -> bool:
    """Whether to tap this layer for these per-example shapes (see the module docstring)."""
    if isinstance(module, nn.Linear):
        return len(input_shape) >= 1
    if len(input_shape) != 4:  # a conv tap needs the K copies stacked on the example's first dim
        return False
    if strategy == "ghost" or output_shape[-1] * output_shape[-2] <= CONV_TAP_MAX_POSITIONS:
        return True
    return prefers_ghost(*layer_geometry(module, input_shape, output_shape))


def _weight_name(module_name: str) -> str:
    return f"{module_name}.weight" if module_name else "weight"


def plan_taps(model: nn.Module, candidates: dict[str, nn.Module], run_one_example, strategy: str = "auto") -> list[Tap]:
    """Run one example without gradients, and keep the candidates called once with good shapes."""
    calls: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {name: [] for name in candidates}
    handles = []
    for name, module in candidates.items():

        def record(mod, inputs, output, name=name):
            calls[name].append((tuple(inputs[0].shape), tuple(output.shape)))

        handles.append(module.register_forward_hook(record))
    try:
        with torch.no_grad():
            run_one_example()
    finally:
        for handle in handles:
            handle.remove()
    taps = []
    for name, seen in calls.items():
        if len(seen) == 1 and keep_tap(candidates[name], *seen[0], strategy=strategy):
            module = candidates[name]
            ghost = strategy == "ghost" or prefers_ghost(*layer_geometry(module, *seen[0]))
            taps.append(Tap(name, _weight_name(name), module, seen[0][1], ghost))
    return taps


class TapHooks:
    """Forward hooks that record tapped inputs and add the probes; active only inside a call."""

    def __init__(self, taps: list[Tap]) -> None:
        self.taps = taps
        self.probes: dict[str, torch.Tensor] | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self._handles = []

    def __enter__(self) -> Self:
        for tap in self.taps:
            self._handles.append(tap.module.register_forward_hook(self._hook(tap.module_name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if self.probes is None:
                return None
            self.inputs[name] = inputs[0]
            return output + self.probes[name]

        return hook


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, *lead, features] -> [B, T, features]``."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _conv_columns(
    module: nn.Conv2d, inputs: torch.Tensor, output_grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """im2col of the per-example input ``[B, K, C, H, W]`` -> ``[B, K*T, C*kh*kw]`` and the output
    gradient ``[B, K, O, H', W']`` -> ``[B, K*T, O]``."""
    batch, copies = inputs.shape[:2]
    columns = F.unfold(inputs.flatten(0, 1), module.kernel_size, module.dilation, module.padding, module.stride)
    columns = columns.view(batch, copies, columns.shape[1], -1).transpose(2, 3).reshape(batch, -1, columns.shape[1])
    grads = output_grad.flatten(3).transpose(2, 3).reshape(batch, -1, output_grad.shape[2])
    return columns, grads


@dataclasses.dataclass
class TapGradient:
    """The weight gradient of one tapped layer for every example, as factors ``G_i^T A_i``."""

    weight_shape: torch.Size
    activations: torch.Tensor  # [B, T, in]
    output_grads: torch.Tensor  # [B, T, out]
    ghost: bool = True

    @classmethod
    def from_tap(cls, tap: Tap, inputs: torch.Tensor, output_grad: torch.Tensor) -> TapGradient:
        if isinstance(tap.module, nn.Conv2d):
            columns, grads = _conv_columns(tap.module, inputs, output_grad)
            return cls(tap.module.weight.shape, columns, grads, tap.ghost)
        return cls(tap.module.weight.shape, _rows(inputs), _rows(output_grad), tap.ghost)

    def zero_examples(self, bad: torch.Tensor) -> None:
        """Drop the examples flagged in ``bad`` ``[B]`` (non-finite gradients) from every later sum."""
        self.activations[bad] = 0
        self.output_grads[bad] = 0

    def materialise(self) -> torch.Tensor:
        """``[B, *weight_shape]``: one batched GEMM."""
        per_example = torch.bmm(self.output_grads.transpose(1, 2), self.activations)
        return per_example.view(-1, *self.weight_shape)

    def squared_norms(self) -> torch.Tensor:
        if self.ghost:
            gram_a = torch.bmm(self.activations, self.activations.transpose(1, 2))
            gram_g = torch.bmm(self.output_grads, self.output_grads.transpose(1, 2))
            return (gram_a * gram_g).flatten(1).sum(1)
        return self.materialise().flatten(1).pow(2).sum(1)

    def weighted_sum(self, scales: torch.Tensor) -> torch.Tensor:
        """``sum_i scales_i * G_i^T A_i`` as one GEMM over all B*T rows."""
        weighted = self.output_grads * scales.to(self.output_grads.dtype).view(-1, 1, 1)
        total = weighted.flatten(0, 1).t() @ self.activations.flatten(0, 1)
        return total.view(self.weight_shape)


def zero_probe(tap: Tap, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(tap.output_shape, dtype=like.dtype, device=like.device)


def shape_key(micro_batch) -> tuple:
    return tuple((key, tuple(value.shape[1:]), value.dtype) for key, value in sorted(micro_batch.items()))
