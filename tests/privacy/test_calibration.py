"""calibrate_noise lands the composed total in [target - 0.01, target], with and without priors."""

import pytest

from dpsynth.errors import PrivacyError
from dpsynth.privacy import (
    CALIBRATION_TOLERANCE,
    Gaussian,
    Laplace,
    PureEpsilon,
    SubsampledGaussian,
    calibrate_noise,
    compute_epsilon,
)

PRIOR = (Gaussian("histogram", 20.0), PureEpsilon("labels", 0.1), Laplace("validation", 50.0, count=3))


@pytest.mark.parametrize(
    "target, delta, q, steps, prior, accountant",
    [
        (1.0, 1e-5, 0.01, 500, (), "prv"),
        (4.0, 1e-6, 0.02, 300, (), "prv"),
        (1.0, 1e-5, 1.0, 1, (), "prv"),
        (3.0, 1e-5, 0.02, 200, PRIOR, "prv"),
        (2.0, 1e-5, 0.01, 500, (), "rdp"),
        (5.0, 1e-6, 0.05, 100, PRIOR, "rdp"),
    ],
)
def test_total_lands_in_band(target, delta, q, steps, prior, accountant):
    sigma = calibrate_noise(target, delta, q, steps, prior=prior, accountant=accountant)
    total = compute_epsilon(prior + (SubsampledGaussian("dpsgd", sigma, q, steps),), delta, accountant)
    assert target - CALIBRATION_TOLERANCE <= total <= target


def test_prior_leaves_less_budget_hence_more_noise():
    alone = calibrate_noise(3.0, 1e-5, 0.02, 200)
    with_prior = calibrate_noise(3.0, 1e-5, 0.02, 200, prior=PRIOR)
    assert with_prior > alone


def test_prior_alone_over_target_is_refused():
    with pytest.raises(PrivacyError, match="prior mechanisms alone"):
        calibrate_noise(0.5, 1e-5, 0.01, 100, prior=(PureEpsilon("labels", 0.6),))


def test_unreachable_target_is_refused():
    # 1e13 full-batch Gaussian releases exceed epsilon=1 even at the largest noise we search.
    with pytest.raises(PrivacyError, match="unreachable"):
        calibrate_noise(1.0, 1e-5, 1.0, 10**13, accountant="rdp")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_epsilon=0.0), "target epsilon"),
        (dict(target_epsilon=-1.0), "target epsilon"),
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(sample_rate=0.0), "sample rate"),
        (dict(sample_rate=1.5), "sample rate"),
        (dict(steps=0), "steps"),
        (dict(accountant="moments"), "accountant"),
    ],
)
def test_bad_inputs(kwargs, message):
    arguments = dict(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=10)
    arguments.update(kwargs)
    with pytest.raises(PrivacyError, match=message) as raised:
        calibrate_noise(**arguments)
    assert "\n" not in str(raised.value)
