"""The real data a run is scored on when its run directory cannot name it: a run fitted on in-memory arrays.

A run directory keeps no private image, and a run fitted on arrays has no dataset name or path to reload
(``data.private`` is ``<arrays>``; ``dataset.json`` holds only the image shape, the class count and the
train size, all public). Its evaluation therefore takes the data from the caller, in one of two ways:

* **held-out arrays** (``test_data=(images, labels)`` or an ``.npz`` with ``images`` and ``labels``):
  scored as they are, as the test split; the fidelity metrics then compare with them (``fid_reference``
  ``test``), since there is no train split to compare with;
* **the arrays the run was fitted on** (``data=(images, labels)``, or a path to the same records): split
  again by the run's own ``data`` section. The hold-outs are keyed on each record's content and
  ``data.split_seed`` (:mod:`dpsynth.data.splits`), so the same records give the same test split the run
  held out, never a record it trained on; a train size that differs from the recorded one is refused.

Both are read as ``fit`` reads arrays (:func:`dpsynth.data.arrays.private_images`: NHWC, NHW or NCHW,
floats in ``data.pixel_range``) with the run's declared class count, and every error names the fix and
quotes no private value.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.errors import ConfigError, DataError
from dpsynth.rundir import DATASET_FILE, IN_MEMORY
from dpsynth.sections import RunConfig

#: the one line an arrays run without data gets, naming both ways to give it
ARRAYS_RUN_NEEDS_DATA = (
    "{run} was fitted on in-memory arrays, which a run directory does not keep: pass held-out arrays "
    "(Synthesizer.evaluate(test_images, test_labels), dpsynth evaluate RUN --test-data FILE.npz) or the "
    "arrays the run was fitted on (evaluate(data=(images, labels)), --data FILE.npz), whose held-out "
    "split is drawn again exactly as the run drew it"
)
HELD_OUT_SOURCE = "the held-out arrays"


def fitted_on_arrays(run_config: RunConfig | None) -> bool:
    """Whether the run was fitted on in-memory arrays (``data.private`` is ``<arrays>``)."""
    return run_config is not None and run_config.data.private == IN_MEMORY


def read_dataset_record(run_dir: Path | None) -> dict[str, Any]:
    """The run's ``dataset.json`` (image shape, class count, train size of an arrays run), or ``{}``."""
    path = None if run_dir is None else Path(run_dir) / DATASET_FILE
    if path is None or not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def declared_classes(run_config: RunConfig, run_dir: Path | None) -> int | None:
    """The run's class count: ``data.num_classes``, else the one ``fit`` recorded in ``dataset.json``."""
    if run_config.data.num_classes is not None:
        return int(run_config.data.num_classes)
    recorded = read_dataset_record(run_dir).get("num_classes")
    return int(recorded) if isinstance(recorded, int) else None


def held_out_splits(test_data: Any, run_config: RunConfig | None, run_dir: Path | None, image_shape: tuple) -> Any:
    """Splits whose test split is ``test_data`` (``(images, labels)`` or an ``.npz`` path), train and val empty.

    ``image_shape`` is the samples' ``(H, W, C)``: the held-out images must match it after the run's
    ``data.image_size`` / ``data.channels`` are applied, as the run's own splits do.
    """
    from dpsynth.data import ImageDataset, PrivateSplits
    from dpsynth.data.arrays import as_dataset, private_images
    from dpsynth.data.loading import check_channels, check_records
    from dpsynth.data.transforms import prepare

    if run_config is None:
        raise ConfigError("held-out arrays score a run: evaluate a run directory, not a bare .npz")
    num_classes = declared_classes(run_config, run_dir)
    if num_classes is None:
        raise DataError("the run declares no class count (data.num_classes); set it to score held-out arrays")
    images, labels = _read_pair(test_data)
    data_cfg = run_config.data
    # ImageDataset refuses a label outside 0..K-1 in one line that quotes neither a label nor a count
    test = as_dataset(private_images(images, data_cfg), labels, num_classes, "held-out")
    check_records(test, HELD_OUT_SOURCE)
    check_channels(test, data_cfg.channels, data_cfg.colour_to_grey, HELD_OUT_SOURCE)
    test = prepare(test, data_cfg.image_size, data_cfg.channels)
    channels, height, width = test.image_shape
    if (height, width, channels) != tuple(image_shape):
        raise DataError(
            f"{HELD_OUT_SOURCE} are {height}x{width}x{channels} images, the run's samples "
            f"{'x'.join(str(d) for d in image_shape)}: pass images of the size the run was fitted on"
        )
    empty = ImageDataset(np.zeros((0, height, width, channels), np.uint8), np.zeros(0, np.int64), num_classes, "none")
    return PrivateSplits(empty, empty, test)


def array_run_splits(data: Any, run_config: RunConfig, run_dir: Path | None) -> Any:
    """The splits an arrays run drew, drawn again from ``data`` (the arrays or a path holding the same
    records) by the run's ``data`` section and the one loader (:func:`dpsynth.data.source.load_source`);
    refused when the train size differs from the recorded one."""
    from dpsynth.data.source import DatasetSource, load_source

    if data is None:
        raise DataError(ARRAYS_RUN_NEEDS_DATA.format(run=run_dir or "this run"))
    num_classes = declared_classes(run_config, run_dir)
    images, labels = (data, None) if isinstance(data, (str, Path)) else _read_pair(data)
    source = DatasetSource.of(images, labels, num_classes=num_classes)
    splits, _, _ = load_source(run_config.data, dataclasses.replace(source, with_public=False))
    recorded = read_dataset_record(run_dir).get("train_size")
    if isinstance(recorded, int) and recorded != len(splits.train):
        raise DataError(
            f"these are not the records the run was fitted on (its train split held {recorded} records, these "
            "split differently): pass the same arrays fit got, or held-out arrays as test data"
        )
    return splits


def write_dataset_record(run_dir: Path, train: Any) -> None:
    """``dataset.json`` of a run fitted on arrays: the declared image shape and classes and the train size N,
    all public (N by the stated assumption, docs/privacy.md); no record or per-class figure."""
    from dpsynth.checkpoint import atomic_write_json

    channels, height, width = train.image_shape
    atomic_write_json(
        Path(run_dir) / DATASET_FILE,
        {
            "shape": [height, width, channels],
            "num_classes": train.num_classes,
            "class_names": train.class_names,
            "train_size": len(train),
        },
    )


def recorded_source(run_dir: Path) -> Any:
    """The data source of a reopened arrays run (to generate from it): empty splits of the recorded image
    shape and classes, since there is nothing to reload; None for a run without ``dataset.json``."""
    from dpsynth.data import ImageDataset, PrivateSplits
    from dpsynth.data.source import DatasetSource

    record = read_dataset_record(run_dir)
    if not record:
        return None
    empty = ImageDataset(
        np.zeros((0, *record["shape"]), np.uint8),
        np.zeros(0, np.int64),
        record["num_classes"],
        "private",
        record["class_names"],
    )
    return DatasetSource(private=PrivateSplits(empty, empty, empty))


def _read_pair(data: Any) -> tuple[Any, Any]:
    """``(images, labels)`` from a pair or an ``.npz`` holding ``images`` and ``labels``."""
    if isinstance(data, (str, Path)):
        return _read_npz(Path(data))
    if isinstance(data, (tuple, list)) and len(data) == 2:
        images, labels = data
        if labels is None:
            raise DataError(f"{HELD_OUT_SOURCE} need their labels: evaluate(test_images, test_labels)")
        return images, labels
    raise DataError(f"{HELD_OUT_SOURCE}: expected (images, labels) or an .npz path, got {type(data).__name__}")


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if path.suffix != ".npz" or not path.is_file():
        raise DataError(f"{path}: held-out data must be an existing .npz file with arrays 'images' and 'labels'")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not {"images", "labels"} <= set(archive.files):
                raise DataError(f"{path}: held-out data needs arrays 'images' and 'labels'")
            return archive["images"], archive["labels"]
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npz ({exc.__class__.__name__})") from None
