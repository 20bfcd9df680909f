"""The §IV-A learning-rate decay rules of Chu et al. (IEEE Access 2023) and the extra schedules."""

import math

import pytest
import torch

from dpsynth.errors import ConfigError
from dpsynth.lr_schedules import (
    Cosine,
    ExponentialDecay,
    LinearDecay,
    LogarithmicDecay,
    make_lr_schedule,
)


def _recursive(update, epochs: int, lr0: float = 1.0) -> list[float]:
    """Apply ``lr_e = update(lr_{e-1}, e)`` literally, as the paper states the rules."""
    rates = [lr0]
    for epoch in range(1, epochs + 1):
        rates.append(update(rates[-1], epoch))
    return rates


def test_linear_decay_matches_the_recursive_formula():
    schedule = LinearDecay(decay_rate=0.3, steps_per_epoch=1)
    expected = _recursive(lambda last, e: last / (1 + 0.3 * e), 12)
    for epoch, value in enumerate(expected):
        assert schedule(epoch) == pytest.approx(value, rel=1e-9)


def test_exponential_decay_is_initial_times_rate_power_epoch():
    schedule = ExponentialDecay(decay_rate=0.99, steps_per_epoch=1)
    for epoch in range(20):
        assert schedule(epoch) == pytest.approx(0.99**epoch, rel=1e-12)


def test_logarithmic_decay_matches_the_recursive_formula():
    schedule = LogarithmicDecay(steps_per_epoch=1)
    expected = _recursive(lambda last, e: last / (1 + math.log(e)), 10)
    for epoch, value in enumerate(expected):
        assert schedule(epoch) == pytest.approx(value, rel=1e-9)
    # log(1) = 0: the first update leaves the rate unchanged, the second divides by 1 + ln 2.
    assert schedule(1) == 1.0 and schedule(2) == pytest.approx(1 / (1 + math.log(2)))


def test_rate_changes_once_per_epoch_of_steps():
    schedule = make_lr_schedule("exponential", decay_rate=0.5, steps_per_epoch=4)
    assert [schedule(s) for s in range(9)] == [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.25]


def test_linear_decay_stays_finite_for_long_runs():
    value = LinearDecay(decay_rate=0.3, steps_per_epoch=1)(10_000)
    assert math.isfinite(value) and 0.0 <= value < 1e-100


def test_cosine_warmup_and_end():
    schedule = Cosine(total_steps=110, warmup_steps=10, final=0.1)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == pytest.approx(0.1)


def test_multistep_and_constant():
    multistep = make_lr_schedule("multistep", milestones=[3, 5], gamma=0.1)
    assert [multistep(s) for s in (0, 2, 3, 4, 5, 9)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    assert make_lr_schedule("none")(123) == 1.0
    assert make_lr_schedule(None)(7) == 1.0


def test_warmup_wraps_any_rule():
    schedule = make_lr_schedule("constant", warmup_steps=4)
    assert [schedule(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_works_as_lambda_lr_and_round_trips_its_state():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, make_lr_schedule("linear", decay_rate=0.3))
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / (1.3 * 1.6))
    state = scheduler.state_dict()
    fresh = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([parameter], lr=1e-3), make_lr_schedule("linear", decay_rate=0.9)
    )
    fresh.load_state_dict(state)
    assert fresh.lr_lambdas[0].decay_rate == 0.3


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("linear", {}),
        ("exponential", {"decay_rate": 1.5}),
        ("linear", {"decay_rate": -0.1}),
        ("bogus", {}),
        ("constant", {"steps_per_epoch": 0}),
    ],
)
def test_bad_parameters_raise_config_error(name, kwargs):
    with pytest.raises(ConfigError):
        make_lr_schedule(name, **kwargs)
