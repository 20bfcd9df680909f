"""Private values never reach an error message, the console or the bench's results JSON (docs/privacy.md).

Each test plants distinctive private values (a label 987654, a pixel 123.456, an overlap of 7 records,
a secret a run prints) and checks that the message, the console or the JSON names the problem without
quoting any of them.
"""

import csv
import gzip
import json
import re
import struct
import sys

import numpy as np
import pytest
from PIL import Image

from dpsynth.bench import load_suite
from dpsynth.bench.cells import FAILED, OVER_BUDGET, RUN_FAILED, PlannedRun, execute, plan_runs, write_record
from dpsynth.bench.table import cell_results, write_results
from dpsynth.data import load_dataset, load_private
from dpsynth.data.dataset import ImageDataset, PrivateSplits
from dpsynth.data.loading import check_overlap, count_overlap
from dpsynth.data.transforms import float_to_uint8
from dpsynth.errors import DataError
from dpsynth.privacy import PrivacyLedger
from dpsynth.rundir import LedgerStore, RunLog

SECRET = "987654"  # a private value a run prints or raises


# ------------------------------------------------------------------ error messages


def _npz(tmp_path, **arrays):
    np.savez(tmp_path / "d.npz", **arrays)
    return tmp_path / "d.npz"


def _grey(count, value=0):
    return np.full((count, 4, 4, 1), value, np.uint8)


def _float_pixel(tmp_path):  # one pixel 123.456 where [0, 1] is declared
    images = np.zeros((4, 4, 4, 1), np.float32)
    images[2, 1, 1, 0] = 123.456
    load_dataset(_npz(tmp_path, images=images, labels=[0, 1, 0, 1]), pixel_range=[0, 1])


def _nan_pixel(tmp_path):
    images = np.full((4, 4, 4, 1), 0.5, np.float32)
    images[1, 0, 0, 0], images[3, 2, 2, 0] = np.nan, -np.inf
    load_dataset(_npz(tmp_path, images=images, labels=[0, 1, 0, 1]), pixel_range=[0, 1])


def _integer_pixel(tmp_path):
    images = np.zeros((4, 4, 4, 1), np.int32)
    images[0, 0, 0, 0] = 987654
    load_dataset(_npz(tmp_path, images=images, labels=[0, 1, 0, 1]))


def _label_too_large(tmp_path):
    load_dataset(_npz(tmp_path, images=_grey(4), labels=[0, 1, 987654, 1], num_classes=10))


def _label_negative(tmp_path):
    ImageDataset(_grey(3), np.array([0, -987654, 1]), 10)


def _image_sizes(tmp_path):  # a record 13 x 17 among 4 x 4 ones
    for name, size in (("a/0.png", (4, 4)), ("a/1.png", (13, 17)), ("b/0.png", (4, 4))):
        (tmp_path / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros(size, np.uint8)).save(tmp_path / "tree" / name)
    load_dataset(tmp_path / "tree")


def _idx(tmp_path, images: np.ndarray, labels: np.ndarray, mapping: str | None = None, gz: bool = False):
    def write(name, array):
        raw = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
        data = raw + array.astype(np.uint8).tobytes()
        (tmp_path / (name + (".gz" if gz else ""))).write_bytes(gzip.compress(data) if gz else data)

    write("emnist-digits-train-images-idx3-ubyte", images)
    write("emnist-digits-train-labels-idx1-ubyte", labels)
    if mapping is not None:
        (tmp_path / "emnist-digits-mapping.txt").write_text(mapping)


def _unmapped_label(tmp_path):  # a stored label 237 that the mapping file lacks
    _idx(tmp_path, np.zeros((3, 4, 4)), np.array([0, 237, 1]), mapping="0 48\n1 49\n")
    load_dataset(tmp_path)


def _corrupt_gzip(tmp_path):  # bytes after the gzip stream: gzip quotes the first two it finds
    _idx(tmp_path, np.full((3, 4, 4), 201), np.array([0, 1, 0]), gz=True)
    path = tmp_path / "emnist-digits-train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes() + b"Zq987654")
    load_dataset(tmp_path)


def _cifar_pickle(tmp_path):  # the unpickler would quote the byte it choked on
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(b"Z987654")
    load_dataset(tmp_path)


def _camelyon_value(tmp_path):  # a tumour label that is not a number
    (tmp_path / "patches").mkdir()
    with open(tmp_path / "metadata.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["", "patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split"])
        writer.writerow([0, "004", 4, 3328, 21792, "tumour-987654", 0, 0, 0])
    load_dataset(tmp_path)


def _overlap(tmp_path):  # 7 private records are also public
    private = np.random.default_rng(0).integers(0, 256, (40, 4, 4, 1), dtype=np.uint8)
    splits = PrivateSplits(
        *(ImageDataset(part, np.zeros(len(part), np.int64), 2) for part in np.split(private, [20, 30]))
    )
    public = np.concatenate([private[[0, 1, 2, 10, 11, 20, 30]], np.full((5, 4, 4, 1), 7, np.uint8)])
    public_set = ImageDataset(public, np.zeros(len(public), np.int64), 2)
    assert count_overlap(splits, public_set) == 7
    check_overlap(splits, public_set)


def _float_array(tmp_path):
    float_to_uint8(np.array([0.0, 123.456, -987654.0, 0.5]), [0, 1])


# (what raises, text that would quote a private value, what the message must still say)
LEAKS = {
    "float pixel out of range": (_float_pixel, [r"123\.4", r"\b1 pixel", r"\(s\)"], "outside the declared pixel_range"),
    "float pixel NaN or inf": (_nan_pixel, [r"\b[12] pixel", r"\(s\)", "-inf"], "NaN and infinite pixel values"),
    "integer pixel": (_integer_pixel, ["987654", r"\b1 pixel"], "outside 0..255"),
    "array pixel": (_float_array, ["123", "987654", r"\b2 pixel"], "outside the declared pixel_range [0, 1]"),
    "label too large": (_label_too_large, ["987654", r"\.\."], "labels must lie in [0, 10)"),
    "label negative": (_label_negative, ["987654", r"\.\."], "a label is negative"),
    "image sizes": (_image_sizes, [r"13\s*x\s*17", r"17\s*x\s*13"], "images differ in size"),
    "unmapped label": (_unmapped_label, ["237"], "a stored label is not in the mapping file"),
    "corrupt gzip": (_corrupt_gzip, ["Zq", "987654"], "corrupt gzip data"),
    "cifar pickle": (_cifar_pickle, ["load key", "'Z'", "987654"], "cannot read CIFAR batch"),
    "camelyon value": (_camelyon_value, ["987654", "tumour-"], "column 'tumor'"),
    "overlap": (_overlap, [r"\b7\b"], "private images also appear in the public set"),
}


@pytest.mark.parametrize("case", LEAKS, ids=list(LEAKS))
def test_error_messages_name_the_problem_without_quoting_private_values(tmp_path, case):
    make, private, problem = LEAKS[case]
    with pytest.raises(DataError) as err:
        make(tmp_path)
    message = str(err.value).replace(str(tmp_path), "<dir>")  # the user's own paths are not data
    assert problem in message
    for pattern in private:
        assert not re.search(pattern, message), f"{case}: {message!r} quotes {pattern!r}"


@pytest.mark.parametrize("reader", ["image", "npz"])
def test_a_decoders_message_loses_the_bytes_it_quotes_from_the_file(tmp_path, monkeypatch, reader):
    import dpsynth.data.readers.common as common
    import dpsynth.data.readers.npz as npz

    def broken(*args, **kwargs):
        raise (SyntaxError if reader == "image" else ValueError)("broken file (chunk b'Zq98', expected b\"\\x93\")")

    if reader == "image":
        monkeypatch.setattr(common.Image, "open", broken)
        call = lambda: common.open_image(tmp_path / "a.png")  # noqa: E731
    else:
        monkeypatch.setattr(npz.np, "load", broken)
        call = lambda: npz.load_arrays(tmp_path / "a.npz")  # noqa: E731
    with pytest.raises(DataError) as err:
        call()
    assert "broken file (chunk <bytes>, expected <bytes>)" in str(err.value)
    assert "Zq98" not in str(err.value) and "x93" not in str(err.value)


# ------------------------------------------------------------------ empty declared classes
# Not refused (docs/privacy.md, "Refusals that depend on the data"): which declared classes a private split lacks
# is a count of private records, so it may neither decide whether a run exists nor reach an error or the console.


def test_declared_classes_without_a_training_record_load_without_an_error(tmp_path):
    names = np.array(["zero", "one", "cls_987654", "three", "cls_123456"])  # 3 of the 5 have no record
    images = np.random.default_rng(0).integers(0, 256, (40, 4, 4, 1), dtype=np.uint8)  # distinct records
    path = _npz(tmp_path, images=images, labels=np.array([0, 1] * 20), class_names=names)
    splits = load_private(path, val_size=0.2, test_size=0.2)
    assert splits.train.num_classes == 5 and splits.train.class_names == list(names)
    assert set(splits.train.labels.tolist()) == {0, 1} and len(splits.train) > 0


def test_an_empty_class_folder_declares_a_class_without_records(tmp_path):
    for name, count in (("a", 2), ("b", 2), ("cls_987654", 0)):
        (tmp_path / "tree" / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "tree" / name / f"{i}.png")
    dataset = load_dataset(tmp_path / "tree")
    assert dataset.class_names == ["a", "b", "cls_987654"] and dataset.num_classes == 3
    assert np.bincount(dataset.labels, minlength=3).tolist() == [2, 2, 0]


def test_a_run_with_an_empty_class_says_so_only_in_its_private_diagnostics(tmp_path, capfd):
    from fake_methods import two_class_images  # registers the test methods (tests/ is on pythonpath)

    import dpsynth

    images, labels = two_class_images(80)
    synth = dpsynth.Synthesizer("test-balanced-means", epsilon=2.0, overrides={"generate.num": 30})
    synth.fit(images, labels, num_classes=3, out=tmp_path / "run", echo=True)
    console = capfd.readouterr()
    note = "no record of declared class(es) [2]"
    assert "run test-balanced-means" in console.err  # the log is echoed ...
    assert "declared class" not in console.err + console.out  # ... but not the private diagnostic
    assert "declared class" not in (tmp_path / "run" / "log.txt").read_text()
    assert note in (tmp_path / "run" / "diagnostics" / "log.txt").read_text()


# ------------------------------------------------------------------ RunLog


@pytest.mark.parametrize("store", [False, True])
def test_private_log_lines_stay_in_diagnostics_and_off_the_console(tmp_path, capfd, store):
    ledger_store = None
    if store:
        ledger_store = LedgerStore(tmp_path, PrivacyLedger(1.0, 1e-5, accountant="rdp"))
        ledger_store.persist()
    log = RunLog(tmp_path, echo=True, store=ledger_store)
    log("step 10 of 100, epsilon 0.5")
    log(f"test accuracy of the classifier: {SECRET} %", private=True)
    log(f"validation accuracy {SECRET}")  # caught by PRIVATE_LINE, not marked by the caller
    console = capfd.readouterr()
    assert "step 10 of 100" in console.err
    assert SECRET not in console.err + console.out
    assert SECRET not in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "diagnostics" / "log.txt").read_text().count(SECRET) == 2


# ------------------------------------------------------------------ bench results

SUITE = """dataset: mnist10k
settings: {pipeline_seeds: 1}
methods:
  - method: dpsgd-classifier
    estimated_minutes: 1
    presets:
      10: dpsgd-classifier/smoke
"""


class _FailingRun(PlannedRun):
    """A planned run whose command prints a private value and dies with it in its exception."""

    def run_command(self, resume: bool = False) -> list[str]:
        # the value is computed, so that the command (which the record keeps) does not quote it
        script = (
            "import sys; value = 987000 + 654; print(f'label {value} of record 3', file=sys.stderr); "
            "raise ValueError(f'pixel {value}')"
        )
        return [sys.executable, "-c", script]


def _planned(tmp_path) -> PlannedRun:
    (tmp_path / "suite.yaml").write_text(SUITE)
    suite = load_suite(tmp_path / "suite.yaml")
    [run] = plan_runs(suite, list(suite.cells), tmp_path / "out")
    return suite, run


def test_a_failing_run_leaves_no_private_output_in_its_record_or_the_results_json(tmp_path, monkeypatch):
    import dpsynth.bench.cells as cells

    monkeypatch.setattr(cells, "machine", lambda: {"cpu": "test"})
    suite, planned = _planned(tmp_path)
    run = _FailingRun(planned.cell, planned.seed, planned.run_dir, planned.overrides, planned.canary)
    record = execute(run, budget_s=600.0, log=lambda line: None)
    assert SECRET in run.log_path.read_text()  # the detail is kept beside the run, for the custodian
    assert record["status"] == FAILED and record["error"] == RUN_FAILED and record["exit_status"] == 1
    assert SECRET not in run.record_path.read_text()
    results = write_results(tmp_path / "results.json", suite, cell_results(suite, [run]))
    text = results.read_text()
    assert SECRET not in text
    [entry] = json.loads(text)["cells"][0]["runs"]
    assert entry["error"] == RUN_FAILED and entry["exit_status"] == 1


@pytest.mark.parametrize("status", [FAILED, OVER_BUDGET])
def test_an_older_record_with_raw_output_is_reduced_to_its_category(tmp_path, status):
    suite, run = _planned(tmp_path)
    attempt = {"wall_s": 1.0, "peak_mib": 1.0, "returncode": 1, "timed_out": False, "command": ""}
    raw = f"Traceback ... | DataError: label {SECRET} | pixel {SECRET}"
    write_record(run, {"run": run.name, "status": status, "steps": {"run": {"attempts": [attempt]}}, "error": raw})
    text = write_results(tmp_path / "results.json", suite, cell_results(suite, [run])).read_text()
    assert SECRET not in text
    assert "see the run's log" in json.loads(text)["cells"][0]["runs"][0]["error"]
