"""Nothing the data layer decides is read off private values: pixel range, classes, channels, split, overlap."""

import ast
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpsynth.data import load_dataset, load_private
from dpsynth.data.loading import check_overlap, load_for_run
from dpsynth.data.sizes import planned_num_classes
from dpsynth.data.splits import as_fraction, content_keys, holdout_mask, record_uniforms
from dpsynth.errors import DataError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def unique_images(count, side=6, channels=1, seed=0):
    images = np.random.default_rng(seed).integers(0, 256, (count, side, side, channels), dtype=np.uint8)
    images[:, 0, 0, 0], images[:, 0, 1, 0] = np.arange(count) % 256, np.arange(count) // 256
    return images


# ---------------------------------------------------------------- pixel range
def test_float_npz_needs_a_declared_range_and_one_record_does_not_rescale_the_others(tmp_path):
    values = np.full((4, 3, 3, 1), 0.5, np.float32)
    np.savez(tmp_path / "f.npz", images=values, labels=[0, 1, 0, 1])
    with pytest.raises(DataError, match="float images need a declared pixel range"):
        load_dataset(tmp_path / "f.npz")
    assert load_dataset(tmp_path / "f.npz", pixel_range=[0, 1]).images.max() == 128
    # a second file whose one extra record reaches 200: the declared [0, 255] scaling of the others is unchanged
    np.savez(
        tmp_path / "g.npz",
        images=np.concatenate([values, np.full((1, 3, 3, 1), 200.0, np.float32)]),
        labels=[0, 1, 0, 1, 0],
    )
    assert load_dataset(tmp_path / "g.npz", pixel_range=[0, 255]).images[:4].max() == 0
    with pytest.raises(DataError, match=r"pixel values outside the declared pixel_range \[0, 1\]"):
        load_dataset(tmp_path / "g.npz", pixel_range=[0, 1])


def test_range_stored_in_the_file_and_integer_format_range(tmp_path):
    np.savez(tmp_path / "r.npz", images=np.full((2, 2, 2, 1), -1.0), labels=[0, 1], pixel_range=[-1, 1])
    assert load_dataset(tmp_path / "r.npz").images.max() == 0
    with pytest.raises(DataError, match="conflicting pixel ranges"):
        load_dataset(tmp_path / "r.npz", pixel_range=[0, 1])
    np.savez(tmp_path / "i.npz", images=np.array([[[[0]], [[256]]], [[[-3]], [[9]]]]), labels=[0, 1])
    with pytest.raises(DataError, match=r"integer images hold pixel values outside 0..255"):
        load_dataset(tmp_path / "i.npz")
    np.savez(tmp_path / "u.npz", images=np.zeros((2, 2, 2, 1), np.uint8), labels=[0, 1])
    with pytest.raises(DataError, match="0..255 by format"):
        load_dataset(tmp_path / "u.npz", pixel_range=[0, 1])


def test_dpimagebench_samples_layout_declares_zero_one(tmp_path):
    x = np.random.default_rng(0).uniform(0, 1, (6, 3, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "gen.npz", x=x, y=np.arange(6) % 3)
    ds = load_dataset(tmp_path / "gen.npz")
    assert ds.images.shape == (6, 4, 4, 3) and ds.num_classes == 3
    assert ds.images[2, 1, 3, 0] == np.round(x[2, 0, 1, 3] * 255)
    x[0, 0, 0, :2] = 1.5
    np.savez(tmp_path / "bad.npz", x=x, y=np.arange(6) % 3)
    with pytest.raises(DataError, match=r"pixel values outside the declared pixel_range \[0, 1\]"):
        load_dataset(tmp_path / "bad.npz")


def test_an_out_of_range_private_file_writes_nothing(tmp_path):
    np.savez(
        tmp_path / "p.npz",
        images=np.full((50, 2, 2, 1), 2.0),
        labels=np.arange(50) % 2,
        class_names=np.array(["a", "b"]),
    )
    with pytest.raises(DataError, match=r"pixel values outside the declared pixel_range"):
        load_private(tmp_path / "p.npz", pixel_range=[0, 1])
    assert {p.name for p in tmp_path.iterdir()} - {"cache"} == {"p.npz"}


# ---------------------------------------------------------------- classes and channels
def test_class_count_is_declared_never_the_largest_label(tmp_path):
    np.savez(tmp_path / "c.npz", images=unique_images(60), labels=np.arange(60) % 3)
    with pytest.raises(DataError, match="number of classes is not declared"):
        load_private(tmp_path / "c.npz")
    assert load_private(tmp_path / "c.npz", num_classes=3, val_size=0.2).train.num_classes == 3
    # a declared class is never dropped, and one without a record is not refused (docs/privacy.md)
    wider = load_private(tmp_path / "c.npz", num_classes=5, val_size=0.2)
    assert wider.train.num_classes == 5 and set(wider.train.labels.tolist()) == {0, 1, 2}
    with pytest.raises(DataError, match=r"labels must lie in \[0, 2\)"):
        load_private(tmp_path / "c.npz", num_classes=2)
    np.savez(
        tmp_path / "n.npz",
        images=unique_images(60),
        labels=np.arange(60) % 4,
        class_names=np.array(["a", "b", "c", "d"]),
    )
    splits = load_private(tmp_path / "n.npz", val_size=0.2, max_train=0.9)
    assert splits.num_classes == 4 and splits.test.num_classes == 4 and splits.train.class_names[3] == "d"
    with pytest.raises(DataError, match="data.num_classes=3 but"):
        load_private(tmp_path / "n.npz", num_classes=3)


def test_image_folder_colour_mode_is_declared_not_read_off_the_files(tmp_path):
    for cls in ("a", "b"):
        (tmp_path / "f" / cls).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(np.full((4, 4), 10 * i, np.uint8), "L").save(tmp_path / "f" / cls / f"{i}.png")
    Image.fromarray(np.zeros((4, 4, 3), np.uint8), "RGB").save(tmp_path / "f" / "a" / "zz.png")  # one colour file
    with pytest.raises(DataError, match="needs data.channels"):
        load_private(tmp_path / "f")
    grey = load_private(tmp_path / "f", channels=1, val_size=0.2, test_size=0.2)
    assert grey.image_shape == (1, 4, 4) and grey.num_classes == 2


# ---------------------------------------------------------------- split
def test_record_draws_depend_on_the_seed_and_the_record_only():
    keys = content_keys(unique_images(1000), np.arange(1000) % 3)
    assert np.array_equal(record_uniforms(keys, 7, "val")[:300], record_uniforms(keys[:300], 7, "val"))
    assert np.array_equal(record_uniforms(keys[::-1], 7, "val"), record_uniforms(keys, 7, "val")[::-1])
    assert not np.array_equal(record_uniforms(keys, 7, "val"), record_uniforms(keys, 8, "val"))
    assert not np.array_equal(record_uniforms(keys, 7, "val"), record_uniforms(keys, 7, "test"))
    many = content_keys(unique_images(20000, side=3), np.zeros(20000))
    draws = record_uniforms(many, 0, "test")
    assert abs(draws.mean() - 0.5) < 0.01 and abs(holdout_mask(many, 0.1, 0, "test").mean() - 0.1) < 0.01
    with pytest.raises(DataError, match="uint64"):
        record_uniforms(np.arange(10), 0, "test")  # positions are not record keys


def test_adding_one_record_leaves_every_other_split_unchanged(tmp_path):
    images, labels = unique_images(300), np.arange(300) % 3
    names = np.array(["a", "b", "c"])
    np.savez(tmp_path / "d.npz", images=images, labels=labels, class_names=names)
    np.savez(
        tmp_path / "e.npz",
        images=np.concatenate([images, unique_images(1, seed=9)]),
        labels=np.concatenate([labels, [0]]),
        class_names=names,
    )

    def where(path):
        splits = load_private(path, val_size=0.15, test_size=0.2, max_train=0.5, split_seed=4)
        return {img.tobytes(): name for name in ("train", "val", "test") for img in getattr(splits, name).images}

    before, after = where(tmp_path / "d.npz"), where(tmp_path / "e.npz")
    assert {k: after.get(k) for k in before} == before
    assert sorted(set(before.values())) == ["test", "train", "val"] and len(before) < 300  # max_train dropped some


def test_counts_need_a_documented_size():
    assert as_fraction(5000, 60000, "val_size") == 5000 / 60000 and as_fraction(0.25, None, "val_size") == 0.25
    with pytest.raises(DataError, match="no documented size to take it from; give a fraction"):
        as_fraction(10, None, "val_size")
    splits = load_private("digits8x8", val_size=200, max_train=600)  # counts of the registered sizes
    assert abs(len(splits.val) - 200) < 50 and abs(len(splits.train) - 600) < 80  # expected counts


# ---------------------------------------------------------------- overlap
def test_public_images_that_are_private_records_are_refused_without_their_count(tmp_path):
    private = unique_images(200)
    public = np.concatenate([private[[3, 50, 120]], unique_images(40, seed=5)])
    np.savez(tmp_path / "priv.npz", images=private, labels=np.arange(200) % 2, class_names=np.array(["a", "b"]))
    np.savez(tmp_path / "pub.npz", images=public, labels=np.arange(43) % 2)
    data = {"private": str(tmp_path / "priv.npz"), "public": str(tmp_path / "pub.npz"), "val_size": 0.1}
    with pytest.raises(DataError, match=r"^private images also appear in the public set.*allow_overlap"):
        load_for_run(data)
    assert load_for_run({**data, "allow_overlap": True})[2] == 3
    np.savez(tmp_path / "other.npz", images=public[3:], labels=np.arange(40) % 2)
    splits, public_set, overlap = load_for_run({**data, "public": str(tmp_path / "other.npz")})
    assert overlap == 0 and check_overlap(splits, None) == 0 and len(public_set) == 40


# ---------------------------------------------------------------- import cycles
def _imports(path: Path, package: str) -> set[str]:
    """Every dpsynth.data module ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _module_file(sub) else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package)}
    return found


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_the_data_layer_has_no_import_cycle():
    graph = {}
    for path in (REPO / "dpsynth" / "data").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = _imports(path, "dpsynth.data.") - {module}
    assert "dpsynth.data.tensors" in graph["dpsynth.data.dataset"]

    def cycle_from(node, stack):
        if node in stack:
            return stack[stack.index(node) :] + [node]
        for child in graph.get(node, ()):
            found = cycle_from(child, stack + [node])
            if found:
                return found
        return None

    cycles = [c for m in graph if (c := cycle_from(m, []))]
    assert not cycles, " -> ".join(cycles[0])


def test_the_planned_class_count_is_the_declared_one_or_unknown(tmp_path):
    """K before any record is read: the config's num_classes or class_names, else the registry; own files without
    those keys give None (the run then takes K from the loaded dataset's declaration)."""
    assert planned_num_classes({"private": "mnist10k"}) == 10
    assert planned_num_classes({"private": "mnist10k", "num_classes": 12}) == 12
    assert planned_num_classes({"private": str(tmp_path / "own.npz"), "class_names": ["a", "b", "c"]}) == 3
    assert planned_num_classes({"private": str(tmp_path / "own.npz")}) is None
