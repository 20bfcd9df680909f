"""A mean-embedding method added in a test needs only its module, a preset and its test class: importing
``toy_embedding`` (``tests/methods/toy_embedding/``, on ``sys.path`` as pytest puts this file's folder there)
registers it, and it then appears in ``dpsynth methods``, ``dpsynth config list``, the generated method and
config tables, and passes the contract tests a built-in method passes."""

from __future__ import annotations

import json

import toy_embedding

from dpsynth.cli import main
from dpsynth.config import find_config, list_presets, reference_markdown
from dpsynth.methods import all_methods, get_method, shipped_methods
from dpsynth.reference import methods_table
from dpsynth.testing import MethodContractTests


class TestToyEmbedding(MethodContractTests):
    """The toy passes every contract test: its plan, its config errors, and a smoke run killed at its first
    checkpoint and resumed, spending exactly the plan."""

    method = "toy-embedding"


def test_registering_the_module_lists_the_method_and_its_preset(capsys):
    assert get_method("toy-embedding") is toy_embedding.ToyEmbedding
    assert main(["methods", "--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)["methods"]}
    assert listed["toy-embedding"]["summary"] == toy_embedding.ToyEmbedding.summary
    assert "toy-embedding/smoke" in list_presets()
    assert find_config("toy-embedding/smoke") == toy_embedding.ToyEmbedding.presets_dir / "smoke.yaml"
    assert main(["config", "list"]) == 0
    assert "toy-embedding/smoke" in capsys.readouterr().out


def test_the_generated_tables_carry_the_registered_method():
    """The README method table and the config reference are generated from the registry: given it, the toy has
    its row (paper and summary) and its config section (its own keys and the skeleton's), with no hand-written
    entry; the committed files list only the methods dpsynth ships."""
    registry = all_methods()
    table = methods_table(registry)
    (row,) = [line for line in table.splitlines() if line.startswith("| `toy-embedding` |")]
    assert toy_embedding.ToyEmbedding.paper in row and toy_embedding.ToyEmbedding.summary in row
    reference = reference_markdown(registry)
    assert "## `toy-embedding`" in reference
    for key in ("num_features", "length_scale", "denominator", "checkpoint_every"):
        assert f"| `toy-embedding.{key}` |" in reference
    assert "toy-embedding" not in shipped_methods()
    assert "toy-embedding" not in methods_table() and "toy-embedding" not in reference_markdown()
    assert "dp-merf" in methods_table() and "## `dp-merf`" in reference_markdown()
