"""CLI contract: helpful --help, one-line errors, --json on stdout alone, no half-written run."""

import json

import numpy as np
import pytest
from conftest import assert_one_line_error, run_cli

SMOKE = (
    "method: dpsgd-classifier\ndata: {private: mnist10k, max_train: 300}\n"
    "dpsgd-classifier: {model: logreg, steps: 3, batch_size: 64}\ngenerate: {num: 10}\n"
)


@pytest.mark.parametrize(
    "command", ["demo", "run", "generate", "evaluate", "privacy", "datasets", "methods", "report", "bench"]
)
def test_every_command_has_help(cli, command):
    result = cli(command, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout


def test_methods_json_is_one_object_on_stdout(cli):
    result = cli("methods", "--json")
    assert result.returncode == 0
    names = {m["name"] for m in json.loads(result.stdout)["methods"]}
    assert "dpsgd-classifier" in names


def test_datasets_json_lists_builtins(cli):
    result = cli("datasets", "--json")
    assert result.returncode == 0, result.stderr
    rows = {d["name"]: d for d in json.loads(result.stdout)["datasets"]}
    assert rows["mnist10k"]["size"] == 10000 and list(rows["mnist10k"]["shape"]) == [28, 28, 1]
    assert rows["mnist10k"]["classes"] == 10
    assert "digits8x8" in rows and "glyphs" in rows


def test_bad_usage_is_one_line(cli):
    assert_one_line_error(cli("run"), "config")
    assert_one_line_error(cli("generate", "x"), "--num")


def test_the_installed_entry_point_prints_one_error_line_and_fails():
    """``python -m dpsynth`` in its own process: what every in-process ``cli`` call stands in for. Its stderr is
    the error line alone (no warning or log line from the imports either)."""
    failed = run_cli("run")
    assert_one_line_error(failed, "config")
    assert len(failed.stderr.strip().splitlines()) == 1 and failed.stdout == "", failed.stderr
    listed = run_cli("methods", "--json")
    assert listed.returncode == 0 and "dp-imgsyn" in {m["name"] for m in json.loads(listed.stdout)["methods"]}


def config_file(tmp_path, text=SMOKE):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["bogus=1"], "unknown config key 'bogus'"),
        (["method=nope"], "unknown method 'nope'"),
        (["privacy.epsilon=0"], "privacy.epsilon"),
        (["privacy.epsilon=-2"], "privacy.epsilon"),
        (["privacy.delta=1"], "privacy.delta"),
        (["privacy.delta=0"], "privacy.delta"),
        (["data.private=/no/such/dataset.npz"], "/no/such/dataset.npz"),
        (["data.private=nosuchset"], "nosuchset"),
        (["data.public=nosuchpublic"], "nosuchpublic"),
    ],
)
def test_bad_run_input_leaves_no_run_directory(cli, tmp_path, overrides, fragment):
    out = tmp_path / "run"
    args = ["run", str(config_file(tmp_path)), "--out", str(out)]
    for item in overrides:
        args += ["--set", item]
    assert_one_line_error(cli(*args), fragment)
    assert not out.exists()


def test_corrupt_private_npz_is_rejected(cli, tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file at all")
    out = tmp_path / "run"
    result = cli("run", str(config_file(tmp_path)), "--out", str(out), "--set", f"data.private={bad}")
    assert_one_line_error(result, "bad.npz")
    assert not out.exists()


def test_labels_out_of_range_are_rejected(cli, tmp_path):
    path = tmp_path / "labels.npz"
    np.savez(path, images=np.zeros((20, 8, 8, 1), np.uint8), labels=np.full(20, -1))
    result = cli("run", str(config_file(tmp_path)), "--out", str(tmp_path / "r"), "--set", f"data.private={path}")
    assert_one_line_error(result)
    assert not (tmp_path / "r").exists()


def test_existing_run_directory_needs_resume(cli, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "something").write_text("x")
    assert_one_line_error(cli("run", str(config_file(tmp_path)), "--out", str(out)), "--resume")


@pytest.mark.parametrize(
    "preset, side, fragment",
    [("dp-gan/smoke", 8, "set data.image_size to 16"), ("dpdm/smoke", 2, "needs a side of at least 3")],
)
def test_a_network_that_cannot_take_the_image_side_fails_before_any_read(cli, tmp_path, preset, side, fragment):
    out = tmp_path / "run"
    result = cli("run", preset, "--out", str(out), "--set", f"data.image_size={side}")
    assert_one_line_error(result, fragment, "data.image_size")
    assert not out.exists()
