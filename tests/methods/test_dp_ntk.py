"""DP-NTK: the method contract, its config rules and its e-NTK feature map (the release itself is tested for
both mean-embedding methods in tests/kernels/test_mean_embedding_method.py)."""

from __future__ import annotations

import pytest
import torch

from dpsynth.api import Synthesizer
from dpsynth.errors import ConfigError
from dpsynth.kernels import NTKFeatures, fc_1l
from dpsynth.methods.dp_ntk import UnitRangeInputs
from dpsynth.testing import MethodContractTests


class TestDPNTKContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dp-ntk/smoke`` preset."""

    method = "dp-ntk"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dp-ntk.network": "fc_2l"}, "2 hidden width"),
        ({"dp-ntk.widths": [32, 256]}, "1 hidden width"),
        ({"dp-ntk.network": "conv"}, "dp-ntk.network"),
        ({"dp-ntk.denominator": "realised-counts"}, "dp-ntk.denominator"),
    ],
)
def test_bad_settings_fail_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Synthesizer.from_config("dp-ntk/smoke", overrides)


def test_pixels_enter_the_network_in_the_unit_range_and_features_keep_norm_one():
    inner = NTKFeatures(fc_1l(16, 3, width=8, seed=0))
    features = UnitRangeInputs(inner)
    x = torch.rand(5, 1, 4, 4) * 2 - 1
    assert torch.allclose(features(x), inner((x + 1) / 2))
    assert torch.allclose(features(x).norm(dim=1), torch.ones(5), atol=1e-5)
    labels = torch.tensor([0, 2, 2, 1, 0])
    onehot = torch.nn.functional.one_hot(labels, 3).float()
    assert torch.allclose(features.class_sums(x, labels, 3), onehot.T @ features(x), atol=1e-5)
    assert features.dim == inner.dim and features.bound == 1.0
