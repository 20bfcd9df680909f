"""Per-example gradients and clipping with ``torch.func``.

One call of ``vmap(grad_and_value(loss))`` over a micro-batch gives every example's gradient at
once, stacked on a leading dimension, without per-parameter Python hooks. The loss of *one*
example may itself average over K augmented copies or K diffusion timesteps stacked on the
example's first dimension; differentiating that average gives the mean of the K gradients, so the
average-then-clip rule of augmentation multiplicity (dp-diffusion-finetuning.txt §4, Algorithm 1;
DESIGN.md privacy rule 3) costs one ``B x P`` gradient tensor instead of ``B x K x P``.

Clipping follows ``clip_C(v) = min(1, C / ||v||) v`` (dp-diffusion-finetuning.txt §3.3). With
``per_layer=True`` each of the L parameter tensors is clipped to ``C / sqrt(L)`` on its own, so the
whole clipped gradient still has norm at most ``sqrt(L * C^2 / L) = C``: the sensitivity, and hence
the accounting, is the same as for flat clipping.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from dpsynth.errors import DataError

Example = Mapping[str, torch.Tensor]
ModelCall = Callable[..., Any]
LossFn = Callable[[ModelCall, Example], torch.Tensor]

# Keeps the scale finite for a zero gradient and makes ||scale * g|| strictly below C.
_NORM_EPS = 1e-6


def batch_size(batch: Example) -> int:
    """The common leading dimension of every tensor in ``batch``."""
    sizes = {int(t.shape[0]) for t in batch.values()}
    if len(sizes) != 1:
        raise DataError(f"batch tensors disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def micro_batches(batch: Example, max_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Split a logical batch into consecutive micro-batches of at most ``max_size`` examples."""
    total = batch_size(batch)
    for start in range(0, total, max_size):
        yield {key: value[start:start + max_size] for key, value in batch.items()}


class PerExampleGradients:
    """Computes per-example gradients of ``loss_fn`` for the trainable parameters of ``model``.

    Parameters with ``requires_grad=False`` and buffers are passed to the model unchanged and get
    no gradient (this is how partial fine-tuning works).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        self.model = model
        self.loss_fn = loss_fn
        # randomness="different": dropout inside the model draws independently per example.
        self._vmapped = vmap(grad_and_value(self._example_loss), in_dims=(None, None, 0),
                             randomness="different")

    def trainable(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def constants(self) -> dict[str, torch.Tensor]:
        frozen = {name: p.detach() for name, p in self.model.named_parameters() if not p.requires_grad}
        frozen.update({name: b for name, b in self.model.named_buffers()})
        return frozen

    def _example_loss(self, params: dict[str, torch.Tensor], constants: dict[str, torch.Tensor],
                      example: Example) -> torch.Tensor:
        def model_call(*args: Any, **kwargs: Any) -> Any:
            return functional_call(self.model, (params, constants), args, kwargs)

        return self.loss_fn(model_call, example)

    def __call__(self, micro_batch: Example, params: dict[str, torch.Tensor] | None = None,
                 constants: dict[str, torch.Tensor] | None = None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Return ``(grads, losses)``: each grad has shape ``[B, *param.shape]``, losses ``[B]``."""
        params = self.trainable() if params is None else params
        constants = self.constants() if constants is None else constants
        return self._vmapped(params, constants, dict(micro_batch))


def per_example_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Total L2 norm over all parameters of each example's gradient, shape ``[B]``."""
    squares = [g.flatten(1).pow(2).sum(1) for g in grads.values()]
    return torch.stack(squares).sum(0).sqrt()


def clip_scales(grads: Mapping[str, torch.Tensor], max_grad_norm: float,
                per_layer: bool = False) -> dict[str, torch.Tensor]:
    """Per-example factors ``min(1, C / ||g||)``, shape ``[B]`` for each parameter.

    Flat clipping uses one norm over all parameters; per-layer clipping clips each of the L
    parameter tensors to ``C / sqrt(L)``, which bounds the total norm by C as well.
    """
    if per_layer:
        layer_bound = max_grad_norm / math.sqrt(len(grads))
        return {name: (layer_bound / (g.flatten(1).norm(dim=1) + _NORM_EPS)).clamp(max=1.0)
                for name, g in grads.items()}
    scale = (max_grad_norm / (per_example_norms(grads) + _NORM_EPS)).clamp(max=1.0)
    return {name: scale for name in grads}


def add_clipped_sum(accumulator: dict[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
                    max_grad_norm: float, per_layer: bool = False) -> None:
    """Add ``sum_i clip_C(g_i)`` of one micro-batch into ``accumulator`` in place."""
    scales = clip_scales(grads, max_grad_norm, per_layer)
    for name, g in grads.items():
        # A [B] x [B, ...] contraction: clip and sum in one kernel, no clipped copy of g.
        accumulator[name].add_(torch.tensordot(scales[name].to(g.dtype), g, dims=1))


def clipped_grad_sum(per_example: PerExampleGradients, micro_batch_stream: Iterable[Example],
                     max_grad_norm: float, per_layer: bool = False
                     ) -> tuple[dict[str, torch.Tensor], int]:
    """Sum of clipped per-example gradients over all micro-batches (before any noise).

    Returns the sum, keyed like the trainable parameters, and the number of examples read.
    Empty micro-batches are skipped (vmap cannot map over zero examples).
    """
    params = per_example.trainable()
    constants = per_example.constants()
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    count = 0
    device = next(iter(params.values())).device if params else torch.device("cpu")
    for micro_batch in micro_batch_stream:
        size = batch_size(micro_batch)
        if size == 0:
            continue
        micro_batch = {key: value.to(device, non_blocking=True) for key, value in micro_batch.items()}
        grads, _ = per_example(micro_batch, params, constants)
        add_clipped_sum(total, grads, max_grad_norm, per_layer)
        count += size
    return total, count
