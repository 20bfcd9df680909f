"""Neighbouring datasets: D and D' = D plus one extreme record must load identically for every other record.

Everything the data layer derives outside the privacy ledger (pixel scaling, class count, channels,
image shape, each record's split, the public set, the resolved config) must either be identical for
D and D' or refuse D' outright. The data layer is shared by every method, so the check runs at the
``load_for_run`` level with each registered method's smoke-config data section, plus one run-level
check through the runner.
"""

from pathlib import Path

import numpy as np
import pytest
import yaml

from dpsynth.config import load_config, resolve_config, with_changes
from dpsynth.data import load_private
from dpsynth.data.loading import load_for_run
from dpsynth.errors import DataError
from dpsynth.methods import METHODS
from dpsynth.runner import load_run_data, run_config

REPO = Path(__file__).resolve().parents[2]
RECORDS = 600
NAMES = np.array([str(d) for d in range(10)])

# dpsynth's own methods (a test module may register a test-only one in the same process)
BUILT_IN = sorted(name for name, cls in METHODS.items() if cls.__module__.startswith("dpsynth."))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def base():
    """600 real mnist10k digits (uint8, 0..255 by format), each made unique by its index in one corner pixel pair."""
    train = load_private("mnist10k").train  # stored sorted by class: take every 11th digit
    images = train.images[::11][:RECORDS].copy()
    images[:, 0, 0, 0] = np.arange(RECORDS) % 256
    images[:, 0, 1, 0] = np.arange(RECORDS) // 256
    return images, train.labels[::11][:RECORDS].copy()


def write(path, images, labels, **extra):
    np.savez(path, images=images, labels=labels, class_names=NAMES, **extra)
    return path


def neighbour(tmp_path, base, kind):
    """(D, D') paths; D' appends one record: all-255 pixels, a label outside the classes, or float pixels."""
    images, labels = base
    d = write(tmp_path / "d.npz", images, labels)
    extra_image = np.full((1, *images.shape[1:]), 255, np.uint8)
    extra_label = {"extreme_pixels": 3, "new_class": 10}[kind]
    d_prime = write(
        tmp_path / "d_prime.npz", np.concatenate([images, extra_image]), np.concatenate([labels, [extra_label]])
    )
    return d, d_prime


def record_splits(splits):
    """{image bytes: split name} for every record that reached a split."""
    return {image.tobytes(): name for name in ("train", "val", "test") for image in getattr(splits, name).images}


def smoke_data_section(method):
    """The resolved data section of the method's smoke config (dpsgd-classifier has none: the CLI test's)."""
    path = REPO / "dpsynth" / "presets" / method / "smoke.yaml"
    if path.is_file():
        return load_config(path).data.model_dump()
    return resolve_config({"method": method, "data": {"private": "mnist10k", "max_train": 300}}).data.model_dump()


@pytest.mark.parametrize("method", BUILT_IN)
def test_one_extreme_record_changes_nothing_for_the_others(tmp_path, base, method):
    data = smoke_data_section(method)
    d, d_prime = neighbour(tmp_path, base, "extreme_pixels")
    if isinstance(data["max_train"], int):
        # a count needs a documented dataset size; a file on disk has none, so D and D' are both refused
        messages = set()
        for path in (d, d_prime):
            with pytest.raises(DataError, match="give a fraction") as err:
                load_for_run({**data, "private": str(path)})
            messages.add(str(err.value).replace(str(path), "PATH"))
        assert len(messages) == 1
        data["max_train"] = data["max_train"] / RECORDS
    splits, public, overlap = load_for_run({**data, "private": str(d)})
    splits2, public2, overlap2 = load_for_run({**data, "private": str(d_prime)})
    assert splits.num_classes == splits2.num_classes == 10
    assert splits.image_shape == splits2.image_shape
    assert [s.class_names for s in (splits.train, splits.val, splits.test)] == [
        s.class_names for s in (splits2.train, splits2.val, splits2.test)
    ]
    before, after = record_splits(splits), record_splits(splits2)
    images = base[0]
    kept = {image.tobytes() for image in images} & set(before)
    assert len(kept) > 0.5 * len(before)
    # pixel scaling: every original record arrives with the same bytes, in the same split
    assert {k: after.get(k) for k in kept} == {k: before[k] for k in kept}
    assert set(after) - set(before) <= {np.full(images.shape[1:], 255, np.uint8).tobytes()}
    if public is not None:
        assert np.array_equal(public.images, public2.images) and np.array_equal(public.labels, public2.labels)
    assert overlap == overlap2 == 0


@pytest.mark.parametrize("method", BUILT_IN)
def test_a_record_of_a_new_class_is_refused(tmp_path, base, method):
    data = {**smoke_data_section(method), "max_train": 0.5}
    d, d_prime = neighbour(tmp_path, base, "new_class")
    load_for_run({**data, "private": str(d)})
    with pytest.raises(DataError, match=r"labels must lie in \[0, 10\)"):
        load_for_run({**data, "private": str(d_prime)})


def test_float_record_outside_the_declared_range_is_refused_and_scaling_is_fixed(tmp_path, base):
    images, labels = base
    floats = images.astype(np.float32) / 255.0
    extreme = np.full((1, *images.shape[1:]), 3.0, np.float32)
    write(tmp_path / "f.npz", floats, labels)
    write(tmp_path / "f_prime.npz", np.concatenate([floats, extreme]), np.concatenate([labels, [3]]))
    data = {"private": str(tmp_path / "f.npz"), "pixel_range": [0, 1], "val_size": 0.1}
    splits, _, _ = load_for_run(data)
    assert splits.train.images.max() == 255  # [0, 1] maps to 0..255, whatever the other records hold
    with pytest.raises(DataError, match=rf"^{tmp_path / 'f_prime.npz'}: pixel values outside the declared"):
        load_for_run({**data, "private": str(tmp_path / "f_prime.npz")})
    wide = {**data, "pixel_range": [0, 255]}  # a declared range wide enough for D' scales D the same way
    a, b = load_for_run({**wide})[0], load_for_run({**wide, "private": str(tmp_path / "f_prime.npz")})[0]
    assert record_splits(a) == {k: v for k, v in record_splits(b).items() if k in record_splits(a)}


def test_resolved_config_does_not_depend_on_the_data(tmp_path, base):
    d, d_prime = neighbour(tmp_path, base, "extreme_pixels")
    smoke = REPO / "dpsynth" / "presets" / "dpdm" / "smoke.yaml"
    first = load_config(smoke, [f"data.private={d}"]).to_dict()
    second = load_config(smoke, [f"data.private={d_prime}"]).to_dict()
    first["data"].pop("private"), second["data"].pop("private")
    assert first == second


def test_run_level_split_is_stable_and_a_new_class_is_refused_before_anything_is_written(tmp_path, base):
    d, d_prime = neighbour(tmp_path, base, "extreme_pixels")
    config = load_config(
        REPO / "dpsynth" / "presets" / "dpdm" / "smoke.yaml",
        [f"data.private={d}", "data.max_train=null", "data.val_size=0.1"],
    )
    splits, public = load_run_data(config)
    splits2, public2 = load_run_data(with_changes(config, {"data": {"private": str(d_prime)}}))
    before, after = record_splits(splits), record_splits(splits2)
    assert all(after[k] == v for k, v in before.items()) and len(after) == len(before) + 1
    assert np.array_equal(public.images, public2.images)
    (tmp_path / "n").mkdir()
    _, new_class = neighbour(tmp_path / "n", base, "new_class")
    (tmp_path / "cfg.yaml").write_text(
        yaml.safe_dump(
            {
                "method": "dpsgd-classifier",
                "data": {"private": str(new_class), "val_size": 0.1},
                "dpsgd-classifier": {"model": "logreg", "steps": 1, "batch_size": 16},
                "generate": {"num": 10},
            }
        )
    )
    with pytest.raises(DataError, match=r"labels must lie in \[0, 10\)"):
        run_config(tmp_path / "cfg.yaml", out=tmp_path / "run", echo=False)
    assert not (tmp_path / "run").exists()
