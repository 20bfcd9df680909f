"""``MethodContractTests``: the tests every synthesis method passes, for a method's own test module to inherit.

    from dpsynth.testing import MethodContractTests

    class TestMyMethod(MethodContractTests):
        method = "my-method"               # the registered name
        config = "my-method/smoke"         # a small config (path or preset name); this is the default

pytest then runs, for that method (docs/methods/authoring.md):

* the declared interface: a typed, described ``config_schema`` with ``extra="forbid"``, phases with a
  private one, what it releases;
* a bad key, a bad privacy target and a bad type fail when the config loads, before any data is read;
* the dry-run plan needs no data and stays within the target (close to it when a σ is calibrated);
* a smoke run killed at its first checkpoint, then resumed, spends exactly the plan mechanism by
  mechanism, as an independent accountant confirms, and then samples (or reports its released model);
* one inserted record moves the clipped-gradient sum of a DP-SGD step by at most the clip norm C, at the
  front or in the middle of the batch (docs/privacy.md, "Per-record randomness").

Requires pytest (``pip install dpsynth[test]``). Every run writes into pytest's temporary directories, and
pre-training caches go to a temporary ``DPSYNTH_CACHE`` (one per test session), never to the user's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pydantic
import pytest
import torch

from dpsynth.api import Synthesizer
from dpsynth.checkpoint import CheckpointManager
from dpsynth.config import find_config
from dpsynth.contract import Phase
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods import Method, get_method
from dpsynth.rundir import LEDGER_FILE, METRICS_FILE, PRIVACY_FILE, SAMPLES_FILE, diagnostics_dir

__all__ = ["SHRINK", "MethodContractTests"]

#: overrides that make a smoke config cheaper still: few samples, no evaluation
SHRINK: dict[str, Any] = {
    "generate.num": 20,
    "generate.batch_size": 20,
    "evaluate.metrics": [],
    "evaluate.audit": False,
}
#: The PLD grid the contract verifies a smoke run's record on (`dpsynth privacy verify` uses 1e-4).
CONTRACT_PLD_INTERVAL = 1e-3
PRIVACY_KEYS = {"epsilon", "delta", "accountant", "guarantee", "target_epsilon", "adjacency", "mechanisms", "statement"}


def contract_cache(tmp_path_factory: Any) -> Path:
    """The pre-training cache (``DPSYNTH_CACHE``) of the contract tests' runs: a test directory, never the user's
    ~/.cache, one for the whole test session of this process. Public models are keyed by every setting that shapes
    them, so a test whose runs pre-train with a method's smoke settings can point there and train them once."""
    cache = tmp_path_factory.getbasetemp() / "contract-cache"
    cache.mkdir(exist_ok=True)
    return cache


class _FirstStepCaptured(Exception):
    """Stops a run at its first DP-SGD step, once the step's engine and batch builder are in hand."""


class MethodContractTests:
    """The common contract tests; subclass as ``Test<Method>`` and set :attr:`method` (and :attr:`config`)."""

    #: the registered method name
    method: ClassVar[str]
    #: a small config of the method: a path or a preset name; None: ``<method>/smoke``
    config: ClassVar[str | Path | None] = None
    #: overrides applied to the smoke runs
    shrink: ClassVar[dict[str, Any]] = SHRINK

    # ------------------------------------------------------------------ helpers
    def config_path(self) -> Path:
        return find_config(self.config or f"{self.method}/smoke")

    def synthesizer(self, overrides: dict[str, Any] | None = None) -> Synthesizer:
        return Synthesizer.from_config(self.config_path(), overrides)

    @pytest.fixture(autouse=True)
    def _private_cache(self, tmp_path_factory: Any, monkeypatch: Any) -> None:
        # The contract's kill (at the first run checkpoint) and first DP-SGD step come after pre-training either
        # way, so its runs of a method share the public models of one cache.
        monkeypatch.setenv("DPSYNTH_CACHE", str(contract_cache(tmp_path_factory)))

    @pytest.fixture
    def no_data_reads(self, monkeypatch: Any) -> None:
        """Make every private or public data load fail the test."""
        import dpsynth.data
        import dpsynth.data.loading
        import dpsynth.runner

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("data was read")

        for module, name in [
            (dpsynth.runner, "load_run_data"),
            (dpsynth.data, "load_private"),
            (dpsynth.data, "load_public"),
            (dpsynth.data.loading, "load_dataset"),
        ]:
            monkeypatch.setattr(module, name, refuse)

    # ------------------------------------------------------------------ the contract
    def test_declares_the_contract(self) -> None:
        cls = get_method(self.method)
        assert issubclass(cls, Method) and cls.name == self.method
        assert issubclass(cls.config_schema, pydantic.BaseModel)
        assert cls.config_schema.model_config.get("extra") == "forbid"
        assert cls.defaults == cls.config_schema().model_dump()
        undescribed = [name for name, field in cls.config_schema.model_fields.items() if not field.description]
        assert not undescribed, f"every key is described: {undescribed}"
        assert cls.releases in ("samples", "model")
        config = self.synthesizer().settings
        assert isinstance(config.section, cls.config_schema), "the method receives its typed section"
        phases = cls.phases(config)
        assert phases and all(isinstance(p, Phase) for p in phases)
        assert any(p.private for p in phases)

    def test_config_errors_come_before_any_data_read(self, tmp_path: Path, no_data_reads: None) -> None:
        with pytest.raises(ConfigError, match=f"'{self.method}.no_such_key'"):
            self.synthesizer({f"{self.method}.no_such_key": 1})
        with pytest.raises(PrivacyError, match="privacy.epsilon"):
            self.synthesizer({"privacy.epsilon": -1})
        with pytest.raises(ConfigError, match="'seed'"):
            self.synthesizer({"seed": "soon"})
        assert not list(tmp_path.iterdir())

    def test_dry_run_plans_without_reading_data(self, no_data_reads: None) -> None:
        synth = self.synthesizer()
        plan = synth.plan()
        target = synth.settings.privacy.epsilon
        assert plan.mechanisms and plan.target_epsilon == target
        assert plan.epsilon() <= target
        if plan.calibrated:  # a solved σ lands close to the target; fixed ones may spend less
            assert target - 0.05 <= plan.epsilon()
        assert all(m.repeats >= 1 for m in plan.mechanisms)

    def test_smoke_run_killed_resumed_spends_exactly_the_plan(self, tmp_path: Path, monkeypatch: Any) -> None:
        run_dir = tmp_path / "run"
        plan = self.synthesizer(self.shrink).plan()
        save, saves = CheckpointManager.save, []

        def save_then_die(manager: Any, state: Any, phase: str = "main") -> None:
            save(manager, state, phase=phase)
            saves.append(phase)
            raise KeyboardInterrupt  # the first checkpoint is written, then the process "dies"

        with monkeypatch.context() as patch:
            patch.setattr(CheckpointManager, "save", save_then_die)
            with pytest.raises(KeyboardInterrupt):
                self.synthesizer(self.shrink).fit(out=run_dir)
        assert saves, "the method writes a checkpoint (resume granularity)"
        # The killed run's privacy.json states what its stored ledger spent so far: no more than the plan,
        # and nothing was released before the kill.
        interrupted = json.loads((run_dir / PRIVACY_FILE).read_text())
        stored = json.loads((run_dir / LEDGER_FILE).read_text())
        assert interrupted["mechanisms"] == stored["mechanisms"]
        assert (interrupted["epsilon"] or 0.0) <= plan.epsilon() + 1e-9
        assert not (run_dir / SAMPLES_FILE).exists() and not (diagnostics_dir(run_dir) / METRICS_FILE).exists()

        synth = self.synthesizer(self.shrink).fit(out=run_dir, resume=True)
        self._check_spent_exactly_the_plan(synth, run_dir)
        if get_method(self.method).releases == "samples":
            images, labels = synth.sample(7)
            assert images.dtype.name == "uint8" and images.shape[0] == 7 and labels.shape == (7,)
            reopened_images, _ = Synthesizer.load(run_dir).sample(3)
            assert reopened_images.shape[1:] == images.shape[1:]
        else:
            assert (diagnostics_dir(run_dir) / METRICS_FILE).is_file()  # a released model's test metrics: private
        self.check_finished_run(run_dir)

    def check_finished_run(self, run_dir: Path) -> None:
        """Override to assert more on the finished smoke run (killed once, resumed to its end): what a method's
        own end-to-end test would otherwise train a run of its own for. Nothing by default."""

    def _check_spent_exactly_the_plan(self, synth: Synthesizer, run_dir: Path) -> None:
        from dpsynth.context import load_private_splits
        from dpsynth.rundir import verify_run

        privacy = synth.privacy
        # The dry-run plan used the registry's expected N; the run plans on the N it loads (content-keyed draws).
        plan = self.synthesizer(self.shrink).plan(len(load_private_splits(synth.settings).train))
        assert PRIVACY_KEYS <= set(privacy)
        spent = {
            m["name"]: {k: m[k] for k in ("name", "kind", "noise_multiplier", "sample_rate", "steps")}
            for m in privacy["mechanisms"]
        }
        assert spent == {m.name: m.to_dict() for m in plan.mechanisms}, "mechanism by mechanism"
        assert privacy["epsilon"] == pytest.approx(plan.epsilon(), abs=1e-9)
        assert privacy["epsilon"] <= privacy["target_epsilon"]
        # PLD on a 1e-3 grid: no weaker than `dpsynth privacy verify`'s 1e-4 (losses are rounded up further, so the
        # bound can only rise; a smoke run's few steps add at most ~steps x 1e-3 to it), at about an eighth of the
        # cost (0.55 s against 4.2 s on a smoke record at sigma 0.39)
        verified = verify_run(run_dir, pld_interval=CONTRACT_PLD_INTERVAL)
        assert verified["ok"], "an independent accountant (dp_accounting) agrees with the privacy record"

    def test_one_inserted_record_moves_the_clipped_sum_by_at_most_the_clip_norm(
        self, tmp_path: Path, monkeypatch: Any
    ) -> None:
        """The method's first DP-SGD step: the clipped-gradient sums of a batch and of the batch with one more
        record inserted at the front or in the middle differ by at most C. A record's random draws taken by
        batch position (or from the run seed) fail this."""
        captured = self._first_dpsgd_step(tmp_path, monkeypatch)
        if captured is None:
            return
        engine = captured["engine"]
        clip = engine.max_grad_norm
        batch = list(range(4, 12))
        base = _clipped_sum(captured, batch)
        assert base.norm() > 0
        for grown in ([0, *batch], [*batch[:4], 1, *batch[4:]]):
            moved = float((_clipped_sum(captured, grown) - base).norm())
            assert moved <= clip * (1 + 1e-4) + 1e-6, f"{self.method}: one record moved the sum by {moved / clip:.2f} C"

    def _first_dpsgd_step(self, tmp_path: Path, monkeypatch: Any) -> dict[str, Any] | None:
        """The engine and batch builder of the method's first DP-SGD step (None: the method has no DP-SGD step,
        which its plan must then confirm)."""
        import dpsynth.dpsgd.training as training
        from dpsynth.dpsgd.engine import DPSGDEngine

        captured: dict[str, Any] = {"micro_batches": training._micro_batches}

        def remember_builder(make_batch: Any, indices: Any, randomness: Any, step: int, size: int, device: Any) -> Any:
            captured.update(make_batch=make_batch, randomness=randomness, step=step, size=size, device=device)
            return captured["micro_batches"](make_batch, indices, randomness, step, size, device)

        def capture_engine(engine: Any, batch: Any, max_grad_norm: float | None = None) -> None:
            captured["engine"] = engine
            raise _FirstStepCaptured

        monkeypatch.setattr(training, "_micro_batches", remember_builder)
        monkeypatch.setattr(DPSGDEngine, "step", capture_engine)
        synth = self.synthesizer(self.shrink)
        try:
            synth.fit(out=tmp_path / "run")
        except _FirstStepCaptured:
            pass
        if "engine" not in captured:
            assert all(m.kind != "subsampled_gaussian" for m in synth.plan().mechanisms), "DP-SGD never stepped"
            return None
        return captured


def _clipped_sum(captured: dict[str, Any], order: list[int]) -> torch.Tensor:
    from dpsynth.dpsgd.per_example import clipped_grad_sum

    engine = captured["engine"]
    batches = captured["micro_batches"](
        captured["make_batch"],
        torch.tensor(order),
        captured["randomness"],
        captured["step"],
        captured["size"],
        captured["device"],
    )
    if isinstance(batches, dict):
        batches = [batches]
    summed, count = clipped_grad_sum(engine._per_example, batches, engine.max_grad_norm, engine.per_layer_clipping)
    assert count == len(order)
    return torch.cat([value.detach().double().flatten() for _, value in sorted(summed.items())])
