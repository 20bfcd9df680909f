"""DP-FETA: the contract, and the central-image release's noise scale, sensitivity, adjacency and denominator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import dpsynth.methods.dp_feta as dp_feta
from dpsynth.checkpoint import CheckpointManager, CurveLog
from dpsynth.config import load_config
from dpsynth.contract import RunContext
from dpsynth.data.dataset import ImageDataset
from dpsynth.data.filters import median_blur3, upsample_to_uint8
from dpsynth.diffusion.augment import RAND_AUGMENT_OPS, apply_op, rand_augment
from dpsynth.diffusion.section import unet_spec
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods.dp_feta import CENTRAL, DPFETA, WARMUP_PHASE, central_query
from dpsynth.methods.families.diffusion import DiffusionMethod
from dpsynth.privacy import PrivacyLedger, SubsampledGaussian, compute_epsilon
from dpsynth.privacy.bounded_sum import BoundedSumRelease, class_sums
from dpsynth.privacy.calibration import calibrate_noise
from dpsynth.privacy.downsampled_means import downsampled_features, downsampled_size
from dpsynth.runner import run_config
from dpsynth.testing import SHRINK, MethodContractTests

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "dpsynth" / "presets" / "dp-feta"


class TestDPFETAContract(MethodContractTests):
    method = "dp-feta"


# ---------------------------------------------------------------------------------------------- helpers
class ZeroNoise:
    """A noise source that keeps every record (coins 0 < q) and adds no noise, recording the std asked for."""

    def __init__(self) -> None:
        self.stds: list[float] = []

    def uniform(self, count: int) -> torch.Tensor:
        return torch.zeros(count, dtype=torch.float64)

    def normal(self, shape, std, device="cpu", dtype=torch.float32):  # noqa: ANN001 - the NoiseSource signature
        self.stds.append(float(std))
        return torch.zeros(shape, dtype=dtype, device=device)


def _section(overrides=(), **central):
    overrides = ["dp-feta.batch_size=8", *overrides, *(f"dp-feta.central.{k}={v}" for k, v in central.items())]
    return load_config(PRESETS / "smoke.yaml", overrides)


def _context(tmp_path: Path, images: np.ndarray, labels: np.ndarray, num_classes: int, noise, overrides=(), **central):
    config = _section(overrides, **central)
    train = ImageDataset(images, labels, num_classes, name="tiny")
    plan = DPFETA().plan(config, len(train))
    ledger = PrivacyLedger(config.privacy.epsilon, config.privacy.delta)
    ctx = RunContext(
        config=config,
        section=config.section,
        run_dir=tmp_path,
        data=SimpleNamespace(train=train),
        public=None,
        ledger=ledger,
        device=torch.device("cpu"),
        seed=0,
        log=lambda message, private=False: None,
        checkpoints=CheckpointManager(tmp_path / "checkpoints"),
        curves=CurveLog(tmp_path / "curves.jsonl"),
        plan=plan,
    )
    ctx.noise_source = lambda: noise  # the test's noise source instead of the config's
    return ctx


def _capture_releases(monkeypatch) -> list[BoundedSumRelease]:
    releases: list[BoundedSumRelease] = []
    release = dp_feta.release_downsampled_means

    def capture(*args, **kwargs):
        releases.append(release(*args, **kwargs))
        return releases[-1]

    monkeypatch.setattr(dp_feta, "release_downsampled_means", capture)
    return releases


def _digits(num: int, num_classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (num, 8, 8, 1), dtype=np.uint8), np.arange(num) % num_classes


# ---------------------------------------------------------------------------------------------- the plan
def test_plan_composes_the_release_with_dp_adam_and_calibrates_only_dp_adam():
    config = load_config(PRESETS / "mnist10k_eps1.yaml")
    plan = DPFETA().plan(config, 7000)
    central = plan.mechanism(CENTRAL)
    assert central == SubsampledGaussian(CENTRAL, 5.0, 2100 / 7000, 2)
    assert plan.calibrated == ("dp-adam",)
    # DP-Adam's sigma accounts for the release: larger than with the whole budget, and the sum meets the target.
    dp = plan.mechanism("dp-adam")
    alone = calibrate_noise(1.0, 1e-5, dp.sample_rate, dp.steps)
    assert dp.noise_multiplier > alone
    total = compute_epsilon([central, dp], 1e-5)
    assert 0.99 - 1e-9 <= total <= 1.0 and plan.epsilon() == pytest.approx(total)


def test_a_release_that_alone_passes_the_target_is_refused_at_plan_time():
    config = load_config(PRESETS / "smoke.yaml", ["dp-feta.central.noise_multiplier=0.3", "privacy.epsilon=1.0"])
    with pytest.raises(PrivacyError, match="central-image release alone"):
        DPFETA().plan(config, 300)
    with pytest.raises(ConfigError, match="central.batch_size"):
        DPFETA().plan(load_config(PRESETS / "smoke.yaml", ["dp-feta.central.batch_size=301"]), 300)


def test_paper_presets_carry_dpimagebench_values():
    config = load_config(PRESETS / "mnist_eps1.yaml")
    section = config.section
    assert (section.central.batch_size, section.central.noise_multiplier, section.central.queries) == (6000, 5.0, 5)
    assert section.central.downsample == 0.5 and section.warmup.steps == 2000 and section.warmup.batch_size == 50
    assert (section.batch_size, section.epochs, section.multiplicity, section.clip_norm) == (4096, 150.0, 32, 1e-3)
    assert section.lr == pytest.approx(3e-4) and section.warmup.lr == pytest.approx(3e-4)


# ---------------------------------------------------------------------------------------------- the release
def test_the_bound_is_the_largest_norm_of_a_downsampled_image():
    """B = sqrt(C*h*w) (= sqrt(ds^2 d)): an all-white image reaches it exactly, so clipping never bites."""
    size = downsampled_size(28, 28, 0.5)
    assert size == (14, 14)
    white = np.full((1, 28, 28, 1), 255, np.uint8)
    feature = downsampled_features(white, size)
    query = central_query(load_config(PRESETS / "smoke.yaml").section, 300, (1, 28, 28), 10)
    assert feature.shape == (1, 196) and float(feature.norm()) == pytest.approx(query.bound) == 14.0
    rgb = downsampled_features(np.full((2, 32, 32, 3), 255, np.uint8), downsampled_size(32, 32, 0.5))
    assert float(rgb[0].norm()) == pytest.approx(math.sqrt(3 * 16 * 16))


def test_adding_one_record_moves_the_class_sums_by_at_most_the_bound():
    images, labels = _digits(40, 4)
    size = downsampled_size(8, 8, 0.5)
    bound = math.sqrt(size[0] * size[1])
    base, _ = class_sums([(downsampled_features(images, size), torch.from_numpy(labels))], 16, 4, bound)
    for extra in (np.full((1, 8, 8, 1), 255, np.uint8), images[:1]):
        grown_images = np.concatenate([extra, images])
        grown_labels = np.concatenate([[2], labels])
        grown, _ = class_sums(
            [(downsampled_features(grown_images, size), torch.from_numpy(grown_labels))], 16, 4, bound
        )
        moved = (grown - base).norm()
        assert float(moved) <= bound + 1e-9
        assert torch.equal((grown - base)[[0, 1, 3]], torch.zeros(3, 16, dtype=torch.float64))  # one class only


def test_noise_std_on_the_sums_is_sigma_c_times_the_bound(tmp_path, monkeypatch):
    images, labels = _digits(60, 3)
    noise = ZeroNoise()
    ctx = _context(tmp_path, images, labels, 3, noise, batch_size=30, noise_multiplier=7.0, queries=2)
    DPFETA().release_central_images(ctx)
    bound = math.sqrt(4 * 4)  # 8x8 grey images at ds 0.5
    assert noise.stds == [pytest.approx(7.0 * bound)] * 2
    assert ctx.plan.noise_multiplier(CENTRAL) == 7.0


def test_means_divide_the_sums_by_the_public_expected_class_count_never_the_realised_one(tmp_path, monkeypatch):
    """Class 0 has 2 records, class 1 has 38: both are divided by b/K = 30/2 = 15."""
    images, _ = _digits(40, 2)
    labels = np.array([0, 0] + [1] * 38)
    releases = _capture_releases(monkeypatch)
    ctx = _context(tmp_path, images, labels, 2, ZeroNoise(), batch_size=30, queries=1)
    DPFETA().release_central_images(ctx)
    (release,) = releases
    exact, counts = class_sums([(downsampled_features(images, (4, 4)), torch.from_numpy(labels))], 16, 2, 4.0)
    assert counts.tolist() == [2.0, 38.0]
    torch.testing.assert_close(release.means, exact / 15.0)
    assert not torch.allclose(release.means[0], exact[0] / counts[0])


def test_an_empty_class_gives_a_finite_central_image(tmp_path, monkeypatch):
    images, _ = _digits(30, 3)
    labels = np.array([0, 2] * 15)  # class 1 is empty
    releases = _capture_releases(monkeypatch)
    ctx = _context(tmp_path, images, labels, 3, ZeroNoise(), batch_size=30, queries=1)
    released, released_labels = DPFETA().release_central_images(ctx)
    assert torch.isfinite(releases[0].means).all() and torch.equal(releases[0].means[1], torch.zeros(16).double())
    assert released.shape == (3, 8, 8, 1) and released.dtype == np.uint8 and released_labels.tolist() == [0, 1, 2]


def test_the_release_is_charged_query_by_query_and_resumes_without_charging_twice(tmp_path, monkeypatch):
    images, labels = _digits(60, 3)
    ctx = _context(tmp_path, images, labels, 3, ZeroNoise(), batch_size=30, queries=3)
    save, calls = CheckpointManager.save, []

    def save_then_die(manager, state, phase="main"):
        save(manager, state, phase=phase)
        calls.append(phase)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(CheckpointManager, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        DPFETA().release_central_images(ctx)
    monkeypatch.setattr(CheckpointManager, "save", save)
    assert [m.repeats for m in ctx.ledger.mechanisms()] == [2]
    released, _ = DPFETA().release_central_images(ctx)
    assert released.shape[0] == 9
    assert ctx.ledger.mechanisms() == [ctx.plan.mechanism(CENTRAL)]


def test_a_release_charged_but_not_checkpointed_stays_spent_and_the_loop_ends_on_the_plan(tmp_path):
    """A run killed between the charge and the checkpoint: the ledger is ahead; the lost release is not repeated."""
    images, labels = _digits(60, 3)
    ctx = _context(tmp_path, images, labels, 3, ZeroNoise(), batch_size=30, queries=2)
    ctx.ledger.charge(ctx.plan.mechanism(CENTRAL).__class__(CENTRAL, 5.0, 0.5, 1))
    released, released_labels = DPFETA().release_central_images(ctx)
    assert released.shape == (3, 8, 8, 1) and released_labels.tolist() == [0, 1, 2]  # one release survived
    assert ctx.ledger.mechanisms() == [ctx.plan.mechanism(CENTRAL)]
    assert ctx.checkpoints.load(phase=CENTRAL)["step"] == 2


def test_a_checkpoint_ahead_of_the_ledger_is_refused(tmp_path):
    images, labels = _digits(60, 3)
    ctx = _context(tmp_path, images, labels, 3, ZeroNoise(), batch_size=30, queries=2)
    DPFETA().release_central_images(ctx)
    fresh = _context(tmp_path, images, labels, 3, ZeroNoise(), batch_size=30, queries=2)  # same files, new ledger
    with pytest.raises(PrivacyError, match="do not belong together"):
        DPFETA().release_central_images(fresh)


def test_the_warm_up_trains_on_the_release_once_and_a_resumed_run_restores_it(tmp_path):
    images, labels = _digits(60, 3)
    warmup = ["dp-feta.warmup.steps=2", "dp-feta.warmup.batch_size=3"]
    ctx = _context(tmp_path, images, labels, 3, ZeroNoise(), warmup, batch_size=30, queries=1)
    method = DPFETA()
    method._central = method.release_central_images(ctx)
    spec = unet_spec(ctx.section, 1, 8, 3)
    warmed = method.initial_model(ctx, spec).state_dict()
    assert ctx.checkpoints.load(phase=WARMUP_PHASE)["done"]
    random = DiffusionMethod.initial_model(method, ctx, spec).state_dict()
    assert any(not torch.equal(warmed[name], random[name]) for name in warmed)  # it trained
    restored = DPFETA()
    restored._central = method._central
    again = restored.initial_model(ctx, spec).state_dict()
    assert all(torch.equal(warmed[name], again[name]) for name in warmed)


def test_a_run_whose_every_release_was_lost_skips_the_warm_up_and_ends_on_the_plan(tmp_path):
    """The only release was charged and the run killed before its checkpoint: nothing to warm up on."""
    images, labels = _digits(60, 3)
    ctx = _context(tmp_path, images, labels, 3, ZeroNoise(), batch_size=30, queries=1)
    ctx.ledger.charge(ctx.plan.mechanism(CENTRAL))
    method = DPFETA()
    method._central = method.release_central_images(ctx)
    assert method._central[0].shape == (0, 8, 8, 1) and ctx.ledger.mechanisms() == [ctx.plan.mechanism(CENTRAL)]
    spec = unet_spec(ctx.section, 1, 8, 3)
    model = method.initial_model(ctx, spec)
    random = DiffusionMethod.initial_model(method, ctx, spec)
    assert ctx.checkpoints.load(phase=WARMUP_PHASE) is None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), random.state_dict().values()))


def test_a_run_killed_between_its_ledger_and_a_central_checkpoint_resumes_and_ends_on_the_plan(tmp_path, monkeypatch):
    """The ledger of the second release reached the disk, its checkpoint did not: the resumed run does not release
    it again, warms up on the first release and ends exactly on the plan."""
    save = CheckpointManager.save

    def die_before_the_second_checkpoint(manager, state, phase="main"):
        if phase == CENTRAL and state["step"] == 2:
            manager.store.persist()  # the charge is on disk (ledger.json), the checkpoint never is
            raise KeyboardInterrupt
        save(manager, state, phase=phase)

    monkeypatch.setattr(CheckpointManager, "save", die_before_the_second_checkpoint)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_config(PRESETS / "smoke.yaml", SHRINK, out=run, echo=False)
    monkeypatch.setattr(CheckpointManager, "save", save)
    run_config(PRESETS / "smoke.yaml", SHRINK, out=run, resume=True, echo=False)
    steps = {m["name"]: m["steps"] for m in json.loads((run / "privacy.json").read_text())["mechanisms"]}
    assert steps == {CENTRAL: 2, "dp-adam": 6}
    log = (run / "log.txt").read_text()
    assert "central-images: 1 release(s) after the last checkpoint stay spent" in log
    assert "central images: 1 releases of 10 images" in log and "warm-up: 10 steps on 10 released images" in log


def test_the_release_reads_the_private_noise_source_not_the_run_seed(tmp_path):
    """Two releases with the same run seed differ: the noise and the Poisson coins come from the noise source."""
    from dpsynth.privacy.rng import NoiseSource

    images, labels = _digits(60, 3)
    first = _context(tmp_path / "a", images, labels, 3, NoiseSource(), batch_size=30, queries=1)
    second = _context(tmp_path / "b", images, labels, 3, NoiseSource(), batch_size=30, queries=1)
    a, _ = DPFETA().release_central_images(first)
    b, _ = DPFETA().release_central_images(second)
    assert not np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------- post-processing
def test_post_processing_keeps_constant_images_and_shapes():
    out = upsample_to_uint8(torch.full((2, 4), 0.5, dtype=torch.float64), 1, (2, 2), (4, 4))
    assert out.shape == (2, 4, 4, 1) and out.dtype == np.uint8 and np.all(out == 127)
    noisy = torch.tensor([[-3.0, 9.0, 0.2, 0.4]], dtype=torch.float64)
    clamped = upsample_to_uint8(noisy, 1, (2, 2), (2, 2), post_process=False)
    assert clamped[..., 0].tolist() == [[[0, 255], [51, 102]]]


def test_median_blur_removes_a_single_outlier():
    pixels = torch.zeros(1, 1, 5, 5)
    pixels[0, 0, 2, 2] = 255.0
    assert torch.equal(median_blur3(pixels), torch.zeros(1, 1, 5, 5))


# ---------------------------------------------------------------------------------------------- RandAugment
def test_rand_augment_is_a_function_of_its_generator_and_stays_in_range():
    images = torch.rand(16, 1, 12, 12)
    first = rand_augment(images, torch.Generator().manual_seed(3))
    second = rand_augment(images, torch.Generator().manual_seed(3))
    assert torch.equal(first, second) and first.shape == images.shape
    assert float(first.min()) >= 0.0 and float(first.max()) <= 1.0
    assert not torch.equal(first, images)
    assert torch.equal(rand_augment(images, torch.Generator(), num_ops=0), images)


@pytest.mark.parametrize("name", RAND_AUGMENT_OPS)
def test_every_operation_keeps_shape_and_range(name):
    images = torch.rand(4, 3, 10, 10)
    out = apply_op(name, images, torch.tensor([1.0, -1.0, 0.5, 0.1]))
    assert out.shape == images.shape and float(out.min()) >= 0.0 and float(out.max()) <= 1.0


def test_geometric_operations_move_pixels_and_fill_with_black():
    image = torch.zeros(1, 1, 9, 9)
    image[0, 0, 4, 4] = 1.0
    shifted = apply_op("translate_x", image, torch.tensor([2.0 / 9.0 / 0.45]))
    assert float(shifted[0, 0, 4, 6]) == pytest.approx(1.0, abs=1e-5) and float(shifted[0, 0, 4, 4]) < 1e-5
    rotated = apply_op("rotate", torch.ones(1, 1, 9, 9), torch.tensor([1.0]))
    assert float(rotated[0, 0, 0, 0]) < 0.5  # a corner rotated in from outside the image is black
