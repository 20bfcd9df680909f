"""The method contract, checked for every registered method: a new method gets these tests by registering.

Each method ships a ``<method>/smoke`` preset; the tests shrink it further (few samples, no
evaluation) so a method costs seconds here: declared interface, a config error before any data is
read, the dry-run plan without data, and a smoke run that is killed, resumed, spends exactly the
plan and generates.
"""

from __future__ import annotations

import json

import pydantic
import pytest
import torch

from dpsynth.api import Synthesizer
from dpsynth.checkpoint import CheckpointManager
from dpsynth.config import find_config
from dpsynth.contract import Phase
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods import METHODS, Method

METHOD_NAMES = sorted(name for name, cls in METHODS.items() if cls.__module__.startswith("dpsynth."))
SHRINK = {"generate.num": 20, "generate.batch_size": 20, "evaluate.metrics": [], "evaluate.audit": False}
PRIVACY_KEYS = {"epsilon", "delta", "accountant", "guarantee", "target_epsilon", "adjacency", "mechanisms", "statement"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    # Pre-training methods cache into a test directory, never into the user's ~/.cache.
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def no_data_reads(monkeypatch):
    """Make every private or public data load fail the test."""
    import dpsynth.data
    import dpsynth.data.loading
    import dpsynth.runner

    def refuse(*args, **kwargs):
        raise AssertionError("data was read")

    for module, name in [
        (dpsynth.runner, "load_run_data"),
        (dpsynth.data, "load_private"),
        (dpsynth.data, "load_public"),
        (dpsynth.data.loading, "load_dataset"),
    ]:
        monkeypatch.setattr(module, name, refuse)


def smoke(name: str):
    return find_config(f"{name}/smoke")


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_method_declares_the_contract(name):
    cls = METHODS[name]
    assert issubclass(cls, Method)
    assert issubclass(cls.config_schema, pydantic.BaseModel)
    assert cls.config_schema.model_config.get("extra") == "forbid"
    assert cls.defaults == cls.config_schema().model_dump()
    assert all(field.description for field in cls.config_schema.model_fields.values()), "every key is described"
    assert cls.releases in ("samples", "model")
    config = Synthesizer.from_config(smoke(name)).settings
    phases = cls.phases(config)
    assert phases and all(isinstance(p, Phase) for p in phases)
    assert any(p.private for p in phases)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_config_errors_come_before_any_data_read(name, tmp_path, no_data_reads):
    with pytest.raises(ConfigError, match=f"'{name}.no_such_key'"):
        Synthesizer.from_config(smoke(name), {f"{name}.no_such_key": 1})
    with pytest.raises(PrivacyError, match="privacy.epsilon"):
        Synthesizer.from_config(smoke(name), {"privacy.epsilon": -1})
    with pytest.raises(ConfigError, match="'seed'"):
        Synthesizer.from_config(smoke(name), {"seed": "soon"})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_dry_run_plans_without_reading_data(name, no_data_reads):
    synth = Synthesizer.from_config(smoke(name))
    plan = synth.plan()
    target = synth.config["privacy"]["epsilon"]
    assert plan.mechanisms and plan.target_epsilon == target
    assert target - 0.05 <= plan.epsilon() <= target
    assert all(m.repeats >= 1 for m in plan.mechanisms)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_smoke_run_killed_resumed_spends_exactly_the_plan(name, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    plan = Synthesizer.from_config(smoke(name), SHRINK).plan()

    save, saves = CheckpointManager.save, []

    def save_then_die(self, state, phase="main"):
        save(self, state, phase=phase)
        saves.append(phase)
        raise KeyboardInterrupt  # the first checkpoint is written, then the process "dies"

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointManager, "save", save_then_die)
        with pytest.raises(KeyboardInterrupt):
            Synthesizer.from_config(smoke(name), SHRINK).fit(out=run_dir)
    assert saves
    # The killed run's privacy.json states what its stored ledger spent so far: no more than the plan.
    interrupted = json.loads((run_dir / "privacy.json").read_text())
    stored = json.loads((run_dir / "ledger.json").read_text())
    assert interrupted["mechanisms"] == stored["mechanisms"]
    assert (interrupted["epsilon"] or 0.0) <= plan.epsilon() + 1e-9
    # ... and nothing was released before the kill
    assert not (run_dir / "samples.npz").exists() and not (run_dir / "diagnostics" / "metrics.json").exists()
    assert sum(m["steps"] for m in interrupted["mechanisms"]) < sum(m.repeats for m in plan.mechanisms)

    synth = Synthesizer.from_config(smoke(name), SHRINK).fit(out=run_dir, resume=True)
    privacy = synth.privacy
    # The dry-run plan used the registry's expected N; the run plans on the N it loads (content-keyed draws).
    from dpsynth.context import load_private_splits

    plan = Synthesizer.from_config(smoke(name), SHRINK).plan(len(load_private_splits(synth.settings).train))
    assert PRIVACY_KEYS <= set(privacy)
    spent = {
        m["name"]: {k: m[k] for k in ("name", "kind", "noise_multiplier", "sample_rate", "steps")}
        for m in privacy["mechanisms"]
    }
    assert spent == {m.name: m.to_dict() for m in plan.mechanisms}, "mechanism by mechanism"
    assert privacy["epsilon"] == pytest.approx(plan.epsilon(), abs=1e-9)
    assert privacy["epsilon"] <= privacy["target_epsilon"]
    # ... and an independent accountant (dp_accounting, from privacy.json's dp_event record) agrees
    from dpsynth.rundir import verify_run

    assert verify_run(run_dir)["ok"]

    if METHODS[name].releases == "samples":
        images, labels = synth.sample(7)
        assert images.dtype.name == "uint8" and images.shape[0] == 7 and labels.shape == (7,)
        reopened_images, _ = Synthesizer.load(run_dir).sample(3)
        assert reopened_images.shape[1:] == images.shape[1:]
    else:
        assert (run_dir / "diagnostics" / "metrics.json").is_file()  # a released model's test metrics: private


def test_import_layers_hold_and_methods_do_not_import_each_other():
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from conftest import REPO

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


class _FirstStepCaptured(Exception):
    """Stops a run at its first DP-SGD step, once the step's engine and batch builder are in hand."""


def _flat(summed: dict) -> torch.Tensor:
    return torch.cat([value.detach().double().flatten() for _, value in sorted(summed.items())])


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_one_inserted_record_moves_the_clipped_sum_by_at_most_the_clip_norm(name, tmp_path, monkeypatch):
    """Every method's private training step: the clipped-gradient sum of a batch B and of B with one more
    record inserted at the front or in the middle differ by at most C (docs/privacy.md, "Per-record
    randomness"). A record's draws taken by batch position (or from the run seed) fail this."""
    import dpsynth.dpsgd.training as training
    from dpsynth.dpsgd.engine import DPSGDEngine
    from dpsynth.dpsgd.per_example import clipped_grad_sum

    captured: dict = {}
    real_micro_batches = training._micro_batches

    def remember_builder(make_batch, indices, randomness, step, size, device):
        captured.update(make_batch=make_batch, randomness=randomness, step=step, size=size, device=device)
        return real_micro_batches(make_batch, indices, randomness, step, size, device)

    def capture_engine(self, batch, max_grad_norm=None):
        captured["engine"] = self
        raise _FirstStepCaptured

    monkeypatch.setattr(training, "_micro_batches", remember_builder)
    monkeypatch.setattr(DPSGDEngine, "step", capture_engine)
    synth = Synthesizer.from_config(smoke(name), SHRINK)
    try:
        synth.fit(out=tmp_path / "run")
    except _FirstStepCaptured:
        pass
    if "engine" not in captured:  # no DP-SGD step: then no mechanism of the plan may be a DP-SGD one
        assert all(m.kind != "subsampled_gaussian" for m in synth.plan().mechanisms), "DP-SGD never stepped"
        return

    engine = captured["engine"]
    clip = engine.max_grad_norm

    def clipped_sum(order: list[int]) -> torch.Tensor:
        batches = real_micro_batches(
            captured["make_batch"],
            torch.tensor(order),
            captured["randomness"],
            captured["step"],
            captured["size"],
            captured["device"],
        )
        if isinstance(batches, dict):
            batches = [batches]
        summed, count = clipped_grad_sum(engine._per_example, batches, clip, engine.per_layer_clipping)
        assert count == len(order)
        return _flat(summed)

    batch = list(range(4, 12))
    base = clipped_sum(batch)
    assert base.norm() > 0
    for grown in ([0, *batch], [*batch[:4], 1, *batch[4:]]):
        moved = float((clipped_sum(grown) - base).norm())
        assert moved <= clip * (1 + 1e-4) + 1e-6, f"{name}: one record moved the clipped sum by {moved / clip:.2f} C"
