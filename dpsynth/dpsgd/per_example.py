"""Per-example gradients and clipping.

The loss is written for *one* example: ``loss_fn(model_call, example)``, where the example may
stack K augmented copies or K diffusion timesteps on its first dimension and the loss averages
them. Differentiating that average gives the mean of the K gradients, so the average-then-clip
rule of augmentation multiplicity (Ghalebikesabi et al. (arXiv:2302.13861) §4, Algorithm 1;
docs/contract.md, privacy rule 3) costs one gradient per example, never K.

How a micro-batch's per-example gradients are formed (:class:`PerExampleGradients`): the
per-example forward runs under ``torch.func.vmap`` (one batched forward whose kernels see all
B*K images at once), then ordinary autograd runs **one batched backward** of the summed losses.
Every Linear, Conv1d/Conv2d, GroupNorm, LayerNorm and Embedding layer that the plan can tap gets
its per-example parameter gradients, or their squared norms, from its input and output gradient
inside that backward, one layer at a time (:mod:`dpsynth.dpsgd.taps`); the remaining parameters
enter the forward as per-example copies, so the same backward gives their per-example gradients
(the "fallback", what ``vmap(grad)`` computes). Nothing of the size ``B x P`` of the whole model
is ever formed at once.

Clipping follows ``clip_C(v) = min(1, C / ||v||) v`` (Ghalebikesabi et al. (arXiv:2302.13861) §3.3). With
``per_layer=True`` each of the L parameter tensors is clipped to ``C / sqrt(L)`` on its own, so the
whole clipped gradient still has norm at most ``sqrt(L * C^2 / L) = C``: the sensitivity, and hence
the accounting, is the same as for flat clipping.

``strategy`` picks the per-layer form (:data:`STRATEGIES`):

* ``"auto"``: per layer by the book-keeping cost model of :mod:`dpsynth.dpsgd.taps` (ghost norm
  with the factors kept, or the per-example gradient instantiated for that layer only);
* ``"ghost"``: a ghost norm for every layer that has one (Linear, Embedding, ungrouped convolutions);
* ``"instantiate"``: every tapped layer's per-example gradient instantiated, layer by layer;
* ``"timed"``: as ``"auto"``, but a layer whose two forms the cost model puts close together gets the
  faster of the two in a timed trial on random tensors when the plan is made (:mod:`dpsynth.dpsgd.form_trial`);
* ``"exact"``: a loop over the examples with ordinary autograd, one backward per example.

The released update is the same for every strategy up to float rounding (tests compare them).
The taps assume the loss differentiates only through the model's parameters. A loss that also
differentiates with respect to its *input* (sliced score matching calls ``torch.autograd.grad`` on
the input inside the loss) declares ``loss_fn.differentiates_input = True``; the exact path is then
used for every layer, whatever ``strategy`` says.

``precision`` (:mod:`dpsynth.dpsgd.precision`): with ``"bf16"`` or ``"fp16"`` the vmapped forward runs
under autocast (:class:`~dpsynth.dpsgd.precision.Autocast`, which unlike ``torch.autocast`` also holds
under vmap) and the batched backward replays its dtypes; the tap hooks cast each layer's input
and output gradient back to the parameters' dtype (unscaling fp16's loss scale), so everything from the
per-example gradient on (norms, clipping, the sum) is the fp32 path.

An example whose gradient is not finite (NaN/Inf), or whose ghost norm is lost to rounding (a sum
of large terms of both signs that cancel; :func:`~dpsynth.dpsgd.taps.ghost_norm`), contributes
zero to the clipped sum: dropping one example's contribution keeps the sensitivity at C. How many
were dropped is a function of the private data, so it is kept only in
:attr:`PerExampleGradients.nonfinite_examples`, a private diagnostic for the data custodian (never in
curves, logs or ``StepStats``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.func import functional_call, vmap

from dpsynth.dpsgd.form_trial import FormTrial, timed_forms
from dpsynth.dpsgd.precision import Precision, no_tf32
from dpsynth.dpsgd.taps import (
    Factored,
    LayerGradient,
    Tap,
    TapHooks,
    _zero_rows,
    add_weighted_examples,
    affine_gradient,
    check_ghost_norms,
    layer_gradient,
    plan_taps,
    shape_key,
    tappable_modules,
)
from dpsynth.errors import ConfigError, DataError

Example = Mapping[str, torch.Tensor]
ModelCall = Callable[..., Any]
LossFn = Callable[[ModelCall, Example], torch.Tensor]

# Keeps the scale finite for a zero gradient and makes ||scale * g|| strictly below C.
_NORM_EPS = 1e-6

StrategyName = Literal["auto", "ghost", "instantiate", "timed", "exact"]
STRATEGIES: tuple[str, ...] = get_args(StrategyName)


def effective_strategy(loss_fn: LossFn, strategy: str) -> str:
    """``strategy`` after validation; ``"exact"`` whenever the loss differentiates its input."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown per-example gradient strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return "exact" if getattr(loss_fn, "differentiates_input", False) else strategy


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
        yield {key: value[start : start + max_size] for key, value in batch.items()}


class PerExampleResult:
    """Per-example gradients of one micro-batch: materialised tensors ``[B, *shape]`` and, for
    tapped layers kept in the ghost form (:mod:`dpsynth.dpsgd.taps`), factored weight gradients."""

    def __init__(
        self,
        materialised: dict[str, torch.Tensor],
        factored: dict[str, Factored],
        order: list[str],
        losses: torch.Tensor,
    ) -> None:
        self.materialised = materialised
        self.factored = factored
        self.order = order  # the trainable parameter names, in model order
        self.losses = losses

    def squared_norms(self) -> dict[str, torch.Tensor]:
        """``{name: [B]}``, each example's squared gradient norm per parameter tensor."""
        names, stacked = self._stacked_squared_norms()
        return _keyed(names, stacked, self.order)

    def _stacked_squared_norms(self) -> tuple[list[str], torch.Tensor]:
        """``(names, [L, B])``: the squared norms as one tensor, formed with a few ops for all layers
        (one norm kernel per materialised gradient, then one square and one clamp for the lot)."""
        parts, names = [], []
        if self.materialised:
            norms = [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in self.materialised.values()]
            parts.append(torch.stack(norms).square())
            names.extend(self.materialised)
        if self.factored:
            check_ghost_norms(self.factored.values())
            # A ghost norm marked unreliable may be negative; never below zero here (dropped before clipping).
            parts.append(torch.stack([f.squared for f in self.factored.values()]).clamp(min=0))
            names.extend(self.factored)
        if not parts:
            return names, self.losses.new_zeros(0, self.losses.shape[0])
        return names, parts[0] if len(parts) == 1 else torch.cat(parts)

    def unreliable(self) -> torch.Tensor | None:
        """``[B]``: examples with a ghost norm lost to rounding (:func:`~dpsynth.dpsgd.taps.ghost_norm`)."""
        check_ghost_norms(self.factored.values())
        masks = [f.unreliable for f in self.factored.values() if f.unreliable is not None]
        return torch.stack(masks).any(0) if masks else None

    def drop_nonfinite(self) -> tuple[dict[str, torch.Tensor], int]:
        """Zero every example whose gradient has a NaN/Inf, or whose ghost norm is unreliable (clipping
        by a norm that came out too small would let it contribute more than C), and return
        ``(squared norms, dropped)``. Reads the count on the host and zeroes only when it is not 0."""
        names, stacked, bad = self._nonfinite()
        dropped = int(bad.sum())
        if dropped:
            stacked = self._zero_examples(bad, stacked)
        return _keyed(names, stacked, self.order), dropped

    def zero_nonfinite(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """:meth:`drop_nonfinite` without a host synchronisation (a captured step): the same examples zeroed by
        ``torch.where`` whatever their count, which is returned as a 0-d device tensor (a private diagnostic)."""
        names, stacked, bad = self._nonfinite()
        return _keyed(names, self._zero_examples(bad, stacked), self.order), bad.sum()

    def _nonfinite(self) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """``(names, squared norms [L, B], bad [B])``: bad marks a NaN/Inf gradient or an unreliable ghost norm."""
        names, stacked = self._stacked_squared_norms()
        finite = torch.isfinite(stacked.sum(0))
        unreliable = self.unreliable()
        if unreliable is not None:
            finite = finite & ~unreliable
        return names, stacked, ~finite

    def _zero_examples(self, bad: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
        """Zero the ``bad`` examples' gradients (out of place: an activation may be a view of the caller's batch);
        return ``stacked`` with their squared norms zeroed too."""
        for name, g in self.materialised.items():
            self.materialised[name] = _zero_rows(g, bad)
        for factored in self.factored.values():
            factored.zero_examples(bad)
        return torch.where(bad, torch.zeros((), dtype=stacked.dtype, device=stacked.device), stacked)

    def full(self) -> dict[str, torch.Tensor]:
        """Every gradient materialised, ``{name: [B, *shape]}`` (for tests and small models)."""
        grads = dict(self.materialised)
        grads.update({name: f.materialise() for name, f in self.factored.items()})
        return {name: grads[name] for name in self.order}

    def add_weighted_sum(self, accumulator: dict[str, torch.Tensor], scales: Mapping[str, torch.Tensor]) -> None:
        """``accumulator[name] += sum_i scales[name][i] * g_i[name]`` in place."""
        for name, g in self.materialised.items():
            add_weighted_examples(accumulator[name], scales[name], g)
        for name, factored in self.factored.items():
            factored.add_weighted_sum_to(accumulator[name], scales[name])


class PerExampleGradients:
    """Computes per-example gradients of ``loss_fn`` for the trainable parameters of ``model``.

    Parameters with ``requires_grad=False`` and buffers are passed to the model unchanged and get
    no gradient (this is how partial fine-tuning works). ``strategy`` is one of :data:`STRATEGIES`
    (see the module docstring). ``nonfinite_examples`` counts the examples dropped for a NaN/Inf
    gradient: a private diagnostic, see the module docstring. ``precision`` (:mod:`dpsynth.dpsgd.precision`)
    runs the forward and backward under autocast; every gradient is handed back in the parameters' dtype.
    ``trial_batch``: the micro-batch size the ``"timed"`` strategy's trials run at (the configured one, never a
    sampled batch's size); the trials of the plans made so far are in :attr:`form_trials` (not private).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        strategy: str = "auto",
        precision: str | Precision = "fp32",
        trial_batch: int = 64,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.strategy = effective_strategy(loss_fn, strategy)
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)
        self.nonfinite_examples = 0
        self._candidates = tappable_modules(model) if self.strategy != "exact" else {}
        self._plans: dict[tuple, list[Tap]] = {}
        self.trial_batch = trial_batch
        self.form_trials: dict[tuple, dict[str, FormTrial]] = {}
        self._hooks: TapHooks | None = None
        self._copy_outputs = False
        # randomness="different": dropout inside the model draws independently per example.
        self._forward = vmap(self._example_forward, in_dims=(0, None, 0), randomness="different")

    def trainable(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def constants(self) -> dict[str, torch.Tensor]:
        frozen = {name: p.detach() for name, p in self.model.named_parameters() if not p.requires_grad}
        frozen.update({name: b for name, b in self.model.named_buffers()})
        return frozen

    def taps(self, micro_batch: Example) -> list[Tap]:
        """The layers tapped for micro-batches shaped like ``micro_batch`` (planned on first use)."""
        return self._plan(dict(micro_batch), self.trainable(), self.constants())

    def _example_forward(
        self,
        per_example: dict[str, torch.Tensor],
        fixed: dict[str, torch.Tensor],
        example: Example,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one example (under vmap) and the inputs of its tapped layers."""

        def model_call(*args: Any, **kwargs: Any) -> Any:
            return functional_call(self.model, (per_example, fixed), args, kwargs)

        hooks = self._hooks
        if hooks is not None:
            hooks.active, hooks.inputs = True, {}
        try:
            loss = self.loss_fn(model_call, example)
        finally:
            inputs = hooks.inputs if hooks is not None else {}
            if hooks is not None:
                hooks.active, hooks.inputs = False, {}
        return loss, inputs

    def _plan(
        self, micro_batch: Example, params: dict[str, torch.Tensor], constants: dict[str, torch.Tensor]
    ) -> list[Tap]:
        if not self._candidates:
            return []
        key = shape_key(micro_batch)
        if key not in self._plans:
            one = {name: value[0] for name, value in micro_batch.items()}

            def run_one_example() -> Any:
                # Under the training precision, so the plan sees the dtypes the tapped layers will see.
                with self.precision.autocast(_device(params)):
                    return self.loss_fn(lambda *a, **k: functional_call(self.model, (params, constants), a, k), one)

            taps = plan_taps(self.model, self._candidates, run_one_example, params, self.strategy)
            if self.strategy == "timed":
                taps, self.form_trials[key] = timed_forms(taps, self.trial_batch, _device(params))
            self._plans[key] = taps
        return self._plans[key]

    def compute(
        self,
        micro_batch: Example,
        params: dict[str, torch.Tensor] | None = None,
        constants: dict[str, torch.Tensor] | None = None,
    ) -> PerExampleResult:
        """Per-example gradients of one micro-batch (at least one example)."""
        params = self.trainable() if params is None else params
        constants = self.constants() if constants is None else constants
        micro_batch = dict(micro_batch)
        if self.strategy == "exact":
            return self._exact(micro_batch, params, constants)
        try:
            return self._tapped(micro_batch, params, constants)
        except RuntimeError as error:
            if "OutputTap" not in str(error) or self._copy_outputs:
                raise
            # The model modifies a tapped layer's output in place: from now on it gets a copy (one more
            # pass over each tapped output) instead of the zero-cost view.
            self._copy_outputs = True
            return self._tapped(micro_batch, params, constants)

    def _tapped(
        self, micro_batch: Example, params: dict[str, torch.Tensor], constants: dict[str, torch.Tensor]
    ) -> PerExampleResult:
        """One vmapped forward, one batched backward; tapped layers reduce their gradients in hooks."""
        batch = batch_size(micro_batch)
        taps = self._plan(micro_batch, params, constants)
        tapped = {name for tap in taps for name in tap.params.values()}
        fixed = {**constants, **{name: params[name] for name in tapped}}
        # Fallback parameters as per-example copies: the backward gives their [B, *shape] gradients.
        copies = {
            name: p.unsqueeze(0).expand(batch, *p.shape).requires_grad_(True)
            for name, p in params.items()
            if name not in tapped
        }
        device = _device(params)
        anchor = torch.zeros((), device=device, requires_grad=True)
        inputs: dict[str, torch.Tensor] = {}
        layers: dict[str, LayerGradient] = {}
        receivers = {
            tap.module_name: self._output_grad_receiver(tap, params, inputs, layers, self.precision) for tap in taps
        }
        self._hooks = TapHooks(taps, anchor, receivers, self._copy_outputs)
        try:
            with self._hooks, self.precision.autocast(device):
                losses, recorded = self._forward(copies, fixed, micro_batch)
        finally:
            self._hooks = None
        inputs.update(recorded)
        del recorded
        leaves = [anchor, *copies.values()]
        grads = [None] * len(leaves)
        if losses.requires_grad:  # the backward outside autocast: it replays the forward's dtypes
            grads = torch.autograd.grad(losses.sum() * self.precision.loss_scale, leaves, allow_unused=True)
        materialised = {
            name: torch.zeros_like(copy) if grad is None else self.precision.for_sum(grad, copy.dtype, gradient=True)
            for (name, copy), grad in zip(copies.items(), grads[1:])
        }
        factored: dict[str, Factored] = {}
        for tap in taps:
            layer = layers.get(tap.module_name)
            if layer is None:  # the layer's output did not reach the loss: a zero gradient
                zeros = {name: params[name].new_zeros(batch, *params[name].shape) for name in tap.params.values()}
                layer = LayerGradient(zeros, {})
            materialised.update(layer.materialised)
            factored.update(layer.factored)
        return PerExampleResult(materialised, factored, list(params), losses.detach())

    @staticmethod
    def _output_grad_receiver(
        tap: Tap,
        params: dict[str, torch.Tensor],
        inputs: dict[str, torch.Tensor],
        layers: dict[str, LayerGradient],
        precision: Precision,
    ) -> Callable[..., None]:
        dtype = params[next(iter(tap.params.values()))].dtype  # the clipped sum's dtype

        def hook(output_grad: torch.Tensor, affine: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
            # pop: an instantiated layer releases its input here; a ghost layer keeps it in its factors.
            # Both factors in the parameters' dtype: under autocast they arrive in bf16/fp16, and the norm
            # must be taken of what the sum adds (docs/privacy.md, "Mixed precision keeps the clip bound").
            layer_input = inputs.pop(tap.module_name)
            if affine is not None:  # a GroupNorm's per-example affine gradients, from its own backward
                grads = (precision.for_sum(grad, dtype, gradient=True) for grad in affine)
                layers[tap.module_name] = affine_gradient(tap, *grads)
                return
            activations = precision.for_sum(layer_input.detach(), dtype, gradient=False)
            layers[tap.module_name] = layer_gradient(
                tap, activations, precision.for_sum(output_grad, dtype, gradient=True)
            )

        return hook

    def _exact(
        self, micro_batch: Example, params: dict[str, torch.Tensor], constants: dict[str, torch.Tensor]
    ) -> PerExampleResult:
        """One ordinary forward and backward per example: correct for any loss, including one that
        calls ``torch.autograd.grad`` or ``torch.func.grad`` on its input."""
        leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}

        def model_call(*args: Any, **kwargs: Any) -> Any:
            return functional_call(self.model, (leaves, constants), args, kwargs)

        grads: dict[str, list[torch.Tensor]] = {name: [] for name in leaves}
        losses = []
        device, scale = _device(params), self.precision.loss_scale
        for index in range(batch_size(micro_batch)):
            example = {key: value[index] for key, value in micro_batch.items()}
            with torch.enable_grad():
                with self.precision.autocast(device):
                    loss = self.loss_fn(model_call, example)
                per_param = torch.autograd.grad(loss * scale, list(leaves.values()), allow_unused=True)
            for (name, leaf), grad in zip(leaves.items(), per_param):
                if grad is None:
                    grad = torch.zeros_like(leaf)
                grads[name].append(self.precision.for_sum(grad, leaf.dtype, gradient=True))
            losses.append(loss.detach())
        stacked = {name: torch.stack(values) for name, values in grads.items()}
        return PerExampleResult(stacked, {}, list(params), torch.stack(losses))

    def __call__(
        self,
        micro_batch: Example,
        params: dict[str, torch.Tensor] | None = None,
        constants: dict[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Return ``(grads, losses)``: each grad has shape ``[B, *param.shape]``, losses ``[B]``."""
        result = self.compute(micro_batch, params, constants)
        return result.full(), result.losses


def _device(params: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(params.values())).device if params else torch.device("cpu")


def per_example_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Total L2 norm over all parameters of each example's gradient, shape ``[B]``."""
    squares = [g.flatten(1).pow(2).sum(1) for g in grads.values()]
    return torch.stack(squares).sum(0).sqrt()


def clip_scales(
    squared_norms: Mapping[str, torch.Tensor], max_grad_norm: float, per_layer: bool = False
) -> dict[str, torch.Tensor]:
    """Per-example factors ``min(1, C / ||g||)``, shape ``[B]`` for each parameter.

    ``squared_norms`` maps each parameter to its per-example squared gradient norms. Flat
    clipping uses one norm over all parameters; per-layer clipping clips each of the L parameter
    tensors to ``C / sqrt(L)``, which bounds the total norm by C as well.
    """
    stacked = torch.stack(list(squared_norms.values()))  # [L, B]: every layer in one op from here on
    if per_layer:
        layer_bound = max_grad_norm / math.sqrt(len(squared_norms))
        scales = (layer_bound / (stacked.sqrt() + _NORM_EPS)).clamp(max=1.0)
        return dict(zip(squared_norms, scales.unbind(0)))
    total = stacked.sum(0).sqrt()
    scale = (max_grad_norm / (total + _NORM_EPS)).clamp(max=1.0)
    return {name: scale for name in squared_norms}


def add_clipped_sum(
    accumulator: dict[str, torch.Tensor], result: PerExampleResult, max_grad_norm: float, per_layer: bool = False
) -> int:
    """Add ``sum_i clip_C(g_i)`` of one micro-batch into ``accumulator`` in place.

    Examples with a non-finite gradient add nothing; returns how many were dropped (private)."""
    squared, dropped = result.drop_nonfinite()
    result.add_weighted_sum(accumulator, clip_scales(squared, max_grad_norm, per_layer))
    return dropped


def clipped_grad_sum(
    per_example: PerExampleGradients,
    micro_batch_stream: Iterable[Example],
    max_grad_norm: float,
    per_layer: bool = False,
) -> tuple[dict[str, torch.Tensor], int]:
    """Sum of clipped per-example gradients over all micro-batches (before any noise).

    Returns the sum, keyed like the trainable parameters, and the number of examples read.
    Empty micro-batches are skipped (vmap cannot map over zero examples). Examples with a NaN/Inf
    gradient contribute zero and are counted in ``per_example.nonfinite_examples``.

    Every DP-SGD step forms its clipped sum here, with TF32 off throughout (:func:`~dpsynth.dpsgd.precision.no_tf32`):
    a clip factor is taken from one computation (float64 Grams, an instantiated per-example gradient) and the
    clipped contribution summed by another (a GEMM or weight-gradient convolution), so the sum must be as
    accurate as the norm for the contribution to stay within C.
    """
    with no_tf32():
        return _clipped_grad_sum(per_example, micro_batch_stream, max_grad_norm, per_layer)


def _clipped_grad_sum(
    per_example: PerExampleGradients,
    micro_batch_stream: Iterable[Example],
    max_grad_norm: float,
    per_layer: bool,
) -> tuple[dict[str, torch.Tensor], int]:
    params = per_example.trainable()
    constants = per_example.constants()
    total = zeros_like_all(params)
    count = 0
    device = _device(params)
    for micro_batch in micro_batch_stream:
        size = batch_size(micro_batch)
        if size == 0:
            continue
        micro_batch = {key: value.to(device, non_blocking=True) for key, value in micro_batch.items()}
        result = per_example.compute(micro_batch, params, constants)
        per_example.nonfinite_examples += add_clipped_sum(total, result, max_grad_norm, per_layer)
        count += size
    return total, count


def zeros_like_all(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{name: zeros_like(t)}`` as views of one flat zero buffer (one kernel instead of one per tensor)
    when the tensors share a dtype and device and are contiguous; else one ``zeros_like`` each."""
    values = list(tensors.values())
    if not values or any(
        t.dtype != values[0].dtype or t.device != values[0].device or not t.is_contiguous() for t in values
    ):
        return {name: torch.zeros_like(t) for name, t in tensors.items()}
    flat = values[0].new_zeros(sum(t.numel() for t in values))
    chunks = flat.split([t.numel() for t in values])
    return {name: chunk.view(t.shape) for (name, t), chunk in zip(tensors.items(), chunks)}


def _keyed(names: list[str], stacked: torch.Tensor, order: list[str]) -> dict[str, torch.Tensor]:
    """The rows of ``stacked`` (one per name in ``names``) keyed by name, in ``order``."""
    rows = dict(zip(names, stacked.unbind(0)))
    return {name: rows[name] for name in order}
