"""Image grids: one row per class, so a reader sees at a glance what each class looks like."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image


def class_grid(
    images: np.ndarray, labels: np.ndarray, num_classes: int | None = None, per_class: int = 10, pad: int = 2
) -> np.ndarray:
    """Tile up to ``per_class`` images of each class into one row per class (uint8 HWC)."""
    if images.ndim != 4 or images.dtype != np.uint8:
        raise ValueError("class_grid expects uint8 images [N, H, W, C]")
    num_classes = int(num_classes if num_classes is not None else labels.max() + 1)
    _, height, width, channels = images.shape
    cell_h, cell_w = height + pad, width + pad
    grid = np.full((num_classes * cell_h + pad, per_class * cell_w + pad, channels), 255, np.uint8)
    for cls in range(num_classes):
        for col, index in enumerate(np.flatnonzero(labels == cls)[:per_class]):
            top, left = pad + cls * cell_h, pad + col * cell_w
            grid[top : top + height, left : left + width] = images[index]
    return grid


def save_class_grid(
    images: np.ndarray,
    labels: np.ndarray,
    path: str | os.PathLike,
    num_classes: int | None = None,
    per_class: int = 10,
    scale: int | None = None,
) -> None:
    """Write :func:`class_grid` as a PNG (creating its folder), upscaled so small digits stay readable."""
    grid = class_grid(images, labels, num_classes, per_class)
    scale = scale or max(1, 64 // images.shape[1])
    picture = Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid)
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    picture.save(path)
