"""The size N of a private train split, from registered metadata alone (no example is read).

N sets the DP-SGD sample rate and the number of steps of an epoch budget, so a privacy plan needs
it before any private data is touched (``dpsynth run --dry-run``). dpsynth treats N as public
(docs/privacy.md, "What is treated as public"); here it comes from the registry's per-split counts
and the split protocol of :func:`dpsynth.data.loading.load_private`, never from data values.
"""

from __future__ import annotations

from typing import Any

from dpsynth.data.loading import DEFAULT_TEST_SIZE
from dpsynth.data.registry import parse_spec, resolve
from dpsynth.data.transforms import resolve_holdout
from dpsynth.errors import DataError


def planned_train_size(data: dict[str, Any]) -> int:
    """The number of private train examples a run with the ``data`` config section trains on.

    Raises DataError for a dataset whose size is not registered (a path, or a generated dataset
    with a ``size`` option): then pass the size explicitly (``--num-examples``).
    """
    spec = data["private"]
    _, splits, options, entry = resolve(spec)
    if entry is None or "train" not in entry.info.splits or options:
        raise DataError(f"the train size of {parse_spec(spec)[0]!r} is not registered; "
                        f"give it explicitly (--num-examples N) to plan without reading the data")
    train = int(entry.info.splits["train"])
    if "test" not in splits:
        train -= resolve_holdout(DEFAULT_TEST_SIZE, train)
    if data["val_size"] is not None or "val" not in splits:
        holdout = data["val_size"] if data["val_size"] is not None else entry.val_size
        train -= resolve_holdout(holdout, train)
    if data["max_train"] is not None:
        train = min(train, int(data["max_train"]))
    return train
