"""The public length-scale rule DP-MERF and DP-Kernel share (dpsynth.kernels.bandwidths): what each rule reads,
that it is reproducible from a public seed, and the settings refused at load."""

from __future__ import annotations

import math

import pytest
import torch

from dpsynth.data import load_public
from dpsynth.errors import ConfigError
from dpsynth.kernels.bandwidths import RandomFeatureSection, public_bandwidths
from dpsynth.methods.dp_kernel import DPKernelSection
from dpsynth.methods.dp_merf import DPMerfConfig

SHAPE = (1, 28, 28)


def test_both_random_feature_methods_state_the_rule_once():
    assert issubclass(DPMerfConfig, RandomFeatureSection) and issubclass(DPKernelSection, RandomFeatureSection)
    assert DPMerfConfig().rule == DPKernelSection().rule == "noise-median"
    assert DPMerfConfig().median_scale == DPKernelSection().median_scale == 0.25


def test_noise_median_depends_on_the_image_shape_only():
    """Uniform-noise images in [-1, 1]: the median distance is about sqrt(2 d / 3), whatever the data; the ladder
    is centred on median_scale x median with num_bandwidths lengths a factor bandwidth_ratio apart."""
    section = RandomFeatureSection(median_points=400)
    lengths = public_bandwidths(section, SHAPE, None, 3, "m")
    assert len(lengths) == 4
    assert all(b / a == pytest.approx(2.0) for a, b in zip(lengths, lengths[1:]))
    centre = math.sqrt(lengths[1] * lengths[2])
    assert centre == pytest.approx(section.median_scale * math.sqrt(2 * 784 / 3), rel=0.02)
    assert public_bandwidths(section, SHAPE, None, 3, "m") == lengths  # a public seed: reproducible


def test_fixed_lengths_are_used_as_given_and_public_median_reads_the_public_set():
    fixed = RandomFeatureSection(bandwidths=[20.49])  # rule null: fixed, since lengths are given
    assert fixed.rule == "fixed" and public_bandwidths(fixed, SHAPE, None, 0, "m") == (20.49,)
    public = load_public("glyphs-digits", max_size=300)
    section = RandomFeatureSection(
        bandwidth_rule="public-median", num_bandwidths=1, median_scale=1.0, median_points=300
    )
    assert section.public_use() == "required" and fixed.public_use() == "none"
    (length,) = public_bandwidths(section, public.image_shape, public, 0, "m")
    images = public.to_tensors()[0].reshape(len(public), -1).double()
    assert length == pytest.approx(float(torch.pdist(images).median()), rel=1e-9)
    with pytest.raises(ConfigError, match="m: bandwidth_rule 'public-median' needs data.public"):
        public_bandwidths(section, SHAPE, None, 0, "m")
    with pytest.raises(ConfigError, match="differ from the private"):
        public_bandwidths(section, (3, 28, 28), public, 0, "m")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"num_features": 201}, "even"),
        ({"bandwidth_rule": "fixed"}, "needs bandwidths"),
        ({"bandwidth_rule": "noise-median", "bandwidths": [4.0, 8.0]}, "use 'fixed'"),
        ({"bandwidths": [4.0, -1.0]}, "> 0"),
        ({"bandwidths": [4.0, float("inf")]}, "finite"),
        ({"num_features": 6, "num_bandwidths": 4}, "cannot cover 4"),
        ({"num_features": 4, "bandwidths": [1.0, 2.0, 3.0]}, "cannot cover 3"),
    ],
)
def test_bad_settings_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        RandomFeatureSection(**values)
