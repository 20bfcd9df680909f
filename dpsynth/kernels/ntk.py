"""Normalised empirical-NTK features of a fixed random network, in closed form per layer.

DP-NTK (Yang et al., "Differentially Private Neural Tangent Kernels for Privacy-Preserving Data
Generation", arXiv:2303.01687, §3, Eq. 4-5) embeds an input by the gradient, with respect to every
parameter of a small network frozen at its random initialisation, of the *sum* of the network's
outputs, normalised to unit length:

    phi(x) = g(x) / ||g(x)||,   g(x) = grad_theta sum_k f_k(x; theta_0),

so ``phi(x) . phi(y)`` is the normalised empirical NTK and the declared bound is B = 1 (a zero
gradient gives a zero feature, still within the bound).

**Closed form, not double backprop.** The networks are Linear layers, ReLU and LayerNorm without
affine parameters (the paper's ``fc_1l`` and ``fc_2l``). For a Linear layer with input ``a_i`` and
backpropagated signal ``delta_i`` (the derivative of ``sum_k f_k`` with respect to the layer's output,
one row per example) the per-example gradients are ``dW_i = delta_i a_i^T`` and ``db_i = delta_i``:
one forward pass keeps every layer input, one backward pass of the all-ones output signal through
the (fixed) Jacobians of the layers gives every ``delta``. Then

    ||g(x_i)||^2 = sum_layers ||delta_i||^2 (||a_i||^2 + 1),

and the per-class sum of normalised features is, per layer, ``(onehot^T (delta / ||g||))^T``-weighted
outer products, i.e. one matrix product ``[K*out, B] x [B, in]``: the ``B x #params`` matrix of
per-example features is never formed on the generator side (:meth:`NTKFeatures.class_sums`). All of
it is ordinary differentiable torch code, so a generator can be trained through it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpsynth.errors import ConfigError
from dpsynth.kernels.feature_map import FeatureMap, flatten_inputs

#: One Linear layer's share of the per-example gradient: (layer, delta [B, out], layer input [B, in]).
_Tangent = tuple[nn.Linear, torch.Tensor, torch.Tensor]

# A squared gradient norm at or below this is treated as zero (the feature is then zero, norm <= 1).
_TINY = 1e-30


def fc_1l(input_dim: int, num_outputs: int, width: int = 800, seed: int = 0) -> nn.Sequential:
    """DP-NTK's MNIST network: Linear(d, width) -> ReLU -> LayerNorm (no affine) -> Linear(width, K)."""
    return _seeded(
        nn.Sequential(
            nn.Linear(input_dim, width),
            nn.ReLU(),
            nn.LayerNorm(width, elementwise_affine=False),
            nn.Linear(width, num_outputs),
        ),
        seed,
    )


def fc_2l(input_dim: int, num_outputs: int, widths: tuple[int, int] = (32, 256), seed: int = 0) -> nn.Sequential:
    """DP-NTK's CIFAR network: Linear(d, w1) -> ReLU -> Linear(w1, w2) -> LayerNorm (no affine) -> Linear(w2, K)."""
    first, second = widths
    return _seeded(
        nn.Sequential(
            nn.Linear(input_dim, first),
            nn.ReLU(),
            nn.Linear(first, second),
            nn.LayerNorm(second, elementwise_affine=False),
            nn.Linear(second, num_outputs),
        ),
        seed,
    )


def _seeded(network: nn.Sequential, seed: int) -> nn.Sequential:
    """Initialise every Linear from a public seed, as torch's default does (U(+-1/sqrt(fan_in)) for
    weight and bias) but without touching the global RNG; then freeze the network."""
    generator = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for module in network:
            if isinstance(module, nn.Linear):
                limit = 1.0 / math.sqrt(module.in_features)
                for parameter in (module.weight, module.bias):
                    if parameter is not None:
                        parameter.copy_(torch.rand(parameter.shape, generator=generator) * 2 * limit - limit)
    return network.requires_grad_(False).eval()


class NTKFeatures(FeatureMap):
    """Unit-norm e-NTK features of ``network`` (``dim`` = its parameter count), computed in closed form.

    Args:
        network: an ``nn.Sequential`` of ``nn.Linear``, ``nn.ReLU`` and ``nn.LayerNorm`` without affine
            parameters, ending in a Linear layer (e.g. :func:`fc_1l`); frozen here. Inputs are flattened.
    """

    bound = 1.0

    def __init__(self, network: nn.Sequential) -> None:
        _check_network(network)
        self.network = network.requires_grad_(False).eval()
        self.dim = sum(p.numel() for p in network.parameters())

    def to(self, device: torch.device | str) -> NTKFeatures:
        self.network.to(device)
        return self

    def _tangents(self, inputs: torch.Tensor) -> tuple[list[_Tangent], torch.Tensor]:
        """Per Linear layer (in parameter order): ``(layer, delta [B, out], layer input [B, in])``, and the
        inverse gradient norms ``[B]`` (0 for a zero gradient)."""
        hidden = flatten_inputs(inputs)
        layer_inputs = []
        for module in self.network:
            layer_inputs.append(hidden)
            hidden = module(hidden)
        signal = torch.ones_like(hidden)  # d(sum_k f_k) / d f
        parts = []
        for module, layer_input in zip(reversed(self.network), reversed(layer_inputs)):
            if isinstance(module, nn.Linear):
                parts.append((module, signal, layer_input))
                signal = signal @ module.weight
            elif isinstance(module, nn.ReLU):
                signal = signal * (layer_input > 0)  # autograd's ReLU derivative: 0 at 0
            else:
                signal = _layer_norm_backward(layer_input, signal, module.eps)
        parts.reverse()
        squared = sum(
            (delta**2).sum(1) * ((a**2).sum(1) + (1.0 if layer.bias is not None else 0.0)) for layer, delta, a in parts
        )
        inverse = torch.where(squared > _TINY, squared.clamp(min=_TINY).rsqrt(), torch.zeros_like(squared))
        return parts, inverse

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """``[B, dim]`` normalised per-example gradients, flattened in ``network.parameters()`` order."""
        parts, inverse = self._tangents(inputs)
        blocks = []
        for layer, delta, layer_input in parts:
            scaled = delta * inverse[:, None]
            blocks.append((scaled[:, :, None] * layer_input[:, None, :]).reshape(len(scaled), -1))
            if layer.bias is not None:
                blocks.append(scaled)
        return torch.cat(blocks, dim=1)

    def class_sums(self, inputs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        """``[K, dim]`` per-class sums of the normalised features, without the ``[B, dim]`` matrix."""
        parts, inverse = self._tangents(inputs)
        onehot = nn.functional.one_hot(labels.to(inverse.device).long(), num_classes).to(inverse.dtype)
        blocks = []
        for layer, delta, layer_input in parts:
            scaled = delta * inverse[:, None]
            by_class = (onehot[:, :, None] * scaled[:, None, :]).reshape(len(scaled), -1)  # [B, K*out]
            blocks.append((by_class.T @ layer_input).reshape(num_classes, -1))  # sum_i delta_i a_i^T per class
            if layer.bias is not None:
                blocks.append(onehot.T @ scaled)
        return torch.cat(blocks, dim=1)


def _layer_norm_backward(layer_input: torch.Tensor, signal: torch.Tensor, eps: float) -> torch.Tensor:
    """Backpropagate ``signal`` through LayerNorm without affine parameters over the last dimension:
    with ``u = (x - mean) / s``, ``s = sqrt(var + eps)``: ``dx = (dy - mean(dy) - u mean(dy u)) / s``."""
    mean = layer_input.mean(dim=1, keepdim=True)
    std = (layer_input.var(dim=1, unbiased=False, keepdim=True) + eps).sqrt()
    normalised = (layer_input - mean) / std
    centred = signal - signal.mean(dim=1, keepdim=True)
    return (centred - normalised * (signal * normalised).mean(dim=1, keepdim=True)) / std


def _check_network(network: nn.Module) -> None:
    if not isinstance(network, nn.Sequential) or not len(network) or not isinstance(network[-1], nn.Linear):
        raise ConfigError("the e-NTK network must be an nn.Sequential ending in an nn.Linear layer")
    for module in network:
        if isinstance(module, nn.LayerNorm):
            if module.elementwise_affine or len(module.normalized_shape) != 1:
                raise ConfigError("the e-NTK network's LayerNorm must have no affine parameters and one dimension")
        elif not isinstance(module, (nn.Linear, nn.ReLU)):
            raise ConfigError(f"the e-NTK closed form covers Linear, ReLU and LayerNorm, not {type(module).__name__}")
