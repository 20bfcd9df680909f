"""The NCSN RefineNet score network of DPPM (Fig. 4a): presets, shapes, per-example independence."""

from __future__ import annotations

import pytest
import torch

from dpsynth.diffusion.score_matching import geometric_sigmas
from dpsynth.dpsgd.engine import reject_cross_example_layers
from dpsynth.errors import ConfigError
from dpsynth.models.refinenet import RefineNet, RefineNetConfig, build_refinenet

SIGMAS = geometric_sigmas(1.0, 0.01, 10)


@pytest.mark.parametrize("preset,low,high", [("cpu", 1.5e6, 2.5e6), ("paper", 25e6, 35e6)])
def test_presets_have_the_documented_size(preset, low, high):
    model = build_refinenet(preset, 3, SIGMAS)
    assert low < sum(p.numel() for p in model.parameters()) < high
    reject_cross_example_layers(model)  # no BatchNorm, no running statistics


@pytest.mark.parametrize("shape", [(1, 29, 28), (3, 17, 16)])
def test_output_has_the_input_shape_for_odd_sizes(shape):
    model = RefineNet(RefineNetConfig(channels=shape[0], num_levels=10, width=4), SIGMAS)
    x = torch.randn(3, *shape)
    assert model(x, torch.tensor([0, 4, 9])).shape == x.shape


def test_examples_do_not_influence_each_other_and_the_level_matters():
    torch.manual_seed(0)
    model = RefineNet(RefineNetConfig(channels=1, num_levels=10, width=4), SIGMAS)
    x = torch.randn(4, 1, 12, 12)
    levels = torch.tensor([0, 1, 2, 3])
    together = model(x, levels)
    alone = torch.cat([model(x[i : i + 1], levels[i : i + 1]) for i in range(4)])
    assert torch.allclose(together, alone, rtol=1e-4, atol=1e-4)
    changed = model(x[:1], torch.tensor([5]))
    assert not torch.allclose(changed, together[:1])


def test_output_is_divided_by_sigma():
    torch.manual_seed(1)
    model = RefineNet(RefineNetConfig(channels=1, num_levels=10, width=4), SIGMAS)
    with torch.no_grad():  # make the levels share their normalisation so only 1/σ differs
        for module in model.modules():
            if hasattr(module, "gamma"):
                module.gamma.copy_(module.gamma[:1].expand_as(module.gamma))
                module.alpha.copy_(module.alpha[:1].expand_as(module.alpha))
    x = torch.randn(1, 1, 8, 8)
    ratio = model(x, torch.tensor([9])) / model(x, torch.tensor([0]))
    assert torch.allclose(ratio, torch.full_like(ratio, float(SIGMAS[0] / SIGMAS[9])), rtol=1e-4)


def test_bad_preset_and_level_count_are_config_errors():
    with pytest.raises(ConfigError, match="preset"):
        build_refinenet("huge", 1, SIGMAS)
    with pytest.raises(ConfigError, match="noise levels"):
        RefineNet(RefineNetConfig(channels=1, num_levels=3, width=4), SIGMAS)
