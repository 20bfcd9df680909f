"""``dpsynth run`` across two gloo processes (the environment torchrun sets): the same ε as one process,
one writer, and a 2-process run resumed by one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gloo_support import spawn_ranks, torchrun_env

from dpsynth.checkpoint import CheckpointManager
from dpsynth.config import load_config
from dpsynth.rundir import ReadOnlyCheckpoints
from dpsynth.runner import run

WORLD = 2
PRESET = "dpsgd-classifier/smoke"  # 8 steps, a checkpoint every 4


class Stop(Exception):
    """Raised by every rank at the first DP-SGD checkpoint: the run is interrupted there."""


def worker(rank: int, ports: list[int], dirs: dict[str, Path]) -> None:
    torch.set_num_threads(1)
    config = load_config(PRESET)
    rank1_dir = dirs["rank1"]  # rank 1 is pointed elsewhere: the test checks that nothing appears there
    torchrun_env(rank, WORLD, ports[0])
    run(config, dirs["full"] if rank == 0 else rank1_dir, echo=False)

    original = CheckpointManager.save

    def save_then_stop(self, state, phase="main"):
        original(self, state, phase)
        if phase == "dpsgd":
            raise Stop

    def stop(self, state, phase="main"):
        if phase == "dpsgd":
            raise Stop

    CheckpointManager.save, ReadOnlyCheckpoints.save = save_then_stop, stop
    torchrun_env(rank, WORLD, ports[1])  # a second store: the first run's keys must not be read again
    try:
        run(config, dirs["cut"] if rank == 0 else rank1_dir, echo=False)
    except Stop:
        pass


def epsilon(run_dir) -> float:
    return json.loads((run_dir / "privacy.json").read_text())["epsilon"]


def dpsgd_steps(run_dir) -> int:
    state = json.loads((run_dir / "ledger.json").read_text())
    return next(m["steps"] for m in state["mechanisms"] if m["name"] == "dpsgd")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def fresh_dirs(attempt: int) -> tuple[dict[str, Path]]:
        root = tmp_path_factory.mktemp(f"distributed-run-{attempt}")
        return ({name: root / name for name in ("full", "cut", "rank1", "single")},)

    (dirs,) = spawn_ranks(worker, fresh_dirs, WORLD, stores=2)
    interrupted = {"steps": dpsgd_steps(dirs["cut"]), "epsilon": epsilon(dirs["cut"])}
    run(load_config(PRESET), dirs["single"], echo=False)
    return dirs, interrupted


def test_two_processes_spend_what_one_process_spends_and_rank1_writes_nothing(runs):
    dirs, _ = runs
    assert epsilon(dirs["full"]) == pytest.approx(epsilon(dirs["single"]), rel=1e-12)
    assert dpsgd_steps(dirs["full"]) == dpsgd_steps(dirs["single"]) == 8
    assert not dirs["rank1"].exists()
    curves = [json.loads(line)["step"] for line in (dirs["full"] / "curves.jsonl").read_text().splitlines()]
    assert curves == sorted(set(curves)) and curves[-1] == 8  # one writer: no record twice
    log = (dirs["full"] / "log.txt").read_text().splitlines()
    assert len(log) == len(set(log))
    assert (dirs["full"] / "diagnostics" / "metrics.json").is_file()


def test_a_two_process_run_resumes_with_one_process(runs):
    dirs, interrupted = runs
    assert interrupted["steps"] == 4  # the ledger stood at the checkpoint the run was stopped at
    assert (dirs["cut"] / "checkpoints" / "dpsgd.pt").is_file()
    resumed = run(load_config(PRESET), dirs["cut"], resume=True, echo=False)
    assert dpsgd_steps(resumed) == 8  # continued from 4, not restarted and not counted twice
    assert epsilon(resumed) == pytest.approx(epsilon(dirs["single"]), rel=1e-12)
    assert epsilon(resumed) > interrupted["epsilon"]


def test_nproc_execs_torchrun_with_the_same_arguments(monkeypatch, tmp_path):
    from dpsynth import cli

    launched = []

    def fake_execv(program, argv):
        launched.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", fake_execv)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit):
        cli.main(["run", PRESET, "--nproc", "3", "--out", out, "--set", "seed=5", "--resume"])
    (argv,) = launched
    assert argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3"]
    assert argv[5:] == ["-m", "dpsynth", "run", PRESET, "--set=seed=5", f"--out={out}", "--resume"]
    assert not (tmp_path / "run").exists()
