"""The size N of a private train split and the image shape, from metadata alone (no pixel is read).

N sets the DP-SGD sample rate and the number of steps of an epoch budget, so a privacy plan needs
it before any private data is touched (``dpsynth run --dry-run``). dpsynth treats N as public
(docs/privacy.md, "What is treated as public"); here it comes from the registry's per-split counts,
or for own data on disk from the record count that the format states without its pixels (an
``.npz`` array's header, the number of image files of a class-folder tree), and the split protocol
of :func:`dpsynth.data.loading.load_private`, never from data values. The image shape comes from
the config, the registry, an ``.npz`` header or one image file's header.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from dpsynth.data.loading import DEFAULT_TEST_SIZE, resolve_val_size, split_masks
from dpsynth.data.registry import parse_spec, resolve
from dpsynth.data.section import DataSection, as_data_section
from dpsynth.errors import DataError


def planned_train_size(data: DataSection | Mapping[str, Any]) -> int:
    """The number of private train examples a run with the ``data`` config section trains on.

    Each record's split is a draw keyed on its own content (:mod:`dpsynth.data.splits`), so without
    reading the records this is exact only where no hold-out or ``max_train`` is drawn; otherwise it is
    a stand-in of the same binomial law, and the run itself plans on the size it loads. Raises
    DataError for a dataset whose size is not registered (a path, or a generated dataset with a
    ``size`` option): then pass the size explicitly (``--num-examples``).
    """
    data = as_data_section(data)
    spec = data.private
    _, splits, options, entry = resolve(spec)
    if entry is None:
        counted = _own_records(spec)
        if counted is None or options:
            raise DataError(
                f"the train size of {parse_spec(spec)[0]!r} is not registered; "
                f"give it explicitly (--num-examples N) to plan without reading the data"
            )
        documented, splits = counted
    elif "train" not in entry.info.splits or options:
        raise DataError(
            f"the train size of {parse_spec(spec)[0]!r} is not registered; "
            f"give it explicitly (--num-examples N) to plan without reading the data"
        )
    else:
        documented = int(entry.info.splits["train"])
    keep, _ = split_masks(
        documented,
        own_val=data.val_size is None and "val" in splits,
        own_test="test" in splits,
        documented=documented if entry is not None else None,
        val_size=resolve_val_size(data.val_size, entry),
        test_size=DEFAULT_TEST_SIZE,
        max_train=data.max_train,
        split_seed=data.split_seed,
        num_classes=entry.info.classes if entry is not None else (data.num_classes or 1),
        source=str(spec),
    )
    return int(keep.sum())


#: the image arrays of an .npz, in the order its reader looks for them
_NPZ_IMAGE_KEYS = ("train_images", "images", "x")


def _own_records(spec: str) -> tuple[int, tuple[str, ...]] | None:
    """(train records, splits) of own data on disk, from headers and file counts; None for other formats."""
    from dpsynth.data.readers import detect_format, flat, folder

    path = Path(parse_spec(spec)[0]).expanduser()
    fmt = detect_format(path)
    if fmt == "flat":
        return len(flat.listed_files(path)), ("train",)
    if fmt == "folder":
        root = folder.train_root(path)
        count = sum(len(_image_files(root / name)) for name in folder.class_names_of(path))
        return count, tuple(folder.splits(path))
    if fmt == "npz":
        keys, shape = _npz_image_header(path)
        if "split" in keys:
            return None  # the split codes are an array to read: plan with --num-examples
        splits = tuple(s for s in ("train", "val", "test") if f"{s}_images" in keys) or ("train",)
        return shape[0], splits
    return None


def _image_files(folder_path: Path) -> list[Path]:
    from dpsynth.data.readers.common import image_files

    return image_files(folder_path) if folder_path.is_dir() else []


def _npz_image_header(path: Path) -> tuple[list[str], tuple[int, ...]]:
    """(array names, shape of the train image array) of an .npz, from the zip listing and one .npy header."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [name.removesuffix(".npy") for name in archive.namelist()]
            key = next((k for k in _NPZ_IMAGE_KEYS if k in names), None)
            if key is None:
                raise DataError(f"{path}: no 'images' array (found {', '.join(sorted(names)) or 'nothing'})")
            with archive.open(f"{key}.npy") as member:
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, _, _ = read_header(member)
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise DataError(f"{path}: not an .npz archive of images and labels ({type(err).__name__})") from None
    return names, tuple(int(v) for v in shape)


def planned_image_shape(data: DataSection | Mapping[str, Any]) -> tuple[int, int, int]:
    """(C, H, W) a run's private images will have, from the config, the registry or file headers.

    ``data.image_size`` and ``data.channels`` win; otherwise a registered dataset's documented shape, an
    ``.npz`` header (NHW, NHWC or NCHW) or the first image file's header (size and mode, no pixel).
    """
    data = as_data_section(data)
    channels, side = _stored_shape(data.private)
    return (data.channels or channels, data.image_size or side, data.image_size or side)


def planned_num_classes(data: DataSection | Mapping[str, Any]) -> int | None:
    """K a run's private dataset declares, from the config (``num_classes``, ``class_names``) or the registry's
    metadata, never from the labels present; None when only the files know it (own data without those keys)."""
    data = as_data_section(data)
    if data.num_classes is not None:
        return int(data.num_classes)
    if data.class_names is not None:
        return len(data.class_names)
    try:
        entry = resolve(data.private)[3]
    except DataError:
        return None
    return None if entry is None else int(entry.info.classes)


def _first_tree_image(path: Path) -> Path:
    from dpsynth.data.readers import folder

    root = folder.train_root(path)
    return next(f for name in folder.class_names_of(path) for f in _image_files(root / name))


def _stored_shape(spec: str) -> tuple[int, int]:
    """(channels, side) of the stored images of ``spec``."""
    from dpsynth.data.readers import detect_format, flat
    from dpsynth.data.readers.common import GREY_MODES, image_mode

    _, _, _, entry = resolve(spec)
    if entry is not None:
        height, _, channels = entry.info.shape
        return channels, height
    path = Path(parse_spec(spec)[0]).expanduser()
    fmt = detect_format(path)
    if fmt == "npz":
        _, shape = _npz_image_header(path)
        if len(shape) == 3:
            return 1, shape[1]
        return (shape[1], shape[2]) if shape[-1] not in (1, 3) and shape[1] in (1, 3) else (shape[3], shape[1])
    if fmt in ("folder", "flat"):
        first = flat.listed_files(path)[0] if fmt == "flat" else _first_tree_image(path)
        with Image.open(first) as image:  # the header only: mode and size, no pixel decoded
            height = image.size[1]
        return (1 if image_mode(first) in GREY_MODES else 3), height
    raise DataError(f"{path}: the image shape is not known without reading the data; set data.image_size")
