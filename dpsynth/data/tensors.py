"""The one pixel scaling every model in dpsynth sees: uint8 v <-> float v / 127.5 - 1.

This module imports nothing else from ``dpsynth.data``, so :mod:`dpsynth.data.dataset` and
:mod:`dpsynth.data.transforms` can both use it without importing each other; torch is imported
only inside the functions that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def to_unit_range(images: np.ndarray) -> np.ndarray:
    """uint8 [..] -> float32 in [-1, 1] (v / 127.5 - 1)."""
    return images.astype(np.float32) / 127.5 - 1.0


def from_unit_range(images: np.ndarray) -> np.ndarray:
    """float in [-1, 1] -> uint8, clipping values outside the range."""
    return np.clip(np.round((np.asarray(images, dtype=np.float64) + 1.0) * 127.5), 0, 255).astype(np.uint8)


def uint8_to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[N, H, W, C]`` -> float32 torch ``[N, C, H, W]`` in [-1, 1] (v / 127.5 - 1)."""
    import torch

    # Transposed while still uint8 (a quarter of the bytes to move; a writable copy even of a read-only memmap),
    # then scaled in place: 2-3x faster than making the permuted float view contiguous, which matters now that
    # it runs on every training batch (ImageDataset.batch_tensors).
    images = torch.from_numpy(np.array(np.asarray(images).transpose(0, 3, 1, 2), order="C"))
    return images.to(torch.float32).div_(127.5).sub_(1.0)


def tensor_to_uint8(images: torch.Tensor) -> np.ndarray:
    """float torch ``[N, C, H, W]`` in [-1, 1] -> uint8 ``[N, H, W, C]`` (inverse of :func:`uint8_to_tensor`)."""
    return from_unit_range(images.detach().float().cpu().permute(0, 2, 3, 1).numpy())
