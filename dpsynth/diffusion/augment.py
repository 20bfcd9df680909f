"""RandAugment on image tensors with an explicit generator, for non-private training on released images.

Cubuk, Zoph, Shlens & Le, "RandAugment: Practical automated data augmentation with a reduced search
space", CVPRW 2020 (arXiv:1909.13719), §3: every image gets ``num_ops`` operations drawn uniformly
from a fixed list, each at a magnitude on a 0..10 scale. DP-FETA (Li et al., IEEE S&P 2025,
arXiv:2504.01395, §4.2) warms its diffusion model up on a few dozen DP central images with
RandAugment (2 operations, a random magnitude per image), which keeps the model from memorising them.

The operations and their ranges at magnitude 10 follow the RandAugment paper's list (as torchvision
implements it): identity, shear x/y (0.3), translate x/y (0.45 of the side), rotate (30 degrees),
brightness, colour, contrast and sharpness (enhance by 1 ± 0.9), posterize (down to 4 bits),
solarize (threshold down to 0), autocontrast and equalize. A signed operation takes either sign with
probability 1/2. Geometric operations fill with 0 (black).

Every draw comes from the ``generator`` argument: use it for public data or DP releases only (a
private record's random inputs come from its per-record draws, docs/privacy.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dpsynth.errors import ConfigError

__all__ = ["RAND_AUGMENT_OPS", "MAX_MAGNITUDE", "rand_augment", "rand_augmenter", "apply_op"]

RAND_AUGMENT_OPS = (
    "identity",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
    "rotate",
    "brightness",
    "color",
    "contrast",
    "sharpness",
    "posterize",
    "solarize",
    "autocontrast",
    "equalize",
)
#: RandAugment's magnitude scale: magnitude 10 is the largest distortion of each operation.
MAX_MAGNITUDE = 10
_GEOMETRIC = ("shear_x", "shear_y", "translate_x", "translate_y", "rotate")
_SIGNED = _GEOMETRIC + ("brightness", "color", "contrast", "sharpness")
_LUMA = (0.299, 0.587, 0.114)


def rand_augment(
    images: torch.Tensor,
    generator: torch.Generator,
    *,
    num_ops: int = 2,
    min_magnitude: int = 1,
    max_magnitude: int = 9,
) -> torch.Tensor:
    """RandAugment ``images [B, C, H, W]`` with values in [0, 1]: ``num_ops`` random operations per image.

    Each image draws, for each of its ``num_ops`` slots, one operation of :data:`RAND_AUGMENT_OPS`
    uniformly, a magnitude uniformly in ``[min_magnitude, max_magnitude]`` (of :data:`MAX_MAGNITUDE`)
    and a sign. Returns a new tensor in [0, 1].
    """
    if images.ndim != 4:
        raise ValueError(f"rand_augment expects [B, C, H, W], got shape {tuple(images.shape)}")
    if num_ops < 0 or not 0 <= min_magnitude <= max_magnitude <= MAX_MAGNITUDE:
        raise ConfigError(
            f"RandAugment needs num_ops >= 0 and 0 <= min_magnitude <= max_magnitude <= {MAX_MAGNITUDE}, "
            f"got {num_ops}, {min_magnitude}, {max_magnitude}"
        )
    batch = images.shape[0]
    out = images.clamp(0.0, 1.0)
    if batch == 0 or num_ops == 0:
        return out.clone()
    ops = torch.randint(0, len(RAND_AUGMENT_OPS), (batch, num_ops), generator=generator)
    levels = torch.randint(min_magnitude, max_magnitude + 1, (batch, num_ops), generator=generator)
    signs = torch.where(torch.rand(batch, num_ops, generator=generator) < 0.5, -1.0, 1.0)
    strength = levels.to(torch.float32) / MAX_MAGNITUDE * signs
    for slot in range(num_ops):
        updated = out.clone()
        for index, name in enumerate(RAND_AUGMENT_OPS):
            chosen = (ops[:, slot] == index).nonzero().flatten()
            if len(chosen) and name != "identity":
                updated[chosen] = apply_op(name, out[chosen], strength[chosen, slot].to(out.device))
        out = updated
    return out


def rand_augmenter(
    num_ops: int,
    min_magnitude: int,
    max_magnitude: int,
    encode: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """``(x0, generator) -> x0'``: :func:`rand_augment` on model-range images ([-1, 1]), the ``augment`` of
    :func:`dpsynth.diffusion.pretrain.train_diffusion`. ``encode`` maps the augmented pixels to what the model trains
    on (a latent backbone's encoder: augmentation stays a pixel operation)."""

    def augment(x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        unit = (x0 + 1.0) / 2.0
        augmented = rand_augment(
            unit, generator, num_ops=num_ops, min_magnitude=min_magnitude, max_magnitude=max_magnitude
        )
        pixels = augmented * 2.0 - 1.0
        return pixels if encode is None else encode(pixels)

    return augment


def apply_op(name: str, images: torch.Tensor, strength: torch.Tensor) -> torch.Tensor:
    """One RandAugment operation on ``images [n, C, H, W]`` in [0, 1] at signed strengths ``[n]`` in [-1, 1]
    (magnitude / 10 with its sign; unsigned operations use the absolute value)."""
    if name not in RAND_AUGMENT_OPS:
        raise ConfigError(f"unknown RandAugment operation {name!r}")
    if name not in _SIGNED:
        strength = strength.abs()
    per_image = strength.reshape(-1, 1, 1, 1).to(images.dtype)
    if name == "identity":
        return images.clone()
    if name in _GEOMETRIC:
        return _affine(name, images, strength)
    if name == "brightness":  # blend with black
        return (images * (1.0 + 0.9 * per_image)).clamp(0.0, 1.0)
    if name == "color":  # blend with the grey image (a no-op for one channel)
        return _blend(_grey(images).expand_as(images), images, 1.0 + 0.9 * per_image)
    if name == "contrast":  # blend with the mean grey level
        mean = _grey(images).mean(dim=(-3, -2, -1), keepdim=True)
        return _blend(mean.expand_as(images), images, 1.0 + 0.9 * per_image)
    if name == "sharpness":  # blend with a smoothed image (borders kept, as PIL does)
        return _blend(_smooth(images), images, 1.0 + 0.9 * per_image)
    if name == "posterize":  # keep the top 8 - round(4 s) bits of each 8-bit value
        bits = 8 - torch.round(4.0 * strength).to(torch.int64)
        step = (2 ** (8 - bits)).reshape(-1, 1, 1, 1).to(images.dtype)
        return torch.floor(torch.round(images * 255.0) / step) * step / 255.0
    if name == "solarize":  # invert every value at or above the threshold 1 - s
        threshold = 1.0 - per_image
        return torch.where(images >= threshold, 1.0 - images, images)
    if name == "autocontrast":
        low = images.amin(dim=(-2, -1), keepdim=True)
        high = images.amax(dim=(-2, -1), keepdim=True)
        span = high - low
        stretched = (images - low) / span.clamp(min=1e-8)
        return torch.where(span > 0, stretched, images).clamp(0.0, 1.0)
    return _equalize(images)


def _blend(base: torch.Tensor, images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance: ``base + factor (images - base)``, clipped to [0, 1]."""
    return (base + factor * (images - base)).clamp(0.0, 1.0)


def _grey(images: torch.Tensor) -> torch.Tensor:
    if images.shape[-3] != 3:
        return images.mean(dim=-3, keepdim=True)
    weights = torch.tensor(_LUMA, dtype=images.dtype, device=images.device).reshape(1, 3, 1, 1)
    return (images * weights).sum(dim=-3, keepdim=True)


def _smooth(images: torch.Tensor) -> torch.Tensor:
    """PIL's SMOOTH filter (centre 5, neighbours 1, / 13) inside, the original pixels on the border."""
    channels = images.shape[-3]
    kernel = torch.ones(3, 3, dtype=images.dtype, device=images.device)
    kernel[1, 1] = 5.0
    kernel = (kernel / kernel.sum()).expand(channels, 1, 3, 3)
    inner = F.conv2d(images, kernel, groups=channels)
    smoothed = images.clone()
    smoothed[..., 1:-1, 1:-1] = inner
    return smoothed


def _affine(name: str, images: torch.Tensor, strength: torch.Tensor) -> torch.Tensor:
    """Shear, translate or rotate every image about its centre; outside pixels are 0."""
    count, _, height, width = images.shape
    theta = torch.zeros(count, 2, 3, dtype=images.dtype, device=images.device)
    theta[:, 0, 0] = 1.0
    theta[:, 1, 1] = 1.0
    s = strength.to(images.dtype)
    # affine_grid maps output coordinates (normalised to [-1, 1]) to the input coordinates sampled.
    if name == "shear_x":
        theta[:, 0, 1] = 0.3 * s * height / width
    elif name == "shear_y":
        theta[:, 1, 0] = 0.3 * s * width / height
    elif name == "translate_x":  # a positive strength moves the content right
        theta[:, 0, 2] = -2.0 * 0.45 * s
    elif name == "translate_y":  # ... and down
        theta[:, 1, 2] = -2.0 * 0.45 * s
    else:  # rotate by up to 30 degrees
        angle = s * math.radians(30.0)
        cos, sin = torch.cos(angle), torch.sin(angle)
        theta[:, 0, 0], theta[:, 0, 1] = cos, -sin * height / width
        theta[:, 1, 0], theta[:, 1, 1] = sin * width / height, cos
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False).clamp(0.0, 1.0)


def _equalize(images: torch.Tensor) -> torch.Tensor:
    """Histogram equalisation of every channel of every image on 256 levels."""
    count, channels, height, width = images.shape
    levels = torch.round(images * 255.0).clamp(0, 255).to(torch.int64).reshape(count * channels, -1)
    hist = torch.zeros(count * channels, 256, dtype=torch.float64, device=images.device)
    hist.scatter_add_(1, levels, torch.ones_like(levels, dtype=torch.float64))
    cdf = hist.cumsum(dim=1)
    lowest = cdf.gather(1, (hist > 0).to(torch.int64).argmax(dim=1, keepdim=True))  # count of the darkest level
    total = float(height * width)
    span = (total - lowest).clamp(min=1.0)
    lut = ((cdf - lowest) / span * 255.0).clamp(0, 255)
    flat = torch.where(total - lowest > 0, lut.gather(1, levels), levels.to(torch.float64))
    return (flat / 255.0).reshape(count, channels, height, width).to(images.dtype)
