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
from dpsynth.methods.pe import MECHANISM, POPULATION_PHASE
from dpsynth.privacy import Gaussian, PrivacyLedger
from dpsynth.privacy.accountants import compute_epsilon
from dpsynth.runner import run_config
from dpsynth.selection import evolution
from dpsynth.testing import SHRINK, MethodContractTests, contract_cache

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


def test_the_vote_query_has_bound_sqrt_k_and_noise_sigma_sqrt_k():
    """The votes' L2 sensitivity is sqrt(k) (k-hot rows: dpsynth.selection.evolution's tests), and so is the noise."""
    section = load_config("pe/smoke", {"pe.num_nearest": 3}).section
    assert section.query(1.0, 10).sensitivity == pytest.approx(math.sqrt(3))
    assert section.query(2.0, 10).noise_std == pytest.approx(2.0 * math.sqrt(3))


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
        public=load_public(config.data.public, max_size=config.data.max_public),  # the run's: one cache entry
        ledger=PrivacyLedger(config.privacy.epsilon, config.privacy.delta),
        device=torch.device("cpu"),
        seed=0,
        log=lambda line: (tmp_path / "log.txt").open("a").write(line + "\n"),
        checkpoints=CheckpointManager(tmp_path / "checkpoints"),
        curves=CurveLog(tmp_path / "curves.jsonl"),
        plan=get_method("pe")().plan(config, len(train)),
    )


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache of public models (backbone, API) for the tests that fit: they differ only in the private phase.
    It is the contract's cache (dpsynth.testing), whose runs pre-train with the same settings: a process that runs
    both builds the public models once."""
    return contract_cache(tmp_path_factory)


def test_classes_come_from_the_metadata_the_threshold_falls_back_and_each_round_is_one_charge(
    tmp_path, monkeypatch, shared_cache
):
    """Three declared classes, records of two: the third still gets its share of candidates and of the samples; a
    threshold above every count falls back to uniform resampling, logged without counts; every round charges one
    release of the one mechanism, whose histograms cover the declared classes."""
    monkeypatch.setenv("DPSYNTH_CACHE", str(shared_cache))
    spent: list[int] = []
    release = evolution.release_bounded_sum

    def counting_release(chunks, dim, query, ledger, noise, **options):
        released = release(chunks, dim, query, ledger, noise, **options)
        (mechanism,) = ledger.mechanisms()
        spent.append(mechanism.repeats)
        assert released.sums.shape == (3, dim) and query.num_classes == 3  # one Gaussian for all declared classes
        return released

    monkeypatch.setattr(evolution, "release_bounded_sum", counting_release)
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


@pytest.mark.parametrize("killed", ["after its population was saved", "before its population was saved"])
def test_a_run_killed_after_round_one_was_charged_resumes_and_ends_on_its_plan(
    tmp_path, monkeypatch, shared_cache, killed
):
    """Killed once round 1 was charged, with its population saved or not (the ledger then one round ahead of the
    checkpoint): the resumed run continues at round 2 from the last saved population, never spends round 1 again,
    and ends on its plan of 2 rounds."""
    monkeypatch.setenv("DPSYNTH_CACHE", str(shared_cache))
    save, before = CheckpointManager.save, killed.startswith("before")

    def die_at_round_one(manager, state, phase="main"):
        at_round_one = phase == POPULATION_PHASE and state.get("step") == 1
        if at_round_one and before:  # killed inside the save: the ledger state is written first, then the state
            manager.store.persist()
            raise KeyboardInterrupt
        save(manager, state, phase=phase)
        if at_round_one:
            raise KeyboardInterrupt

    overrides = {**SHRINK, **TINY}
    with monkeypatch.context() as patch:
        patch.setattr(CheckpointManager, "save", die_at_round_one)
        with pytest.raises(KeyboardInterrupt):
            run_config("pe/smoke", overrides, out=tmp_path / "run", echo=False)
    stored = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert [m["steps"] for m in stored["mechanisms"] if m["name"] == MECHANISM] == [1]
    saved = CheckpointManager(tmp_path / "run" / "checkpoints").load(phase=POPULATION_PHASE)
    assert saved["step"] == (0 if before else 1)
    run = run_config("pe/smoke", overrides, out=tmp_path / "run", resume=True, echo=False)
    privacy = json.loads((run / "privacy.json").read_text())
    assert [(m["name"], m["steps"]) for m in privacy["mechanisms"]] == [(MECHANISM, 2)]
    log = (run / "log.txt").read_text()
    assert f"{MECHANISM}: resumed at release 1" in log
    assert ("1 release(s) after the last checkpoint stay spent" in log) == before
    assert log.count("pe: round 1/2") == 1 and log.count("pe: round 2/2") == 1  # round 1 ran once, before the kill
    assert len(np.load(run / "samples.npz")["labels"]) == load_config("pe/smoke", overrides).generate.num


def test_a_ledger_behind_its_population_checkpoint_is_refused_before_anything_is_built(tmp_path):
    train = ImageDataset(np.zeros((20, 28, 28, 1), np.uint8), (np.arange(20) % 10).astype(np.int64), 10, name="z")
    ctx = _context(tmp_path, train, {})
    ctx.checkpoints.save({"step": 1, "latents": None, "api_labels": None}, phase=POPULATION_PHASE)
    with pytest.raises(PrivacyError, match="holds 0 releases but the checkpoint 1"):
        get_method("pe")().fit(ctx)
    assert not (tmp_path / "log.txt").exists() or "backbone" not in (tmp_path / "log.txt").read_text()


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
