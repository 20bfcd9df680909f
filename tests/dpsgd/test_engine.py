"""DP-SGD engine: sensitivity, noise, sampling, optimizers, clipping, ledger, checkpoints."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from dpsynth.dpsgd import (
    DPSGDEngine,
    PerExampleGradients,
    PoissonSampler,
    clipped_grad_sum,
    per_example_norms,
    public_clip_norm,
    steps_per_epoch,
)
from dpsynth.errors import BudgetExceededError, ConfigError, PrivacyError
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.mechanisms import SubsampledGaussian
from dpsynth.privacy.rng import NoiseSource


def make_ledger(epsilon: float = 50.0) -> PrivacyLedger:
    """A ledger whose budget the tests do not reach (RDP: fast to evaluate)."""
    return PrivacyLedger(target_epsilon=epsilon, delta=1e-5, accountant="rdp")


def steps_spent(ledger: PrivacyLedger, name: str = "dpsgd") -> int:
    return next(m for m in ledger.mechanisms() if m.name == name).steps


class TinyNet(nn.Module):
    """Conv + GroupNorm + linear head, with a buffer and a frozen parameter."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 5 * 5, classes)
        self.register_buffer("shift", torch.tensor(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(x + self.shift))).flatten(1))


def loss_fn(model_call, example):
    """Cross-entropy averaged over the example's K stacked views ([K,1,5,5] or [1,5,5])."""
    x, y = example["x"], example["y"]
    if x.dim() == 3:
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    return F.cross_entropy(model_call(x), y)


def make_batch(n: int, k: int | None = None, scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 1, 5, 5) if k is None else (n, k, 1, 5, 5)
    labels = (n,) if k is None else (n, k)
    return {"x": scale * torch.randn(shape, generator=g), "y": torch.randint(0, 3, labels, generator=g)}


def make_engine(model=None, optimizer=None, ledger=None, **overrides) -> DPSGDEngine:
    torch.manual_seed(0)
    model = model if model is not None else TinyNet()
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    args = {
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "sample_rate": 0.1,
        "expected_batch_size": 8,
        "max_physical_batch_size": 4,
        "noise": NoiseSource(seed=0),
    }
    args.update(overrides)
    return DPSGDEngine(model, optimizer, loss_fn, ledger if ledger is not None else make_ledger(), **args)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


# -- per-example gradients and sensitivity ---------------------------------------------------------


def test_per_example_gradient_is_the_mean_of_the_k_view_gradients():
    torch.manual_seed(1)
    model = TinyNet()
    batch = make_batch(3, k=4)
    grads, _ = PerExampleGradients(model, loss_fn)(batch)
    for i in range(3):
        view_grads = []
        for j in range(4):
            model.zero_grad()
            F.cross_entropy(model(batch["x"][i, j : j + 1]), batch["y"][i, j : j + 1]).backward()
            view_grads.append(flat(p.grad for p in model.parameters()))
        expected = torch.stack(view_grads).mean(0)
        assert torch.allclose(flat(g[i] for g in grads.values()), expected, atol=1e-5)


@pytest.mark.parametrize("per_layer", [False, True])
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(per_layer):
    torch.manual_seed(2)
    per_example = PerExampleGradients(TinyNet(), loss_fn)
    clip = 0.7
    for case in range(12):
        # Every third case plants an adversarial example whose gradient is huge.
        batch = make_batch(5, k=3, seed=case)
        if case % 3 == 0:
            batch["x"][case % 5] *= 1e4
        full, _ = clipped_grad_sum(per_example, [batch], clip, per_layer)
        full_norm_bound = 5 * clip
        assert flat(full.values()).norm() <= full_norm_bound * (1 + 1e-5)
        for drop in range(5):
            keep = [i for i in range(5) if i != drop]
            rest, count = clipped_grad_sum(per_example, [{k: v[keep] for k, v in batch.items()}], clip, per_layer)
            assert count == 4
            change = (flat(full.values()) - flat(rest.values())).norm()
            assert change <= clip * (1 + 1e-5), (case, drop, float(change))


def test_a_large_gradient_is_clipped_to_exactly_c_and_small_ones_are_kept():
    torch.manual_seed(3)
    per_example = PerExampleGradients(TinyNet(), loss_fn)
    batch = make_batch(2, scale=1.0)
    batch["x"][0] *= 1e4
    raw, _ = per_example(batch)
    norms = per_example_norms(raw)
    clip = float(norms[1]) * 1.5  # example 1 is under the bound, example 0 far above
    for i in range(2):
        single = {k: v[i : i + 1] for k, v in batch.items()}
        clipped, _ = clipped_grad_sum(per_example, [single], clip)
        expected = min(float(norms[i]), clip)
        assert math.isclose(float(flat(clipped.values()).norm()), expected, rel_tol=1e-4)


def test_per_layer_clipping_bounds_each_layer_by_c_over_sqrt_l():
    torch.manual_seed(4)
    per_example = PerExampleGradients(TinyNet(), loss_fn)
    batch = make_batch(1, scale=1e3)
    clip = 2.0
    clipped, _ = clipped_grad_sum(per_example, [batch], clip, per_layer=True)
    layers = len(clipped)
    for tensor in clipped.values():
        assert float(tensor.norm()) <= clip / math.sqrt(layers) * (1 + 1e-5)
    assert float(flat(clipped.values()).norm()) <= clip * (1 + 1e-5)


# -- noise, sampling -------------------------------------------------------------------------------


def test_noise_std_is_sigma_c_over_expected_batch_size():
    torch.manual_seed(5)
    model = nn.Linear(200, 100)
    before = flat(p.detach().clone() for p in model.parameters())
    sigma, clip, expected_batch = 1.3, 0.5, 16
    engine = DPSGDEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        lambda call, ex: call(ex["x"]).sum(),
        make_ledger(),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        sample_rate=0.01,
        expected_batch_size=expected_batch,
        max_physical_batch_size=8,
        noise=NoiseSource(seed=11),
    )
    stats_ = engine.step({"x": torch.zeros(0, 200)})  # empty Poisson batch: pure noise
    delta = before - flat(p.detach() for p in model.parameters())
    target = sigma * clip / expected_batch
    assert stats_.noise_std == pytest.approx(target)
    assert float(delta.std()) == pytest.approx(target, rel=0.03)  # 20,100 draws: ~0.5% sampling error
    assert abs(float(delta.mean())) < 5 * target / math.sqrt(delta.numel())


def test_empty_batch_still_counts_a_step():
    ledger = make_ledger()
    engine = make_engine(ledger=ledger)
    before = flat(p.detach().clone() for p in engine.model.parameters())
    engine.step(make_batch(0))
    assert steps_spent(ledger) == 1 and engine.steps == 1
    assert not torch.equal(before, flat(p.detach() for p in engine.model.parameters()))


def test_poisson_sampler_includes_each_example_with_probability_q():
    sampler = PoissonSampler(400, 0.05, generator=torch.Generator().manual_seed(3), num_steps=250)
    batches = list(sampler)
    assert len(batches) == 250
    total = sum(len(b) for b in batches)
    assert stats.binomtest(total, 400 * 250, 0.05).pvalue > 1e-3
    per_example = torch.zeros(400)
    for b in batches:
        assert torch.equal(b, b.unique())  # sorted, no repeats
        per_example[b] += 1
    # Each example's count is Binomial(250, 0.05): its spread across examples must match.
    assert float(per_example.var()) == pytest.approx(250 * 0.05 * 0.95, rel=0.3)
    assert any(len(b) == 0 for b in PoissonSampler(10, 0.01, torch.Generator().manual_seed(0), num_steps=50))


def test_poisson_sampler_defaults_to_an_entropy_seed():
    torch.manual_seed(0)
    first = PoissonSampler(1000, 0.5).sample()
    torch.manual_seed(0)
    second = PoissonSampler(1000, 0.5).sample()
    assert not torch.equal(first, second)
    assert steps_per_epoch(0.03) == 34
    with pytest.raises(PrivacyError):
        PoissonSampler(10, 0.0)


# -- optimizers, virtual batches, engine contract -----------------------------------------------------


class NoNoise(NoiseSource):
    """Test-only hook: switches the DP noise off so the update can be checked exactly."""

    def normal(self, shape, std, device="cpu", dtype=torch.float32):
        return torch.zeros(tuple(shape), device=device, dtype=dtype)


def reference_clipped_mean(model: nn.Module, batch: dict, clip: float, expected_batch: float) -> list[torch.Tensor]:
    """sum_i clip_C(grad L_i) / B by a plain loop over the examples (no engine code)."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(batch["y"])):
        model.zero_grad()
        loss_fn(model, {k: v[i] for k, v in batch.items()}).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        scale = min(1.0, clip / (float(flat(grads).norm()) + 1e-6))
        for acc, g in zip(total, grads):
            acc.add_(scale * g)
    return [t / expected_batch for t in total]


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_optimizer_steps_equal_a_reference_computation(optimizer_cls):
    torch.manual_seed(6)
    model = TinyNet()
    reference = copy.deepcopy(model)
    reference_optimizer = optimizer_cls(reference.parameters(), lr=1e-2)
    engine = make_engine(
        model=model,
        optimizer=optimizer_cls(model.parameters(), lr=1e-2),
        ema_decay=0.5,
        noise=NoNoise(),
        max_grad_norm=0.2,
    )
    for step in range(3):
        batch = make_batch(6, k=2, seed=step)
        engine.step(batch)
        for p, g in zip(reference.parameters(), reference_clipped_mean(reference, batch, 0.2, 8)):
            p.grad = g
        reference_optimizer.step()
    assert torch.allclose(flat(model.parameters()), flat(reference.parameters()), atol=1e-5)
    ema = flat(engine.ema_model.parameters())
    assert not torch.equal(ema, flat(model.parameters()))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_example_contributes_nothing_and_is_counted(poison):
    batch = make_batch(5, k=2, seed=3)
    batch["x"][2, 1, 0, 0, 0] = poison
    clean = {k: torch.cat([v[:2], v[3:]]) for k, v in batch.items()}
    results = []
    for data in (batch, clean):
        engine = make_engine(noise=NoiseSource(seed=4))
        stats_ = engine.step(data)
        results.append(flat(p.detach() for p in engine.model.parameters()))
        assert "nonfinite" not in repr(stats_)  # the count is private: not in what a step reports
    assert torch.isfinite(results[0]).all()
    assert torch.allclose(results[0], results[1], atol=1e-6)
    per_example = PerExampleGradients(TinyNet(), loss_fn)
    clipped_grad_sum(per_example, [batch, batch], 1.0)
    assert per_example.nonfinite_examples == 2


def test_virtual_batching_matches_one_physical_batch():
    batch = make_batch(10, k=2)
    results = []
    for physical in (3, 64):
        engine = make_engine(max_physical_batch_size=physical, noise=NoiseSource(seed=9))
        engine.step(batch)
        results.append(flat(p.detach() for p in engine.model.parameters()))
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_update_equals_clipped_mean_plus_noise_with_plain_sgd():
    engine = make_engine(noise_multiplier=0.5, max_grad_norm=0.3, expected_batch_size=8)
    per_example = engine._per_example
    batch = make_batch(5)
    clipped, _ = clipped_grad_sum(per_example, [batch], 0.3)
    # the engine's source replays the same draws: one flat draw for all parameters (one group), split in order
    flat = NoiseSource(seed=0).normal((sum(c.numel() for c in clipped.values()),), 0.5 * 0.3)
    draws = flat.split([c.numel() for c in clipped.values()])
    expected = {n: (c + d.view(c.shape)) / 8 for (n, c), d in zip(clipped.items(), draws)}
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.step(batch)
    for name, p in engine.model.named_parameters():
        assert torch.allclose(before[name] - 0.1 * expected[name], p.detach(), atol=1e-6)


def test_batchnorm_is_rejected_at_construction():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(ConfigError, match="BatchNorm2d"):
        make_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_refused_step_changes_nothing():
    ledger = PrivacyLedger(target_epsilon=3.0, delta=1e-5, accountant="rdp")
    engine = make_engine(ledger=ledger, noise_multiplier=2.0, sample_rate=0.5, ema_decay=0.5)
    declared = next(m for m in ledger.mechanisms() if m.name == "dpsgd")
    assert (declared.noise_multiplier, declared.sample_rate) == (2.0, 0.5)
    allowed = ledger.max_steps("dpsgd")
    assert 1 <= allowed < 50
    for step in range(allowed):
        engine.step(make_batch(4, seed=step))
    model_state = copy.deepcopy(engine.model.state_dict())
    ema_state = copy.deepcopy(engine.ema_model.state_dict())
    ema_updates = engine.ema_state_dict()["num_updates"]
    optimizer_state = copy.deepcopy(engine.optimizer.state_dict())
    with pytest.raises(BudgetExceededError):
        engine.step(make_batch(4, seed=99))
    assert engine.steps == allowed and steps_spent(ledger) == allowed
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, model_state[name])
    for name, value in engine.ema_model.state_dict().items():
        assert torch.equal(value, ema_state[name])
    assert engine.ema_state_dict()["num_updates"] == ema_updates == allowed
    assert repr(engine.optimizer.state_dict()) == repr(optimizer_state)


def test_engine_refuses_a_ledger_declared_with_another_sigma():
    ledger = make_ledger()
    ledger.register(SubsampledGaussian("dpsgd", 2.0, 0.1, 0))
    with pytest.raises(PrivacyError):
        make_engine(ledger=ledger, noise_multiplier=1.0)


def test_public_clip_norm_is_the_mean_public_gradient_norm_and_costs_nothing():
    ledger = make_ledger()
    engine = make_engine(ledger=ledger)
    public = make_batch(6, k=2, seed=42)
    value = public_clip_norm(engine, public)
    grads, _ = engine._per_example(public)
    assert value == pytest.approx(float(per_example_norms(grads).mean()), rel=1e-6)
    assert steps_spent(ledger) == 0
    stats_ = engine.step(make_batch(4), max_grad_norm=value)
    assert stats_.max_grad_norm == value and engine.max_grad_norm == 1.0
    assert steps_spent(ledger) == 1


def test_resume_restores_model_optimizer_ema_and_step_count():
    batches = [make_batch(5, k=2, seed=s) for s in range(3)]
    model = TinyNet()
    original = make_engine(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), ema_decay=0.9)
    for batch in batches[:2]:
        original.step(batch)
    state = copy.deepcopy(original.state_dict())

    fresh_model = TinyNet()
    resumed = make_engine(
        model=fresh_model, optimizer=torch.optim.Adam(fresh_model.parameters(), lr=1e-2), ema_decay=0.9
    )
    resumed.load_state_dict(state)
    assert resumed.steps == 2
    original.noise, resumed.noise = NoiseSource(seed=5), NoiseSource(seed=5)
    original.step(batches[2])
    resumed.step(batches[2])
    assert torch.allclose(flat(original.model.parameters()), flat(resumed.model.parameters()), atol=1e-6)
    assert torch.allclose(flat(original.ema_model.parameters()), flat(resumed.ema_model.parameters()), atol=1e-6)
    with pytest.raises(PrivacyError):
        make_engine(noise_multiplier=3.0).load_state_dict(state)


class TapNet(nn.Module):
    """Layers for every tap path: a small conv and a 28x28 conv (instantiated per layer), a Linear on
    K rows (ghost norm), a Linear on many rows (instantiated), and a Linear called twice (not tapped:
    its per-example gradient comes from the fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.small_conv = nn.Conv2d(2, 3, 3, padding=1, stride=4)
        self.big_conv = nn.Conv2d(2, 3, 3, padding=1)
        self.tokens = nn.Linear(3, 2)
        self.shared = nn.Linear(3 * 7 * 7, 3 * 7 * 7 // 7)
        self.head = nn.Linear(21, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = torch.tanh(self.small_conv(x))  # [K, 3, 7, 7]
        big = self.big_conv(x).mean((2, 3))  # [K, 3]
        rows = self.tokens(small.flatten(2).transpose(1, 2)).sum((1, 2))  # 49 rows of 3 features
        shared = self.shared(small.flatten(1))
        return (
            self.head(torch.tanh(self.shared(torch.cat([small.flatten(1)[:, :126], shared], 1))))
            # weighted per logit: a term added equally to every logit has a zero cross-entropy gradient
            + (big.sum(1, keepdim=True) + rows[:, None]) * torch.tensor([1.0, 0.0, -1.0, 0.5])
        )


def test_layer_taps_give_the_same_clipped_sums_as_the_exact_path():
    torch.manual_seed(8)
    model = TapNet()
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(5, 3, 2, 28, 28, generator=g), "y": torch.randint(0, 4, (5, 3), generator=g)}
    fast, plain = PerExampleGradients(model, loss_fn), PerExampleGradients(model, loss_fn, strategy="exact")
    taps = {tap.module_name: tap for tap in fast.taps(batch)}
    assert set(taps) == {"small_conv", "big_conv", "tokens", "head"}
    assert taps["head"].ghost and not (taps["big_conv"].ghost or taps["small_conv"].ghost or taps["tokens"].ghost)
    result = fast.compute(batch)
    assert set(result.factored) == {"head.weight"}
    assert {"shared.weight", "big_conv.weight", "tokens.bias"} <= set(result.materialised)
    want, _ = plain(batch)
    for name, grad in result.full().items():
        assert torch.allclose(grad, want[name], atol=1e-5, rtol=1e-4), name
    for per_layer in (False, True):
        got_sum, _ = clipped_grad_sum(fast, [batch], 0.05, per_layer)
        want_sum, _ = clipped_grad_sum(plain, [batch], 0.05, per_layer)
        for name in want_sum:
            assert torch.allclose(got_sum[name], want_sum[name], atol=1e-6, rtol=1e-4), name


def test_noise_groups_hold_one_device_and_dtype_within_the_size_bound():
    from dpsynth.dpsgd.engine import _NOISE_GROUP_NUMEL, _noise_groups

    big = torch.zeros(_NOISE_GROUP_NUMEL - 10)
    tensors = [
        torch.zeros(4),
        torch.zeros(3, dtype=torch.float64),
        torch.zeros(5, dtype=torch.float64),
        big,
        torch.zeros(20),
    ]
    groups = _noise_groups(tensors)
    assert [[t.numel() for t in g] for g in groups] == [[4], [3, 5], [big.numel()], [20]]
    assert all(len({(t.device, t.dtype) for t in g}) == 1 for g in groups)
