"""Feature maps with a declared norm bound: random Fourier features (unit norm, kernel approximation,
public determinism, bandwidth rules) and closed-form e-NTK features (equal to autograd's per-example
gradients, unit norm, factored class sums)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpsynth.errors import ConfigError
from dpsynth.kernels import (
    NTKFeatures,
    RandomFourierFeatures,
    bandwidth_ladder,
    class_feature_means,
    fc_1l,
    fc_2l,
    feature_chunks,
    median_heuristic,
)
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.bounded_sum import BoundedSum, release_bounded_sum
from dpsynth.privacy.rng import NoiseSource

# ----------------------------------------------------------------------------- random Fourier features


def test_rff_rows_have_unit_norm_whatever_the_input():
    rff = RandomFourierFeatures(input_dim=12, num_features=64, bandwidths=[0.5, 3.0], seed=0)
    vectors = rff(torch.cat([torch.randn(20, 12) * 100, torch.zeros(1, 12)]))
    images = rff(torch.rand(5, 3, 2, 2))  # images are flattened
    norms = torch.cat([vectors, images]).norm(dim=1)
    assert rff.bound == 1.0 and rff.dim == 64
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)


@pytest.mark.parametrize("bandwidths", [2.0, (1.0, 2.0, 4.0, 8.0)])
def test_rff_inner_products_approximate_the_gaussian_kernel(bandwidths):
    """phi(x).phi(y) ~ sum_s w_s exp(-|x-y|^2 / (2 l_s^2)); at D = 40,000 each estimate has std below
    0.005, so 0.03 is a wide margin; pairs at all distances, including x = y (kernel 1)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(30, 10, generator=generator)
    y = torch.cat(
        [x[:5], x[5:15] + 0.3 * torch.randn(10, 10, generator=generator), torch.randn(15, 10, generator=generator)]
    )
    rff = RandomFourierFeatures(10, 40_000, bandwidths, seed=2)
    approx = rff(x) @ rff(y).T
    scales = (bandwidths,) if isinstance(bandwidths, float) else bandwidths
    squared = torch.cdist(x.double(), y.double()) ** 2
    exact = sum(torch.exp(-squared / (2 * s**2)) for s in scales) / len(scales)
    assert torch.allclose(rff.kernel(x, y), exact)
    assert float((approx.double() - exact).abs().max()) < 0.03
    assert float(exact.min()) < 0.3 and float(exact.max()) == pytest.approx(1.0)  # near and far pairs


def test_rff_are_deterministic_from_the_public_seed():
    inputs = torch.randn(4, 6)
    same = [RandomFourierFeatures(6, 32, 1.5, seed=7)(inputs) for _ in range(2)]
    other = RandomFourierFeatures(6, 32, 1.5, seed=8)(inputs)
    assert torch.equal(same[0], same[1])
    assert not torch.allclose(same[0], other)


def test_rff_mix_assigns_frequencies_round_robin():
    rff = RandomFourierFeatures(200, 2 * 3000, (1.0, 10.0), seed=3)
    row_norms = rff.frequencies.norm(dim=1)  # ~ sqrt(d) / l for a row of bandwidth l
    assert float(row_norms[0::2].mean()) == pytest.approx(math.sqrt(200) / 1.0, rel=0.02)
    assert float(row_norms[1::2].mean()) == pytest.approx(math.sqrt(200) / 10.0, rel=0.02)


@pytest.mark.parametrize("args", [(5, 31, 1.0), (5, 2, (1.0, 2.0)), (5, 8, 0.0), (5, 8, ())])
def test_rff_bad_settings_are_refused(args):
    with pytest.raises(ConfigError):
        RandomFourierFeatures(*args, seed=0)


def test_public_bandwidth_rules():
    points = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])  # distances 5, 5, 10
    assert median_heuristic(points) == pytest.approx(5.0)
    many = torch.randn(5000, 3, generator=torch.Generator().manual_seed(4))
    assert median_heuristic(many, max_points=500, seed=1) == median_heuristic(many, max_points=500, seed=1)
    ladder = bandwidth_ladder(4.0, 4)
    assert ladder == pytest.approx((4.0 / 2**1.5, 4.0 / 2**0.5, 4.0 * 2**0.5, 4.0 * 2**1.5))
    assert bandwidth_ladder(3.0, 1) == (3.0,)
    assert math.prod(ladder) == pytest.approx(4.0**4)  # centred on the base (geometric mean)


# ----------------------------------------------------------------------------------------- e-NTK


def autograd_features(network: nn.Sequential, inputs: torch.Tensor) -> torch.Tensor:
    """The definition, by per-example backprop: grad_theta sum_k f_k(x_i), flattened, normalised."""
    network = network.requires_grad_(True)
    rows = []
    for example in inputs:
        network.zero_grad()
        network(example.reshape(1, -1)).sum().backward()
        gradient = torch.cat([p.grad.reshape(-1) for p in network.parameters()])
        rows.append(gradient / gradient.norm())
    network.requires_grad_(False)
    return torch.stack(rows)


@pytest.mark.parametrize("builder", [lambda: fc_1l(12, 3, width=7, seed=0), lambda: fc_2l(12, 4, (5, 6), seed=1)])
def test_closed_form_ntk_features_equal_autograd_per_example_gradients(builder):
    torch.set_default_dtype(torch.float64)  # compare to 1e-10, not float32 rounding
    try:
        network = builder()
        inputs = torch.randn(9, 3, 2, 2, generator=torch.Generator().manual_seed(5))
        closed = NTKFeatures(network)(inputs)
        expected = autograd_features(network, inputs)
    finally:
        torch.set_default_dtype(torch.float32)
    assert closed.shape == (9, sum(p.numel() for p in network.parameters()))
    assert torch.allclose(closed, expected, atol=1e-10)
    assert torch.allclose(closed.norm(dim=1), torch.ones(9, dtype=torch.float64))


def test_ntk_class_sums_equal_the_sums_of_materialised_features_and_are_differentiable():
    features = NTKFeatures(fc_1l(10, 4, width=16, seed=2))
    inputs = torch.randn(13, 10, requires_grad=True)
    labels = torch.tensor([0, 1, 1, 3, 3, 3, 0, 1, 3, 3, 0, 0, 1])  # class 2 empty
    rows = features(inputs)
    expected = torch.zeros(4, features.dim).index_add(0, labels, rows)
    sums = features.class_sums(inputs, labels, 4)
    assert torch.allclose(sums, expected, atol=1e-5)
    assert torch.equal(sums[2], torch.zeros(features.dim))
    means, present = class_feature_means(features, inputs, labels, 4)
    assert present.tolist() == [True, True, False, True]
    (means**2).sum().backward()  # the generator side trains through it
    assert inputs.grad is not None and torch.isfinite(inputs.grad).all() and inputs.grad.abs().sum() > 0


def test_ntk_zero_gradient_gives_a_zero_feature_not_nan():
    network = nn.Sequential(nn.Linear(3, 4, bias=False), nn.ReLU(), nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        network[0].weight.fill_(-1.0)  # every pre-activation of a positive input is negative: all ReLUs off
    rows = NTKFeatures(network)(torch.rand(2, 3) + 0.1)
    assert torch.equal(rows, torch.zeros(2, 4 * 3 + 2 * 4))  # within the bound B = 1, and finite
    other = NTKFeatures(network)(-torch.rand(2, 3) - 0.1)  # ReLUs on: an ordinary unit-norm feature
    assert torch.allclose(other.norm(dim=1), torch.ones(2))


def test_ntk_network_is_checked_and_seeded_publicly():
    with pytest.raises(ConfigError):
        NTKFeatures(nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1)))
    with pytest.raises(ConfigError):
        NTKFeatures(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1)))  # affine LayerNorm
    first, second = fc_1l(5, 2, width=3, seed=9), fc_1l(5, 2, width=3, seed=9)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert not any(p.requires_grad for p in first.parameters())


# -------------------------------------------------------------------------- into the bounded-sum release


@pytest.mark.parametrize(
    "make", [lambda: RandomFourierFeatures(16, 64, 2.0, seed=0), lambda: NTKFeatures(fc_1l(16, 3, 8))]
)
def test_feature_chunks_feed_the_release_and_need_no_clipping(make):
    feature_map = make()
    images = torch.randn(40, 1, 4, 4)
    labels = torch.arange(40) % 3
    query = BoundedSum("embedding", feature_map.bound, 1.0, num_classes=3, denominator=40.0)
    release = release_bounded_sum(
        feature_chunks(feature_map, images, labels, batch_size=16),
        feature_map.dim,
        query,
        PrivacyLedger(50.0, 1e-5),
        NoiseSource(seed=1),
    )
    exact = torch.zeros(3, feature_map.dim, dtype=torch.float64).index_add(0, labels, feature_map(images).double())
    noise = NoiseSource(seed=1).normal((3 * feature_map.dim,), std=1.0, dtype=torch.float64).reshape(3, -1)
    assert torch.allclose(release.sums, exact + noise, atol=1e-5)  # unit-norm rows pass the clip unchanged
