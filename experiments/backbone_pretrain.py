"""Wall time and held-out reconstruction error of the public latent backbone's pre-training (docs/backbone.md).

Trains the autoencoder of ``backbone`` (the CPU defaults unless ``--set`` changes them) on a public glyph set
into a fresh cache directory, then scores the reconstruction of the glyph set's *test* split, which the
training never saw, against the trivial baseline of predicting the mean training image. Everything here is
public data. Prints one JSON object.

    OMP_NUM_THREADS=1 python experiments/backbone_pretrain.py --public glyphs-digits --out experiments/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public", default="glyphs-digits", help="a glyph set (it has a test split)")
    parser.add_argument("--size", type=int, default=None, help="public training images (default: the set's own)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a backbone key: steps=100")
    parser.add_argument("--out", help="also write the JSON object here")
    args = parser.parse_args()

    import torch

    from dpsynth.config import parse_overrides
    from dpsynth.data.loading import load_dataset
    from dpsynth.models.backbone import BackboneSection, describe, mean_image_mse, pretrain_backbone, reconstruction_mse

    section = BackboneSection.model_validate(parse_overrides(args.set))
    options = {} if args.size is None else {"size": args.size}
    public = load_dataset(args.public, "train", **options)
    held_out = load_dataset(args.public, "test", **options)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["DPSYNTH_CACHE"] = cache
        started = time.perf_counter()
        backbone = pretrain_backbone(public, section, log=lambda line: None)
        seconds = time.perf_counter() - started
    train_images, _ = public.to_tensors()
    test_images, _ = held_out.to_tensors()
    result = {
        "public": args.public,
        "train_images": len(public),
        "held_out_images": len(held_out),
        "backbone": section.model_dump(),
        "pretrain_seconds": round(seconds, 1),
        "held_out_mse": reconstruction_mse(backbone.autoencoder, test_images),
        "mean_image_mse": mean_image_mse(train_images, test_images),
        "summary": {k: v for k, v in describe(backbone).items() if k not in ("path", "key")},
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        "torch": torch.__version__,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
