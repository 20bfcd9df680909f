"""Heterogeneous composition: monotone in every mechanism; mechanisms validate their parameters."""

import pytest

from dpsynth.errors import PrivacyError
from dpsynth.privacy import Gaussian, Laplace, PureEpsilon, SubsampledGaussian, compute_epsilon
from dpsynth.privacy.mechanisms import mechanism_from_dict

DELTA = 1e-5
CHAIN = [
    SubsampledGaussian("dpsgd", 1.5, 0.02, 300),
    Gaussian("histogram", 15.0),
    Laplace("validation", 30.0, 2),
    PureEpsilon("labels", 0.05),
    Gaussian("statistics", 40.0, count=3),
]


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_adding_a_mechanism_never_lowers_epsilon(accountant):
    previous = 0.0
    for size in range(1, len(CHAIN) + 1):
        current = compute_epsilon(CHAIN[:size], DELTA, accountant)
        assert current >= previous, (size, current, previous)
        previous = current


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_more_steps_never_lower_epsilon(accountant):
    values = [
        compute_epsilon([Gaussian("histogram", 15.0), SubsampledGaussian("dpsgd", 1.5, 0.02, steps)], DELTA, accountant)
        for steps in (1, 10, 100, 200, 300)
    ]
    assert values == sorted(values)


def test_composition_ignores_names_order_and_unused_mechanisms():
    reordered = list(reversed(CHAIN)) + [SubsampledGaussian("registered_only", 1.0, 0.1, 0)]
    assert compute_epsilon(reordered, DELTA) == compute_epsilon(CHAIN, DELTA)
    assert compute_epsilon([], DELTA) == 0.0


def test_full_batch_subsampled_gaussian_is_the_gaussian_mechanism():
    assert compute_epsilon([SubsampledGaussian("a", 3.0, 1.0, 4)], DELTA) == compute_epsilon(
        [Gaussian("b", 3.0, count=4)], DELTA
    )


def test_mechanisms_round_trip_through_dicts():
    for mechanism in CHAIN:
        assert mechanism_from_dict(mechanism.to_dict()) == mechanism


@pytest.mark.parametrize(
    "make",
    [
        lambda: SubsampledGaussian("a", 0.0, 0.1, 1),
        lambda: SubsampledGaussian("a", -1.0, 0.1, 1),
        lambda: SubsampledGaussian("a", float("nan"), 0.1, 1),
        lambda: SubsampledGaussian("a", 1.0, 0.0, 1),
        lambda: SubsampledGaussian("a", 1.0, 1.01, 1),
        lambda: SubsampledGaussian("a", 1.0, 0.1, -1),
        lambda: SubsampledGaussian("a", 1.0, 0.1, 1.5),
        lambda: SubsampledGaussian("", 1.0, 0.1, 1),
        lambda: Gaussian("a", 0.0),
        lambda: Laplace("a", -2.0),
        lambda: PureEpsilon("a", 0.0),
        lambda: PureEpsilon("a", float("inf")),
        lambda: mechanism_from_dict({"kind": "exponential", "name": "a"}),
    ],
)
def test_bad_mechanism_parameters(make):
    with pytest.raises(PrivacyError) as raised:
        make()
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_bad_delta(delta):
    with pytest.raises(PrivacyError, match="delta"):
        compute_epsilon(CHAIN, delta)


def test_unknown_accountant():
    with pytest.raises(PrivacyError, match="unknown accountant"):
        compute_epsilon(CHAIN, DELTA, accountant="moments")
