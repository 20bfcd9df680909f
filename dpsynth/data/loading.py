"""What a run asks for: the private train/val/test splits and the public dataset.

Split protocol (after DPImageBench, with a record-wise hold-out): generators see only ``train``;
``val`` is the dataset's own validation split when it has one, otherwise a hold-out carved from
train (MNIST family and CIFAR 5,000 of the documented size, others 10 %); ``test`` is the official
test split, or a 10 % hold-out of train. Nothing here is derived from private values:

- each record's split is a keyed hash of (its content key, ``split_seed``) (:mod:`dpsynth.data.splits`),
  taken on the records as the reader decodes them, before any resize or channel conversion: adding,
  removing or reordering records leaves every other record where it was, and duplicates share a split;
- the class count is declared: ``num_classes``, the registered dataset, or the file's own metadata
  (class names, a class count, a mapping file, class folders), never ``labels.max() + 1``;
- channels come from the format or the array's shape, and image folders need ``channels``;
- float pixels are scaled from a declared ``pixel_range``, never from the values' min and max.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.data import readers
from dpsynth.data.dataset import ImageDataset, PrivateSplits
from dpsynth.data.registry import Entry, accepted_options, load_dataset, parse_spec, resolve
from dpsynth.data.section import DataSection, as_data_section
from dpsynth.data.splits import as_fraction, holdout_mask, stand_in_keys
from dpsynth.data.transforms import check_pixel_range, prepare, stratified_subset
from dpsynth.errors import DataError

#: the one wording of the fix for a missing class declaration, for files and in-memory arrays alike
DECLARE_CLASSES = (
    "set data.num_classes (CLI: --set data.num_classes=K; Python: Synthesizer.fit(..., num_classes=K)); "
    "the class count is never read off the private labels"
)
DEFAULT_TEST_SIZE = 0.1  # carved from train only when a dataset has no test split
DEFAULT_VAL_SIZE = 0.1  # carved from train when a dataset on disk has no val split
UINT8_RANGE = (0.0, 255.0)


def _reader_options(spec: str | Path, image_size: int | None, options: dict[str, Any]) -> dict[str, Any]:
    """Pass ``image_size`` to readers that resize while reading (CelebA, folders, glyphs) to save memory."""
    _, _, spec_options, _ = resolve(spec)
    if image_size is None or "image_size" in options or "image_size" in spec_options:
        return dict(options)
    if _takes_option(spec, "image_size"):
        return {**options, "image_size": int(image_size)}
    return dict(options)


def _takes_option(spec: str | Path, option: str) -> bool:
    loader, _, _, _ = resolve(spec)
    accepted = accepted_options(loader)
    if accepted is not None:
        return option in accepted
    from dpsynth.data.readers import FORMATS, detect_format

    fmt = detect_format(Path(parse_spec(spec)[0]).expanduser())
    module = readers.npz if fmt == "npz-dir" else FORMATS.get(fmt)
    return module is not None and option in inspect.signature(module.read).parameters


def _declared_options(
    spec: str | Path,
    entry: Entry | None,
    channels: int | None,
    pixel_range: Any,
    num_classes: int | None,
    class_names: list[str] | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    """Reader options that carry the declared pixel range, colour mode and class names (a labels file names
    its classes); refuse what only data could decide."""
    options = dict(options)
    if pixel_range is not None:
        if _takes_option(spec, "pixel_range"):
            options["pixel_range"] = list(check_pixel_range(pixel_range))
        elif check_pixel_range(pixel_range) != UINT8_RANGE:
            raise DataError(f"{spec}: pixels are 0..255 by format; pixel_range {list(pixel_range)} does not apply")
    if entry is not None:
        return options  # registered datasets declare classes and channels in their loaders
    path = Path(parse_spec(spec)[0]).expanduser()
    if readers.detected_channels(path) and "grey" not in options:
        if channels is None:
            raise DataError(
                f"{path}: an image folder needs data.channels (1 or 3); grey or colour is not "
                "detected from private files"
            )
        options["grey"] = int(channels) == 1
    if class_names is not None and _takes_option(spec, "class_names"):
        options["class_names"] = list(class_names)
    if num_classes is None and not readers.declares_classes(path, **options):
        raise DataError(
            f"{path}: the number of classes is not declared ({readers.undeclared_classes_hint(path)}); "
            f"{DECLARE_CLASSES}"
        )
    return options


def _with_classes(dataset: ImageDataset, num_classes: int, class_names: list[str] | None) -> ImageDataset:
    if dataset.num_classes == num_classes and dataset.class_names == class_names:
        return dataset
    return ImageDataset(dataset.images, dataset.labels, num_classes, dataset.name, class_names)


def _declared_classes(
    train: ImageDataset, num_classes: int | None, declared_by_source: bool, spec: str | Path
) -> tuple[int, list[str] | None]:
    """The class count and names: ``num_classes`` when given (it must match what the source declares)."""
    if num_classes is None:
        return train.num_classes, train.class_names
    if int(num_classes) < 1:
        raise DataError(f"num_classes must be at least 1, got {num_classes}")
    if declared_by_source and train.num_classes != int(num_classes):
        raise DataError(f"data.num_classes={num_classes} but {spec} declares {train.num_classes} classes")
    names = train.class_names if train.class_names and len(train.class_names) == int(num_classes) else None
    return int(num_classes), names


def _named(dataset: ImageDataset, split: str, base: str) -> ImageDataset:
    return dataset.renamed(f"{base}-{split}")  # a memory-mapped split stays unread


#: the fix for an empty hold-out: val has a config key, test (carved only from a set without one) has not
_EMPTY_HOLDOUT_FIX = {
    "val": "give a larger data.val_size (a fraction, e.g. 0.2) or more records",
    "test": "give more records (a few hundred at least) or a file with its own test split",
}


def _carve(keys: np.ndarray, fraction: float, split_seed: int, purpose: str) -> np.ndarray:
    mask = holdout_mask(keys, fraction, split_seed, purpose)
    if not mask.any():  # N is public (docs/privacy.md), so it may be named
        raise DataError(
            f"the {purpose} hold-out drew none of the {len(keys)} records (each is held out with probability "
            f"{fraction:.3g}); {_EMPTY_HOLDOUT_FIX[purpose]}"
        )
    return mask


def release_freed_heap() -> None:
    """Hand the heap that the split's temporaries freed back to the operating system (glibc's
    ``malloc_trim``; nothing elsewhere).

    Why: the split of a large memory-mapped set makes a few arrays of 8 bytes a record (keys, draws,
    index lists). After glibc frees the first of them it raises its mmap threshold to that size, so the
    later ones come from the heap and stay resident once freed: 37 MiB of a 2M-record set's 67 MiB of
    growth after loading, none of it live (experiments/memmap_data.py). Later allocations could reuse it,
    but a run's memory would then grow with N for no record it holds. Called once the loader's frame,
    which holds the whole set's keys and masks, is gone (:func:`_then_release_freed_heap`).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return
    trim(0)


def _then_release_freed_heap(load: Callable[..., PrivateSplits]) -> Callable[..., PrivateSplits]:
    @functools.wraps(load)
    def loaded(*args: Any, **kwargs: Any) -> PrivateSplits:
        splits = load(*args, **kwargs)
        if splits.train.memory_mapped:
            release_freed_heap()
        return splits

    return loaded


@_then_release_freed_heap
def load_private(
    spec: str | Path,
    image_size: int | None = None,
    channels: int | None = None,
    val_size: float | None = None,
    split_seed: int = 0,
    max_train: float | None = None,
    test_size: float = DEFAULT_TEST_SIZE,
    num_classes: int | None = None,
    pixel_range: list[float] | tuple[float, float] | None = None,
    colour_to_grey: bool = False,
    class_names: list[str] | None = None,
    **options: Any,
) -> PrivateSplits:
    """The private splits of ``spec``, resized to ``image_size`` and converted to ``channels``.

    Args:
        val_size: ``None`` uses the dataset's own val split, or else its default hold-out (5,000 of
            the documented size for MNIST-family and CIFAR, 10 % otherwise); a fraction, or a count
            of a registered dataset's documented size, always carves val from train.
        max_train: keep this many training records (a count, registered datasets only) or this
            fraction of them, chosen by keyed draws of (content key, split_seed) (smoke runs).
        test_size: hold-out carved from train when the dataset has no test split.
        num_classes: the class count when the source does not declare one (labels must lie below it).
        pixel_range: the range of float pixels in an ``.npz`` file ([0, 1], [-1, 1], [0, 255], ...).
        colour_to_grey: with ``channels=1``, turn stored colour images into grey; without it that is an
            error (:func:`check_channels`).
        class_names: names of the classes in label order (``dataset.yaml``'s ``classes``), for a source that
            names none; they set ``num_classes`` when that is not given.
        options: reader options (``size``, ``attribute``, ``root``, ...).
    """
    if class_names is not None and num_classes is None:
        num_classes = len(class_names)
    _, splits, _, entry = resolve(spec)
    options = _reader_options(spec, image_size, options)
    options = _declared_options(spec, entry, channels, pixel_range, num_classes, class_names, options)
    declared_by_source = entry is not None or readers.declares_classes(
        Path(parse_spec(spec)[0]).expanduser(), **options
    )
    base = entry.info.name if entry else Path(str(spec)).name
    documented = entry.info.splits.get("train") if entry else None
    train = load_dataset(spec, "train", **options)
    check_records(train, str(spec))
    check_channels(train, channels, colour_to_grey, str(spec))
    classes, names = _declared_classes(train, num_classes, declared_by_source, spec)
    names = names or (list(class_names) if class_names is not None else None)
    train = _with_classes(train, classes, names)
    own_val = val_size is None and "val" in splits
    # Keys of the records as stored and decoded: before prepare() resizes them, so a record keeps its
    # split whatever image_size or channels a run asks for (readers that resize while reading, to
    # save memory, hand over records already at image_size: their keys are those of the resized ones).
    keep, carved = split_masks(
        train.record_keys,  # a shard's cached keys; in-memory records hashed a block at a time
        own_val=own_val,
        own_test="test" in splits,
        documented=documented,
        val_size=resolve_val_size(val_size, entry),
        test_size=test_size,
        max_train=max_train,
        split_seed=split_seed,
        num_classes=classes,
        source=str(spec),
    )
    val = (
        _with_classes(load_dataset(spec, "val", **options), classes, names)
        if own_val
        else train.subset(np.flatnonzero(carved["val"]))
    )
    test = (
        train.subset(np.flatnonzero(carved["test"]))
        if "test" in carved
        else _with_classes(load_dataset(spec, "test", **options), classes, names)
    )
    # A declared class with no training record is not refused: whether a run exists must not depend on a
    # per-class count (docs/privacy.md, "Refusals that depend on the data"); the class trains like any other.
    train = train.subset(np.flatnonzero(keep))
    parts = {"train": train, "val": val, "test": test}
    prepared = {k: _named(prepare(ds, image_size, channels), k, base) for k, ds in parts.items()}
    return PrivateSplits(prepared["train"], prepared["val"], prepared["test"])


def check_records(train: ImageDataset, source: str) -> None:
    """DataError when the private source holds no training record at all (before any split is drawn)."""
    if not len(train):
        raise DataError(
            f"{source} holds no images (0 records); point data.private at the file or folder that holds them"
        )


def check_channels(train: ImageDataset, channels: int | None, colour_to_grey: bool, source: str) -> None:
    """Refuse to drop colour that the source stores, unless ``colour_to_grey`` asks for it.

    ``data.channels: 1`` on colour images would release grey images without a word, and a user who
    declares "1" as they must for an image folder may not mean a conversion: so turning colour into
    grey is done only when asked (``data.colour_to_grey: true``). Grey to colour repeats the channel
    and loses nothing, so it needs no flag. Image folders are read straight at ``data.channels`` (their
    files may mix modes), so the check never fires for them. The stored channel count is a property of
    the format or the whole array's shape, not of a record's values.
    """
    stored = train.image_shape[0]
    if channels == 1 and stored == 3 and not colour_to_grey:
        raise DataError(
            f"{source}: the images are colour (3 channels) but data.channels=1 would release grey images; set "
            "data.channels=3 (or null) to keep colour, or data.colour_to_grey=true to convert them to grey"
        )


def resolve_val_size(val_size: float | None, entry: Entry | None) -> float:
    """The val hold-out a config asks for, else the registered dataset's convention, else 10 %."""
    if val_size is not None:
        return val_size
    return entry.val_size if entry else DEFAULT_VAL_SIZE


def split_masks(
    records: np.ndarray | int,
    *,
    own_val: bool,
    own_test: bool,
    documented: int | None,
    val_size: float,
    test_size: float,
    max_train: float | None,
    split_seed: int,
    num_classes: int,
    source: str = "a dataset on disk",
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(train mask, carved hold-out masks) of the records whose content keys are ``records``.

    Each record's hold-outs depend on its own key and the config only (:mod:`dpsynth.data.splits`).
    ``records`` may also be a bare count, for callers that plan before reading any record
    (:func:`dpsynth.data.sizes.planned_train_size`): :func:`~dpsynth.data.splits.stand_in_keys` then
    give masks whose sizes follow the same law, exact where nothing is carved by a draw (the
    dataset's own val and test and no ``max_train``), a stand-in otherwise. ``source`` names the data
    in error messages.
    """
    keys = stand_in_keys(records) if isinstance(records, (int, np.integer)) else records
    count = len(keys)
    nominal = documented
    kept_share = 1.0  # the expected fraction of records no hold-out takes
    held = np.zeros(count, dtype=bool)
    carved: dict[str, np.ndarray] = {}
    if not own_test:
        p_test = as_fraction(test_size, nominal, "test_size", source)
        carved["test"] = _carve(keys, p_test, split_seed, "test")
        held |= carved["test"]
        nominal = None if nominal is None else round(nominal * (1 - p_test))
        kept_share *= 1 - p_test
    if not own_val:
        p_val = as_fraction(val_size, nominal, "data.val_size", source)
        carved["val"] = _carve(keys, p_val, split_seed, "val") & ~held
        held |= carved["val"]
        kept_share *= 1 - p_val
    keep = ~held
    if max_train is not None:
        expected = None if documented is None else documented * kept_share
        keep &= _max_train_mask(keys, max_train, expected, num_classes, split_seed, source)
    return keep, carved


def _max_train_mask(
    keys: np.ndarray,
    max_train: float,
    expected_candidates: float | None,
    num_classes: int,
    split_seed: int,
    source: str,
) -> np.ndarray:
    """The records ``max_train`` keeps: each whose own content-keyed draw falls below a fraction.

    A fraction is used as it is. A count needs the registered dataset's documented size and means an
    *expected* count: the fraction ``count / expected_candidates`` (the documented size less the
    expected hold-outs), so the kept number is binomial around it. Why not exactly ``count`` records
    (the smallest draws)? A fixed-size sample is not add/remove-stable: one added record with a small
    draw would push a kept record out, so neighbouring datasets would give training sets that differ
    in two records, and the add/remove guarantee of the training mechanisms would not carry over.
    """
    if isinstance(max_train, (float, np.floating)) and not float(max_train).is_integer():
        return holdout_mask(keys, as_fraction(max_train, None, "data.max_train"), split_seed, "max_train")
    count = int(max_train)
    if expected_candidates is None:
        raise DataError(
            f"data.max_train={count} is a count, but {source} has no documented size to take an expected count "
            "from; give a fraction in (0, 1) (e.g. data.max_train=0.5) or null to train on every record"
        )
    if count < num_classes:
        raise DataError(
            f"data.max_train={count} is smaller than the {num_classes} classes; give a larger count, a fraction, "
            "or null to train on every record"
        )
    if count > round(expected_candidates):  # documented metadata only: no record is counted
        raise DataError(
            f"data.max_train={count} is more than the {round(expected_candidates)} train records {source} is "
            "documented to hold; give a smaller count, a fraction, or null to train on every record"
        )
    return holdout_mask(keys, min(1.0, count / expected_candidates), split_seed, "max_train")


def load_public(
    spec: str | Path,
    image_size: int | None = None,
    channels: int | None = None,
    max_size: int | None = None,
    seed: int = 0,
    **options: Any,
) -> ImageDataset:
    """The public dataset (its train split): free to use, never charged to the privacy ledger.

    ``max_size`` caps the number of examples: generated datasets produce exactly that many,
    others keep a class-stratified subset drawn with ``seed``.
    """
    loader, _, spec_options, _ = resolve(spec)
    options = _reader_options(spec, image_size, options)
    accepted = accepted_options(loader)
    generated = accepted is not None and "size" in accepted
    if max_size is not None and generated and "size" not in options and "size" not in spec_options:
        options["size"] = int(max_size)
    public = load_dataset(spec, "train", **options)
    if max_size is not None and int(max_size) < len(public):
        if int(max_size) < 1:
            raise DataError(f"max_size must be positive, got {max_size}")
        public = public.subset(stratified_subset(public.labels, public.num_classes, int(max_size), seed))
    return prepare(public, image_size, channels)


def image_digests(images: np.ndarray) -> set[bytes]:
    """One 128-bit BLAKE2b digest per image (its shape and bytes): exact duplicates share a digest."""
    return set(_digest_list(images))


def count_overlap(private: PrivateSplits, public: ImageDataset) -> int:
    """How many private records (train, val and test) are pixel-identical to some public image.

    Both sides are compared after preprocessing (the public set is loaded at the private size and
    channels), so a resized copy of a private image counts. One hash per image: linear time.
    """
    public_digests = image_digests(public.images)
    return sum(
        sum(1 for images, _ in split.chunks() for digest in _digest_list(images) if digest in public_digests)
        for split in (private.train, private.val, private.test)
    )


def _digest_list(images: np.ndarray) -> list[bytes]:
    shape = repr(images.shape[1:]).encode()
    return [hashlib.blake2b(shape + np.ascontiguousarray(image).tobytes(), digest_size=16).digest() for image in images]


def check_overlap(private: PrivateSplits, public: ImageDataset | None, allow_overlap: bool = False) -> int:
    """The number of private records also in the public set; DataError when any and not ``allow_overlap``.

    The count is computed from private data: it belongs in the custodian's diagnostics, not the release.
    """
    if public is None:
        return 0
    overlap = count_overlap(private, public)
    if overlap and not allow_overlap:
        raise DataError(  # not the count: how many private records are public is itself private
            "private images also appear in the public set; a public set must not "
            "contain private records (set data.allow_overlap: true to proceed anyway)"
        )
    return overlap


def private_options(data: DataSection | Mapping[str, Any]) -> dict[str, Any]:
    """``load_private`` keyword arguments from a config's ``data`` section (one definition for every caller)."""
    data = as_data_section(data)
    return {
        "image_size": data.image_size,
        "channels": data.channels,
        "val_size": data.val_size,
        "split_seed": data.split_seed,
        "max_train": data.max_train,
        "num_classes": data.num_classes,
        "pixel_range": data.pixel_range,
        "colour_to_grey": data.colour_to_grey,
        "class_names": data.class_names,
    }


def load_for_run(
    data: DataSection | Mapping[str, Any], splits: PrivateSplits | None = None
) -> tuple[PrivateSplits, ImageDataset | None, int]:
    """(private splits, public set or None, overlap count) for a config's ``data`` section.

    ``splits`` skips loading the private side (in-memory arrays handed to the Python API). The public
    set is loaded at the private size and channels, which come from the config or the private
    format's declared shape, and is checked for overlap with every private split.
    """
    data = as_data_section(data)
    if splits is None:
        splits = load_private(data.private, **private_options(data))
    if not data.public:
        return splits, None, 0
    channels, height, _ = splits.train.image_shape
    public = load_public(
        data.public,
        image_size=data.image_size or height,
        channels=data.channels or channels,
        max_size=data.max_public,
    )
    return splits, public, check_overlap(splits, public, data.allow_overlap)
