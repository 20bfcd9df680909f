"""Feature-statistics inversion (DP-ImgSyn, TMLR 2024): GroupNorm statistics, their DP release, the alignment
optimisation (Algorithm 1) and the soft-label release, on toy GroupNorm networks."""

import numpy as np
import pytest
import torch
from torch import nn

from dpsynth.errors import ConfigError
from dpsynth.inversion.alignment import (
    ReleaseSection,
    SynthesisSection,
    align_batch,
    gaussian_blur,
    soft_label_release,
    total_variation,
)
from dpsynth.inversion.feature_stats import (
    FeatureStatistics,
    GroupNormInputs,
    batch_statistics,
    feature_loss,
    per_example_moments,
)
from dpsynth.inversion.statistics import StatsSection, private_moment_release, statistics_query
from dpsynth.privacy import Gaussian, PrivacyLedger, SubsampledGaussian
from dpsynth.privacy.bounded_sum import clip_to_bound, poisson_sample
from dpsynth.privacy.rng import NoiseSource
from dpsynth.report.balance import balanced_labels

#: the ledger name the statistics release is charged under in these tests
STATS = "statistics"


def tiny_gn_net(scale: float = 1.0, classes: int = 3, seed: int = 0) -> nn.Module:
    """A two-GroupNorm toy classifier (a real network, small enough for unit tests)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.GroupNorm(3, 6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, classes),
    )
    with torch.no_grad():
        net[0].weight.mul_(scale)
    return net.eval()


def moments_of(net: nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), GroupNormInputs(net) as captured:
        net(images)
        return per_example_moments(captured.captured())


def test_hooks_capture_every_groupnorm_input_in_order():
    net = tiny_gn_net()
    images = torch.randn(5, 1, 6, 6)
    with torch.no_grad(), GroupNormInputs(net) as captured:
        net(images)
        inputs = captured.captured()
        assert captured.channels == [4, 6]
    assert torch.allclose(inputs[0], net[0](images))
    assert inputs[1].shape == (5, 6, 6, 6)
    assert not net[1]._forward_pre_hooks  # hooks removed on exit


def test_mean_of_per_example_moments_gives_the_batch_statistics():
    """Averaging per-example (mean, second moment) rows recovers BatchNorm-style mean and variance."""
    net = tiny_gn_net()
    images = torch.randn(7, 1, 5, 5)
    with torch.no_grad(), GroupNormInputs(net) as captured:
        net(images)
        inputs = captured.captured()
        rows = per_example_moments(inputs)
        direct = batch_statistics(inputs)
    assert rows.shape == (7, 2 * (4 + 6))
    recovered = FeatureStatistics.from_moments(rows.mean(0).double(), [4, 6], min_variance=0.0)
    for (mean, var), (rmean, rvar) in zip(direct, recovered):
        assert torch.allclose(mean.double(), rmean, atol=1e-5)
        assert torch.allclose(var.double(), rvar, atol=1e-5)
    assert float(feature_loss(inputs, recovered.to("cpu"))) == pytest.approx(0.0, abs=1e-8)


def test_negative_noisy_variance_is_clamped():
    moments = torch.tensor([1.0, 0.5])  # one channel: mean 1, E[x^2] 0.5 -> variance -0.5
    stats = FeatureStatistics.from_moments(moments, [1], min_variance=1e-3)
    assert float(stats.variances[0]) == pytest.approx(1e-3)


def released_vector(released, query) -> torch.Tensor:
    """What one statistics release publishes: ``[sums, w * counts]``."""
    return torch.cat([released.sums.flatten(), query.count_weight * released.counts])


def reader(images: torch.Tensor, seen: list | None = None):
    def read(indices):
        if seen is not None:
            seen.extend(int(i) for i in indices)
        return images[torch.as_tensor(indices)]

    return read


def test_statistics_sensitivity_is_at_most_c_for_many_neighbours():
    """Same seeded noise on neighbouring datasets: the released [sum, w*count] vectors differ by at most the
    query's sensitivity sqrt(C^2 + w^2), and the sums alone by at most C."""
    generator = torch.Generator().manual_seed(0)
    for case in range(30):
        net = tiny_gn_net(scale=10.0 ** (case % 4 - 1), seed=case)
        n = 2 + case % 6
        images = torch.randn(n, 1, 4, 4, generator=generator) * (1 + case % 3)
        clip = 0.1 + float(torch.rand((), generator=generator)) * 2
        query = statistics_query(
            StatsSection(noise_multiplier=1.0, count_noise_multiplier=1.0 + case % 3), clip, name=STATS
        )
        removed = int(torch.randint(n, (1,), generator=generator))
        neighbour = torch.cat([images[:removed], images[removed + 1 :]])
        ledger = PrivacyLedger(target_epsilon=1000.0, delta=1e-5)
        full = private_moment_release(net, n, reader(images), query, ledger, NoiseSource(seed=case), batch_size=3)
        less = private_moment_release(
            net, n - 1, reader(neighbour), query, ledger, NoiseSource(seed=case), batch_size=3
        )
        moved = released_vector(full, query) - released_vector(less, query)
        assert float(moved.norm()) <= query.sensitivity * (1 + 1e-4)
        assert float((full.sums - less.sums).norm()) <= clip * (1 + 1e-4)


def test_statistics_release_is_noisy_and_charged():
    """The sum carries noise sigma_s*C and the count sigma_c, one Gaussian whose multiplier is the two composed."""
    net = tiny_gn_net()
    images = torch.randn(40, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    clip, sigma_sum, sigma_count = 1.0, 3.0, 4.0
    query = statistics_query(
        StatsSection(noise_multiplier=sigma_sum, count_noise_multiplier=sigma_count), clip, name=STATS
    )
    assert query.noise_std == pytest.approx(sigma_sum * clip)
    assert query.noise_std / query.count_weight == pytest.approx(sigma_count)
    ledger = PrivacyLedger(target_epsilon=50.0, delta=1e-5)
    released = private_moment_release(net, 40, reader(images), query, ledger, NoiseSource(seed=7))
    exact = torch.cat([clip_to_bound(moments_of(net, images).double(), clip).sum(0), torch.tensor([40.0])])
    residual = torch.cat([released.sums[0], released.counts]) - exact
    assert float(residual.abs().max()) > 0.1  # the noise is there
    expected = NoiseSource(seed=7).normal((len(exact),), std=sigma_sum * clip, dtype=torch.float64)
    expected[-1] *= sigma_count / sigma_sum  # the count's coordinate is released as w*count
    assert torch.allclose(residual, expected, atol=1e-4)
    (charged,) = ledger.mechanisms()
    assert charged.name == STATS and charged.count == 1
    assert charged.noise_multiplier == pytest.approx((sigma_sum**-2 + sigma_count**-2) ** -0.5)


def test_joint_statistics_release_costs_what_the_two_gaussians_cost():
    """One Gaussian on [sum, w*count] is the sum's and the count's Gaussians composed: the same epsilon."""
    stats = StatsSection(noise_multiplier=10.0, count_noise_multiplier=20.0)
    joint = PrivacyLedger(target_epsilon=100.0, delta=1e-5)
    joint.charge(statistics_query(stats, clip_norm=0.7, name=STATS).mechanism(1))
    apart = PrivacyLedger(target_epsilon=100.0, delta=1e-5)
    apart.charge(Gaussian("sum", 10.0))
    apart.charge(Gaussian("count", 20.0))
    assert joint.epsilon() == pytest.approx(apart.epsilon(), rel=1e-3)


def test_subsampled_statistics_read_only_the_poisson_sample_and_are_accounted_once():
    """With sample_rate q the release reads the records the noise source's coins keep (never the others),
    divides by their noisy count, and the ledger holds one subsampled Gaussian at rate q."""
    net = tiny_gn_net()
    images = torch.randn(200, 1, 4, 4, generator=torch.Generator().manual_seed(2))
    query = statistics_query(
        StatsSection(noise_multiplier=2.0, count_noise_multiplier=2.0, sample_rate=0.25), 1.0, name=STATS
    )
    ledger = PrivacyLedger(target_epsilon=50.0, delta=1e-5)
    seen: list[int] = []
    released = private_moment_release(net, 200, reader(images, seen), query, ledger, NoiseSource(seed=3))
    kept = poisson_sample(200, 0.25, NoiseSource(seed=3)).tolist()
    assert seen == kept and 20 < len(kept) < 90
    assert abs(float(released.counts[0]) - len(kept)) < 5 * 2.0  # the count is of the sample, not of N
    (charged,) = ledger.mechanisms()
    assert isinstance(charged, SubsampledGaussian) and (charged.sample_rate, charged.steps) == (0.25, 1)
    assert charged.noise_multiplier == pytest.approx(2.0 / 2**0.5)


def test_alignment_reduces_the_feature_loss():
    net = tiny_gn_net()
    for parameter in net.parameters():
        parameter.requires_grad_(False)
    # target: statistics of brighter, smoother images than the starting batch
    target_images = 0.5 + 0.2 * torch.randn(32, 1, 6, 6, generator=torch.Generator().manual_seed(2))
    target = FeatureStatistics.from_moments(moments_of(net, target_images).mean(0), [4, 6])
    start = torch.randn(12, 1, 6, 6, generator=torch.Generator().manual_seed(3)).clamp(-1, 1)
    targets = torch.from_numpy(balanced_labels(12, 3))
    synthesis = SynthesisSection(iterations=40, lr=0.05)
    aligned, history = align_batch(net, target, start, targets, synthesis)
    assert len(history) == 40
    assert history[-1]["feature"] < 0.3 * history[0]["feature"]
    assert float(aligned.abs().max()) <= 1.0
    assert not torch.allclose(aligned, start)


def test_zero_iterations_keep_the_initial_images():
    net = tiny_gn_net()
    start = torch.rand(4, 1, 6, 6) * 2 - 1
    target = FeatureStatistics.from_moments(moments_of(net, start).mean(0), [4, 6])
    aligned, history = align_batch(
        net, target, start, torch.from_numpy(balanced_labels(4, 3)), SynthesisSection(iterations=0)
    )
    assert history == [] and torch.equal(aligned, start)


def test_early_stopping_on_rising_total_variation():
    net = tiny_gn_net()
    for parameter in net.parameters():
        parameter.requires_grad_(False)
    smooth = torch.zeros(6, 1, 6, 6)  # TV can only rise from a constant image
    target = FeatureStatistics.from_moments(moments_of(net, torch.randn(16, 1, 6, 6)).mean(0), [4, 6])
    synthesis = SynthesisSection(iterations=50, early_stop_patience=2, alpha_tv=0.0)
    _, history = align_batch(net, target, smooth, torch.from_numpy(balanced_labels(6, 3)), synthesis)
    assert len(history) < 50


def test_gaussian_blur_is_a_low_pass_filter():
    noise = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(4))
    blurred = gaussian_blur(noise, 5)
    assert blurred.shape == noise.shape
    assert float(total_variation(blurred)) < 0.5 * float(total_variation(noise))
    constant = torch.full((1, 1, 8, 8), 0.3)
    assert torch.allclose(gaussian_blur(constant, 3), constant, atol=1e-6)  # preserves DC
    with pytest.raises(ConfigError):
        gaussian_blur(noise, 4)


def test_release_labels_soft_labels_and_quantisation():
    net = tiny_gn_net()
    images = torch.rand(9, 1, 6, 6) * 2 - 1
    targets = torch.from_numpy(balanced_labels(9, 3))
    samples = soft_label_release(
        net, images, targets, ReleaseSection(temperature=2.0, labels="teacher"), torch.device("cpu")
    )
    assert samples.images.dtype == np.uint8 and samples.images.shape == (9, 6, 6, 1)
    assert np.allclose(samples.soft_labels.sum(1), 1.0, atol=1e-5)
    assert np.array_equal(samples.labels, samples.soft_labels.argmax(1))
    quantised = torch.from_numpy(samples.images).permute(0, 3, 1, 2).float() / 127.5 - 1
    with torch.no_grad():
        expected = torch.softmax(net(quantised) / 2.0, 1).numpy()
    assert np.allclose(samples.soft_labels, expected, atol=1e-5)  # labels belong to the released pixels
    by_target = soft_label_release(
        net, images, targets, ReleaseSection(temperature=1.0, labels="target"), torch.device("cpu")
    )
    assert np.array_equal(by_target.labels, targets.numpy())
