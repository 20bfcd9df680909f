"""FID sanity check on mnist10k and the cost of Inception features on this machine.

FID(train, test) must be small (same distribution, different digits); FID(train, noise) and
FID(train, shifted train) must be large. Also prints KID and precision/recall, and the seconds of
Inception feature extraction per 1,000 images.

    OMP_NUM_THREADS=2 python experiments/fid_sanity.py --num 1000 [--device cpu] [--batch-size 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dpsynth.metrics.fidelity import compute_fidelity
from dpsynth.metrics.inception import InceptionFeatures


def load_mnist10k() -> tuple[np.ndarray, np.ndarray]:
    """(train images, test images) of mnist10k, through the data layer when it is available."""
    try:
        from dpsynth.data import load_private
    except ImportError:
        load_private = None
    if load_private is not None:
        splits = load_private("mnist10k")
        return splits.train.images, splits.test.images
    # Fallback until dpsynth.data.load_private lands: the shipped asset and its fixed split column.
    asset = Path(__file__).resolve().parents[1] / "dpsynth" / "data" / "assets" / "mnist10k.npz"
    with np.load(asset) as data:
        return data["images"][data["split"] == 0], data["images"][data["split"] == 2]


def shifted(images: np.ndarray, pixels: int) -> np.ndarray:
    """Translate every digit right and down by ``pixels`` (zero fill)."""
    out = np.zeros_like(images)
    out[:, pixels:, pixels:] = images[:, :-pixels, :-pixels]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=1000, help="images per set")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    train, test = load_mnist10k()
    train = train[rng.choice(len(train), args.num, replace=False)]
    test = test[rng.choice(len(test), min(args.num, len(test)), replace=False)]
    sets = {
        "test": test,
        "noise": rng.integers(0, 256, size=test.shape, dtype=np.uint8),
        "shifted4": shifted(train, 4),
    }
    extractor = InceptionFeatures(device=args.device, batch_size=args.batch_size)
    started = time.perf_counter()
    train_features = extractor(train, desc="train")
    seconds = time.perf_counter() - started
    results: dict[str, object] = {
        "num_images": args.num,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "seconds_per_1000_images": seconds / len(train) * 1000,
    }
    for name, images in sets.items():
        features = extractor(images, desc=name)
        results[f"train_vs_{name}"] = compute_fidelity(train_features, features, ["fid", "kid", "precision", "recall"])
    if args.json:
        print(json.dumps(results))
    else:
        for key, value in results.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
