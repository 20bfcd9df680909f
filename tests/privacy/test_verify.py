"""privacy.json's machine-readable record (a dp_accounting DpEvent and the neighbouring relation) and
``dpsynth privacy verify RUN``, which recomputes ε from that record alone with dp_accounting."""

import argparse
import json

import pytest
from conftest import assert_one_line_error
from dp_accounting import dp_event as dpe

from dpsynth.cli import privacy as privacy_cli
from dpsynth.errors import PrivacyError
from dpsynth.privacy import Gaussian, Laplace, PrivacyLedger, PureEpsilon, SubsampledGaussian
from dpsynth.privacy.dp_event_json import event_from_json, event_to_json

BASE = (
    "method: dpsgd-classifier\nname: base\ndata: {private: mnist10k, max_train: 400}\n"
    "privacy: {epsilon: 2.0, delta: 1.0e-5}\n"
    "dpsgd-classifier: {model: logreg, steps: 6, batch_size: 80, checkpoint_every: 2, lr: 1.0}\n"
)


def _ledger(accountant="prv", target=3.0):
    ledger = PrivacyLedger(target, 1e-5, accountant=accountant)
    ledger.charge(Gaussian("histogram", 10.0))
    ledger.charge(Laplace("counts", 20.0, count=2))
    ledger.register(SubsampledGaussian("dpsgd", 1.5, 0.02))
    ledger.spend("dpsgd", 300)
    return ledger


def _verify(run_dir, capsys, *extra):
    parser = argparse.ArgumentParser()
    privacy_cli.register(parser.add_subparsers())
    args = parser.parse_args(["privacy", "verify", str(run_dir), *extra])
    code = args.func(args)
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A tiny DP-SGD run through the real runner: privacy.json as every run writes it."""
    from dpsynth.runner import run_config

    root = tmp_path_factory.mktemp("verify")
    config = root / "base.yaml"
    config.write_text(BASE)
    return run_config(config, out=root / "run", echo=False)


def test_each_mechanism_states_its_dp_event():
    gaussian = dpe.GaussianDpEvent(2.0)
    assert SubsampledGaussian("s", 2.0, 0.05, 7).dp_event() == dpe.SelfComposedDpEvent(
        dpe.PoissonSampledDpEvent(0.05, gaussian), 7
    )
    assert SubsampledGaussian("s", 2.0, 1.0, 7).dp_event() == dpe.SelfComposedDpEvent(gaussian, 7)
    assert SubsampledGaussian("s", 2.0, 0.05, 0).dp_event() == dpe.NoOpDpEvent()
    assert Gaussian("g", 2.0, 3).dp_event() == dpe.SelfComposedDpEvent(gaussian, 3)
    assert Laplace("l", 4.0, 2).dp_event() == dpe.SelfComposedDpEvent(dpe.LaplaceDpEvent(4.0), 2)
    [response] = [PureEpsilon("rr", 1.0, 5).dp_event()]
    assert response.count == 5 and response.event.num_buckets == 2
    # binary randomized response with noise p keeps the bit w.p. 1 - p/2: ratio (1 - p/2) / (p/2) = e^eps
    p = response.event.noise_parameter
    assert (1 - p / 2) / (p / 2) == pytest.approx(2.718281828459045)


def test_privacy_json_carries_the_composed_event_and_the_neighbouring_relation():
    ledger = _ledger()
    record = ledger.to_json()
    event = event_from_json(record["dp_event"])
    assert event == ledger.dp_event()
    assert event == dpe.ComposedDpEvent([m.dp_event() for m in ledger.mechanisms()])
    neighbouring = record["neighbouring"]
    assert neighbouring["relation"] == "add/remove one record"
    assert neighbouring["dp_accounting_relation"] == "ADD_OR_REMOVE_ONE"
    assert neighbouring["dataset_size_public"] is True
    assert "q = B/N" in neighbouring["dataset_size_note"]


def test_serialised_event_round_trips_through_json():
    events = [
        _ledger().dp_event(),
        dpe.ComposedDpEvent([dpe.NonPrivateDpEvent(), PureEpsilon("rr", 0.5, 3).dp_event()]),
        dpe.ComposedDpEvent([]),
        dpe.UnsupportedDpEvent(),
    ]
    for event in events:
        text = json.dumps(event_to_json(event), allow_nan=False)
        assert event_from_json(json.loads(text)) == event
    assert event_to_json(dpe.GaussianDpEvent(2.0)) == {"type": "GaussianDpEvent", "noise_multiplier": 2.0}


@pytest.mark.parametrize(
    "record",
    [
        {"type": "GaussianDpEvent"},
        {"type": "GaussianDpEvent", "noise_multiplier": 1.0, "extra": 1},
        {"type": "GaussianDpEvent", "noise_multiplier": True},
        {"type": "GaussianDpEvent", "noise_multiplier": "1"},
        {"type": "SelfComposedDpEvent", "event": {"type": "NoOpDpEvent"}, "count": 2.0},
        {"type": "ComposedDpEvent", "events": {"type": "NoOpDpEvent"}},
        {"type": "os.system"},
        ["GaussianDpEvent", 1.0],
    ],
)
def test_malformed_records_are_refused(record):
    with pytest.raises(PrivacyError):
        event_from_json(record)


def test_a_run_without_guarantee_records_a_non_private_event(tmp_path, capsys):
    ledger = PrivacyLedger(None, 1e-5, guarantee="none")
    ledger.charge(PureEpsilon("rr", 1.0, count=4))
    event = event_from_json(ledger.to_json()["dp_event"])
    assert event.events[0] == dpe.NonPrivateDpEvent()
    ledger.write(tmp_path / "privacy.json")
    with pytest.raises(PrivacyError, match="guarantee 'none'"):
        _verify(tmp_path, capsys)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_verify_accepts_what_the_ledger_writes(accountant, tmp_path, capsys):
    _ledger(accountant).write(tmp_path / "privacy.json")
    code, out = _verify(tmp_path, capsys, "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"]
    assert result["stated_epsilon"] >= result["required_epsilon"]
    assert result["pld_epsilon"] <= result["rdp_epsilon"]  # PLD is the tighter of the two here
    # the stated value is dpsynth's own accountant: PRV close to PLD, RDP the same analysis as dp_accounting's
    reference = result["pld_epsilon"] if accountant == "prv" else result["rdp_epsilon"]
    assert result["stated_epsilon"] == pytest.approx(reference, rel=0.05 if accountant == "prv" else 1e-3)


def test_a_coarser_pld_grid_only_raises_the_bound(tmp_path):
    """The contract tests verify on a 1e-3 grid (dpsynth.testing.CONTRACT_PLD_INTERVAL): pessimistic rounding to a
    coarser grid must give a PLD epsilon no lower than the CLI's 1e-4 grid, so it accepts nothing the CLI refuses."""
    from dpsynth.privacy.verify import PLD_VALUE_DISCRETIZATION_INTERVAL, read_record, verify_record
    from dpsynth.testing import CONTRACT_PLD_INTERVAL

    ledger = PrivacyLedger(10.0, 1e-5)
    ledger.register(SubsampledGaussian("dpsgd", 0.6, 0.05))
    ledger.spend("dpsgd", 12)
    ledger.write(tmp_path / "privacy.json")
    record = read_record(tmp_path / "privacy.json")
    fine, coarse = verify_record(record), verify_record(record, pld_interval=CONTRACT_PLD_INTERVAL)
    assert CONTRACT_PLD_INTERVAL > PLD_VALUE_DISCRETIZATION_INTERVAL
    assert coarse["pld_value_discretization_interval"] == CONTRACT_PLD_INTERVAL
    assert fine["pld_epsilon"] <= coarse["pld_epsilon"] <= fine["pld_epsilon"] + 12 * CONTRACT_PLD_INTERVAL
    assert coarse["required_epsilon"] >= fine["required_epsilon"] and coarse["ok"]


def test_verify_refuses_a_pure_epsilon_mechanism_under_add_remove(tmp_path, capsys):
    ledger = PrivacyLedger(5.0, 1e-5)
    ledger.charge(PureEpsilon("rr", 1.0))
    ledger.write(tmp_path / "privacy.json")
    with pytest.raises(PrivacyError, match="RandomizedResponseDpEvent"):
        _verify(tmp_path, capsys)


def test_verify_a_real_run(real_run, cli):
    result = cli("privacy", "verify", str(real_run))
    assert result.returncode == 0, result.stderr
    assert "PLD epsilon" in result.stdout and "RDP epsilon" in result.stdout and "OK" in result.stdout
    result = cli("privacy", "verify", str(real_run), "--json")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    stated = json.loads((real_run / "privacy.json").read_text())["epsilon"]
    assert verdict["ok"] and verdict["stated_epsilon"] == stated
    assert verdict["dataset_size_public"] is True


def _tampered(real_run, tmp_path, change):
    run_dir = tmp_path / "tampered"
    run_dir.mkdir()
    record = json.loads((real_run / "privacy.json").read_text())
    change(record)
    (run_dir / "privacy.json").write_text(json.dumps(record))
    return run_dir


def test_verify_fails_when_the_stated_epsilon_is_lowered(real_run, tmp_path, cli):
    def lower(record):
        record["epsilon"] *= 0.9

    result = cli("privacy", "verify", str(_tampered(real_run, tmp_path, lower)))
    assert_one_line_error(result, "below what dp_accounting certifies")
    assert "PLD epsilon" in result.stdout  # the numbers are still shown


def test_verify_fails_when_the_record_is_missing_or_changed(real_run, tmp_path, cli):
    def drop(record):
        del record["dp_event"]

    assert_one_line_error(cli("privacy", "verify", str(_tampered(real_run, tmp_path, drop))), "no dp_event record")
    assert_one_line_error(cli("privacy", "verify", str(tmp_path)), "no privacy.json")

    def more_steps(record):  # the stated ε no longer covers the recorded event
        record["dp_event"]["events"][0]["count"] *= 20

    (tmp_path / "tampered").rename(tmp_path / "first")
    assert_one_line_error(
        cli("privacy", "verify", str(_tampered(real_run, tmp_path, more_steps))), "below what dp_accounting certifies"
    )
