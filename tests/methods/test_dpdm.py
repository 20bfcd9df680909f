"""DPDM end to end: the smoke preset, the public adaptive clip norm, resume after a kill, generate later."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from dpsynth.api import Synthesizer
from dpsynth.runner import run_config
from dpsynth.testing import MethodContractTests

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "dpsynth" / "presets" / "dpdm" / "smoke.yaml"
MECHANISM = "dp-adam"


def _privacy(run_dir: Path) -> dict:
    return json.loads((run_dir / "privacy.json").read_text())


def _curves(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "curves.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    return run_config(SMOKE, out=tmp_path_factory.mktemp("dpdm") / "run", echo=False)


def test_smoke_run_writes_balanced_uint8_samples(smoke_run):
    with np.load(smoke_run / "samples.npz") as samples:
        images, labels = samples["images"], samples["labels"]
    assert images.shape == (100, 28, 28, 1) and images.dtype == np.uint8
    assert labels.dtype == np.int64
    assert np.bincount(labels, minlength=10).tolist() == [10] * 10
    assert images.std() > 0  # not a constant image
    assert (smoke_run / "samples.png").is_file()


def test_smoke_run_spends_at_most_the_target(smoke_run):
    privacy = _privacy(smoke_run)
    assert privacy["epsilon"] <= privacy["target_epsilon"] == 10.0
    assert privacy["epsilon"] > 5.0  # σ is calibrated to use the budget, not a token amount
    steps = {m["name"]: m["steps"] for m in privacy["mechanisms"]}
    assert steps[MECHANISM] == 6
    # The unsound private-batch clip norm of Algorithm 1 is named in the released privacy statement.
    assert any("PUBLIC batch" in note and "Algorithm 1" in note for note in privacy["notes"])


def test_clip_norm_comes_from_public_batches(smoke_run):
    records = _curves(smoke_run)
    assert [record["step"] for record in records] == [1, 2, 4, 6]  # first step, then every checkpoint
    norms = [record["clip_norm"] for record in records]
    assert all(n > 0 for n in norms)
    assert len(set(norms)) > 1  # re-estimated each step, not the fixed clip_norm
    assert 1.0 not in norms


def _first_clip_norm(run_dir: Path) -> float:
    first = _curves(run_dir)[0]
    assert first["step"] == 1
    return first["clip_norm"]


def test_clip_norm_follows_the_public_batch_not_the_private_data(smoke_run, tmp_path):
    """Step 1's C is computed at the seeded initial weights before any private step: with C from
    public batches (§IV-B) it cannot depend on the private set, and it must move with the public set.
    Algorithm 1's private-batch C (or any C computed on private images) fails the first check."""
    short = ["dpdm.steps=1", "dpdm.checkpoint_every=1", "generate.num=10", "generate.batch_size=10"]
    other_private = run_config(SMOKE, ["data.max_train=150", *short], out=tmp_path / "private", echo=False)
    other_public = run_config(SMOKE, ["data.max_public=400", *short], out=tmp_path / "public", echo=False)
    reference = _first_clip_norm(smoke_run)
    assert _first_clip_norm(other_private) == pytest.approx(reference, rel=1e-6)
    assert _first_clip_norm(other_public) != pytest.approx(reference, rel=1e-3)


def test_generate_in_a_fresh_context_loads_the_checkpoint(smoke_run, tmp_path):
    path = Synthesizer.load(smoke_run).generate(20, tmp_path / "more.npz")
    with np.load(path) as samples:
        assert samples["images"].shape == (20, 28, 28, 1)
        assert np.bincount(samples["labels"], minlength=10).tolist() == [2] * 10


def test_no_public_data_falls_back_to_fixed_clip_norm(tmp_path):
    run_dir = run_config(
        SMOKE,
        ["data.public=", "dpdm.steps=2", "dpdm.checkpoint_every=2", "generate.num=10"],
        out=tmp_path / "run",
        echo=False,
    )
    assert "warning: dpdm adaptive clipping needs public data" in (run_dir / "log.txt").read_text()
    assert {record["clip_norm"] for record in _curves(run_dir)} == {1.0}


def test_resume_after_kill_continues_the_same_ledger(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "dpsynth", "run", str(SMOKE), "--out", str(run_dir)]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = run_dir / "checkpoints" / f"{MECHANISM}.pt"
    deadline = time.time() + 120
    try:
        while not checkpoint.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert checkpoint.exists(), "the run never wrote a checkpoint"
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert not (run_dir / "samples.npz").exists(), "the run finished before it could be killed"
    steps_done = max(record["step"] for record in _curves(run_dir))
    assert steps_done < 6

    run_config(SMOKE, out=run_dir, resume=True, echo=False)
    privacy = _privacy(run_dir)
    steps = {m["name"]: m["steps"] for m in privacy["mechanisms"]}
    assert steps[MECHANISM] == 6  # no step counted twice, none lost
    assert privacy["epsilon"] <= 10.0
    assert [record["step"] for record in _curves(run_dir)] == [1, 2, 4, 6]  # sampled, none twice
    assert "resumed" in (run_dir / "log.txt").read_text()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["method"] == "dpdm"


class TestDPDMContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dpdm/smoke`` preset."""

    method = "dpdm"
