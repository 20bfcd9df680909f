"""``dpsynth pretrain CONFIG [--set KEY=VALUE] [--json]``: build a run's public models ahead of time."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``pretrain`` subcommand to the ``dpsynth`` parser."""
    parser = subparsers.add_parser(
        "pretrain",
        help="pre-train a config's public backbone (and diffusion model or GAN) into the cache (no privacy cost)",
        description="Train the public models CONFIG's run will use on its data.public (public data only; the "
        "set is refused if it holds a private record): the backbone section's autoencoder where the run reads it "
        "(space: latent, and pe), and the method's own public pre-training where it has one (pdp-diffusion; dp-gan "
        "and gs-wgan with pretrain_steps). Store "
        "them in $DPSYNTH_CACHE or ~/.cache/dpsynth and print where; a later run or call with the same public "
        "data and keys reuses them (docs/backbone.md).",
    )
    parser.add_argument("config", help="YAML config path or packaged preset, e.g. pdp-diffusion/mnist10k_eps10")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. backbone.steps=500"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=cmd_pretrain)


def cmd_pretrain(args: argparse.Namespace) -> int:
    from dpsynth.pretraining import pretrain

    # Log lines go to stderr; stdout holds only the cache paths (or the JSON object), for scripts.
    built = pretrain(args.config, args.set, log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps({"models": built}, allow_nan=False))
    else:
        for model in built:
            state = "cached already" if model["cached"] else "built"
            shape = "x".join(map(str, model["image_shape"]))
            if "latent_shape" in model:
                shape += " -> " + "x".join(map(str, model["latent_shape"]))
            print(f"{model['kind']} ({shape}, {model['parameters']:,} parameters) {state}", file=sys.stderr)
            print(model["path"])
    return 0
