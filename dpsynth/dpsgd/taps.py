"""Per-layer per-example gradients from one ordinary batched backward ("taps").

A tapped layer's per-example parameter gradient is a function of two tensors the batched backward
already has: the layer input ``A`` and the gradient at its output ``G`` (for example ``i`` with
``T`` output rows: Linear ``G_i^T A_i``, Conv2d the same on the im2col rows of ``A_i``, GroupNorm
``sum(G_i * normalise(A_i))``, Embedding a scatter of ``G_i`` at the indices ``A_i``). So the engine
never differentiates under ``vmap``: the per-example forward runs under ``vmap`` (so a loss is still
written for one example and its K copies), autograd then runs one batched backward of the summed
losses, and each tapped layer receives its ``G`` in a tensor hook as soon as the backward reaches it.

Mechanism: the tapped parameters enter the forward as constants (the backward computes no weight
gradient for them); a forward hook records the layer input and adds a zero "probe" to the output;
the probe is a broadcast of a scalar leaf, so the gradient flowing into it is exactly ``G`` and what
reaches the leaf is one scalar. Only layers called once per forward whose parameters are used by no
other operation are tapped (checked on one example when the plan is made); the other parameters
take the "fallback": they enter the forward as ``[B, *shape]`` per-example copies, so the same
backward yields their per-example gradients directly (the formulation ``vmap(grad)`` uses, and what
the engine did for every layer before taps existed).

Per layer, in the hook (Bu et al., "Differentially Private Optimization on Large Model at Small
Cost", ICML 2023, arXiv:2210.00038, §3-4, book-keeping), one of two forms:

* **ghost** (when cheaper than instantiating, ``T in out``: :func:`choose_ghost`; strategy ``"timed"`` lets a
  timed trial overrule that count where it is close, :mod:`dpsynth.dpsgd.form_trial`): the squared norm
  comes from the ``T x T`` Gram matrices of ``A_i`` and ``G_i`` (Goodfellow 2015; Li et al. 2022),
  costing ``T^2 (in + out)`` per example (:func:`linear_form_costs`; for a convolution the input Gram may
  come cheaper from the pixel Gram, :func:`conv_ghost_cost`), and the layer keeps ``A`` and ``G`` for
  the clipped sum, which is later one GEMM (Linear) or one ordinary batched weight-gradient convolution (Conv2d) of the
  clip-weighted ``G`` with ``A``: the same kernel as a non-private backward;
* **instantiated** (otherwise): ``G_i^T A_i`` is formed for the whole micro-batch at once (one
  ``bmm``, or for a convolution one grouped weight-gradient convolution with the examples as groups)
  and its squared norm taken. The ``B x P_layer`` tensor is then kept for the clipped sum (a
  ``[B] x [B, ...]`` contraction) and ``A``, ``G`` released, unless it is larger than ``A`` and ``G``
  together (a convolution with many channels on a small map): then it is freed at once and the
  layer keeps ``A`` and ``G`` as a ghost layer does (one more weight-gradient convolution in the sum).

For a Linear layer the time criterion and the memory one coincide (``T (in + out)`` numbers of
factors against ``in * out``); for a convolution the factors are smaller than im2col suggests
(``A`` holds ``C H W``, not ``C kh kw T``), hence the separate memory test. A large-map convolution
(``T`` = 784 positions at 28x28) is instantiated and keeps its small ``B x P_layer`` gradient; a Linear
head or a small-map convolution keeps its factors. Either way the largest per-example tensor alive
at once is one layer's, never the whole model's ``B x P``.
Normalisation affines and biases are always instantiated (``B x channels``).

K > 1 (augmentation multiplicity): the K copies of an example are rows of the same ``A_i``/``G_i``,
so every form above sums their contributions before the norm: the gradient of the K-averaged loss.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn
from torch._C import _functorch as functorch
from torch._C._functorch import TransformType
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

TAPPED_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.GroupNorm, nn.LayerNorm, nn.Embedding)


@dataclasses.dataclass(frozen=True)
class Tap:
    """A layer whose parameter gradients are computed from its input and its output gradient."""

    module_name: str
    module: nn.Module
    params: dict[str, str]  # local name ("weight", "bias") -> the model's parameter name (trainable only)
    output_shape: tuple[int, ...]  # per example (no batch dimension)
    output_dtype: torch.dtype
    ghost: bool  # the weight norm by the ghost norm, factors kept (else the gradient is instantiated)
    input_shape: tuple[int, ...]  # per example (no batch dimension)


def linear_form_costs(rows: int, in_features: int, out_features: int) -> tuple[int, int]:
    """The book-keeping cost model: a ghost norm costs ``rows^2 (in + out)`` multiply-adds per
    example, an instantiated gradient ``rows * in * out``."""
    return rows * rows * (in_features + out_features), rows * in_features * out_features


# -- which layers -------------------------------------------------------------------------------


def tappable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Layers of a supported type that own at least one trainable parameter a tap can handle."""
    found = {}
    for name, module in model.named_modules():
        if type(module) not in TAPPED_TYPES or not _own_trainable(module):
            continue
        if isinstance(module, (nn.Conv1d, nn.Conv2d)) and _conv_padding(module) is None:
            continue
        if isinstance(module, nn.Embedding) and (
            module.max_norm is not None or module.scale_grad_by_freq or module.sparse
        ):
            continue  # max_norm rewrites the weight in the forward; the others change the gradient's form
        found[name] = module
    return found


def _own_trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        local: p
        for local, p in module._parameters.items()
        if local in ("weight", "bias") and p is not None and p.requires_grad
    }


def _conv_padding(module: nn.Module) -> tuple[int, ...] | None:
    """Symmetric zero padding per spatial dim as the convolution applies it (None: asymmetric 'same')."""
    if module.padding_mode != "zeros":
        return (0,) * len(module.kernel_size)  # the module pads its input itself; the tap pads A alike
    if module.padding == "valid":
        return (0,) * len(module.kernel_size)
    if module.padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        return None if any(t % 2 for t in totals) else tuple(t // 2 for t in totals)
    return tuple(module.padding)


def layer_geometry(
    module: nn.Module, input_shape: tuple[int, ...], output_shape: tuple[int, ...]
) -> tuple[int, int, int]:
    """``(rows T, in, out)`` of the per-example weight-gradient factors ``A [T, in]``, ``G [T, out]``."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        spatial = len(module.kernel_size)
        rows = _numel(output_shape[: -spatial - 1]) * _numel(output_shape[-spatial:])
        kernel = _numel(module.kernel_size)
        return rows, module.in_channels // module.groups * kernel, module.out_channels
    if isinstance(module, nn.Embedding):
        return _numel(input_shape), module.num_embeddings, module.embedding_dim
    return _numel(output_shape[:-1]), module.in_features, module.out_features


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def _shapes_fit(module: nn.Module, input_shape: tuple[int, ...]) -> bool:
    if isinstance(module, nn.Conv2d):
        return len(input_shape) in (3, 4)
    if isinstance(module, nn.Conv1d):
        return len(input_shape) in (2, 3)
    if isinstance(module, nn.GroupNorm):
        return len(input_shape) >= 2
    if isinstance(module, nn.Linear):
        return len(input_shape) >= 1
    return True


def has_ghost_form(module: nn.Module) -> bool:
    """Whether the layer can take either form (a ghost norm, or an instantiated gradient as every layer can)."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return module.groups == 1
    return isinstance(module, (nn.Linear, nn.Embedding))


def choose_ghost(module: nn.Module, input_shape: tuple[int, ...], output_shape: tuple[int, ...], strategy: str) -> bool:
    """Whether the layer's weight norm is a ghost norm (factors kept) under ``strategy`` (``"timed"`` starts
    from the cost model's choice, which :mod:`dpsynth.dpsgd.form_trial` may then overturn)."""
    if not has_ghost_form(module) or strategy == "instantiate":
        return False
    if strategy == "ghost":
        return True
    ghost, instantiated = form_costs(module, input_shape, output_shape)
    return ghost <= instantiated


def form_costs(module: nn.Module, input_shape: tuple[int, ...], output_shape: tuple[int, ...]) -> tuple[int, int]:
    """The cost model's multiply-adds per example of the weight norm as a ghost norm and as an instantiated
    gradient (a layer with a ghost form: :func:`has_ghost_form`)."""
    rows, fan_in, out = layer_geometry(module, input_shape, output_shape)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return conv_ghost_cost(module, input_shape, rows) + rows * rows * out, rows * fan_in * out
    return linear_form_costs(rows, fan_in, out)


def conv_ghost_cost(module: nn.Module, input_shape: tuple[int, ...], rows: int) -> int:
    """Multiply-adds per example of a convolution's input Gram: the cheaper of the im2col Gram
    (``T^2 C kh kw``) and the padded input's pixel Gram plus its shifted sums (``P^2 C + kh kw T^2``,
    :meth:`_Conv.input_gram`). On 14x14 maps with 128 channels the pixel Gram makes the ghost norm
    about half as costly as instantiating (16M against 29M per example)."""
    spatial = len(module.kernel_size)
    if module.padding_mode == "zeros":
        pads = [2 * p for p in _conv_padding(module)]
    else:
        pads = [sum(module._reversed_padding_repeated_twice[2 * i : 2 * i + 2]) for i in range(spatial)][::-1]
    padded = _numel(size + pad for size, pad in zip(input_shape[-spatial:], pads))
    pixels = _numel(input_shape[: -spatial - 1]) * padded
    kernel, channels = _numel(module.kernel_size), module.in_channels
    return min(rows * rows * channels * kernel, pixel_gram_cost(pixels, channels, kernel, rows))


# The kh*kw shifted block sums of the pixel Gram are strided, memory-bound additions: first measured about
# 8x the cost of a GEMM multiply-add each (14x14 maps, 64 channels: the pixel-Gram ghost norm took 2x
# the instantiated one although the plain multiply-add counts were equal). They are now summed separably
# (kh + kw passes, :func:`_shifted_sum`), which made them cheaper; the constant was not re-fitted.
_SHIFTED_SUM_COST = 8


def pixel_gram_cost(pixels: int, channels: int, kernel: int, rows: int) -> int:
    return pixels * pixels * channels + _SHIFTED_SUM_COST * kernel * rows * rows


class _ParameterUses(TorchFunctionMode):
    """Counts the torch calls that receive each watched tensor (to find shared or tied weights).

    A property read that yields a tensor (``weight.T``, ``.mT``, ``.data``) is a use: the tensor it
    returns carries the weight into some other operation that the tap would not see, so a layer whose
    weight is also read through ``.T`` (a tied output head) must not be tapped. Reads of metadata
    (``.shape``, ``.dtype``) return no tensor and are not uses."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched = watched
        self.uses: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if getattr(func, "__name__", "") != "__get__" or isinstance(result, torch.Tensor):
            self._count(args, kwargs)
        return result

    def _count(self, args, kwargs) -> None:
        for leaf in _pytree.tree_leaves((args, kwargs)):
            name = self.watched.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if name is not None:
                self.uses[name] += 1


def plan_taps(
    model: nn.Module,
    candidates: dict[str, nn.Module],
    run_one_example: Callable[[], Any],
    params: dict[str, torch.Tensor],
    strategy: str = "auto",
) -> list[Tap]:
    """Run one example without gradients and keep the candidates a tap handles exactly: called once,
    with shapes it supports, and whose trainable parameters no other operation reads (tied weights)."""
    calls: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]] = {name: [] for name in candidates}
    handles = []
    for name, module in candidates.items():

        def record(mod, inputs, output, name=name):
            if inputs and isinstance(output, torch.Tensor):
                calls[name].append((tuple(inputs[0].shape), tuple(output.shape), output.dtype))
            else:
                calls[name].extend([None, None])  # called without a positional input: never tapped

        handles.append(module.register_forward_hook(record))
    uses = _ParameterUses({id(tensor): name for name, tensor in params.items()})
    try:
        with torch.no_grad(), uses:
            run_one_example()
    finally:
        for handle in handles:
            handle.remove()
    prefix = {module: name for name, module in candidates.items()}
    taps = []
    for name, seen in calls.items():
        module = candidates[name]
        owned = {local: _join(prefix[module], local) for local in _own_trainable(module)}
        if len(seen) != 1 or not _shapes_fit(module, seen[0][0]):
            continue
        if any(uses.uses[full] != 1 for full in owned.values()):
            continue
        input_shape, output_shape, dtype = seen[0]
        ghost = choose_ghost(module, input_shape, output_shape, strategy)
        taps.append(Tap(name, module, owned, output_shape, dtype, ghost, input_shape))
    return taps


def _join(module_name: str, local: str) -> str:
    return f"{module_name}.{local}" if module_name else local


# -- the hooks ----------------------------------------------------------------------------------


class TapHooks:
    """Forward hooks that record tapped inputs and route output gradients; active only inside a call.

    ``receivers[name](G)`` is called with layer ``name``'s output gradient ``G [B, ...]`` during the
    backward; a GroupNorm's also with ``affine=``, its per-example affine gradients (:class:`TappedGroupNorm`).
    ``anchor`` is a scalar leaf that requires grad: it makes every tapped output part of the graph, even when
    nothing before the layer needs a gradient (tapped weights are constants)."""

    def __init__(
        self,
        taps: list[Tap],
        anchor: torch.Tensor,
        receivers: dict[str, Callable[..., None]],
        copy_outputs: bool = False,
    ) -> None:
        self.taps = taps
        self.copy_outputs = copy_outputs  # for models that modify a layer output in place
        self.anchor = anchor
        self.receivers = receivers
        self.active = False
        self.inputs: dict[str, torch.Tensor] = {}
        self._handles = []

    def __enter__(self) -> Self:
        for tap in self.taps:
            if isinstance(tap.module, nn.GroupNorm):
                tap.module.forward = functools.partial(self._group_norm, tap.module_name, tap.module)
            else:
                self._handles.append(tap.module.register_forward_hook(self._hook(tap.module_name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for tap in self.taps:
            tap.module.__dict__.pop("forward", None)

    def _record(self, name: str, layer_input: torch.Tensor) -> Callable[..., None]:
        """Record a tapped layer's input and return its receiver."""
        if name in self.inputs:  # the plan saw one call; a second would overwrite the first's gradient
            raise RuntimeError(f"tapped layer {name!r} was called twice in one forward; use strategy 'exact'")
        if functorch.get_dynamic_layer_stack_depth() != 1:
            raise RuntimeError(
                f"tapped layer {name!r} ran under a functorch transform of the loss's own (vmap, grad); "
                "use strategy 'exact'"
            )
        self.inputs[name] = layer_input
        return self.receivers[name]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if not self.active:
                return None
            receive = self._record(name, inputs[0])
            tapped = beneath_vmap(lambda plain: OutputTap.apply(plain, self.anchor, receive), output)
            return tapped.clone() if self.copy_outputs else tapped

        return hook

    def _group_norm(self, name: str, module: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return type(module).forward(module, x)
        receive = self._record(name, x)
        if module.weight is not None and x.dtype != module.weight.dtype:
            # Under bf16/fp16 a low-precision input must not meet fp32 affine parameters in the kernel (the CPU
            # kernel accepts the mix, CUDA's raises). Casting to the parameters' dtype is autocast's fp32 rule
            # for group_norm (dpsynth.dpsgd.precision.FP32_OPS), and leaves bf16 parameters as they are.
            x = x.to(module.weight.dtype)
        affine = (module.weight, module.bias, module.num_groups, module.eps)
        return beneath_vmap(lambda plain: TappedGroupNorm.apply(plain, self.anchor, *affine, receive), x)


class OutputTap(torch.autograd.Function):
    """The identity on a layer output (a view: no copy), applied beneath the vmap level to the whole batch
    (:func:`beneath_vmap`), so its backward receives the batched ``G [B, ...]`` and hands it to ``receive``.
    Autograd forbids modifying such a view in place (``ReLU(inplace=True)`` after a tapped layer):
    :class:`TapHooks` then hands the model a copy instead. The old-style form (``ctx`` in ``forward``) skips
    the signature binding ``Function.apply`` does on every call for the other (0.9 against 5.9 ms for 84
    calls, ``experiments/engine_micro.py output-tap``); it never runs under a functorch transform."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, anchor: torch.Tensor, receive: Callable[[torch.Tensor], None]):
        ctx.receive = receive
        return output.view_as(output)

    @staticmethod
    def backward(ctx, output_grad: torch.Tensor):
        ctx.receive(output_grad)
        return output_grad, None, None


def beneath_vmap(function: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    """``function`` of the ``[B, ...]`` batch behind a tensor of the innermost ``vmap``, rewrapped as that vmap's
    tensor. A tensor that vmap does not batch (one the example does not change) is expanded to ``[B, ...]``
    first, so the backward still hands ``function``'s output one gradient per example.

    This is what a custom ``autograd.Function``'s vmap rule runs, without torch's generic route to it (pytree
    flattening and signature binding in Python on every call). That route made the engine's forward of one
    0.8M UNet example cost 98 ms against 23 ms for the plain module (its 84 taps and 27 GroupNorms); now 38
    against 20 ms (``experiments/engine_micro.py forward``, the 2-core development VM). The
    vmap level is popped while ``function`` runs, as ``interpreter.lower()`` does there, so ``function``
    sees plain tensors and ordinary autograd records it."""
    top = functorch.peek_interpreter_stack()
    if top is None or top.key() != TransformType.Vmap:
        raise RuntimeError("beneath_vmap is called inside the engine's vmapped forward only")
    level = top.level()
    saved = functorch.pop_dynamic_layer_stack()
    try:
        if functorch.maybe_get_level(tensor) == level:
            plain = functorch.get_unwrapped(tensor).movedim(functorch.maybe_get_bdim(tensor), 0)
        else:
            plain = tensor.expand(functorch.CVmapInterpreterPtr(top).batchSize(), *tensor.shape)
        result = function(plain)
    finally:
        functorch.push_dynamic_layer_stack(saved)
    return functorch._add_batch_dim(result, 0, level)


class TappedGroupNorm(torch.autograd.Function):
    """A tapped GroupNorm over the examples' stacked copies ``[B, N, C, *]`` (an example's N copies each).

    Forward: one ``native_group_norm`` of the ``B N`` rows with the affine (vmap's own batching rule normalises
    without it, then scales and shifts in two more passes; one kernel measured ~2.8x faster, 64 x 64 x 28 x 28,
    one thread). Backward: one ``native_group_norm_backward`` with the rows as the channels of a single "image"
    of ``B N C`` channels in ``B N G`` groups, whose groups are exactly the per-row groups. That one pass yields
    the input gradient and, per row and channel, the affine gradients, which are summed over an example's copies
    and handed to ``receive`` as its per-example gradients. The engine used to take those in a second pass, with
    the statistics computed again: four GroupNorms at 64 x 32 x 28 x 28 took 44-54 ms that way and 34-39 ms
    now (``experiments/engine_micro.py group-norm``)."""

    @staticmethod
    def forward(ctx, plain, anchor, weight, bias, groups, eps, receive):
        channels = plain.shape[2]
        rows = plain.reshape(-1, channels, _numel(plain.shape[3:])).contiguous()  # [B*N, C, HW]
        count, pixels = rows.shape[0], rows.shape[2]
        normalised, mean, rstd = torch.native_group_norm(rows, weight, bias, count, channels, pixels, groups, eps)
        ctx.save_for_backward(rows, mean, rstd, weight)
        ctx.groups, ctx.batch, ctx.receive = groups, plain.shape[0], receive
        return normalised.view(plain.shape)

    @staticmethod
    def backward(ctx, output_grad):
        rows, mean, rstd, weight = ctx.saved_tensors
        count, channels, pixels = rows.shape
        stacked = (1, count * channels, pixels)
        input_grad, scaled, summed = torch.ops.aten.native_group_norm_backward(
            output_grad.reshape(stacked).contiguous(),
            rows.reshape(stacked),
            mean.reshape(1, -1),
            rstd.reshape(1, -1),
            None if weight is None else weight.repeat(count),
            1,
            count * channels,
            pixels,
            count * ctx.groups,
            [ctx.needs_input_grad[0], True, True],
        )
        per_example = (scaled.view(ctx.batch, -1, channels).sum(1), summed.view(ctx.batch, -1, channels).sum(1))
        ctx.receive(output_grad, affine=per_example)
        input_grad = None if input_grad is None else input_grad.view(output_grad.shape)
        return input_grad, None, None, None, None, None, None


# -- per-layer gradients ------------------------------------------------------------------------


class Factored:
    """A weight gradient kept as its factors; ``squared`` is computed once, when ``G`` arrives.

    ``unreliable`` marks the examples whose ghost norm cannot be trusted (:func:`ghost_norm`):
    the caller drops them as it drops a NaN/Inf gradient."""

    ghost = True
    _squared: torch.Tensor | None = None
    _unreliable: torch.Tensor | None = None
    # A ghost norm before its check: the checks of all layers run as one batch (:func:`check_ghost_norms`).
    pending: GhostNorm | None = None

    @property
    def squared(self) -> torch.Tensor:
        if self.pending is not None:
            check_ghost_norms([self])
        return self._squared

    @squared.setter
    def squared(self, value: torch.Tensor) -> None:
        self._squared = value

    @property
    def unreliable(self) -> torch.Tensor | None:
        if self.pending is not None:
            check_ghost_norms([self])
        return self._unreliable

    def zero_examples(self, bad: torch.Tensor) -> None:
        raise NotImplementedError

    def weighted_sum(self, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_weighted_sum_to(self, total: torch.Tensor, scales: torch.Tensor) -> None:
        """``total += weighted_sum(scales)`` in place (one op fewer where the sum can be written into it)."""
        total.add_(self.weighted_sum(scales))

    def materialise(self) -> torch.Tensor:
        raise NotImplementedError


class FactoredLinear(Factored):
    """``G_i^T A_i`` with ``A [B, T, in]`` and ``G [B, T, out]``."""

    def __init__(self, activations: torch.Tensor, output_grads: torch.Tensor, weight_shape: torch.Size) -> None:
        self.activations, self.output_grads, self.weight_shape = activations, output_grads, weight_shape
        rows, fan_in, out = activations.shape[1], activations.shape[2], output_grads.shape[2]
        self.pending = ghost_norm(_wide_gram(activations), _wide_gram(output_grads), fan_in + out + rows, output_grads)

    def zero_examples(self, bad: torch.Tensor) -> None:
        self.activations = _zero_rows(self.activations, bad)
        self.output_grads = _zero_rows(self.output_grads, bad)

    def weighted_sum(self, scales: torch.Tensor) -> torch.Tensor:
        """``sum_i scales_i * G_i^T A_i`` as one GEMM over all B*T rows."""
        weighted = _scaled_rows(self.output_grads, scales)
        return (weighted.flatten(0, 1).t() @ self.activations.flatten(0, 1)).view(self.weight_shape)

    def add_weighted_sum_to(self, total: torch.Tensor, scales: torch.Tensor) -> None:
        """The GEMM of :meth:`weighted_sum` accumulating into ``total`` (``addmm_``)."""
        if not total.is_contiguous():
            super().add_weighted_sum_to(total, scales)
            return
        weighted = _scaled_rows(self.output_grads, scales)
        total.view(self.weight_shape[0], -1).addmm_(weighted.flatten(0, 1).t(), self.activations.flatten(0, 1))

    def materialise(self) -> torch.Tensor:
        per_example = torch.bmm(self.output_grads.transpose(1, 2), self.activations)
        return per_example.view(-1, *self.weight_shape)


class FactoredConv(Factored):
    """A convolution's weight gradient kept as ``A [B*K, C, H, W]`` and ``G [B*K, O, H', W']``."""

    def __init__(
        self,
        conv: _Conv,
        activations: torch.Tensor,
        output_grads: torch.Tensor,
        batch: int,
        squared: torch.Tensor | None = None,
    ) -> None:
        self.conv, self.activations, self.output_grads, self.batch = conv, activations, output_grads, batch
        self.ghost = squared is None
        if squared is not None:  # norms taken from the instantiated gradient, already released
            self.squared = squared
            return
        rows = output_grads.flatten(2).transpose(1, 2).reshape(batch, -1, output_grads.shape[1])
        gram_a = conv.input_gram(activations, batch, output_grads.shape[-2:])
        depth = (activations.shape[1] + 1) * _numel(conv.kernel) + rows.shape[2] + rows.shape[1]  # im2col or pixel
        self.pending = ghost_norm(gram_a, _wide_gram(rows), depth, output_grads)

    def zero_examples(self, bad: torch.Tensor) -> None:
        copies = self.activations.shape[0] // self.batch
        bad_rows = bad.repeat_interleave(copies)
        self.activations = _zero_rows(self.activations, bad_rows)
        self.output_grads = _zero_rows(self.output_grads, bad_rows)

    def weighted_sum(self, scales: torch.Tensor) -> torch.Tensor:
        """The ordinary batched weight-gradient convolution of the clip-weighted ``G`` with ``A``."""
        copies = self.activations.shape[0] // self.batch
        weights = scales.to(self.output_grads.dtype)
        if copies > 1:
            weights = weights.repeat_interleave(copies)
        weights = weights.view(-1, 1, 1, 1)
        return self.conv.weight_grad(self.activations, self.output_grads * weights)

    def materialise(self) -> torch.Tensor:
        return self.conv.per_example_weight_grads(self.activations, self.output_grads, self.batch)


class FactoredEmbedding(Factored):
    """Rows ``G [B, T, D]`` scattered at the indices ``[B, T]`` of a ``[num, D]`` table."""

    def __init__(self, indices: torch.Tensor, output_grads: torch.Tensor, num_embeddings: int) -> None:
        self.indices, self.output_grads, self.num_embeddings = indices, output_grads, num_embeddings
        gram = _wide_gram(output_grads)
        same = (indices.unsqueeze(2) == indices.unsqueeze(1)).to(device=gram.device, dtype=gram.dtype)
        depth = output_grads.shape[2] + output_grads.shape[1]
        self.pending = ghost_norm(same, gram, depth, output_grads)

    def zero_examples(self, bad: torch.Tensor) -> None:
        self.output_grads = _zero_rows(self.output_grads, bad)

    def weighted_sum(self, scales: torch.Tensor) -> torch.Tensor:
        total = self.output_grads.new_zeros(self.num_embeddings, self.output_grads.shape[-1])
        self.add_weighted_sum_to(total, scales)
        return total

    def add_weighted_sum_to(self, total: torch.Tensor, scales: torch.Tensor) -> None:
        weighted = _scaled_rows(self.output_grads, scales)
        total.index_add_(0, self.indices.flatten(), weighted.flatten(0, 1))

    def materialise(self) -> torch.Tensor:
        return _embedding_grads(self.indices, self.output_grads, self.num_embeddings)


# A ghost norm is trusted only where it exceeds the worst-case float64 rounding error of its sum by
# this factor (so its relative error is at most 1e-6, far inside the 1e-5 the clip bound is tested to).
_GHOST_MARGIN = 1e6


@dataclasses.dataclass(frozen=True)
class GhostNorm:
    """A ghost norm and its error bound (float64, ``[B]`` each), before :func:`check_ghost_norms`; the checked
    norm is returned on ``device``, in ``dtype`` or float32 if wider."""

    squared: torch.Tensor
    scale: torch.Tensor
    bound: torch.Tensor
    device: torch.device
    dtype: torch.dtype


def ghost_norm(gram_a: torch.Tensor, gram_g: torch.Tensor, depth: int, like: torch.Tensor) -> GhostNorm:
    """``||G_i^T A_i||^2``, ``S^2`` and the error bound from float64 Gram matrices ``[B, T, T]`` of the rows of A and G.

    Why the care: ``sum((A A^T) * (G G^T))`` adds terms of both signs as large as
    ``S^2 = (sum_t ||a_t|| ||g_t||)^2``, while the result can be far smaller (rows that nearly cancel).
    In float32 (or float16) the rounding error, about ``eps * S^2``, then swamps it: a norm that comes
    out too small lets the example past the clip with more than C, a negative one turns the whole sum
    into NaN. Hence float64 Grams, and an a-posteriori check (:func:`check_ghost_norms`): ``depth`` (the
    longest chain of additions behind one term: the Grams' inner dimensions plus the final reduction) times
    float64 epsilon times ``S^2`` bounds the error, and a norm that does not exceed that bound by
    :data:`_GHOST_MARGIN` (or is not finite) is marked unreliable. ``S`` costs nothing: ``||a_t||^2`` is the
    Gram's diagonal."""
    squared = (gram_a * gram_g).flatten(1).sum(1)
    row_norms = (gram_a.diagonal(dim1=1, dim2=2).clamp(min=0) * gram_g.diagonal(dim1=1, dim2=2).clamp(min=0)).sqrt()
    scale = row_norms.sum(1).square()
    bound = _GHOST_MARGIN * depth * torch.finfo(squared.dtype).eps * scale
    return GhostNorm(squared, scale, bound, like.device, like.dtype)


def check_ghost_norms(layers) -> None:
    """Check the pending ghost norms of ``layers`` (:class:`Factored`) against their error bounds (:func:`ghost_norm`),
    the layers of one device and dtype stacked into one ``[L, B]`` batch (a dozen ops in all, not per layer). The
    checked norm goes to ``like``'s device, in float32 at least (float64 for float64 factors): its rounding to
    float32 (1e-7) is far inside the margin."""
    groups: dict[tuple, list[Factored]] = {}
    for layer in layers:
        if layer.pending is not None:
            norm = layer.pending
            groups.setdefault((norm.squared.device, norm.squared.dtype, norm.device, norm.dtype), []).append(layer)
    for (_, _, device, like_dtype), group in groups.items():
        dtype = torch.promote_types(like_dtype, torch.float32)
        norms = [layer.pending for layer in group]
        squared = torch.stack([n.squared for n in norms])
        scale = torch.stack([n.scale for n in norms])
        bound = torch.stack([n.bound for n in norms])
        unreliable = ~torch.isfinite(squared) | ~torch.isfinite(scale) | ((scale > 0) & (squared <= bound))
        for layer, sq, bad in zip(group, squared.to(device, dtype).unbind(0), unreliable.to(device).unbind(0)):
            layer._squared, layer._unreliable, layer.pending = sq, bad, None


def add_weighted_examples(total: torch.Tensor, weights: torch.Tensor, grads: torch.Tensor) -> None:
    """``total += sum_i weights[i] * grads[i]`` in place for instantiated gradients ``[B, *shape]``: a
    ``[B] x [B, ...]`` contraction, so clipping, summing and accumulating take one kernel and no clipped copy."""
    weights = weights.to(grads.dtype)
    if total.is_contiguous():
        total.view(1, -1).addmm_(weights.view(1, -1), grads.reshape(grads.shape[0], -1))
    else:
        total.add_(torch.tensordot(weights, grads, dims=1))


def _scaled_rows(output_grads: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``G`` ``[B, T, out]`` with example i's rows scaled by ``scales[i]`` (the clip weights)."""
    return output_grads * scales.to(output_grads.dtype).view(-1, 1, 1)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 copy for Gram matrices (on the CPU for MPS, which has no float64)."""
    if tensor.device.type == "mps":
        tensor = tensor.cpu()
    return tensor.to(torch.float64)


def _gram(rows: torch.Tensor) -> torch.Tensor:
    """``[B, T, T]`` inner products of the rows of ``[B, T, d]``."""
    return torch.bmm(rows, rows.transpose(1, 2))


#: Bytes of float64 copies that one Gram computation holds at once. The examples are taken in blocks, so a
#: large micro-batch of a small network never holds a float64 (im2col) copy of every example at once:
#: dp-gan's discriminator at micro-batch 512 held 1.1 GB that way, four times its forward's activations.
GRAM_BLOCK_BYTES = 64 * 2**20


def _blockwise(batch: int, bytes_per_example: int, gram_of: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """``gram_of(examples)`` over blocks of at most ``GRAM_BLOCK_BYTES`` of copies, concatenated."""
    size = max(1, GRAM_BLOCK_BYTES // max(1, bytes_per_example))
    if size >= batch:
        return gram_of(slice(0, batch))
    return torch.cat([gram_of(slice(start, min(start + size, batch))) for start in range(0, batch, size)])


def _wide_gram(rows: torch.Tensor) -> torch.Tensor:
    """``_gram`` of a float64 copy of ``rows [B, T, d]``, a block of examples at a time."""
    return _blockwise(rows.shape[0], rows[0].numel() * 8, lambda block: _gram(_wide(rows[block])))


def _zero_rows(tensor: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    # Out of place: A may be a view of the caller's batch.
    return torch.where(bad.view(-1, *([1] * (tensor.dim() - 1))), torch.zeros((), dtype=tensor.dtype), tensor)


def _embedding_grads(indices: torch.Tensor, output_grads: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    batch, rows, dim = output_grads.shape
    grads = output_grads.new_zeros(batch, num_embeddings, dim)
    return grads.scatter_add_(1, indices.unsqueeze(-1).expand(batch, rows, dim), output_grads)


@dataclasses.dataclass(frozen=True)
class _Conv:
    """A Conv1d/Conv2d as a 2-D convolution (Conv1d gets a height-1 spatial dim)."""

    weight_shape: torch.Size
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    pre_pad: tuple[int, ...] | None  # padding_mode != "zeros": the module's own F.pad of the input
    pad_mode: str

    @classmethod
    def of(cls, module: nn.Module) -> _Conv:
        padding = _conv_padding(module)
        pre_pad = None if module.padding_mode == "zeros" else module._reversed_padding_repeated_twice
        if isinstance(module, nn.Conv1d):
            return cls(
                module.weight.shape,
                (1, module.kernel_size[0]),
                (1, module.stride[0]),
                (0, padding[0]),
                (1, module.dilation[0]),
                module.groups,
                pre_pad,
                module.padding_mode,
            )
        return cls(
            module.weight.shape,
            tuple(module.kernel_size),
            tuple(module.stride),
            tuple(padding),
            tuple(module.dilation),
            module.groups,
            pre_pad,
            module.padding_mode,
        )

    def as_4d(self, activations: torch.Tensor, output_grads: torch.Tensor, batch: int):
        """Per-example ``[B, (K,) C, *spatial]`` tensors as ``[B*K, C, H, W]`` (Conv1d: ``H = 1``)."""
        spatial = 1 if len(self.weight_shape) == 3 else 2
        a = activations.reshape(-1, *activations.shape[activations.dim() - spatial - 1 :])
        g = output_grads.reshape(-1, *output_grads.shape[output_grads.dim() - spatial - 1 :])
        if self.pre_pad is not None:
            a = F.pad(a, self.pre_pad, mode=self.pad_mode)
        if spatial == 1:
            a, g = a.unsqueeze(2), g.unsqueeze(2)
        return a, g

    def _backward_weight(self, a: torch.Tensor, g: torch.Tensor, groups: int, weight_shape) -> torch.Tensor:
        weight = g.new_empty(1).expand(weight_shape)
        return torch.ops.aten.convolution_backward(
            g, a, weight, None, self.stride, self.padding, self.dilation, False, [0, 0], groups, (False, True, False)
        )[1]

    def weight_grad(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The summed weight gradient (the kernel a non-private backward runs)."""
        out, per_group, kh, kw = g.shape[1], a.shape[1] // self.groups, *self.kernel
        return self._backward_weight(a, g, self.groups, (out, per_group, kh, kw)).view(self.weight_shape)

    @property
    def pointwise(self) -> bool:
        """A 1x1 convolution without stride, padding or groups: a Linear layer over the positions."""
        unit = self.kernel == self.stride == (1, 1) and self.padding == (0, 0)
        return unit and self.groups == 1 and self.pre_pad is None

    def per_example_weight_grads(self, a: torch.Tensor, g: torch.Tensor, batch: int) -> torch.Tensor:
        """``[B, *weight_shape]``: one grouped convolution with the examples as groups, the K copies of
        an example as the convolution's batch (so they are summed). A pointwise convolution is one ``bmm``
        of the positions instead (the grouped kernel loops over the groups there: 9.3 against 8.0 ms for
        64 to 32 channels at 28x28, 4.1 against 2.8 at 14x14)."""
        copies = a.shape[0] // batch
        if self.pointwise:
            rows_a = a.view(batch, copies, a.shape[1], -1).transpose(1, 2).reshape(batch, a.shape[1], -1)
            rows_g = g.view(batch, copies, g.shape[1], -1).transpose(1, 2).reshape(batch, g.shape[1], -1)
            return torch.bmm(rows_g, rows_a.transpose(1, 2)).view(batch, *self.weight_shape)
        out, padded = self.weight_shape[0], self.padded_outputs
        if padded != out:  # zero output channels, whose gradients are sliced off below
            g = F.pad(g, (0, 0, 0, 0, 0, padded - out))
        a = a.view(batch, copies, *a.shape[1:]).transpose(0, 1).reshape(copies, -1, *a.shape[2:])
        g = g.view(batch, copies, *g.shape[1:]).transpose(0, 1).reshape(copies, -1, *g.shape[2:])
        per_group = a.shape[1] // (batch * self.groups)
        grads = self._backward_weight(a, g, batch * self.groups, (batch * padded, per_group, *self.kernel))
        if padded != out:
            grads = grads.view(batch, padded, *grads.shape[1:])[:, :out]
        return grads.reshape(batch, *self.weight_shape)

    @property
    def padded_outputs(self) -> int:
        """The output channels the grouped per-example kernel runs with: rounded up to a multiple of
        :data:`OUTPUT_CHANNEL_BLOCK` for an ungrouped convolution with at least that many input channels: mkldnn's
        grouped weight gradient measured 2-4x faster on whole blocks of output channels (experiments/engine_micro.py
        ``narrow-outputs``: a UNet's 32 -> 1 output convolution at 28x28, B = 64, with 7 zero channels added)."""
        block, (out_channels, in_channels) = OUTPUT_CHANNEL_BLOCK, self.weight_shape[:2]
        if self.groups != 1 or in_channels < block or out_channels % block == 0:
            return out_channels
        return -(-out_channels // block) * block

    def input_gram(self, a: torch.Tensor, batch: int, out_size: tuple[int, int]) -> torch.Tensor:
        """``[B, K*T, K*T]`` in float64: :meth:`block_input_gram` of float64 copies of ``a``'s rows, a block of
        examples at a time (an example's K copies are consecutive rows)."""
        copies = a.shape[0] // batch
        (ph, pw), (oh, ow) = self.padding, out_size
        padded = (a.shape[2] + 2 * ph) * (a.shape[3] + 2 * pw)
        # what one example's block holds: its float64 rows, their im2col (or padded) copies, its Gram matrices
        held = copies * a[0].numel() + 2 * copies * max(a.shape[1] * _numel(self.kernel) * oh * ow, a.shape[1] * padded)
        held += (copies * padded) ** 2 + (copies * oh * ow) ** 2
        return _blockwise(
            batch,
            8 * held,
            lambda block: self.block_input_gram(
                _wide(a[block.start * copies : block.stop * copies]), block.stop - block.start, out_size
            ),
        )

    def block_input_gram(self, a: torch.Tensor, batch: int, out_size: tuple[int, int]) -> torch.Tensor:
        """``[B, K*T, K*T]``: the Gram matrix of each example's im2col rows (groups == 1).

        Either from the im2col rows themselves (``T^2 C kh kw`` per example), or from the Gram matrix
        of the padded input's pixels (``(Hp Wp)^2 C``), summing its ``kh kw`` diagonally shifted
        (strided, dilated) blocks: the row of output position ``t`` holds the input pixels
        ``t * stride + offset * dilation``, so ``<row_t, row_s> = sum_offset P[t*stride + o*d, s*stride + o*d]``.
        The cheaper is used (a 3x3 convolution on 7x7 maps: 6.4 ms instead of 10.9 ms, B = C = 64)."""
        copies, channels = a.shape[0] // batch, a.shape[1]
        (ph, pw), (sh, sw), (dh, dw), (kh, kw) = self.padding, self.stride, self.dilation, self.kernel
        oh, ow = out_size
        hp, wp = a.shape[2] + 2 * ph, a.shape[3] + 2 * pw
        positions, rows = copies * oh * ow, copies * hp * wp
        if pixel_gram_cost(rows, channels, kh * kw, positions) >= positions * positions * channels * kh * kw:
            cols = F.unfold(a, self.kernel, self.dilation, self.padding, self.stride)  # [B*K, C*kh*kw, T]
            cols = cols.transpose(1, 2).reshape(batch, -1, cols.shape[1])
            return torch.bmm(cols, cols.transpose(1, 2))
        padded = F.pad(a, (pw, pw, ph, ph)).view(batch, copies, channels, hp * wp)
        pixels = padded.transpose(2, 3).reshape(batch, rows, channels)
        pixel_gram = torch.bmm(pixels, pixels.transpose(1, 2)).view(batch, copies, hp, wp, copies, hp, wp)
        # The kh*kw shifts are separable: the kw column shifts first (both position indices' columns), then the
        # kh row shifts of that: kh + kw strided passes over the Gram instead of kh * kw.
        columns = _shifted_sum(pixel_gram, (3, 6), kw, ow, sw, dw)
        return _shifted_sum(columns, (2, 5), kh, oh, sh, dh).view(batch, positions, positions)


def _shifted_sum(tensor: torch.Tensor, dims: tuple[int, ...], offsets: int, size: int, stride: int, dilation: int):
    """``sum_o tensor[..., o*dilation + stride*t, ...]`` for ``t < size``, the same slice in each of ``dims``."""
    total = None
    for offset in range(offsets):
        index = [slice(None)] * tensor.dim()
        for dim in dims:
            index[dim] = slice(offset * dilation, offset * dilation + (size - 1) * stride + 1, stride)
        part = tensor[tuple(index)]
        total = part.clone() if total is None else total.add_(part)
    return total


@dataclasses.dataclass
class LayerGradient:
    """What one tap yields: per-example gradients (``[B, *shape]``) and factored weight gradients."""

    materialised: dict[str, torch.Tensor]
    factored: dict[str, Factored]


def layer_gradient(tap: Tap, inputs: torch.Tensor, output_grad: torch.Tensor) -> LayerGradient:
    """The tapped layer's per-example gradients from its input ``[B, ...]`` and output gradient ``[B, ...]``."""
    module, batch = tap.module, output_grad.shape[0]
    materialised: dict[str, torch.Tensor] = {}
    factored: dict[str, Factored] = {}
    weight, bias = tap.params.get("weight"), tap.params.get("bias")
    if isinstance(module, nn.LayerNorm):
        return affine_gradient(tap, *_layer_norm_affine_grads(module, inputs, output_grad))
    if isinstance(module, nn.Embedding):
        indices = inputs.reshape(batch, -1)
        grads = output_grad.reshape(batch, indices.shape[1], -1)
        if module.padding_idx is not None:
            grads = grads * (indices != module.padding_idx).unsqueeze(-1).to(grads.dtype)
        if tap.ghost:
            factored[weight] = FactoredEmbedding(indices, grads, module.num_embeddings)
        else:
            materialised[weight] = _embedding_grads(indices, grads, module.num_embeddings)
    elif isinstance(module, nn.Linear):
        rows_a, rows_g = (
            inputs.reshape(batch, -1, inputs.shape[-1]),
            output_grad.reshape(batch, -1, module.out_features),
        )
        if weight is not None:
            if tap.ghost:
                factored[weight] = FactoredLinear(rows_a, rows_g, module.weight.shape)
            else:
                materialised[weight] = torch.bmm(rows_g.transpose(1, 2), rows_a)
        if bias is not None:
            materialised[bias] = rows_g.sum(1)
    else:
        conv = _Conv.of(module)
        a, g = conv.as_4d(inputs, output_grad, batch)
        if weight is not None:
            if tap.ghost:
                factored[weight] = FactoredConv(conv, a, g, batch)
            elif _keeps_instantiated(conv, a, g, batch):
                materialised[weight] = conv.per_example_weight_grads(a, g, batch)
            else:  # norm from the instantiated gradient, freed at once; the sum later from A and G
                squared = conv.per_example_weight_grads(a, g, batch).flatten(1).pow(2).sum(1)
                factored[weight] = FactoredConv(conv, a, g, batch, squared)
        if bias is not None:
            materialised[bias] = g.view(batch, -1, *g.shape[1:]).sum((1, 3, 4))
    return LayerGradient(materialised, factored)


#: Output channels per example that the grouped per-example weight gradient is padded to a multiple of
#: (:attr:`_Conv.padded_outputs`; 1 turns the padding off).
OUTPUT_CHANNEL_BLOCK = 8

# An instantiated gradient up to this many times the size of the factors it replaces is kept: the
# weight-gradient convolution it saves costs more than holding it (the 1.1M CNN's 64-channel 14x14 layer,
# 2.4M numbers against 1.6M: 20 ms a step, 3 MB).
_KEEP_INSTANTIATED_RATIO = 3


def _keeps_instantiated(conv: _Conv, a: torch.Tensor, g: torch.Tensor, batch: int) -> bool:
    """Keep an instantiated conv gradient for the clipped sum (a cheap contraction) unless it is much larger
    than the layer's input and output gradient, which the other choice keeps (the sum is then one more
    ordinary weight-gradient convolution). A 3x3 conv on 28x28 or 14x14 keeps it; with 128 channels on 7x7,
    ``B x 147k`` numbers against ``B x 12.5k``, it keeps ``A`` and ``G``."""
    return _numel(conv.weight_shape) * batch <= _KEEP_INSTANTIATED_RATIO * (a.numel() + g.numel())


def affine_gradient(tap: Tap, scaled: torch.Tensor, summed: torch.Tensor) -> LayerGradient:
    """A normalisation layer's per-example affine gradients ``[B, C]`` (``sum G * x_hat``, ``sum G``) as a
    :class:`LayerGradient` of its trainable weight and bias."""
    grads = {"weight": scaled, "bias": summed}
    return LayerGradient({name: grads[local] for local, name in tap.params.items()}, {})


def _layer_norm_affine_grads(module: nn.LayerNorm, inputs: torch.Tensor, output_grad: torch.Tensor):
    batch = output_grad.shape[0]
    with torch.no_grad():
        normalised = F.layer_norm(inputs, module.normalized_shape, eps=module.eps)
        shape = (batch, -1, *module.normalized_shape)
        return (output_grad * normalised).reshape(shape).sum(1), output_grad.reshape(shape).sum(1)


def shape_key(micro_batch) -> tuple:
    return tuple((key, tuple(value.shape[1:]), value.dtype) for key, value in sorted(micro_batch.items()))
