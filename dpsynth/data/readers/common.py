"""Helpers shared by the format readers: paths, gzip, image files, class bookkeeping."""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from dpsynth.data.dataset import ImageDataset
from dpsynth.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}
_GZIP_MAGIC = b"\x1f\x8b"
_QUOTED_BYTES = re.compile(r"""\bb(['"]).*?(?<!\\)\1""")  # a bytes literal in an exception's text


def require_path(path: str | Path, what: str = "dataset path") -> Path:
    """``path`` as a Path, or DataError if nothing is there."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{what} not found: {path}")
    return path


def read_bytes(path: Path) -> bytes:
    """The content of ``path``, gunzipped when it starts with the gzip magic (whatever its name)."""
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if raw[:2] == _GZIP_MAGIC else raw
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"cannot read {path}: {reason(err)}") from None


def reason(err: BaseException) -> str:
    """Why reading failed, without the exception's own text where that may quote the file's content.

    A corrupt gzip stream reports the bytes it found or the checksums it computed: it is named as such.
    An operating-system error gives its description ("Permission denied"), any other error its type.
    """
    if isinstance(err, (zlib.error, gzip.BadGzipFile)):
        return "corrupt gzip data"
    if isinstance(err, EOFError):
        return "the file ends early (truncated)"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return type(err).__name__


def first_line(err: BaseException) -> str:
    """A decoder's message, first line only, with any bytes it quotes from the file left out.

    PIL and numpy name the bytes they stopped at ("broken PNG file (chunk b'...')", "expected
    b'\\x93NUMPY', got b'...'"): bytes of a private file, which an error message must not carry.
    """
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return _QUOTED_BYTES.sub("<bytes>", text)


def open_image(path: Path) -> Image.Image:
    """Open and fully decode an image file; a corrupt or non-image file raises DataError."""
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy() if image.mode != "P" else image.convert("RGBA")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise DataError(f"cannot read image {path}: {first_line(err)}") from None


def crop_box(width: int, height: int, crop: int | None) -> tuple[int, int, int, int]:
    """The centred ``crop`` x ``crop`` box (or the largest centred square when ``crop`` is None)."""
    side = min(width, height) if crop is None else min(crop, width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return (left, top, left + side, top + side)


def image_to_array(
    image: Image.Image, grey: bool, image_size: int | None, crop: int | None = None, square: bool = False
) -> np.ndarray:
    """uint8 [H, W, C] from a PIL image: to "L" or "RGB", optionally centre-cropped and resized.

    When ``image_size`` is set, a non-square image is centre-cropped to a square first (or to
    ``crop`` when given), so that faces and patches keep their aspect ratio.
    """
    image = image.convert("L" if grey else "RGB")
    if crop is not None or (image_size is not None and (square or image.width != image.height)):
        image = image.crop(crop_box(image.width, image.height, crop))
    if image_size is not None and (image.width, image.height) != (image_size, image_size):
        shrinking = image.width >= image_size
        method = Image.Resampling.BILINEAR if shrinking else Image.Resampling.BICUBIC
        image = image.resize((image_size, image_size), method)
    array = np.asarray(image, dtype=np.uint8)
    return array[..., None] if grey else array


def image_mode(path: Path) -> str:
    """The PIL mode of an image file, from its header only."""
    try:
        with Image.open(path) as image:
            return image.mode
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise DataError(f"cannot read image {path}: {first_line(err)}") from None


def load_image_files(
    paths: Sequence[Path], image_size: int | None = None, grey: bool | None = None, crop: int | None = None
) -> np.ndarray:
    """uint8 [N, H, W, C] from image files; grey when every file is grey (unless ``grey`` is given).

    Images are decoded one at a time into one preallocated array, so memory holds the result
    only (202,599 CelebA faces at 64 x 64 are 2.5 GB; as decoded PIL images they would be 23 GB).
    """
    if not paths:
        return np.zeros((0, 1, 1, 1), dtype=np.uint8)
    if grey is None:
        grey = all(image_mode(path) in GREY_MODES for path in paths)
    first = image_to_array(open_image(paths[0]), grey, image_size, crop)
    out = np.empty((len(paths), *first.shape), dtype=np.uint8)
    out[0] = first
    for i, path in enumerate(paths[1:], start=1):
        array = image_to_array(open_image(path), grey, image_size, crop)
        if array.shape != first.shape:  # the files, not their sizes: a record's size is its own
            raise DataError(
                f"images differ in size: {path} and {paths[0]}; set data.image_size (e.g. --set "
                "data.image_size=32) to centre-crop and resize every image to one size"
            )
        out[i] = array
    return out


def is_image_file(path: Path) -> bool:
    """Whether ``path`` is a file the folder readers read: not hidden, with an image suffix."""
    return path.is_file() and not path.name.startswith(".") and path.suffix.lower() in IMAGE_SUFFIXES


def image_files(folder: Path) -> list[Path]:
    """Image files directly inside ``folder``, sorted by name (hidden files skipped)."""
    return sorted(p for p in folder.iterdir() if is_image_file(p))


def dataset(
    images: np.ndarray,
    labels: Iterable[int] | np.ndarray,
    name: str,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
) -> ImageDataset:
    """An ImageDataset whose class count defaults to the class names, then to max label + 1."""
    labels = np.asarray(labels)
    if num_classes is None:
        if class_names is not None:
            num_classes = len(class_names)
        else:
            num_classes = int(labels.max()) + 1 if labels.size else 1
    return ImageDataset(images, labels, num_classes, name, list(class_names) if class_names else None)
