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
