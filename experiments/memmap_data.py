"""Benchmark the memory-mapped data path at scale: memory and time of DP-SGD-like batch access vs N.

For each size N (default 10k, 200k and 2M records of 32x32x3, i.e. 30 MB, 600 MB and 6 GB on disk) a
shard set is written under ``--dir`` (:func:`dpsynth.data.shards.write_shards`, content keys computed as
it writes), then a fresh process measures, with nothing else in it:

1. ``load_private(shard, val_size=0.1)``: the content-keyed train/val/test split (cached keys, labels;
   the splits are row selections of the memmap, no pixel is read);
2. ``--steps`` batch accesses as DP-SGD makes them (``dpsynth.dpsgd.training``): a Poisson sample of the
   train split at q = B / N (the run's :class:`ShardedPoissonSampler`), the batch's records gathered from
   the memmap and converted to float tensors (``ImageDataset.batch_tensors``), and the batch's per-record
   draws (:class:`RecordRandomness`, which holds the train split's content keys as a run does).

Reported per N, and as ratios to the smallest N: the median CPU time per batch access (``process_time``,
which a machine shared with other jobs disturbs far less than wall time; the wall-clock median is kept
too) and its two parts, the peak resident memory of the access loop (``VmHWM``, reset after loading
through ``/proc/self/clear_refs``), the process's own memory (``RssAnon``, sampled every step) and the
resident pages of the shard's mapping itself (``/proc/self/smaps``; batch reads are positional reads
of the file, ``dpsynth.data.dataset.read_rows``, so it should stay near zero), and the loading phase's
time and peak. ``--coins`` also times the O(N) sampler this replaced (one uniform per record, ``torch.rand(N) < q``).

    OMP_NUM_THREADS=1 python experiments/memmap_data.py --sizes 10000,200000,2000000 --steps 100 \\
        --dir /tmp/dpsynth-memmap [--coins] [--keep] [--json]

The shard sets are deleted afterwards unless ``--keep``; ``df -h`` the directory first (2M records
need 6.3 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE, CLASSES, BLOCK = (32, 32, 3), 10, 8192


def write_set(out: Path, count: int, seed: int = 0) -> float:
    """Write ``count`` random records as a shard set at ``out``; return the seconds it took."""
    import numpy as np

    from dpsynth.data.shards import write_shards

    rng = np.random.default_rng(seed)
    record = int(np.prod(SHAPE))
    labels = rng.integers(0, CLASSES, count)

    def blocks():
        for start in range(0, count, BLOCK):
            size = min(BLOCK, count - start)
            yield np.frombuffer(rng.bytes(size * record), dtype=np.uint8).reshape(size, *SHAPE)

    start = time.perf_counter()
    write_shards(blocks(), labels, out, num_classes=CLASSES)
    return time.perf_counter() - start


def memory_kib() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon and RssFile of this process, in KiB (Linux)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0])
    return fields


def mapped_kib(suffix: str) -> int:
    """Resident KiB of this process's mappings of files whose path ends with ``suffix`` (Linux smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line: address range first
                inside = line.rstrip().endswith(suffix)
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (``clear_refs`` 5, Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def measure(shard: Path, batch: int, steps: int, warmup: int, coins: bool) -> dict:
    """The worker: load the split, then time ``steps`` Poisson batch accesses; memory as it goes."""
    import torch

    from dpsynth.data import load_private
    from dpsynth.dpsgd.distributed import ShardedPoissonSampler
    from dpsynth.privacy.record_draws import RecordRandomness
    from dpsynth.privacy.rng import NoiseSource

    torch.set_num_threads(1)
    before = memory_kib()
    start = time.perf_counter()
    splits = load_private(shard, val_size=0.1)
    load_s = time.perf_counter() - start
    loaded = memory_kib()
    train = splits.train
    rate = batch / len(train)
    noise = NoiseSource()
    sampler = ShardedPoissonSampler(len(train), rate, noise)
    randomness = RecordRandomness(train.record_keys, key=0)
    for step in range(warmup):
        indices = sampler.sample()
        train.batch_tensors(indices)
        randomness.draws(step, indices)
    peak_reset = reset_peak()
    sample_s, gather_s, wall_s, anon = [], [], [], []
    for step in range(warmup, warmup + steps):
        w0, t0 = time.perf_counter(), time.process_time()
        indices = sampler.sample()
        t1 = time.process_time()
        images, labels = train.batch_tensors(indices)
        randomness.draws(step, indices)
        t2, w2 = time.process_time(), time.perf_counter()
        sample_s.append(t1 - t0)
        gather_s.append(t2 - t1)
        wall_s.append(w2 - w0)
        anon.append(memory_kib()["RssAnon"])
    end = memory_kib()
    row = {
        "records": len(train) + len(splits.val) + len(splits.test),
        "train": len(train),
        "batch": batch,
        "steps": steps,
        "load_s": load_s,
        "load_peak_mib": loaded["VmHWM"] / 1024,
        "load_anon_growth_mib": (loaded["RssAnon"] - before["RssAnon"]) / 1024,
        "step_ms": 1e3 * statistics.median(s + g for s, g in zip(sample_s, gather_s)),
        "sample_ms": 1e3 * statistics.median(sample_s),
        "gather_ms": 1e3 * statistics.median(gather_s),
        "wall_ms": 1e3 * statistics.median(wall_s),
        "steps_peak_mib": end["VmHWM"] / 1024 if peak_reset else None,
        "steps_anon_peak_mib": max(anon) / 1024,
        "mapped_resident_mib": mapped_kib("images.u8") / 1024,
        "memory_mapped": train.memory_mapped,
    }
    if coins:
        timings = []
        for _ in range(min(steps, 20)):
            t0 = time.process_time()
            (noise.uniform(len(train)) < rate).nonzero()
            timings.append(time.process_time() - t0)
        row["coin_sample_ms"] = 1e3 * statistics.median(timings)
    return row


def in_subprocess(args: list[str]) -> dict:
    path = os.pathsep.join([str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "worker failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_ratios(rows: list[dict]) -> None:
    base = rows[0]
    for row in rows:
        for key in ("step_ms", "wall_ms", "gather_ms", "steps_anon_peak_mib", "steps_peak_mib", "load_peak_mib"):
            if row.get(key) is not None and base.get(key):
                row[f"{key}_vs_first"] = row[key] / base[key]


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'records':>9} {'cpu ms':>7} {'x':>5} {'sample':>7} {'gather':>7} {'coins':>7} {'wall ms':>7} {'x':>5} "
        f"{'steps peak':>10} {'x':>5} {'anon':>6} {'x':>5} {'mapped':>6} {'load s':>7} {'load peak':>9} {'x':>5}"
    )
    print(header, file=sys.stderr)
    print("-" * len(header), file=sys.stderr)
    for r in rows:
        print(
            f"{r['records']:>9} {r['step_ms']:7.2f} {r['step_ms_vs_first']:5.2f} {r['sample_ms']:7.2f} "
            f"{r['gather_ms']:7.2f} {r.get('coin_sample_ms', float('nan')):7.2f} {r['wall_ms']:7.2f} "
            f"{r['wall_ms_vs_first']:5.2f} {r['steps_peak_mib'] or 0:10.0f} {r.get('steps_peak_mib_vs_first', 1):5.2f} "
            f"{r['steps_anon_peak_mib']:6.0f} {r['steps_anon_peak_mib_vs_first']:5.2f} {r['mapped_resident_mib']:6.1f} "
            f"{r['load_s']:7.1f} {r['load_peak_mib']:9.0f} {r['load_peak_mib_vs_first']:5.2f}",
            file=sys.stderr,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,200000,2000000", help="comma-separated record counts")
    parser.add_argument("--batch", type=int, default=256, help="expected Poisson batch B (q = B / N)")
    parser.add_argument("--steps", type=int, default=100, help="timed batch accesses per size")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/dpsynth-memmap", help="where the shard sets are written")
    parser.add_argument("--coins", action="store_true", help="also time one-uniform-per-record sampling")
    parser.add_argument("--keep", action="store_true", help="keep the shard sets (reused by a later run)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list on stdout")
    parser.add_argument("--write", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        out, count = args.write.split(":")
        print(json.dumps({"write_s": write_set(Path(out), int(count))}))
        return
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.batch, args.steps, args.warmup, args.coins)))
        return
    rows = []
    for count in (int(c) for c in args.sizes.split(",")):
        shard = Path(args.dir) / f"n{count}"
        print(f"{count} records: writing {shard} ...", file=sys.stderr, flush=True)
        written = (
            {"write_s": None} if (shard / "meta.json").is_file() else in_subprocess(["--write", f"{shard}:{count}"])
        )
        print(f"{count} records: measuring ...", file=sys.stderr, flush=True)
        flags = ["--measure", str(shard), "--batch", str(args.batch), "--steps", str(args.steps)]
        flags += ["--warmup", str(args.warmup)] + (["--coins"] if args.coins else [])
        rows.append({**in_subprocess(flags), **written})
        if not args.keep:
            shutil.rmtree(shard)
    add_ratios(rows)
    print_table(rows)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
