"""Private Evolution (``pe``): the method contract on its smoke preset, and privacy tests of its vote release that
fail when the mechanism is made unsound (sensitivity, one ledger entry per round, sigma over T rounds, classes
from the metadata, the threshold and its uniform fallback)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dpsynth.checkpoint import CheckpointManager, CurveLog
from dpsynth.config import load_config
from dpsynth.contract import RunContext
from dpsynth.data import load_public
from dpsynth.data.dataset import ImageDataset
from dpsynth.diffusion.samplers import vary
from dpsynth.diffusion.schedules import build_schedule
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods import get_method
from dpsynth.methods import pe as pe_module
from dpsynth.methods.pe import MECHANISM, balanced_draw, resampling_weights, vote_rows
from dpsynth.privacy import Gaussian, PrivacyLedger
from dpsynth.privacy.accountants import compute_epsilon
from dpsynth.privacy.bounded_sum import class_sums
from dpsynth.runner import run_config
from dpsynth.testing import SHRINK, MethodContractTests

TINY = {"backbone.steps": 10, "backbone.batch_size": 16, "backbone.autoencoder.base_channels": 8}


class TestPEContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on ``pe/smoke`` with the tiny backbone."""

    method = "pe"
    shrink = {**SHRINK, **TINY}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"pe.variation_degrees": [1]}, "one degree per round"),
        ({"pe.variation_degrees": [1, 4]}, r"sample_steps - 1 = 3"),
        ({"pe.population": 45}, "pe.population"),
        ({"pe.num_nearest": 5}, "pe.num_nearest"),
        ({"pe.model": "no-such-unet"}, "pe.model"),
        ({"pe.loss": "hybrid"}, "learn_sigma"),
        ({"pe.threshold": -1}, "pe.threshold"),
        ({"pe.pretrain.enabled": False}, "cannot be disabled"),
    ],
)
def test_bad_settings_fail_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("pe/smoke", overrides)


def test_public_data_is_required_at_load():
    with pytest.raises(ConfigError, match="public"):
        load_config("pe/smoke", {"data.public": None})


@pytest.mark.parametrize("epsilon, rounds", [(1.0, 10), (10.0, 11), (4.0, 3)])
def test_sigma_is_calibrated_so_that_t_rounds_spend_the_target(epsilon, rounds):
    """T Gaussian rounds as one planned entry; sigma solved so that exactly T of them land at the target, which
    T + 1 of them would pass (so one round too many, or a sigma for one round, is caught)."""
    config = load_config(
        "pe/smoke",
        {"privacy.epsilon": epsilon, "pe.rounds": rounds, "pe.variation_degrees": [1] * rounds},
    )
    plan = get_method("pe")().plan(config, 7000)
    (mechanism,) = plan.mechanisms
    assert mechanism.name == MECHANISM and mechanism.repeats == rounds and plan.calibrated == (MECHANISM,)
    assert isinstance(mechanism, Gaussian)
    assert epsilon - 0.01 <= plan.epsilon() <= epsilon
    sigma = mechanism.noise_multiplier
    one_more = compute_epsilon([Gaussian(MECHANISM, sigma, rounds + 1)], config.privacy.delta)
    assert one_more > epsilon
    fixed = get_method("pe")().plan(load_config("pe/smoke", {"pe.noise_multiplier": 50.0}), 7000)
    assert fixed.noise_multiplier(MECHANISM) == 50.0 and fixed.epsilon() < 10.0 and not fixed.calibrated


def _neighbours(num_nearest: int):
    generator = torch.Generator().manual_seed(0)
    candidates = torch.randn(3, 6, 5, generator=generator)  # K = 3 classes, 6 candidates each, D = 5
    private = torch.randn(20, 5, generator=generator)
    labels = torch.arange(20) % 3
    full = class_sums([(vote_rows(private, labels, candidates, num_nearest), labels)], 6, 3, math.sqrt(num_nearest))[0]
    less = class_sums(
        [(vote_rows(private[1:], labels[1:], candidates, num_nearest), labels[1:])], 6, 3, math.sqrt(num_nearest)
    )[0]
    return private, labels, candidates, full, less


def test_removing_one_record_changes_one_bin_by_exactly_one():
    private, labels, candidates, full, less = _neighbours(1)
    difference = full - less
    assert torch.count_nonzero(difference) == 1 and float(difference.sum()) == 1.0
    nearest = int(torch.cdist(private[:1], candidates[int(labels[0])]).argmin())
    assert float(difference[int(labels[0]), nearest]) == 1.0  # the removed record's nearest, in its own class
    assert float(full.sum()) == len(private)  # every record votes once


def test_k_nearest_votes_move_k_bins_and_the_bound_is_sqrt_k():
    *_, full, less = _neighbours(3)
    difference = full - less
    assert torch.count_nonzero(difference) == 3 and set(difference[difference != 0].tolist()) == {1.0}
    assert float(difference.norm()) == pytest.approx(math.sqrt(3))
    section = load_config("pe/smoke", {"pe.num_nearest": 3}).section
    assert section.query(1.0, 10).sensitivity == pytest.approx(math.sqrt(3))
    assert section.query(2.0, 10).noise_std == pytest.approx(2.0 * math.sqrt(3))


def test_threshold_and_uniform_fallback():
    histogram = torch.tensor([[5.0, 1.0, -2.0], [0.5, 0.2, -1.0]], dtype=torch.float64)
    weights, empty = resampling_weights(histogram, threshold=1.0)
    assert weights[0].tolist() == [4.0, 0.0, 0.0]
    assert empty == [1] and weights[1].tolist() == [1.0, 1.0, 1.0]  # all below H: uniform resampling
    weights, empty = resampling_weights(histogram, threshold=0.0)
    assert empty == [] and weights[1].tolist() == [0.5, 0.2, 0.0]


def test_balanced_draw_cycles_over_the_classes_and_repeats_only_when_short():
    images = np.arange(12, dtype=np.uint8).reshape(12, 1, 1, 1)
    labels = np.repeat(np.arange(3), 4)
    drawn, drawn_labels = balanced_draw(images, labels, 9, seed=0)
    assert drawn_labels.tolist() == [0, 1, 2] * 3
    assert len(set(drawn[:, 0, 0, 0].tolist())) == 9 and all(labels[drawn[:, 0, 0, 0]] == drawn_labels)
    drawn, _ = balanced_draw(images, labels, 30, seed=0)
    assert len(set(drawn[:, 0, 0, 0].tolist())) == 12


def test_a_variation_starting_late_stays_close_and_the_degree_is_checked():
    """With a model that predicts no noise, a variation that skips all but one step returns (almost) its input, and
    one that starts at the noisiest step does not: the degree sets where SDEdit starts."""
    schedule = build_schedule("linear")

    def no_noise(x, t, y=None):
        return torch.zeros_like(x)

    start = torch.linspace(-2.0, 2.0, 32).reshape(2, 4, 2, 2)
    options = {"steps": 10, "clip_denoised": False}
    late = vary(no_noise, schedule, start, None, skip=9, generator=torch.Generator().manual_seed(0), **options)
    early = vary(no_noise, schedule, start, None, skip=0, generator=torch.Generator().manual_seed(0), **options)
    assert late.shape == start.shape and float((late - start).abs().max()) < 0.05
    assert float((early - start).abs().max()) > 1.0
    with pytest.raises(ConfigError, match="skips 0 to 9"):
        vary(no_noise, schedule, start, None, steps=10, skip=10)


def _context(tmp_path, train, overrides):
    config = load_config("pe/smoke", {**TINY, **overrides})
    return RunContext(
        config=config,
        section=config.section,
        run_dir=tmp_path,
        data=SimpleNamespace(train=train),
        public=load_public("glyphs", max_size=300),
        ledger=PrivacyLedger(config.privacy.epsilon, config.privacy.delta),
        device=torch.device("cpu"),
        seed=0,
        log=lambda line: (tmp_path / "log.txt").open("a").write(line + "\n"),
        checkpoints=CheckpointManager(tmp_path / "checkpoints"),
        curves=CurveLog(tmp_path / "curves.jsonl"),
        plan=get_method("pe")().plan(config, len(train)),
    )


def test_classes_come_from_the_metadata_the_threshold_falls_back_and_each_round_is_one_charge(tmp_path, monkeypatch):
    """Three declared classes, records of two: the third still gets its share of candidates and of the samples; a
    threshold above every count falls back to uniform resampling, logged without counts; every round charges one
    release of the one mechanism, whose histograms cover the declared classes."""
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))
    spent: list[int] = []
    release = pe_module.release_bounded_sum

    def counting_release(chunks, dim, query, ledger, noise, **options):
        released = release(chunks, dim, query, ledger, noise, **options)
        (mechanism,) = ledger.mechanisms()
        spent.append(mechanism.repeats)
        assert released.sums.shape == (3, dim) and query.num_classes == 3  # one Gaussian for all declared classes
        return released

    monkeypatch.setattr(pe_module, "release_bounded_sum", counting_release)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 28, 28, 1), dtype=np.uint8)
    train = ImageDataset(images, (np.arange(40) % 2).astype(np.int64), 3, name="two of three")
    ctx = _context(tmp_path, train, {"pe.population": 30, "pe.threshold": 1.0e6})
    method = get_method("pe")()
    method.fit(ctx)
    assert spent == [1, 2]  # rounds 1 and 2: one more repeat of the one entry each
    ctx.plan.check_spent(ctx.ledger)
    samples = method.generate(ctx, 9)
    assert sorted(samples.labels.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert samples.images.shape == (9, 28, 28, 1) and samples.images.dtype == np.uint8
    log = (tmp_path / "log.txt").read_text()
    assert log.count("3 class(es) had no candidate above the threshold") == 2
    with pytest.raises(ConfigError, match="pe.population"):
        get_method("pe")().fit(_context(tmp_path / "odd", train, {"pe.population": 40}))


def test_a_run_killed_after_a_round_resumes_without_spending_it_again(tmp_path, monkeypatch):
    """Killed right after round 1 was charged and its population saved: the resumed run spends rounds 2..T only."""
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))
    save, phases = CheckpointManager.save, []

    def save_then_die_after_round_one(manager, state, phase="main"):
        save(manager, state, phase=phase)
        phases.append((phase, state.get("round")))
        if phase == "population" and state.get("round") == 1:
            raise KeyboardInterrupt

    overrides = {**SHRINK, **TINY}
    with monkeypatch.context() as patch:
        patch.setattr(CheckpointManager, "save", save_then_die_after_round_one)
        with pytest.raises(KeyboardInterrupt):
            run_config("pe/smoke", overrides, out=tmp_path / "run", echo=False)
    stored = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert [m["steps"] for m in stored["mechanisms"] if m["name"] == MECHANISM] == [1]
    run = run_config("pe/smoke", overrides, out=tmp_path / "run", resume=True, echo=False)
    privacy = json.loads((run / "privacy.json").read_text())
    assert [(m["name"], m["steps"]) for m in privacy["mechanisms"]] == [(MECHANISM, 2)]
    assert "resumed after 1 of 2 rounds" in (run / "log.txt").read_text()


def test_a_charged_round_without_its_population_is_refused_before_anything_is_built(tmp_path):
    train = ImageDataset(np.zeros((20, 28, 28, 1), np.uint8), (np.arange(20) % 10).astype(np.int64), 10, name="z")
    ctx = _context(tmp_path, train, {})
    ctx.ledger.register(ctx.section.query(ctx.plan.noise_multiplier(MECHANISM), 10).mechanism(0))
    ctx.ledger.spend(MECHANISM, 1)  # charged, then the process died before the population was written
    with pytest.raises(PrivacyError, match="holds 1 'pe-votes' rounds but the checkpoint 0"):
        get_method("pe")().fit(ctx)


def test_dpsynth_pretrain_builds_the_api_ahead_of_the_run(tmp_path, monkeypatch):
    """`dpsynth pretrain pe/...` builds the backbone and the API model; the run then finds both in the cache."""
    from dpsynth.pretraining import pretrain

    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))
    built = pretrain("pe/smoke", TINY, log=lambda line: None)
    assert [model["kind"] for model in built] == ["autoencoder", "diffusion"]
    assert not any(model["cached"] for model in built)
    run = run_config("pe/smoke", {**SHRINK, **TINY}, out=tmp_path / "run", echo=False)
    log = (run / "log.txt").read_text()
    assert "backbone: cache hit" in log and "pre-training: cache hit" in log and "API model" in log


@pytest.mark.parametrize("mode", ["unconditional", "public-labels", "names"])
def test_the_random_api_conditions_every_declared_class(mode):
    """K x M conditions, class-major: the null class, uniform public classes, or the public class of the same name
    (class names are metadata) and the null class for a private class no public class is named after."""
    section = load_config("pe/smoke", {"pe.random_api": mode}).section
    api = pe_module.PublicApi.__new__(pe_module.PublicApi)
    api.section, api.public_classes = section, 5
    ctx = SimpleNamespace(
        public=SimpleNamespace(class_names=["x", "b", "y", "a", "z"]),
        data=SimpleNamespace(train=SimpleNamespace(class_names=["a", "b", "c"])),
    )
    labels = api.random_labels(ctx, 3, 4, torch.Generator().manual_seed(0))
    assert labels.shape == (12,)
    if mode == "unconditional":
        assert labels.tolist() == [5] * 12
    elif mode == "names":
        assert labels.tolist() == [3] * 4 + [1] * 4 + [5] * 4
    else:
        assert 0 <= int(labels.min()) and int(labels.max()) < 5 and len(set(labels.tolist())) > 1


def test_the_api_pre_training_is_the_shared_latent_recipe():
    """pe/mnist10k_*'s public pre-training settings equal a latent PDP-Diffusion config's with the same recipe, so
    both hit one cache entry (the key hashes these settings, the spec, the public set and the seed)."""
    from dpsynth.methods.families.diffusion import pretrain_settings

    recipe = {
        "model": "ldm-0.8m",
        "learn_sigma": False,
        "loss": "simple",
        "noise_schedule": "linear",
        "timesteps": 1000,
        "pretrain.steps": 3000,
        "pretrain.batch_size": 128,
        "pretrain.lr": 0.001,
        "pretrain.warmup_steps": 100,
        "pretrain.ema_decay": 0.999,
    }
    pdp = load_config(
        "pdp-diffusion/mnist10k_eps10",
        {"pdp-diffusion.space": "latent", **{f"pdp-diffusion.{key}": value for key, value in recipe.items()}},
    )
    for eps in (1, 10):
        pe = load_config(f"pe/mnist10k_eps{eps}")
        assert pretrain_settings(pe.section) == pretrain_settings(pdp.section)
        assert pe.data.public == pdp.data.public and pe.seed == pdp.seed and pe.backbone == pdp.backbone
        assert {key: getattr(pe.section, key) for key in recipe if "." not in key} == {
            key: getattr(pdp.section, key) for key in recipe if "." not in key
        }


def test_the_api_shares_dp_ldms_pre_trained_latent_model():
    """pe/mnist10k_* and dp-ldm/mnist10k_* pre-train the same latent model: one cache entry for both."""
    from dpsynth.methods.families.diffusion import pretrain_settings

    ldm = load_config("dp-ldm/mnist10k_eps10")
    for eps in (1, 10):
        pe = load_config(f"pe/mnist10k_eps{eps}")
        assert pretrain_settings(pe.section) == pretrain_settings(ldm.section)
        assert (pe.data.public, pe.data.max_public, pe.seed, pe.backbone) == (
            ldm.data.public,
            ldm.data.max_public,
            ldm.seed,
            ldm.backbone,
        )
        keys = ("model", "unet", "learn_sigma", "noise_schedule", "timesteps")
        assert {key: getattr(pe.section, key) for key in keys} == {key: getattr(ldm.section, key) for key in keys}
