"""PrivImage on mnist10k: +D and +G at eps 10 and 1, against PDP-Diffusion pre-trained on other public sets.

The paper's central claim (PrivImage, arXiv:2311.12850, §5.2) is that pre-training on a privately *selected*
public subset beats pre-training on the whole public set. This sweep tests it at the CPU preset's budget (0.3M
UNet, 2,000 public pre-training steps, 200 DP steps), on mnist10k private and the 62-class ``glyphs`` public set:

- ``privimage_eps10``: the shipped preset, which runs the DP semantic query and releases ``selection.json``;
- ``privimage_eps1``, ``privimage-gan_eps10``, ``privimage-gan_eps1``: the shipped presets, **re-using** that
  released selection (``privimage.selection.reuse``), which charges the query again in each run; the
  selection's noise is the same (sigma_q = 68 in every preset), so it is a draw of the same mechanism, and the
  pre-trained models are shared through the cache;
- ``pdp-all-glyphs_eps10``: PDP-Diffusion pre-trained on all 62 glyph classes (``data.public=glyphs``);
- ``pdp-digit-glyphs_eps10``: PDP-Diffusion pre-trained on the ten digit glyphs (an oracle selection);
- ``privimage-random_eps10``: PrivImage+D with a *random* selection of the same size (k2 = 5 public classes
  per digit, drawn with a fixed public seed and relabelled like the real selection); the run re-uses it as a
  selection file, so it, too, is charged for a query (conservative: no private data chose it);
- ``pdp-scratch_eps10``: PDP-Diffusion with no public data.

Every run writes its downstream CNN accuracy (``evaluate`` of the preset); ``--fid N`` then adds FID on N
samples against N private train images (a private diagnostic, ``dpsynth evaluate RUN --metrics fid``).

    OMP_NUM_THREADS=2 python bench/privimage_mnist10k.py --runs bench/out/privimage_mnist10k [--fid 1000] [--json]

Interrupted runs resume; finished ones are skipped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from diffusion_mnist10k import print_table, run_once, summarise  # bench/ is on sys.path when this script runs

PRESETS = Path(__file__).resolve().parent.parent / "dpsynth" / "presets"
SELECTION_RUN = "privimage_eps10"
REUSE = f"privimage.selection.reuse={{runs}}/{SELECTION_RUN}/selection.json"
RANDOM_SELECTION = "random_selection.json"

RUNS: dict[str, tuple[str, list[str]]] = {
    SELECTION_RUN: ("privimage/mnist10k_eps10.yaml", []),
    "privimage-gan_eps10": ("privimage/mnist10k_gan_eps10.yaml", [REUSE]),
    "privimage_eps1": ("privimage/mnist10k_eps1.yaml", [REUSE]),
    "privimage-gan_eps1": ("privimage/mnist10k_gan_eps1.yaml", [REUSE]),
    "pdp-all-glyphs_eps10": ("pdp-diffusion/mnist10k_eps10.yaml", ["data.public=glyphs"]),
    "privimage-random_eps10": (
        "privimage/mnist10k_eps10.yaml",
        [f"privimage.selection.reuse={{runs}}/{RANDOM_SELECTION}"],
    ),
    "pdp-digit-glyphs_eps10": ("pdp-diffusion/mnist10k_eps10.yaml", []),
    "pdp-scratch_eps10": ("pdp-diffusion/mnist10k_eps10.yaml", ["data.public=null"]),
}


def random_selection(released: Path, out: Path, seed: int = 0) -> None:
    """A selection file with each private row's public classes drawn uniformly (same k2), no private input.

    The noisy counts of the released file are kept only so that the file parses; nothing is chosen by them.
    """
    data = json.loads(released.read_text())
    rng = np.random.default_rng(seed)
    names = data["semantic_names"]
    for row in data["rows"]:
        picks = rng.choice(len(names), size=len(row["selected"]), replace=False)
        row["selected"] = [{"public_class": names[i], "index": int(i), "noisy_count": None} for i in picks]
    data["collisions"], data["sds"], data["selection_ratio"] = {}, None, None
    data["note"] = f"random control: public classes drawn with numpy default_rng({seed}), not by the query"
    out.write_text(json.dumps(data, indent=1))


def run(name: str, runs: Path) -> None:
    if name == "privimage-random_eps10" and not (runs / RANDOM_SELECTION).is_file():
        random_selection(runs / SELECTION_RUN / "selection.json", runs / RANDOM_SELECTION)
    preset, overrides = RUNS[name]
    run_once(runs / name, str(PRESETS / preset), [override.format(runs=runs) for override in overrides])


def add_fid(run_dir: Path, num: int) -> float:
    """FID of the run's first ``num`` samples against ``num`` private train images (cached per run)."""
    stored = run_dir / "diagnostics" / f"fid{num}.json"
    if not stored.is_file():
        command = [sys.executable, "-m", "dpsynth", "evaluate", str(run_dir), "--metrics", "fid"]
        command += ["--max-fid-samples", str(num), "--json"]
        print(f"[{time.strftime('%H:%M:%S')}] {' '.join(command)}", file=sys.stderr, flush=True)
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        stored.write_text(json.dumps({"fid": result["fid"], "num": num}))
    return float(json.loads(stored.read_text())["fid"])


def selection_summary(run_dir: Path) -> dict[str, object]:
    """Which digits found their own glyph among their top-k2 public classes, from the released selection."""
    data = json.loads((run_dir / "selection.json").read_text())
    own = [row["class"] for row in data["rows"] if row["class"] in [s["public_class"] for s in row["selected"]]]
    return {"digits_with_own_glyph": own, "selection_ratio": data["selection_ratio"], "sds": data["sds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("bench/out/privimage_mnist10k"))
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="run these only (default: all)")
    parser.add_argument("--fid", type=int, default=0, help="also FID on this many samples (0: none)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    runs = args.runs.resolve()
    names = args.only or list(RUNS)
    for name in names:
        run(name, runs)
    rows = []
    for name in names:
        row = summarise(runs / name)
        if args.fid:
            row["fid"] = add_fid(runs / name, args.fid)
        rows.append(row)
    if (runs / SELECTION_RUN / "selection.json").is_file():
        print("selection:", json.dumps(selection_summary(runs / SELECTION_RUN)), file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print_table(rows, "FID", lambda row: f"{row['fid']:.1f}" if "fid" in row else "-")


if __name__ == "__main__":
    main()
