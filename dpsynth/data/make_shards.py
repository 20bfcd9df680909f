"""``python -m dpsynth.data.make_shards INPUT OUT``: every split of a dataset as a memory-mapped shard set.

INPUT is anything ``data.private`` takes (an ``.npz``, an image folder, a registered name); OUT becomes a
shard directory (:mod:`dpsynth.data.shards`, docs/datasets.md, "Sets larger than memory"). A module of its
own, which the package never imports, so that ``-m`` runs it cleanly.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dpsynth.data.shards import read_meta, shards_from
from dpsynth.errors import DataError


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
