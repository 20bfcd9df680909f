"""Downstream utility: the distillation loss (dp-imgsyn Eq. 6/7), real→real accuracy, noisy private-val selection."""

import math

import numpy as np
import pytest
import torch

from dpsynth.data import load_private
from dpsynth.errors import PrivacyError
from dpsynth.metrics.utility import NoisyValidation, TrainConfig, distillation_loss, evaluate_utility
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.mechanisms import Gaussian
from dpsynth.privacy.rng import NoiseSource


def test_distillation_loss_on_a_hand_example():
    # Teacher p = (0.8, 0.2) softened at T = 2 is ∝ sqrt(p) = (2/3, 1/3); a student with equal logits is (1/2, 1/2).
    loss = distillation_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.8, 0.2]]), temperature=2.0)
    kl = 2 / 3 * math.log((2 / 3) / 0.5) + 1 / 3 * math.log((1 / 3) / 0.5)
    assert float(loss) == pytest.approx(4 * kl, rel=1e-5)  # × T²


def test_distillation_with_one_hot_teacher_at_t1_is_cross_entropy():
    logits = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    labels = torch.tensor([2, 1])
    one_hot = torch.nn.functional.one_hot(labels, 3).float()
    expected = torch.nn.functional.cross_entropy(logits, labels)
    torch.testing.assert_close(distillation_loss(logits, one_hot, 1.0), expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def mnist():
    return load_private("mnist10k")


def sample(dataset, num, seed=0):
    """A random subset (the splits are stored sorted by class)."""
    index = np.random.default_rng(seed).choice(len(dataset), num, replace=False)
    return dataset.images[index], dataset.labels[index]


def test_real_to_real_accuracy_on_mnist10k_is_high(mnist):
    config = TrainConfig(epochs=2, max_steps=200, batch_size=64, lr=3e-3)
    result = evaluate_utility(
        mnist.train.images,
        mnist.train.labels,
        mnist.test.images,
        mnist.test.labels,
        10,
        models=["logreg"],
        seeds=[0, 1],
        config=config,
    )
    assert result["logreg"]["mean"] > 85.0
    assert len(result["logreg"]["runs"]) == 2 and result["logreg"]["std"] >= 0.0


def test_soft_labels_train_by_distillation(mnist):
    images, labels = sample(mnist.train, 2000)
    soft = np.full((len(labels), 10), 0.02, dtype=np.float32)
    soft[np.arange(len(labels)), labels] = 0.82  # a confident teacher
    config = TrainConfig(epochs=4, max_steps=120, batch_size=64, lr=3e-3, kd_temperature=2.0)
    result = evaluate_utility(
        images, labels, mnist.test.images, mnist.test.labels, 10, models=["logreg"], config=config, soft_labels=soft
    )
    assert result["logreg"]["mean"] > 80.0


def test_private_validation_selection_is_charged_to_the_ledger(mnist):
    ledger = PrivacyLedger(10.0, 1e-5)
    validation = NoisyValidation(ledger, *sample(mnist.val, 200), noise_multiplier=5.0, noise=NoiseSource(seed=0))
    config = TrainConfig(epochs=3, batch_size=250, lr=3e-3)
    result = evaluate_utility(
        *sample(mnist.train, 500),
        *sample(mnist.test, 200),
        10,
        models=["logreg"],
        config=config,
        selection="private-val",
        validation=validation,
    )
    assert ledger.mechanisms() == [Gaussian(name="noisy-validation", noise_multiplier=5.0, count=3)]  # one per epoch
    assert 0 < ledger.epsilon() < 10.0
    assert validation.remaining == 0 and 0 <= result["logreg"]["epochs"][0] < 3
    with pytest.raises(PrivacyError, match="more often than charged"):
        validation.score(torch.nn.Linear(784, 10))


def test_noisy_count_has_the_charged_noise_scale(mnist):
    validation = NoisyValidation(
        PrivacyLedger(10.0, 1e-5),
        mnist.val.images[:10],
        mnist.val.labels[:10],
        noise_multiplier=3.0,
        mechanism="laplace",
        noise=NoiseSource(seed=1),
    )
    draws = np.array([validation._draw() for _ in range(4000)])
    assert np.mean(np.abs(draws)) == pytest.approx(3.0, rel=0.08)  # E|Laplace(b)| = b
    assert abs(np.mean(draws)) < 0.3


def test_private_val_without_a_ledger_is_refused(mnist):
    with pytest.raises(PrivacyError):
        NoisyValidation(None, mnist.val.images[:10], mnist.val.labels[:10], noise_multiplier=1.0)
