"""Preprocessing on uint8 NHWC arrays: declared-range scaling, resize, centre crop, grey/RGB conversion.

Only numpy and PIL are used here (torch only in :mod:`dpsynth.data.tensors`), so that the same
code prepares private data, public data and synthetic samples. The class-stratified splits below
read labels, so they serve public data and fixed published splits only (digits8x8, mnist10k's
build, public subsets); private hold-outs are record-wise (:mod:`dpsynth.data.splits`).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from dpsynth.data.dataset import ImageDataset
from dpsynth.data.tensors import (  # noqa: F401 - re-exported: callers import the scaling from here
    from_unit_range,
    tensor_to_uint8,
    to_unit_range,
    uint8_to_tensor,
)
from dpsynth.errors import DataError

# ITU-R BT.601 luma weights, the ones PIL uses for "RGB" -> "L".
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)


def check_pixel_range(pixel_range: object) -> tuple[float, float]:
    """A declared pixel range ``[low, high]`` (e.g. [0, 1], [-1, 1], [0, 255]) as two floats, low < high."""
    try:
        low, high = (float(v) for v in pixel_range)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise DataError(
            f"pixel_range must be [low, high], e.g. [0, 1], [-1, 1] or [0, 255]; got {pixel_range!r}"
        ) from None
    if not (np.isfinite(low) and np.isfinite(high) and low < high):
        raise DataError(f"pixel_range must be two finite numbers with low < high, got {pixel_range!r}")
    return low, high


def count_outside(values: np.ndarray, low: float, high: float) -> int:
    """How many values are NaN, infinite, or outside [low, high]."""
    values = np.asarray(values)
    inside = (values >= low) & (values <= high)  # False for NaN
    return int(values.size - np.count_nonzero(inside))


#: the non-finite kinds of pixel value, each with the numpy test that finds them
_NON_FINITE = (("NaN", "numpy.isnan", np.isnan), ("infinite", "numpy.isinf", np.isinf))


def range_problem(values: np.ndarray, low: float, high: float) -> str | None:
    """What is wrong with pixel ``values`` against ``[low, high]``, or None: the kinds of problem and the fix.

    NaN, infinities and finite values outside the range are told apart. The answer never quotes a
    value, the extremes or how many values are wrong: those are computed from private records, and an
    error message reaches the console and the bench's log (docs/privacy.md); the user can count them
    on their own copy with the numpy test the message names.
    """
    values = np.asarray(values)
    floating = values.dtype.kind in "fc"
    found = [(kind, name) for kind, name, test in _NON_FINITE if floating and test(values).any()]
    problems = []
    if found:
        kinds, tests = " and ".join(kind for kind, _ in found), " / ".join(name for _, name in found)
        problems.append(f"{kinds} pixel values (replace them or drop their images; {tests} finds them)")
    with np.errstate(invalid="ignore"):  # NaN compares False: it is outside no range, it is NaN
        outside = (values < low) | (values > high)
    if (outside & np.isfinite(values) if floating else outside).any():
        problems.append(
            f"pixel values outside the declared pixel_range [{low:g}, {high:g}] (declare the range the data "
            "uses in data.pixel_range, e.g. [0, 1], [-1, 1] or [0, 255], or clip the values to it)"
        )
    return "; ".join(problems) or None


def float_to_uint8(images: np.ndarray, pixel_range: object) -> np.ndarray:
    """Float images in the declared ``pixel_range`` to uint8 (low -> 0, high -> 255).

    The range is declared, never inferred from the values: an inferred range would let one record
    change the scaling of every other pixel. A value outside it (or NaN, or infinite) is refused with
    the kind of problem and its fix, never the value or a count (:func:`range_problem`).
    """
    low, high = check_pixel_range(pixel_range)
    images = np.asarray(images, dtype=np.float64)
    problem = range_problem(images, low, high)
    if problem:
        raise DataError(problem)
    return np.clip(np.round((images - low) * (255.0 / (high - low))), 0, 255).astype(np.uint8)


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
    stored_channels, height, width = dataset.image_shape
    if (image_size is None or height == width == int(image_size)) and channels in (None, stored_channels):
        return dataset  # nothing to do: a memory-mapped dataset is not read
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
