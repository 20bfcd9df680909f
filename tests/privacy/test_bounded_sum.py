"""The noisy bounded-sum release: sensitivity under add/remove, noise scale, denominator, empty classes,
charge before compute, Poisson subsampling and the dp_event record that `dpsynth privacy verify` checks."""

from __future__ import annotations

import math

import pytest
import torch
from dp_accounting import dp_event as dpe

from dpsynth.errors import BudgetExceededError, DataError, PrivacyError
from dpsynth.privacy import Gaussian, PrivacyLedger, SubsampledGaussian
from dpsynth.privacy.bounded_sum import (
    BoundedSum,
    class_sums,
    clip_to_bound,
    poisson_sample,
    release_bounded_sum,
    release_subsampled_bounded_sum,
)
from dpsynth.privacy.dp_event_json import event_from_json
from dpsynth.privacy.rng import NoiseSource
from dpsynth.privacy.verify import verify_record


def roomy_ledger() -> PrivacyLedger:
    return PrivacyLedger(target_epsilon=100.0, delta=1e-5)


def unbudgeted_ledger() -> PrivacyLedger:
    """Records without enforcing a budget: for a release with almost no noise, to see the counts."""
    return PrivacyLedger(target_epsilon=None, delta=1e-5, guarantee="none")


def adversarial_feature(generator: torch.Generator, dim: int, bound: float, case: int) -> torch.Tensor:
    """A feature the added record controls: far over the bound, exactly at it, zero, or non-finite."""
    direction = torch.randn(dim, generator=generator, dtype=torch.float64)
    kind = case % 5
    if kind == 0:
        return direction * 1e6
    if kind == 1:
        return direction / direction.norm() * bound
    if kind == 2:
        return torch.zeros(dim, dtype=torch.float64)
    if kind == 3:
        return direction.index_fill(0, torch.tensor([0]), float("nan"))
    return direction.index_fill(0, torch.tensor([dim - 1]), float("inf"))


def released_vector(features, labels, query: BoundedSum, seed: int) -> torch.Tensor:
    """The whole released vector (sums, then counts) of one release with a fixed test noise source."""
    release = release_bounded_sum(
        iter([(features, labels)]), features.shape[1], query, roomy_ledger(), NoiseSource(seed=seed)
    )
    parts = [release.sums.reshape(-1)]
    if release.counts is not None:
        parts.append(release.counts * query.count_weight)
    return torch.cat(parts)


@pytest.mark.parametrize("count_weight", [None, 0.5, 3.0])
def test_adding_one_record_moves_the_release_by_at_most_its_sensitivity(count_weight):
    """Neighbouring datasets: one added record with an adversarial feature and any label moves all K
    class sums together (and the weighted counts) by at most B, resp. sqrt(B^2 + w^2), in L2. Through the
    real release with the same test noise, so the noise cancels and the difference is the sums'."""
    generator = torch.Generator().manual_seed(0)
    for case in range(60):
        n, dim, classes = 1 + case % 7, 1 + (case * 5) % 17, 1 + case % 4
        bound = 0.05 + float(torch.rand((), generator=generator)) * 3
        query = BoundedSum("q", bound, 1.0, num_classes=classes, count_weight=count_weight)
        features = torch.randn(n, dim, generator=generator, dtype=torch.float64) * 10.0 ** (case % 5 - 2)
        labels = torch.randint(classes, (n,), generator=generator)
        extra = adversarial_feature(generator, dim, bound, case)[None]
        extra_label = torch.randint(classes, (1,), generator=generator)
        with_record = released_vector(torch.cat([features, extra]), torch.cat([labels, extra_label]), query, case)
        without = released_vector(features, labels, query, case)
        distance = float((with_record - without).norm())
        assert math.isfinite(distance)
        assert distance <= query.sensitivity * (1 + 1e-9), (case, distance, query.sensitivity)
        if case % 5 == 0:  # a row far over the bound is scaled to it: the bound is attained, not exceeded
            assert distance == pytest.approx(query.sensitivity, rel=1e-6)


def test_the_whole_table_moves_by_b_not_by_b_per_class():
    """Parallel composition: the sensitivity of the K x D table is B, whatever K (no sqrt(K) factor)."""
    query = BoundedSum("q", 2.0, 1.0, num_classes=10)
    assert query.sensitivity == 2.0
    assert BoundedSum("q", 2.0, 1.0, num_classes=10, count_weight=1.5).sensitivity == pytest.approx(2.5)
    features = torch.randn(30, 4, dtype=torch.float64)
    labels = torch.arange(30) % 10
    full, _ = class_sums(iter([(features, labels)]), 4, 10, 2.0)
    for drop in range(30):
        keep = torch.tensor([i for i in range(30) if i != drop])
        neighbour, _ = class_sums(iter([(features[keep], labels[keep])]), 4, 10, 2.0)
        assert float((full - neighbour).norm()) <= 2.0 * (1 + 1e-12)


def test_clipping_scales_long_rows_keeps_short_ones_and_zeroes_non_finite_ones():
    rows = torch.tensor([[3.0, 4.0], [0.3, 0.4], [float("nan"), 1.0], [0.0, 0.0]], dtype=torch.float64)
    clipped = clip_to_bound(rows, 1.0)
    assert torch.allclose(clipped[0], torch.tensor([0.6, 0.8], dtype=torch.float64))
    assert torch.equal(clipped[1], rows[1])  # within the bound: exactly untouched
    assert torch.equal(clipped[2], torch.zeros(2, dtype=torch.float64))
    assert torch.equal(clipped[3], rows[3])


@pytest.mark.parametrize("count_weight", [None, 2.0])
def test_noise_std_is_sigma_times_the_sensitivity_on_every_coordinate(count_weight):
    classes, dim, bound, sigma = 4, 5000, 0.7, 1.5
    features = torch.randn(50, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = torch.arange(50) % classes
    query = BoundedSum("q", bound, sigma, num_classes=classes, count_weight=count_weight)
    release = release_bounded_sum(iter([(features, labels)]), dim, query, roomy_ledger(), NoiseSource(seed=11))
    exact_sums, exact_counts = class_sums(iter([(features, labels)]), dim, classes, bound)
    residual = [(release.sums - exact_sums).reshape(-1)]
    if count_weight is not None:
        residual.append((release.counts - exact_counts) * count_weight)
    residual = torch.cat(residual)
    expected_std = sigma * math.hypot(bound, count_weight or 0.0)
    assert release.noise_std == pytest.approx(expected_std)
    # 20,000 normals: the sample std is within 3 % of the true std except with probability ~1e-20
    assert float(residual.std()) == pytest.approx(expected_std, rel=0.03)
    assert abs(float(residual.mean())) < 5 * expected_std / math.sqrt(len(residual))
    # the residual is exactly one draw of the test noise source: nothing else perturbs the sums
    drawn = NoiseSource(seed=11).normal((len(residual),), std=expected_std, dtype=torch.float64)
    assert torch.allclose(residual, drawn, atol=1e-9)


def test_means_divide_by_the_declared_denominator_never_by_the_realised_count():
    features = torch.rand(12, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.1
    labels = torch.tensor([0] * 9 + [1] * 3)  # unbalanced: realised counts 9 and 3
    chunks = [(features, labels)]
    scalar = release_bounded_sum(
        iter(chunks), 3, BoundedSum("a", 1.0, 1.0, 2, denominator=6.0), roomy_ledger(), NoiseSource(seed=3)
    )
    assert torch.allclose(scalar.means, scalar.sums / 6.0)
    per_class = release_bounded_sum(
        iter(chunks), 3, BoundedSum("b", 1.0, 1.0, 2, denominator=[4.0, 8.0]), roomy_ledger(), NoiseSource(seed=3)
    )
    assert torch.allclose(per_class.means, per_class.sums / torch.tensor([[4.0], [8.0]], dtype=torch.float64))
    assert torch.allclose(per_class.sums, scalar.sums)  # same noise, same sums: only the divisor differs
    raw = release_bounded_sum(iter(chunks), 3, BoundedSum("c", 1.0, 1.0, 2), roomy_ledger(), NoiseSource(seed=3))
    assert torch.equal(raw.means, raw.sums)
    noisy = release_bounded_sum(
        iter(chunks), 3, BoundedSum("d", 1.0, 0.01, 2, count_weight=1.0), unbudgeted_ledger(), NoiseSource(seed=3)
    )
    assert noisy.counts is not None and torch.allclose(
        noisy.counts, torch.tensor([9.0, 3.0], dtype=torch.float64), atol=0.1
    )
    assert torch.allclose(noisy.means, noisy.sums / noisy.counts[:, None])


@pytest.mark.parametrize(
    "settings",
    [
        {"denominator": 0.0},
        {"denominator": -2.0},
        {"denominator": [1.0, 2.0, 3.0]},  # three values for two classes
        {"denominator": 5.0, "count_weight": 1.0},  # declared and noisy at once
        {"count_weight": 0.0},
        {"sample_rate": 0.0},
        {"sample_rate": 1.5},
    ],
)
def test_bad_declarations_are_refused(settings):
    with pytest.raises(PrivacyError):
        BoundedSum("q", 1.0, 1.0, num_classes=2, **settings)


@pytest.mark.parametrize("bound, sigma", [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1.0, float("inf"))])
def test_bad_bound_or_noise_is_refused(bound, sigma):
    with pytest.raises(PrivacyError):
        BoundedSum("q", bound, sigma)


@pytest.mark.parametrize("settings", [{"denominator": 7.0}, {"denominator": [1.0] * 5}, {"count_weight": 0.5}])
def test_empty_classes_give_finite_means(settings):
    features = torch.ones(4, 6, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1])  # classes 2, 3 and 4 have no record
    query = BoundedSum("q", 1.0, 2.0, num_classes=5, **settings)
    for chunks in ([(features, labels)], [], [(features[:0], labels[:0])]):  # some records, none at all
        release = release_bounded_sum(iter(chunks), 6, query, roomy_ledger(), NoiseSource(seed=4))
        assert torch.isfinite(release.means).all() and torch.isfinite(release.sums).all()
        if release.counts is not None:
            assert torch.isfinite(release.counts).all()


def test_the_ledger_is_charged_before_any_private_chunk_is_read():
    ledger = roomy_ledger()
    seen = []

    def chunks():
        seen.append([m.name for m in ledger.mechanisms()])  # what the ledger holds when reading starts
        yield torch.ones(2, 3), torch.tensor([0, 1])

    release_bounded_sum(chunks(), 3, BoundedSum("stats", 1.0, 2.0, num_classes=2), ledger, NoiseSource(seed=0))
    assert seen == [["stats"]]
    assert ledger.mechanisms() == [Gaussian("stats", 2.0, 1)]


def test_a_refused_charge_reads_nothing_and_draws_no_sample():
    consumed = []

    def chunks():
        consumed.append(True)
        yield torch.ones(2, 3), None

    def select(indices):
        consumed.append(indices)
        return chunks()

    tight = PrivacyLedger(target_epsilon=0.01, delta=1e-5)
    with pytest.raises(BudgetExceededError):
        release_bounded_sum(chunks(), 3, BoundedSum("stats", 1.0, 0.5), tight, NoiseSource(seed=0))
    with pytest.raises(BudgetExceededError):
        release_subsampled_bounded_sum(
            select, 10, 3, BoundedSum("sub", 1.0, 0.5, sample_rate=0.5), tight, NoiseSource()
        )
    assert not consumed
    assert tight.mechanisms() == []


def test_poisson_subsample_uses_the_noise_source_and_composes_repeats_in_one_mechanism():
    assert torch.equal(
        poisson_sample(1000, 0.3, NoiseSource(seed=5)), (NoiseSource(seed=5).uniform(1000) < 0.3).nonzero().flatten()
    )
    images = torch.randn(200, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    labels = torch.arange(200) % 2
    selected = []

    def select(indices):
        selected.append(indices)
        yield images[indices], labels[indices]

    ledger = roomy_ledger()
    query = BoundedSum("central", 5.0, 3.0, num_classes=2, sample_rate=0.25, denominator=25.0)
    noise = NoiseSource(seed=7)
    for _ in range(3):
        release = release_subsampled_bounded_sum(select, 200, 8, query, ledger, noise)
        assert release.means.shape == (2, 8) and torch.isfinite(release.means).all()
    assert ledger.mechanisms() == [SubsampledGaussian("central", 3.0, 0.25, 3)]
    assert all(0 < len(indices) < 200 for indices in selected)  # a subsample, different each time
    assert not torch.equal(selected[0], selected[1])
    with pytest.raises(PrivacyError):  # a subsampled query needs the sampling entry point
        release_bounded_sum(iter([]), 8, query, roomy_ledger(), NoiseSource(seed=0))


def test_a_registered_release_spends_one_step_each_time_and_stops_at_the_budget():
    ledger = PrivacyLedger(target_epsilon=1.0, delta=1e-5, accountant="rdp")
    query = BoundedSum("per-step", 1.0, 2.0, num_classes=1, sample_rate=0.01)
    ledger.register(query.mechanism(0))
    select = lambda indices: iter([(torch.ones(len(indices), 2), None)])  # noqa: E731
    for _ in range(5):
        release_subsampled_bounded_sum(select, 100, 2, query, ledger, NoiseSource(seed=0), registered=True)
    assert ledger.mechanisms() == [SubsampledGaussian("per-step", 2.0, 0.01, 5)]
    limit = ledger.max_steps("per-step")
    assert limit > 5
    ledger.spend("per-step", limit - 5)
    with pytest.raises(BudgetExceededError):
        release_subsampled_bounded_sum(select, 100, 2, query, ledger, NoiseSource(seed=0), registered=True)
    # a release noised otherwise than the registered mechanism cannot spend its steps
    louder = BoundedSum("per-step", 1.0, 0.5, num_classes=1, sample_rate=0.01)
    with pytest.raises(PrivacyError, match="other parameters"):
        release_subsampled_bounded_sum(select, 100, 2, louder, roomy_registered(query), NoiseSource(), registered=True)


def roomy_registered(query: BoundedSum) -> PrivacyLedger:
    ledger = roomy_ledger()
    ledger.register(query.mechanism(0))
    return ledger


def test_labels_are_checked_without_quoting_them():
    query = BoundedSum("q", 1.0, 1.0, num_classes=3)
    with pytest.raises(DataError, match="a label is 3 or more"):
        release_bounded_sum(iter([(torch.ones(2, 2), torch.tensor([0, 7]))]), 2, query, roomy_ledger(), NoiseSource())
    with pytest.raises(DataError, match="a label is negative"):
        release_bounded_sum(iter([(torch.ones(2, 2), torch.tensor([0, -1]))]), 2, query, roomy_ledger(), NoiseSource())
    with pytest.raises(DataError, match="labels are needed"):
        release_bounded_sum(iter([(torch.ones(2, 2), None)]), 2, query, roomy_ledger(), NoiseSource())


def test_the_dp_event_of_the_releases_round_trips_through_verify():
    """privacy.json after a full-batch release with noisy counts and three subsampled releases: its
    dp_event is exactly those mechanisms, and dp_accounting certifies the stated epsilon."""
    ledger = PrivacyLedger(target_epsilon=8.0, delta=1e-5)
    full = BoundedSum("embedding", 1.0, 2.0, num_classes=3, count_weight=1.0)
    release_bounded_sum(iter([(torch.rand(9, 4), torch.arange(9) % 3)]), 4, full, ledger, NoiseSource())
    sub = BoundedSum("central", 2.0, 4.0, num_classes=3, sample_rate=0.2, denominator=1.0)
    for _ in range(3):
        release_subsampled_bounded_sum(
            lambda i: iter([(torch.rand(len(i), 4), i % 3)]), 50, 4, sub, ledger, NoiseSource()
        )
    record = ledger.to_json()
    gaussian = dpe.GaussianDpEvent
    assert event_from_json(record["dp_event"]) == dpe.ComposedDpEvent(
        [
            dpe.SelfComposedDpEvent(gaussian(2.0), 1),
            dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.2, gaussian(4.0)), 3),
        ]
    )
    result = verify_record(record)
    assert result["ok"], result
    assert result["pld_epsilon"] == pytest.approx(record["epsilon"], rel=0.05)
    record["epsilon"] *= 0.8  # an under-stated epsilon is caught
    assert not verify_record(record)["ok"]
