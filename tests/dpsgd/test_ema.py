"""EMA of model weights with the (1 + n) / (10 + n) warm-up, and its resumable state."""

import copy

import pytest
import torch
from torch import nn

from dpsynth.dpsgd.ema import EMA, warmed_up_decay


def scalar_model(value: float) -> nn.Module:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def test_warm_up_decay_formula():
    assert warmed_up_decay(0.9999, 0) == pytest.approx(0.1)
    assert warmed_up_decay(0.9999, 90) == pytest.approx(91 / 100)
    assert warmed_up_decay(0.9, 1000) == 0.9  # capped at the configured decay
    assert warmed_up_decay(0.9999, 10**6) == 0.9999


def test_updates_follow_the_warmed_up_recursion():
    model = scalar_model(0.0)
    ema = EMA(model, decay=0.9999)
    expected = 0.0
    for n, target in enumerate([1.0, 2.0, 3.0, 4.0]):
        with torch.no_grad():
            model.weight.fill_(target)
        decay = min(0.9999, (1 + n) / (10 + n))
        assert ema.current_decay() == pytest.approx(decay)
        ema.update(model)
        expected = decay * expected + (1 - decay) * target
        assert float(ema.model.weight) == pytest.approx(expected, rel=1e-6)
    assert ema.num_updates == 4
    # Without warm-up a 0.9999 average would still sit at ~0.001 of the way from the start.
    assert float(ema.model.weight) > 2.0


def test_warmup_can_be_disabled():
    model = scalar_model(1.0)
    ema = EMA(scalar_model(0.0), decay=0.5, warmup=False)
    ema.update(model)
    assert float(ema.model.weight) == pytest.approx(0.5)


def test_state_dict_round_trip_keeps_the_update_count():
    model = scalar_model(2.0)
    ema = EMA(scalar_model(0.0), decay=0.999)
    for _ in range(3):
        ema.update(model)
    state = copy.deepcopy(ema.state_dict())
    resumed = EMA(scalar_model(0.0), decay=0.999)
    resumed.load_state_dict(state)
    assert resumed.num_updates == 3
    ema.update(model)
    resumed.update(model)
    assert torch.equal(ema.model.weight, resumed.model.weight)


def test_bare_weights_load_with_a_fresh_count():
    ema = EMA(scalar_model(0.0), decay=0.99)
    ema.load_state_dict(scalar_model(5.0).state_dict())
    assert float(ema.model.weight) == 5.0 and ema.num_updates == 0


def test_decay_outside_unit_interval_rejected():
    with pytest.raises(ValueError):
        EMA(scalar_model(0.0), decay=1.0)
