"""The sanitised block: GS-WGAN's one release per generator step (Chen et al., arXiv:2006.08265, §3).

Per step a shard k of a fixed content-keyed partition is drawn uniformly at random from the run's
:class:`~dpsynth.privacy.rng.NoiseSource` (never the run seed), a block of B rows is computed from that
shard alone (GS-WGAN: the gradient of the critic trained on shard k with respect to each of B generated
images), each row is clipped to L2 norm C, and Gaussian noise is added to the whole block:

* **Sensitivity.** The critic of shard k may change arbitrarily when one of its records changes, so
  *every* row may move anywhere in the C-ball: the block's L2 diameter is ``Delta = 2 C sqrt(B)``. The
  original paper clips to C/B with noise ``2 sigma C / B`` per coordinate and composes B*T mechanisms,
  each amplified by 1/K; that treats the B rows as B independently sampled releases although they all
  share the drawn shard. Here the block is ONE Gaussian with noise std ``sigma * Delta`` per coordinate.
* **Amplification.** Drawing 1 of K shards is sampling without replacement of size 1 from K, accounted
  over a change of one shard's contents (dp_accounting's REPLACE_ONE of a shard, an accounting device at
  the shard level); a record-level add/remove neighbour is such a change because the partition is a
  function of each record's content with K fixed. Only add/remove is covered: a replaced record can be
  keyed to another shard, changing two. So each step is one
  :class:`~dpsynth.privacy.mechanisms.ShardSampledGaussian` application (RDP only).
* **Order.** :func:`release_sanitised_block` spends the step in the ledger (refusing past the budget)
  before the shard is drawn and before the block, hence any private value, is computed.

The caller guarantees that what it computes for shard k depends on the private data only through shard
k's records (plus released or public state): GS-WGAN's critics are each trained on their own shard only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from dpsynth.errors import PrivacyError
from dpsynth.privacy.mechanisms import ShardSampledGaussian, check_count, check_positive


@dataclasses.dataclass(frozen=True)
class SanitisedBlock:
    """What decides the noise of one sanitised step, declared before any private data is read.

    ``rows`` B, ``clip_norm`` C (per row), ``noise_multiplier`` sigma (noise std / block diameter 2 C sqrt(B)),
    ``num_shards`` K.
    """

    name: str
    rows: int
    clip_norm: float
    noise_multiplier: float
    num_shards: int

    def __post_init__(self) -> None:
        check_count(self.rows, "rows of the sanitised block", minimum=1)
        check_positive(self.clip_norm, "clip norm")
        check_positive(self.noise_multiplier, "noise multiplier")
        check_count(self.num_shards, "number of shards", minimum=1)

    @property
    def sensitivity(self) -> float:
        """L2 diameter of the block over every content of the drawn shard: ``2 C sqrt(B)``."""
        return 2.0 * self.clip_norm * math.sqrt(self.rows)

    @property
    def noise_std(self) -> float:
        """Per-coordinate noise std: ``sigma * 2 C sqrt(B)``."""
        return self.noise_multiplier * self.sensitivity

    def mechanism(self, steps: int = 0) -> ShardSampledGaussian:
        """The ledger entry of ``steps`` applications."""
        return ShardSampledGaussian(self.name, self.noise_multiplier, self.num_shards, steps)


def clip_rows(block: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Each row (first dimension) scaled to L2 norm at most ``clip_norm``; a row holding NaN/Inf becomes zero."""
    flat = block.reshape(len(block), -1)
    finite = torch.isfinite(flat).all(dim=1, keepdim=True)
    flat = torch.where(finite, flat, torch.zeros_like(flat))
    norms = flat.norm(dim=1, keepdim=True)
    scale = torch.clamp(clip_norm / (norms + 1e-12), max=1.0)
    return (flat * scale).reshape(block.shape)


def draw_shard(noise: Any, num_shards: int) -> int:
    """A shard index uniform on [0, K) from the DP noise source (secret: never logged or released)."""
    return min(int(float(noise.uniform(1)[0]) * num_shards), num_shards - 1)


def release_sanitised_block(
    query: SanitisedBlock,
    compute: Callable[[int], torch.Tensor],
    ledger: Any,
    noise: Any,
) -> torch.Tensor:
    """Spend one step of ``query`` (registered in ``ledger`` first), draw a shard k, and return
    ``clip_rows(compute(k)) + N(0, noise_std^2)`` ([B, ...], on the block's device and dtype).

    ``compute(k)`` must read no private record outside shard k. The drawn k and the clipped block are
    never returned.
    """
    ledger.spend(query.name, 1)
    shard = draw_shard(noise, query.num_shards)
    block = compute(shard)
    if block.shape[0] != query.rows:
        raise PrivacyError(f"the sanitised block has {block.shape[0]} rows, {query.rows} were declared")
    clipped = clip_rows(block.detach(), query.clip_norm)
    return clipped + noise.normal(clipped.shape, query.noise_std, clipped.device, clipped.dtype)
