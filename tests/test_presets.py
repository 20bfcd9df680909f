"""Packaged presets: listed by `dpsynth config list`, run by name, shipped in the wheel and usable from it."""

import json
import os
import shutil
import subprocess
import sys

from conftest import REPO

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


def test_config_list_and_dry_run_by_preset_name_write_nothing(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # in this process: nothing may appear in the working directory
    listed = cli("config", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert "dpdm/mnist10k_eps10" in json.loads(listed.stdout)["presets"]
    result = cli("run", "dpdm/mnist10k_eps10", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert [m["name"] for m in plan["mechanisms"]] == ["dp-adam"] and plan["mechanisms"][0]["calibrated"]
    assert plan["epsilon"] <= plan["target_epsilon"] == 10.0
    assert not list(tmp_path.iterdir()), "a dry run creates no run directory"


# Runs each of a JSON object's commands through dpsynth.cli.main in one process; prints where dpsynth was
# imported from and each command's exit status, stdout and stderr, as one JSON line.
IN_ONE_PROCESS = """
import contextlib, io, json, sys
import dpsynth
from dpsynth.cli import main
results = {"file": dpsynth.__file__}
for name, args in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
    results[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


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

    # Three commands in one process of the wheel's package (a process each costs seconds of imports);
    # `python -m dpsynth` itself runs the preset below.
    commands = {
        "list": ["config", "list"],
        "dry": ["run", "dp-imgsyn/smoke", "--dry-run"],
        "suite": ["bench", "mnist10k-cpu", "--dry-run", "--json"],  # the suites ship in the wheel too
    }
    called = subprocess.run(
        [sys.executable, "-c", IN_ONE_PROCESS, json.dumps(commands)],
        cwd=work,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert called.returncode == 0, called.stderr[-2000:]
    results = json.loads(called.stdout.splitlines()[-1])
    assert results["file"].startswith(str(site)), results["file"]
    listed, dry, suite = (subprocess.CompletedProcess(args, *results[name]) for name, args in commands.items())
    assert listed.returncode == 0 and "dp-imgsyn/smoke" in listed.stdout.split(), listed.stderr
    assert dry.returncode == 0 and "dp-imgsyn-teacher" in dry.stdout, dry.stderr
    in_checkout = bench("mnist10k-cpu", BenchOptions(out=work / "out"), dry=True)["runs"]
    assert suite.returncode == 0 and len(json.loads(suite.stdout)["runs"]) == len(in_checkout) > 0, suite.stderr
    run = dpsynth("run", "dp-imgsyn/smoke", "--set", "generate.num=20", "--out", "run")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((work / "run" / "privacy.json").read_text())["epsilon"] <= 10.0
