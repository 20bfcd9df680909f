"""Every built-in method's tests inherit :class:`dpsynth.testing.MethodContractTests` (docs/methods/authoring.md)."""

from __future__ import annotations

import re
from pathlib import Path

from dpsynth.methods import METHODS

HERE = Path(__file__).resolve().parent


def test_every_built_in_method_has_a_contract_test_class():
    declared = set()
    for path in HERE.glob("test_*.py"):
        text = path.read_text()
        for body in re.findall(r"class \w+\(MethodContractTests\):\n((?:    .*\n|\n)+)", text):
            declared.update(re.findall(r'^    method = "([^"]+)"', body, flags=re.M))
    built_in = {name for name, cls in METHODS.items() if cls.__module__.startswith("dpsynth.")}
    assert built_in <= declared, f"add a MethodContractTests subclass for: {', '.join(sorted(built_in - declared))}"
