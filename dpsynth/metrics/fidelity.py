"""Fidelity metrics on TF-Inception pool features (docs/contract.md, "Evaluation protocol").

* FID (Heusel et al., 2017): Fréchet distance between Gaussians fitted to real and synthetic
  features, ``|mu_r - mu_s|^2 + Tr(S_r + S_s - 2 (S_r S_s)^(1/2))``.
* KID (Bińkowski et al., 2018): unbiased MMD^2 with the cubic polynomial kernel
  ``k(x, y) = (x·y / d + 1)^3``, averaged over random subsets; unbiased, so ≈ 0 for equal distributions.
* Precision / recall (Kynkäänniemi et al., 2019) with k = 4: the real manifold is the union of
  balls around each real feature reaching its k-th nearest real neighbour; precision is the share of
  synthetic features inside it, recall the share of real features inside the synthetic manifold.
* Inception Score (Salimans et al., 2016): ``exp E_x KL(p(y|x) || p(y))``. It needs the Inception
  classifier's class probabilities; the shipped TorchScript network ends at the pool layer and
  has no logits, so ``evaluate`` reports ``is`` as null with the reason unless a TorchScript
  network returning logits is given (:func:`inception_score` itself works on any probability matrix).

Everything here is computed on real private images, but only for the data custodian's report: the
reference features never leave the machine and are not part of the synthetic release.
"""

from __future__ import annotations

import numpy as np
import torch

from dpsynth.errors import DataError

PRECISION_RECALL_K = 4


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``[d]`` and unbiased covariance ``[d, d]`` of ``features [N, d]`` (float64)."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) < 2:
        raise DataError(f"FID needs at least 2 feature vectors, got shape {features.shape}")
    return features.mean(axis=0), np.cov(features, rowvar=False)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2).

    ``Tr((S1 S2)^(1/2))`` is computed as the sum of square roots of the eigenvalues of the
    symmetric PSD matrix ``S1^(1/2) S2 S1^(1/2)`` (same spectrum as ``S1 S2``), which stays real and
    stable when the covariances are singular (fewer samples than 2048 dimensions).
    """
    eigvals, eigvecs = np.linalg.eigh(sigma1)
    sqrt_sigma1 = (eigvecs * np.sqrt(np.clip(eigvals, 0.0, None))) @ eigvecs.T
    middle = sqrt_sigma1 @ sigma2 @ sqrt_sigma1
    trace_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0.0, None)).sum()
    diff = mu1 - mu2
    value = float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * trace_sqrt)
    return max(value, 0.0)


def fid(real_features: np.ndarray, fake_features: np.ndarray) -> float:
    """FID between two feature sets.

    With fewer vectors than dimensions on each side, the same value from the features themselves: each
    covariance is ``S = A^T A`` with ``A`` the centred features over ``sqrt(n - 1)``, so ``Tr(S)`` is the squared
    norm of ``A`` and the nonzero eigenvalues of ``S_r S_s`` are those of ``M M^T`` with ``M = A_r A_s^T``, whence
    ``Tr((S_r S_s)^(1/2))`` is the sum of the singular values of ``M``: an ``[n_r, n_s]`` problem instead of
    three ``[d, d]`` eigendecompositions (seconds each at the pool layer's d = 2048).
    """
    real, fake = np.asarray(real_features, dtype=np.float64), np.asarray(fake_features, dtype=np.float64)
    same_dimension = real.ndim == fake.ndim == 2 and real.shape[1] == fake.shape[1]
    if not (same_dimension and 2 <= len(real) < real.shape[1] and 2 <= len(fake) < fake.shape[1]):
        return frechet_distance(*feature_statistics(real), *feature_statistics(fake))
    real_mean, fake_mean = real.mean(axis=0), fake.mean(axis=0)
    a = (real - real_mean) / np.sqrt(len(real) - 1)
    b = (fake - fake_mean) / np.sqrt(len(fake) - 1)
    trace_sqrt = np.linalg.svd(a @ b.T, compute_uv=False).sum()
    diff = real_mean - fake_mean
    return max(float(diff @ diff + np.sum(a * a) + np.sum(b * b) - 2.0 * trace_sqrt), 0.0)


def _polynomial_kernel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a @ b.T / a.shape[1] + 1.0) ** 3


def kid(
    real_features: np.ndarray, fake_features: np.ndarray, num_subsets: int = 100, subset_size: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """KID: mean and std over subsets of the unbiased MMD^2 estimate (polynomial kernel)."""
    real = np.asarray(real_features, dtype=np.float64)
    fake = np.asarray(fake_features, dtype=np.float64)
    size = min(subset_size, len(real), len(fake))
    if size < 2:
        raise DataError("KID needs at least 2 real and 2 synthetic feature vectors")
    rng = np.random.default_rng(seed)  # subsets only pick which features to compare: not DP noise
    estimates = []
    for _ in range(num_subsets):
        x = real[rng.choice(len(real), size, replace=False)]
        y = fake[rng.choice(len(fake), size, replace=False)]
        k_xx, k_yy, k_xy = _polynomial_kernel(x, x), _polynomial_kernel(y, y), _polynomial_kernel(x, y)
        off_diagonal = size * (size - 1)
        mmd = (
            (k_xx.sum() - np.trace(k_xx)) / off_diagonal
            + (k_yy.sum() - np.trace(k_yy)) / off_diagonal
            - 2.0 * k_xy.mean()
        )
        estimates.append(mmd)
    return float(np.mean(estimates)), float(np.std(estimates))


def _kth_neighbour_radii(features: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """Distance from each point to its k-th nearest neighbour among the others in the same set."""
    radii = []
    for start in range(0, len(features), chunk):
        distances = torch.cdist(features[start : start + chunk], features)
        # The 0-th smallest is the point itself (distance 0), so the k-th neighbour is index k.
        radii.append(distances.kthvalue(k + 1, dim=1).values)
    return torch.cat(radii)


def _coverage(manifold: torch.Tensor, radii: torch.Tensor, queries: torch.Tensor, chunk: int) -> float:
    """Share of ``queries`` inside at least one ball (manifold[i], radii[i])."""
    inside = []
    for start in range(0, len(queries), chunk):
        distances = torch.cdist(queries[start : start + chunk], manifold)
        inside.append((distances <= radii[None, :]).any(dim=1))
    return float(torch.cat(inside).double().mean())


def precision_recall(
    real_features: np.ndarray, fake_features: np.ndarray, k: int = PRECISION_RECALL_K, chunk: int = 1024
) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al., 2019, k-NN manifolds, default k = 4)."""
    real = torch.as_tensor(np.asarray(real_features), dtype=torch.float64)
    fake = torch.as_tensor(np.asarray(fake_features), dtype=torch.float64)
    if len(real) <= k or len(fake) <= k:
        raise DataError(f"precision/recall with k={k} needs more than {k} real and synthetic images")
    real_radii = _kth_neighbour_radii(real, k, chunk)
    fake_radii = _kth_neighbour_radii(fake, k, chunk)
    precision = _coverage(real, real_radii, fake, chunk)
    recall = _coverage(fake, fake_radii, real, chunk)
    return precision, recall


def inception_score(probabilities: np.ndarray, splits: int = 10) -> tuple[float, float]:
    """Inception Score ``exp(E_x KL(p(y|x) || p(y)))`` per split: (mean, std) over ``splits`` chunks."""
    probs = np.asarray(probabilities, dtype=np.float64)
    if probs.ndim != 2 or len(probs) < splits:
        raise DataError(f"IS needs [N, classes] probabilities with N >= {splits}, got {probs.shape}")
    scores = []
    for part in np.array_split(probs, splits):
        marginal = part.mean(axis=0, keepdims=True)
        kl = (part * (np.log(np.clip(part, 1e-12, None)) - np.log(np.clip(marginal, 1e-12, None)))).sum(axis=1)
        scores.append(np.exp(kl.mean()))
    return float(np.mean(scores)), float(np.std(scores))


IS_UNAVAILABLE = (
    "the Inception Score needs Inception class logits; the TF-Inception TorchScript "
    "network (fid-helper default_1.pt) returns only 2048-d pool features"
)


def compute_fidelity(
    real_features: np.ndarray,
    fake_features: np.ndarray,
    metrics: list[str],
    kid_subsets: int = 100,
    kid_subset_size: int = 1000,
) -> dict[str, float | dict]:
    """The requested subset of ``fid``, ``kid``, ``precision``, ``recall`` from two feature sets."""
    result: dict[str, float | dict] = {}
    if "fid" in metrics:
        result["fid"] = fid(real_features, fake_features)
    if "kid" in metrics:
        mean, std = kid(real_features, fake_features, kid_subsets, kid_subset_size)
        result["kid"] = {"mean": mean, "std": std}
    if "precision" in metrics or "recall" in metrics:
        precision, recall = precision_recall(real_features, fake_features)
        if "precision" in metrics:
            result["precision"] = precision
        if "recall" in metrics:
            result["recall"] = recall
    return result
