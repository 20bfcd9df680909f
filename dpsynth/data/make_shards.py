"""``python -m dpsynth.data.make_shards INPUT OUT``: every split of a dataset as a memory-mapped shard set.

INPUT is anything ``data.private`` takes (an ``.npz``, an image folder, a registered name); OUT becomes a
shard directory (:mod:`dpsynth.data.shards`, docs/datasets.md, "Sets larger than memory"). A module of its
own, which the package never imports, so that ``-m`` runs it cleanly; it sits above both the registry and
the shard reader, which is why :func:`shards_from` lives here (no import runs back down to up).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpsynth.data.registry import load_dataset, resolve
from dpsynth.data.shards import SPLITS, read_meta, write_shards
from dpsynth.data.splits import CONTENT_KEY_CHUNK
from dpsynth.errors import DataError


def shards_from(spec: str | Path, out: str | Path, block: int = CONTENT_KEY_CHUNK, **options: Any) -> Path:
    """A shard set at ``out`` holding every split of the dataset ``spec`` (a path or a registered name, read
    by dpsynth's own readers with reader ``options``, one split in memory at a time); returns ``out``."""
    _, available, _, _ = resolve(spec)
    for split in (s for s in SPLITS if s in available):
        dataset = load_dataset(spec, split, **options)
        blocks = (dataset.images[start : start + block] for start in range(0, len(dataset), block))
        write_shards(
            blocks,
            dataset.labels,
            out,
            num_classes=dataset.num_classes,
            class_names=dataset.class_names,
            split=split,
        )
    return Path(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Write every split of INPUT as a shard set at OUT; 0 on success, 1 on a data error, 2 on bad usage."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m dpsynth.data.make_shards INPUT OUT  (INPUT: an .npz, a folder or a dataset name)")
        return 2
    try:
        out = shards_from(args[0], args[1])
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(f'{s}: {n}' for s, n in read_meta(out)['splits'].items())} records to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
