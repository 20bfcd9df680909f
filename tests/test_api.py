"""The Python API: arrays and overrides behave like the CLI (docs/python.md runs in test_pip_install.py)."""

import numpy as np
import pytest

import dpsynth
from dpsynth.errors import ConfigError, DataError


def test_synthesizer_is_exported_and_validates_overrides_at_construction():
    assert dpsynth.Synthesizer.__module__ == "dpsynth.api"
    with pytest.raises(ConfigError, match="'dpdm.steps' = -3"):
        dpsynth.Synthesizer("dpdm", overrides={"dpdm.steps": -3})
    synth = dpsynth.Synthesizer("dpdm", epsilon=2.0, overrides={"dpdm.steps": 20})
    assert synth.config["privacy"]["epsilon"] == 2.0 and synth.config["dpdm"]["steps"] == 20


def test_private_labels_need_an_explicit_class_count(tmp_path):
    synth = dpsynth.Synthesizer("dpsgd-classifier")
    images = np.zeros((50, 8, 8), np.uint8)
    with pytest.raises(DataError, match="num_classes"):
        synth.fit(images, np.arange(50) % 2, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_unfitted_synthesizer_has_no_run_dir():
    with pytest.raises(ConfigError, match="not been fitted"):
        _ = dpsynth.Synthesizer("dpdm").run_dir


def test_cli_evaluate_is_a_thin_layer_over_the_api(monkeypatch, capsys):
    """`dpsynth evaluate` parses arguments and calls dpsynth.evaluate; it has no logic of its own."""
    import dpsynth.api
    from dpsynth.cli import main

    calls = []

    def fake_evaluate(target, metrics=None, **options):
        calls.append((target, metrics, options))
        return {"fid": 1.5}

    monkeypatch.setattr(dpsynth.api, "evaluate", fake_evaluate)
    assert dpsynth.evaluate is fake_evaluate
    assert main(["evaluate", "some.npz", "--metrics", "fid", "--data", "mnist10k", "--json"]) == 0
    assert calls == [("some.npz", ["fid"], calls[0][2])] and calls[0][2]["data"] == "mnist10k"
    assert capsys.readouterr().out.strip() == '{"fid": 1.5}'
