"""The DP-SGD classifier baseline beside the chance and majority rates: how the report table and
`dpsynth evaluate --show` word it, and where the release stands against it."""

import argparse

import pytest

from dpsynth.report.usefulness import baseline_rows, versus_dpsgd


def metrics(release_mean, baseline_mean=None):
    accuracy = {
        "cnn": {
            "mean": release_mean,
            "std": 0.0,
            "test_size": 100,
            "interval": [release_mean - 9, release_mean + 8],
            "versus_majority": "above",
        }
    }
    baselines = {"test_size": 100, "num_classes": 2, "chance": 50.0, "majority": 55.0, "headline": "cnn"}
    if baseline_mean is not None:
        baselines["dpsgd_classifier"] = {
            "mean": baseline_mean,
            "std": 0.0,
            "test_size": 100,
            "interval": [baseline_mean - 9, baseline_mean + 8],
            "versus_majority": "above",
            "epsilon": 1.99,
            "delta": 1e-5,
            "combined_epsilon": 2.9,
            "run_dir": "RUN/baseline-dpsgd",
        }
    return {"accuracy": accuracy, "accuracy_baselines": baselines}


def test_no_baseline_row_or_sentence_when_it_was_not_trained():
    result = metrics(80.0)
    assert len(baseline_rows(result["accuracy_baselines"])) == 2
    assert versus_dpsgd(result["accuracy"], result["accuracy_baselines"]) is None


@pytest.mark.parametrize(
    "release, direct, standing",
    [
        (60.0, 90.0, "below it: training a classifier on the private data directly did better"),
        (90.0, 60.0, "above it"),
        (80.0, 82.0, "within its 95 % interval"),
    ],
)
def test_the_release_is_placed_against_the_dpsgd_classifier(release, direct, standing):
    result = metrics(release, direct)
    rows = baseline_rows(result["accuracy_baselines"])
    assert rows[-1][0] == (
        "DP-SGD classifier trained on the private data at ε = 1.99 (a separate release; with this release, "
        "ε = 2.9 in all)"
    )
    assert rows[-1][1].startswith(f"{direct:.1f} %") and "100 test images" in rows[-1][1]
    sentence = versus_dpsgd(result["accuracy"], result["accuracy_baselines"])
    assert sentence.endswith(f"the cnn classifier on the release is {standing}.")


def test_evaluate_show_prints_the_baseline_sentence(monkeypatch, capsys):
    import dpsynth.api
    from dpsynth.cli import evaluate as eval_cli

    calls = []
    monkeypatch.setattr(dpsynth.api, "evaluate", lambda *args, **kwargs: calls.append(kwargs) or metrics(60.0, 90.0))
    parser = argparse.ArgumentParser()
    eval_cli.register(parser.add_subparsers())
    arguments = ["evaluate", "RUN", "--show", "--baseline", "--baseline-set", "dpsgd-classifier.steps=5"]
    eval_cli.run(parser.parse_args(arguments))
    assert calls[0]["baseline"] is True and calls[0]["baseline_overrides"] == ["dpsgd-classifier.steps=5"]
    out = capsys.readouterr().out
    assert "The DP-SGD classifier trained on the private data at ε = 1.99" in out and "did better" in out
