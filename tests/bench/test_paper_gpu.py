"""The paper-scale GPU runbook suite: every paper-scale preset once, and the dry run's estimate columns."""

import pytest

from dpsynth.bench import BenchOptions, bench, load_suite
from dpsynth.bench.paper import is_paper_scale, paper_scale_presets
from dpsynth.cli.bench import _dry_run_text
from dpsynth.errors import ConfigError


def test_paper_gpu_lists_every_paper_scale_preset_once():
    suite = load_suite("paper-gpu")
    presets = [cell.preset for cell in suite.cells]
    assert sorted(presets) == paper_scale_presets()
    assert suite.settings.estimate_gpu == "H100"
    for cell in suite.cells:  # every method x dataset x eps with a paper preset: the cell runs its own epsilon
        assert f"_eps{cell.epsilon:g}" in cell.preset


def test_paper_scale_rule():
    assert is_paper_scale("dpdm/cifar10_eps10") and is_paper_scale("dp-imgsyn/celeba_hair_eps1_places365")
    for name in ("dpdm/smoke", "privimage/smoke_gan", "dpdm/mnist10k_eps1", "dpdm/auto_eps1", "demo"):
        assert not is_paper_scale(name)


def write_suite(tmp_path, settings: str, dataset: str = "null"):
    path = tmp_path / "gpu.yaml"
    path.write_text(
        f"dataset: {dataset}\nbaseline: null\nsettings: {{{settings}}}\nmethods:\n"
        "  - method: dpsgd-classifier\n    estimated_minutes: 3\n    presets: {10: dpsgd-classifier/smoke}\n"
        "  - method: dpdm\n    estimated_minutes: 3\n    num_examples: 400\n    presets: {10: dpdm/smoke}\n"
    )
    return path


def test_dry_run_adds_each_runs_estimate_on_the_named_gpu(tmp_path):
    suite = write_suite(tmp_path, "estimate_gpu: A100, pipeline_seeds: 1")
    result = bench(str(suite), BenchOptions(out=tmp_path / "out"), dry=True)
    by_run = {row["run"]: row["estimate"] for row in result["runs"]}
    assert set(by_run) == {"dpsgd-classifier_eps10", "dpdm_eps10"}
    for estimate in by_run.values():
        assert estimate["parameters"] > 0 and estimate["peak_gib"] > 0 and estimate["gpu_hours"] > 0
    assert by_run["dpdm_eps10"]["num_examples"] == 400  # the entry's size stands in for the registry's
    text = _dry_run_text(result)
    assert "ESTIMATES on one A100" in text and "dpdm_eps10" in text.split("ESTIMATES")[1]


def test_a_suite_without_a_gpu_prints_no_estimates(tmp_path):
    result = bench(str(write_suite(tmp_path, "")), BenchOptions(out=tmp_path / "out"), dry=True)
    assert all("estimate" not in row for row in result["runs"])
    assert "ESTIMATES" not in _dry_run_text(result)


def test_an_unknown_gpu_fails_at_load_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="estimate_gpu.*H100"):
        load_suite(write_suite(tmp_path, "estimate_gpu: V100"))


def test_a_named_dataset_is_still_checked(tmp_path):
    with pytest.raises(ConfigError, match="reads mnist10k, not cifar10"):
        load_suite(write_suite(tmp_path, "", dataset="cifar10"))


def test_the_table_names_the_gpu_and_its_cuda_build():
    from dpsynth.bench.table import _describe_machine

    gpu = {"cpu": "x", "cores": 16, "torch": "2.11.0+cu130", "gpu": "NVIDIA H100 80GB HBM3", "cuda": "13.0"}
    assert _describe_machine(gpu).endswith("GPU NVIDIA H100 80GB HBM3, CUDA 13.0")
    assert _describe_machine({**gpu, "gpu": None, "cuda": None}).endswith("no GPU")
