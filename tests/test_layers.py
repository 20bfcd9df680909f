"""The import-linter layers contract names every top-level package and module of dpsynth."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]


def _layers_contract() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    [contract] = [c for c in config["contracts"] if c["type"] == "layers"]
    return contract["layers"]


def _named(layers: list[str]) -> list[str]:
    """The modules the layers name, siblings (``a | b``, ``a : b``) split."""
    return [name.strip() for layer in layers for name in re.split(r"[|:]", layer)]


def _top_level() -> set[str]:
    package = REPO / "dpsynth"
    modules = {f"dpsynth.{path.stem}" for path in package.glob("*.py") if path.name != "__init__.py"}
    packages = {f"dpsynth.{path.name}" for path in package.iterdir() if (path / "__init__.py").is_file()}
    return modules | packages


def test_every_top_level_package_and_module_is_a_layer():
    named = _named(_layers_contract())
    missing = sorted(_top_level() - set(named))
    assert not missing, f"add to the layers contract in pyproject.toml: {', '.join(missing)}"
    unknown = sorted(set(named) - _top_level())
    assert not unknown, f"the layers contract names what dpsynth does not have: {', '.join(unknown)}"
    assert len(named) == len(set(named)), "a module is named in two layers"


def test_import_layers_hold_and_methods_do_not_import_each_other():
    import os
    import shutil
    import subprocess
    import sys

    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    result = subprocess.run(
        [lint, "--config", str(REPO / "pyproject.toml")],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 kept, 0 broken" in result.stdout
