"""DP-MERF's small conditional generator: the paper's MNIST size, shapes, pixel range, public seeding."""

from __future__ import annotations

import pytest
import torch

from dpsynth.errors import ConfigError
from dpsynth.models.merf_generator import MerfGenerator, build_merf_generator


def test_the_paper_sizes_give_a_017m_parameter_mnist_generator():
    generator = MerfGenerator(num_classes=10, channels=1, image_size=28)
    count = sum(p.numel() for p in generator.parameters())
    assert 160_000 < count < 175_000  # DP-MERF's ~0.17M-parameter generator (code 5, FC 200, 16/8, 5/5)


@pytest.mark.parametrize("channels, side", [(1, 28), (3, 32), (1, 8)])
def test_images_have_the_right_shape_and_lie_in_minus_one_one(channels, side):
    generator = MerfGenerator(num_classes=4, channels=channels, image_size=side)
    images = generator(torch.randn(6, generator.z_dim) * 10, torch.tensor([0, 1, 2, 3, 0, 1])).detach()
    assert images.shape == (6, channels, side, side)
    assert float(images.min()) >= -1.0 and float(images.max()) <= 1.0


def test_labels_condition_the_output():
    generator = MerfGenerator(num_classes=3, channels=1, image_size=8).eval()
    z = torch.randn(1, generator.z_dim).repeat(3, 1)
    images = generator(z, torch.tensor([0, 1, 2]))
    assert not torch.allclose(images[0], images[1])


def test_build_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = build_merf_generator(10, 1, 28, seed=5)
    assert torch.equal(torch.rand(1), expected_next)
    second = build_merf_generator(10, 1, 28, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    other = build_merf_generator(10, 1, 28, seed=6)
    assert not torch.equal(first.fc1.weight, other.fc1.weight)


@pytest.mark.parametrize("settings", [{"image_size": 30}, {"image_size": 28, "kernel_sizes": (4, 5)}])
def test_bad_sizes_are_refused(settings):
    with pytest.raises(ConfigError):
        MerfGenerator(num_classes=2, channels=1, **settings)
