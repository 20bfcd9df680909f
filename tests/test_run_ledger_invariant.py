"""The ledger invariant over sequences of commands on a tiny DPDM run.

After every command (run, resume, evaluate with each selection, generate, audit, report) the ε in
privacy.json never decreases and always equals the composition of the stored ledger state; without
that state, every command that would continue the ledger refuses and privacy.json is left untouched.
"""

import json
import shutil

import pytest
from conftest import assert_one_line_error, interrupt_after_steps

from dpsynth.api import Synthesizer
from dpsynth.errors import PrivacyError

TINY_DPDM = """
method: dpdm
name: tiny
seed: 0
device: cpu
data: {private: mnist10k, public: glyphs, max_train: 200, max_public: 100}
privacy: {epsilon: 10.0, delta: 1.0e-5}
dpdm:
  model: 0.8m
  unet: {base_channels: 8, channel_mult: [1, 2], num_res_blocks: 1, attention_levels: [], num_head_channels: 8}
  batch_size: 20
  physical_batch_size: 20
  steps: 4
  lr: 0.001
  public_clip_batch: 8
  checkpoint_every: 2
  sampler: ddim
  sample_steps: 3
generate: {num: 20, batch_size: 20}
"""
TRAIN = {"epochs": 1, "batch_size": 20, "lr": 3e-3}
EVALUATE = {"models": ["logreg"], "seeds": 1, "protocol": TRAIN}


def stored_state_epsilon(run_dir):
    """ε composed from ledger.json, independently of the code under test's bookkeeping."""
    from dpsynth.privacy import PrivacyLedger

    state = json.loads((run_dir / "ledger.json").read_text())
    ledger = PrivacyLedger(
        state["target_epsilon"], state["delta"], accountant=state["accountant"], guarantee=state["guarantee"]
    )
    ledger.load_state_dict(state)
    return ledger.epsilon(), [m.to_dict() for m in ledger.mechanisms()]


class Invariant:
    """Checks privacy.json against ledger.json after each command and that ε never went down."""

    def __init__(self, run_dir):
        self.run_dir, self.history = run_dir, []

    def check(self, command):
        privacy = json.loads((self.run_dir / "privacy.json").read_text())
        epsilon, mechanisms = stored_state_epsilon(self.run_dir)
        assert privacy["epsilon"] == pytest.approx(epsilon, rel=1e-12), command
        assert privacy["mechanisms"] == mechanisms, command
        if self.history:
            assert privacy["epsilon"] >= self.history[-1][1] - 1e-12, (command, self.history)
        self.history.append((command, privacy["epsilon"]))


@pytest.fixture(scope="module")
def sequence(tmp_path_factory):
    """Run the whole command sequence once; return the run directory and the invariant's history."""
    from dpsynth.eval.evaluate import evaluate
    from dpsynth.report.html import write_report
    from dpsynth.runner import run_config

    root = tmp_path_factory.mktemp("ledger")
    config_path = root / "tiny.yaml"
    config_path.write_text(TINY_DPDM)
    run_dir = root / "run"
    invariant = Invariant(run_dir)
    with pytest.raises(KeyboardInterrupt):
        interrupt_after_steps(config_path, run_dir, stop_after=3)
    invariant.check("run (interrupted)")
    run_config(config_path, out=run_dir, resume=True, echo=False)
    invariant.check("run --resume")
    for selection in ("synthetic", "last"):
        evaluate(run_dir, ["accuracy"], selection=selection, **EVALUATE)
        invariant.check(f"evaluate --selection {selection}")
    evaluate(run_dir, ["accuracy"], selection="private-val", val_noise_multiplier=50.0, **EVALUATE)
    invariant.check("evaluate --selection private-val")
    Synthesizer.load(run_dir).generate(10, run_dir / "more.npz")
    invariant.check("generate")
    evaluate(run_dir, ["audit"])
    invariant.check("audit")
    write_report(run_dir)
    write_report(run_dir, release=True)
    invariant.check("report")
    return run_dir, invariant.history


def test_epsilon_never_decreases_and_equals_the_stored_composition(sequence):
    _, history = sequence
    epsilons = dict(history)
    assert epsilons["run (interrupted)"] > 0  # two steps were checkpointed before the interrupt
    assert epsilons["run --resume"] > epsilons["run (interrupted)"]
    assert epsilons["evaluate --selection private-val"] > epsilons["evaluate --selection last"]
    assert epsilons["report"] == epsilons["evaluate --selection private-val"]


def test_every_continuing_command_refuses_without_the_ledger_state(sequence, tmp_path, cli):
    from dpsynth.eval.evaluate import evaluate
    from dpsynth.runner import run_config

    run_dir = tmp_path / "copy"
    shutil.copytree(sequence[0], run_dir)
    (run_dir / "ledger.json").unlink()
    before = (run_dir / "privacy.json").read_text()
    with pytest.raises(PrivacyError, match="ledger.json"):
        evaluate(run_dir, ["accuracy"], selection="private-val", val_noise_multiplier=50.0, **EVALUATE)
    with pytest.raises(PrivacyError, match="ledger.json"):
        Synthesizer.load(run_dir).generate(5)
    with pytest.raises(PrivacyError, match="ledger.json"):
        evaluate(run_dir, ["audit"])
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(TINY_DPDM)
    with pytest.raises(PrivacyError, match="ledger.json"):
        run_config(config_path, out=run_dir, resume=True, echo=False)
    assert_one_line_error(cli("generate", str(run_dir), "--num", "5"), "ledger.json")
    assert (run_dir / "privacy.json").read_text() == before


def test_commands_refuse_a_state_that_disagrees_with_privacy_json(sequence, tmp_path):
    from dpsynth.checkpoint import atomic_write_json

    run_dir = tmp_path / "copy"
    shutil.copytree(sequence[0], run_dir)
    state = json.loads((run_dir / "ledger.json").read_text())
    state["mechanisms"] = state["mechanisms"][:1]  # a state that lost the noisy validation
    atomic_write_json(run_dir / "ledger.json", state)
    before = (run_dir / "privacy.json").read_text()
    with pytest.raises(PrivacyError, match="does not match"):
        Synthesizer.load(run_dir).generate(5)
    assert (run_dir / "privacy.json").read_text() == before


def test_a_run_without_guarantee_is_evaluated_generated_and_reported_without_epsilon(sequence, tmp_path):
    """privacy.json says "guarantee": "none" (an explicit unsound opt-in): commands work and never state an ε."""
    from dpsynth.eval.evaluate import evaluate
    from dpsynth.privacy import PrivacyLedger
    from dpsynth.privacy.mechanisms import mechanism_from_dict
    from dpsynth.report.html import write_report
    from dpsynth.rundir import LedgerStore

    run_dir = tmp_path / "copy"
    shutil.copytree(sequence[0], run_dir)
    unsound = PrivacyLedger(None, 1e-5, guarantee="none")
    for record in json.loads((run_dir / "ledger.json").read_text())["mechanisms"]:
        unsound.charge(mechanism_from_dict(record))
    LedgerStore(run_dir, unsound).persist()
    assert Synthesizer.load(run_dir).generate(5, run_dir / "few.npz").is_file()
    evaluate(run_dir, ["accuracy"], selection="private-val", val_noise_multiplier=50.0, **EVALUATE)
    privacy = json.loads((run_dir / "privacy.json").read_text())
    assert privacy["guarantee"] == "none" and privacy["epsilon"] is None
    assert [m["steps"] for m in privacy["mechanisms"] if m["name"] == "noisy-validation"] == [2]
    page = write_report(run_dir).read_text()
    assert 'class="warning"' in page and "NO PRIVACY GUARANTEE" in page
    assert 'class="coverage covered"' not in page and "released without a privacy guarantee" in page
