"""Privacy audit: membership-inference metrics, the one-run ε lower bound, the canary audit."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
import yaml
from sklearn.datasets import load_digits

import dpsynth.eval.audit as audit_module
from dpsynth.contract import METHODS, Method, register_method
from dpsynth.data.dataset import ImageDataset
from dpsynth.errors import PrivacyError
from dpsynth.eval.audit import audit_run
from dpsynth.metrics.audit_stats import (
    accuracy_epsilon,
    audit_p_value,
    clopper_pearson,
    epsilon_lower_bound,
    max_certifiable_epsilon,
)
from dpsynth.metrics.canary import GuessOutcome, bound_summary, canary_audit, guess_membership
from dpsynth.metrics.membership import (
    loss_attack,
    membership_attack,
    nearest_neighbour_attack,
    nearest_neighbour_distances,
    roc_auc,
    tpr_at_fpr,
)
from dpsynth.privacy.rng import NoiseSource


def digits(count: int) -> ImageDataset:
    data = load_digits()
    images = np.clip(data.images[:count] * 16, 0, 255).astype(np.uint8)[..., None]
    return ImageDataset(images, data.target[:count].astype(np.int64), 10, "digits8x8")


# ------------------------------------------------------------------ ε lower bound mathematics


def test_pure_dp_bound_matches_closed_form():
    # δ = 0 and all 10 guesses right: p(ε) = q^10 with q = e^ε/(1+e^ε); the bound solves q^10 = β.
    q = 0.05 ** (1 / 10)
    assert epsilon_lower_bound(10, 10, 10, delta=0.0, beta=0.05) == pytest.approx(math.log(q / (1 - q)), abs=1e-6)


def test_delta_term_matches_hand_computation():
    # m = r = v = 1: f(1) = q and max_i (f(1-i) - f(1)) / i = 1 - q, so p = q + 2δ(1 - q).
    # With β = 0.9, δ = 0.1: q = (β - 2δ) / (1 - 2δ) = 7/8, ε = ln 7.
    assert audit_p_value(1, 1, 1, math.log(7), 0.1) == pytest.approx(0.9)
    assert epsilon_lower_bound(1, 1, 1, delta=0.1, beta=0.9) == pytest.approx(math.log(7), abs=1e-6)
    # m = 3, r = 2, v = 2, ε = 0: f(2) = 1/4; windows pmf(1) = 1/2 and pmf(1)+pmf(0) = 3/4 over i = 1, 2,
    # max(1/2, 3/8) = 1/2; p = 1/4 + 2·3·δ·1/2.
    assert audit_p_value(3, 2, 2, 0.0, 0.01) == pytest.approx(0.25 + 0.03)


def test_p_value_without_delta_is_the_binomial_tail():
    epsilon, r, v = 0.7, 12, 9
    q = math.exp(epsilon) / (1 + math.exp(epsilon))
    tail = sum(math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(v, r + 1))
    assert audit_p_value(50, r, v, epsilon, 0.0) == pytest.approx(tail, rel=1e-10)
    assert audit_p_value(50, r, 0, epsilon, 0.0) == 1.0


def test_bound_behaves_sensibly():
    assert epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0  # chance-level guessing proves nothing
    bounds = [epsilon_lower_bound(1000, 100, v, 1e-5) for v in (60, 70, 80, 90, 100)]
    assert bounds == sorted(bounds) and bounds[0] < bounds[-1]
    assert epsilon_lower_bound(1000, 100, 90, 1e-3) < epsilon_lower_bound(1000, 100, 90, 1e-7)
    assert epsilon_lower_bound(1000, 100, 90, 1e-5, beta=0.01) < epsilon_lower_bound(1000, 100, 90, 1e-5, beta=0.1)
    with pytest.raises(PrivacyError):
        epsilon_lower_bound(10, 11, 5, 1e-5)
    with pytest.raises(PrivacyError):
        epsilon_lower_bound(10, 10, 5, 1e-5, beta=1.0)


def test_bound_is_valid_for_randomized_response():
    # Each guess of an ε-DP randomized response is right with probability e^ε/(1+e^ε): the bound at
    # confidence 95 % may exceed the true ε in at most ~5 % of trials.
    epsilon, guesses, trials = 1.0, 40, 300
    generator = np.random.default_rng(1)
    correct = generator.binomial(guesses, math.exp(epsilon) / (1 + math.exp(epsilon)), size=trials)
    bound_of = {v: epsilon_lower_bound(guesses, guesses, v, 0.0, 0.05) for v in np.unique(correct).tolist()}
    bounds = np.array([bound_of[v] for v in correct.tolist()])
    assert np.mean(bounds > epsilon) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert np.mean(bounds > 0) > 0.2  # and it is not vacuous


def test_clopper_pearson_matches_closed_forms_and_scipy():
    # x = 0: the upper end solves (1 - p)^n = α/2; x = n: the lower end solves p^n = α/2.
    assert clopper_pearson(0, 10, 0.95) == pytest.approx((0.0, 1 - 0.025 ** (1 / 10)))
    assert clopper_pearson(10, 10, 0.95) == pytest.approx((0.025 ** (1 / 10), 1.0))
    for successes, trials, confidence in [(3, 17, 0.95), (50, 100, 0.9), (1, 1000, 0.99)]:
        exact = scipy.stats.binomtest(successes, trials).proportion_ci(confidence, method="exact")
        assert clopper_pearson(successes, trials, confidence) == pytest.approx((exact.low, exact.high), rel=1e-9)
    assert clopper_pearson(0, 0) == (0.0, 1.0)
    with pytest.raises(PrivacyError):
        clopper_pearson(5, 4)


def test_clopper_pearson_covers_at_least_its_confidence():
    generator = np.random.default_rng(2)
    trials, rate = 40, 0.1
    hits = [
        lo <= rate <= hi
        for lo, hi in (clopper_pearson(int(x), trials, 0.9) for x in generator.binomial(trials, rate, size=400))
    ]
    assert np.mean(hits) >= 0.9 - 3 * math.sqrt(0.09 / 400)


def test_max_certifiable_epsilon_is_the_bound_with_every_guess_right():
    # δ = 0: p(ε)^r = β, so the most r guesses can certify is logit(β^{1/r}) — 1.82 for r = 20.
    q = 0.05 ** (1 / 20)
    assert max_certifiable_epsilon(100, 20, 0.0, 0.05) == pytest.approx(math.log(q / (1 - q)), abs=1e-6)
    assert max_certifiable_epsilon(100, 20, 0.0) == pytest.approx(1.82, abs=0.01)
    assert max_certifiable_epsilon(100, 20, 1e-5) <= max_certifiable_epsilon(100, 20, 0.0)
    assert all(epsilon_lower_bound(100, 20, v, 1e-5) <= max_certifiable_epsilon(100, 20, 1e-5) for v in range(0, 21, 5))
    assert max_certifiable_epsilon(100, 0, 1e-5) == 0.0


def test_bound_summary_reports_intervals_and_what_the_audit_could_certify():
    outcome = GuessOutcome(num_canaries=100, num_guesses=20, num_correct=15, guesses=np.zeros(100, np.int8))
    summary = bound_summary(outcome, delta=1e-5, beta=0.05, claimed=1.0)
    assert summary["guess_accuracy"] == 0.75 and summary["confidence"] == 0.95
    low, high = summary["guess_accuracy_interval"]
    assert (low, high) == pytest.approx(clopper_pearson(15, 20, 0.95))
    assert summary["epsilon_interval"] == pytest.approx([math.log(low / (1 - low)), math.log(high / (1 - high))])
    assert 0 < summary["epsilon_lower_bound"] < summary["max_certifiable_epsilon"]
    assert summary["exceeds_claim"] == (summary["epsilon_lower_bound"] > 1.0)
    assert "empirical lower bound" in summary["statement"] and "0.95" in summary["statement"]
    assert f"{summary['max_certifiable_epsilon']:.3g}" in summary["statement"]
    every_guess_right = bound_summary(GuessOutcome(100, 20, 20, np.zeros(100, np.int8)), 1e-5, 0.05, None)
    assert every_guess_right["epsilon_interval"][1] is None  # no finite ε explains a perfect score
    assert every_guess_right["epsilon_lower_bound"] == pytest.approx(every_guess_right["max_certifiable_epsilon"])
    assert json.loads(json.dumps(every_guess_right, allow_nan=False)) == every_guess_right
    assert accuracy_epsilon(0.4) == 0.0


def test_guess_membership_counts_correct_guesses():
    scores = np.array([0.9, 0.1, 0.8, 0.2, 0.5])
    included = np.array([True, False, False, False, True])
    outcome = guess_membership(scores, included, k_plus=2, k_minus=2)
    # IN guesses: canaries 0 (right) and 2 (wrong); OUT guesses: 1 and 3 (both right); 4 abstains.
    assert outcome.guesses.tolist() == [1, -1, 1, -1, 0]
    assert (outcome.num_guesses, outcome.num_correct) == (4, 3)


# ------------------------------------------------------------------ membership-inference metrics


def test_roc_metrics_on_hand_cases():
    members, nonmembers = np.array([5.0, 4.0, 3.0, 0.5]), np.array([2.0, 1.0, 0.0, -1.0])
    assert roc_auc(members, nonmembers) == pytest.approx(14 / 16)  # 14 of 16 pairs ordered right
    assert tpr_at_fpr(members, nonmembers, 0.0) == pytest.approx(0.75)
    assert tpr_at_fpr(members, nonmembers, 0.25) == pytest.approx(0.75)
    assert tpr_at_fpr(members, nonmembers, 0.5) == pytest.approx(1.0)
    # Identical scores: no threshold separates them, AUC is ½ and a 10 % FPR buys no true positive.
    assert roc_auc(np.zeros(10), np.zeros(10)) == pytest.approx(0.5)
    assert tpr_at_fpr(np.zeros(10), np.zeros(10), 0.1) == 0.0


def test_attack_result_gives_exact_intervals_on_the_tpr_and_fpr():
    members, nonmembers = np.array([5.0, 4.0, 3.0, 0.5]), np.array([2.0, 1.0, 0.0, -1.0])
    result = membership_attack(members, nonmembers, "hand", fpr=0.25)
    # Threshold 1.0: three members and one non-member (2.0) at or above it.
    assert (result.true_positives, result.false_positives) == (3, 1)
    assert (result.tpr_at_fpr, result.achieved_fpr) == (0.75, 0.25)
    assert result.tpr_interval == pytest.approx(list(clopper_pearson(3, 4, 0.95)))
    assert result.achieved_fpr_interval == pytest.approx(list(clopper_pearson(1, 4, 0.95)))
    assert result.confidence == 0.95
    # Few examples: a perfect-looking TPR still has a wide interval.
    assert result.tpr_interval[0] < 0.25 and result.tpr_interval[1] > 0.99
    assert json.loads(json.dumps(result.to_dict(), allow_nan=False))["tpr_interval"] == result.tpr_interval


def test_nearest_neighbour_distances_match_brute_force():
    generator = np.random.default_rng(0)
    queries = generator.integers(0, 256, (7, 4, 4, 1), dtype=np.uint8)
    references = generator.integers(0, 256, (5, 4, 4, 1), dtype=np.uint8)
    expected = [min(np.linalg.norm(q.astype(float) / 255 - r.astype(float) / 255) for r in references) for q in queries]
    assert nearest_neighbour_distances(queries, references, chunk=3) == pytest.approx(expected)


def test_nearest_neighbour_attack_catches_copied_members():
    data = digits(200)
    members, nonmembers = data.images[:100], data.images[100:]
    generator = np.random.default_rng(0)
    leaked = np.clip(members[:60].astype(int) + generator.integers(-8, 9, members[:60].shape), 0, 255).astype(np.uint8)
    result = nearest_neighbour_attack(members, nonmembers, leaked)
    assert result.tpr_at_fpr >= 0.5 and result.auc > 0.75
    unrelated = nearest_neighbour_attack(members, nonmembers, digits(600).images[400:])
    assert unrelated.tpr_at_fpr < 0.35


def overfit_losses(images: torch.Tensor, labels: torch.Tensor, steps: int = 300) -> np.ndarray:
    """Per-example losses of a small MLP trained without privacy on the first 64 examples only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):  # full-batch training until the 64 members are memorised
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images[:64]), labels[:64]).backward()
        optimizer.step()
    with torch.no_grad():  # float64: float32 losses of memorised examples collapse into ties near 0
        return torch.nn.functional.cross_entropy(model(images).double(), labels, reduction="none").numpy()


def test_loss_attack_detects_an_overfit_model():
    images, labels = digits(128).to_tensors()
    losses = overfit_losses(images, labels)
    result = loss_attack(losses[:64], losses[64:])
    assert result.auc > 0.65 and result.tpr_at_fpr > 0.1  # digits generalise well, yet the gap shows
    # Random labels leave nothing to learn but the members themselves: the attack becomes near perfect.
    random_labels = torch.from_numpy(np.random.default_rng(0).integers(0, 10, 128))
    losses = overfit_losses(images, random_labels)
    memorised = loss_attack(losses[:64], losses[64:])
    assert memorised.tpr_at_fpr > 0.8 and memorised.auc > 0.95  # guessing gives 0.10 and 0.5


# ------------------------------------------------------------------ canary audit

AUDIT_SOURCES = [
    "dpsynth/eval/audit.py",
    "dpsynth/metrics/canary.py",
    "dpsynth/metrics/membership.py",
    "dpsynth/metrics/audit_stats.py",
    "docs/audit.md",
]


@pytest.mark.parametrize("path", AUDIT_SOURCES)
def test_the_audit_never_claims_to_prove(path):
    """An audit is a statistical test: its text says "empirical lower bound", never "proves"."""
    text = (Path(__file__).resolve().parents[2] / path).read_text()
    assert not re.search(r"\bprov(e|es|en|ing)\b", text, re.IGNORECASE), path
    if path in ("docs/audit.md", "dpsynth/metrics/canary.py"):
        assert "empirical lower bound" in text


def test_the_audit_has_no_command_line_of_its_own():
    # `dpsynth evaluate RUN --metrics audit,canary` is the one way in.
    assert not hasattr(audit_module, "main")


def test_non_private_training_gives_a_positive_lower_bound():
    result = canary_audit(
        digits(500), num_canaries=100, noise_multiplier=0.0, sample_rate=0.2, steps=150, inclusion_seed=3
    )
    assert result.claimed_epsilon is None and not result.exceeds_claim
    assert result.num_correct >= 18
    assert result.epsilon_lower_bound > 1.0
    assert result.epsilon_lower_bound <= result.max_certifiable_epsilon
    assert result.guess_accuracy_interval[0] <= result.guess_accuracy <= result.guess_accuracy_interval[1]
    assert "empirical lower bound" in result.statement


def test_dp_sgd_lower_bound_stays_below_the_claim():
    result = canary_audit(
        digits(500),
        num_canaries=100,
        epsilon=1.0,
        delta=1e-5,
        sample_rate=0.2,
        steps=150,
        inclusion_seed=3,
        noise=NoiseSource(seed=11),
        batch_generator=torch.Generator().manual_seed(5),
    )
    assert result.noise_multiplier > 1.0
    assert 0.98 <= result.claimed_epsilon <= 1.0
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert not result.exceeds_claim


# ------------------------------------------------------------------ auditing a run directory


class Memoriser(Method):
    """A test method that releases noisy copies of its training images and whose "model" has
    memorised them: an example's loss is its distance to the nearest training image."""

    name = "test-memoriser"

    def plan(self, config, num_examples):
        raise NotImplementedError  # never run: the test writes the run directory itself

    def fit(self, ctx):
        pass

    def generate(self, ctx, num):
        raise NotImplementedError

    def example_losses(self, ctx, images, labels):
        return nearest_neighbour_distances(images, ctx.data.train.images)


if Memoriser.name not in METHODS:
    register_method(Memoriser)


def test_audit_run_on_a_run_directory(tmp_path):
    from dpsynth.data import load_private

    config = {"method": "test-memoriser", "name": "mem", "data": {"private": "digits8x8", "max_train": 300}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    train = load_private("digits8x8", max_train=300).train
    generator = np.random.default_rng(0)
    leaked = train.images[:150].astype(int) + generator.integers(-10, 11, train.images[:150].shape)
    np.savez(tmp_path / "samples.npz", images=np.clip(leaked, 0, 255).astype(np.uint8), labels=train.labels[:150])
    _store_ledger(tmp_path)

    report = audit_run(tmp_path, max_examples=100)
    attacks = report["membership_inference"]
    assert attacks["nearest_neighbour"]["num_members"] == attacks["nearest_neighbour"]["num_nonmembers"] == 100
    assert attacks["nearest_neighbour"]["tpr_at_fpr"] > 0.3
    assert attacks["loss"]["tpr_at_fpr"] == pytest.approx(1.0)  # members sit at distance 0
    assert attacks["loss"]["tpr_interval"][0] > 0.9  # 100 of 100 members: the CP lower end is 0.964
    assert attacks["nearest_neighbour"]["achieved_fpr"] <= 0.1
    assert json.loads((tmp_path / "audit.json").read_text()) == report


def test_audit_run_canary_mirrors_the_runs_dp_sgd(tmp_path):
    config = {"method": "test-memoriser", "name": "mem", "data": {"private": "digits8x8", "max_train": 300}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    from dpsynth.privacy import SubsampledGaussian

    _store_ledger(tmp_path, SubsampledGaussian("dpsgd", 1.5, 0.02, 1000))
    run_epsilon = json.loads((tmp_path / "privacy.json").read_text())["epsilon"]
    report = audit_run(
        tmp_path, membership=False, canary=True, canary_options={"num_canaries": 30, "inclusion_seed": 0}
    )
    canary = report["canary"]
    assert (canary["noise_multiplier"], canary["sample_rate"]) == (1.5, 0.02)
    assert canary["steps"] == 300  # capped: the audit prices only the steps it runs
    assert canary["run_claimed_epsilon"] == run_epsilon and 0 < canary["claimed_epsilon"] < run_epsilon
    assert canary["epsilon_lower_bound"] <= canary["claimed_epsilon"] and not canary["exceeds_claim"]
    # Six IN and six OUT guesses: the most this audit could ever certify is small, and it says so.
    assert canary["num_guesses"] == 6 and canary["max_certifiable_epsilon"] < 2.0
    assert str(round(canary["max_certifiable_epsilon"], 2))[:3] in canary["statement"]
    assert report["skipped"] == {}
    assert "empirical lower bound" in report["note"]


def _store_ledger(run_dir, *mechanisms):
    """The run's stored ledger state (ledger.json + privacy.json), at the default config's budget."""
    from dpsynth.privacy import PrivacyLedger
    from dpsynth.rundir import LedgerStore

    ledger = PrivacyLedger(10.0, 1e-5)
    for mechanism in mechanisms:
        ledger.charge(mechanism)
    LedgerStore(run_dir, ledger).persist()
