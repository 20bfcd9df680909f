"""Two gloo processes on CPU give the same update as the single-process engine (one noise draw)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn.functional as F
from gloo_support import destroy_group, init_gloo, spawn_ranks
from torch import nn

from dpsynth.dpsgd import DPSGDEngine
from dpsynth.dpsgd.distributed import DistributedDPSGDEngine
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.rng import NoiseSource

SIGMA, CLIP, RATE, EXPECTED = 0.8, 0.5, 0.1, 6.0
STEP_CLIPS = (None, 0.35)  # the second step uses an adaptive clip norm (e.g. DPDM's public one)
NOISE_SEED = 1234


def make_ledger() -> PrivacyLedger:
    return PrivacyLedger(target_epsilon=50.0, delta=1e-5, accountant="rdp")


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)
    )


def loss_fn(model_call, example):
    return F.cross_entropy(model_call(example["x"]), example["y"])  # x: [K, 1, 4, 4]


def make_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        {"x": torch.randn(7, 2, 1, 4, 4, generator=g), "y": torch.randint(0, 2, (7, 2), generator=g)} for _ in range(2)
    ]


def engine_args() -> dict:
    return {
        "noise_multiplier": SIGMA,
        "max_grad_norm": CLIP,
        "sample_rate": RATE,
        "expected_batch_size": EXPECTED,
        "max_physical_batch_size": 2,
        "noise": NoiseSource(seed=NOISE_SEED),
    }


def worker(rank: int, ports: list[int], out_dir: str, world_size: int = 2) -> None:
    torch.set_num_threads(1)
    try:
        init_gloo(rank, world_size, ports[0])
        model = build_model()
        if rank == 1:  # a different initialisation: the engine must synchronise from rank 0
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        ledger = make_ledger() if rank == 0 else None
        args = engine_args()
        if rank == 1:  # a rank whose clip norms disagree: rank 0's must be used everywhere
            args["max_grad_norm"] = CLIP * 4
        engine = DistributedDPSGDEngine(model, torch.optim.Adam(model.parameters(), lr=0.05), loss_fn, ledger, **args)
        used = []
        for batch, clip in zip(make_batches(), STEP_CLIPS):
            shard = {k: v[rank::world_size] for k, v in batch.items()}
            if clip is not None and rank == 1:
                clip *= 10
            used.append(engine.step(shard, max_grad_norm=clip).max_grad_norm)
        torch.save(
            {
                "params": [p.detach() for p in model.parameters()],
                "clips": used,
                "spent": ledger.mechanisms()[0].steps if ledger else None,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        destroy_group()


def test_two_gloo_ranks_equal_the_single_process_engine():
    model = build_model()
    ledger = make_ledger()
    engine = DPSGDEngine(model, torch.optim.Adam(model.parameters(), lr=0.05), loss_fn, ledger, **engine_args())
    for batch, clip in zip(make_batches(), STEP_CLIPS):
        engine.step(batch, max_grad_norm=clip)
    expected = [p.detach() for p in model.parameters()]

    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(worker, lambda _: (out_dir,), 2)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]

    assert results[0]["spent"] == 2  # charged once per logical step, by rank 0 only
    assert results[0]["clips"] == results[1]["clips"] == [CLIP, STEP_CLIPS[1]]
    for got_rank0, got_rank1, want in zip(results[0]["params"], results[1]["params"], expected):
        assert torch.allclose(got_rank0, got_rank1, atol=1e-6)
        assert torch.allclose(got_rank0, want, atol=1e-5)
    initial = [p.detach() for p in build_model().parameters()]
    assert not all(torch.allclose(a, b) for a, b in zip(initial, expected))
