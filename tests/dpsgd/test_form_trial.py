"""Strategy "timed": a layer whose two forms the cost model puts close together takes the faster one in a
trial on random tensors at the configured micro-batch size; the trial reads nothing private and draws
nothing from the run's generators; the update is the exact path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsynth.config import resolve_config
from dpsynth.dpsgd import DPSGDEngine, PerExampleGradients, form_trial
from dpsynth.errors import ConfigError
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.rng import NoiseSource


class SmallAndLargeMaps(nn.Module):
    """A 3x3 conv on a 12x12 map (ghost norm about 50x instantiation in the cost model: not timed), one on
    a 3x3 map and a Linear head (both within the trial ratio: timed)."""

    def __init__(self) -> None:
        super().__init__()
        self.large = nn.Conv2d(1, 4, 3, padding=1)
        self.small = nn.Conv2d(4, 6, 3, padding=1)
        self.head = nn.Linear(6 * 9, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(torch.tanh(self.large(x)), 4)
        return self.head(torch.tanh(self.small(h)).flatten(1))


def loss(model_call, example):
    return F.cross_entropy(model_call(example["x"]), example["y"])


def batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 2, 1, 12, 12, generator=g), "y": torch.randint(0, 2, (n, 2), generator=g)}


def ghost_forms(gradients: PerExampleGradients, micro_batch) -> dict[str, bool]:
    return {tap.module_name: tap.ghost for tap in gradients.taps(micro_batch)}


def test_only_close_calls_are_timed_and_the_timed_update_is_the_exact_one():
    torch.manual_seed(0)
    model, micro_batch = SmallAndLargeMaps(), batch(5)
    timed = PerExampleGradients(model, loss, strategy="timed", trial_batch=4)
    got, _ = timed(micro_batch)
    assert set(next(iter(timed.form_trials.values()))) == {"small", "head"}
    want, _ = PerExampleGradients(model, loss, strategy="exact")(micro_batch)
    for name, grad in want.items():
        assert torch.allclose(got[name], grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("ghost_faster", [True, False])
def test_the_faster_form_in_the_trial_is_kept(ghost_faster, monkeypatch):
    """The trial's timings decide, whatever the cost model said (it instantiates the small conv and takes
    the head's ghost norm, so each case overturns one of its picks)."""
    assert ghost_forms(PerExampleGradients(SmallAndLargeMaps(), loss, strategy="auto"), batch(3)) == {
        "large": False,
        "small": False,
        "head": True,
    }
    monkeypatch.setattr(form_trial, "_seconds", lambda tap, *args: 1.0 if tap.ghost == ghost_faster else 2.0)
    forms = ghost_forms(PerExampleGradients(SmallAndLargeMaps(), loss, strategy="timed"), batch(3))
    assert forms == {"large": False, "small": ghost_faster, "head": ghost_faster}


def test_the_trial_runs_at_the_configured_batch_on_random_tensors_and_leaves_the_global_generator_alone(
    monkeypatch,
):
    seen = []

    def seconds(tap, inputs, *args):
        seen.append((inputs.shape[0], inputs.abs().max().item()))
        return 1.0

    monkeypatch.setattr(form_trial, "_seconds", seconds)
    private = batch(3)
    private["x"].fill_(1e6)  # a trial that read the micro-batch would see these values
    gradients = PerExampleGradients(SmallAndLargeMaps(), loss, strategy="timed", trial_batch=7)
    state = torch.get_rng_state()
    gradients.taps(private)
    assert torch.equal(torch.get_rng_state(), state)
    assert seen and all(size == 7 and largest < 10 for size, largest in seen)


def test_the_engine_times_at_its_physical_batch_size_and_a_config_section_passes_the_strategy():
    model = SmallAndLargeMaps()
    engine = DPSGDEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss,
        PrivacyLedger(target_epsilon=50.0, delta=1e-5, accountant="rdp"),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sample_rate=0.5,
        expected_batch_size=2,
        max_physical_batch_size=3,
        noise=NoiseSource(seed=1),
        strategy="timed",
    )
    engine.step(batch(5))
    assert engine.strategy == "timed" and engine._per_example.trial_batch == 3
    assert engine._per_example.form_trials
    config = resolve_config({"method": "dpsgd-classifier", "device": "cpu", "dpsgd-classifier": {"strategy": "timed"}})
    assert config.section.private_training().strategy == "timed"
    with pytest.raises(ConfigError, match=r"dpsgd-classifier\.strategy"):
        resolve_config({"method": "dpsgd-classifier", "device": "cpu", "dpsgd-classifier": {"strategy": "fastest"}})


def test_the_other_form_is_abandoned_after_a_warm_up_far_slower_than_the_models_pick(monkeypatch):
    """A fake clock: the cost model's pick takes 1 s a run, the other form 10 s (past 3x): one run of it."""
    clock, runs = [0.0], []

    def norm_and_sum(tap, *args):
        runs.append(tap.ghost)
        clock[0] += 1.0 if tap.ghost == picked else 10.0

    monkeypatch.setattr(form_trial, "_norm_and_sum", norm_and_sum)
    monkeypatch.setattr(form_trial.time, "perf_counter", lambda: clock[0])
    gradients = PerExampleGradients(SmallAndLargeMaps(), loss, strategy="timed", trial_batch=2)
    picked = False  # the cost model instantiates the small conv (and takes the head's ghost norm)
    micro_batch = batch(2)
    taps = {tap.module_name: tap for tap in gradients.taps(micro_batch)}
    trial = next(iter(gradients.form_trials.values()))["small"]
    assert (trial.ghost_s, trial.instantiated_s) == (10.0, 1.0) and not taps["small"].ghost
    assert runs[: form_trial.TRIAL_REPEATS + 2] == [False] * (form_trial.TRIAL_REPEATS + 1) + [True]
