"""``dataset.yaml`` beside own data: classes and pixel range declared once, read by the data layer, overridden by
``--set data.*``; a bad file stops at load with one line naming the file, the key and the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpsynth.cli import main
from dpsynth.config import load_config
from dpsynth.data import load_private
from dpsynth.data.declaration import DATASET_FILE, read_declaration
from dpsynth.data.loading import private_options
from dpsynth.errors import DataError

PRESET = "dpsgd-classifier/smoke"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def grey_npz(tmp_path: Path, floats: bool = False) -> Path:
    rng = np.random.default_rng(0)
    images = rng.random((120, 10, 10)).astype(np.float32) if floats else rng.integers(0, 256, (120, 10, 10), np.uint8)
    folder = tmp_path / "data"
    folder.mkdir(exist_ok=True)
    np.savez(folder / "set.npz", images=images, labels=np.arange(120) % 3)
    return folder / "set.npz"


def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    rng = np.random.default_rng(1)
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for index in range(60):
            Image.fromarray(rng.integers(0, 256, (10, 10), np.uint8)).save(root / name / f"{index}.png")
    return root


def declare(path: Path, text: str) -> Path:
    target = (path if path.is_dir() else path.parent) / DATASET_FILE
    target.write_text(text)
    return target


def test_npz_classes_and_float_range_come_from_dataset_yaml(tmp_path):
    archive = grey_npz(tmp_path, floats=True)
    declare(archive, "classes: [a, b, c]\npixel_range: [0, 1]\n")
    config = load_config(PRESET, [f"data.private={archive}", "data.max_train=null"])
    assert config.data.num_classes == 3 and config.data.class_names == ["a", "b", "c"]
    assert config.data.pixel_range == [0.0, 1.0]
    splits = load_private(config.data.private, **private_options(config.data))
    assert splits.train.num_classes == 3 and splits.train.class_names == ["a", "b", "c"]


def test_set_data_overrides_dataset_yaml(tmp_path):
    archive = grey_npz(tmp_path)
    declare(archive, "num_classes: 3\nchannels: 1\n")
    config = load_config(PRESET, [f"data.private={archive}", "data.max_train=null", "data.channels=3"])
    assert config.data.channels == 3 and config.data.num_classes == 3


def test_folder_tree_declares_channels_inside_it(tmp_path):
    root = tree(tmp_path)
    declare(root, "classes: [cat, dog]\nchannels: 1\nimage_size: 10\n")
    config = load_config(PRESET, [f"data.private={root}", "data.max_train=null"])
    assert (config.data.channels, config.data.image_size, config.data.num_classes) == (1, 10, 2)


def test_numeric_class_names_are_names(tmp_path):
    archive = grey_npz(tmp_path)
    declare(archive, "classes: [0, 1, 2]\n")
    assert read_declaration(archive)["class_names"] == ["0", "1", "2"]


def test_without_dataset_yaml_nothing_is_declared(tmp_path):
    assert read_declaration(grey_npz(tmp_path)) == {} and read_declaration("mnist10k") == {}


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("- a\n- b\n", ["expected a mapping of keys", "classes"]),
        ("classes: [a, b\n", ["invalid YAML"]),
        ("clases: [a, b, c]\n", ["unknown key 'clases'", "known: classes"]),
        ("classes: [a, a, b]\n", ["key 'classes'", "distinct"]),
        ("classes: [a, b]\nnum_classes: 3\n", ["num_classes 3 but 2 classes named"]),
        ("num_classes: 0\n", ["key 'num_classes' = 0", "greater than or equal to 1"]),
        ("pixel_range: [1, 0]\n", ["key 'pixel_range'", "low < high"]),
        ("channels: 2\n", ["key 'channels' = 2", "expected 1 or 3"]),
    ],
    ids=["list", "bad-yaml", "unknown-key", "duplicate-class", "count-mismatch", "zero", "range", "channels"],
)
def test_bad_dataset_yaml_is_one_line_naming_the_file_and_key(text, fragments, tmp_path, capsys):
    archive = grey_npz(tmp_path)
    declared = declare(archive, text)
    out = tmp_path / "run"
    capsys.readouterr()
    code = main(["run", PRESET, f"--set=data.private={archive}", "--set=data.max_train=null", "--out", str(out)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"error: {declared}: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists()  # stopped at load: no run directory, no privacy.json


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("classes: [dog, cat]\n", "differs from the class folders ['cat', 'dog']"),
        ("num_classes: 3\n", "'num_classes' = 3 but the folder has 2 class folders"),
        ("pixel_range: [0, 1]\n", "image files are 0..255 by format"),
    ],
)
def test_dataset_yaml_must_agree_with_a_folder_tree(text, fragment, tmp_path):
    root = tree(tmp_path)
    declare(root, text)
    with pytest.raises(DataError, match=r"dataset\.yaml: key") as err:
        read_declaration(root)
    assert fragment in str(err.value)
