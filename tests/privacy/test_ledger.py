"""PrivacyLedger: hard stop at the budget, resume without reset or double count, privacy.json."""

import json
import warnings

import pytest

from dpsynth.errors import BudgetExceededError, PrivacyError
from dpsynth.privacy import (
    Gaussian,
    Laplace,
    PrivacyLedger,
    PureEpsilon,
    SubsampledGaussian,
    calibrate_noise,
    compute_epsilon,
)
from dpsynth.privacy.accountants import composition_epsilon

DELTA = 1e-5
SIGMA, RATE = 2.0, 0.05


def _training_ledger(target=1.0, accountant="prv"):
    ledger = PrivacyLedger(target, DELTA, accountant=accountant)
    ledger.charge(Gaussian("histogram", 10.0))
    ledger.register(SubsampledGaussian("dpsgd", SIGMA, RATE, 0))
    return ledger


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_spend_refuses_exactly_the_step_that_exceeds_the_budget(accountant):
    ledger = _training_ledger(accountant=accountant)
    limit = ledger.max_steps("dpsgd")
    assert limit > 10
    ledger.spend("dpsgd", limit - 1)
    ledger.spend("dpsgd")
    assert ledger.epsilon() <= 1.0
    with pytest.raises(BudgetExceededError, match="budget exhausted") as refused:
        ledger.spend("dpsgd")
    assert "\n" not in str(refused.value)
    # The refused step was not recorded, and one more step would indeed pass the target.
    assert ledger.mechanisms()[1].steps == limit
    beyond = [Gaussian("histogram", 10.0), SubsampledGaussian("dpsgd", SIGMA, RATE, limit + 1)]
    assert compute_epsilon(beyond, DELTA, accountant) > 1.0


def test_max_steps_is_cached_until_another_mechanism_changes():
    ledger = _training_ledger(target=2.0)
    before = ledger.max_steps("dpsgd")
    misses = composition_epsilon.cache_info().misses
    for _ in range(before - 1):
        ledger.spend("dpsgd")
    assert composition_epsilon.cache_info().misses == misses  # spending computed no epsilon
    assert ledger.max_steps("dpsgd") == before  # own steps do not change the limit
    other = _training_ledger(target=2.0)
    other.spend("dpsgd", 3)
    other.charge(Laplace("validation", 2.0))
    assert other.max_steps("dpsgd") < before  # another mechanism changed: recomputed


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_a_planned_count_that_fits_spares_the_search_and_never_moves_the_hard_stop(accountant, monkeypatch):
    limit = _training_ledger(target=2.0, accountant=accountant).max_steps("dpsgd")
    searched = []
    search = PrivacyLedger._search_max_steps
    monkeypatch.setattr(PrivacyLedger, "_search_max_steps", lambda *a: searched.append(1) or search(*a))
    within = PrivacyLedger(2.0, DELTA, accountant=accountant)
    within.charge(Gaussian("histogram", 10.0))
    within.register(SubsampledGaussian("dpsgd", SIGMA, RATE, 0), planned=limit - 5)
    within.spend("dpsgd", limit - 5)
    assert not searched  # the plan fits: one epsilon at the planned count, no search for the limit
    within.spend("dpsgd", 5)  # past the plan: the exact limit, searched once
    with pytest.raises(BudgetExceededError, match="budget exhausted"):
        within.spend("dpsgd")
    assert searched == [1] and within.mechanisms()[1].steps == limit
    # a plan past the budget is no shortcut: the step over the limit is refused as without one
    over = PrivacyLedger(2.0, DELTA, accountant=accountant)
    over.charge(Gaussian("histogram", 10.0))
    over.register(SubsampledGaussian("dpsgd", SIGMA, RATE, 0), planned=limit + 10)
    over.spend("dpsgd", limit)
    with pytest.raises(BudgetExceededError):
        over.spend("dpsgd")
    # a mechanism charged after registering is checked again with the planned count
    later = PrivacyLedger(2.0, DELTA, accountant=accountant)
    later.charge(Gaussian("histogram", 10.0))
    later.register(SubsampledGaussian("dpsgd", SIGMA, RATE, 0), planned=limit)
    later.spend("dpsgd", 3)
    later.charge(Laplace("validation", 1.0))
    with pytest.raises(BudgetExceededError):
        later.spend("dpsgd", limit - 3)
    assert later.epsilon() <= 2.0


def test_charge_refuses_past_the_budget_and_records_nothing():
    ledger = PrivacyLedger(1.0, DELTA)
    ledger.charge(PureEpsilon("labels", 0.6))
    with pytest.raises(BudgetExceededError, match="charging 'more'"):
        ledger.charge(PureEpsilon("more", 0.6))
    with pytest.raises(BudgetExceededError):
        ledger.charge(PureEpsilon("labels", 0.6))  # a repeat of the same mechanism: 1.2 > 1
    assert [(m.name, m.count) for m in ledger.mechanisms()] == [("labels", 1)]
    assert ledger.epsilon() == pytest.approx(compute_epsilon([PureEpsilon("labels", 0.6)], DELTA))


def test_repeat_charges_add_up_and_conflicting_parameters_are_refused():
    ledger = PrivacyLedger(5.0, DELTA)
    ledger.charge(Gaussian("validation", 20.0))
    ledger.charge(Gaussian("validation", 20.0))
    assert ledger.mechanisms()[0].count == 2
    with pytest.raises(PrivacyError, match="other parameters"):
        ledger.charge(Gaussian("validation", 10.0))


def test_resume_neither_resets_nor_double_counts():
    first = _training_ledger(target=2.0)
    first.spend("dpsgd", 7)
    saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    spent_before = first.epsilon()

    resumed = PrivacyLedger(2.0, DELTA)
    resumed.register(SubsampledGaussian("dpsgd", SIGMA, RATE, 0))  # the method registers as usual
    resumed.load_state_dict(saved)
    resumed.register(SubsampledGaussian("dpsgd", SIGMA, RATE, 0))  # ...or after loading: a no-op
    assert resumed.epsilon() == pytest.approx(spent_before)
    assert resumed.max_steps("dpsgd") == first.max_steps("dpsgd")
    resumed.spend("dpsgd", 3)
    steps = {m.name: m.repeats for m in resumed.mechanisms()}
    assert steps == {"histogram": 1, "dpsgd": 10}
    assert resumed.epsilon() == pytest.approx(
        compute_epsilon([Gaussian("histogram", 10.0), SubsampledGaussian("dpsgd", SIGMA, RATE, 10)], DELTA)
    )


def test_notes_reach_privacy_json_once_and_survive_a_checkpoint():
    ledger = _training_ledger(target=2.0)
    assert "notes" not in ledger.to_json()
    ledger.note("the sound version was implemented")
    ledger.note("the sound version was implemented")
    assert ledger.to_json()["notes"] == ["the sound version was implemented"]
    resumed = PrivacyLedger(2.0, DELTA)
    resumed.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert resumed.to_json()["notes"] == ["the sound version was implemented"]


def test_resume_refuses_a_changed_budget_or_a_used_ledger():
    saved = _training_ledger(target=2.0).state_dict()
    with pytest.raises(PrivacyError, match="target_epsilon"):
        PrivacyLedger(3.0, DELTA).load_state_dict(saved)
    used = PrivacyLedger(2.0, DELTA)
    used.charge(Gaussian("histogram", 10.0))
    with pytest.raises(PrivacyError, match="before charging"):
        used.load_state_dict(saved)


def test_privacy_json_schema_and_atomic_write(tmp_path):
    ledger = _training_ledger(target=2.0)
    ledger.spend("dpsgd", 5)
    path = ledger.write(tmp_path / "privacy.json")
    record = json.loads(path.read_text())
    assert record["guarantee"] == "dp" and record["accountant"] == "prv"
    assert record["target_epsilon"] == 2.0 and record["delta"] == DELTA
    assert record["epsilon"] == pytest.approx(ledger.epsilon()) and record["epsilon"] <= 2.0
    for mechanism in record["mechanisms"]:
        assert {"name", "kind", "noise_multiplier", "sample_rate", "steps"} <= set(mechanism)
    assert record["mechanisms"][1] == {
        "name": "dpsgd",
        "kind": "subsampled_gaussian",
        "noise_multiplier": SIGMA,
        "sample_rate": RATE,
        "steps": 5,
    }
    assert "-DP" in record["statement"]
    assert [p.name for p in tmp_path.iterdir()] == ["privacy.json"]  # no temporary file left


def test_guarantee_none_claims_nothing(tmp_path):
    ledger = PrivacyLedger(None, DELTA, guarantee="none")
    ledger.register(PureEpsilon("randomized_response", 1.0, count=0))
    ledger.spend("randomized_response", 100)  # no budget applies, nothing refused
    assert ledger.epsilon() is None
    with pytest.raises(PrivacyError, match="no budget"):
        ledger.max_steps("randomized_response")
    record = json.loads(ledger.write(tmp_path / "privacy.json").read_text())
    assert record["guarantee"] == "none" and record["epsilon"] is None
    assert "No differential privacy guarantee" in record["note"]
    assert "-DP" not in record["statement"]
    assert record["mechanisms"][0]["steps"] == 100


def test_check_delta_warns_for_delta_not_below_one_over_n():
    ledger = PrivacyLedger(1.0, 1e-3)
    with pytest.warns(UserWarning, match="not below 1/n"):
        message = ledger.check_delta(5000)
    assert message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ledger.check_delta(500) is None


def test_ledger_calibrate_uses_what_is_left():
    ledger = PrivacyLedger(2.0, DELTA)
    ledger.charge(Gaussian("histogram", 5.0))
    sigma = ledger.calibrate(RATE, 50)
    assert sigma == calibrate_noise(2.0, DELTA, RATE, 50, prior=[Gaussian("histogram", 5.0)])
    ledger.register(SubsampledGaussian("dpsgd", sigma, RATE, 0))
    assert ledger.max_steps("dpsgd") >= 50


@pytest.mark.parametrize(
    "bad",
    [
        lambda: PrivacyLedger(0.0, DELTA),
        lambda: PrivacyLedger(1.0, 1.0),
        lambda: PrivacyLedger(1.0, DELTA, accountant="gdp"),
        lambda: PrivacyLedger(1.0, DELTA, guarantee="maybe"),
        lambda: PrivacyLedger(1.0, DELTA).spend("never_registered"),
        lambda: PrivacyLedger(1.0, DELTA).register(SubsampledGaussian("dpsgd", 1.0, 0.1, 5)),
        lambda: PrivacyLedger(1.0, DELTA).charge("not a mechanism"),
    ],
)
def test_bad_ledger_use(bad):
    with pytest.raises(PrivacyError):
        bad()


def test_privacy_json_states_the_dataset_size_assumption():
    from dpsynth.privacy import PrivacyLedger

    for ledger in (PrivacyLedger(1.0, 1e-5, accountant="rdp"), PrivacyLedger(None, 1e-5, guarantee="none")):
        size, data_format = ledger.to_json()["assumptions"]
        assert "dataset size N is public" in size and "per-class counts" in size
        assert "declared format is public" in data_format and "no training record is not refused" in data_format
