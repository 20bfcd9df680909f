"""The way of ``Synthesizer.fit``'s data: arrays, a path and a registered name become one
:class:`~dpsynth.data.source.DatasetSource`, read by the one loader ``dpsynth run`` uses, with the same split.

The API itself resolves nothing: no config change, no sizing, no split (checked on its source text), and a
spy on the loader sees the very object ``fit`` was given.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import dpsynth.api
import dpsynth.data.source
from dpsynth.api import Synthesizer
from dpsynth.cli import main
from dpsynth.data.source import Arrays, DatasetSource
from dpsynth.errors import DataError
from dpsynth.rundir import IN_MEMORY

#: what resolving data means: splitting, sizing, preparing or loading it, or rewriting the config for it
RESOLVING = {
    "split_arrays",
    "array_train_size",
    "as_dataset",
    "as_array",
    "prepare",
    "apply_scaling",
    "with_changes",
    "config_for_source",
    "load_private",
    "load_public",
    "load_for_run",
    "load_source",
    "load_run_data",
    "private_options",
    "check_overlap",
    "IN_MEMORY",
}


class Stop(Exception):
    """Raised by the spy once the loader has run: nothing is trained."""


@pytest.fixture
def loader_calls(monkeypatch):
    """Every call of the one loader, ``(data section, source, splits)``; the run stops right after it."""
    calls = []
    real = dpsynth.data.source.load_source

    def spy(data, source=None):
        loaded = real(data, source)
        calls.append((data, source, loaded[0]))
        raise Stop

    monkeypatch.setattr(dpsynth.data.source, "load_source", spy)
    return calls


def faces(count=240, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, 12, 12), dtype=np.uint8), rng.integers(0, 2, count)


def test_the_api_module_names_no_function_that_resolves_data():
    tree = ast.parse(Path(dpsynth.api.__file__).read_text())
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    named |= {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert not named & RESOLVING, sorted(named & RESOLVING)
    assert not hasattr(dpsynth.api, "_sized_for") and not hasattr(Synthesizer, "_array_data")


def test_arrays_a_path_and_a_name_reach_the_one_loader_as_the_source_fit_got(loader_calls, tmp_path):
    images, labels = faces()
    path = tmp_path / "faces.npz"
    np.savez(path, images=images, labels=labels)

    for args, classes in (((images, labels), 2), ((path,), 2), (("digits8x8",), None)):
        with pytest.raises(Stop):
            Synthesizer("dpsgd-classifier").fit(*args, num_classes=classes, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # stopped right after loading: nothing was written

    (arrays_data, arrays_source, from_arrays), (path_data, path_source, from_path), (name_data, name_source, _) = (
        loader_calls
    )
    assert all(isinstance(source, DatasetSource) for source in (arrays_source, path_source, name_source))
    assert isinstance(arrays_source.private, Arrays) and arrays_source.private.images is images
    assert arrays_source.private.labels is labels and arrays_source.num_classes == 2
    assert path_source.private == str(path) and name_source.private == "digits8x8"
    assert path_source.num_classes == 2 and name_source.num_classes is None
    # the config the run stores names each source the same way
    assert (arrays_data.private, path_data.private, name_data.private) == (IN_MEMORY, str(path), "digits8x8")
    assert arrays_data.num_classes == path_data.num_classes == 2
    # the same records in memory and in a file: the same content-keyed split, record for record
    for part in ("train", "val", "test"):
        a, b = getattr(from_arrays, part), getattr(from_path, part)
        assert len(a) and np.array_equal(a.record_keys, b.record_keys), part


def test_dpsynth_run_reaches_the_same_loader_with_the_same_split(loader_calls, tmp_path):
    images, labels = faces()
    path = tmp_path / "faces.npz"
    np.savez(path, images=images, labels=labels)
    with pytest.raises(Stop):
        Synthesizer("dpsgd-classifier").fit(images, labels, num_classes=2, out=tmp_path / "api")
    args = ["run", "dpsgd-classifier/smoke", f"--set=data.private={path}", "--set=data.num_classes=2"]
    with pytest.raises(Stop):
        main(args + ["--set=data.max_train=null", "--out", str(tmp_path / "cli")])
    (_, _, by_api), (cli_data, cli_source, by_cli) = loader_calls
    # the CLI names its data in the config: a source with nothing of its own, read from data.private
    assert cli_source is None or cli_source.private is None
    assert cli_data.private == str(path)
    assert np.array_equal(by_api.train.record_keys, by_cli.train.record_keys)


def test_plan_sizes_an_auto_preset_for_the_arrays_as_the_run_does(monkeypatch, tmp_path):
    """The config a run on arrays stores is stated once (``config_for_source`` in ``execute``); ``plan`` states
    it the same way, so the plan of the arrays is the plan of the run that ``fit`` starts."""
    import dpsynth.runner

    runs = []
    real = dpsynth.runner.load_run_data

    def spy(config, source=None):
        runs.append((config, real(config, source)[0]))
        raise Stop

    monkeypatch.setattr(dpsynth.runner, "load_run_data", spy)
    images, labels = faces(400)
    synth = Synthesizer.from_config("dpsgd-classifier/auto", {"auto.max_epochs": 2})
    planned = synth.plan(images, labels)
    with pytest.raises(Stop):
        synth.fit(images, labels, num_classes=2, out=tmp_path / "run")
    ((config, splits),) = runs
    assert config.data.private == IN_MEMORY and config.data.num_classes == 2
    assert config.auto.num_examples == len(splits.train) and config.auto.image_shape == [1, 12, 12]
    assert config.auto.num_examples != synth.settings.auto.num_examples  # sized again: not the preset's N
    run_plan = dpsynth.runner.plan_run(config, len(splits.train))
    assert [m.to_dict() for m in planned.mechanisms] == [m.to_dict() for m in run_plan.mechanisms]


def test_public_arrays_and_a_public_name_go_the_same_way_with_the_same_overlap_check(loader_calls, tmp_path):
    images, labels = faces()
    public_images, public_labels = faces(50, seed=1)
    with pytest.raises(Stop):
        Synthesizer("dpsgd-classifier").fit(
            images, labels, num_classes=2, public=(public_images, public_labels), out=tmp_path / "run"
        )
    with pytest.raises(Stop):
        Synthesizer("dpsgd-classifier").fit(images, labels, num_classes=2, public="digits8x8", out=tmp_path / "run")
    (arrays_data, arrays_source, _), (name_data, name_source, _) = loader_calls
    assert isinstance(arrays_source.public, Arrays) and arrays_source.public.images is public_images
    assert arrays_data.public == IN_MEMORY and name_source.public == name_data.public == "digits8x8"
    # a private record among the public arrays is refused by the loader's one overlap check, before any write
    leaked = np.concatenate([public_images, images[:1]])
    with pytest.raises(DataError, match="private images also appear in the public set"):
        Synthesizer("dpsgd-classifier").fit(images, labels, num_classes=2, public=leaked, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()
