"""A declared class with no training record is not refused (docs/privacy.md, "Refusals that depend on the data").

Whether a run exists is released, so it must not depend on a per-class count. Dataset D has no record of
one of its three declared classes; D + 1 adds one such record (kept in the train split by its own content
key). Both run, through an image folder, an ``.npz`` file and in-memory arrays, and their ``privacy.json``
and ``log.txt`` differ only in values that depend on N: the train size, and for DP-SGD the sample rate
q = B/N with what follows from it (the calibrated sigma, the epsilon spent). Only the custodian's
``diagnostics/log.txt`` says that a class is empty.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_methods import two_class_images  # registers the test methods (tests/ is on pythonpath)
from PIL import Image

import dpsynth
from dpsynth.config import resolve_config
from dpsynth.data.arrays import array_train_size

CLASSES = ["0-dark", "1-bright", "2-rare"]  # sorted as folder names: the same label indices on every path
EMPTY_NOTE = "no record of declared class(es) [2]"
FAST = {"generate.num": 30, "evaluate.metrics": [], "evaluate.audit": False}


def rare_record(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """D + one record of the empty class 2, the first candidate whose content key keeps it in the train split."""
    data = resolve_config({"method": "test-balanced-means"}).data
    before = array_train_size(images, labels, data)
    for seed in range(100):
        extra = np.random.default_rng(seed).integers(100, 150, (1, *images.shape[1:])).astype(np.uint8)
        grown, grown_labels = np.concatenate([images, extra]), np.r_[labels, 2]
        if array_train_size(grown, grown_labels, data) == before + 1:
            return grown, grown_labels
    raise AssertionError("no candidate record lands in the train split")


@pytest.fixture(scope="module")
def datasets() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    images, labels = two_class_images(120)
    return {"without": (images, labels), "with": rare_record(images, labels)}


def write_folder(root: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    for name in CLASSES:
        (root / name).mkdir(parents=True)  # the rare class's folder is empty in D: it declares the class
    for index, (image, label) in enumerate(zip(images, labels)):
        Image.fromarray(image).save(root / CLASSES[label] / f"{index:04d}.png")
    return root


def fit(method: str, path: str, images: np.ndarray, labels: np.ndarray, where: Path, overrides: dict) -> Path:
    """Fit ``method`` on the data handed over by ``path`` (folder, npz or arrays); the run directory."""
    out = where / "run"
    if path == "arrays":
        synth = dpsynth.Synthesizer(method, epsilon=2.0, overrides={**FAST, **overrides})
        synth.fit(images, labels, num_classes=len(CLASSES), out=out)
    elif path == "npz":
        np.savez(where / "data.npz", images=images, labels=labels, class_names=np.array(CLASSES))
        synth = dpsynth.Synthesizer(method, epsilon=2.0, overrides={**FAST, **overrides})
        synth.fit(str(where / "data.npz"), out=out)
    else:
        root = write_folder(where / "data", images, labels)
        synth = dpsynth.Synthesizer(method, epsilon=2.0, overrides={**FAST, **overrides, "data.channels": 1})
        synth.fit(str(root), out=out)
    return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
#: Log values that depend on N: the train size, q = B/N and what follows from it. Wall-clock durations differ
#: from run to run whatever the data.
_N_DEPENDENT = re.compile(r"(\(train |q=|sigma=|eps=|eps spent so far |finished in )$")


def same_but_n(a: str, b: str, where: Path, other: Path) -> list[str]:
    """The labels (text just before each number) of the numbers in which ``a`` and ``b`` differ; AssertionError
    if anything else differs (the two runs' own directories aside)."""
    a, b = a.replace(str(where.parent), "<dir>"), b.replace(str(other.parent), "<dir>")  # data and run dirs
    texts_a, texts_b = _NUMBER.split(a), _NUMBER.split(b)
    assert texts_a == texts_b, (a, b)
    changed = []
    for text, x, y in zip(texts_a, _NUMBER.findall(a), _NUMBER.findall(b)):
        if x != y:
            label = _N_DEPENDENT.search(text)
            assert label, (text, x, y, a, b)
            changed.append(label.group(1))
    return changed


def log_lines(run: Path) -> list[str]:
    return [line.split("] ", 1)[1] for line in (run / "log.txt").read_text().splitlines()]  # no timestamp


def compare_privacy(small: dict[str, Any], large: dict[str, Any], where: Path, other: Path) -> set[str]:
    """The keys whose values differ (numbers: only N-dependent ones; strings: only in their numbers)."""
    allowed = {"epsilon", "noise_multiplier", "sample_rate", "sampling_probability"}
    changed: set[str] = set()

    def walk(x: Any, y: Any, key: str) -> None:
        if isinstance(x, dict):
            assert isinstance(y, dict) and x.keys() == y.keys(), key
            for name in x:
                walk(x[name], y[name], name)
        elif isinstance(x, list):
            assert isinstance(y, list) and len(x) == len(y), key
            for u, v in zip(x, y):
                walk(u, v, key)
        elif isinstance(x, str):
            assert isinstance(y, str)
            if x != y:
                assert _NUMBER.split(x) == _NUMBER.split(y), (key, x, y)  # the statement quotes epsilon
                changed.add(key)
        elif x != y:
            assert key in allowed, (key, x, y)
            changed.add(key)

    walk(small, large, "")
    return changed


def run_pair(method: str, path: str, datasets: dict, tmp_path: Path, overrides: dict) -> tuple[Path, Path]:
    runs = []
    for name, (images, labels) in datasets.items():
        (tmp_path / name).mkdir()
        runs.append(fit(method, path, images, labels, tmp_path / name, overrides))
    return runs[0], runs[1]


def train_size(run: Path) -> int:
    return int(re.search(r"\(train (\d+)\)", (run / "log.txt").read_text()).group(1))


@pytest.mark.parametrize("path", ["folder", "npz", "arrays"])
def test_a_class_without_training_record_runs_like_one_with_a_record(path, datasets, tmp_path):
    """test-balanced-means releases noisy class means (one Gaussian, no N in its plan): privacy.json is the
    same for D and D + 1, and log.txt differs in the train size alone."""
    small, large = run_pair("test-balanced-means", path, datasets, tmp_path, {})
    assert train_size(large) == train_size(small) + 1
    assert (
        compare_privacy(
            json.loads((small / "privacy.json").read_text()),
            json.loads((large / "privacy.json").read_text()),
            small,
            large,
        )
        == set()
    )
    lines_small, lines_large = log_lines(small), log_lines(large)
    assert len(lines_small) == len(lines_large)
    changed = [c for a, b in zip(lines_small, lines_large) for c in same_but_n(a, b, small, large)]
    assert "(train " in changed and set(changed) <= {"(train ", "finished in "}
    # The generator still gets the empty class's public label: the release is balanced over 3 classes.
    released = np.load(small / "samples.npz")["labels"]
    assert set(released.tolist()) == {0, 1, 2}
    # Only the custodian's diagnostics say that a class is empty.
    assert EMPTY_NOTE in (small / "diagnostics" / "log.txt").read_text()
    assert EMPTY_NOTE not in (large / "diagnostics" / "log.txt").read_text()
    for run in (small, large):
        assert "declared class" not in (run / "log.txt").read_text()


def test_a_dp_sgd_run_without_a_class_differs_from_its_neighbour_only_through_n(datasets, tmp_path):
    """DP-SGD on arrays: q = B/N, so the sample rate, the calibrated sigma and the epsilon spent differ between
    D and D + 1, and nothing else."""
    overrides = {
        "dpsgd-classifier.batch_size": 20,
        "dpsgd-classifier.physical_batch_size": 20,
        "dpsgd-classifier.steps": 2,
        "privacy.accountant": "rdp",
    }
    small, large = run_pair("dpsgd-classifier", "arrays", datasets, tmp_path, overrides)
    records = [json.loads((run / "privacy.json").read_text()) for run in (small, large)]
    changed = compare_privacy(*records, small, large)
    assert {"sample_rate", "sampling_probability"} <= changed  # q in the mechanism and in its dp_event
    assert changed <= {"epsilon", "noise_multiplier", "sample_rate", "sampling_probability", "statement"}
    for run, record in zip((small, large), records):
        assert record["mechanisms"][0]["sample_rate"] == pytest.approx(20 / train_size(run))
    changed_log = {c for a, b in zip(log_lines(small), log_lines(large)) for c in same_but_n(a, b, small, large)}
    assert "(train " in changed_log and "q=" in changed_log
