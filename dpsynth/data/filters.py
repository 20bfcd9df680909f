"""Low-resolution images to full-size uint8 images, with OpenCV's 3x3 median and sharpening filters.

DP-FETA's post-processing of its central images (Li et al., IEEE S&P 2025, arXiv:2504.01395, §4.1; the
reference code's ``cv2.medianBlur`` and ``cv2.filter2D``): clamp to [0, 1], bilinear upsampling to the full size,
8-bit, a 3x3 median blur and, for grey images, a 3x3 sharpening. Applied to a DP release it is post-processing.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

#: cv2.filter2D's sharpening kernel, applied after the median blur to grey images
SHARPEN = ((0.0, -1.0, 0.0), (-1.0, 5.0, -1.0), (0.0, -1.0, 0.0))


def upsample_to_uint8(
    flat: torch.Tensor,
    channels: int,
    size: tuple[int, int],
    image_size: tuple[int, int],
    post_process: bool = True,
) -> np.ndarray:
    """``flat [K, C*h*w]`` (pixels in [0, 1], any float range) as uint8 ``[K, H, W, C]`` images of ``image_size``.

    Clamp to [0, 1], bilinear upsampling, ``floor(255 v)``; with ``post_process`` a 3x3 median blur (edges
    replicated) and, for grey images, the 3x3 sharpening kernel (edges reflected), saturated to [0, 255].
    """
    low = flat.reshape(-1, channels, *size).clamp(0.0, 1.0).to(torch.float32)
    upsampled = F.interpolate(low, size=image_size, mode="bilinear", align_corners=False)
    pixels = torch.floor(upsampled * 255.0).clamp(0, 255)
    if post_process:
        pixels = median_blur3(pixels)
        if channels == 1:
            pixels = sharpen3(pixels)
    return pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def median_blur3(pixels: torch.Tensor) -> torch.Tensor:
    """3x3 median of every channel of ``[n, C, H, W]``, edges replicated (cv2.medianBlur with ksize 3)."""
    n, channels, height, width = pixels.shape
    padded = F.pad(pixels, (1, 1, 1, 1), mode="replicate")
    windows = F.unfold(padded.reshape(n * channels, 1, height + 2, width + 2), kernel_size=3)
    return windows.median(dim=1).values.reshape(n, channels, height, width)


def sharpen3(pixels: torch.Tensor) -> torch.Tensor:
    """:data:`SHARPEN` over grey ``[n, 1, H, W]`` pixels, edges reflected, rounded and saturated to [0, 255]."""
    kernel = torch.tensor(SHARPEN, dtype=pixels.dtype).reshape(1, 1, 3, 3)
    return torch.round(F.conv2d(F.pad(pixels, (1, 1, 1, 1), mode="reflect"), kernel)).clamp(0, 255)
