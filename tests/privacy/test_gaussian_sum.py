"""The Gaussian sum of clipped per-example vectors: sensitivity, real noise, ledger charge first."""

import pytest
import torch

from dpsynth.errors import BudgetExceededError, PrivacyError
from dpsynth.privacy import Gaussian, PrivacyLedger
from dpsynth.privacy.gaussian_sum import clip_rows, private_count, private_sum, private_sum_of_chunks
from dpsynth.privacy.rng import NoiseSource


def roomy_ledger() -> PrivacyLedger:
    return PrivacyLedger(target_epsilon=100.0, delta=1e-5)


def test_clipped_rows_are_bounded_and_short_rows_untouched():
    generator = torch.Generator().manual_seed(0)
    for case in range(50):
        scale = 10.0 ** (case % 7 - 3)
        rows = torch.randn(16, 1 + case, generator=generator, dtype=torch.float64) * scale
        clip = float(torch.rand((), generator=generator)) * 2 + 0.01
        clipped = clip_rows(rows, clip)
        assert torch.all(clipped.norm(dim=1) <= clip * (1 + 1e-9))
        short = rows.norm(dim=1) <= clip
        assert torch.allclose(clipped[short], rows[short])


def test_sum_sensitivity_under_add_remove_is_at_most_c():
    """Removing any one row moves the clipped sum by at most C (many random cases)."""
    generator = torch.Generator().manual_seed(1)
    for case in range(200):
        n, dim = 2 + case % 9, 1 + (case * 7) % 31
        rows = torch.randn(n, dim, generator=generator, dtype=torch.float64) * 10.0 ** (case % 5 - 2)
        clip = 0.05 + float(torch.rand((), generator=generator)) * 3
        full = clip_rows(rows, clip).sum(0)
        removed = int(torch.randint(n, (1,), generator=generator))
        neighbour = clip_rows(torch.cat([rows[:removed], rows[removed + 1 :]]), clip).sum(0)
        assert float((full - neighbour).norm()) <= clip * (1 + 1e-9)


def test_noise_is_really_added_with_std_sigma_c():
    rows = torch.randn(64, 20000, generator=torch.Generator().manual_seed(2))
    clip, sigma = 0.5, 2.0
    ledger = roomy_ledger()
    released = private_sum(rows, clip, sigma, ledger, "stats", NoiseSource(seed=123))
    residual = released.double() - clip_rows(rows.double(), clip).sum(0)
    assert not torch.allclose(released.double(), clip_rows(rows.double(), clip).sum(0), atol=1e-3)
    assert float(residual.std()) == pytest.approx(sigma * clip, rel=0.03)
    assert abs(float(residual.mean())) < 4 * sigma * clip / 20000**0.5
    # the residual is exactly the seeded noise draw: nothing else perturbs the sum
    expected = NoiseSource(seed=123).normal((20000,), std=sigma * clip, dtype=torch.float64)
    assert torch.allclose(residual, expected, atol=1e-4)


def test_mechanism_is_charged_to_the_ledger():
    ledger = roomy_ledger()
    private_sum(torch.ones(3, 4), 1.0, 5.0, ledger, "dp-imgsyn-statistics", NoiseSource(seed=0))
    assert Gaussian("dp-imgsyn-statistics", 5.0) in ledger.mechanisms()
    assert ledger.epsilon() > 0


def test_refused_charge_reads_nothing():
    consumed = []

    def chunks():
        consumed.append(True)
        yield torch.ones(2, 3)

    ledger = PrivacyLedger(target_epsilon=0.01, delta=1e-5)
    with pytest.raises(BudgetExceededError):
        private_sum_of_chunks(chunks(), 3, 1.0, 0.5, ledger, "stats", NoiseSource(seed=0))
    assert not consumed


def test_chunked_sum_equals_one_shot_sum_with_the_same_noise():
    rows = torch.randn(10, 6, generator=torch.Generator().manual_seed(3)) * 3
    whole = private_sum(rows, 1.0, 1.0, roomy_ledger(), "s", NoiseSource(seed=9))
    parts = private_sum_of_chunks(iter([rows[:4], rows[4:]]), 6, 1.0, 1.0, roomy_ledger(), "s", NoiseSource(seed=9))
    assert torch.allclose(whole, parts, atol=1e-5)


def test_private_count_adds_gaussian_noise_and_charges():
    ledger = roomy_ledger()
    released = private_count(1000, 20.0, ledger, "count", NoiseSource(seed=5))
    expected = 1000 + float(NoiseSource(seed=5).normal((1,), std=20.0, dtype=torch.float64))
    assert released == pytest.approx(max(1.0, expected))
    assert released != 1000
    assert Gaussian("count", 20.0) in ledger.mechanisms()
    assert private_count(0, 50.0, roomy_ledger(), "c", NoiseSource(seed=1)) >= 1.0  # clamped


@pytest.mark.parametrize("clip, sigma", [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1.0, float("inf"))])
def test_bad_parameters_raise_privacy_error(clip, sigma):
    with pytest.raises(PrivacyError):
        private_sum(torch.ones(2, 2), clip, sigma, roomy_ledger(), "s", NoiseSource(seed=0))
