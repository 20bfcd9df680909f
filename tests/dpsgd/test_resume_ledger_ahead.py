"""A DP-SGD run killed after a step was charged but before its checkpoint resumes at the ledger's count
(:meth:`dpsynth.contract.RunContext.resume`): the charged step stays spent, is not taken again, and the run ends
on its plan."""

from __future__ import annotations

import json

import pytest
import torch

from dpsynth.api import Synthesizer
from dpsynth.checkpoint import CheckpointManager
from dpsynth.dpsgd import DPSGDEngine

PRESET = "dpsgd-classifier/smoke"
OVERRIDES = ["dpsgd-classifier.checkpoint_every=2"]
MECHANISM = "dpsgd"


class _Killed(BaseException):
    """A kill of the process (not an error the run could handle)."""


def _steps(run) -> int:
    ledger = json.loads((run / "ledger.json").read_text())
    return next(m["steps"] for m in ledger["mechanisms"] if m["name"] == MECHANISM)


def test_a_dpsgd_run_killed_between_ledger_and_checkpoint_resumes_at_the_ledger(tmp_path, monkeypatch):
    run, taken = tmp_path / "run", []
    real_save, real_step = CheckpointManager.save, DPSGDEngine.step

    def killed_at_step_six(self, state, phase="main"):
        if phase == MECHANISM and state.get("step") == 6:
            self.store.persist()  # the ledger reached disk (6 steps), the checkpoint (4) did not move
            raise _Killed
        return real_save(self, state, phase)

    def counted_step(self, *args, **kwargs):
        taken.append(1)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", killed_at_step_six)
    with pytest.raises(_Killed):
        Synthesizer.from_config(PRESET, OVERRIDES).fit(out=run)
    assert _steps(run) == 6
    assert torch.load(run / "checkpoints" / f"{MECHANISM}.pt", weights_only=False)["step"] == 4
    monkeypatch.setattr(CheckpointManager, "save", real_save)
    monkeypatch.setattr(DPSGDEngine, "step", counted_step)
    Synthesizer.from_config(PRESET, OVERRIDES).fit(out=run, resume=True)
    assert len(taken) == 2, "steps 6 and 7 run; 4 and 5 stay spent and are not taken again"
    assert _steps(run) == 8
    assert "stay spent" in (run / "log.txt").read_text()
