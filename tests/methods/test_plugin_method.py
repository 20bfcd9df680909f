"""A method outside the package, registered through the ``dpsynth.methods`` entry point, passes the common
contract and runs by name (docs/methods/authoring.md's worked example: ``tests/methods/plugin/``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpsynth.methods import get_method
from dpsynth.testing import MethodContractTests

PLUGIN = Path(__file__).resolve().parent / "plugin"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def installed_plugin():
    """The plugin directory on sys.path: its dist-info declares the entry point, as ``pip install`` would."""
    sys.path.insert(0, str(PLUGIN))
    yield
    sys.path.remove(str(PLUGIN))


class TestPluginContract(MethodContractTests):
    """The worked example passes every contract test a built-in method passes."""

    method = "class-means"


def test_the_plugin_is_found_by_name_and_ships_its_presets():
    cls = get_method("class-means")  # not imported by anyone: found through the entry point
    assert cls.__module__ == "dpsynth_class_means"
    from dpsynth.config import find_config, list_presets

    assert "class-means/smoke" in list_presets()
    assert find_config("class-means/smoke") == PLUGIN / "dpsynth_class_means" / "presets" / "smoke.yaml"


def test_the_plugin_runs_by_name_from_the_command_line(cli, tmp_path):
    listed = cli("methods")  # in this process (the plugin is on sys.path); the run below is a process of its own
    assert listed.returncode == 0 and "class-means" in listed.stdout.split(), listed.stderr
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGIN), str(REPO)]), DPSYNTH_CACHE=str(tmp_path / "c"))
    run = subprocess.run(
        [sys.executable, "-m", "dpsynth", "run", "class-means/smoke", "--out", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "run" / "samples.npz").is_file() and (tmp_path / "run" / "privacy.json").is_file()


def test_a_broken_plugin_is_reported_when_asked_for(tmp_path, monkeypatch):
    package, info = tmp_path / "broken_plugin", tmp_path / "broken_plugin-0.1.dist-info"
    package.mkdir(), info.mkdir()
    (package / "__init__.py").write_text("raise ImportError('missing dependency')\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dpsynth.methods]\nbroken = broken_plugin:Broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from dpsynth.errors import ConfigError

    with pytest.raises(ConfigError, match="method 'broken' is installed but failed to load .*missing dependency"):
        get_method("broken")
