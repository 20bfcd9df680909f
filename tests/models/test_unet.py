"""UNet: presets, shapes, conditioning, and per-example gradients under torch.func."""

import pytest
import torch
from conftest import TINY_UNET as TINY
from conftest import randomize
from torch import nn
from torch.func import functional_call, grad, vmap

from dpsynth.errors import ConfigError
from dpsynth.models.unet import (
    PRESET_NOMINAL_PARAMETERS,
    UNET_PRESETS,
    UNet,
    UNetConfig,
    build_unet,
    count_parameters,
)


@pytest.mark.parametrize("name", sorted(UNET_PRESETS))
def test_preset_parameter_counts_within_20_percent(name):
    with torch.device("meta"):  # count without allocating the 80M model
        model = build_unet(name, image_size=32, channels=3, num_classes=10)
    nominal = PRESET_NOMINAL_PARAMETERS[name]
    assert 0.8 * nominal <= count_parameters(model) <= 1.2 * nominal


def test_preset_names_are_case_insensitive_and_unknown_ones_rejected():
    with torch.device("meta"):
        assert build_unet("4M", 32, 3, 10).config == UNET_PRESETS["4m"]
        assert build_unet("unet-0.8m", 28, 1, 10).config == UNET_PRESETS["0.8m"]
    with pytest.raises(ConfigError):
        build_unet("3m", 32, 3, 10)
    with pytest.raises(ConfigError):
        build_unet({"base_channels": 8, "widths": 3}, 32, 3, 10)


def test_dict_config_with_preset_base_and_attention_resolutions():
    with torch.device("meta"):
        model = build_unet({"preset": "4m", "num_res_blocks": 2, "attention_resolutions": [14, 7]}, 28, 1, 10)
    assert model.config.base_channels == 64 and model.config.num_res_blocks == 2
    assert model.config.attention_levels == (1, 2)  # 28 → 14 → 7


def test_no_batchnorm_and_groupnorm_present():
    model = build_unet("0.8m", 28, 1, 10)
    kinds = {type(m) for m in model.modules()}
    assert nn.GroupNorm in kinds
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_an_input_the_levels_would_halve_to_1x1_is_refused_when_the_model_is_built():
    three_levels = dict(TINY, channel_mult=(1, 2, 2))
    with torch.device("meta"):
        build_unet(three_levels, 5, 1, 10)  # 5 -> 3 -> 2
        with pytest.raises(ConfigError, match=r"4x4 input 2 time\(s\) to 1x1.*at least 5.*data\.image_size"):
            build_unet(three_levels, 4, 1, 10)


@pytest.mark.parametrize("image_size", [16, 28, 7])
def test_output_shape_including_odd_sizes_and_learned_sigma(image_size):
    model = randomize(build_unet(dict(TINY, channel_mult=(1, 2, 2)), image_size, 3, 5, learn_sigma=True))
    x = torch.randn(2, 3, image_size, image_size)
    out = model(x, torch.tensor([0, 999]), torch.tensor([1, 5]))
    assert out.shape == (2, 6, image_size, image_size)
    assert torch.isfinite(out).all()


def test_class_and_time_conditioning_change_the_output():
    model = randomize(build_unet(TINY, 8, 1, 3))
    x = torch.randn(1, 1, 8, 8)
    base = model(x, torch.tensor([10]), torch.tensor([0]))
    assert not torch.allclose(base, model(x, torch.tensor([10]), torch.tensor([1])))
    assert not torch.allclose(base, model(x, torch.tensor([500]), torch.tensor([0])))
    # y=None is the null class (index num_classes).
    assert torch.allclose(model(x, torch.tensor([10]), None), model(x, torch.tensor([10]), torch.tensor([3])))


def test_examples_do_not_interact():
    """GroupNorm and attention act within an example: a batch equals its rows run one at a time."""
    model = randomize(build_unet(TINY, 8, 1, 3))
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([1, 400, 900]), torch.tensor([0, 1, 2])
    rows = torch.cat([model(x[i : i + 1], t[i : i + 1], y[i : i + 1]) for i in range(3)])
    assert torch.allclose(model(x, t, y), rows, atol=1e-5)


def _per_example_loss(model, params, x, t, y):
    out = functional_call(model, params, (x.unsqueeze(0), t.unsqueeze(0), y.unsqueeze(0)))
    return (out**2).mean()


def test_vmap_grad_matches_per_example_autograd():
    model = randomize(build_unet(TINY, 8, 1, 3, learn_sigma=True))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([3, 300, 999]), torch.tensor([0, 2, 3])

    def loss(p, xi, ti, yi):
        return _per_example_loss(model, p, xi, ti, yi)

    batched = vmap(grad(loss), in_dims=(None, 0, 0, 0))(params, x, t, y)
    for i in range(3):
        model.zero_grad()
        (model(x[i : i + 1], t[i : i + 1], y[i : i + 1]) ** 2).mean().backward()
        for name, parameter in model.named_parameters():
            assert torch.allclose(batched[name][i], parameter.grad, atol=1e-6, rtol=1e-4), name


def test_dropout_acts_in_training_only_and_p0_equals_eval():
    model = randomize(build_unet(dict(TINY, dropout=0.5), 8, 1, 3))
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([3, 30]), torch.tensor([0, 1])
    with torch.no_grad():
        model.train()
        first, second = model(x, t, y), model(x, t, y)
        assert not torch.allclose(first, second)  # a fresh mask each call
        model.eval()
        deterministic = model(x, t, y)
        assert torch.equal(deterministic, model(x, t, y))
        assert not torch.allclose(first, deterministic)
        no_dropout = build_unet(dict(TINY, dropout=0.0), 8, 1, 3)
        no_dropout.load_state_dict(model.state_dict())
        assert torch.allclose(no_dropout.train()(x, t, y), deterministic, atol=1e-6)


def test_dropout_under_vmap_draws_a_different_mask_per_example():
    model = randomize(build_unet(dict(TINY, dropout=0.5), 8, 1, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, t, y = torch.randn(1, 1, 8, 8).repeat(2, 1, 1, 1), torch.tensor([30, 30]), torch.tensor([1, 1])

    def per_example_grads():
        return vmap(
            grad(lambda p, a, b, c: _per_example_loss(model, p, a, b, c)),
            in_dims=(None, 0, 0, 0),
            randomness="different",
        )(params, x, t, y)

    trained = per_example_grads()  # model.train(): two identical examples, two masks
    assert all(torch.isfinite(g).all() for g in trained.values())
    assert any(not torch.allclose(g[0], g[1]) for g in trained.values())
    model.eval()
    evaluated = per_example_grads()
    assert all(torch.allclose(g[0], g[1]) for g in evaluated.values())


def test_unconditional_model():
    model = randomize(UNet(UNetConfig(**TINY), in_channels=1, num_classes=0))
    assert model.class_embedding is None
    assert model(torch.randn(2, 1, 8, 8), torch.tensor([1, 2])).shape == (2, 1, 8, 8)
