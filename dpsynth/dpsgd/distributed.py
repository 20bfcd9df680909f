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

Poisson sampling shards naturally (:class:`ShardedPoissonSampler`): rank r owns the disjoint shard
``r, r + W, r + 2W, ...`` of the N private examples and flips one coin per example of its shard with
probability q, drawn from its *own* entropy-seeded (or ``os.urandom``) noise source. Every example
belongs to exactly one shard and gets exactly one coin, and coins drawn by independent sources are
independent, so the union over ranks includes each of the N examples independently with probability
q: exactly one Poisson(q) sample of the whole set, the sampling the subsampled-Gaussian accountant
assumes. The engine divides by the global expected batch size q N, never by a realised size.

On ranks other than 0 the ledger passed to the engine is a *mirror*: it is spent only after rank 0
accepted the step, so every rank's in-memory ledger states the same composition (the runner checks
the plan against it), but only rank 0's is ever written (:mod:`dpsynth.rundir`).

Launch: ``torchrun --nproc_per_node N -m dpsynth run CONFIG``. :func:`init_from_env` joins the
process group torchrun describes in the environment (nccl on CUDA devices, gloo on CPU).
"""

from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dpsynth.dpsgd.engine import DPSGDEngine
from dpsynth.dpsgd.per_example import LossFn
from dpsynth.dpsgd.sampler import PoissonSampler
from dpsynth.errors import BudgetExceededError, ConfigError, DPSynthError, PrivacyError
from dpsynth.privacy.mechanisms import SubsampledGaussian
from dpsynth.privacy.rng import NoiseSource

T = TypeVar("T")

# -- the process group ---------------------------------------------------------------------------


def launched_world_size() -> int:
    """The number of processes torchrun started (``WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """True on the one process that owns the run directory (rank 0, or the only process)."""
    return rank() == 0


def init_from_env(device: str = "auto", timeout_s: float = 1800.0) -> bool:
    """Join the process group torchrun describes in the environment; return whether this call created it.

    Does nothing without torchrun (``WORLD_SIZE`` unset or 1) or when a group already exists. The
    backend is nccl when the run's device is CUDA (each process takes ``cuda:LOCAL_RANK``) and gloo
    otherwise.
    """
    if launched_world_size() <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; run with one process")
    use_cuda = device != "cpu" and torch.cuda.is_available() and not device.startswith("mps")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def local_device(device: torch.device) -> torch.device:
    """This process's device: under torchrun a bare ``cuda`` becomes ``cuda:LOCAL_RANK``."""
    if device.type == "cuda" and device.index is None and is_distributed():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def from_main(compute: Callable[[], T]) -> T:
    """Run ``compute`` on rank 0 only and hand its result, or its error, to every rank.

    Rank 0 validates and reads the run directory (its config, ``ledger.json``, checkpoints); the
    other ranks receive the same values instead of reading files, so a run needs no shared file
    system and an error on rank 0 (a refused config, a mismatching ledger) stops every rank with the
    same one-line message rather than leaving them waiting.
    """
    if not is_distributed():
        return compute()
    payload: list[Any] = [None]
    error: BaseException | None = None
    if is_main():
        try:
            payload[0] = ("ok", compute())
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others hang
            error = exc
            payload[0] = ("error", _picklable(exc))
    dist.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    kind, value = payload[0]
    if kind == "error":
        raise value
    return value


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - any unpicklable error still reaches the other ranks as text
        return DPSynthError(f"rank 0 failed: {exc}")


def rank_slice(num: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s contiguous share of ``num`` items: ``num // world``, one more
    for the first ``num % world`` ranks. Generation and FID feature extraction split their work this way."""
    base, extra = divmod(num, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_indices(num_examples: int, shard: int, shards: int) -> torch.Tensor:
    """The disjoint shard ``shard, shard + shards, ...`` of ``range(num_examples)``."""
    return torch.arange(min(shard, num_examples), num_examples, shards, dtype=torch.int64)  # empty past the end


class ShardedPoissonSampler:
    """Poisson sampling at rate q over this rank's disjoint shard; yields *global* indices.

    With one process it is exactly :class:`PoissonSampler` over all N examples. With W ranks, rank r
    flips the coins of the examples ``r, r + W, ...`` only, from its own independent DP noise
    source: each example of the whole set is in exactly one shard and is included independently with
    probability q, so the union of the ranks' batches is exactly one Poisson(q) sample of the N
    examples (the module docstring gives the argument).
    """

    def __init__(self, num_examples: int, sample_rate: float, noise: NoiseSource, shard: int = 0, shards: int = 1):
        self.num_examples, self.shard, self.shards = int(num_examples), int(shard), int(shards)
        self.sample_rate = float(sample_rate)
        size = len(range(self.shard, self.num_examples, self.shards))
        self._sampler = PoissonSampler(size, sample_rate, noise=noise) if size else None

    @property
    def indices(self) -> torch.Tensor:
        """The global indices of this rank's shard (built on demand: sampling never needs them all)."""
        return shard_indices(self.num_examples, self.shard, self.shards)

    def sample(self) -> torch.Tensor:
        """This rank's part of one logical batch: sorted global indices."""
        if self._sampler is None:  # more ranks than examples: this shard is empty
            return torch.zeros(0, dtype=torch.int64)
        return self._sampler.sample() * self.shards + self.shard  # local i is global shard + i * shards


class DistributedDPSGDEngine(DPSGDEngine):
    """:class:`DPSGDEngine` over an initialised process group.

    Takes the same arguments; ``ledger`` is required on rank 0. On the other ranks it is ``None``
    or a mirror of rank 0's ledger, spent only once rank 0 accepted a step (never written anywhere).
    ``expected_batch_size`` is the *global* expected batch size q N.
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
        self.mirror = ledger if self.rank != 0 else None
        if self.mirror is not None and self.noise_multiplier > 0:
            self.mirror.register(SubsampledGaussian(self.mechanism_name, self.noise_multiplier, self.sample_rate, 0))
        self._synchronise_replicas()

    def _device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @torch.no_grad()
    def _synchronise_replicas(self) -> None:
        modules = [self.model] + ([self.ema_model] if self.ema_model is not None else [])
        for tensor in [t for m in modules for t in (*m.parameters(), *m.buffers())]:
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
        if self.mirror is not None:
            self.mirror.spend(self.mechanism_name)

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
