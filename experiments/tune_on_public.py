"""Re-derive a preset's tuned hyperparameter on public data only, never on the private set it ships for.

The mnist10k PDP-Diffusion presets once used lr 2e-3, picked over Table 3's 5e-4 by downstream accuracy on
mnist10k's test split: tuning on the private data the preset is meant for, whose choice then leaks through the
released configuration. This script makes the same comparison on a PUBLIC stand-in for the private set:

- stand-in private train / val / test: scikit-learn's handwritten ``digits8x8`` (1,797 UCI digits, public),
  upscaled to 28x28 grey, with the fixed digits8x8 split (train 1,257 / val 180 / test 360);
- public pre-training data: ``glyphs-digits``, as in the presets.

Each candidate runs the preset unchanged except for ``data.private`` (the stand-in file) and the tuned key;
the downstream CNN's accuracy on the stand-in's test split (public data) picks the winner. The printed JSON
says which value to ship and the table behind it; copy the value into the preset with a ``# how chosen:`` line
naming this script.

    OMP_NUM_THREADS=2 python experiments/tune_on_public.py --out experiments/out/tune_on_public [--smoke]

``--smoke`` shrinks every run to a few steps (under a minute in all) to check that the script works; its
numbers mean nothing. A full run takes about as long as the presets themselves, once per candidate.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from dpsynth.data import load_dataset
from dpsynth.data.transforms import resize
from dpsynth.runner import run_config

# (preset, dotted key, candidates): every choice that was once made on private test data.
CHOICES = [
    ("pdp-diffusion/mnist10k_eps10", "pdp-diffusion.lr", [5e-4, 1e-3, 2e-3]),
]

SMOKE = [
    "pdp-diffusion.model=0.8m",
    (
        "pdp-diffusion.unet={base_channels: 16, channel_mult: [1, 2], num_res_blocks: 1, attention_levels: [], "
        "num_head_channels: 16}"
    ),
    "pdp-diffusion.steps=2",
    "pdp-diffusion.batch_size=16",
    "pdp-diffusion.physical_batch_size=16",
    "pdp-diffusion.pretrain.steps=2",
    "pdp-diffusion.pretrain.batch_size=16",
    "pdp-diffusion.pretrain.warmup_steps=1",
    "pdp-diffusion.sample_steps=2",
    "pdp-diffusion.checkpoint_every=2",
    "pdp-diffusion.pretrain.checkpoint_every=2",
    "data.max_public=100",
    "generate.num=30",
    "generate.batch_size=30",
    "evaluate.epochs=1",
]


def write_stand_in(path: Path, side: int = 28) -> Path:
    """digits8x8 (public) upscaled to ``side`` x ``side``, stored with its fixed train/val/test split."""
    arrays = {}
    for split in ("train", "val", "test"):
        digits = load_dataset("digits8x8", split)
        arrays[f"{split}_images"] = resize(digits.images, side)
        arrays[f"{split}_labels"] = digits.labels
    np.savez(path, class_names=np.array([str(d) for d in range(10)]), **arrays)
    return path


def accuracy(run_dir: Path) -> float:
    """The downstream CNN's accuracy on the stand-in's test split, from the run's metrics.json."""
    value = json.loads((run_dir / "metrics.json").read_text())["accuracy"]["cnn"]
    return float(value["mean"] if isinstance(value, dict) else value)


def tune(out: Path, smoke: bool) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    stand_in = write_stand_in(out / "digits8x8_28.npz")
    results = []
    for preset, key, candidates in CHOICES:
        rows = []
        for value in candidates:
            run_dir = out / f"{Path(preset).parent.name}-{Path(preset).stem}-{key.rsplit('.', 1)[1]}{value:g}"
            overrides = [
                f"data.private={stand_in}",
                f"{key}={value}",
                "evaluate.metrics=[accuracy]",
                "evaluate.models=[cnn]",
                *(SMOKE if smoke else []),
            ]
            if not (run_dir / "metrics.json").is_file():
                if run_dir.is_dir():  # an interrupted run of this script: start that candidate again
                    shutil.rmtree(run_dir)
                run_config(preset, overrides, out=run_dir, echo=False)
            rows.append({"value": value, "stand_in_test_accuracy": accuracy(run_dir), "run": str(run_dir)})
        best = max(rows, key=lambda row: row["stand_in_test_accuracy"])
        results.append({"preset": preset, "key": key, "chosen": best["value"], "smoke": smoke, "rows": rows})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/out/tune_on_public"))
    parser.add_argument("--smoke", action="store_true", help="a few steps per run, to test the script")
    args = parser.parse_args()
    print(json.dumps(tune(args.out, args.smoke), indent=2))


if __name__ == "__main__":
    main()
