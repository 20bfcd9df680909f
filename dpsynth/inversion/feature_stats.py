"""GroupNorm input statistics and the feature loss of DP-ImgSyn (DP-ImgSyn (TMLR 2024) §4.1–4.2, Eq. 1).

A BatchNorm network keeps running batch statistics, but BatchNorm mixes examples and so cannot be
trained with per-example DP-SGD. DP-ImgSyn's teacher uses GroupNorm instead and *captures* the
inputs of every GroupNorm layer afterwards. GroupNorm is per example, so one batched forward gives
each example's own statistics exactly; this module turns them into

* a per-example *moment vector* (channel means and channel second moments of every layer's
  input, concatenated), the row that the DP Gaussian sum clips and adds up (§4.1), and
* batch statistics (channel mean and variance over batch and space, as BatchNorm defines them),
  compared with the private targets by the feature loss ``R_feature`` (Eq. 1).

Means and second moments are summed privately, not variances: both are averages of per-example
quantities, so their noisy sums divided by a noisy count estimate the population moments, and
``var = E[x^2] - mu^2`` follows by post-processing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch import nn


class GroupNormInputs:
    """Forward pre-hooks on every ``nn.GroupNorm`` of ``model`` that keep the layer inputs.

    Use as a context manager; inside it, each forward fills :attr:`inputs` (one tensor per
    GroupNorm layer, in module order, with the autograd graph kept so a loss on the statistics
    can be differentiated with respect to the images).
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.GroupNorm)]
        if not self.layers:
            raise ValueError("the model has no GroupNorm layer; DP-ImgSyn needs a GroupNorm teacher")
        self.inputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def channels(self) -> list[int]:
        """Channels of each GroupNorm layer, in capture order."""
        return [module.num_channels for _, module in self.layers]

    def __enter__(self) -> GroupNormInputs:
        for index, (_, module) in enumerate(self.layers):
            self._handles.append(module.register_forward_pre_hook(self._keeper(index)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.inputs = [None] * len(self.layers)

    def _keeper(self, index: int):
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.inputs[index] = args[0]

        return hook

    def captured(self) -> list[torch.Tensor]:
        if any(x is None for x in self.inputs):
            raise RuntimeError("a GroupNorm layer was not reached by the forward pass")
        return list(self.inputs)  # type: ignore[arg-type]


def _spatial_dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


def per_example_moments(inputs: list[torch.Tensor]) -> torch.Tensor:
    """``[B, D]``: per example, for each layer, channel means then channel second moments.

    ``D = 2 * sum_l C_l``. Spatial positions are averaged, so each entry is an average over one
    example only (the quantity whose clipped sum the DP mechanism releases).
    """
    parts: list[torch.Tensor] = []
    for x in inputs:
        dims = _spatial_dims(x)
        parts.append(x.mean(dim=dims) if dims else x)
        parts.append((x * x).mean(dim=dims) if dims else x * x)
    return torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)


def batch_statistics(inputs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the channel mean and (biased) variance over batch and space, as in BatchNorm."""
    stats = []
    for x in inputs:
        dims = (0, *_spatial_dims(x))
        mean = x.mean(dim=dims)
        second = (x * x).mean(dim=dims)
        stats.append((mean, second - mean * mean))
    return stats


@dataclasses.dataclass
class FeatureStatistics:
    """Target statistics ``(mu_l, var_l)`` of every GroupNorm input of the teacher (§4.2)."""

    means: list[torch.Tensor]
    variances: list[torch.Tensor]

    @classmethod
    def from_moments(cls, moments: torch.Tensor, channels: list[int], min_variance: float = 1e-4) -> FeatureStatistics:
        """Split an average moment vector (layout of :func:`per_example_moments`) into layers.

        ``var = E[x^2] - mu^2`` can come out negative once noise is added; it is clamped at
        ``min_variance`` (post-processing, free).
        """
        expected = 2 * sum(channels)
        if moments.shape != (expected,):
            raise ValueError(f"moment vector has shape {tuple(moments.shape)}, expected ({expected},)")
        means, variances = [], []
        offset = 0
        for c in channels:
            mean = moments[offset : offset + c]
            second = moments[offset + c : offset + 2 * c]
            offset += 2 * c
            means.append(mean.clone())
            variances.append(torch.clamp(second - mean * mean, min=min_variance))
        return cls(means, variances)

    def to(self, device: torch.device | str) -> FeatureStatistics:
        return FeatureStatistics([m.to(device) for m in self.means], [v.to(device) for v in self.variances])

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"means": [m.cpu() for m in self.means], "variances": [v.cpu() for v in self.variances]}

    @classmethod
    def from_state_dict(cls, state: dict[str, list[torch.Tensor]]) -> FeatureStatistics:
        return cls(list(state["means"]), list(state["variances"]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(zip(self.means, self.variances))


def feature_loss(inputs: list[torch.Tensor], target: FeatureStatistics) -> torch.Tensor:
    """``R_feature = sum_l ||mu_l(x) - mu_l||_2^2 + ||var_l(x) - var_l||_2^2`` (DP-ImgSyn (TMLR 2024) Eq. 1).

    The paper calls both terms "mean and variance estimates"; variances are compared here.
    """
    batch = batch_statistics(inputs)
    if len(batch) != len(target.means):
        raise ValueError(f"{len(batch)} GroupNorm layers captured, {len(target.means)} target layers")
    loss = inputs[0].new_zeros(())
    for (mean, var), (target_mean, target_var) in zip(batch, target):
        loss = loss + (mean - target_mean).pow(2).sum() + (var - target_var).pow(2).sum()
    return loss
