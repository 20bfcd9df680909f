"""The shard-sampled Gaussian (GS-WGAN's generator step): one Gaussian on a block computed from one of K
content-keyed shards, amplified once per step by sampling 1 of K without replacement (replace-one of a
shard, which covers add/remove of a record); its ledger entry, its dp_event and ``dpsynth privacy verify``."""

import json

import pytest
from dp_accounting import dp_event as dpe

from dpsynth.errors import PrivacyError
from dpsynth.privacy import Gaussian, PrivacyLedger, ShardSampledGaussian, SubsampledGaussian, compute_epsilon
from dpsynth.privacy.dp_event_json import event_from_json, event_to_json
from dpsynth.privacy.mechanisms import mechanism_from_dict
from dpsynth.privacy.verify import verify_record

DELTA = 1e-5


def test_record_round_trip_and_sample_rate_is_one_over_k():
    step = ShardSampledGaussian("gs", 0.8, 40, 300)
    assert step.to_dict() == {
        "name": "gs",
        "kind": "shard_sampled_gaussian",
        "noise_multiplier": 0.8,
        "sample_rate": 1 / 40,
        "steps": 300,
    }
    assert mechanism_from_dict(step.to_dict()) == step
    with pytest.raises(PrivacyError, match="1/K"):
        mechanism_from_dict({**step.to_dict(), "sample_rate": 0.3})
    with pytest.raises(PrivacyError, match="number of shards"):
        ShardSampledGaussian("gs", 0.8, 0)


def test_dp_event_is_one_sampled_without_replacement_gaussian_per_step():
    step = ShardSampledGaussian("gs", 0.8, 40, 300)
    event = step.dp_event()
    assert event == dpe.SelfComposedDpEvent(dpe.SampledWithoutReplacementDpEvent(40, 1, dpe.GaussianDpEvent(0.8)), 300)
    assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event
    # One shard: every step reads the whole set, the plain Gaussian mechanism (and the PRV accountant takes it).
    single = ShardSampledGaussian("gs", 3.0, 1, 5)
    assert single.dp_event() == dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(3.0), 5)
    assert compute_epsilon([single], DELTA) == pytest.approx(compute_epsilon([Gaussian("g", 3.0, 5)], DELTA))


def test_bound_is_never_below_the_instance_where_the_other_shards_answer_like_the_neighbour():
    """If every other shard's block equals the neighbour's block, the step's output pair is exactly Poisson
    sampling's add/remove pair ((1-q) N(0) + q N(Delta), N(0)) with q = 1/K: a valid instance, so a sound bound
    for the shard step can never be below the Poisson-subsampled Gaussian's (whose RDP bound is tight)."""
    for sigma, shards, steps in [(0.8, 50, 1000), (2.0, 10, 200), (5.0, 100, 2000)]:
        shard = compute_epsilon([ShardSampledGaussian("gs", sigma, shards, steps)], DELTA, "rdp")
        poisson = compute_epsilon([SubsampledGaussian("p", sigma, 1 / shards, steps)], DELTA, "rdp")
        assert shard >= poisson
        # ... and amplification is real: far below the un-sampled Gaussian composed as often.
        assert shard < compute_epsilon([Gaussian("g", sigma, steps)], DELTA, "rdp")


def test_per_step_amplification_not_per_row():
    """B rows share one drawn shard: the step is one Gaussian whose sensitivity covers all rows (noise
    multiplier sigma on the block), not B mechanisms each amplified by 1/K; the latter (GS-WGAN's original
    B*T composition, with noise sqrt(B) larger per mechanism relative to a row) states a smaller epsilon."""
    rows, steps, shards, per_row = 16, 200, 20, 4.0
    joint = compute_epsilon([ShardSampledGaussian("gs", per_row / rows**0.5, shards, steps)], DELTA, "rdp")
    per_row_composition = compute_epsilon([ShardSampledGaussian("gs", per_row, shards, rows * steps)], DELTA, "rdp")
    assert joint > per_row_composition


def test_prv_refuses_and_rdp_composes_with_add_remove_mechanisms():
    step = ShardSampledGaussian("gs", 1.0, 20, 50)
    with pytest.raises(PrivacyError, match="rdp accountant"):
        compute_epsilon([step], DELTA, "prv")
    dpsgd = SubsampledGaussian("d", 1.0, 0.05, 100)
    both = compute_epsilon([step, dpsgd], DELTA, "rdp")
    assert both > max(compute_epsilon([step], DELTA, "rdp"), compute_epsilon([dpsgd], DELTA, "rdp"))


def _ledger() -> PrivacyLedger:
    ledger = PrivacyLedger(12.0, DELTA, accountant="rdp")
    ledger.charge(Gaussian("histogram", 20.0))
    ledger.register(ShardSampledGaussian("gs", 1.2, 25))
    ledger.spend("gs", 400)
    return ledger


def test_ledger_states_the_shard_relation_and_verify_recomputes_it():
    record = json.loads(json.dumps(_ledger().to_json()))
    assert "shard_sampling" in record["neighbouring"]
    result = verify_record(record)
    assert result["ok"] and result["pld_epsilon"] is None
    assert result["rdp_epsilon"] == pytest.approx(record["epsilon"], rel=1e-6)
    # A lowered stated epsilon, or more steps than it covers, fails.
    assert not verify_record({**record, "epsilon": 0.9 * record["epsilon"]})["ok"]
    more = json.loads(json.dumps(record).replace('"count": 400', '"count": 800'))
    assert not verify_record(more)["ok"]


def test_shard_statement_names_add_remove_only():
    """The record-level guarantee is add/remove: a replaced record can be keyed to another shard (two shards
    change), so the statement must never speak of replacing (in any case, as a relation or a dp_accounting
    name); it speaks of a uniform draw of one of K shards and a change of one shard's contents."""
    statement = _ledger().to_json()["neighbouring"]["shard_sampling"]
    assert "replac" not in statement.lower()
    assert "add/remove one record" in statement and "change of one shard's contents" in statement
    assert "uniform draw of one of K shards" in statement and "ADD_OR_REMOVE_ONE" in statement


def test_shard_statement_and_the_accountants_relation_agree():
    """The record states add/remove (wording and dp_accounting name), and both the ledger and verify account it
    as the statement says: the other events under ADD_OR_REMOVE_ONE, the shard steps over a change of one of
    the K shards (REPLACE_ONE of a shard), RDP curves added order by order. Any other record-level relation
    is refused."""
    from dp_accounting import privacy_accountant
    from dp_accounting.rdp import RdpAccountant, rdp_privacy_accountant

    from dpsynth.privacy.verify import RELATIONS

    ledger = _ledger()
    record = json.loads(json.dumps(ledger.to_json()))
    neighbouring = record["neighbouring"]
    assert neighbouring["relation"] == "add/remove one record" and neighbouring["dp_accounting_relation"] == (
        "ADD_OR_REMOVE_ONE"
    )
    assert RELATIONS[neighbouring["relation"]] == privacy_accountant.NeighboringRelation.ADD_OR_REMOVE_ONE
    records = RdpAccountant(neighboring_relation=privacy_accountant.NeighboringRelation.ADD_OR_REMOVE_ONE)
    records.compose(Gaussian("histogram", 20.0).dp_event())
    shards = RdpAccountant(neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE)
    shards.compose(ShardSampledGaussian("gs", 1.2, 25, 400).dp_event())
    expected, _ = rdp_privacy_accountant.compute_epsilon(records._orders, records._rdp + shards._rdp, DELTA)
    assert verify_record(record)["rdp_epsilon"] == pytest.approx(expected, rel=1e-9)
    assert record["epsilon"] == pytest.approx(expected, rel=1e-6)
    for other in ("replace one record", "add/remove or replace one record"):
        with pytest.raises(PrivacyError, match="neighbouring relation"):
            verify_record({**record, "neighbouring": {**neighbouring, "relation": other}})


def test_verify_refuses_a_shard_step_the_record_does_not_explain():
    record = json.loads(json.dumps(_ledger().to_json()))
    del record["neighbouring"]["shard_sampling"]
    with pytest.raises(PrivacyError, match="shard_sampling"):
        verify_record(record)
    nested = {**record["dp_event"]}
    nested["events"] = [{"type": "PoissonSampledDpEvent", "sampling_probability": 0.5, "event": record["dp_event"]}]
    with pytest.raises(PrivacyError, match="nested"):
        verify_record({**record, "neighbouring": _ledger().to_json()["neighbouring"], "dp_event": nested})


def test_no_shard_note_without_a_shard_step():
    ledger = PrivacyLedger(8.0, DELTA, accountant="rdp")
    ledger.charge(Gaussian("histogram", 20.0))
    assert "shard_sampling" not in ledger.to_json()["neighbouring"]


def test_verify_command_prints_no_pld_value_for_shard_steps(tmp_path, capsys):
    import argparse

    from dpsynth.cli import privacy as privacy_cli

    _ledger().write(tmp_path / "privacy.json")
    parser = argparse.ArgumentParser()
    privacy_cli.register(parser.add_subparsers())
    args = parser.parse_args(["privacy", "verify", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "PLD epsilon: none" in out and "RDP epsilon" in out and "OK" in out
