"""The tap engine keeps the clip bound on adversarial inputs and never silently drops a weight's second use.

Ghost norms: rows of ``A`` at scale ``s`` that differ by O(1) while their output gradients cancel make
``||G_i^T A_i||^2`` a difference of Gram terms ~``s^2`` times larger than itself. Float32 (or float16) Grams
then give a norm too small (the example passes the clip with more than C) or negative (NaN everywhere).

Tied weights: a layer whose weight is also read through ``.T`` or registered in a second layer must not be
tapped, or the second use's gradient is lost."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dpsynth.dpsgd import PerExampleGradients
from dpsynth.dpsgd.per_example import clip_scales, clipped_grad_sum

CLIP = 1.0


def directional_loss(model_call, example):
    """Linear in the output, so the output gradient ``G`` is exactly ``example["w"]``."""
    return (model_call(example["x"]) * example["w"]).sum()


class Rows(nn.Module):
    """One tapped layer whose per-example rows ``A`` are ``x`` (Linear, 1x1 Conv2d, or Embedding indices)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer = {
            "linear": nn.Linear(8, 2, bias=False),
            "conv": nn.Conv2d(8, 2, 1, bias=False),
            "embedding": nn.Embedding(5, 8),
        }[kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "conv":  # [T, 8] -> a 1 x T map with 8 channels
            return self.layer(x.t().unsqueeze(1)).squeeze(1).t()
        return self.layer(x)


def cancelling_batch(kind: str, size: int, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """Two rows per example: ``scale * u + noise`` with output gradients ``v, -v`` (for an embedding: one
    index twice with gradients ``scale * v, -scale * v + noise``). The true gradient is O(1), its Gram terms
    O(scale^2)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "embedding":
        v = torch.randn(size, 1, 8, generator=g)
        v = scale * v / v.norm(dim=-1, keepdim=True)
        return {
            "x": torch.randint(0, 5, (size, 1), generator=g).expand(size, 2).contiguous(),
            "w": torch.cat([v, -v + torch.randn(size, 1, 8, generator=g)], 1),
        }
    u = torch.randn(8, generator=g)
    v = torch.randn(size, 1, 2, generator=g)
    x = scale * u / u.norm() + torch.randn(size, 2, 8, generator=g)
    return {"x": x, "w": torch.cat([v, -v], 1)}


def true_squared_norms(model: Rows, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each example's squared gradient norm, materialised in float64."""
    w = batch["w"].double()
    if model.kind == "embedding":
        table = torch.zeros(len(w), 5, 8, dtype=torch.float64)
        grads = table.scatter_add_(1, batch["x"].unsqueeze(-1).expand(-1, -1, 8), w)
    else:
        grads = torch.einsum("bto,bti->boi", w, batch["x"].double())
    return grads.flatten(1).pow(2).sum(1)


@pytest.mark.parametrize("kind", ["linear", "conv", "embedding"])
@pytest.mark.parametrize("scale", [1e2, 1e3, 1e4])
def test_ghost_norms_of_nearly_cancelling_rows_are_exact_and_keep_the_clip_bound(kind, scale):
    torch.manual_seed(0)
    model = Rows(kind)
    batch = cancelling_batch(kind, 32, scale, seed=int(scale))
    result = PerExampleGradients(model, directional_loss, strategy="ghost").compute(batch)
    assert "layer.weight" in result.factored
    true = true_squared_norms(model, batch)
    squared, dropped = result.drop_nonfinite()
    # These cancel by ~scale^2 but stay far inside float64: none may be dropped, each norm exact to 1e-6
    # (float32 Grams are off by 1e-3 at scale 1e2 and negative at 1e4; float16 ones overflow).
    assert dropped == 0
    torch.testing.assert_close(squared["layer.weight"].double(), true, rtol=1e-6, atol=0)
    clipped = clip_scales(squared, CLIP)["layer.weight"].double() * true.sqrt()
    assert clipped.max() <= CLIP * (1 + 1e-5)


def test_cancellation_beyond_float64_drops_the_example_and_counts_it():
    """At scale 1e7 the float64 ghost norm is within its own rounding error: those examples contribute
    nothing and are counted as non-finite; ordinary examples of the same micro-batch are clipped as usual."""
    torch.manual_seed(0)
    model = Rows("linear")
    hostile, ordinary = cancelling_batch("linear", 6, 1e7, seed=1), cancelling_batch("linear", 6, 1.0, seed=2)
    batch = {key: torch.cat([hostile[key], ordinary[key]]) for key in hostile}
    per_example = PerExampleGradients(model, directional_loss, strategy="ghost")
    result = per_example.compute(batch)
    squared, dropped = result.drop_nonfinite()
    assert dropped == 6 and result.unreliable()[:6].all() and not result.unreliable()[6:].any()
    true = true_squared_norms(model, batch)
    clipped = clip_scales(squared, CLIP)["layer.weight"].double() * true.sqrt()
    assert clipped[6:].max() <= CLIP * (1 + 1e-5)

    total, count = clipped_grad_sum(per_example, [batch], CLIP)
    assert count == 12 and per_example.nonfinite_examples == 6
    assert torch.isfinite(total["layer.weight"]).all()
    alone, _ = clipped_grad_sum(PerExampleGradients(model, directional_loss, strategy="ghost"), [ordinary], CLIP)
    torch.testing.assert_close(total["layer.weight"], alone["layer.weight"])


# -- tied and transposed weights ----------------------------------------------------------------


class TransposedHead(nn.Module):
    """The input layer's weight read again, through ``.T``, as the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 3)
        self.mid = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return F.linear(h, self.inp.weight.T)


class SharedParameter(nn.Module):
    """One Parameter registered in two Linear layers (``b.weight = a.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def regression_loss(model_call, example):
    return (model_call(example["x"]) - example["target"]).pow(2).mean()


def torch_func_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-example gradients by ``vmap(grad)``, independent of the tap engine."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p, example):
        return regression_loss(lambda *a: functional_call(model, p, a), example)

    return vmap(grad(loss), in_dims=(None, 0))(params, batch)


@pytest.mark.parametrize("build,untapped", [(TransposedHead, {"inp"}), (SharedParameter, {"a", "b"})])
@pytest.mark.parametrize("strategy", ["auto", "ghost", "instantiate"])
def test_a_weight_used_twice_is_not_tapped_and_gets_every_use_of_its_gradient(build, untapped, strategy):
    torch.manual_seed(1)
    model = build()
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(5, 2, 4, generator=g), "target": torch.randn(5, 2, 1, generator=g)}
    batch["target"] = batch["target"].expand(5, 2, model(batch["x"][0]).shape[-1]).contiguous()
    per_example = PerExampleGradients(model, regression_loss, strategy=strategy)
    assert not untapped & {tap.module_name for tap in per_example.taps(batch)}
    got, _ = per_example(batch)
    want = torch_func_grads(model, batch)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


# -- one near-cancelling record, every strategy and layer form, every device ------------------------------
# A ghost layer's clip factor comes from float64 Grams (a convolution's, under "instantiate", possibly from its
# instantiated per-example gradient), but its clipped contribution is summed by a separate GEMM or weight-gradient
# convolution: clipping is exact only if that sum is as accurate as the norm. TF32 (on by default for cuDNN
# convolutions) would let a record whose gradient rows nearly cancel add about 2^-11 * SCALE times its norm too
# much; the private step turns it off (dpsynth.dpsgd.precision.no_tf32). The CUDA cases are generated only where
# CUDA is available (experiments/gpu_check.sh runs them on a GPU lease); on a CPU-only machine there is no CUDA
# case to skip.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
STRATEGIES = ["auto", "ghost", "instantiate", "timed", "exact"]
NEAR_CANCEL_SCALE = 30.0  # the record's rows: SCALE * a shared direction + O(1) noise, output gradients summing to 0
NEAR_CANCEL_CLIP = 0.05


class Wide(nn.Module):
    """A 3x3 convolution with many channels on a 4x4 map: instantiated, its gradient is larger than ``A`` and
    ``G`` together, so the engine takes the norm from the instantiated gradient and sums from ``A`` and ``G``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Conv2d(32, 32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class Twice(nn.Module):
    """A Linear called twice: not tapped, its per-example gradient from per-example weight copies (the fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.layer(x))


class Single(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


# layer form -> (model builder, per-example input shape, its feature (channel) axis: the other axes are rows)
LAYER_FORMS = {
    "linear": (lambda: Single(nn.Linear(8, 4)), (6, 8), 1),
    "conv2d-3x3": (lambda: Single(nn.Conv2d(3, 4, 3)), (3, 6, 6), 0),
    "conv2d-pointwise": (lambda: Single(nn.Conv2d(3, 4, 1)), (3, 5, 5), 0),
    "conv2d-grouped": (lambda: Single(nn.Conv2d(4, 4, 3, groups=2)), (4, 6, 6), 0),
    "conv1d": (lambda: Single(nn.Conv1d(3, 4, 3)), (3, 9), 0),
    "conv2d-wide": (Wide, (32, 4, 4), 0),
    "embedding": (lambda: Rows("embedding"), None, None),
    "group-norm": (lambda: Single(nn.GroupNorm(2, 4)), (2, 4, 5, 5), 1),
    "layer-norm": (lambda: Single(nn.LayerNorm(8)), (6, 8), 1),
    "fallback": (Twice, (6, 8), 1),
}


def near_cancelling_record(form: str, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """One record (a batch of 1) whose gradient rows nearly cancel: every input row (position) is ``scale``
    times one shared direction plus O(1) noise, and the output gradients ``w`` sum to zero over the rows, so
    the weight gradient ``sum_t w_t x_t^T`` keeps only the O(1) noise part of terms ``scale`` times larger."""
    if form == "embedding":
        return cancelling_batch("embedding", 1, scale, seed)
    model, shape, axis = LAYER_FORMS[form]
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn([size if dim == axis else 1 for dim, size in enumerate(shape)], generator=g)
    x = scale * direction / direction.norm() + torch.randn(*shape, generator=g)
    with torch.no_grad():
        out = model()(x)
    w = torch.randn(out.shape, generator=g)
    w = w - w.mean(dim=tuple(dim for dim in range(out.dim()) if dim != axis), keepdim=True)
    return {"x": x.unsqueeze(0), "w": w.unsqueeze(0)}


def ordinary_records(form: str, count: int, seed: int) -> dict[str, torch.Tensor]:
    parts = [near_cancelling_record(form, 0.0, seed + i) for i in range(count)]
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def flat_sum(total: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([value.detach().double().flatten().cpu() for _, value in sorted(total.items())])


def layer_forms(per_example: PerExampleGradients, batch: dict[str, torch.Tensor]) -> set[str]:
    """The forms the engine takes for ``batch``'s parameters: ghost (norm from Grams, sum from factors),
    norm-from-gradient (a convolution's norm from its instantiated gradient, sum from factors), instantiated
    (a tapped layer's gradient kept), fallback (per-example copies), exact (one backward per example)."""
    if per_example.strategy == "exact":
        return {"exact"}
    result = per_example.compute(batch)
    tapped = {name for tap in per_example.taps(batch) for name in tap.params.values()}
    forms = {"ghost" if f.ghost else "norm-from-gradient" for f in result.factored.values()}
    forms |= {"instantiated" if name in tapped else "fallback" for name in result.materialised}
    return forms


def check_near_cancelling_record(form: str, strategy: str, device: str) -> set[str]:
    """Adding one near-cancelling record (each of three) to five ordinary ones moves the noiseless clipped sum
    by at most C * (1 + 1e-5); returns the layer forms the engine took (for the coverage test)."""
    torch.manual_seed(0)
    model = LAYER_FORMS[form][0]().to(device)
    base = {key: value.to(device) for key, value in ordinary_records(form, 5, seed=10).items()}
    per_example = PerExampleGradients(model, directional_loss, strategy=strategy)
    without, _ = clipped_grad_sum(per_example, [base], NEAR_CANCEL_CLIP)
    for seed in range(3):
        record = near_cancelling_record(form, NEAR_CANCEL_SCALE, seed)
        neighbour = {key: torch.cat([base[key][:2], record[key].to(device), base[key][2:]]) for key in base}
        with_record, count = clipped_grad_sum(per_example, [neighbour], NEAR_CANCEL_CLIP)
        assert count == 6 and per_example.nonfinite_examples == 0
        change = float((flat_sum(with_record) - flat_sum(without)).norm())
        assert change <= NEAR_CANCEL_CLIP * (1 + 1e-5), (form, strategy, device, seed, change / NEAR_CANCEL_CLIP - 1)
        assert change >= NEAR_CANCEL_CLIP * (1 - 1e-3), "the record is clipped: its contribution has norm C"
    return layer_forms(PerExampleGradients(model, directional_loss, strategy=strategy), neighbour)


def tf32_rounded(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` rounded to TF32's 10-bit mantissa (what a TF32 GEMM or convolution reads of its fp32 inputs)."""
    bits = tensor.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(tensor.dtype)


@pytest.mark.parametrize("form", ["linear", "conv2d-3x3"])
def test_the_bound_check_catches_a_sum_formed_from_tf32_inputs(form, monkeypatch):
    """What the check guards against, on the CPU: a ghost layer whose clipped sum reads ``A`` and ``G`` at TF32
    precision (as cuDNN's default TF32 would on CUDA) while its norm came from float64 Grams lets the
    near-cancelling record add more than C * (1 + 1e-5)."""
    from dpsynth.dpsgd import taps

    def rounded(method):
        def call(self, *args):
            exact = self.activations, self.output_grads
            self.activations, self.output_grads = tf32_rounded(exact[0]), tf32_rounded(exact[1])
            try:
                return method(self, *args)
            finally:
                self.activations, self.output_grads = exact

        return call

    monkeypatch.setattr(taps.FactoredLinear, "add_weighted_sum_to", rounded(taps.FactoredLinear.add_weighted_sum_to))
    monkeypatch.setattr(taps.FactoredConv, "weighted_sum", rounded(taps.FactoredConv.weighted_sum))
    with pytest.raises(AssertionError, match=form):
        check_near_cancelling_record(form, "ghost", "cpu")


def test_the_record_nearly_cancels():
    """The weight gradient of the record is far smaller than the sum of its terms' norms (what makes the
    clipped sum sensitive to rounding), for every tapped form with rows."""
    for form in ("linear", "conv2d-3x3", "conv2d-pointwise", "conv1d", "conv2d-wide"):
        model = LAYER_FORMS[form][0]()
        record = near_cancelling_record(form, NEAR_CANCEL_SCALE, 3)
        full, _ = PerExampleGradients(model, directional_loss, strategy="instantiate")(record)
        weight = full["layer.weight"].double().norm()
        x, w = record["x"][0].double(), record["w"][0].double()
        rows = x.norm() * w.norm()  # >= the sum of the terms' norms up to the kernel size
        assert rows > 5 * weight, form


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("form", LAYER_FORMS)
def test_one_near_cancelling_record_moves_the_clipped_sum_by_at_most_c(form, strategy, device):
    check_near_cancelling_record(form, strategy, device)


def test_the_near_cancelling_cases_cover_every_layer_form():
    forms = set()
    for form in LAYER_FORMS:
        for strategy in STRATEGIES:
            model = LAYER_FORMS[form][0]()
            batch = ordinary_records(form, 3, seed=1)
            forms |= layer_forms(PerExampleGradients(model, directional_loss, strategy=strategy), batch)
    assert forms == {"ghost", "norm-from-gradient", "instantiated", "fallback", "exact"}


# -- TF32 off inside the private step ---------------------------------------------------------------------
def tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("strategy", ["auto", "exact"])
def test_tf32_is_off_inside_the_private_step_and_restored_after(strategy):
    """A forward hook reads the TF32 flags while DPSGDEngine.step runs (both on beforehand, as a user may set
    them): off inside every forward of the step, back on after it, and back on after a step that raised."""
    from dpsynth.dpsgd import DPSGDEngine
    from dpsynth.privacy import PrivacyLedger
    from dpsynth.privacy.rng import NoiseSource

    seen: list[tuple[bool, bool]] = []
    model = Single(nn.Conv2d(3, 4, 3))
    model.layer.register_forward_hook(lambda module, args, output: seen.append(tf32_flags()))
    engine = DPSGDEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        directional_loss,
        PrivacyLedger(target_epsilon=50.0, delta=1e-5, accountant="rdp"),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sample_rate=0.1,
        expected_batch_size=4,
        max_physical_batch_size=2,
        noise=NoiseSource(seed=3),
        strategy=strategy,
    )
    before = tf32_flags()
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        engine.step(ordinary_records("conv2d-3x3", 4, seed=0))
        assert seen and set(seen) == {(False, False)}
        assert tf32_flags() == (True, True)

        def fail(module, args, output):
            assert tf32_flags() == (False, False)
            raise RuntimeError("a failing forward")

        model.layer.register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="a failing forward"):
            engine.step(ordinary_records("conv2d-3x3", 4, seed=1))
        assert tf32_flags() == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
