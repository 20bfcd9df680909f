"""DP-SGD across two gloo processes: the same clipped sum as one process, the noise added exactly once, the
same update as the single-process engine, the sampling shards, and generation split across ranks (one group of
ranks does every check: starting processes costs more than any of them)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gloo_support import destroy_group, init_gloo, spawn_ranks
from torch import nn

from dpsynth.contract import RunContext, Samples
from dpsynth.dpsgd import DPSGDEngine
from dpsynth.dpsgd.distributed import DistributedDPSGDEngine, ShardedPoissonSampler
from dpsynth.dpsgd.per_example import PerExampleGradients, clipped_grad_sum, micro_batches
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.rng import NoiseSource
from dpsynth.runner import RANK_SEED_STRIDE, generate_across_ranks

WORLD = 2
CLIP = 0.3
SIGMA, NOISE_CLIP, NOISE_STEPS = 1.5, 0.4, 24
RUN_SEED, NUM_SAMPLES = 11, 7
# the whole update against the single-process engine: Adam, two steps, the second with an adaptive clip norm
# (e.g. DPDM's public one), one noise draw from the same seed
UPDATE_SIGMA, UPDATE_CLIP, UPDATE_RATE, UPDATE_EXPECTED = 0.8, 0.5, 0.1, 6.0
STEP_CLIPS = (None, 0.35)
NOISE_SEED = 1234


class SeedStampingMethod:
    """Generates images whose pixels are the context's seed: shows which rank (stream) drew each sample."""

    def generate(self, ctx, num):
        images = np.full((num, 2, 2, 1), ctx.seed % 251, dtype=np.uint8)
        return Samples(images=images, labels=np.arange(num) % 3)


def bare_context() -> RunContext:
    return RunContext(
        config={},
        section={},
        run_dir=Path("."),
        data=None,
        public=None,
        ledger=None,
        device=torch.device("cpu"),
        seed=RUN_SEED,
        log=print,
        checkpoints=None,
        curves=None,
    )


class RecordingEngine(DistributedDPSGDEngine):
    """Keeps the all-reduced sum of every step; ``noise_off`` is the test-only hook that skips the noise."""

    def __init__(self, *args, noise_off: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.noise_off, self.sums = noise_off, []

    def _add_noise(self, summed, clip):
        return summed if self.noise_off else super()._add_noise(summed, clip)

    def _aggregate(self, noisy_sum):
        reduced = super()._aggregate(noisy_sum)
        self.sums.append(torch.cat([t.reshape(-1).clone() for t in reduced.values()]))
        return reduced


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))


def classification_loss(model_call, example):
    return F.cross_entropy(model_call(example["x"]), example["y"])


def zero_loss(model_call, example):
    return (model_call(example["x"]) * 0.0).sum()  # every gradient is exactly zero


def fixed_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(9, 2, 1, 4, 4, generator=g), "y": torch.randint(0, 3, (9, 2), generator=g)}


def update_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)
    )


def update_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        {"x": torch.randn(7, 2, 1, 4, 4, generator=g), "y": torch.randint(0, 2, (7, 2), generator=g)} for _ in range(2)
    ]


def update_ledger() -> PrivacyLedger:
    return PrivacyLedger(target_epsilon=50.0, delta=1e-5, accountant="rdp")


def update_engine_args() -> dict:
    return {
        "noise_multiplier": UPDATE_SIGMA,
        "max_grad_norm": UPDATE_CLIP,
        "sample_rate": UPDATE_RATE,
        "expected_batch_size": UPDATE_EXPECTED,
        "max_physical_batch_size": 2,
        "noise": NoiseSource(seed=NOISE_SEED),
    }


def whole_update(rank: int) -> dict:
    """Two Adam steps of the distributed engine on this rank's shards, with rank 1 disagreeing on everything
    rank 0 decides (initialisation, clip norms): rank 0's must be used everywhere."""
    model = update_model()
    if rank == 1:  # a different initialisation: the engine must synchronise from rank 0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ledger = update_ledger() if rank == 0 else None
    args = update_engine_args()
    if rank == 1:  # a rank whose clip norms disagree: rank 0's must be used everywhere
        args["max_grad_norm"] = UPDATE_CLIP * 4
    engine = DistributedDPSGDEngine(
        model, torch.optim.Adam(model.parameters(), lr=0.05), classification_loss, ledger, **args
    )
    used = []
    for batch, clip in zip(update_batches(), STEP_CLIPS):
        shard = {k: v[rank::WORLD] for k, v in batch.items()}
        if clip is not None and rank == 1:
            clip *= 10
        used.append(engine.step(shard, max_grad_norm=clip).max_grad_norm)
    return {
        "params": [p.detach() for p in model.parameters()],
        "clips": used,
        "spent": ledger.mechanisms()[0].steps if ledger else None,
    }


def make_engine(model, loss, ledger, sigma, clip, name, noise_off=False) -> RecordingEngine:
    return RecordingEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss,
        ledger,
        noise_off=noise_off,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        sample_rate=0.5,
        expected_batch_size=4.0,
        max_physical_batch_size=2,
        mechanism_name=name,
    )


def worker(rank: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        init_gloo(rank, WORLD, ports[0])
        ledger = PrivacyLedger(target_epsilon=1e4, delta=1e-5, accountant="rdp")
        mirror = PrivacyLedger(target_epsilon=1e4, delta=1e-5, accountant="rdp")
        # 1. the same sum: a fixed batch split into the ranks' shards, noise switched off
        model = small_model()
        engine = make_engine(model, classification_loss, ledger if rank == 0 else mirror, 1.0, CLIP, "sum", True)
        batch = fixed_batch()
        shard = {k: v[rank::WORLD] for k, v in batch.items()}
        reference, _ = clipped_grad_sum(
            PerExampleGradients(small_model(), classification_loss), micro_batches(batch, 2), CLIP, False
        )
        engine.step(shard)
        # 2. the noise exactly once: zero gradients, many steps, the released sum is the noise alone
        noisy = make_engine(nn.Linear(40, 10), zero_loss, ledger if rank == 0 else mirror, SIGMA, NOISE_CLIP, "noise")
        for _ in range(NOISE_STEPS):
            noisy.step({"x": torch.randn(3, 1, 40)})
        # 3. the sampler: this rank's coins over its own shard
        sampler = ShardedPoissonSampler(101, 0.3, NoiseSource(), shard=rank, shards=WORLD)
        # 4. generation: each rank draws its share with its own streams, rank 0 gathers
        samples = generate_across_ranks(SeedStampingMethod(), bare_context(), NUM_SAMPLES)
        # 5. the whole update equals the single-process engine's
        update = whole_update(rank)
        torch.save(
            {
                "samples": None
                if samples is None
                else (torch.from_numpy(samples.images[:, 0, 0, 0]), torch.from_numpy(samples.labels)),
                "sum": engine.sums[0],
                "reference": torch.cat([t.reshape(-1) for t in reference.values()]),
                "noise": torch.stack(noisy.sums),
                "spent": [m.steps for m in (ledger if rank == 0 else mirror).mechanisms()],
                "shard_batch": sampler.sample(),
                "shard": sampler.indices,
                "update": update,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        destroy_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    (out_dir,) = spawn_ranks(worker, lambda _: (str(tmp_path_factory.mktemp("distributed-engine")),), WORLD)
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(WORLD)]


def test_all_reduced_clipped_sum_equals_the_single_process_sum(results):
    for result in results:
        assert torch.allclose(result["sum"], result["reference"], atol=1e-6)
    assert results[0]["reference"].abs().sum() > 0


def test_noise_is_added_exactly_once(results):
    noise = results[0]["noise"]
    assert torch.equal(noise, results[1]["noise"])  # both ranks apply the same update
    ratio = float(noise.var()) / (SIGMA * NOISE_CLIP) ** 2
    # sigma^2 C^2 once: ratio 1 (2 if each rank added full noise, 1/2 if each added a 1/sqrt(W) share)
    assert abs(ratio - 1.0) < 0.06, ratio
    assert abs(float(noise.mean())) < 0.05


def test_rank0_charges_and_the_other_ranks_mirror_each_step_once(results):
    assert results[0]["spent"] == results[1]["spent"] == [1, NOISE_STEPS]


def test_two_gloo_ranks_equal_the_single_process_engine(results):
    model = update_model()
    ledger = update_ledger()
    engine = DPSGDEngine(
        model, torch.optim.Adam(model.parameters(), lr=0.05), classification_loss, ledger, **update_engine_args()
    )
    for batch, clip in zip(update_batches(), STEP_CLIPS):
        engine.step(batch, max_grad_norm=clip)
    expected = [p.detach() for p in model.parameters()]

    updates = [result["update"] for result in results]
    assert updates[0]["spent"] == 2  # charged once per logical step, by rank 0 only
    assert updates[0]["clips"] == updates[1]["clips"] == [UPDATE_CLIP, STEP_CLIPS[1]]
    for got_rank0, got_rank1, want in zip(updates[0]["params"], updates[1]["params"], expected):
        assert torch.allclose(got_rank0, got_rank1, atol=1e-6)
        assert torch.allclose(got_rank0, want, atol=1e-5)
    initial = [p.detach() for p in update_model().parameters()]
    assert not all(torch.allclose(a, b) for a, b in zip(initial, expected))


def test_shards_are_disjoint_and_cover_the_dataset(results):
    shards = [set(r["shard"].tolist()) for r in results]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(101))
    for result, shard in zip(results, shards):
        assert set(result["shard_batch"].tolist()) <= shard


def test_generation_is_split_across_ranks_and_gathered_on_rank0(results):
    assert results[1]["samples"] is None
    stamps, labels = results[0]["samples"]
    rank0, rank1 = RUN_SEED % 251, (RUN_SEED + RANK_SEED_STRIDE) % 251
    assert stamps.tolist() == [rank0] * 4 + [rank1] * 3  # 7 samples: shares of 4 and 3
    assert labels.tolist() == [0, 1, 2, 0, 0, 1, 2]
