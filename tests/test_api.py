"""The Python API: the docs/python.md example runs as written; arrays and overrides behave like the CLI."""

import re

import numpy as np
import pytest
from conftest import REPO

import dpsynth
from dpsynth.errors import ConfigError, DataError


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


def test_docs_python_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(REPO / "docs" / "python.md")
    assert blocks, "docs/python.md has a python example"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/python.md", "exec"), namespace)  # noqa: S102  (running the documented example is the test)
    synth = namespace["synth"]
    assert (synth.run_dir / "privacy.json").is_file() and (synth.run_dir / "samples.npz").is_file()
    assert synth.privacy["epsilon"] <= 5.0
    assert namespace["samples"].dtype == np.uint8 and namespace["samples"].shape == (40, 28, 28, 1)
    assert set(np.unique(namespace["sample_labels"])) <= set(range(10))
    spent = {m["name"]: m["noise_multiplier"] for m in synth.privacy["mechanisms"]}
    assert spent == {m.name: m.noise_multiplier for m in namespace["plan"].mechanisms}


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
