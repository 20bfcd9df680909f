"""The progress bar's ε between checkpoints: the ledger's own value, recomputed only when it is cheap enough."""

from __future__ import annotations

import dpsynth.dpsgd.training as training
from dpsynth.dpsgd.training import EpsilonTicker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class SlowLedger:
    """A ledger whose ε costs ``cost`` seconds of the fake clock per call."""

    def __init__(self, clock: Clock, cost: float) -> None:
        self.clock, self.cost, self.calls = clock, cost, 0

    def epsilon(self) -> float:
        self.calls += 1
        self.clock.now += self.cost
        return 0.5 * self.calls


def test_epsilon_is_recomputed_once_the_interval_and_its_own_cost_allow(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(training.time, "monotonic", clock)
    ledger = SlowLedger(clock, cost=0.2)  # a PRV call on a shared CPU
    ticker = EpsilonTicker(ledger, share=0.05, interval=1.0)
    assert not ticker.due()
    clock.now += 1.0
    assert ticker.due() and ticker.measure() == 0.5 and ledger.calls == 1
    clock.now += 1.0  # past the interval, but 0.2 s of accounting may take only 5 %: wait 4 s
    assert not ticker.due()
    clock.now += 3.1
    assert ticker.due()


def test_a_checkpoint_value_counts_as_fresh(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(training.time, "monotonic", clock)
    ticker = EpsilonTicker(SlowLedger(clock, cost=0.0), interval=1.0)
    clock.now += 5.0
    ticker.fresh()
    assert not ticker.due()
