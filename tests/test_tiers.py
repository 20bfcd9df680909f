"""The long tier (tests/conftest.py): every file and test it names exists, so none drops out of it unseen."""

import ast

from conftest import LONGEST_FIRST, TESTS_DIR, TRAIN_TIER


def _test_functions(path):
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_name_in_the_long_tier_is_a_test_of_its_file():
    for relative, names in TRAIN_TIER.items():
        path = TESTS_DIR / relative
        assert path.is_file(), relative
        missing = set(names or ()) - _test_functions(path)
        assert not missing, f"{relative}: {sorted(missing)}"
    assert all((TESTS_DIR / relative).is_file() for relative in LONGEST_FIRST)
