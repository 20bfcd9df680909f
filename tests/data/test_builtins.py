"""Built-in datasets: mnist10k (shipped), digits8x8 (scikit-learn), the glyph generator, the registry."""

import hashlib
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from dpsynth.data import glyphs, list_datasets, load_dataset
from dpsynth.data.glyphs import GlyphSpec
from dpsynth.errors import DataError

PROVENANCE_IMAGES_SHA256 = "0768d16c5adea568dee18fa5e4e1acb117e9ec2c5d6b1dffe5fc29c1e61c1eca"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def test_mnist10k_splits_are_stratified_and_disjoint():
    parts = {s: load_dataset("mnist10k", s) for s in ("train", "val", "test")}
    assert [len(parts[s]) for s in ("train", "val", "test")] == [7000, 1000, 2000]
    assert parts["train"].images.shape == (7000, 28, 28, 1) and parts["train"].images.dtype == np.uint8
    all_counts = sum(np.bincount(p.labels, minlength=10) for p in parts.values())
    assert all_counts.tolist() == [1001, 1127, 991, 1032, 980, 863, 1014, 1070, 944, 978]
    test_share = np.bincount(parts["test"].labels, minlength=10) / all_counts
    assert np.all(np.abs(test_share - 0.2) < 0.01)
    digests = {p.images[i].tobytes() for p in parts.values() for i in range(0, len(p), 97)}
    assert len(digests) == sum(len(range(0, len(p), 97)) for p in parts.values())


def test_mnist10k_content_matches_provenance():
    from importlib import resources

    with resources.as_file(resources.files("dpsynth.data") / "assets" / "mnist10k.npz") as path:
        images = np.load(path)["images"]
    assert hashlib.sha256(images.tobytes()).hexdigest() == PROVENANCE_IMAGES_SHA256
    assert 30 < images.mean() < 37  # MNIST's mean intensity is 0.1307 * 255 = 33.3


def test_digits8x8_real_digits_scaled_to_uint8():
    train = load_dataset("digits8x8", "train")
    test = load_dataset("digits8x8", "test")
    assert train.images.shape == (1257, 8, 8, 1) and len(test) == 360
    assert train.images.max() == 255 and train.num_classes == 10
    assert np.array_equal(load_dataset("digits8x8", "test").labels, test.labels)


def test_glyphs_are_deterministic_balanced_and_labelled():
    spec = GlyphSpec(size=124, seed=3)
    first = glyphs.render(spec)
    second = glyphs.render(spec)
    assert np.array_equal(first.images, second.images) and np.array_equal(first.labels, second.labels)
    assert first.images.shape == (124, 28, 28, 1) and first.num_classes == 62
    assert np.bincount(first.labels).tolist() == [2] * 62
    assert first.class_names[10] == "A" and first.class_names[36] == "a"
    other = glyphs.render(GlyphSpec(size=124, seed=4))
    assert not np.array_equal(first.images, other.images)
    ink = first.images.reshape(124, -1).max(axis=1)
    assert np.all(ink > 100)  # every glyph is visible
    border = np.concatenate([first.images[:, 0], first.images[:, -1]]).mean()
    assert border < first.images.mean()  # glyphs sit in the middle, on a dark background


def test_glyph_classes_look_different():
    ds = glyphs.render(GlyphSpec(size=620, digits_only=False, max_rotation=0, max_shear=0, max_translation=0))
    means = np.stack([ds.images[ds.labels == c].mean(axis=0) for c in range(62)]).reshape(62, -1)
    # the mean image of "1" and of "0" differ far more than noise
    assert np.abs(means[1] - means[0]).mean() > 10


def test_glyphs32_colour_and_digits_variant():
    ds = load_dataset("glyphs32-digits", "train", size=40, seed=1)
    assert ds.images.shape == (40, 32, 32, 3) and ds.num_classes == 10
    assert np.abs(ds.images[..., 0].astype(int) - ds.images[..., 1]).mean() > 5  # not grey
    grey = load_dataset("glyphs-digits", "val", size=100)
    assert grey.images.shape == (10, 28, 28, 1)
    assert np.bincount(grey.labels).tolist() == [1] * 10


def test_glyph_splits_differ_and_cache_is_reused(tmp_path):
    train = load_dataset("glyphs", "train", size=62)
    test = load_dataset("glyphs", "test", size=620)
    assert len(test) == 62 and not np.array_equal(train.images, test.images)
    cached = list((tmp_path / "cache" / "glyphs").glob("*.npz"))
    assert len(cached) == 2
    started = time.perf_counter()
    again = load_dataset("glyphs", "train", size=62)
    assert time.perf_counter() - started < 1.0
    assert np.array_equal(again.images, train.images)


def test_glyph_generation_is_fast():
    started = time.perf_counter()
    glyphs.render(GlyphSpec(size=2000))
    assert time.perf_counter() - started < 15  # ~1 s on one idle core; generous for a shared machine


def test_list_datasets_describes_every_entry():
    infos = {info.name: info for info in list_datasets()}
    for name in (
        "mnist10k",
        "digits8x8",
        "glyphs",
        "glyphs-digits",
        "glyphs32",
        "mnist",
        "fashion-mnist",
        "kmnist",
        "emnist-letters",
        "cifar10",
        "cifar100",
        "celeba",
        "camelyon17",
    ):
        assert name in infos
    assert infos["mnist10k"].splits == {"train": 7000, "val": 1000, "test": 2000}
    assert infos["mnist10k"].size == 10000
    assert infos["mnist10k"].licence == "MIT" and infos["mnist10k"].kind == "builtin"
    assert infos["cifar10"].shape == (32, 32, 3) and infos["cifar10"].kind == "download"
    json.dumps([info.to_dict() for info in infos.values()])


def test_importing_the_package_stays_light():
    code = "import sys, dpsynth.data; print(sorted(m for m in ('matplotlib', 'torch', 'sklearn') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_spec_options_in_the_name():
    ds = load_dataset("glyphs-digits?size=20&seed=2")
    assert len(ds) == 20
    with pytest.raises(DataError, match="unknown option 'colour'"):
        load_dataset("glyphs?colour=1")


def test_download_verifies_checksums_offline(tmp_path, monkeypatch):
    """download() on file:// URLs: the real fetch, verify and unpack path, without a network."""
    import tarfile

    from dpsynth.data import fetch as dl

    payload = tmp_path / "src" / "toy.tar.gz"
    payload.parent.mkdir()
    (tmp_path / "src" / "hello.txt").write_text("hi")
    with tarfile.open(payload, "w:gz") as bundle:
        bundle.add(tmp_path / "src" / "hello.txt", arcname="toy/hello.txt")
    good = hashlib.md5(payload.read_bytes()).hexdigest()
    monkeypatch.setitem(dl.RESOURCES, "toy", (dl.Resource(payload.as_uri(), "toy.tar.gz", md5=good, extract=True),))
    folder = dl.download("toy", tmp_path / "out")
    assert (folder / "toy" / "hello.txt").read_text() == "hi"
    monkeypatch.setitem(dl.RESOURCES, "bad", (dl.Resource(payload.as_uri(), "bad.tar.gz", md5="0" * 32),))
    with pytest.raises(DataError, match="checksum mismatch"):
        dl.download("bad", tmp_path / "out2")
    assert not (tmp_path / "out2" / "bad.tar.gz").exists()
    with pytest.raises(DataError, match="no download for 'nope'"):
        dl.download("nope", tmp_path)
