"""Canary audit: an empirical ε lower bound for dpsynth's DP-SGD from one training run.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023,
arXiv:2305.08846): m canaries each enter the training set with probability ½, the trained model
scores them, the auditor guesses the k+ highest-scoring IN and the k- lowest OUT, and the number of
correct guesses becomes an **empirical lower bound** on ε at confidence 1 - β
(:func:`dpsynth.metrics.audit_stats.epsilon_lower_bound`). It is a statistical test, not a proof: a
lower bound above the ε the accountant claims is evidence, at that confidence, of a bug in the
private training or its accounting; a bound below the claim shows nothing about the claim's
tightness. The audit also reports the largest ε its number of guesses could ever certify.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsynth.errors import DataError, PrivacyError
from dpsynth.metrics.audit_stats import accuracy_epsilon, clopper_pearson, epsilon_lower_bound, max_certifiable_epsilon

if TYPE_CHECKING:
    import torch

AUDIT_MECHANISM = "canary_audit"
STATEMENT = (
    "empirical lower bound on epsilon at confidence {confidence:g} (Steinke, Nasr & Jagielski 2023): "
    "a statistical test of the privacy claim, not a proof; this audit cannot certify more than "
    "epsilon = {max_certifiable:.3g} with {guesses} guesses"
)


@dataclasses.dataclass
class GuessOutcome:
    """The auditor's guesses from canary scores and how many were right."""

    num_canaries: int
    num_guesses: int
    num_correct: int
    guesses: np.ndarray  # int8 [m]: +1 guessed IN, -1 guessed OUT, 0 abstain


def guess_membership(scores: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int) -> GuessOutcome:
    """Guess the ``k_plus`` highest-scoring canaries IN and the ``k_minus`` lowest OUT, then score.

    Ties in the scores are broken by canary order, which is independent of the inclusion bits.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise DataError("one score and one inclusion bit per canary are required")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > len(scores):
        raise PrivacyError(f"k+ = {k_plus} and k- = {k_minus} must be >= 0 and sum to at most {len(scores)}")
    order = np.argsort(-scores, kind="stable")
    guesses = np.zeros(len(scores), dtype=np.int8)
    guesses[order[:k_plus]] = 1
    if k_minus:
        guesses[order[-k_minus:]] = -1
    truth = np.where(included, 1, -1)
    correct = int(np.sum(guesses * truth > 0))
    return GuessOutcome(len(scores), k_plus + k_minus, correct, guesses)


@dataclasses.dataclass
class CanaryAuditResult:
    """The empirical ε lower bound of one canary audit, next to the ε the accountant claims.

    ``claimed_epsilon`` is None for the non-private sanity mode (σ = 0), which claims nothing.
    ``max_certifiable_epsilon`` is the bound had every guess been right: no audit of this size can
    show more. ``guess_accuracy_interval`` is the two-sided Clopper–Pearson interval of the guess
    accuracy at ``confidence``; ``epsilon_interval`` maps it through ``logit`` (the ε of randomized
    response with that accuracy, δ = 0), with None for an unbounded upper end.
    """

    epsilon_lower_bound: float
    claimed_epsilon: float | None
    exceeds_claim: bool
    confidence: float
    delta: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    k_plus: int
    k_minus: int
    noise_multiplier: float
    sample_rate: float
    steps: int
    max_grad_norm: float
    accountant: str
    max_certifiable_epsilon: float
    guess_accuracy: float | None
    guess_accuracy_interval: list[float]
    epsilon_interval: list[float | None]
    statement: str
    canary_kind: str = "mislabelled"
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _UnaccountedLedger:
    """Stands in for the ledger in the σ = 0 sanity mode only: it counts steps and claims no ε.

    A subsampled Gaussian with σ = 0 is not a DP mechanism, so no accountant can price it (the
    engine registers nothing for it); the non-private audit exists to show the attack works (its
    bound must come out clearly above 0).
    """

    def __init__(self) -> None:
        self.steps = 0

    def spend(self, name: str, steps: int = 1) -> None:
        self.steps += steps

    def epsilon(self) -> float:
        return math.inf


def inclusion_bits(num_canaries: int, seed: int | None = None) -> np.ndarray:
    """Which canaries enter training, each independently with probability ½.

    Drawn from OS entropy (``secrets``) unless a test passes ``seed``: a replayable choice would let
    a published config reveal the answer key of the audit.
    """
    import secrets

    generator = np.random.default_rng(seed if seed is not None else secrets.randbits(128))
    return generator.random(num_canaries) < 0.5


def mislabel(labels: np.ndarray, num_classes: int, generator: np.random.Generator) -> np.ndarray:
    """A wrong label for each example, uniform over the other classes (the canaries' labels)."""
    if num_classes < 2:
        raise DataError("mislabelled canaries need at least two classes")
    shift = generator.integers(1, num_classes, size=len(labels))
    return ((labels + shift) % num_classes).astype(np.int64)


def _audit_classifier(input_dim: int, num_classes: int, hidden: int) -> torch.nn.Module:
    import torch

    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(input_dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, num_classes)
    )


def _example_cross_entropy(model_call: Any, example: dict) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(model_call(example["image"][None]), example["label"][None])


def _resolve_noise(
    noise_multiplier: float | None, epsilon: float | None, delta: float, sample_rate: float, steps: int, accountant: str
) -> tuple[float, float | None]:
    """(σ, claimed ε): σ = 0 claims nothing; a given σ is priced; a given ε is calibrated."""
    if (noise_multiplier is None) == (epsilon is None):
        raise PrivacyError("give exactly one of noise_multiplier and epsilon to the canary audit")
    if noise_multiplier is not None:
        if noise_multiplier < 0:
            raise PrivacyError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        if noise_multiplier == 0:
            return 0.0, None
    from dpsynth.privacy import SubsampledGaussian, calibrate_noise, compute_epsilon

    if noise_multiplier is not None:
        claim = compute_epsilon(
            [SubsampledGaussian(AUDIT_MECHANISM, noise_multiplier, sample_rate, steps)], delta, accountant
        )
        return float(noise_multiplier), float(claim)
    sigma = calibrate_noise(epsilon, delta, sample_rate, steps, accountant=accountant)
    return float(sigma), float(epsilon)


def _audit_ledger(claim: float | None, delta: float, accountant: str) -> Any:
    """The audit training's own ledger, whose budget is exactly the claimed ε."""
    if claim is None:
        return _UnaccountedLedger()
    from dpsynth.privacy import PrivacyLedger

    # A hair of slack so that floating-point noise in re-computing the same composition never
    # refuses the last step; the reported claim is the ledger's own final ε, not this budget.
    return PrivacyLedger(claim * (1 + 1e-9) + 1e-9, delta, accountant=accountant)


@dataclasses.dataclass
class _CanarySetup:
    """The training set (base examples plus the included canaries) and the canaries to score."""

    train_images: Any
    train_labels: Any
    canary_images: Any
    canary_labels: Any
    included: np.ndarray


def choose_canaries(dataset: Any, num_canaries: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(canary indices, the other indices, the canaries' wrong labels) of ``dataset``: public choices from ``seed``."""
    if not 1 <= num_canaries < len(dataset):
        raise DataError(f"need 1 <= canaries < dataset size ({len(dataset)}), got {num_canaries}")
    public_rng = np.random.default_rng(seed)
    order = public_rng.permutation(len(dataset))
    canary_index, base_index = order[:num_canaries], order[num_canaries:]
    return canary_index, base_index, mislabel(dataset.labels[canary_index], dataset.num_classes, public_rng)


def _plant_canaries(dataset: Any, num_canaries: int, seed: int, inclusion_seed: int | None) -> _CanarySetup:
    """Mislabel ``num_canaries`` examples chosen with the public ``seed``; include each with probability ½."""
    import torch

    canary_index, base_index, wrong_labels = choose_canaries(dataset, num_canaries, seed)
    canary_labels = torch.from_numpy(wrong_labels)
    included = inclusion_bits(num_canaries, inclusion_seed)
    images, labels = dataset.to_tensors()
    canary_images = images[torch.from_numpy(canary_index)]
    keep = torch.from_numpy(included)
    return _CanarySetup(
        train_images=torch.cat([images[torch.from_numpy(base_index)], canary_images[keep]]),
        train_labels=torch.cat([labels[torch.from_numpy(base_index)], canary_labels[keep]]),
        canary_images=canary_images,
        canary_labels=canary_labels,
        included=included,
    )


def _train_and_score(
    setup: _CanarySetup,
    dataset: Any,
    ledger: Any,
    *,
    sigma: float,
    sample_rate: float,
    steps: int,
    max_grad_norm: float,
    lr: float,
    hidden: int,
    device: str,
    noise: Any,
    seed: int,
    batch_generator: Any,
    max_physical_batch_size: int,
) -> np.ndarray:
    """DP-SGD on the canary training set with dpsynth's own engine; returns each canary's loss."""
    import torch

    from dpsynth.dpsgd import DPSGDEngine, PoissonSampler

    train_images, train_labels = setup.train_images.to(device), setup.train_labels.to(device)
    torch.manual_seed(seed)
    model = _audit_classifier(int(np.prod(dataset.image_shape)), dataset.num_classes, hidden).to(device)
    num_train = len(train_labels)
    engine = DPSGDEngine(
        model,
        torch.optim.Adam(model.parameters(), lr=lr),
        _example_cross_entropy,
        ledger,
        noise_multiplier=sigma,
        max_grad_norm=max_grad_norm,
        sample_rate=sample_rate,
        expected_batch_size=sample_rate * num_train,
        max_physical_batch_size=max_physical_batch_size,
        mechanism_name=AUDIT_MECHANISM,
        noise=noise,
    )
    for batch_index in PoissonSampler(num_train, sample_rate, generator=batch_generator, num_steps=steps):
        batch_index = batch_index.to(device)
        engine.step({"image": train_images[batch_index], "label": train_labels[batch_index]})
    with torch.no_grad():
        model.eval()
        return (
            torch.nn.functional.cross_entropy(
                model(setup.canary_images.to(device)), setup.canary_labels.to(device), reduction="none"
            )
            .cpu()
            .numpy()
        )


def guess_counts(num_canaries: int, k_plus: int | None, k_minus: int | None) -> tuple[int, int]:
    """(k+, k-): the numbers of IN and OUT guesses, m/10 each by default."""
    k_plus = max(1, num_canaries // 10) if k_plus is None else int(k_plus)
    k_minus = max(1, num_canaries // 10) if k_minus is None else int(k_minus)
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > num_canaries:
        raise PrivacyError(f"k+ = {k_plus} and k- = {k_minus} must be >= 0 and sum to at most {num_canaries}")
    return k_plus, k_minus


def canary_audit(
    dataset: Any,
    *,
    num_canaries: int = 100,
    noise_multiplier: float | None = None,
    epsilon: float | None = None,
    delta: float = 1e-5,
    sample_rate: float = 0.05,
    steps: int = 200,
    max_grad_norm: float = 1.0,
    lr: float = 0.01,
    hidden: int = 128,
    k_plus: int | None = None,
    k_minus: int | None = None,
    beta: float = 0.05,
    accountant: str = "prv",
    device: str = "cpu",
    noise: Any = None,
    inclusion_seed: int | None = None,
    seed: int = 0,
    batch_generator: Any = None,
    max_physical_batch_size: int = 256,
) -> CanaryAuditResult:
    """One-run audit of dpsynth's DP-SGD (Steinke, Nasr & Jagielski, 2023, §3 and Algorithm 1).

    ``num_canaries`` examples of ``dataset`` (an ``ImageDataset``) get a wrong label and become the
    canaries; the rest is the fixed training set. Each canary joins it with probability ½
    (:func:`inclusion_bits`). A small MLP is trained with :class:`dpsynth.dpsgd.DPSGDEngine` under
    Poisson sampling (rate ``sample_rate``, ``steps`` steps, clip ``max_grad_norm``) and the noise
    multiplier given, or calibrated to ``epsilon``; ``noise_multiplier=0`` is the non-private sanity
    mode. Each canary is scored by minus its loss under the final model (a black-box, last-iterate
    attacker); the ``k_plus`` best are guessed IN, the ``k_minus`` worst OUT (default m/10 each) and
    :func:`~dpsynth.metrics.audit_stats.epsilon_lower_bound` turns the correct guesses into an empirical
    ε lower bound at confidence 1 - β.

    ``seed`` drives only public choices (which examples become canaries, their wrong labels, the
    initialisation); DP noise and batch sampling come from entropy unless a test passes ``noise``
    and ``batch_generator`` (a ``torch.Generator``).
    """
    started = time.time()
    if not 1 <= num_canaries < len(dataset):
        raise DataError(f"need 1 <= canaries < dataset size ({len(dataset)}), got {num_canaries}")
    k_plus, k_minus = guess_counts(num_canaries, k_plus, k_minus)
    sigma, claim = _resolve_noise(noise_multiplier, epsilon, delta, sample_rate, steps, accountant)
    setup = _plant_canaries(dataset, num_canaries, seed, inclusion_seed)
    ledger = _audit_ledger(claim, delta, accountant)
    losses = _train_and_score(
        setup,
        dataset,
        ledger,
        sigma=sigma,
        sample_rate=sample_rate,
        steps=steps,
        max_grad_norm=max_grad_norm,
        lr=lr,
        hidden=hidden,
        device=device,
        noise=noise,
        seed=seed,
        batch_generator=batch_generator,
        max_physical_batch_size=max_physical_batch_size,
    )
    outcome = guess_membership(-losses, setup.included, k_plus, k_minus)
    claimed = float(ledger.epsilon()) if claim is not None else None
    return CanaryAuditResult(
        claimed_epsilon=claimed,
        delta=delta,
        k_plus=k_plus,
        k_minus=k_minus,
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        steps=steps,
        max_grad_norm=max_grad_norm,
        accountant=accountant,
        seconds=time.time() - started,
        **bound_summary(outcome, delta, beta, claimed),
    )


def bound_summary(outcome: GuessOutcome, delta: float, beta: float, claimed: float | None) -> dict[str, Any]:
    """The empirical ε lower bound of ``outcome``, its intervals, the most this audit could certify, the claim check."""
    guesses, correct = outcome.num_guesses, outcome.num_correct
    bound = epsilon_lower_bound(outcome.num_canaries, guesses, correct, delta, beta)
    most = max_certifiable_epsilon(outcome.num_canaries, guesses, delta, beta)
    accuracy_interval = clopper_pearson(correct, guesses, 1.0 - beta)
    return {
        "epsilon_lower_bound": bound,
        "exceeds_claim": claimed is not None and bound > claimed,
        "confidence": 1.0 - beta,
        "num_canaries": outcome.num_canaries,
        "num_guesses": guesses,
        "num_correct": correct,
        "max_certifiable_epsilon": most,
        "guess_accuracy": correct / guesses if guesses else None,
        "guess_accuracy_interval": list(accuracy_interval),
        "epsilon_interval": [accuracy_epsilon(accuracy_interval[0]), accuracy_epsilon(accuracy_interval[1])],
        "statement": STATEMENT.format(confidence=1.0 - beta, max_certifiable=most, guesses=guesses),
    }
