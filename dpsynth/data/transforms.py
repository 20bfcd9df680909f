"""Preprocessing on uint8 NHWC arrays: resize, centre crop, grey/RGB conversion, stratified splits.

Only numpy and PIL are used here (torch only in :meth:`ImageDataset.to_tensors`), so that the
same code prepares private data, public data and synthetic samples. Splits follow the
DPImageBench protocol: a fixed-seed, class-stratified hold-out carved from the training set.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from dpsynth.data.dataset import ImageDataset
from dpsynth.errors import DataError

# ITU-R BT.601 luma weights, the ones PIL uses for "RGB" -> "L".
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)


def to_unit_range(images: np.ndarray) -> np.ndarray:
    """uint8 [..] -> float32 in [-1, 1] (v / 127.5 - 1)."""
    return images.astype(np.float32) / 127.5 - 1.0


def uint8_to_tensor(images: np.ndarray) -> "torch.Tensor":  # noqa: F821
    """uint8 ``[N, H, W, C]`` -> float32 torch ``[N, C, H, W]`` in [-1, 1] (v / 127.5 - 1): the one
    pixel scaling every model in dpsynth sees."""
    import torch

    images = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
    return images.to(torch.float32).div_(127.5).sub_(1.0).contiguous()


def tensor_to_uint8(images: "torch.Tensor") -> np.ndarray:  # noqa: F821
    """float torch ``[N, C, H, W]`` in [-1, 1] -> uint8 ``[N, H, W, C]`` (inverse of :func:`uint8_to_tensor`)."""
    return from_unit_range(images.detach().float().cpu().permute(0, 2, 3, 1).numpy())


def from_unit_range(images: np.ndarray) -> np.ndarray:
    """float in [-1, 1] -> uint8, clipping values outside the range."""
    return np.clip(np.round((np.asarray(images, dtype=np.float64) + 1.0) * 127.5), 0, 255).astype(np.uint8)


def float_to_uint8(images: np.ndarray) -> np.ndarray:
    """Float images to uint8, guessing the range from the data: [0, 1], [-1, 1] or [0, 255]."""
    images = np.asarray(images, dtype=np.float64)
    if not np.all(np.isfinite(images)):
        raise DataError("float images contain NaN or infinite values")
    low, high = float(images.min(initial=0.0)), float(images.max(initial=0.0))
    if low >= 0.0 and high <= 1.0:
        scaled = images * 255.0
    elif low >= -1.0 and high <= 1.0:
        scaled = (images + 1.0) * 127.5
    elif low >= 0.0 and high <= 255.0:
        scaled = images
    else:
        raise DataError(f"float images must lie in [0, 1], [-1, 1] or [0, 255], found {low:g}..{high:g}")
    return np.clip(np.round(scaled), 0, 255).astype(np.uint8)


def grey_to_rgb(images: np.ndarray) -> np.ndarray:
    """[N, H, W, 1] -> [N, H, W, 3] by repeating the channel."""
    return np.repeat(images, 3, axis=3) if images.shape[3] == 1 else images


def rgb_to_grey(images: np.ndarray) -> np.ndarray:
    """[N, H, W, 3] -> [N, H, W, 1] with BT.601 luma."""
    if images.shape[3] == 1:
        return images
    luma = images.astype(np.float64) @ _LUMA
    return np.clip(np.round(luma), 0, 255).astype(np.uint8)[..., None]


def convert_channels(images: np.ndarray, channels: int | None) -> np.ndarray:
    """Grey <-> RGB so that the result has ``channels`` (1 or 3); ``None`` keeps the input."""
    if channels is None or images.shape[3] == channels:
        return images
    if channels == 3:
        return grey_to_rgb(images)
    if channels == 1:
        return rgb_to_grey(images)
    raise DataError(f"channels must be 1 or 3, got {channels}")


def centre_crop(images: np.ndarray, height: int, width: int | None = None) -> np.ndarray:
    """The central ``height`` x ``width`` window of every image."""
    width = height if width is None else width
    _, full_height, full_width, _ = images.shape
    if height > full_height or width > full_width:
        raise DataError(f"cannot crop {height}x{width} from {full_height}x{full_width} images")
    top = (full_height - height) // 2
    left = (full_width - width) // 2
    return images[:, top : top + height, left : left + width]


def centre_square(images: np.ndarray) -> np.ndarray:
    """Centre crop to a square whose side is the shorter image side."""
    side = min(images.shape[1], images.shape[2])
    return centre_crop(images, side, side)


def resize_image(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize one uint8 [H, W, C] image with PIL (antialiased bilinear when shrinking, bicubic when growing)."""
    if image.shape[0] == height and image.shape[1] == width:
        return image
    growing = height > image.shape[0] or width > image.shape[1]
    method = Image.Resampling.BICUBIC if growing else Image.Resampling.BILINEAR
    channels = image.shape[2]
    pil = Image.fromarray(image[..., 0] if channels == 1 else image)
    out = np.asarray(pil.resize((width, height), method))
    return out[..., None] if channels == 1 else out


def resize(images: np.ndarray, size: int | tuple[int, int]) -> np.ndarray:
    """Resize every image to ``size`` (an int for square, or (H, W))."""
    height, width = (size, size) if isinstance(size, int) else size
    if images.shape[1] == height and images.shape[2] == width:
        return images
    out = np.empty((len(images), height, width, images.shape[3]), dtype=np.uint8)
    for i, image in enumerate(images):
        out[i] = resize_image(image, height, width)
    return out


def fit_square(images: np.ndarray, size: int) -> np.ndarray:
    """Centre crop non-square images to a square, then resize to ``size`` x ``size``."""
    if images.shape[1] != images.shape[2]:
        images = centre_square(images)
    return resize(images, size)


def prepare(dataset: ImageDataset, image_size: int | None = None, channels: int | None = None) -> ImageDataset:
    """``dataset`` at ``image_size`` x ``image_size`` (centre-cropped to square first) with ``channels``."""
    if channels is not None and channels not in (1, 3):
        raise DataError(f"channels must be 1 or 3, got {channels}")
    if image_size is not None and int(image_size) < 1:
        raise DataError(f"image_size must be positive, got {image_size}")
    images = dataset.images
    if image_size is not None:
        images = fit_square(images, int(image_size))
    images = convert_channels(images, channels)
    if images is dataset.images:
        return dataset
    return ImageDataset(images, dataset.labels, dataset.num_classes, dataset.name, dataset.class_names)


def stratified_quotas(labels: np.ndarray, num_classes: int, size: int, min_per_class: int = 0) -> np.ndarray:
    """How many of ``size`` examples to take from each class, proportional to the class counts.

    Largest-remainder rounding, so the quotas sum exactly to ``size`` and differ from the exact
    proportion by less than one; ties go to the lower class index, so the result is deterministic.
    ``min_per_class`` then lifts small classes (as far as they have examples), taking the
    difference from the largest quotas, so a small subset still holds every class.
    """
    counts = np.bincount(labels, minlength=num_classes).astype(np.int64)
    total = int(counts.sum())
    if not 0 <= size <= total:
        raise DataError(f"cannot take {size} examples from a dataset of {total}")
    exact = counts * (size / total) if total else np.zeros(num_classes)
    quotas = np.floor(exact).astype(np.int64)
    order = np.lexsort((np.arange(num_classes), -(exact - quotas)))
    for cls in order[: size - int(quotas.sum())]:
        quotas[cls] += 1
    quotas = np.minimum(quotas, counts)
    for cls in np.flatnonzero(quotas < np.minimum(min_per_class, counts)):
        need = int(min(min_per_class, counts[cls]) - quotas[cls])
        for _ in range(need):
            donor = int(np.argmax(quotas))
            if quotas[donor] <= min_per_class:
                break  # nothing left to give: size is too small for the minimum
            quotas[donor] -= 1
            quotas[cls] += 1
    return quotas


def stratified_split(
    labels: np.ndarray, num_classes: int, holdout: int, seed: int = 0, min_per_class: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into (keep, holdout) with ``holdout`` examples drawn per class at random.

    Each class gives its quota (see :func:`stratified_quotas`) from a fixed-seed permutation of
    its own indices. Both index arrays are returned sorted, so the order of the data is kept.
    """
    labels = np.asarray(labels, dtype=np.int64)
    quotas = stratified_quotas(labels, num_classes, holdout, min_per_class)
    rng = np.random.default_rng(seed)
    taken = np.zeros(len(labels), dtype=bool)
    for cls in range(num_classes):
        members = np.flatnonzero(labels == cls)
        taken[rng.permutation(members)[: quotas[cls]]] = True
    return np.flatnonzero(~taken), np.flatnonzero(taken)


def stratified_subset(labels: np.ndarray, num_classes: int, size: int, seed: int = 0) -> np.ndarray:
    """Sorted indices of a class-stratified random subset of ``size`` examples, every present class kept."""
    return stratified_split(labels, num_classes, size, seed, min_per_class=1)[1]


def resolve_holdout(size: int | float, total: int) -> int:
    """A hold-out size given as a count (int) or a fraction of ``total`` (float in (0, 1))."""
    if isinstance(size, float) and not size.is_integer():
        if not 0.0 < size < 1.0:
            raise DataError(f"a fractional split size must lie in (0, 1), got {size}")
        return max(1, int(round(size * total)))
    count = int(size)
    if not 0 < count < total:
        raise DataError(f"split size {count} must lie between 1 and {total - 1} (dataset of {total})")
    return count
