"""Packaged presets: listed by `dpsynth config list`, run by name, shipped in the wheel and usable from it."""

import json
import os
import shutil
import subprocess
import sys

from conftest import REPO, run_cli

from dpsynth.bench.runs import BenchOptions, bench
from dpsynth.config import PRESETS_DIR, list_presets


def test_every_method_has_a_smoke_preset_and_presets_live_in_the_package():
    from dpsynth.methods import METHODS

    names = list_presets()
    for method in METHODS.values():
        if method.__module__.startswith("dpsynth."):
            assert f"{method.name}/smoke" in names
    assert PRESETS_DIR.parent.name == "dpsynth" and (PRESETS_DIR / "demo.yaml").is_file()
    assert not (REPO / "configs").exists(), "presets moved into the package"


def test_config_list_and_dry_run_by_preset_name_write_nothing(tmp_path):
    listed = run_cli("config", "list", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "dpdm/mnist10k_eps10" in json.loads(listed.stdout)["presets"]
    result = run_cli("run", "dpdm/mnist10k_eps10", "--dry-run", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert [m["name"] for m in plan["mechanisms"]] == ["dp-adam"] and plan["mechanisms"][0]["calibrated"]
    assert plan["epsilon"] <= plan["target_epsilon"] == 10.0
    assert not list(tmp_path.iterdir()), "a dry run creates no run directory"


def _pip(*args: str, cwd=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", *args, "--quiet"]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_installed_wheel_runs_a_preset_outside_the_checkout(tmp_path):
    wheels, site, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "source"
    # Build from a copy: setuptools leaves build/ in the tree it builds, and a stale build/lib in the
    # checkout would put deleted modules into the next wheel.
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"
        ),
    )
    build = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source), cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    wheel = next(wheels.glob("dpsynth-*.whl"))
    install = _pip("install", "--no-deps", "--no-index", "--target", str(site), str(wheel))
    assert install.returncode == 0, install.stderr

    work = tmp_path / "elsewhere"
    work.mkdir()
    # The wheel's package first on the path; the other dependencies come from this environment.
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="2")

    def dpsynth(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dpsynth", *args],
            cwd=work,
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )

    where = subprocess.run(
        [sys.executable, "-c", "import dpsynth; print(dpsynth.__file__)"],
        cwd=work,
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    listed = dpsynth("config", "list")
    assert listed.returncode == 0 and "dp-imgsyn/smoke" in listed.stdout.split(), listed.stderr
    dry = dpsynth("run", "dp-imgsyn/smoke", "--dry-run")
    assert dry.returncode == 0 and "dp-imgsyn-teacher" in dry.stdout, dry.stderr
    suite = dpsynth("bench", "mnist10k-cpu", "--dry-run", "--json")  # the suites ship in the wheel too
    in_checkout = bench("mnist10k-cpu", BenchOptions(out=work / "out"), dry=True)["runs"]
    assert suite.returncode == 0 and len(json.loads(suite.stdout)["runs"]) == len(in_checkout) > 0, suite.stderr
    run = dpsynth("run", "dp-imgsyn/smoke", "--set", "generate.num=20", "--out", "run")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((work / "run" / "privacy.json").read_text())["epsilon"] <= 10.0
