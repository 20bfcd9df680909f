"""FID feature extraction across two gloo processes: the gathered features are the one-process features in
order, rank 0 alone touches the cache, and a 2-process run writes the FID that one process computes."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gloo_support import destroy_group, init_gloo, spawn_ranks, torchrun_env
from torch import nn

from dpsynth.config import load_config
from dpsynth.dpsgd.distributed import rank_slice
from dpsynth.errors import DataError
from dpsynth.eval.evaluate import evaluate
from dpsynth.metrics import inception
from dpsynth.metrics.inception import InceptionFeatures, reference_features
from dpsynth.runner import run

WORLD = 2
NUM_IMAGES = 7  # not divisible by WORLD: rank 0 extracts 4, rank 1 extracts 3
# a DPPM smoke run cut to seconds; it releases samples, so the run evaluates FID after training
RUN_OVERRIDES = [
    "dppm.training.steps=2",
    "dppm.training.checkpoint_every=2",
    "data.max_train=100",
    "generate.num=13",
    "evaluate.metrics=[fid]",
]


class TinyFeatures(nn.Module):
    """A stand-in for Inception: 2×2 average pools and their tanh, 24 features per image."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool2d(x, 2).flatten(1)
        return torch.cat([pooled, torch.tanh(3 * pooled)], 1)


def save_tiny_network(path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is what InceptionFeatures loads
        torch.jit.trace(TinyFeatures(), torch.zeros(1, 3, 299, 299)).save(str(path))
    return path


def distinct_images(num: int) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, (num, 8, 8, 1), dtype=np.uint8)


def worker(rank: int, ports: list[int], network: Path, out: Path) -> None:
    """Both parts in one spawn: starting the processes costs more than either part."""
    torch.set_num_threads(1)
    extract_features(rank, ports[0], network, out)
    torchrun_env(rank, WORLD, ports[1])  # a second store: the first group's keys must not be read again
    inception.default_network_path = lambda: network  # the run's evaluation loads the stand-in network
    extracted = count_extracted_images()
    run(load_config("dppm/smoke", RUN_OVERRIDES), out / ("run" if rank == 0 else "rank1-run"), echo=False)
    (out / f"run-extracted-rank{rank}.json").write_text(json.dumps(extracted))


def count_extracted_images() -> dict[str, int]:
    """Images this process ran through the network, by progress label (filled in as they are extracted)."""
    counts: dict[str, int] = {}
    original = InceptionFeatures._extract

    def counting(self, images, desc):
        counts[desc] = counts.get(desc, 0) + len(images)
        return original(self, images, desc)

    InceptionFeatures._extract = counting
    return counts


def extract_features(rank: int, port: int, network: Path, out: Path) -> None:
    try:
        init_gloo(rank, WORLD, port)
        extractor = InceptionFeatures(network, batch_size=2, progress=False)
        extracted = count_extracted_images()
        results = {"gathered": extractor(distinct_images(NUM_IMAGES), desc="seven")}
        results["one_image"] = extractor(distinct_images(1), desc="one")
        results["extracted"] = np.array([extracted["seven"], extracted.get("one", 0)])
        try:
            extractor(distinct_images(3 + rank))  # ranks that disagree on the images fail, on every rank
        except DataError as exc:
            results["mismatch_error"] = np.array(str(exc))
        cache = out / f"cache-rank{rank}"  # rank 1 is pointed elsewhere: nothing may appear there
        for attempt in ("fresh", "cached"):
            results[attempt] = reference_features(distinct_images(NUM_IMAGES), extractor, "toy", "train", cache=cache)
        np.savez(out / f"rank{rank}.npz", **results)
    finally:
        destroy_group()


@pytest.fixture(scope="module")
def network(tmp_path_factory) -> Path:
    return save_tiny_network(tmp_path_factory.mktemp("network") / "tiny.pt")


@pytest.fixture(scope="module")
def spawned(network, tmp_path_factory) -> Path:
    (_, out) = spawn_ranks(worker, lambda attempt: (network, tmp_path_factory.mktemp(f"two-ranks-{attempt}")), WORLD, 2)
    return out


@pytest.fixture(scope="module")
def gathered(spawned):
    return spawned, [dict(np.load(spawned / f"rank{rank}.npz")) for rank in range(WORLD)]


def test_rank_slices_cover_every_image_once_in_order():
    slices = [rank_slice(NUM_IMAGES, rank, WORLD) for rank in range(WORLD)]
    assert slices == [(0, 4), (4, 7)]
    assert [rank_slice(1, rank, 3) for rank in range(3)] == [(0, 1), (1, 1), (1, 1)]


def test_gathered_features_equal_one_process_features_in_order(network, gathered):
    _, ranks = gathered
    single = InceptionFeatures(network, batch_size=2, progress=False)
    expected = single(distinct_images(NUM_IMAGES))
    assert expected.shape == (NUM_IMAGES, 24) and len(np.unique(expected[:, 0])) == NUM_IMAGES
    assert [list(result["extracted"]) for result in ranks] == [[4, 1], [3, 0]]  # each rank ran its share only
    for result in ranks:
        np.testing.assert_array_equal(result["gathered"], expected)
        np.testing.assert_array_equal(result["one_image"], single(distinct_images(1)))  # rank 1 had none
        assert "same images on every rank" in str(result["mismatch_error"])


def test_rank0_alone_caches_reference_features(gathered):
    out, ranks = gathered
    assert not (out / "cache-rank1").exists()
    (cached_file,) = (out / "cache-rank0").iterdir()
    assert cached_file.name.startswith("private-toy-train-")
    for result in ranks:
        np.testing.assert_array_equal(result["cached"], result["fresh"])
        np.testing.assert_array_equal(result["fresh"], result["gathered"].astype(np.float32))


def test_a_two_process_run_writes_the_one_process_fid_from_rank0_only(network, spawned, tmp_path):
    run_dir = spawned / "run"
    assert not (spawned / "rank1-run").exists()
    written = json.loads((run_dir / "diagnostics" / "metrics.json").read_text())
    assert written["meta"]["num_samples"] == 13 and written["fid"] > 0.0
    assert len(list((run_dir / "diagnostics" / "inception").iterdir())) == 1  # rank 0 cached the reference
    extracted = [json.loads((spawned / f"run-extracted-rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert [counts["inception samples"] for counts in extracted] == [7, 6]
    reference = [counts[next(k for k in counts if k.startswith("inception mnist10k"))] for counts in extracted]
    assert reference[1] > 0 and reference[0] - reference[1] in (0, 1)
    # One process, from scratch (no cached reference features): the same samples give the same FID.
    for name in ("config.yaml", "samples.npz"):
        shutil.copy(run_dir / name, tmp_path / name)
    again = evaluate(tmp_path, ["fid"], inception=str(network), write=False)
    assert written["fid"] == pytest.approx(again["fid"], rel=1e-9)
