"""Fetching the real datasets for users who have a network, with checksum verification.

Nothing here runs in tests or at import time (there is no network on the build machines).
``download(name, root)`` fetches every file of a dataset into ``root`` (default
:func:`data_root`), checks its MD5/SHA-256 before keeping it, and unpacks archives.
Checksums are the ones published by the dataset authors (and used by torchvision); the
WILDS Camelyon17 bundle has no published checksum, so it is only size-checked by the archive
reader and a warning says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from dpsynth.errors import DataError


@dataclasses.dataclass(frozen=True)
class Resource:
    """One file to fetch: ``url`` saved as ``filename``, verified with ``md5`` or ``sha256``."""

    url: str
    filename: str
    md5: str | None = None
    sha256: str | None = None
    extract: bool = False


_MNIST = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_FASHION = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_KMNIST = "http://codh.rois.ac.jp/kmnist/dataset/kmnist/"
_GDRIVE = "https://drive.google.com/uc?export=download&id="


def _idx(base: str, md5s: tuple[str, str, str, str]) -> tuple[Resource, ...]:
    names = (
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    )
    return tuple(Resource(base + n, n, md5=m) for n, m in zip(names, md5s))


RESOURCES: dict[str, tuple[Resource, ...]] = {
    "mnist": _idx(
        _MNIST,
        (
            "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "d53e105ee54ea40749a09fcbcd1e9432",
            "9fb629c4189551a2d022fa330f9573f3",
            "ec29112dd5afa0611ce80d1b7f02629c",
        ),
    ),
    "fashion-mnist": _idx(
        _FASHION,
        (
            "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "25c81989df183df01b3e8a0aad5dffbe",
            "bef4ecab320f06d8554ea6380940ec79",
            "bb300cfdad3c16e7a12a480ee83cd310",
        ),
    ),
    "kmnist": _idx(
        _KMNIST,
        (
            "bdb82020997e1d708af4cf47b453dcf7",
            "e144d726b3acfaa3e44228e80efcd344",
            "5c965bf0a639b31b8f53240b1b52f4d7",
            "7320c461ea6c1c855c0b718fb2a4b134",
        ),
    ),
    "emnist": (
        Resource(
            "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
            "gzip.zip",
            md5="58c8d27c78d21e728a6bc7b3cc06412e",
            extract=True,
        ),
    ),
    "cifar10": (
        Resource(
            "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
            "cifar-10-python.tar.gz",
            md5="c58f30108f718f92721af3b95e74349a",
            extract=True,
        ),
    ),
    "cifar100": (
        Resource(
            "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
            "cifar-100-python.tar.gz",
            md5="eb9058c3a382ffc7106e4002c42a8d85",
            extract=True,
        ),
    ),
    "celeba": (
        Resource(
            _GDRIVE + "0B7EVK8r0v71pZjFTYXZWM3FlRnM",
            "img_align_celeba.zip",
            md5="00d2c5bc6d35e252742224ab0c1e8fcb",
            extract=True,
        ),
        Resource(
            _GDRIVE + "0B7EVK8r0v71pblRyaVFSWGxPY0U", "list_attr_celeba.txt", md5="75e246fa4810816ffd6ee81facbd244c"
        ),
        Resource(
            _GDRIVE + "0B7EVK8r0v71pY0NSMzRuSXJEVkk", "list_eval_partition.txt", md5="d32c9cbf5e040fd4025c592c306e6668"
        ),
    ),
    "camelyon17": (
        Resource(
            "https://worksheets.codalab.org/rest/bundles/0xe45e15f39fb54e9d9e919556af67aabe/contents/blob/",
            "camelyon17_v1.0.tar.gz",
            extract=True,
        ),
    ),
}
# Registered names that share the files of another entry.
RESOURCE_ALIASES = {"emnist-letters": "emnist", "emnist-balanced": "emnist", "emnist-digits": "emnist"}


def data_root(name: str | None = None) -> Path:
    """Where real datasets live: ``$DPSYNTH_DATA`` or ``~/.cache/dpsynth/data``, then ``/<name>``."""
    base = Path(os.environ.get("DPSYNTH_DATA") or Path.home() / ".cache" / "dpsynth" / "data")
    return base / name if name else base


def file_digest(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, resource: Resource) -> bool:
    """Whether ``path`` matches the resource's checksum (True when none is published)."""
    if resource.sha256:
        return file_digest(path, "sha256") == resource.sha256
    if resource.md5:
        return file_digest(path, "md5") == resource.md5
    return True


def _fetch(resource: Resource, target: Path) -> None:
    import urllib.request  # only when downloading: it costs ~0.1 s at import

    handle, temporary = tempfile.mkstemp(dir=target.parent, suffix=".part")
    try:
        with os.fdopen(handle, "wb") as out, urllib.request.urlopen(resource.url, timeout=60) as response:
            shutil.copyfileobj(response, out, 1 << 20)
        if not verify(Path(temporary), resource):
            raise DataError(f"checksum mismatch for {resource.url}; the file was not kept")
        os.replace(temporary, target)
    except OSError as err:
        raise DataError(f"cannot download {resource.url}: {err}") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _extract(archive: Path, folder: Path) -> None:
    """Unpack a .zip / .tar(.gz) archive, refusing members that would land outside ``folder``."""
    import tarfile
    import zipfile

    destination = folder.resolve()
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as bundle:
            for member in bundle.namelist():
                if not (destination / member).resolve().is_relative_to(destination):
                    raise DataError(f"{archive}: member {member} escapes the target folder")
            bundle.extractall(destination)
    else:
        with tarfile.open(archive) as bundle:
            bundle.extractall(destination, filter="data")


def download(name: str, root: str | Path | None = None) -> Path:
    """Fetch dataset ``name`` into ``root`` (default ``data_root(name)``), verify, unpack; return the folder."""
    key = RESOURCE_ALIASES.get(name, name)
    if key not in RESOURCES:
        raise DataError(f"no download for '{name}'; downloadable: {', '.join(sorted(RESOURCES))}")
    folder = Path(root) if root is not None else data_root(name)
    folder.mkdir(parents=True, exist_ok=True)
    for resource in RESOURCES[key]:
        target = folder / resource.filename
        if target.is_file() and verify(target, resource):
            print(f"{target}: present, checksum ok", file=sys.stderr)
        else:
            if not (resource.md5 or resource.sha256):
                print(f"warning: {resource.filename} has no published checksum; it is not verified", file=sys.stderr)
            print(f"downloading {resource.url}", file=sys.stderr)
            _fetch(resource, target)
        if resource.extract:
            _extract(target, folder)
    return folder
