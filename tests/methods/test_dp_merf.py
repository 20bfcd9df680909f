"""DP-MERF: the method contract, its config rules and its public bandwidth rules (the release itself is tested
for both mean-embedding methods in tests/kernels/test_mean_embedding_method.py)."""

from __future__ import annotations

import math

import pytest
import torch

from dpsynth.api import Synthesizer
from dpsynth.data import load_public
from dpsynth.errors import ConfigError
from dpsynth.methods.dp_merf import DPMerfConfig, public_bandwidths
from dpsynth.testing import MethodContractTests


class TestDPMerfContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dp-merf/smoke`` preset."""

    method = "dp-merf"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dp-merf.num_features": 201}, "even"),
        ({"dp-merf.bandwidth_rule": "fixed"}, "needs bandwidths"),
        ({"dp-merf.bandwidths": [4.0, 8.0]}, "use 'fixed'"),
        ({"dp-merf.bandwidth_rule": "fixed", "dp-merf.bandwidths": [4.0, -1.0]}, "> 0"),
        ({"dp-merf.denominator": "realised-counts"}, "dp-merf.denominator"),
        ({"dp-merf.count_weight": 0}, "dp-merf.count_weight"),
    ],
)
def test_bad_settings_fail_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Synthesizer.from_config("dp-merf/smoke", overrides)


def test_public_median_needs_public_data_at_load():
    with pytest.raises(ConfigError, match="public"):
        Synthesizer.from_config("dp-merf/smoke", {"dp-merf.bandwidth_rule": "public-median"})


def test_noise_median_depends_on_the_image_shape_only():
    """Uniform-noise images in [-1, 1]: the median distance is about sqrt(2 d / 3), whatever the data; the ladder
    is centred on median_scale x median with num_bandwidths lengths a factor bandwidth_ratio apart."""
    section = DPMerfConfig(median_points=400)
    lengths = public_bandwidths(section, (1, 28, 28), None, seed=3)
    assert len(lengths) == 4
    assert all(b / a == pytest.approx(2.0) for a, b in zip(lengths, lengths[1:]))
    centre = math.sqrt(lengths[1] * lengths[2])
    assert centre == pytest.approx(section.median_scale * math.sqrt(2 * 784 / 3), rel=0.02)
    assert public_bandwidths(section, (1, 28, 28), None, seed=3) == lengths  # a public seed: reproducible


def test_fixed_lengths_are_used_as_given_and_public_median_reads_the_public_set():
    fixed = DPMerfConfig(bandwidth_rule="fixed", bandwidths=[20.49])
    assert public_bandwidths(fixed, (1, 28, 28), None, seed=0) == (20.49,)
    public = load_public("glyphs-digits", max_size=300)
    section = DPMerfConfig(bandwidth_rule="public-median", num_bandwidths=1, median_scale=1.0, median_points=300)
    (length,) = public_bandwidths(section, public.image_shape, public, seed=0)
    images = public.to_tensors()[0].reshape(len(public), -1).double()
    assert length == pytest.approx(float(torch.pdist(images).median()), rel=1e-9)
    with pytest.raises(ConfigError, match="data.public"):
        public_bandwidths(section, (1, 28, 28), None, seed=0)
