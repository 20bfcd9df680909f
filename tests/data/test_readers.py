"""Each real-data reader on a tiny fixture written here in that dataset's exact on-disk format."""

import csv
import gzip
import pickle
import struct

import numpy as np
import pytest
from PIL import Image

from dpsynth.data import load_dataset, load_private
from dpsynth.data.readers import detect_format, path_splits
from dpsynth.errors import DataError


# ---------------------------------------------------------------- IDX (MNIST family, EMNIST)
def write_idx(path, array, gz):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if gz else payload)


def write_mnist(folder, n_train=20, n_test=10, gz=True, prefix="", label_offset=0, classes=10):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    data = {}
    for split, stem, n in (("train", "train", n_train), ("test", "t10k" if not prefix else "test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % classes + label_offset).astype(np.uint8)
        write_idx(folder / f"{prefix}{stem}-images-idx3-ubyte{suffix}", images, gz)
        write_idx(folder / f"{prefix}{stem}-labels-idx1-ubyte{suffix}", labels, gz)
        data[split] = (images, labels)
    return data


@pytest.mark.parametrize("gz", [True, False])
def test_idx_reader_reads_mnist_layout(tmp_path, gz):
    data = write_mnist(tmp_path / "mnist", gz=gz)
    assert detect_format(tmp_path / "mnist") == "idx"
    assert path_splits(tmp_path / "mnist") == ["test", "train"]
    train = load_dataset(tmp_path / "mnist", "train")
    test = load_dataset(tmp_path / "mnist", "test")
    assert train.images.shape == (20, 28, 28, 1) and len(test) == 10
    assert np.array_equal(train.images[..., 0], data["train"][0])
    assert train.labels.tolist() == data["train"][1].tolist()


def test_registered_mnist_reads_from_root_option(tmp_path):
    write_mnist(tmp_path / "m")
    ds = load_dataset("fashion-mnist", "train", root=str(tmp_path / "m"))
    assert ds.class_names[0] == "T-shirt/top" and ds.num_classes == 10


def test_idx_single_file_path(tmp_path):
    data = write_mnist(tmp_path, gz=False)
    ds = load_dataset(tmp_path / "train-images-idx3-ubyte")
    assert np.array_equal(ds.images[..., 0], data["train"][0])


def test_emnist_is_transposed_and_letters_mapped(tmp_path):
    folder = tmp_path / "gzip"
    folder.mkdir()
    upright = np.zeros((26, 28, 28), np.uint8)
    upright[:, 2, :] = 255  # a horizontal bar: its transpose is vertical
    for split in ("train", "test"):
        write_idx(folder / f"emnist-letters-{split}-images-idx3-ubyte.gz", upright.transpose(0, 2, 1), True)
        write_idx(folder / f"emnist-letters-{split}-labels-idx1-ubyte.gz", np.arange(1, 27, dtype=np.uint8), True)
    (folder / "emnist-letters-mapping.txt").write_text("".join(f"{i} {64 + i} {96 + i}\n" for i in range(1, 27)))
    write_mnist(folder, prefix="emnist-digits-")
    with pytest.raises(DataError, match="several IDX datasets"):
        load_dataset(folder)
    ds = load_dataset("emnist-letters", "train", root=str(tmp_path))
    assert np.array_equal(ds.images[..., 0], upright)
    assert ds.labels.tolist() == list(range(26)) and ds.num_classes == 26
    assert ds.class_names[:3] == ["A", "B", "C"]


# ---------------------------------------------------------------- CIFAR python batches
def write_cifar10(root, per_batch=4):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    written = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"img{i}.png".encode() for i in range(per_batch)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
        written.append((data, labels))
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"num_cases_per_batch": per_batch, b"label_names": names, b"num_vis": 3072}, f, protocol=2)
    return written


def test_cifar10_batches(tmp_path):
    written = write_cifar10(tmp_path)
    assert detect_format(tmp_path) == "cifar"
    train = load_dataset(tmp_path, "train")
    test = load_dataset(tmp_path, "test")
    assert train.images.shape == (20, 32, 32, 3) and len(test) == 4
    first = written[0][0][0]
    assert train.images[0, 0, 0].tolist() == [first[0], first[1024], first[2048]]  # R, G, B planes
    assert train.images[0, 0, 1, 0] == first[1]
    assert train.labels[:4].tolist() == written[0][1]
    assert train.class_names[0] == "airplane" and train.num_classes == 10


def test_cifar100_fine_and_coarse(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for split, n in (("train", 6), ("test", 3)):
        with open(folder / split, "wb") as f:
            pickle.dump(
                {
                    b"data": np.zeros((n, 3072), np.uint8),
                    b"fine_labels": list(range(n)),
                    b"coarse_labels": [0] * n,
                    b"filenames": [b"x"] * n,
                },
                f,
            )
    with open(folder / "meta", "wb") as f:
        pickle.dump(
            {
                b"fine_label_names": [f"f{i}".encode() for i in range(100)],
                b"coarse_label_names": [f"c{i}".encode() for i in range(20)],
            },
            f,
        )
    fine = load_dataset(tmp_path, "train")
    coarse = load_dataset(tmp_path, "test", label="coarse")
    assert fine.num_classes == 100 and fine.labels.tolist() == list(range(6))
    assert coarse.num_classes == 20 and coarse.class_names[0] == "c0"


def test_cifar_refuses_pickles_that_run_code(tmp_path):
    write_cifar10(tmp_path)

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo hacked",))

    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "wb") as f:
        pickle.dump({b"data": Evil()}, f)
    with pytest.raises(DataError, match="refusing"):
        load_dataset(tmp_path, "train")


# ---------------------------------------------------------------- image folders
def write_folder(root, classes=("cat", "ant", "bee"), per_class=3, size=(6, 5), mode="RGB", ext="png"):
    rng = np.random.default_rng(2)
    for cls in classes:
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(root / cls / f"{i}.{ext}")


def test_image_folder_sorted_classes(tmp_path):
    write_folder(tmp_path / "imgs")
    ds = load_dataset(tmp_path / "imgs")
    assert ds.class_names == ["ant", "bee", "cat"]
    assert ds.images.shape == (9, 5, 6, 3) and np.bincount(ds.labels).tolist() == [3, 3, 3]
    png = np.asarray(Image.open(tmp_path / "imgs" / "bee" / "0.png"))
    assert np.array_equal(ds.images[3], png)


def test_image_folder_grey_jpg_and_resize_while_reading(tmp_path):
    write_folder(tmp_path / "g", mode="L", ext="jpg", size=(12, 8))
    ds = load_dataset(tmp_path / "g", image_size=4)
    assert ds.images.shape == (9, 4, 4, 1)


def test_image_folder_split_layout(tmp_path):
    write_folder(tmp_path / "d" / "train", per_class=10)
    write_folder(tmp_path / "d" / "test", per_class=1)
    assert path_splits(tmp_path / "d") == ["test", "train"]
    splits = load_private(tmp_path / "d", val_size=0.3, channels=3)
    assert len(splits.train) + len(splits.val) == 30 and len(splits.val) > 0 and len(splits.test) == 3


def test_a_tree_with_only_a_train_folder_is_planned_from_that_folder(tmp_path):
    from dpsynth.data.readers.folder import train_root
    from dpsynth.data.sizes import _own_records, planned_image_shape

    write_folder(tmp_path / "d" / "train", per_class=4)
    assert train_root(tmp_path / "d") == tmp_path / "d" / "train"
    assert _own_records(str(tmp_path / "d")) == (12, ("train",))
    assert planned_image_shape({"private": str(tmp_path / "d")}) == (3, 5, 5)


# ---------------------------------------------------------------- npz
def test_npz_variants(tmp_path):
    rng = np.random.default_rng(3)
    nchw = rng.uniform(-1, 1, (5, 3, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "float.npz", images=nchw, labels=np.arange(5) % 2)
    ds = load_dataset(tmp_path / "float.npz", pixel_range=[-1, 1])
    assert ds.images.shape == (5, 4, 4, 3) and ds.images.dtype == np.uint8
    assert ds.images[0, 0, 0, 0] == np.clip(np.round((nchw[0, 0, 0, 0] + 1) * 127.5), 0, 255)
    np.savez(
        tmp_path / "nhw.npz",
        images=np.zeros((4, 3, 3), np.uint8),
        labels=[0, 1, 2, 0],
        class_names=np.array(["a", "b", "c"]),
    )
    nhw = load_dataset(tmp_path / "nhw.npz")
    assert nhw.image_shape == (1, 3, 3) and nhw.class_names == ["a", "b", "c"]
    np.savez(
        tmp_path / "split.npz",
        train_images=np.zeros((4, 2, 2, 1), np.uint8),
        train_labels=[0, 1, 0, 1],
        test_images=np.zeros((2, 2, 2, 1), np.uint8),
        test_labels=[0, 1],
    )
    assert path_splits(tmp_path / "split.npz") == ["train", "test"]
    assert len(load_dataset(tmp_path / "split.npz", "test")) == 2


def test_npz_directory_of_splits(tmp_path):
    for split, n in (("train", 8), ("test", 4)):
        np.savez(tmp_path / f"{split}.npz", images=np.zeros((n, 2, 2, 1), np.uint8), labels=np.arange(n) % 2)
    assert path_splits(tmp_path) == ["train", "test"]
    assert len(load_dataset(tmp_path, "test")) == 4


# ---------------------------------------------------------------- CelebA
ATTRS = ["5_o_Clock_Shadow", "Black_Hair", "Blond_Hair", "Brown_Hair", "Gray_Hair", "Male", "Smiling"]


def write_celeba(root, rows):
    folder = root / "celeba"
    (folder / "img_align_celeba").mkdir(parents=True)
    rng = np.random.default_rng(4)
    lines = [str(len(rows)), " ".join(ATTRS) + " "]
    partition = []
    for i, (values, part) in enumerate(rows, start=1):
        name = f"{i:06d}.jpg"
        Image.fromarray(rng.integers(0, 256, (218, 178, 3), dtype=np.uint8)).save(folder / "img_align_celeba" / name)
        lines.append(name + "".join(f" {v:>2}" for v in values))
        partition.append(f"{name} {part}")
    (folder / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
    (folder / "list_eval_partition.txt").write_text("\n".join(partition) + "\n")


def test_celeba_attribute_and_partition(tmp_path):
    #          shadow black blond brown gray male smiling
    rows = [
        ([-1, 1, -1, -1, -1, 1, -1], 0),
        ([-1, -1, 1, -1, -1, -1, 1], 0),
        ([1, -1, -1, 1, -1, 1, 1], 0),
        ([-1, 1, 1, -1, -1, -1, -1], 1),
        ([-1, -1, -1, -1, 1, 1, -1], 2),
    ]
    write_celeba(tmp_path, rows)
    assert detect_format(tmp_path) == "celeba"
    train = load_dataset(tmp_path, "train", image_size=16)
    assert train.images.shape == (3, 16, 16, 3) and train.labels.tolist() == [1, 0, 1]
    assert train.class_names == ["not Male", "Male"]
    smiling = load_dataset(tmp_path, "train", attribute="Smiling", image_size=8)
    assert smiling.labels.tolist() == [0, 1, 1]
    hair = load_dataset(tmp_path, "train", attribute="hair", image_size=8)
    assert hair.labels.tolist() == [0, 1, 2] and hair.num_classes == 4
    assert len(load_dataset(tmp_path, "test", image_size=8)) == 1
    with pytest.raises(DataError, match="unknown CelebA attribute 'Hat'"):
        load_dataset(tmp_path, attribute="Hat")


# ---------------------------------------------------------------- Camelyon17 (WILDS)
def write_camelyon(root):
    rng = np.random.default_rng(5)
    rows = [  # patient, node, x, y, tumor, slide, center, split
        (4, 4, 3328, 21792, 1, 0, 0, 0),
        (4, 4, 3360, 21792, 0, 0, 0, 0),
        (10, 0, 96, 64, 1, 5, 3, 1),
        (15, 1, 1000, 2000, 0, 7, 1, 0),
        (20, 2, 10, 20, 1, 9, 2, 0),
        (21, 2, 11, 21, 0, 9, 4, 0),
    ]
    with open(root / "metadata.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["", "patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split"])
        for i, (p, n, x, y, t, s, c, sp) in enumerate(rows):
            writer.writerow([i, f"{p:03d}", n, x, y, t, s, c, sp])
            folder = root / "patches" / f"patient_{p:03d}_node_{n}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(
                folder / f"patch_patient_{p:03d}_node_{n}_x_{x}_y_{y}.png"
            )


def test_camelyon17_wilds_splits(tmp_path):
    write_camelyon(tmp_path)
    assert detect_format(tmp_path) == "camelyon17"
    train = load_dataset(tmp_path, "train")
    assert train.images.shape == (3, 96, 96, 3) and train.labels.tolist() == [1, 0, 0]
    assert load_dataset(tmp_path, "val").labels.tolist() == [1]
    assert load_dataset(tmp_path, "ood_val", image_size=32).images.shape == (1, 32, 32, 3)
    assert load_dataset(tmp_path, "test").labels.tolist() == [1]
    registered = load_dataset("camelyon17", "test", root=str(tmp_path))
    assert registered.class_names == ["normal", "tumor"]
