"""Own data at 10⁵–10⁶ images: what loading costs and whether an ``auto`` preset still finishes in its budget.

For each size N an own data set is written under ``--dir`` in each ``--formats``: ``npz`` (one ``.npz`` of
uint8 28×28 images and labels) and/or ``folder`` (a class-per-folder tree of PNG files), each with a
``dataset.yaml`` declaring its 10 classes and 1 channel. The records are the 10,000 built-in mnist10k digits,
each copy shifted by a keyed offset of up to ±2 pixels and given uniform noise of ±8 grey levels, so every
record is distinct (the split is keyed on record content) and the labels mean something. Nothing here is
private data; the set stands in for a custodian's own files.

Then, each in a fresh process (so that its peak memory is its own):

1. ``load``: ``dpsynth.data.load_private`` on the path, as a run loads it (read, content-hash, keyed split):
   wall time and peak resident memory (``ru_maxrss``);
2. ``run``: ``dpsynth run METHOD --set data.private=PATH`` under ``/usr/bin/time -v``: wall time, peak
   memory, exit status, ε spent, every key the scaling rule set, and the run's downstream accuracy (a
   private diagnostic of this public stand-in), against the preset's ``auto.time_budget_s``.

    OMP_NUM_THREADS=2 python experiments/own_data_scale.py --sizes 100000,1000000 --formats npz,folder \\
        --method dpsgd-classifier/auto --dir /tmp/dpsynth-scale --json experiments/results/own_data_scale.json

A folder tree of 10⁶ PNG files is about 10⁶ inodes; ``--formats npz`` at that size. Sets are deleted
afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = 20_000


def stand_in(count: int, seed: int = 0):
    """``count`` distinct labelled 28×28 digits: mnist10k, shifted and noised per copy (uint8, int64)."""
    import numpy as np

    from dpsynth.data.builtins import load_mnist10k

    base = load_mnist10k("train")
    base_images = base.images[..., 0]
    rng = np.random.default_rng(seed)
    for start in range(0, count, BLOCK):
        size = min(BLOCK, count - start)
        pick = rng.integers(0, len(base_images), size)
        images = base_images[pick].astype(np.int16)
        shifts = rng.integers(-2, 3, (size, 2))
        for axis in (0, 1):
            for shift in (-2, -1, 1, 2):
                rows = shifts[:, axis] == shift
                images[rows] = np.roll(images[rows], shift, axis=axis + 1)
        images += rng.integers(-8, 9, images.shape, dtype=np.int16)
        yield np.clip(images, 0, 255).astype(np.uint8), base.labels[pick].astype(np.int64)


def write_npz(out: Path, count: int) -> float:
    import numpy as np

    started = time.perf_counter()
    blocks = list(stand_in(count))
    out.mkdir(parents=True, exist_ok=True)
    images = np.concatenate([b[0] for b in blocks])
    labels = np.concatenate([b[1] for b in blocks])
    np.savez(out / "digits.npz", images=images, labels=labels)
    (out / "dataset.yaml").write_text("classes: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]\nchannels: 1\n")
    return time.perf_counter() - started


def write_folder(out: Path, count: int) -> float:
    from PIL import Image

    started = time.perf_counter()
    for digit in range(10):
        (out / str(digit)).mkdir(parents=True, exist_ok=True)
    index = 0
    for images, labels in stand_in(count):
        for image, label in zip(images, labels):
            Image.fromarray(image).save(out / str(int(label)) / f"{index:07d}.png")
            index += 1
    (out / "dataset.yaml").write_text("classes: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]\nchannels: 1\n")
    return time.perf_counter() - started


def measure_load(path: Path) -> dict:
    """Load in a fresh process: wall time and peak resident memory."""
    code = (
        "import json, resource, sys, time\n"
        "from dpsynth.config import load_config\n"
        "from dpsynth.data import load_private\n"
        "from dpsynth.data.loading import private_options\n"
        f"config = load_config('dpsgd-classifier/auto', ['data.private={path}'])\n"
        "t = time.perf_counter()\n"
        "splits = load_private(config.data.private, **private_options(config.data))\n"
        "wall = time.perf_counter() - t\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20\n"
        "print(json.dumps({'load_s': round(wall, 1), 'peak_gib': round(peak, 2), 'train': len(splits.train)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_run(path: Path, method: str, run_dir: Path) -> dict:
    """``dpsynth run METHOD`` on the path under /usr/bin/time -v: wall, peak memory, ε, the rule's keys, accuracy."""
    command = [
        "/usr/bin/time", "-v", sys.executable, "-m", "dpsynth", "run", method,
        "--out", str(run_dir), f"--set=data.private={path}",
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - started
    peak_kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    result = {
        "returncode": done.returncode,
        "wall_s": round(wall, 1),
        "peak_gib": round(int(peak_kib.group(1)) / 2**20, 2) if peak_kib else None,
    }
    privacy = run_dir / "privacy.json"
    if privacy.is_file():
        result["epsilon"] = json.loads(privacy.read_text())["epsilon"]
    metrics = run_dir / "diagnostics" / "metrics.json"  # private diagnostics of this synthetic stand-in
    if metrics.is_file():
        accuracy = json.loads(metrics.read_text()).get("accuracy", {})
        result["accuracy"] = {name: row["mean"] for name, row in accuracy.items() if isinstance(row, dict)}
    config = run_dir / "config.yaml"
    if config.is_file():
        from dpsynth.config import read_yaml

        auto = read_yaml(config).get("auto") or {}
        result["time_budget_s"] = auto.get("time_budget_s")
        result["set_by_rule"] = {item["key"]: item["value"] for item in auto.get("applied", [])}
    if done.returncode:
        result["error"] = done.stderr.strip().splitlines()[-1][-300:] if done.stderr.strip() else ""
    return result


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--formats", default="npz", help="comma-separated: npz, folder")
    parser.add_argument("--method", default="dpsgd-classifier/auto")
    parser.add_argument("--dir", default="/tmp/dpsynth-scale")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--no-run", action="store_true", help="measure loading only")
    args = parser.parse_args()
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        for fmt in args.formats.split(","):
            root = Path(args.dir) / f"{fmt}-{size}"
            shutil.rmtree(root, ignore_errors=True)
            written = write_npz(root, size) if fmt == "npz" else write_folder(root / "tree", size)
            path = root / "digits.npz" if fmt == "npz" else root / "tree"
            row = {"size": size, "format": fmt, "write_s": round(written, 1), **measure_load(path)}
            print(json.dumps(row), flush=True)
            if not args.no_run:
                row["run"] = measure_run(path, args.method, root / "run")
                row["method"] = args.method
                print(json.dumps(row), flush=True)
            results.append(row)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
