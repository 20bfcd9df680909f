"""The Gaussian sum of clipped per-example vectors, and a Gaussian count.

A one-off (full-batch) Gaussian mechanism over the whole private set (Dwork & Roth 2014, Thm A.1):
every example contributes one vector, clipped to L2 norm ``C``; under add/remove adjacency the sum
then moves by at most ``C``, so adding ``N(0, sigma^2 C^2 I)`` once makes the sum
``Gaussian(name, sigma)``-private. DP-ImgSyn releases the GroupNorm statistics of the private set
this way (DP-ImgSyn (TMLR 2024) §4.1; docs/contract.md, privacy rules 1 and 7: the noise is really added).

:func:`private_sum` and :func:`private_sum_of_chunks` are the one-class case of the bounded-sum
release (:mod:`dpsynth.privacy.bounded_sum`, which also serves PrivImage's semantic histogram and the
kernel methods' mean embeddings): one implementation of the clipping, the charge and the noise.

The mechanism is charged to the ledger *before* anything is released, so a refused charge
(:class:`~dpsynth.errors.BudgetExceededError`) leaves nothing computed from private data behind.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dpsynth.errors import PrivacyError
from dpsynth.privacy.bounded_sum import BoundedSum, clip_to_bound, release_bounded_sum
from dpsynth.privacy.rng import NoiseSource


def clip_rows(per_example: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Scale every row ``v`` to ``min(1, C / ||v||_2) v`` so that its L2 norm is at most ``C``
    (a non-finite row becomes zero: :func:`~dpsynth.privacy.bounded_sum.clip_to_bound`)."""
    return clip_to_bound(per_example, clip_norm)


def private_sum(
    per_example: torch.Tensor, clip_norm: float, noise_multiplier: float, ledger, name: str, noise: NoiseSource
) -> torch.Tensor:
    """Release ``sum_i clip_C(v_i) + N(0, sigma^2 C^2 I)`` for the rows ``v_i`` of ``per_example``.

    Args:
        per_example: ``[N, D]``, one row per private example (``N`` may be 0).
        clip_norm: ``C``, the L2 bound of every row and hence the add/remove sensitivity of the sum.
        noise_multiplier: ``sigma``; the noise std is ``sigma * C``.
        ledger: the run's :class:`~dpsynth.privacy.PrivacyLedger`; ``Gaussian(name, sigma)`` is
            charged before the sum is computed, so a refusal releases nothing.
        name: the mechanism's name in ``privacy.json``.
        noise: the DP noise source (never the run seed).

    Returns:
        float32 ``[D]`` noisy sum.
    """
    if per_example.ndim != 2:
        raise ValueError(f"per_example must be [N, D], got shape {tuple(per_example.shape)}")
    return private_sum_of_chunks(
        iter([per_example]), int(per_example.shape[1]), clip_norm, noise_multiplier, ledger, name, noise
    )


def private_sum_of_chunks(
    chunks: Iterable[torch.Tensor],
    dim: int,
    clip_norm: float,
    noise_multiplier: float,
    ledger,
    name: str,
    noise: NoiseSource,
) -> torch.Tensor:
    """:func:`private_sum` over rows that arrive in chunks ``[n_j, dim]`` (one mechanism, noise once).

    ``chunks`` may be a lazy generator that reads private data: it is consumed only after the
    charge succeeded. Useful when all rows at once would not fit in memory.
    """
    query = BoundedSum(name, clip_norm, noise_multiplier)
    released = release_bounded_sum(((chunk, None) for chunk in chunks), dim, query, ledger, noise)
    return released.sums[0].float()


def private_count(
    count: int, noise_multiplier: float, ledger, name: str, noise: NoiseSource, minimum: float = 1.0
) -> float:
    """Release ``count + N(0, sigma^2)``, clamped below at ``minimum``.

    Under add/remove adjacency the number of private examples changes by one, so its L2
    sensitivity is 1 and ``Gaussian(name, sigma)`` is charged (before release). The clamp is
    post-processing; it keeps a later division by the count finite.
    """
    from dpsynth.privacy import Gaussian

    _check_positive(noise_multiplier, "noise_multiplier")
    ledger.charge(Gaussian(name, float(noise_multiplier)))
    noisy = float(count) + float(noise.normal((1,), std=float(noise_multiplier), dtype=torch.float64).item())
    return max(float(minimum), noisy)


def _check_positive(value: float, what: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or value == float("inf"):
        raise PrivacyError(f"{what} must be a positive finite number, got {value!r}")
