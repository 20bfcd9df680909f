"""DP-SGD across processes with ``torch.distributed`` (DDP semantics, one noise draw per step).

Every rank holds a replica of the model and its own optimizer, and receives its shard of the
logical batch. A step then runs as follows:

1. rank 0 alone owns the ledger and charges the step (one charge per logical step, not one per
   rank); it broadcasts whether the charge was accepted, so on refusal every rank raises
   :class:`~dpsynth.errors.BudgetExceededError` before touching any data;
2. each rank sums the clipped per-example gradients of its shard (sensitivity C per example, as
   in the single-process engine);
3. rank 0 adds the Gaussian noise ``N(0, sigma^2 C^2)`` to its partial sum, the other ranks add
   none, so the all-reduced (SUM) total carries exactly one noise draw: the released gradient has
   the same distribution as the single-process engine's. (Adding ``noise / world_size`` on every
   rank would shrink the std by ``sqrt(world_size)``, and independent full noise on every rank
   would waste utility.)
4. every rank divides by the global expected batch size and takes the same optimizer step, so
   the replicas stay identical (they are synchronised from rank 0 at construction).

The clip norm C of each step (fixed, or adaptive as in DPDM) is rank 0's value, broadcast before
the step: a rank clipping to a larger C than the one the noise is scaled to would break the
sensitivity bound, so ranks never use their own.

Poisson sampling shards naturally: if each rank samples its own disjoint shard of the dataset
with rate q, the union is exactly a Poisson(q) sample of the whole dataset.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpsynth.dpsgd.engine import DPSGDEngine
from dpsynth.dpsgd.per_example import LossFn
from dpsynth.errors import BudgetExceededError, ConfigError, PrivacyError


class DistributedDPSGDEngine(DPSGDEngine):
    """:class:`DPSGDEngine` over an initialised process group.

    Takes the same arguments; ``ledger`` is required on rank 0 and ignored (pass ``None``) on
    the other ranks. ``expected_batch_size`` is the *global* expected batch size q N.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        ledger: Any,
        *,
        process_group: Any = None,
        **engine_args: Any,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("DistributedDPSGDEngine needs an initialised torch.distributed process group")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if self.rank == 0 and ledger is None:
            raise PrivacyError("rank 0 owns the privacy ledger and must be given one")
        super().__init__(model, optimizer, loss_fn, ledger if self.rank == 0 else None, **engine_args)
        self._synchronise_replicas()

    def _device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @torch.no_grad()
    def _synchronise_replicas(self) -> None:
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            dist.broadcast(tensor.data, src=self._global_rank0(), group=self.group)

    def _global_rank0(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _agreed_clip(self, clip: float) -> float:
        value = torch.tensor([clip], dtype=torch.float64, device=self._device())
        dist.broadcast(value, src=self._global_rank0(), group=self.group)
        return float(value.item())

    def _charge(self) -> None:
        accepted = torch.zeros(1, dtype=torch.int64, device=self._device())
        error: Exception | None = None
        if self.rank == 0:
            try:
                super()._charge()
                accepted.fill_(1)
            except Exception as exc:  # noqa: BLE001 - any error: tell the other ranks before re-raising, or they hang
                error = exc
        dist.broadcast(accepted, src=self._global_rank0(), group=self.group)
        if error is not None:
            raise error
        if not bool(accepted.item()):
            raise BudgetExceededError(f"rank 0 refused to charge step {self.steps + 1} of {self.mechanism_name!r}")

    def _add_noise(self, summed: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
        return super()._add_noise(summed, clip) if self.rank == 0 else summed

    def _aggregate(self, noisy_sum: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # One all-reduce over a flat buffer instead of one per parameter tensor.
        tensors = list(noisy_sum.values())
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        reduced, offset = {}, 0
        for name, tensor in noisy_sum.items():
            reduced[name] = flat[offset : offset + tensor.numel()].view_as(tensor)
            offset += tensor.numel()
        return reduced

    def state_dict(self) -> dict[str, Any]:
        """Identical on every rank; save it from rank 0 together with rank 0's ledger."""
        return super().state_dict()
