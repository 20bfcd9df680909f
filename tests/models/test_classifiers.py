"""Classifiers: every name and preset builds, runs, has GroupNorm only, and works under vmap(grad)."""

import pytest
import torch
from torch.func import functional_call, grad, vmap

from dpsynth.errors import ConfigError
from dpsynth.models.classifiers import build_classifier, count_parameters, list_classifiers


@pytest.mark.parametrize("name", list_classifiers())
def test_cpu_preset_forward_and_no_batchnorm(name):
    model = build_classifier(name, in_channels=1, num_classes=10, image_size=28, preset="cpu")
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name", list_classifiers())
def test_per_example_gradients_with_vmap(name):
    model = build_classifier(name, in_channels=3, num_classes=4, image_size=16, preset="cpu")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    x, y = torch.randn(2, 3, 16, 16), torch.tensor([0, 3])
    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    # The vmap gradient of example 0 equals the ordinary autograd gradient of example 0 alone.
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()
    for key, param in model.named_parameters():
        torch.testing.assert_close(per_example[key][0], param.grad, rtol=1e-4, atol=1e-5)


def test_paper_sizes_and_the_1_1m_benchmark_model():
    assert abs(count_parameters(build_classifier("cnn-1.1m", 1, 10, 28)) - 1.1e6) < 0.05e6
    assert abs(count_parameters(build_classifier("cnn-1.1m", 3, 10, 32)) - 1.1e6) < 0.05e6
    wrn = count_parameters(build_classifier("wrn-40-4", 3, 10, 32, preset="gpu"))
    assert 8.5e6 < wrn < 9.5e6  # WRN-40-4 has ~8.9M parameters
    resnet18 = count_parameters(build_classifier("resnet18", 3, 10, 32, preset="gpu"))
    assert 11e6 < resnet18 < 11.3e6  # ResNet-18: ~11.2M
    assert count_parameters(build_classifier("resnet", 3, 10, 32, preset="gpu")) < 0.3e6  # ResNet-20: 0.27M


def test_bad_requests_raise_config_errors():
    with pytest.raises(ConfigError, match="unknown classifier"):
        build_classifier("vgg", 1, 10, 28)
    with pytest.raises(ConfigError, match="preset"):
        build_classifier("cnn", 1, 10, 28, preset="tpu")
