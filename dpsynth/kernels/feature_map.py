"""Finite feature maps with a declared norm bound: the interface the kernel methods share.

A feature map ``phi`` sends a batch of inputs (images ``[N, C, H, W]`` or vectors ``[N, d]``) to
``[N, dim]`` rows whose L2 norm is at most ``bound`` by construction (random Fourier features and
normalised e-NTK features have norm exactly 1). The bound is what the bounded-sum release
(:mod:`dpsynth.privacy.bounded_sum`) declares as its sensitivity; the release still clips every row,
so a map that breaks its promise costs accuracy, never privacy.

The same map serves both sides of a kernel method (DP-MERF, Harder et al., AISTATS 2021,
arXiv:2002.11603, §3; DP-NTK, Yang et al., arXiv:2303.01687, §3): the private side sums features per
class once (:func:`feature_chunks` feeds the release), the generator side differentiates per-class
feature means of generated images (:meth:`FeatureMap.class_sums`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class FeatureMap:
    """Base class: ``dim`` features per input, each row of L2 norm at most ``bound``.

    Subclasses implement :meth:`features`; :meth:`class_sums` may be overridden when the class sums
    have a cheaper form than materialising every row (the e-NTK's outer products).
    """

    dim: int
    bound: float = 1.0

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """``[N, dim]`` features of ``inputs`` (differentiable in ``inputs``)."""
        raise NotImplementedError

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.features(inputs)

    def class_sums(self, inputs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        """``[K, dim]``: row ``c`` is the sum of the features of the inputs labelled ``c`` (differentiable)."""
        rows = self.features(inputs)
        # A one-hot product rather than index_add: its backward is one more product (no scatter).
        onehot = torch.nn.functional.one_hot(labels.to(rows.device).long(), num_classes).to(rows.dtype)
        return onehot.T @ rows


def class_feature_means(
    feature_map: FeatureMap, inputs: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(means [K, dim], present [K] bool)``: per-class feature means; a class without inputs has a
    zero row and ``present`` False (it has no mean to match)."""
    sums = feature_map.class_sums(inputs, labels, num_classes)
    counts = torch.bincount(labels.to(sums.device), minlength=num_classes).to(sums.dtype)
    return sums / counts.clamp(min=1.0)[:, None], counts > 0


@torch.no_grad()
def feature_chunks(
    feature_map: FeatureMap,
    inputs: torch.Tensor,
    labels: torch.Tensor | None,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Lazily yield ``(features [n, dim], labels [n])`` chunks of ``inputs`` for the bounded-sum release.

    A generator: nothing is computed until the release consumes it, i.e. after its ledger charge.
    """
    for start in range(0, len(inputs), batch_size):
        part = inputs[start : start + batch_size].to(device)
        yield feature_map(part), None if labels is None else labels[start : start + batch_size]


def flatten_inputs(inputs: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` -> ``[N, d]``: feature maps act on flattened pixels."""
    return inputs.reshape(inputs.shape[0], -1)
