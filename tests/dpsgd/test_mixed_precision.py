"""Mixed precision (``precision: bf16``): the clipped sum keeps its sensitivity C, the noise is σC/B, fp16 is
refused off CUDA, and a bf16 step trains (dpsynth.dpsgd.precision; docs/privacy.md, "Mixed precision keeps
the clip bound")."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsynth.config import resolve_config
from dpsynth.dpsgd import DPSGDEngine, PerExampleGradients, clipped_grad_sum
from dpsynth.dpsgd.precision import FP16_LOSS_SCALE, Autocast, Precision
from dpsynth.errors import ConfigError
from dpsynth.privacy.rng import NoiseSource

CLIP = 0.5
# The tolerance of the fp32 sensitivity tests (tests/dpsgd/test_engine.py): the sum is fp32 under bf16 too.
TOLERANCE = 1e-5


class MixedNet(nn.Module):
    """A layer for every per-example path under autocast: a conv (instantiated), GroupNorm, an Embedding
    and a Linear head (ghost), and a Linear called twice (not tapped: the per-example-copy fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.label = nn.Embedding(3, 4)
        self.twice = nn.Linear(4, 4)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm(self.conv(x)) + self.label(y)[:, :, None, None])
        h = self.twice(self.twice(h.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        return self.head(h.flatten(1))


def loss_fn(model_call, example):
    """Cross-entropy of one example's K views ``x [K, 1, 6, 6]``, ``y [K]``."""
    return F.cross_entropy(model_call(example["x"], example["y"]), example["y"])


def records(count: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(count, 2, 1, 6, 6, generator=g), "y": torch.randint(0, 3, (count, 2), generator=g)}


def insert(batch: dict[str, torch.Tensor], record: dict[str, torch.Tensor], at: int) -> dict[str, torch.Tensor]:
    return {key: torch.cat([value[:at], record[key], value[at:]]) for key, value in batch.items()}


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors.values()])


@pytest.mark.parametrize("strategy", ["auto", "ghost", "instantiate", "exact"])
@pytest.mark.parametrize("scale", [1.0, 1e4, 1e30])
def test_one_inserted_record_moves_the_bf16_clipped_sum_by_at_most_c(strategy, scale):
    """Neighbouring batches B and B + one record (inserted first or in the middle; ``scale`` 1e4 makes its
    gradient huge, 1e30 non-finite in bf16): the clipped sums differ by at most C."""
    torch.manual_seed(0)
    per_example = PerExampleGradients(MixedNet(), loss_fn, strategy=strategy, precision="bf16")
    batch, extra = records(6, seed=1), records(1, seed=2)
    extra["x"] = extra["x"] * scale
    base, _ = clipped_grad_sum(per_example, [batch], CLIP)
    assert all(t.dtype == torch.float32 for t in base.values())
    for at in (0, 3):
        neighbour, count = clipped_grad_sum(per_example, [insert(batch, extra, at)], CLIP)
        assert count == 7
        change = float((flat(neighbour) - flat(base)).norm())
        assert change <= CLIP * (1 + TOLERANCE), (strategy, scale, at, change)


@pytest.mark.parametrize("strategy", ["auto", "exact"])
def test_a_clipped_bf16_gradient_has_norm_at_most_c_in_fp32(strategy):
    """The norm of one record's clipped contribution, taken in the sum's precision (fp32), is at most C,
    and a record under the bound is kept whole (its clipped sum is its own gradient)."""
    torch.manual_seed(1)
    per_example = PerExampleGradients(MixedNet(), loss_fn, strategy=strategy, precision="bf16")
    for seed, scale in ((3, 1.0), (4, 1e3), (5, 1e5)):
        record = records(1, seed)
        record["x"] = record["x"] * scale
        raw = flat(per_example.compute(record).full())
        clipped, _ = clipped_grad_sum(per_example, [record], CLIP)
        assert float(raw.norm()) > CLIP and float(flat(clipped).norm()) <= CLIP * (1 + TOLERANCE)
        whole, _ = clipped_grad_sum(per_example, [record], 2 * float(raw.norm()))
        assert torch.allclose(flat(whole), raw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", ["auto", "exact"])
def test_bf16_is_really_applied_and_gradients_match_fp32_to_bf16_accuracy(strategy):
    """The forward runs in bf16 under vmap too (torch.autocast alone leaves a vmapped conv in fp32 on the CPU):
    the tapped layers' outputs are bf16, and the gradients differ from fp32 ones by bf16 rounding only."""
    torch.manual_seed(2)
    model, batch = MixedNet(), records(4, seed=6)
    want, _ = PerExampleGradients(model, loss_fn, strategy="exact")(batch)
    mixed = PerExampleGradients(model, loss_fn, strategy=strategy, precision="bf16")
    got, _ = mixed(batch)
    if strategy == "auto":  # the casts do not change which layers are tapped (the plan counts parameter uses)
        dtypes = {tap.module_name: tap.output_dtype for tap in mixed.taps(batch)}
        assert set(dtypes) == {tap.module_name for tap in PerExampleGradients(model, loss_fn).taps(batch)}
        assert dtypes["conv"] == dtypes["head"] == torch.bfloat16
        assert dtypes["norm"] == dtypes["label"] == torch.float32  # GroupNorm stays fp32; an Embedding is a lookup
    errors = []
    for name, grad in got.items():
        assert grad.dtype == torch.float32
        errors.append(float((grad - want[name]).norm()) / float(want[name].norm()))
    assert 1e-4 < max(errors) < 0.08, errors  # bf16 has 8 mantissa bits: 0.4 % per rounding


def test_groupnorm_runs_in_fp32_in_the_batched_forward_under_bf16():
    """The vmapped forward's GroupNorm gets fp32 input, as autocast's rule says: CUDA's kernel rejects a bf16
    input with fp32 affine parameters (the CPU's accepts it, so only the dtype shows the difference here)."""
    torch.manual_seed(2)
    model, batch = MixedNet(), records(4, seed=6)
    seen = []
    model.norm.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    PerExampleGradients(model, loss_fn, strategy="auto", precision="bf16")(batch)
    assert seen and set(seen) == {torch.float32}, seen


def test_a_model_with_bf16_parameters_keeps_groupnorm_in_bf16():
    """Without autocast, a bf16 model's GroupNorm runs in bf16: its input is cast to the parameters' dtype, not
    to fp32 (the CPU kernel refuses an fp32 input with bf16 parameters)."""
    torch.manual_seed(2)
    model = MixedNet().to(torch.bfloat16)
    batch = {
        key: value.to(torch.bfloat16) if value.is_floating_point() else value for key, value in records(4, 6).items()
    }
    seen = []
    model.norm.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    grads, _ = PerExampleGradients(model, loss_fn, strategy="auto")(batch)
    assert seen and set(seen) == {torch.bfloat16}, seen
    assert all(grad.dtype == torch.bfloat16 and torch.isfinite(grad).all() for grad in grads.values())


class CountingLedger:
    """The engine's ledger interface without accounting (σ = 0 registers nothing)."""

    def register(self, mechanism) -> None:
        pass

    def spend(self, name: str, steps: int = 1) -> None:
        pass


def test_noise_std_is_sigma_c_over_expected_batch_size_under_bf16():
    torch.manual_seed(3)
    model = nn.Linear(200, 100)
    before = torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()])
    sigma, clip, expected_batch = 1.3, 0.5, 16
    engine = DPSGDEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        lambda call, ex: call(ex["x"]).sum(),
        CountingLedger(),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        sample_rate=0.01,
        expected_batch_size=expected_batch,
        max_physical_batch_size=8,
        noise=NoiseSource(seed=11),
        precision="bf16",
    )
    stats = engine.step({"x": torch.zeros(0, 200)})  # an empty Poisson batch: the noise alone
    delta = before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    target = sigma * clip / expected_batch
    assert engine.precision == "bf16" and stats.noise_std == pytest.approx(target)
    assert delta.dtype == torch.float32
    assert float(delta.std()) == pytest.approx(target, rel=0.03)  # 20,100 draws: ~0.5 % sampling error
    assert abs(float(delta.mean())) < 5 * target / math.sqrt(delta.numel())


def test_fp16_is_refused_at_config_load_off_cuda_naming_the_key():
    with pytest.raises(ConfigError, match=r"dpsgd-classifier\.precision=fp16 .*CUDA") as error:
        resolve_config({"method": "dpsgd-classifier", "device": "cpu", "dpsgd-classifier": {"precision": "fp16"}})
    assert "\n" not in str(error.value)
    config = resolve_config({"method": "dpsgd-classifier", "device": "cpu", "dpsgd-classifier": {"precision": "bf16"}})
    assert config.section.private_training().precision == "bf16"


def test_the_engine_refuses_fp16_on_a_cpu_model():
    model = nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        DPSGDEngine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            lambda call, ex: call(ex["x"]).sum(),
            CountingLedger(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sample_rate=0.1,
            expected_batch_size=4,
            max_physical_batch_size=4,
            precision="fp16",
        )


def test_autocast_casts_under_vmap_like_torch_autocast():
    x, weight, bias, project = torch.randn(3, 2, 4, 5, 5), torch.randn(6, 4, 3, 3), torch.randn(6), torch.randn(100, 3)
    with Autocast(torch.bfloat16):
        convolved = torch.func.vmap(lambda one: F.conv2d(one, weight, bias))(x)
        normalised = F.group_norm(convolved[0], 2)
        assert convolved.dtype == torch.bfloat16 and normalised.dtype == torch.float32
        assert torch.func.vmap(lambda one: one.flatten(1) @ project)(x).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(convolved[1], F.conv2d(x[1], weight, bias))


def test_the_fp16_loss_scale_is_undone_exactly():
    """The unscaling the fp16 path applies (checked on the CPU, where fp16 itself is refused): a power of
    two, so a gradient divided by it is the unscaled gradient bit for bit."""
    assert math.log2(FP16_LOSS_SCALE).is_integer()
    grad = torch.randn(1000, dtype=torch.float32)
    back = Precision("fp16").for_sum(grad * FP16_LOSS_SCALE, torch.float32, gradient=True)
    assert torch.equal(back, grad)
    indices = torch.arange(4)
    assert Precision("fp16").for_sum(indices, torch.float32, gradient=False) is indices


def test_a_bf16_step_trains_a_tiny_model():
    """Clipped, lightly noised bf16 steps on two separable classes lower the loss and separate them."""
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, 2, (64,), generator=g)
    inputs = torch.randn(64, 8, generator=g) + 2.0 * (2.0 * labels[:, None] - 1.0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 2))
    engine = DPSGDEngine(
        model,
        torch.optim.Adam(model.parameters(), lr=0.05),
        lambda call, ex: F.cross_entropy(call(ex["x"][None]), ex["y"][None]),
        CountingLedger(),
        noise_multiplier=0.1,
        max_grad_norm=1.0,
        sample_rate=0.5,
        expected_batch_size=32,
        max_physical_batch_size=16,
        noise=NoiseSource(seed=1),
        precision="bf16",
    )

    def loss() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(inputs), labels))

    before = loss()
    for step in range(30):
        engine.step({"x": inputs, "y": labels})
    with torch.no_grad():
        accuracy = float((model(inputs).argmax(1) == labels).float().mean())
    assert loss() < 0.5 * before and accuracy >= 0.95
    assert all(p.dtype == torch.float32 for p in model.parameters())
