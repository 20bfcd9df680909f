"""Memory-mapped shards (dpsynth.data.shards): round trip, no copy, cached content keys, the same split as
the .npz of the same records, batch access."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from dpsynth.data import ImageDataset, load_dataset, load_private, make_shards, shards
from dpsynth.data.splits import content_keys
from dpsynth.dpsgd import PoissonSampler
from dpsynth.errors import DataError

CLASSES, NAMES = 3, ["a", "b", "c"]


def records(count: int = 300, seed: int = 0, shape: tuple[int, int, int] = (6, 5, 3)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, *shape), dtype=np.uint8), rng.integers(0, CLASSES, count)


def write(out, images: np.ndarray, labels: np.ndarray, split: str = "train", block: int = 64):
    blocks = (images[start : start + block] for start in range(0, len(images), block))
    return shards.write_shards(blocks, labels, out, num_classes=CLASSES, class_names=NAMES, split=split)


def test_round_trip_from_blocks_and_single_images(tmp_path):
    images, labels = records()
    write(tmp_path / "s", images, labels)
    shards.write_shards(
        iter(images[:7]), labels[:7], tmp_path / "s", num_classes=CLASSES, class_names=NAMES, split="test"
    )
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["splits"] == {"train": 300, "test": 7} and (meta["height"], meta["width"], meta["channels"]) == (
        6,
        5,
        3,
    )
    train, test = load_dataset(tmp_path / "s", "train"), load_dataset(tmp_path / "s", "test")
    assert isinstance(train.images, np.memmap) and train.memory_mapped and train.rows is None
    assert np.array_equal(train.images, images) and np.array_equal(train.labels, labels)
    assert np.array_equal(test.images, images[:7]) and train.class_names == NAMES and train.num_classes == CLASSES
    assert train.image_shape == (3, 6, 5) and len(train) == 300


def test_a_memmap_is_held_without_a_copy_and_subsets_select_rows(tmp_path):
    images, labels = records(40)
    file = tmp_path / "raw.u8"
    images.tofile(file)
    mapped = np.memmap(file, dtype=np.uint8, mode="r+", shape=images.shape)
    dataset = ImageDataset(mapped, labels, CLASSES)
    assert dataset.images is mapped and np.shares_memory(dataset.images, mapped)
    chosen = np.array([3, 17, 29, 30])
    subset = dataset.subset(chosen).subset([1, 3])  # a selection of a selection: positions compose
    assert (
        subset.memory_mapped
        and subset.rows.tolist() == [17, 30]
        and subset.labels.tolist() == labels[[17, 30]].tolist()
    )
    assert subset.rows.dtype == np.int32  # 4 bytes a selected record: the store's positions fit
    with pytest.raises(DataError, match="integer positions"):
        ImageDataset(mapped, labels[:2], CLASSES, rows=np.array([1.0, 2.0]))
    # Not copied at subset time: a change to the file shows through the selection's batch reads.
    mapped[30] = 255 - mapped[30]
    x, y = subset.batch_tensors(torch.tensor([1]))
    assert torch.equal(x[0], torch.from_numpy(255 - images[30]).permute(2, 0, 1).float() / 127.5 - 1)
    assert y.tolist() == [labels[30]]


def mapped_resident_kib(suffix: str) -> int | None:
    """Resident KiB of this process's mappings of files ending in ``suffix``; None off Linux."""
    if not os.path.exists("/proc/self/smaps"):
        return None
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                inside = line.rstrip().endswith(suffix)
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


def test_batch_reads_equal_indexing_and_map_no_pages_of_the_shard(tmp_path):
    images, labels = records(3000, shape=(32, 32, 3))
    write(tmp_path / "s", images, labels, block=1000)
    dataset = shards.read(tmp_path / "s")
    for positions in ([0, 1, 2, 10, 11, 2999], [2999, 5, 5, 0], list(range(1000, 2000))):
        assert np.array_equal(dataset.gather(positions), images[positions])
    with pytest.raises(IndexError):
        dataset.gather([3000])
    for _ in range(20):
        dataset.batch_tensors(torch.randperm(3000)[:256].sort().values)
    assert sum(len(chunk) for chunk, _ in dataset.chunks(700)) == 3000
    assert mapped_resident_kib("images.u8") in (0, None)  # positional reads: the map's pages are never faulted in


def test_record_keys_equal_the_in_memory_keys_and_are_cached_beside_the_shard(tmp_path):
    images, labels = records()
    folder = write(tmp_path / "s", images, labels)
    want = content_keys(images, labels)
    assert np.array_equal(shards.read(tmp_path / "s").record_keys, want)
    assert (folder / "keys.npy").stat().st_mode & 0o777 == (folder / "images.u8").stat().st_mode & 0o777
    os.chmod(folder / "images.u8", 0o600)
    (folder / "keys.npy").unlink()  # recomputed in blocks from the file, cached again
    assert np.array_equal(shards.read(tmp_path / "s").record_keys, want)
    assert np.array_equal(np.load(folder / "keys.npy"), want) and (folder / "keys.npy").stat().st_mode & 0o777 == 0o600
    np.save(folder / "labels.npy", (labels + 1) % CLASSES)  # the labels changed: a stale cache is not used
    assert np.array_equal(shards.read(tmp_path / "s").record_keys, content_keys(images, (labels + 1) % CLASSES))
    subset = shards.read(tmp_path / "s").subset([5, 2])
    assert np.array_equal(subset.record_keys, content_keys(images[[5, 2]], (labels[[5, 2]] + 1) % CLASSES))


def test_content_keys_of_a_strided_array_equal_those_of_its_copy():
    images, labels = records(2500)
    flipped = images[:, ::-1]
    assert np.array_equal(content_keys(flipped, labels), content_keys(np.ascontiguousarray(flipped), labels))
    dataset = ImageDataset(np.ascontiguousarray(flipped), labels, CLASSES)
    assert np.array_equal(dataset.record_keys, content_keys(flipped, labels))


def test_the_split_equals_the_split_of_the_npz_of_the_same_records(tmp_path):
    images, labels = records(400, seed=1)
    np.savez(tmp_path / "same.npz", images=images, labels=labels, class_names=np.array(NAMES))
    write(tmp_path / "s", images, labels)
    options = {"val_size": 0.2, "split_seed": 7}
    from_npz, from_shards = load_private(tmp_path / "same.npz", **options), load_private(tmp_path / "s", **options)
    for split in ("train", "val", "test"):
        want, got = getattr(from_npz, split), getattr(from_shards, split)
        assert got.memory_mapped and got.rows is not None and len(got) == len(want) > 0
        assert np.array_equal(got.record_keys, want.record_keys) and np.array_equal(got.labels, want.labels)
        assert np.array_equal(got.images, want.images), split
    # A Poisson batch read from the shard equals the same rows of the npz split's full tensors.
    batch = PoissonSampler(len(from_shards.train), 0.1, generator=torch.Generator().manual_seed(0)).sample()
    x, y = from_shards.train.batch_tensors(batch)
    all_x, all_y = from_npz.train.to_tensors()
    assert torch.equal(x, all_x[batch]) and torch.equal(y, all_y[batch])
    empty_x, empty_y = from_shards.train.batch_tensors(torch.zeros(0, dtype=torch.int64))
    assert empty_x.shape == (0, 3, 6, 5) and empty_y.shape == (0,)


def test_shards_from_an_npz_and_the_module_command(tmp_path, capsys):
    images, labels = records(50)
    np.savez(tmp_path / "in.npz", images=images, labels=labels, class_names=np.array(NAMES))
    assert make_shards.main([str(tmp_path / "in.npz"), str(tmp_path / "out")]) == 0
    assert "train: 50" in capsys.readouterr().out
    read = shards.read(tmp_path / "out")
    assert np.array_equal(read.images, images) and read.class_names == NAMES
    assert make_shards.main(["only-one"]) == 2


@pytest.mark.parametrize(
    "labels, kwargs, message",
    [
        (np.array([0, 3]), {}, r"labels must lie in \[0, 3\)"),
        (np.array([0, 1]), {"class_names": ["a"]}, "1 class names for 3 classes"),
        (np.array([0, 1, 2]), {}, "2 images but 3 labels"),
    ],
)
def test_bad_input_is_refused(tmp_path, labels, kwargs, message):
    images, _ = records(2)
    with pytest.raises(DataError, match=message):
        shards.write_shards([images], labels, tmp_path / "s", num_classes=CLASSES, **kwargs)


def test_a_split_must_agree_with_the_set_and_a_truncated_file_is_refused(tmp_path):
    images, labels = records(20)
    folder = write(tmp_path / "s", images, labels)
    other, _ = records(5, shape=(6, 6, 3))
    with pytest.raises(DataError, match="disagrees with meta.json on width"):
        shards.write_shards([other], labels[:5], tmp_path / "s", num_classes=CLASSES, class_names=NAMES, split="val")
    with open(folder / "images.u8", "r+b") as stream:
        stream.truncate(10)
    with pytest.raises(DataError, match="10 bytes, but meta.json describes 20 records"):
        shards.read(tmp_path / "s")


def test_loading_a_shard_set_hands_the_splits_freed_heap_back(tmp_path, monkeypatch):
    """The split's temporaries (8 bytes a record each) are freed once the loader returns; glibc would keep
    them resident (dpsynth.data.loading.release_freed_heap), so a memory-mapped load trims the heap then,
    and an in-memory load, whose records dwarf them, does not."""
    from dpsynth.data import loading

    calls = []
    monkeypatch.setattr(loading, "release_freed_heap", lambda: calls.append(1))
    images, labels = records()
    write(tmp_path / "s", images, labels)
    np.savez(tmp_path / "d.npz", images=images, labels=labels, class_names=np.array(NAMES))
    load_private(tmp_path / "d.npz", val_size=0.1)
    assert calls == []
    splits = load_private(tmp_path / "s", val_size=0.1)
    assert calls == [1] and splits.train.memory_mapped
