"""A flat folder of images with ``labels.csv``: read with the classes ``dataset.yaml`` declares, counted and
shaped from its listing, and every gap between the images and the rows a one-line error with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpsynth.cli import main
from dpsynth.config import load_config
from dpsynth.data import load_private
from dpsynth.data.loading import private_options
from dpsynth.data.readers import detect_format, read_path
from dpsynth.data.readers.flat import LABELS_FILE
from dpsynth.data.sizes import planned_image_shape, planned_train_size
from dpsynth.errors import DataError

CLASSES = ("face", "other")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def flat_folder(tmp_path: Path, count: int = 60, header: str = "file,label", names: bool = True) -> Path:
    """``count`` grey 10x10 images with a labels.csv; labels alternate, as class names or indices."""
    root = tmp_path / "flat"
    root.mkdir()
    rng = np.random.default_rng(0)
    rows = [header]
    for index in range(count):
        Image.fromarray(rng.integers(0, 256, (10, 10), np.uint8)).save(root / f"img{index:03d}.png")
        label = CLASSES[index % 2] if names else str(index % 2)
        rows.append(f"img{index:03d}.png,{label}")
    (root / LABELS_FILE).write_text("\n".join(rows) + "\n")
    return root


def test_name_labels_map_through_the_declared_classes_in_row_order(tmp_path):
    root = flat_folder(tmp_path)
    assert detect_format(root) == "flat"
    data = read_path(root, class_names=list(CLASSES), grey=True)
    assert data.images.shape == (60, 10, 10, 1) and data.class_names == list(CLASSES)
    assert data.labels.tolist() == [i % 2 for i in range(60)]
    assert np.array_equal(data.images[7, ..., 0], np.asarray(Image.open(root / "img007.png")))


def test_index_labels_and_other_header_names(tmp_path):
    root = flat_folder(tmp_path, header="id,class", names=False)
    assert read_path(root, grey=True).labels.tolist() == [i % 2 for i in range(60)]


def test_a_run_reads_it_with_dataset_yaml_and_plans_from_the_listing(tmp_path):
    root = flat_folder(tmp_path, count=200)
    (root / "dataset.yaml").write_text("classes: [face, other]\nchannels: 1\n")
    config = load_config("dpsgd-classifier/smoke", [f"data.private={root}", "data.max_train=null"])
    assert planned_image_shape(config.data) == (1, 10, 10)
    splits = load_private(config.data.private, **private_options(config.data))
    assert splits.train.class_names == list(CLASSES) and splits.train.num_classes == 2
    assert len(splits.train) + len(splits.val) + len(splits.test) == 200
    # planned from the 200 rows without reading a pixel: the same binomial law as the keyed split (std ~ 6)
    assert abs(planned_train_size(config.data) - len(splits.train)) < 30


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda root: (root / LABELS_FILE).unlink(), "images with no labels; add labels.csv"),
        (lambda root: (root / LABELS_FILE).write_text("name;label\nimg000.png;face\n"), "must name a file column"),
        (
            lambda root: (root / "img999.png").write_bytes((root / "img000.png").read_bytes()),
            "image file(s) have no row in labels.csv (first: img999.png)",
        ),
        (lambda root: _append(root, "ghost.png,face"), "row 62 lists ghost.png, which is not an image file"),
        (lambda root: _append(root, "img000.png,face"), "row 62 lists img000.png a second time"),
        (lambda root: _append(root, "img000.png"), "row 62 lacks a file name or a label"),
    ],
    ids=["no-labels-file", "bad-header", "unlisted-image", "missing-image", "twice", "short-row"],
)
def test_every_gap_between_images_and_rows_is_one_line_with_the_fix(edit, fragment, tmp_path):
    root = flat_folder(tmp_path)
    edit(root)
    with pytest.raises(DataError) as err:
        read_path(root, class_names=list(CLASSES), grey=True)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_declared_class_no_row_names_is_a_class_without_records_not_an_error(tmp_path):
    """dataset.yaml may declare a class that labels.csv never uses: the class exists with no record, and the run
    loads as any other (whether a run exists must not depend on a per-class count; docs/privacy.md)."""
    root = flat_folder(tmp_path)
    data = read_path(root, class_names=[*CLASSES, "rare"], grey=True)
    assert data.num_classes == 3 and np.bincount(data.labels, minlength=3).tolist() == [30, 30, 0]
    (root / "dataset.yaml").write_text("classes: [face, other, rare]\nchannels: 1\n")
    splits = load_private(root, class_names=[*CLASSES, "rare"], channels=1)
    assert splits.train.num_classes == 3 and 2 not in set(splits.train.labels.tolist())


def test_a_label_outside_the_declared_classes_names_the_row_not_the_label(tmp_path):
    root = flat_folder(tmp_path)
    with pytest.raises(DataError, match="the label of row 2 is not one of the 1 classes") as err:
        read_path(root, class_names=["other"], grey=True)
    assert "face" not in str(err.value).replace(str(tmp_path), "")
    with pytest.raises(DataError, match="row 2 is not a class index; name the classes in dataset.yaml"):
        read_path(root, grey=True)


def test_without_declared_classes_the_run_stops_naming_dataset_yaml(tmp_path):
    root = flat_folder(tmp_path)
    with pytest.raises(DataError, match="labels.csv labels the records but lists no classes.*dataset.yaml"):
        load_private(root, channels=1)


def test_a_declaration_may_not_give_an_image_folder_a_float_range(tmp_path):
    root = flat_folder(tmp_path)
    (root / "dataset.yaml").write_text("classes: [face, other]\npixel_range: [0, 1]\n")
    with pytest.raises(DataError, match="image files are 0..255 by format"):
        load_config("dpsgd-classifier/smoke", [f"data.private={root}"])


def _append(root: Path, row: str) -> None:
    with (root / LABELS_FILE).open("a") as handle:
        handle.write(row + "\n")


def test_dpsynth_run_releases_from_a_flat_folder(tmp_path, capsys):
    root = flat_folder(tmp_path, count=200)
    (root / "dataset.yaml").write_text("classes: [face, other]\nchannels: 1\n")
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "dpsgd-classifier/smoke",
                "--out",
                str(out),
                f"--set=data.private={root}",
                "--set=data.max_train=null",
            ]
        )
        == 0
    )
    assert json.loads((out / "privacy.json").read_text())["epsilon"] > 0


def test_a_flat_folder_without_labels_stops_the_run_before_it_starts(tmp_path, capsys):
    root = flat_folder(tmp_path)
    (root / LABELS_FILE).unlink()
    out = tmp_path / "run"
    assert main(["run", "dpsgd-classifier/smoke", "--out", str(out), f"--set=data.private={root}"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "add labels.csv" in lines[0] and not out.exists()
