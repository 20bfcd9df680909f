"""Evaluating a run fitted on in-memory arrays (docs/evaluation.md): on held-out arrays, on the run's own
held-out split drawn again from the same arrays, in the session that fitted it, and through the CLI; and
the DP-SGD classifier baseline, a separate release beside the chance and majority rates."""

import json

import numpy as np
import pytest
from fake_methods import two_class_images  # registers the test methods (tests/ is on pythonpath)

import dpsynth
from dpsynth.errors import ConfigError, DataError

#: one quick classifier: the figures are not the point, where they come from is
QUICK = {"metrics": ["accuracy"], "seeds": 1, "models": ["logreg"], "protocol": {"epochs": 1}}


@pytest.fixture(scope="module")
def arrays():
    return two_class_images(240)


@pytest.fixture(scope="module")
def fitted(arrays, tmp_path_factory):
    images, labels = arrays
    synth = dpsynth.Synthesizer("test-balanced-means", epsilon=2.0, overrides={"generate.num": 64})
    return synth.fit(images, labels, num_classes=2, out=tmp_path_factory.mktemp("arrays") / "run")


def test_a_reloaded_arrays_run_without_data_names_both_ways_to_give_it(fitted):
    again = dpsynth.Synthesizer.load(fitted.run_dir)
    with pytest.raises(DataError) as error:
        again.evaluate(**QUICK)
    message = str(error.value)
    assert "\n" not in message and "unknown dataset" not in message
    assert "evaluate(test_images, test_labels)" in message and "--test-data" in message and "data=" in message


def test_the_run_own_held_out_split_is_drawn_again_from_the_same_arrays(fitted, arrays):
    in_session = fitted.evaluate(**QUICK)  # the split fit made, held by the synthesizer
    again = dpsynth.Synthesizer.load(fitted.run_dir).evaluate(data=arrays, **QUICK)
    assert in_session["meta"]["test_size"] == again["meta"]["test_size"] > 0
    assert in_session["accuracy_baselines"]["majority"] == again["accuracy_baselines"]["majority"]
    from dpsynth.context import read_run_config
    from dpsynth.data.arrays import split_arrays
    from dpsynth.eval.held_out import array_run_splits

    config = read_run_config(fitted.run_dir)
    redrawn = array_run_splits(arrays, config, fitted.run_dir)
    original = split_arrays(*arrays, 2, config.data)
    assert np.array_equal(redrawn.test.record_keys, original.test.record_keys)
    assert not set(redrawn.test.record_keys) & set(redrawn.train.record_keys)


def test_other_arrays_are_refused_as_the_run_own(fitted, arrays):
    images, labels = arrays
    with pytest.raises(DataError, match="not the records the run was fitted on"):
        dpsynth.Synthesizer.load(fitted.run_dir).evaluate(data=(images[:120], labels[:120]), **QUICK)


def test_held_out_arrays_are_scored_as_the_test_split(fitted):
    held_images, held_labels = two_class_images(30, seed=7)
    result = dpsynth.Synthesizer.load(fitted.run_dir).evaluate(held_images, held_labels, **QUICK)
    assert result["meta"]["test_size"] == 30 and result["accuracy"]["logreg"]["test_size"] == 30
    assert result["meta"]["test_data"] == "held-out arrays passed to evaluate"
    stored = json.loads((fitted.run_dir / "diagnostics" / "metrics.json").read_text())
    assert stored["accuracy"]["logreg"]["test_size"] == 30


def test_held_out_arrays_are_checked_without_echoing_them(fitted):
    again = dpsynth.Synthesizer.load(fitted.run_dir)
    held_images, held_labels = two_class_images(30, seed=7)
    with pytest.raises(DataError, match=r"labels must lie in \[0, 2\)") as error:
        again.evaluate(held_images, held_labels + 5, **QUICK)
    assert "6" not in str(error.value) and "15" not in str(error.value)  # no label value, no count
    with pytest.raises(DataError, match="pass images of the size the run was fitted on"):
        again.evaluate(np.zeros((30, 12, 12), np.uint8), held_labels, **QUICK)
    with pytest.raises(DataError, match="need their labels"):
        again.evaluate(held_images, None, metrics=["accuracy"])
    with pytest.raises(ConfigError, match="fid_reference 'test'"):
        again.evaluate(held_images, held_labels, metrics=["fid"], fid_reference="train")


def test_cli_evaluates_an_arrays_run_on_a_held_out_file_without_printing_figures(fitted, capsys, tmp_path):
    from dpsynth.cli import main  # in process: the test methods are registered here only

    held_images, held_labels = two_class_images(30, seed=9)
    held = tmp_path / "held.npz"
    np.savez(held, images=held_images, labels=held_labels)
    options = ["--metrics", "accuracy", "--seeds", "1", "--models", "logreg", "--epochs", "1"]
    assert main(["evaluate", str(fitted.run_dir), "--test-data", str(held), *options]) == 0
    console = capsys.readouterr()
    stored = json.loads((fitted.run_dir / "diagnostics" / "metrics.json").read_text())
    mean = stored["accuracy"]["logreg"]["mean"]
    assert stored["accuracy"]["logreg"]["test_size"] == 30
    assert f"{mean:.2f}" not in console.out + console.err and f"{mean:.1f}" not in console.out + console.err
    assert "figures not shown" in console.out
    assert main(["evaluate", str(fitted.run_dir), *options]) != 0
    refused = capsys.readouterr().err
    assert "--test-data" in refused and "unknown dataset" not in refused and refused.count("\n") == 1


def test_dpsgd_baseline_is_a_separate_release_beside_chance_and_majority(arrays, tmp_path):
    images, labels = arrays
    synth = dpsynth.Synthesizer("test-balanced-means", epsilon=2.0, overrides={"generate.num": 64})
    synth.fit(images, labels, num_classes=2, out=tmp_path / "run")
    spent_before = synth.privacy["epsilon"]
    small = {"dpsgd-classifier.steps": 3, "dpsgd-classifier.model": "logreg"}
    with pytest.raises(ConfigError, match="dpsgd-classifier.steps"):
        synth.evaluate(baseline=True, baseline_overrides={"dpsgd-classifier.steps": -1}, **QUICK)
    assert not (tmp_path / "run" / "baseline-dpsgd").exists()  # a bad key fails before anything is trained

    result = dpsynth.Synthesizer.load(synth.run_dir).evaluate(
        data=arrays, baseline=True, baseline_overrides=small, **QUICK
    )
    entry = result["accuracy_baselines"]["dpsgd_classifier"]
    baseline_privacy = json.loads((tmp_path / "run" / "baseline-dpsgd" / "privacy.json").read_text())
    assert entry["epsilon"] == baseline_privacy["epsilon"] <= 2.0
    assert entry["test_size"] == result["meta"]["test_size"] and len(entry["interval"]) == 2
    assert entry["versus_majority"] in ("above", "within", "at or below")
    # two releases on the same data: their composition costs more than either, and no more than the sum
    assert max(spent_before, entry["epsilon"]) < entry["combined_epsilon"] <= spent_before + entry["epsilon"] + 1e-6
    assert synth.privacy["epsilon"] == spent_before  # the run's own ledger is untouched
    stored = json.loads((tmp_path / "run" / "diagnostics" / "metrics.json").read_text())
    assert stored["accuracy_baselines"]["dpsgd_classifier"]["mean"] == entry["mean"]

    from dpsynth.report.html import render_report

    report = render_report(tmp_path / "run")
    assert "DP-SGD classifier trained on the private data at ε = " in report and "a separate release" in report
    assert "DP-SGD classifier" not in render_report(tmp_path / "run", release=True)  # a private diagnostic

    # asked again, the finished baseline is reused: no second release of the private data
    stamp = (tmp_path / "run" / "baseline-dpsgd" / "privacy.json").stat().st_mtime_ns
    again = synth.evaluate(baseline=True, **QUICK)
    assert again["accuracy_baselines"]["dpsgd_classifier"]["epsilon"] == entry["epsilon"]
    assert (tmp_path / "run" / "baseline-dpsgd" / "privacy.json").stat().st_mtime_ns == stamp


def test_the_audit_of_an_arrays_run_takes_the_arrays_it_was_fitted_on(fitted, arrays):
    again = dpsynth.Synthesizer.load(fitted.run_dir)
    with pytest.raises(DataError, match="fitted on in-memory arrays"):
        again.evaluate(metrics=["audit"])
    with pytest.raises(ConfigError, match="run_canary retrains the method"):
        again.evaluate(data=arrays, metrics=["run_canary"])
    report = again.evaluate(data=arrays, metrics=["audit"])["audit"]
    attack = report["membership_inference"]["nearest_neighbour"]
    assert attack["num_members"] > 0 and attack["num_nonmembers"] > 0


def test_evaluate_dpsgd_baseline_key_trains_it_at_the_end_of_the_run(arrays, tmp_path):
    images, labels = arrays
    quick_run = {"evaluate.metrics": ["accuracy"], "evaluate.seeds": 1, "evaluate.models": ["logreg"]}
    baseline = {"evaluate.dpsgd_baseline": True, "evaluate.dpsgd_baseline_settings": {"steps": 3, "model": "logreg"}}
    synth = dpsynth.Synthesizer(
        "test-balanced-means",
        epsilon=2.0,
        overrides={"generate.num": 64, "evaluate.epochs": 1, **quick_run, **baseline},
    )
    synth.fit(images, labels, num_classes=2, out=tmp_path / "run")
    baseline_run = tmp_path / "run" / "baseline-dpsgd"
    baseline_config = dpsynth.context.read_run_config(baseline_run)
    assert baseline_config.section.steps == 3  # the run's dpsgd_baseline_settings reached it
    stored = json.loads((tmp_path / "run" / "diagnostics" / "metrics.json").read_text())
    entry = stored["accuracy_baselines"]["dpsgd_classifier"]
    assert entry["epsilon"] == json.loads((baseline_run / "privacy.json").read_text())["epsilon"] <= 2.0
    assert max(synth.privacy["epsilon"], entry["epsilon"]) < entry["combined_epsilon"]


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"evaluate.dpsgd_baseline": True, "evaluate.metrics": ["fid"]}, "does not list accuracy"),
        (
            {"evaluate.dpsgd_baseline": True, "evaluate.dpsgd_baseline_settings": {"steps": -1}},
            "'evaluate.dpsgd_baseline_settings.steps' = -1",
        ),
        (
            {"evaluate.dpsgd_baseline": True, "evaluate.dpsgd_baseline_settings": {"stepz": 3}},
            "unknown config key 'evaluate.dpsgd_baseline_settings.stepz'",
        ),
        ({"evaluate.dpsgd_baseline_settings": {"steps": 3}}, "evaluate.dpsgd_baseline is false; set it true"),
    ],
    ids=["no-accuracy", "bad-value", "unknown-key", "settings-without-flag"],
)
def test_a_bad_dpsgd_baseline_request_fails_at_load(overrides, fragment):
    from dpsynth.config import load_config

    with pytest.raises(ConfigError) as error:
        load_config("dp-merf/smoke", {"evaluate.metrics": ["accuracy"], **overrides})
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_a_classifier_release_has_no_dpsgd_baseline():
    from dpsynth.config import load_config

    with pytest.raises(ConfigError, match="releases a classifier itself"):
        load_config("dpsgd-classifier/smoke", {"evaluate.dpsgd_baseline": True, "evaluate.metrics": ["accuracy"]})
