"""A custodian's own data: every bad input stops with one line that names the key or file and the fix.

Each case feeds one bad input through ``dpsynth run`` (in this process, as ``dpsynth.cli.main``) or
through ``Synthesizer.fit``, and checks that the run stops before its run directory exists: no
``privacy.json`` is left claiming a spend that was never made (docs/own-data.md).
Messages never quote a private value (tests/test_private_values.py); the train size N may appear.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpsynth.api import Synthesizer
from dpsynth.cli import main
from dpsynth.errors import DPSynthError

RUN = "dpsgd-classifier/smoke"  # the cheapest preset: nothing below gets as far as training
SECRET_PIXEL = 123.456  # a private value no message may quote


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def faces(count=200, side=25, channels=1, seed=0):
    """Distinct grey (or colour) records and 2 classes, like the face/non-face set of the issue."""
    rng = np.random.default_rng(seed)
    shape = (count, side, side) if channels == 1 else (count, side, side, channels)
    return rng.integers(0, 256, shape, dtype=np.uint8), rng.integers(0, 2, count)


def npz(tmp_path: Path, name: str = "faces.npz", **arrays) -> Path:
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def run_error(tmp_path: Path, capsys, *overrides: str, preset: str = RUN) -> str:
    """The one ``error:`` line of ``dpsynth run PRESET --set ...``; checks that no run was left behind."""
    out = tmp_path / "run"
    args = ["run", preset, "--out", str(out)] + [f"--set={item}" for item in overrides]
    capsys.readouterr()
    assert main(args) == 1
    console = capsys.readouterr()
    lines = [line for line in console.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), console.err
    assert console.out == ""
    assert not (out / "privacy.json").exists() and not out.exists()
    return lines[0].replace(str(tmp_path), "<dir>")  # the user's own paths are not data


def fit_error(tmp_path: Path, *args, overrides: dict | None = None, **kwargs) -> str:
    """The one-line message of ``Synthesizer(...).fit(*args)``; checks that no privacy.json was written."""
    out = tmp_path / "api-run"
    with pytest.raises(DPSynthError) as err:
        Synthesizer("dpsgd-classifier", overrides=overrides).fit(*args, out=out, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    assert not (out / "privacy.json").exists()
    return message.replace(str(tmp_path), "<dir>")


# ------------------------------------------------------------------ the class declaration


def test_an_undeclared_class_count_names_the_key_and_how_to_set_it(tmp_path, capsys):
    images, labels = faces()
    line = run_error(tmp_path, capsys, f"data.private={npz(tmp_path, images=images, labels=labels)}")
    assert "data.num_classes" in line and "--set data.num_classes=K" in line and "num_classes=K" in line


def test_arrays_without_num_classes_say_how_to_pass_it(tmp_path):
    message = fit_error(tmp_path, *faces())
    assert "in-memory arrays" in message and "Synthesizer.fit(..., num_classes=K)" in message


def test_num_classes_given_to_fit_declares_a_files_classes(tmp_path):
    """``fit(path, num_classes=K)`` sets data.num_classes, so the message's Python fix works for a path too."""
    images, labels = faces()
    path = npz(tmp_path, images=images, labels=labels)
    message = fit_error(tmp_path, str(path), num_classes=2, overrides={"data.max_train": 3000})
    assert "number of classes" not in message and "data.max_train=3000" in message  # past the class check


# ------------------------------------------------------------------ data.max_train


def test_a_max_train_count_on_a_file_says_give_a_fraction_or_null(tmp_path, capsys):
    images, labels = faces()
    path = npz(tmp_path, images=images, labels=labels, num_classes=2)
    line = run_error(tmp_path, capsys, f"data.private={path}", "data.max_train=300")
    assert "data.max_train=300 is a count" in line and "fraction" in line and "null" in line


def test_a_max_train_count_on_arrays_names_the_arrays(tmp_path):
    message = fit_error(tmp_path, *faces(), num_classes=2, overrides={"data.max_train": 300})
    assert "data.max_train=300" in message and "in-memory arrays" in message and "null" in message


def test_a_max_train_count_larger_than_a_registered_dataset_is_refused(tmp_path, capsys):
    line = run_error(tmp_path, capsys, "data.private=digits8x8", "data.max_train=5000")
    assert "data.max_train=5000 is more than the 1257 train records" in line and "null" in line


# ------------------------------------------------------------------ pixels


def float_faces(*planted: float):
    """Float faces in [0, 1] with one planted pixel value per record 5, 6, ..."""
    images, labels = faces()
    values = images.astype(np.float32) / 255
    for record, value in enumerate(planted, start=5):
        values[record, 3, 4] = value
    return values, labels


@pytest.mark.parametrize(
    "planted, named, absent",
    [
        ([np.nan], "NaN pixel values", ["infinite", "outside"]),
        ([np.inf], "infinite pixel values", ["NaN", "outside"]),
        ([SECRET_PIXEL], "pixel values outside the declared pixel_range [0, 1]", ["NaN", "infinite"]),
        ([np.nan, -np.inf], "NaN and infinite pixel values", ["outside"]),
    ],
    ids=["nan", "inf", "out-of-range", "nan-and-inf"],
)
def test_nan_infinite_and_out_of_range_pixels_are_told_apart(tmp_path, capsys, planted, named, absent):
    images, labels = float_faces(*planted)
    path = npz(tmp_path, images=images, labels=labels, num_classes=2)
    line = run_error(tmp_path, capsys, f"data.private={path}", "data.max_train=null", "data.pixel_range=[0,1]")
    assert named in line and ("data.pixel_range" in line or "numpy.is" in line), line
    assert not [word for word in absent if word in line], line
    assert "123.4" not in line and "pixel(s)" not in line and " 1 pixel" not in line  # never a value or a count


def test_float_arrays_take_the_declared_range_and_refuse_nan(tmp_path):
    images, labels = float_faces(np.nan)
    message = fit_error(tmp_path, images, labels, num_classes=2, overrides={"data.pixel_range": [0, 1]})
    assert "in-memory arrays" in message and "NaN pixel values" in message
    message = fit_error(tmp_path, images, labels, num_classes=2)
    assert "data.pixel_range" in message  # float arrays need their range declared, like a float .npz


# ------------------------------------------------------------------ files that are not a dataset


def test_a_file_that_is_not_an_archive_gets_no_allow_pickle_hint(tmp_path, capsys):
    path = tmp_path / "faces.npz"
    path.write_text("id,label\n1,0\n")
    line = run_error(tmp_path, capsys, f"data.private={path}")
    assert "not an .npz archive" in line and "numpy.savez" in line and "allow_pickle" not in line


@pytest.mark.parametrize(
    "name, content, fix",
    [
        ("faces.npy", None, "numpy.savez"),
        ("faces.zip", b"PK\x05\x06" + bytes(18), "unpack the archive"),
        ("face.png", "png", "folder"),
    ],
)
def test_a_single_file_of_another_kind_says_what_to_turn_it_into(tmp_path, capsys, name, content, fix):
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, faces()[0])
    elif content == "png":
        Image.fromarray(faces()[0][0]).save(path)
    else:
        path.write_bytes(content)
    line = run_error(tmp_path, capsys, f"data.private={path}")
    assert "unsupported file" in line and fix in line


def test_an_npy_array_named_npz_is_told_apart(tmp_path, capsys):
    path = tmp_path / "faces.npz"
    with open(path, "wb") as handle:
        np.save(handle, faces()[0])
    line = run_error(tmp_path, capsys, f"data.private={path}")
    assert "a single .npy array" in line and "numpy.savez" in line


def test_a_file_with_zero_records_says_so(tmp_path, capsys):
    path = npz(tmp_path, images=np.zeros((0, 25, 25), np.uint8), labels=np.zeros(0, np.int64), num_classes=2)
    line = run_error(tmp_path, capsys, f"data.private={path}", "data.max_train=null")
    assert "holds no images (0 records)" in line and "test_size" not in line


def test_zero_arrays_say_so(tmp_path):
    message = fit_error(tmp_path, np.zeros((0, 25, 25), np.uint8), np.zeros(0, np.int64), num_classes=2)
    assert "holds no images (0 records)" in message


# ------------------------------------------------------------------ image sizes


def test_mixed_image_sizes_in_a_folder_name_data_image_size(tmp_path, capsys):
    for cls, side in (("face", 25), ("other", 30)):
        (tmp_path / "tree" / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(faces(1, side, seed=i)[0][0]).save(tmp_path / "tree" / cls / f"{i}.png")
    line = run_error(tmp_path, capsys, f"data.private={tmp_path / 'tree'}", "data.channels=1", "data.max_train=null")
    assert "images differ in size" in line and "data.image_size" in line


def test_an_image_folder_needs_its_colour_mode_declared(tmp_path, capsys):
    for cls in ("face", "other"):
        (tmp_path / "tree" / cls).mkdir(parents=True)
        Image.fromarray(faces(1)[0][0]).save(tmp_path / "tree" / cls / "0.png")
    line = run_error(tmp_path, capsys, f"data.private={tmp_path / 'tree'}")
    assert "data.channels (1 or 3)" in line


def test_ragged_images_in_an_npz_or_a_list_say_resize_them(tmp_path, capsys):
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.zeros((25, 25), np.uint8), np.zeros((30, 30), np.uint8)
    path = npz(tmp_path, images=ragged, labels=np.array([0, 1]), num_classes=2)
    line = run_error(tmp_path, capsys, f"data.private={path}", "data.max_train=null")
    assert "images of different sizes" in line and "allow_pickle" not in line
    message = fit_error(tmp_path, list(ragged), [0, 1], num_classes=2)
    assert "differ in size" in message and "resize them" in message


# ------------------------------------------------------------------ grey and colour


def test_colour_images_are_not_turned_grey_unless_asked(tmp_path, capsys):
    images, labels = faces(channels=3)
    path = npz(tmp_path, images=images, labels=labels, num_classes=2)
    line = run_error(tmp_path, capsys, f"data.private={path}", "data.max_train=null", "data.channels=1")
    assert "colour (3 channels)" in line and "data.channels=3" in line and "data.colour_to_grey=true" in line
    message = fit_error(tmp_path, images, labels, num_classes=2, overrides={"data.channels": 1})
    assert "data.colour_to_grey=true" in message


def test_asking_for_grey_converts_and_grey_to_colour_needs_no_flag(tmp_path):
    from dpsynth.data import load_private

    colour, labels = faces(channels=3)
    path = npz(tmp_path, images=colour, labels=labels, num_classes=2)
    assert load_private(path, channels=1, colour_to_grey=True).image_shape == (1, 25, 25)
    grey = npz(tmp_path, "grey.npz", images=faces()[0], labels=labels, num_classes=2)
    assert load_private(grey, channels=3).image_shape == (3, 25, 25)


# ------------------------------------------------------------------ a preset too large for the data


@pytest.mark.parametrize(
    "preset, key", [("dpsgd-classifier/mnist10k_eps1", "dpsgd-classifier.batch_size=512")], ids=["dpsgd"]
)
def test_a_batch_larger_than_the_train_set_names_the_key_its_value_n_and_the_fix(tmp_path, capsys, preset, key):
    images, labels = faces()
    path = npz(tmp_path, images=images, labels=labels, num_classes=2)
    line = run_error(tmp_path, capsys, f"data.private={path}", preset=preset)
    assert key in line and "training records" in line and "> 1" in line
    assert f"--set {key.split('=')[0]}=" in line and "sample rate" in line


def test_a_batch_check_fails_before_public_pre_training(tmp_path, capsys):
    """pdp-diffusion's preset pre-trains on public glyphs: the plan refuses the batch before any of it."""
    images, labels = faces(side=28)
    path = npz(tmp_path, images=images, labels=labels, num_classes=2)
    line = run_error(
        tmp_path, capsys, f"data.private={path}", "data.max_public=200", preset="pdp-diffusion/mnist10k_eps1"
    )
    assert "pdp-diffusion.batch_size=" in line and "training records" in line
    assert not list((tmp_path / "cache").glob("**/*.pt"))  # no pre-trained model was trained or cached


def test_class_init_by_names_without_class_names_fails_before_public_pre_training(tmp_path, capsys):
    """A check that needs the loaded data and the method runs before pre-training, not minutes after it."""
    import json

    images, labels = faces(side=28)
    path = npz(tmp_path, images=images, labels=labels, num_classes=2)  # a class count, no class names
    out = tmp_path / "run"
    args = ["run", "pdp-diffusion/smoke", "--out", str(out), f"--set=data.private={path}", "--set=data.max_train=null"]
    capsys.readouterr()
    assert main([*args, "--set=pdp-diffusion.class_init=names"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: pdp-diffusion.class_init: names needs class names") and "class_init=null" in line
    assert not list((tmp_path / "cache").glob("**/*.pt"))  # nothing was pre-trained
    assert json.loads((out / "privacy.json").read_text())["epsilon"] == 0  # no spend is claimed
