"""The mean-embedding skeleton (dp-merf, dp-ntk): privacy-mutant tests of its one release.

Each test fails if the release is made unsound: the noise scale (sigma x sensitivity on every coordinate,
drawn once from the run's noise source), the add/remove sensitivity of the released sums and counts, the
denominator (noisy counts or the declared N/K, never the realised class counts), the calibration of sigma
(with any prior mechanism of the run), the whole private set embedded (not a first batch), feature maps
built without private data, and no second release (or charge) on resume.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant

from dpsynth.api import Synthesizer
from dpsynth.checkpoint import CheckpointManager, CurveLog
from dpsynth.contract import RunContext
from dpsynth.data.dataset import ImageDataset
from dpsynth.errors import PrivacyError
from dpsynth.methods import get_method
from dpsynth.methods.families.mean_embedding import (
    RELEASE_PHASE,
    MeanEmbeddingMethod,
    count_weight,
    private_feature_chunks,
)
from dpsynth.privacy import Gaussian, PrivacyLedger
from dpsynth.privacy.bounded_sum import class_sums
from dpsynth.privacy.rng import NoiseSource

METHODS = ["dp-merf", "dp-ntk"]
CLASSES, SIDE = 4, 8


def small_dataset(n: int = 40, seed: int = 0, weights: tuple[float, ...] | None = None) -> ImageDataset:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, SIDE, SIDE, 1), dtype=np.uint8)
    labels = rng.choice(CLASSES, size=n, p=weights) if weights else np.arange(n) % CLASSES
    return ImageDataset(images, labels.astype(np.int64), CLASSES, name="toy")


def config_of(method: str, **overrides):
    settings = {"privacy.epsilon": 1.0, f"{method}.release_batch_size": 7}
    if method == "dp-merf":
        settings[f"{method}.num_features"] = 64
    return Synthesizer.from_config(f"{method}/smoke", {**settings, **overrides}).settings


def make_ctx(tmp_path: Path, method: str, train, noise_seed: int = 1, ledger=None, **overrides) -> RunContext:
    config = config_of(method, **overrides)
    plan = get_method(method)().plan(config, len(train))
    ctx = RunContext(
        config=config,
        section=config.section,
        run_dir=tmp_path,
        data=SimpleNamespace(train=train),
        public=None,
        ledger=ledger or PrivacyLedger(config.privacy.epsilon, config.privacy.delta),
        device=torch.device("cpu"),
        seed=0,
        log=lambda *args, **kwargs: None,
        checkpoints=CheckpointManager(tmp_path / "checkpoints"),
        curves=CurveLog(tmp_path / "curves.jsonl"),
        plan=plan,
    )
    ctx.noise_source = lambda: NoiseSource(seed=noise_seed)  # a test source: the noise is known
    return ctx


def released(tmp_path: Path, method: str, train, noise_seed: int = 1, **overrides):
    """(method, ctx, feature map, saved release) of one release over ``train``."""
    ctx = make_ctx(tmp_path, method, train, noise_seed, **overrides)
    instance = get_method(method)()
    feature_map = instance.feature_map(ctx)
    instance.release(ctx, feature_map)
    return instance, ctx, feature_map, ctx.checkpoints.load(phase=RELEASE_PHASE)


def noisy_vector(saved, weight: float) -> torch.Tensor:
    """The whole released vector [sums, w * counts] reconstructed from the saved means and noisy counts."""
    counts = saved["counts"]
    sums = saved["means"].double() * counts.clamp(min=1.0)[:, None]
    return torch.cat([sums.reshape(-1), weight * counts])


@pytest.mark.parametrize("method", METHODS)
def test_noise_is_sigma_times_the_joint_sensitivity_drawn_once(tmp_path, method):
    """The residual of the released [sums, w*counts] is exactly one draw of N(0, (sigma sqrt(1 + w^2))^2) from the
    run's noise source, with sigma the plan's: no other perturbation, no smaller scale."""
    train = small_dataset()
    instance, ctx, feature_map, saved = released(tmp_path, method, train, noise_seed=5)
    w = count_weight(ctx.section, feature_map.dim)
    assert w == pytest.approx(feature_map.dim**-0.25)  # the default: D^(-1/4)
    sigma = ctx.plan.noise_multiplier(instance.mechanism_name)
    assert 3.73 <= sigma <= 3.73 * 1.02  # eps 1, delta 1e-5: exact 3.73; the PRV upper bound pads it slightly
    sums, counts = class_sums(
        private_feature_chunks(feature_map, train, 7), feature_map.dim, CLASSES, instance.feature_bound
    )
    exact = torch.cat([sums.reshape(-1), w * counts])
    residual = noisy_vector(saved, w) - exact
    std = sigma * math.hypot(1.0, w)
    assert saved["noise_std"] == pytest.approx(std)
    drawn = NoiseSource(seed=5).normal(exact.shape, std=std, dtype=torch.float64)
    assert torch.allclose(residual, drawn, atol=1e-4 * std)
    assert float(residual.std()) == pytest.approx(std, rel=0.15)
    assert ctx.ledger.mechanisms() == [Gaussian(instance.mechanism_name, sigma, 1)]


@pytest.mark.parametrize("method", METHODS)
def test_one_added_record_moves_the_released_vector_by_at_most_its_sensitivity(tmp_path, method):
    """Add/remove: with the same test noise, the released [sums, w*counts] of neighbouring datasets differ by
    at most sqrt(1 + w^2), whatever the added image and label (features have norm 1: one class row moves)."""
    base = small_dataset(30, seed=1)
    for case in range(3):
        weight = {f"{method}.count_weight": [0.5, 2.0, 0.05][case]}
        rng = np.random.default_rng(10 + case)
        extra = rng.integers(0, 256, size=(1, SIDE, SIDE, 1), dtype=np.uint8)
        if case == 1:
            extra[:] = 255
        position = [0, 15, 30][case]
        images = np.concatenate([base.images[:position], extra, base.images[position:]])
        labels = np.concatenate([base.labels[:position], [case % CLASSES], base.labels[position:]])
        grown = ImageDataset(images, labels, CLASSES, name="toy")
        _, _, _, without = released(tmp_path / f"a{case}", method, base, noise_seed=case, **weight)
        _, _, _, with_record = released(tmp_path / f"b{case}", method, grown, noise_seed=case, **weight)
        w = [0.5, 2.0, 0.05][case]
        moved = float((noisy_vector(with_record, w) - noisy_vector(without, w)).norm())
        # float32 means: a relative slack of 1e-3, far below a doubled sensitivity
        assert 0.5 < moved <= math.hypot(1.0, w) * (1 + 1e-3), (case, moved)


@pytest.mark.parametrize("method", METHODS)
def test_declared_denominator_is_n_over_k_never_the_realised_class_counts(tmp_path, method):
    """denominator: declared divides every class sum by N/K, even when the classes are unbalanced, and releases
    no counts; the sensitivity is then that of the sums alone (1)."""
    train = small_dataset(48, weights=(0.55, 0.25, 0.15, 0.05))
    instance, ctx, feature_map, saved = released(
        tmp_path, method, train, noise_seed=2, **{f"{method}.denominator": "declared"}
    )
    assert saved["counts"] is None and saved["noise_std"] == pytest.approx(
        ctx.plan.noise_multiplier(method_name(method))
    )
    sums, _ = class_sums(private_feature_chunks(feature_map, train, 7), feature_map.dim, CLASSES, 1.0)
    noise = NoiseSource(seed=2).normal((CLASSES * feature_map.dim,), std=saved["noise_std"], dtype=torch.float64)
    expected = (sums + noise.reshape(CLASSES, -1)) / (len(train) / CLASSES)
    assert torch.allclose(saved["means"].double(), expected, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_noisy_counts_are_the_divisor_not_the_exact_counts(tmp_path, method):
    train = small_dataset(48, weights=(0.55, 0.25, 0.15, 0.05))
    _, ctx, _, saved = released(tmp_path, method, train, noise_seed=3)
    exact = torch.bincount(torch.as_tensor(train.labels), minlength=CLASSES).double()
    assert not torch.allclose(saved["counts"], exact, atol=1.0)  # count noise std sigma sqrt(1+w^2)/w ~ 37
    sums = saved["means"].double() * saved["counts"].clamp(min=1.0)[:, None]
    assert torch.isfinite(saved["means"]).all() and torch.isfinite(sums).all()


def method_name(method: str) -> str:
    return get_method(method).mechanism_name


@pytest.mark.parametrize("method", METHODS)
def test_the_release_embeds_every_private_record_once(tmp_path, method):
    """The whole private training set, not its first minibatch (DPImageBench's DP-NTK), each record once."""
    train = small_dataset(45)
    ctx = make_ctx(tmp_path, method, train)
    instance = get_method(method)()
    feature_map = instance.feature_map(ctx)
    seen = []
    original = feature_map.features

    def counting(inputs):
        seen.append(len(inputs))
        return original(inputs)

    feature_map.features = counting
    instance.release(ctx, feature_map)
    assert sum(seen) == len(train) and max(seen) <= ctx.section.release_batch_size


@pytest.mark.parametrize("method", METHODS)
def test_the_feature_map_is_built_without_private_data(tmp_path, method):
    """Bandwidths, random frequencies and the e-NTK network come from public seeds and shapes only."""
    train = small_dataset()
    ctx = make_ctx(tmp_path, method, train)

    class LayoutOnly:
        """The declared layout (image shape, class count) and nothing else of the private set."""

        image_shape = train.image_shape
        num_classes = CLASSES

        def __getattr__(self, name):
            raise AssertionError(f"the feature map read private data ({name})")

        def __len__(self):
            raise AssertionError("the feature map read the private set size")

    ctx.data = SimpleNamespace(train=LayoutOnly())
    instance = get_method(method)()
    features = instance.feature_map(ctx)
    reference = instance.feature_map(make_ctx(tmp_path / "reference", method, train))
    probe = torch.rand(3, 1, SIDE, SIDE) * 2 - 1
    assert torch.equal(features(probe), reference(probe))


@pytest.mark.parametrize("method", METHODS)
def test_a_charged_release_whose_target_was_lost_is_never_released_again(tmp_path, method):
    """A crash between the ledger write and the target's checkpoint: resuming must not re-release (a second
    charge the plan does not hold) nor read the private data."""
    train = small_dataset()
    ctx = make_ctx(tmp_path, method, train)
    ctx.ledger.charge(ctx.plan.mechanism(method_name(method)))
    instance = get_method(method)()
    with pytest.raises(PrivacyError, match="charged"):
        instance.release(ctx, instance.feature_map(ctx))
    assert len(ctx.ledger.mechanisms()) == 1 and ctx.ledger.mechanisms()[0].repeats == 1


@pytest.mark.parametrize("method", METHODS)
def test_a_checkpointed_release_is_reused_without_a_second_charge(tmp_path, method):
    train = small_dataset()
    instance, ctx, feature_map, saved = released(tmp_path, method, train)
    again = get_method(method)().release(ctx, feature_map)
    assert torch.equal(again, saved["means"])
    assert [m.repeats for m in ctx.ledger.mechanisms()] == [1]


def independent_epsilon(sigmas: list[float], delta: float) -> float:
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dpe.ComposedDpEvent([dpe.GaussianDpEvent(s) for s in sigmas]))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("epsilon, sigma", [(1.0, 3.73), (10.0, 0.500)])
def test_sigma_is_calibrated_for_the_target_and_an_independent_accountant_agrees(method, epsilon, sigma):
    """The exact single-Gaussian calibration (dp-merf.md: 3.73 / 0.500 at delta 1e-5), up to the PRV
    accountant's upper bound (at most 2 % more noise); dp_accounting's PLD confirms the target is met and
    that 3 % less noise would pass it (σ is neither padded much nor halved)."""
    config = config_of(method, **{"privacy.epsilon": epsilon})
    plan = get_method(method)().plan(config, 7000)
    found = plan.noise_multiplier(method_name(method))
    assert sigma * 0.999 <= found <= sigma * 1.02
    assert independent_epsilon([found], 1e-5) <= epsilon * 1.01
    assert independent_epsilon([found * 0.97], 1e-5) > epsilon


class _WithPrior(MeanEmbeddingMethod):
    """A test composition: a Gaussian mechanism spent before the release (e.g. a private pre-processing)."""

    name = "with-prior"
    mechanism_name = "embedding"

    @classmethod
    def prior_mechanisms(cls, config, num_examples):
        return (Gaussian("earlier", 8.0, 1),)

    def feature_map(self, ctx):  # pragma: no cover - the plan only
        raise NotImplementedError


def test_the_release_leaves_room_for_mechanisms_spent_before_it():
    """Composition (dp-merf.md: DPImageBench ignores privacy_history): with a prior mechanism the release's σ
    grows so that both together meet the target, which an independent accountant confirms."""
    config = config_of("dp-merf", **{"privacy.epsilon": 1.0})
    alone = get_method("dp-merf")().plan(config, 7000)
    composed = _WithPrior().plan(config, 7000)
    assert composed.names() == ["embedding", "earlier"]
    assert composed.noise_multiplier("embedding") > alone.noise_multiplier("rff-embedding") * 1.05
    assert 0.99 - 0.01 <= composed.epsilon() <= 1.0
    assert independent_epsilon([composed.noise_multiplier("embedding"), 8.0], 1e-5) <= 1.0 * 1.01
    ledger = PrivacyLedger(1.0, 1e-5)
    for mechanism in reversed(composed.mechanisms):
        ledger.charge(mechanism)  # the prior first, then the release: within the budget
    composed.check_spent(ledger)


@pytest.mark.parametrize("method", METHODS)
def test_a_checkpointed_target_the_ledger_never_charged_is_refused(tmp_path, method):
    """A release checkpoint without its charge in the ledger (files of different runs mixed): refused before
    anything is trained on it or released again."""
    train = small_dataset()
    _, _, _, saved = released(tmp_path, method, train)
    fresh = make_ctx(tmp_path, method, train)  # the same run directory, an empty ledger
    instance = get_method(method)()
    with pytest.raises(PrivacyError, match="ledger holds 0 releases but the checkpoint 1"):
        instance.release(fresh, instance.feature_map(fresh))
    assert fresh.ledger.mechanisms() == []


def test_the_released_state_restores_the_generator_that_fit_trained(tmp_path):
    """``state_dict`` after ``fit``, loaded into a fresh instance (as ``dpsynth generate`` does), samples exactly
    what the fitted instance samples: the released generator is all that generation reads."""
    train = small_dataset()
    ctx = make_ctx(tmp_path, "dp-merf", train, **{"dp-merf.steps": 3, "dp-merf.checkpoint_every": 2})
    fitted = get_method("dp-merf")()
    fitted.fit(ctx)
    state = fitted.state_dict()
    assert set(state) == {"generator"} and all(v.device.type == "cpu" for v in state["generator"].values())
    restored = get_method("dp-merf")()
    restored.load_state_dict(state, make_ctx(tmp_path / "other", "dp-merf", train))
    expected, again = fitted.generate(ctx, 12), restored.generate(ctx, 12)
    assert np.array_equal(expected.images, again.images) and np.array_equal(expected.labels, again.labels)
    assert len(set(expected.labels.tolist())) == CLASSES
