"""Packaged presets: listed by `dpsynth config list`, run by name (that they ship in the wheel and run from it:
tests/test_pip_install.py)."""

import json

from conftest import REPO

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
