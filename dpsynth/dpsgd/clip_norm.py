"""Clip norm from public data (Chu et al. (IEEE Access 2023) §IV-B, Algorithm 1 line 5).

DPDM sets the clip threshold of each step to the average per-example gradient norm of a batch
drawn from a *public* dataset D_pub. Only public examples are read, so the value is free
(docs/contract.md, privacy rule 4) and nothing is charged to the ledger; the noise of the private step
scales with the chosen C (std sigma C), so the accounting of the step does not change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dpsynth.dpsgd.per_example import Example, micro_batches

if TYPE_CHECKING:
    from dpsynth.dpsgd.engine import DPSGDEngine


def public_clip_norm(engine: DPSGDEngine, public_batch: Example, min_norm: float = 1e-6) -> float:
    """Mean L2 norm of the per-example gradients of ``public_batch`` at the engine's current weights.

    Uses the engine's own loss and per-example machinery, so the norm measured is exactly the
    quantity the private step clips (the K-averaged gradient of one example). The result is
    floored at ``min_norm`` because a clip norm must be positive.
    """
    per_example = engine._per_example
    params, constants = per_example.trainable(), per_example.constants()
    device = next(iter(params.values())).device
    norms = []
    for micro_batch in micro_batches(public_batch, engine.max_physical_batch_size):
        micro_batch = {key: value.to(device) for key, value in micro_batch.items()}
        squared = per_example.compute(micro_batch, params, constants).squared_norms()
        norms.append(torch.stack(list(squared.values())).sum(0).sqrt())
    if not norms:
        raise ValueError("public_clip_norm needs a non-empty public batch")
    return max(float(torch.cat(norms).mean()), min_norm)
