"""The release's class balance against the requested (balanced) label distribution, checked after
generation for every method (docs/report.md): a method that collapses to one label is called out in the log,
the report, metrics.json, the summary line and a Python warning; a balanced one is not."""

import json
import warnings

import numpy as np
import pytest
import torch
from fake_methods import two_class_images  # registers the test methods (tests/ is on pythonpath)

import dpsynth
from dpsynth.report.balance import FAR_FROM_REQUESTED, balanced_draw, label_balance, requested_counts


def test_balanced_labels_pass_and_one_class_is_called_out():
    assert label_balance(np.arange(64) % 2, 2)["warning"] is None
    collapsed = label_balance(np.zeros(64, np.int64), 2)
    assert collapsed["missing_classes"] == [1] and collapsed["total_variation"] == pytest.approx(0.5)
    assert "no sample of requested class(es) 1" in collapsed["warning"] and "[64, 0]" in collapsed["warning"]
    assert collapsed["released"] == [64, 0] and collapsed["requested"] == [32, 32]


def test_the_threshold_is_a_total_variation_distance_and_missing_classes_always_count():
    assert list(requested_counts(7, 3)) == [3, 2, 2]
    near = np.array([0] * 35 + [1] * 29)  # 35/29 instead of 32/32: distance 3/64
    assert label_balance(near, 2)["warning"] is None
    far = np.array([0] * 50 + [1] * 14)  # distance 18/64 > 0.2
    assert label_balance(far, 2)["total_variation"] > FAR_FROM_REQUESTED and label_balance(far, 2)["warning"]
    ten = np.arange(100) % 9  # class 9 never released: distance 0.1 only, still flagged
    assert label_balance(ten, 10)["missing_classes"] == [9] and label_balance(ten, 10)["warning"]
    few = np.arange(3)  # fewer samples than classes: the classes never requested are not missing
    assert label_balance(few, 10)["warning"] is None


@pytest.mark.parametrize("method, flagged", [("test-collapsed-means", True), ("test-balanced-means", False)])
def test_a_run_says_plainly_when_its_release_collapses_to_one_label(method, flagged, tmp_path):
    from dpsynth.report.html import render_report
    from dpsynth.runner import summary_line

    images, labels = two_class_images(200)
    synth = dpsynth.Synthesizer(method, epsilon=2.0, overrides={"generate.num": 64})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        synth.fit(images, labels, num_classes=2, out=tmp_path / "run")
        _, sample_labels = synth.sample(64)
    said = [str(w.message) for w in caught if w.category is dpsynth.api.UnbalancedLabelsWarning]
    run = tmp_path / "run"
    balance = json.loads((run / "diagnostics" / "metrics.json").read_text())["label_balance"]
    log = (run / "log.txt").read_text()
    reports = [render_report(run), render_report(run, release=True)]  # public output: both reports say it
    assert balance["requested"] == [32, 32] and balance["num_classes"] == 2
    if flagged:
        assert set(sample_labels) == {0} and len(said) == 2  # fit (the run's release) and sample
        assert balance["missing_classes"] == [1] and "warning: the released labels do not follow" in log
        assert all("The released labels do not follow the requested balanced distribution" in r for r in reports)
        assert "WARNING: labels not balanced as requested" in summary_line(run)
    else:
        assert not said and balance["warning"] is None and "released labels" not in log
        assert not any("do not follow the requested" in r for r in reports)
        assert "WARNING" not in summary_line(run)


def test_dp_imgsyn_hard_labels_follow_the_requested_targets_even_when_the_teacher_is_collapsed():
    """The cause of the issue's one-class release: hard labels were the DP teacher's argmax, and a weak
    teacher (200 faces at ε 2) answers one class for everything. They are the balanced targets now."""
    from dpsynth.inversion.alignment import ReleaseSection, soft_label_release
    from dpsynth.report.balance import balanced_labels

    class OneClassTeacher(torch.nn.Module):
        def forward(self, x):
            return torch.tensor([5.0, -5.0]).expand(len(x), 2)

    targets = torch.from_numpy(balanced_labels(64, 2))
    images = torch.rand(64, 1, 8, 8) * 2 - 1
    samples = soft_label_release(OneClassTeacher(), images, targets, ReleaseSection(), torch.device("cpu"))
    assert label_balance(samples.labels, 2)["warning"] is None and np.array_equal(samples.labels, targets.numpy())
    assert samples.soft_labels.argmax(1).tolist() == [0] * 64  # the teacher's view stays in the soft labels
    teacher = soft_label_release(
        OneClassTeacher(), images, targets, ReleaseSection(labels="teacher"), torch.device("cpu")
    )
    assert label_balance(teacher.labels, 2)["warning"] is not None


def test_balanced_draw_cycles_over_the_classes_and_repeats_only_when_short():
    images = np.arange(12, dtype=np.uint8).reshape(12, 1, 1, 1)
    labels = np.repeat(np.arange(3), 4)
    drawn, drawn_labels = balanced_draw(images, labels, 9, seed=0)
    assert drawn_labels.tolist() == [0, 1, 2] * 3
    assert len(set(drawn[:, 0, 0, 0].tolist())) == 9 and all(labels[drawn[:, 0, 0, 0]] == drawn_labels)
    drawn, _ = balanced_draw(images, labels, 30, seed=0)
    assert len(set(drawn[:, 0, 0, 0].tolist())) == 12
