"""Every kind of bad input raises DataError with a one-line message that names the problem."""

import gzip
import pickle
import struct

import numpy as np
import pytest
from PIL import Image

from dpsynth.data import load_dataset, load_private, load_public
from dpsynth.errors import DataError, DPSynthError


def one_line(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message and message
    assert isinstance(excinfo.value, DPSynthError)
    return message


def write_pngs(root, counts, size=(4, 4), mode="L"):
    for cls, count in counts.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            shape = size if mode == "L" else (*size, 3)
            Image.fromarray(np.full(shape, 40 * i, np.uint8), mode).save(root / cls / f"{i}.png")


def test_missing_path(tmp_path):
    with pytest.raises(DataError) as err:
        load_dataset(str(tmp_path / "nowhere" / "data.npz"))
    assert "not found" in one_line(err)


def test_unknown_dataset_name_lists_known_names():
    with pytest.raises(DataError) as err:
        load_private("cifar11")
    message = one_line(err)
    assert "unknown dataset 'cifar11'" in message and "mnist10k" in message and "cifar10" in message


def test_corrupt_image_file(tmp_path):
    write_pngs(tmp_path / "d", {"a": 2, "b": 2})
    (tmp_path / "d" / "b" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "d")
    assert "cannot read image" in one_line(err) and "1.png" in str(err.value)


def test_corrupt_npz_and_truncated_idx(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 garbage")
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "bad.npz")
    assert "cannot read" in one_line(err)
    header = struct.pack(">BBBBIII", 0, 0, 8, 3, 5, 28, 28)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(header + b"\x00" * 100))
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(struct.pack(">BBBBI", 0, 0, 8, 1, 5) + bytes(5))
    )
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    assert "IDX header promises" in one_line(err)


def test_unreadable_cifar_batch(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(b"not a pickle")
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    assert "cannot read CIFAR batch" in one_line(err)


def test_wrong_image_shape_and_channel_count(tmp_path):
    np.savez(tmp_path / "c2.npz", images=np.zeros((3, 4, 4, 2), np.uint8), labels=[0, 1, 0])
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "c2.npz")
    assert "1 or 3 channels" in one_line(err)
    np.savez(tmp_path / "flat.npz", images=np.zeros((3, 16), np.uint8), labels=[0, 1, 0])
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "flat.npz")
    assert "[N, H, W, C]" in one_line(err)
    folder = tmp_path / "cifar"
    folder.mkdir()
    with open(folder / "data_batch_1", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 1000), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DataError) as err:
        load_dataset(folder)
    assert "[N, 3072]" in one_line(err)


def test_images_of_different_sizes_need_image_size(tmp_path):
    write_pngs(tmp_path / "d", {"a": 2})
    write_pngs(tmp_path / "d", {"b": 2}, size=(5, 5))
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "d")
    assert "set data.image_size" in one_line(err)
    assert load_dataset(tmp_path / "d", image_size=3).images.shape == (4, 3, 3, 1)


def test_labels_missing(tmp_path):
    np.savez(tmp_path / "nolabels.npz", images=np.zeros((3, 4, 4, 1), np.uint8))
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "nolabels.npz")
    assert "labels missing" in one_line(err)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(struct.pack(">BBBBIII", 0, 0, 8, 3, 1, 2, 2) + bytes(4))
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "t10k-images-idx3-ubyte")
    assert "labels missing" in one_line(err)


def test_labels_out_of_range(tmp_path):
    np.savez(tmp_path / "range.npz", images=np.zeros((3, 4, 4, 1), np.uint8), labels=[0, 1, 5], num_classes=3)
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "range.npz")
    assert "[0, 3)" in one_line(err)
    np.savez(tmp_path / "negative.npz", images=np.zeros((2, 4, 4, 1), np.uint8), labels=[0, -1])
    with pytest.raises(DataError):
        load_dataset(tmp_path / "negative.npz")
    np.savez(tmp_path / "count.npz", images=np.zeros((2, 4, 4, 1), np.uint8), labels=[0, 1, 1])
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "count.npz")
    assert "2 images but 3 labels" in one_line(err)


def test_an_empty_class_folder_is_a_declared_class_not_an_error(tmp_path):
    """Whether a run exists must not depend on a per-class count (docs/privacy.md, "Refusals that depend on the
    data"): an empty class folder declares its class, which has no record."""
    write_pngs(tmp_path / "d", {"a": 3, "b": 3})
    (tmp_path / "d" / "c").mkdir()
    dataset = load_dataset(tmp_path / "d")
    assert dataset.class_names == ["a", "b", "c"] and np.bincount(dataset.labels, minlength=3).tolist() == [3, 3, 0]


def test_a_declared_class_without_a_private_train_record_is_not_an_error(tmp_path):
    labels = np.array([0, 2] * 20)
    np.savez(
        tmp_path / "gap.npz",
        images=np.random.default_rng(0).integers(0, 256, (40, 4, 4, 1), dtype=np.uint8),
        labels=labels,
        class_names=np.array(["zero", "one", "two"]),
    )
    splits = load_private(tmp_path / "gap.npz", val_size=0.2, test_size=0.2)
    assert splits.train.num_classes == 3 and 1 not in set(splits.train.labels.tolist())
    assert {0, 2} <= set(splits.train.labels.tolist())


def test_bad_split_and_option_and_sizes(tmp_path):
    with pytest.raises(DataError, match="no 'validation' split"):
        load_dataset("mnist10k", "validation")
    with pytest.raises(DataError, match="unknown option 'size'"):
        load_dataset("mnist10k", size=3)
    np.savez(tmp_path / "x.npz", images=np.zeros((4, 2, 2, 1), np.uint8), labels=[0, 1, 0, 1])
    with pytest.raises(DataError, match="does not apply"):
        load_dataset(tmp_path / "x.npz", attribute="Male")
    with pytest.raises(DataError, match="max_train=1"):
        load_private("digits8x8", max_train=1)
    with pytest.raises(DataError, match="channels must be 1 or 3"):
        load_public("digits8x8", channels=4)


def test_unsupported_file_and_unrecognised_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "notes.txt")
    assert "unsupported file" in one_line(err)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "empty")
    assert "no dataset recognised" in one_line(err)
