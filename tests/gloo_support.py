"""Process groups for tests that spawn gloo ranks, robust on a loaded machine.

* No port races: the test process hosts each TCPStore itself on a port the OS picks and keeps it bound
  while the ranks run, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``), so no other process
  can take the port between choosing and binding it (what ``bind(0)``, close, reuse cannot promise).
* Generous timeouts for the setup: two ranks starting on a machine busy with other tests can take long.
* Loopback only (``GLOO_SOCKET_IFNAME=lo``): a fresh machine's hostname need not resolve to a reachable address.
* The setup is retried: a spawn that failed for the process group (a store or connection error, a rank
  killed by a signal such as gloo's SIGABRT) runs again with fresh stores; any other error is raised.
* Ranks start from a fork server (``forkserver``), not as fresh interpreters: the server imports torch and
  dpsynth's run stack once per test process, and every rank of every spawn after it is a fork of that clean,
  single-threaded process. With ``spawn`` each rank of each spawn imported them again, seconds apiece: most of
  what a gloo test took. The ranks are still processes of their own, and a process group is only ever made in
  a rank, after the fork.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist
import torch.multiprocessing as mp

import dpsynth

SETUP_TIMEOUT = datetime.timedelta(seconds=300)
# What the fork server imports before its first fork: torch, and what the gloo tests' modules and their runs use.
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "dpsynth.runner",
    "dpsynth.methods",
    "dpsynth.eval.evaluate",
    "dpsynth.metrics.inception",
)
ATTEMPTS = 3
# What a failed process-group setup or transport looks like in a rank's traceback.
_SETUP_ERRORS = ("DistNetworkError", "DistStoreError", "Connection reset", "Connection closed", "connectFullMesh")


@contextmanager
def agent_stores(count: int) -> Iterator[list[int]]:
    """``count`` TCPStore servers hosted here, on ports bound until the block ends; yields the ports."""
    stores = [
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=SETUP_TIMEOUT)
        for _ in range(count)
    ]
    try:
        yield [store.port for store in stores]
    finally:
        del stores


def torchrun_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives rank ``rank``, pointed at a store :func:`agent_stores` hosts."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        TORCHELASTIC_USE_AGENT_STORE="True",
        GLOO_SOCKET_IFNAME="lo",
    )


def init_gloo(rank: int, world: int, port: int) -> None:
    """Join a gloo group through the store on ``port`` (env://, as the package does under torchrun)."""
    torchrun_env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=SETUP_TIMEOUT)


def spawn_ranks(worker: Callable[..., None], args_for: Callable[[int], tuple], world: int, stores: int = 1) -> tuple:
    """``worker(rank, ports, *args_for(attempt))`` in ``world`` ranks started from the fork server; returns
    that attempt's args.

    ``args_for`` gives each attempt its own arguments (fresh output folders), so a retried setup never
    meets a half-written run of the failed one."""
    mp.set_forkserver_preload(list(PRELOAD))  # read when the server starts: by the first spawn of this process
    for attempt in range(ATTEMPTS):
        args = args_for(attempt)
        try:
            with agent_stores(stores) as ports:
                start = (worker, dpsynth.__file__, ports, *args)
                mp.start_processes(_rank, args=start, nprocs=world, join=True, start_method="forkserver")
            return args
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            if attempt == ATTEMPTS - 1 or not _setup_failure(exc):
                raise
    raise AssertionError("unreachable")


def _rank(rank: int, worker: Callable[..., None], origin: str, ports: list[int], *args) -> None:
    """A rank: ``worker(rank, ports, *args)``, once it is sure the fork server's dpsynth is the test's (the
    server resolves imports from its working directory and the environment's path, not the test's sys.path)."""
    if dpsynth.__file__ != origin:
        raise RuntimeError(f"the fork server imported dpsynth from {dpsynth.__file__}, the test from {origin}")
    worker(rank, ports, *args)


def _setup_failure(exc: Exception) -> bool:
    if isinstance(exc, mp.ProcessExitedException):
        return exc.exit_code is not None and exc.exit_code < 0  # killed by a signal (gloo aborts)
    return any(marker in str(exc) for marker in _SETUP_ERRORS)


def destroy_group() -> None:
    """For ``finally`` blocks: leave no group behind, whatever happened."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
