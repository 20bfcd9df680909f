"""Moment matching (post-processing): the trainer lowers the MMD to a released target, the generated
class means approach a toy target, it is deterministic from its public seed, labels are uniform and
public, and a per-step target callable (DP-Kernel) is asked once per step."""

from __future__ import annotations

import pytest
import torch

from dpsynth.errors import ConfigError
from dpsynth.kernels import (
    MomentMatchingSettings,
    RandomFourierFeatures,
    class_feature_means,
    moment_matching_loss,
    train_moment_matching,
)
from dpsynth.models.gan import sample_conditional
from dpsynth.models.merf_generator import build_merf_generator
from dpsynth.report.balance import balanced_labels

CLASSES, SIDE = 3, 8


def toy_problem():
    """A small known set: class c is a bright square at its own place on a dark 8x8 image, plus noise."""
    generator = torch.Generator().manual_seed(0)
    images = -torch.ones(60, 1, SIDE, SIDE)
    labels = torch.arange(60) % CLASSES
    for index, label in enumerate(labels.tolist()):
        images[index, 0, 2 * label : 2 * label + 3, 2 * label : 2 * label + 3] = 1.0
    images = (images + 0.1 * torch.randn(images.shape, generator=generator)).clamp(-1, 1)
    features = RandomFourierFeatures(SIDE * SIDE, 512, (2.0, 4.0, 8.0), seed=1)
    target, _ = class_feature_means(features, images, labels, CLASSES)
    return features, target


def generated_distance(generator, features, target) -> float:
    labels = torch.arange(300) % CLASSES
    means, _ = class_feature_means(features, sample_conditional(generator, labels, seed=5), labels, CLASSES)
    return float((means - target).norm())


def test_trainer_lowers_the_loss_and_the_generated_means_approach_the_target():
    features, target = toy_problem()
    generator = build_merf_generator(CLASSES, 1, SIDE, seed=2, z_dim=4, hidden=32, conv_channels=(8, 4))
    before = generated_distance(generator, features, target)
    settings = MomentMatchingSettings(steps=250, batch_size=60, lr=1e-2, seed=3)
    result = train_moment_matching(generator, features, target, settings, progress=False)
    assert len(result.losses) == 250
    first, last = sum(result.losses[:10]) / 10, sum(result.losses[-25:]) / 25
    assert last < 0.05 * first, (first, last)  # about 0.01 in practice
    after = generated_distance(generator, features, target)
    assert after < 0.2 * before, (before, after)  # about 0.08 in practice
    assert after < 0.2 * float(target.norm())  # close to the target, relative to its size (about 0.1)


def test_training_is_deterministic_from_the_public_seeds():
    features, target = toy_problem()
    runs = []
    for _ in range(2):
        generator = build_merf_generator(CLASSES, 1, SIDE, seed=4, z_dim=4, hidden=16, conv_channels=(4, 4))
        settings = MomentMatchingSettings(steps=5, batch_size=12, seed=6, decay_every=2)
        losses = train_moment_matching(generator, features, target, settings, progress=False).losses
        runs.append((losses, [p.detach().clone() for p in generator.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_a_target_callable_is_asked_once_per_step_in_order():
    features, target = toy_problem()
    asked = []

    def per_step_target(step: int) -> torch.Tensor:
        asked.append(step)
        return target + 0.01 * step  # a fresh release each step (DP-Kernel)

    generator = build_merf_generator(CLASSES, 1, SIDE, seed=0, z_dim=4, hidden=16, conv_channels=(4, 4))
    settings = MomentMatchingSettings(steps=4, batch_size=9)
    train_moment_matching(generator, features, per_step_target, settings, progress=False)
    assert asked == [0, 1, 2, 3]


def test_the_loss_is_the_squared_distance_of_the_class_means_over_present_classes():
    features = RandomFourierFeatures(4, 16, 1.0, seed=0)
    images = torch.randn(5, 4)
    labels = torch.tensor([0, 0, 2, 2, 2])  # class 1 absent: no mean to match, left out
    target = torch.randn(3, 16)
    rows = features(images)
    expected = ((rows[:2].mean(0) - target[0]) ** 2).sum() + ((rows[2:].mean(0) - target[2]) ** 2).sum()
    assert float(moment_matching_loss(features, images, labels, target)) == pytest.approx(float(expected), rel=1e-5)


def test_labels_are_uniform_and_public():
    rng = torch.Generator().manual_seed(0)
    for count in (7, 10, 23, 100):
        counts = torch.bincount(torch.from_numpy(balanced_labels(count, 10, rng)), minlength=10)
        assert int(counts.sum()) == count
        assert int(counts.max()) - int(counts.min()) <= 1  # every class floor or ceil of count / K


def test_bad_settings_are_refused():
    for settings in ({"steps": 0}, {"batch_size": 0}, {"lr": 0.0}, {"lr_decay": 1.5}, {"decay_every": -1}):
        with pytest.raises(ConfigError):
            MomentMatchingSettings(**settings)


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_a_resumed_training_ends_exactly_where_an_uninterrupted_one_does(optimizer):
    """Checkpoints every 2 steps; resuming from the one after step 4 gives the same generator, losses and
    latent draws as 6 uninterrupted steps (optimiser, schedule and the latent generator restored)."""
    features, target = toy_problem()
    settings = MomentMatchingSettings(steps=6, batch_size=12, seed=6, decay_every=2, optimizer=optimizer)

    def fresh():
        return build_merf_generator(CLASSES, 1, SIDE, seed=4, z_dim=4, hidden=16, conv_channels=(4, 4))

    saved = []
    straight = fresh()
    full = train_moment_matching(
        straight, features, target, settings, progress=False, checkpoint_every=2, checkpoint=saved.append
    )
    assert [state["step"] for state in saved] == [2, 4, 6]
    resumed = fresh()
    rest = train_moment_matching(resumed, features, target, settings, progress=False, resume=saved[1])
    assert rest.losses == full.losses
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
    with pytest.raises(ConfigError):
        train_moment_matching(fresh(), features, target, settings, progress=False, resume={**saved[0], "step": 7})


def test_a_per_step_target_is_never_asked_twice_for_a_step_after_a_resume():
    """DP-Kernel releases once per step: resumed from the state at step 2 but with steps 2 and 3 already
    released (start_step=4), the trainer asks only for steps 4 and 5 and reports each update to after_step."""
    features, target = toy_problem()
    settings = MomentMatchingSettings(steps=6, batch_size=12, seed=6)
    saved = []
    generator = build_merf_generator(CLASSES, 1, SIDE, seed=4, z_dim=4, hidden=16, conv_channels=(4, 4))
    train_moment_matching(
        generator, features, target, settings, progress=False, checkpoint_every=2, checkpoint=saved.append
    )
    asked, seen = [], []

    def counted(step):
        asked.append(step)
        return target

    train_moment_matching(
        generator,
        features,
        counted,
        settings,
        progress=False,
        resume=saved[0],
        start_step=4,
        after_step=lambda step, loss: seen.append(step),
    )
    assert asked == [4, 5] and seen == [4, 5]
    with pytest.raises(ConfigError):
        train_moment_matching(generator, features, target, settings, progress=False, resume=saved[1], start_step=3)


def test_the_optimizer_is_a_setting():
    with pytest.raises(ConfigError):
        MomentMatchingSettings(optimizer="sgd")
