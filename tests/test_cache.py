"""The shared cache of public pre-trained models: content keys, hits, rebuilds, atomic entries, resumable builds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpsynth.cache import cache_entry, load_or_build, public_content_key
from dpsynth.data.dataset import ImageDataset


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))


def _public(seed: int = 0, count: int = 12) -> ImageDataset:
    images = np.random.default_rng(seed).integers(0, 256, (count, 4, 4, 1), dtype=np.uint8)
    return ImageDataset(images, np.arange(count) % 3, 3, name="tiny", class_names=["a", "b", "c"])


def test_the_public_content_key_follows_every_pixel_label_order_and_class_name():
    public = _public()
    key = public_content_key(public)
    assert key == public_content_key(_public())  # a function of the content, not of the object
    edited = public.images.copy()
    edited[5, 1, 2, 0] ^= 1  # one bit of one pixel
    assert key != public_content_key(ImageDataset(edited, public.labels, 3, class_names=public.class_names))
    relabelled = public.labels.copy()
    relabelled[0] = (relabelled[0] + 1) % 3
    assert key != public_content_key(ImageDataset(public.images, relabelled, 3, class_names=public.class_names))
    assert key != public_content_key(public.subset(np.arange(12)[::-1]))  # order: batches are drawn by position
    assert key != public_content_key(public.subset(np.arange(11)))
    assert key != public_content_key(ImageDataset(public.images, public.labels, 3, class_names=["a", "b", "z"]))


def test_a_second_call_hits_and_a_changed_description_builds_again(tmp_path):
    builds = []

    def build(snapshots):
        builds.append(snapshots)
        return {"weights": torch.full((2,), float(len(builds)))}

    description = {"public_content": "abc", "section": {"steps": 3}}
    first, cached = load_or_build(cache_entry("toy", description), build)
    assert not cached and len(builds) == 1 and builds[0] is not None
    again, cached = load_or_build(cache_entry("toy", dict(description)), build)
    assert cached and len(builds) == 1 and torch.equal(again["weights"], first["weights"])
    other_public, other_config = dict(description, public_content="abd"), dict(description, section={"steps": 4})
    for changed in (other_public, other_config):
        _, cached = load_or_build(cache_entry("toy", changed), build)
        assert not cached
    assert len(builds) == 3
    entry = cache_entry("toy", description)
    assert entry.path.parent == tmp_path / "cache" / "pretrained" / "toy"
    assert entry.manifest_path.is_file() and not list(entry.directory.glob(".*.tmp"))  # no torn temp files


def test_without_the_cache_nothing_is_read_or_written(tmp_path):
    entry = cache_entry("toy", {"x": 1})
    state, cached = load_or_build(entry, lambda snapshots: {"snapshots": snapshots}, use_cache=False)
    assert not cached and state["snapshots"] is None and not entry.directory.exists()


def test_an_interrupted_build_resumes_from_its_snapshot_and_the_snapshot_goes_when_done():
    entry = cache_entry("toy", {"x": 2})

    def build_and_die(snapshots):
        snapshots.save({"step": 5})
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load_or_build(entry, build_and_die)
    assert entry.partial_path.is_file() and not entry.exists()
    state, cached = load_or_build(entry, lambda snapshots: {"resumed_at": snapshots.load()["step"]})
    assert state == {"resumed_at": 5} and not cached
    assert entry.exists() and not entry.partial_path.exists()
