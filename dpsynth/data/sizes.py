"""The size N of a private train split, from registered metadata alone (no example is read).

N sets the DP-SGD sample rate and the number of steps of an epoch budget, so a privacy plan needs
it before any private data is touched (``dpsynth run --dry-run``). dpsynth treats N as public
(docs/privacy.md, "What is treated as public"); here it comes from the registry's per-split counts
and the split protocol of :func:`dpsynth.data.loading.load_private`, never from data values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpsynth.data.loading import DEFAULT_TEST_SIZE, resolve_val_size, split_masks
from dpsynth.data.registry import parse_spec, resolve
from dpsynth.data.section import DataSection, as_data_section
from dpsynth.errors import DataError


def planned_train_size(data: DataSection | Mapping[str, Any]) -> int:
    """The number of private train examples a run with the ``data`` config section trains on.

    Each record's split is a draw keyed on its own content (:mod:`dpsynth.data.splits`), so without
    reading the records this is exact only where no hold-out or ``max_train`` is drawn; otherwise it is
    a stand-in of the same binomial law, and the run itself plans on the size it loads. Raises
    DataError for a dataset whose size is not registered (a path, or a generated dataset with a
    ``size`` option): then pass the size explicitly (``--num-examples``).
    """
    data = as_data_section(data)
    spec = data.private
    _, splits, options, entry = resolve(spec)
    if entry is None or "train" not in entry.info.splits or options:
        raise DataError(
            f"the train size of {parse_spec(spec)[0]!r} is not registered; "
            f"give it explicitly (--num-examples N) to plan without reading the data"
        )
    documented = int(entry.info.splits["train"])
    keep, _ = split_masks(
        documented,
        own_val=data.val_size is None and "val" in splits,
        own_test="test" in splits,
        documented=documented,
        val_size=resolve_val_size(data.val_size, entry),
        test_size=DEFAULT_TEST_SIZE,
        max_train=data.max_train,
        split_seed=data.split_seed,
        num_classes=entry.info.classes,
        source=str(spec),
    )
    return int(keep.sum())
