"""Privacy audit: membership inference and a one-run canary audit (docs/audit.md).

Two complementary empirical checks of what a run leaks (DESIGN.md, "Evaluation protocol"):

* **Membership inference** (privimage.txt appendix A): an attacker scores every private train
  example (member) and every private val example (non-member); we report the ROC AUC and the true
  positive rate at a 10 % false positive rate (TPR@10%FPR; random guessing gives 0.10).
  Two attacks: the loss threshold attack on a released model (Yeom et al., 2018: low loss = member),
  and the nearest-neighbour distance attack on released samples (a member that the generator
  memorised lies close to some synthetic image).
* **Canary audit** (Steinke, Nasr & Jagielski, 2023, "Privacy Auditing with One (1) Training Run"):
  m canaries each enter the training set with probability 1/2, the trained model scores them, the
  auditor guesses the k+ highest-scoring as IN and the k- lowest as OUT, and the number of correct
  guesses becomes an ε lower bound at confidence 1 - β. A lower bound above the ledger's claimed ε
  proves a bug in the private training (or the accounting).

The audit reads private data but is not itself a ledger mechanism: its figures are for the data
custodian who runs it and are not differentially private. They must not be released alongside
the synthetic data as if they were covered by the run's guarantee (docs/audit.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from dpsynth.errors import DataError, PrivacyError

DEFAULT_FPR = 0.10


# --------------------------------------------------------------------------------------------
# Membership inference on arrays
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class AttackResult:
    """Outcome of one membership-inference attack; scores are "higher = more likely a member"."""

    attack: str
    auc: float
    tpr_at_fpr: float
    fpr: float
    num_members: int
    num_nonmembers: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def roc_curve(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ROC of the threshold attack "member iff score >= t", over every distinct threshold t.

    Returns (fpr, tpr), both starting at 0 (threshold +inf) and ending at 1. Tied scores move
    together, so a tie never counts as a partial detection.
    """
    members = _finite_scores(member_scores, "member")
    nonmembers = _finite_scores(nonmember_scores, "non-member")
    scores = np.concatenate([members, nonmembers])
    is_member = np.concatenate([np.ones(len(members)), np.zeros(len(nonmembers))])
    order = np.argsort(-scores, kind="stable")
    scores, is_member = scores[order], is_member[order]
    # Last position of each run of equal scores: the ROC only has points between distinct scores.
    boundaries = np.flatnonzero(np.diff(scores) != 0)
    last_of_tie = np.concatenate([boundaries, [len(scores) - 1]])
    true_positives = np.cumsum(is_member)[last_of_tie]
    false_positives = (last_of_tie + 1) - true_positives
    tpr = np.concatenate([[0.0], true_positives / len(members)])
    fpr = np.concatenate([[0.0], false_positives / len(nonmembers)])
    return fpr, tpr


def roc_auc(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> float:
    """Area under the ROC curve: P(member score > non-member score) + ½ P(tie)."""
    fpr, tpr = roc_curve(member_scores, nonmember_scores)
    return float(np.trapezoid(tpr, fpr))


def tpr_at_fpr(member_scores: np.ndarray, nonmember_scores: np.ndarray, fpr: float = DEFAULT_FPR) -> float:
    """Largest true positive rate of a threshold whose false positive rate is at most ``fpr``.

    This is the TPR@10%FPR of privimage.txt appendix A (with ``fpr=0.1``); an attack that guesses
    at random scores about ``fpr``.
    """
    if not 0.0 <= fpr <= 1.0:
        raise ValueError(f"fpr must lie in [0, 1], got {fpr}")
    curve_fpr, curve_tpr = roc_curve(member_scores, nonmember_scores)
    return float(curve_tpr[curve_fpr <= fpr + 1e-12].max())


def membership_attack(member_scores: np.ndarray, nonmember_scores: np.ndarray, attack: str,
                      fpr: float = DEFAULT_FPR) -> AttackResult:
    """AUC and TPR at ``fpr`` of an attack given its scores (higher = member)."""
    return AttackResult(
        attack=attack,
        auc=roc_auc(member_scores, nonmember_scores),
        tpr_at_fpr=tpr_at_fpr(member_scores, nonmember_scores, fpr),
        fpr=fpr,
        num_members=int(np.size(member_scores)),
        num_nonmembers=int(np.size(nonmember_scores)),
    )


def loss_attack(member_losses: np.ndarray, nonmember_losses: np.ndarray,
                fpr: float = DEFAULT_FPR) -> AttackResult:
    """Loss threshold attack (Yeom et al., 2018): a model fits its training examples better."""
    return membership_attack(-np.asarray(member_losses, np.float64),
                             -np.asarray(nonmember_losses, np.float64), "loss", fpr)


def nearest_neighbour_distances(queries: np.ndarray, references: np.ndarray, chunk: int = 512) -> np.ndarray:
    """Euclidean distance from each query image to its nearest reference image.

    Images are compared as flat vectors with pixels scaled to [0, 1]; ``queries`` and
    ``references`` must share their per-image shape (uint8 ``[N, H, W, C]`` or float).
    """
    queries_flat = _flat_unit(queries)
    references_flat = _flat_unit(references)
    if queries_flat.shape[1] != references_flat.shape[1]:
        raise DataError(f"cannot compare images of shape {np.shape(queries)[1:]} with {np.shape(references)[1:]}")
    if len(references_flat) == 0:
        raise DataError("nearest-neighbour attack needs at least one synthetic sample")
    reference_norms = np.einsum("ij,ij->i", references_flat, references_flat)
    nearest = np.empty(len(queries_flat))
    for start in range(0, len(queries_flat), chunk):
        block = queries_flat[start:start + chunk]
        # ||a - b||² = ||a||² - 2 a·b + ||b||², one matrix product per chunk.
        squared = (np.einsum("ij,ij->i", block, block)[:, None] - 2.0 * block @ references_flat.T
                   + reference_norms[None, :])
        nearest[start:start + chunk] = np.sqrt(np.maximum(squared.min(axis=1), 0.0))
    return nearest


def nearest_neighbour_attack(members: np.ndarray, nonmembers: np.ndarray, synthetic: np.ndarray,
                             fpr: float = DEFAULT_FPR) -> AttackResult:
    """Distance-to-closest-record attack on released samples: closer to a sample = member."""
    return membership_attack(-nearest_neighbour_distances(members, synthetic),
                             -nearest_neighbour_distances(nonmembers, synthetic), "nearest_neighbour", fpr)


def _finite_scores(scores: np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(scores, dtype=np.float64).ravel()
    if array.size == 0:
        raise DataError(f"membership inference needs at least one {what} score")
    if not np.all(np.isfinite(array)):
        raise DataError(f"{what} scores contain NaN or infinity")
    return array


def _flat_unit(images: np.ndarray) -> np.ndarray:
    array = np.asarray(images)
    flat = array.reshape(len(array), -1).astype(np.float64)
    return flat / 255.0 if array.dtype == np.uint8 else flat


# --------------------------------------------------------------------------------------------
# One-run ε lower bound (Steinke, Nasr & Jagielski, 2023)
# --------------------------------------------------------------------------------------------

def audit_p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[at least ``num_correct`` right guesses] if the training is (ε, δ)-DP.

    Steinke, Nasr & Jagielski (2023), Theorem 3 (the (ε, δ) case of their main result): let
    ``S ∈ {-1, +1}^m`` be the uniform inclusion signs of the m canaries, ``T`` the auditor's
    guesses with ``||T||₁ = r`` non-abstentions and ``W = Σ_i max(0, T_i S_i)`` the correct ones.
    With ``f(v) = P[Binomial(r, p) >= v]`` and ``p = e^ε / (1 + e^ε)`` (the accuracy of ε-DP
    randomized response),

        P[W >= v] <= f(v) + 2 m δ · max_{1 <= i <= m} (f(v - i) - f(v)) / i.

    ``f(v - i) - f(v) = P[v - i <= Binomial(r, p) < v]`` only grows by the pmf terms below v; for
    i > v it stays at ``P[Binomial < v]`` while i grows, so the maximum is reached for i <= v.
    """
    _check_audit_counts(num_canaries, num_guesses, num_correct)
    if epsilon < 0 or not 0.0 <= delta <= 1.0:
        raise PrivacyError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    if num_correct == 0:
        return 1.0
    accuracy = float(scipy.special.expit(epsilon))
    tail = float(scipy.stats.binom.sf(num_correct - 1, num_guesses, accuracy))  # f(v)
    # pmf(v - 1), pmf(v - 2), ..., pmf(0): cumulative sums give f(v - i) - f(v) for i = 1..v.
    below = scipy.stats.binom.pmf(np.arange(num_correct - 1, -1, -1), num_guesses, accuracy)
    window = np.cumsum(below)
    slope = float(np.max(window / np.arange(1, num_correct + 1)))
    return min(1.0, tail + 2.0 * num_canaries * delta * slope)


def epsilon_lower_bound(num_canaries: int, num_guesses: int, num_correct: int, delta: float,
                        beta: float = 0.05, epsilon_max: float = 100.0) -> float:
    """The ε lower bound at confidence ``1 - β`` from an observed number of correct guesses.

    Every ε whose p-value (:func:`audit_p_value`) is at most β is rejected: were the training
    (ε, δ)-DP, seeing this many correct guesses would have probability at most β. The bound is
    the infimum of the ε that are *not* rejected (Steinke et al. 2023, Algorithm 2 solves the same
    equation by bisection). The p-value is continuous in ε and tends to 1 as ε grows, so the root
    of ``p(ε) = β`` is found with Brent's method; a grid check below the root guards the claim
    "every smaller ε is rejected" against a non-monotone δ term.
    """
    _check_audit_counts(num_canaries, num_guesses, num_correct)
    if not 0.0 < beta < 1.0:
        raise PrivacyError(f"confidence parameter beta must lie in (0, 1), got {beta}")

    def excess(epsilon: float) -> float:
        return audit_p_value(num_canaries, num_guesses, num_correct, epsilon, delta) - beta

    if excess(0.0) > 0.0:
        return 0.0
    if excess(epsilon_max) <= 0.0:
        return epsilon_max
    root = float(scipy.optimize.brentq(excess, 0.0, epsilon_max, xtol=1e-9, rtol=1e-12))
    grid = np.linspace(0.0, root, 65)
    not_rejected = [eps for eps in grid if excess(float(eps)) > 0.0]
    return float(not_rejected[0]) if not_rejected else root


def _check_audit_counts(num_canaries: int, num_guesses: int, num_correct: int) -> None:
    if not 0 <= num_correct <= num_guesses <= num_canaries:
        raise PrivacyError(
            f"need 0 <= correct ({num_correct}) <= guesses ({num_guesses}) <= canaries ({num_canaries})"
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


# --------------------------------------------------------------------------------------------
# Canary audit: a small DP-SGD training with canaries, scored by loss
# --------------------------------------------------------------------------------------------

AUDIT_MECHANISM = "canary_audit"


@dataclasses.dataclass
class CanaryAuditResult:
    """The empirical ε lower bound of one canary audit, next to the ε the accountant claims.

    ``claimed_epsilon`` is None for the non-private sanity mode (σ = 0), which claims nothing.
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


def _audit_classifier(input_dim: int, num_classes: int, hidden: int) -> "torch.nn.Module":
    import torch

    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(input_dim, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, num_classes))


def _example_cross_entropy(model_call: Any, example: dict) -> "torch.Tensor":
    import torch.nn.functional as F

    return F.cross_entropy(model_call(example["image"][None]), example["label"][None])


def _resolve_noise(noise_multiplier: float | None, epsilon: float | None, delta: float, sample_rate: float,
                   steps: int, accountant: str) -> tuple[float, float | None]:
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
        claim = compute_epsilon([SubsampledGaussian(AUDIT_MECHANISM, noise_multiplier, sample_rate, steps)],
                                delta, accountant)
        return float(noise_multiplier), float(claim)
    sigma = calibrate_noise(epsilon, delta, sample_rate, steps, accountant=accountant)
    return float(sigma), float(epsilon)


def canary_audit(dataset: Any, *, num_canaries: int = 100, noise_multiplier: float | None = None,
                 epsilon: float | None = None, delta: float = 1e-5, sample_rate: float = 0.05,
                 steps: int = 200, max_grad_norm: float = 1.0, lr: float = 0.01, hidden: int = 128,
                 k_plus: int | None = None, k_minus: int | None = None, beta: float = 0.05,
                 accountant: str = "prv", device: str = "cpu", noise: Any = None,
                 inclusion_seed: int | None = None, seed: int = 0, batch_generator: Any = None,
                 max_physical_batch_size: int = 256) -> CanaryAuditResult:
    """One-run audit of dpsynth's DP-SGD (Steinke, Nasr & Jagielski, 2023, §3 and Algorithm 1).

    ``num_canaries`` examples of ``dataset`` (an ``ImageDataset``) get a wrong label and become the
    canaries; the rest is the fixed training set. Each canary joins it with probability ½
    (:func:`inclusion_bits`). A small MLP is trained with :class:`dpsynth.dpsgd.DPSGDEngine` under
    Poisson sampling (rate ``sample_rate``, ``steps`` steps, clip ``max_grad_norm``) and the noise
    multiplier given, or calibrated to ``epsilon``; ``noise_multiplier=0`` is the non-private sanity
    mode. Each canary is scored by minus its loss under the final model (a black-box, last-iterate
    attacker); the ``k_plus`` best are guessed IN, the ``k_minus`` worst OUT (default m/10 each) and
    :func:`epsilon_lower_bound` turns the correct guesses into an ε lower bound at confidence 1 - β.

    ``seed`` drives only public choices (which examples become canaries, their wrong labels, the
    initialisation); DP noise and batch sampling come from entropy unless a test passes ``noise``
    and ``batch_generator`` (a ``torch.Generator``).
    """
    import time

    import torch

    from dpsynth.dpsgd import DPSGDEngine, PoissonSampler

    started = time.time()
    if not 1 <= num_canaries < len(dataset):
        raise DataError(f"need 1 <= canaries < dataset size ({len(dataset)}), got {num_canaries}")
    k_plus = max(1, num_canaries // 10) if k_plus is None else int(k_plus)
    k_minus = max(1, num_canaries // 10) if k_minus is None else int(k_minus)
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > num_canaries:
        raise PrivacyError(f"k+ = {k_plus} and k- = {k_minus} must be >= 0 and sum to at most {num_canaries}")
    sigma, claim = _resolve_noise(noise_multiplier, epsilon, delta, sample_rate, steps, accountant)

    public_rng = np.random.default_rng(seed)
    order = public_rng.permutation(len(dataset))
    canary_index, base_index = order[:num_canaries], order[num_canaries:]
    canary_labels = mislabel(dataset.labels[canary_index], dataset.num_classes, public_rng)
    included = inclusion_bits(num_canaries, inclusion_seed)

    images, labels = dataset.to_tensors()
    canary_images = images[torch.from_numpy(canary_index)]
    canary_targets = torch.from_numpy(canary_labels)
    keep = torch.from_numpy(included)
    train_images = torch.cat([images[torch.from_numpy(base_index)], canary_images[keep]]).to(device)
    train_labels = torch.cat([labels[torch.from_numpy(base_index)], canary_targets[keep]]).to(device)

    torch.manual_seed(seed)
    model = _audit_classifier(int(np.prod(dataset.image_shape)), dataset.num_classes, hidden).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    ledger = _audit_ledger(claim, sample_rate, delta, accountant)
    num_train = len(train_labels)
    engine = DPSGDEngine(model, optimizer, _example_cross_entropy, ledger, noise_multiplier=sigma,
                         max_grad_norm=max_grad_norm, sample_rate=sample_rate,
                         expected_batch_size=sample_rate * num_train,
                         max_physical_batch_size=max_physical_batch_size, mechanism_name=AUDIT_MECHANISM,
                         noise=noise)
    sampler = PoissonSampler(num_train, sample_rate, generator=batch_generator, num_steps=steps)
    for batch_index in sampler:
        batch_index = batch_index.to(device)
        engine.step({"image": train_images[batch_index], "label": train_labels[batch_index]})

    with torch.no_grad():
        model.eval()
        losses = torch.nn.functional.cross_entropy(model(canary_images.to(device)), canary_targets.to(device),
                                                   reduction="none").cpu().numpy()
    outcome = guess_membership(-losses, included, k_plus, k_minus)
    bound = epsilon_lower_bound(num_canaries, outcome.num_guesses, outcome.num_correct, delta, beta)
    claimed = float(ledger.epsilon()) if claim is not None else None
    return CanaryAuditResult(
        epsilon_lower_bound=bound, claimed_epsilon=claimed,
        exceeds_claim=claimed is not None and bound > claimed, confidence=1.0 - beta, delta=delta,
        num_canaries=num_canaries, num_guesses=outcome.num_guesses, num_correct=outcome.num_correct,
        k_plus=k_plus, k_minus=k_minus, noise_multiplier=sigma, sample_rate=sample_rate, steps=steps,
        max_grad_norm=max_grad_norm, accountant=accountant, seconds=time.time() - started)


def _audit_ledger(claim: float | None, sample_rate: float, delta: float, accountant: str) -> Any:
    """The audit training's own ledger, whose budget is exactly the claimed ε."""
    if claim is None:
        return _UnaccountedLedger()
    from dpsynth.privacy import PrivacyLedger

    # A hair of slack so that floating-point noise in re-computing the same composition never
    # refuses the last step; the reported claim is the ledger's own final ε, not this budget.
    return PrivacyLedger(claim * (1 + 1e-9) + 1e-9, delta, accountant=accountant)


# --------------------------------------------------------------------------------------------
# Auditing a finished run
# --------------------------------------------------------------------------------------------

CANARY_MAX_STEPS = 300


def audit_run(run_dir: Any, *, membership: bool = True, canary: bool = False, max_examples: int = 1000,
              fpr: float = DEFAULT_FPR, canary_options: dict[str, Any] | None = None, seed: int = 0,
              write: bool = True) -> dict[str, Any]:
    """Audit a run directory; returns the figures and writes them to ``run_dir/audit.json``.

    * Nearest-neighbour attack on ``samples.npz`` (always, when samples exist): members are up to
      ``max_examples`` private train images, non-members as many private val images.
    * Loss attack when the run's method implements ``Method.example_losses(ctx, images uint8
      [N,H,W,C], labels int64 [N]) -> float array [N]`` (the per-example loss of its released
      model; the base class returns None: nothing to score; docs/audit.md).
    * With ``canary=True``, :func:`canary_audit` on the run's private train split at the σ and
      sample rate of the run's DP-SGD mechanism (from ``privacy.json``), for at most
      ``CANARY_MAX_STEPS`` steps; ``canary_options`` overrides its keyword arguments.

    The data are loaded exactly as the run loaded them (same config, same split seed).
    """
    from pathlib import Path

    from dpsynth.runner import open_run

    run_dir = Path(run_dir)
    ctx, method = open_run(run_dir, echo=False)
    report: dict[str, Any] = {"membership_inference": {}, "skipped": {},
                              "note": "audit figures read private data and are not differentially private"}
    if membership:
        members, nonmembers = _balanced_members(ctx.data.train, ctx.data.val, max_examples, seed)
        samples_path = run_dir / "samples.npz"
        if samples_path.is_file():
            with np.load(samples_path) as archive:
                synthetic = archive["images"]
            report["membership_inference"]["nearest_neighbour"] = nearest_neighbour_attack(
                members.images, nonmembers.images, synthetic, fpr).to_dict()
        else:
            report["skipped"]["nearest_neighbour"] = "samples.npz not found"
        member_losses = method.example_losses(ctx, members.images, members.labels)
        if member_losses is not None:
            nonmember_losses = method.example_losses(ctx, nonmembers.images, nonmembers.labels)
            report["membership_inference"]["loss"] = loss_attack(np.asarray(member_losses, np.float64),
                                                                 np.asarray(nonmember_losses, np.float64), fpr).to_dict()
        else:
            report["skipped"]["loss"] = f"method {method.name!r} exposes no example_losses hook"
    if canary:
        report["canary"] = _canary_for_run(run_dir, ctx, canary_options or {}, seed)
        if "skipped" in report["canary"]:
            report["skipped"]["canary"] = report["canary"].pop("skipped")
            del report["canary"]
    if write:
        from dpsynth.checkpoint import atomic_write_json

        atomic_write_json(run_dir / "audit.json", report)
    return report


def _balanced_members(train: Any, val: Any, max_examples: int, seed: int) -> tuple[Any, Any]:
    """Equal-size random subsets of the private train (members) and val (non-members) splits."""
    count = min(len(train), len(val), int(max_examples))
    if count < 1:
        raise DataError("membership inference needs non-empty private train and val splits")
    generator = np.random.default_rng(seed)
    return (train.subset(np.sort(generator.choice(len(train), count, replace=False))),
            val.subset(np.sort(generator.choice(len(val), count, replace=False))))


def _canary_for_run(run_dir: Any, ctx: Any, options: dict[str, Any], seed: int) -> dict[str, Any]:
    """The canary audit at the run's own DP-SGD noise multiplier and sample rate."""
    import json

    privacy_path = run_dir / "privacy.json"
    if not privacy_path.is_file():
        return {"skipped": "privacy.json not found"}
    privacy = json.loads(privacy_path.read_text())
    dpsgd = [m for m in privacy.get("mechanisms", []) if m.get("kind") == "subsampled_gaussian" and m.get("steps")]
    if not dpsgd and "noise_multiplier" not in options:
        return {"skipped": "the run has no DP-SGD mechanism to mirror"}
    settings: dict[str, Any] = {"delta": float(privacy.get("delta", 1e-5)),
                                "accountant": privacy.get("accountant", "prv"), "seed": seed}
    if dpsgd:
        main = max(dpsgd, key=lambda m: m["steps"])
        settings.update(noise_multiplier=float(main["noise_multiplier"]), sample_rate=float(main["sample_rate"]),
                        steps=min(int(main["steps"]), CANARY_MAX_STEPS))
    settings["num_canaries"] = min(100, max(2, len(ctx.data.train) // 10))
    settings.update(options)
    result = canary_audit(ctx.data.train, **settings).to_dict()
    result["run_claimed_epsilon"] = privacy.get("epsilon")
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m dpsynth.eval.audit RUN_DIR [--canary] [--max-examples N]``: audit one run, print JSON."""
    import argparse
    import json
    import sys

    from dpsynth.errors import DPSynthError

    parser = argparse.ArgumentParser(prog="python -m dpsynth.eval.audit", description=main.__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--canary", action="store_true", help="also run the canary audit at the run's sigma and q")
    parser.add_argument("--max-examples", type=int, default=1000, help="members (and non-members) attacked")
    args = parser.parse_args(argv)
    try:
        report = audit_run(args.run_dir, canary=args.canary, max_examples=args.max_examples)
    except DPSynthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
