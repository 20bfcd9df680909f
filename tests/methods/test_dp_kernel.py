"""dp-kernel: the method contract on its smoke preset, and privacy-mutant style tests of its per-step release.

The critical one: the generator's update must be the update of the *released* (noisy) embedding, i.e.
differ from the update computed from the noiseless class means of the same Poisson sample by exactly
the noise's contribution. DPImageBench's code (the noise added as a constant at the generated points)
makes the two equal; :func:`test_a_mutant_that_differentiates_the_noiseless_embedding_is_caught` runs
that mutant through the same check and asserts it fails.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

import dpsynth.methods.dp_kernel as dp_kernel
import dpsynth.methods.families.mean_embedding as family
from dpsynth.kernels import MomentMatchingSettings, RandomFourierFeatures, moment_matching_loss, train_moment_matching
from dpsynth.kernels.feature_map import class_feature_means
from dpsynth.models.merf_generator import build_merf_generator
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.bounded_sum import BoundedSumRelease, class_sums, poisson_sample
from dpsynth.privacy.rng import NoiseSource
from dpsynth.testing import MethodContractTests

CLASSES, SIDE, N = 3, 8, 240
SIGMA, NOISE_SEED = 1.5, 7


class TestDPKernelContract(MethodContractTests):
    method = "dp-kernel"

    def test_one_inserted_record_moves_the_clipped_sum_by_at_most_the_clip_norm(
        self, tmp_path: Any, monkeypatch: Any
    ) -> None:
        """dp-kernel has no DP-SGD step; its subsampled mechanism is the per-step bounded-sum release. The same
        neighbouring-batch check on it: the exact per-class feature sums of a batch and of the batch with one
        record inserted at the front or in the middle differ by at most the declared bound (1)."""
        captured: dict[str, Any] = {}

        class Captured(Exception):
            pass

        def capture(self: family.EmbeddingReleases, step: int) -> torch.Tensor:
            captured["releases"] = self
            raise Captured

        monkeypatch.setattr(family.EmbeddingReleases, "__call__", capture)
        with pytest.raises(Captured):
            self.synthesizer(self.shrink).fit(out=tmp_path / "run")
        releases = captured["releases"]
        bound, dim, classes = releases.query.bound, releases.feature_map.dim, releases.query.num_classes

        def sums(order: list[int]) -> torch.Tensor:
            return class_sums(releases._select(torch.tensor(order)), dim, classes, bound)[0]

        batch = list(range(4, 12))
        base = sums(batch)
        assert base.norm() > 0
        for grown in ([0, *batch], [*batch[:4], 1, *batch[4:]]):
            moved = float((sums(grown) - base).norm())
            assert moved <= bound * (1 + 1e-6), f"one record moved the released sums by {moved:.3f} > {bound}"
            assert moved == pytest.approx(bound, rel=1e-4)  # unit-norm features: exactly the bound


# ---------------------------------------------------------------------------------------------- the setting


def private_set() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(N) % CLASSES
    images = torch.rand(N, 1, SIDE, SIDE, generator=generator) * 2 - 1
    for c in range(CLASSES):  # every class its own bright square: class means that differ
        images[labels == c, 0, 2 * c : 2 * c + 3, 2 * c : 2 * c + 3] = 1.0
    return images, labels


def section(**overrides: Any) -> dp_kernel.DPKernelSection:
    values = {"batch_size": 60, "steps": 3, "num_features": 400, "bandwidths": [2.0, 4.0], "gen_batch_size": 30}
    return dp_kernel.DPKernelSection(**{**values, **overrides})


def make_releases(images, labels, noise_seed: int = NOISE_SEED, **overrides: Any) -> family.EmbeddingReleases:
    config = section(**overrides)
    features = RandomFourierFeatures(SIDE * SIDE, config.num_features, tuple(config.bandwidths), seed=1)
    query = dp_kernel.DPKernel.query(config, SIGMA, CLASSES, len(images), features.dim)
    ledger = PrivacyLedger(target_epsilon=None, delta=1e-5, guarantee="none")  # records, no budget search
    return family.EmbeddingReleases(
        features, images, labels, query, ledger, NoiseSource(seed=noise_seed), running=config.target == "running_mean"
    )


def replayed_sample_and_noise(releases: family.EmbeddingReleases) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fixed test noise source gives the first release, drawn independently of the method: the Poisson
    coins, then one Gaussian vector of std sigma x sensitivity over all K x D sums (the bounded-sum order)."""
    query = releases.query
    source = NoiseSource(seed=NOISE_SEED)
    indices = poisson_sample(len(releases.images), query.sample_rate, source)
    noise = source.normal((query.num_classes * releases.feature_map.dim,), std=query.noise_std, dtype=torch.float64)
    return indices, noise.reshape(query.num_classes, -1)


def noiseless_means(releases: family.EmbeddingReleases, indices: torch.Tensor) -> torch.Tensor:
    """The exact class means of the sampled records over the declared denominator: never released."""
    query = releases.query
    sums, _ = class_sums(releases._select(indices), releases.feature_map.dim, query.num_classes, query.bound)
    return sums / torch.tensor(query.denominator, dtype=torch.float64)[:, None]


def small_generator() -> torch.nn.Module:
    return build_merf_generator(CLASSES, 1, SIDE, seed=3, z_dim=4, hidden=32, conv_channels=(8, 4))


def generator_inputs(settings: MomentMatchingSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The public labels and latents of the trainer's first step (same public seed, same draw order)."""
    from dpsynth.report.balance import balanced_labels

    rng = torch.Generator().manual_seed(int(settings.seed))
    labels = torch.from_numpy(balanced_labels(settings.batch_size, CLASSES, rng))
    return labels, torch.randn(settings.batch_size, 4, generator=rng)


def gradient(generator: torch.nn.Module, loss_of_means) -> torch.Tensor:
    generator.zero_grad(set_to_none=True)
    loss_of_means().backward()
    return torch.cat([p.grad.flatten() for p in generator.parameters()]).double()


def check_update_carries_the_noise() -> dict[str, float]:
    """One step of the method's own path (EmbeddingReleases + the trainer) from a fixed test noise source; its
    gradient must equal the noiseless class means' gradient plus the noise's contribution, which is not small."""
    images, labels = private_set()
    releases = make_releases(images, labels)
    features = releases.feature_map
    settings = section(steps=1).training(11)
    trained, fresh = small_generator(), small_generator()
    fresh.load_state_dict(copy.deepcopy(trained.state_dict()))
    fresh.train()

    captured: dict[str, torch.Tensor] = {}

    def remember(step: int, loss: float) -> None:
        captured["grad"] = torch.cat([p.grad.flatten() for p in trained.parameters()]).double()

    train_moment_matching(trained, features, releases, settings, progress=False, after_step=remember)
    method_grad = captured["grad"]

    indices, noise = replayed_sample_and_noise(releases)
    exact = noiseless_means(releases, indices).float()
    noise_on_means = (noise / torch.tensor(releases.query.denominator, dtype=torch.float64)[:, None]).float()
    gen_labels, z = generator_inputs(settings)

    def means() -> torch.Tensor:
        return class_feature_means(features, fresh(z, gen_labels), gen_labels, CLASSES)[0]

    noiseless_grad = gradient(fresh, lambda: moment_matching_loss(features, fresh(z, gen_labels), gen_labels, exact))
    # d/dtheta ||m - (t0 + e)||^2 - d/dtheta ||m - t0||^2 = -2 d/dtheta sum_c e_c . m_c
    noise_grad = gradient(fresh, lambda: -2.0 * (means() * noise_on_means).sum())
    difference = method_grad - noiseless_grad
    assert noise_grad.norm() > 0.5 * noiseless_grad.norm(), "the test noise must matter at this sigma"
    assert difference.norm() > 0.5 * noiseless_grad.norm(), "the update equals the noiseless embedding's update"
    assert torch.allclose(difference, noise_grad, rtol=1e-3, atol=1e-4 * float(noise_grad.abs().max())), (
        "the update is not the noiseless update plus the noise's contribution"
    )
    return {"noise": float(noise_grad.norm()), "noiseless": float(noiseless_grad.norm())}


# ---------------------------------------------------------------------------------------------- mutant tests


def test_the_generator_update_is_the_noisy_releases_not_the_noiseless_embeddings():
    check_update_carries_the_noise()


def test_a_mutant_that_differentiates_the_noiseless_embedding_is_caught(monkeypatch):
    """DPImageBench's form: the noise is drawn (and 'released') but the generator is trained on the noiseless
    statistic, the noise entering only as a constant. The check above must fail on it."""
    real = family.release_subsampled_bounded_sum

    def noise_as_a_constant(select, num_records, dim, query, ledger, noise, *, registered=False):
        seen: list[torch.Tensor] = []

        def remember(indices):
            seen.append(indices)
            return select(indices)

        release = real(remember, num_records, dim, query, ledger, noise, registered=registered)
        sums, _ = class_sums(select(seen[0]), dim, query.num_classes, query.bound)
        means = sums / torch.tensor(query.denominator, dtype=torch.float64)[:, None]
        return BoundedSumRelease(release.sums, release.counts, means, release.noise_std)

    monkeypatch.setattr(family, "release_subsampled_bounded_sum", noise_as_a_constant)
    with pytest.raises(AssertionError, match="noiseless"):
        check_update_carries_the_noise()


def test_noise_scale_and_declared_denominator():
    """Noise std sigma x 1 on every class sum; the means divide by the public expected class size qN/K, not by
    the realised number of sampled records."""
    images, labels = private_set()
    releases = make_releases(images, labels, num_features=4000)
    release = releases.release()
    indices, noise = replayed_sample_and_noise(releases)
    exact, _ = class_sums(releases._select(indices), releases.feature_map.dim, CLASSES, 1.0)
    added = release.sums - exact
    assert torch.allclose(added, noise, atol=1e-9)
    assert float(added.std()) == pytest.approx(SIGMA * 1.0, rel=0.05)  # sensitivity 1: unit-norm features
    expected_class_size = 60 / N * N / CLASSES
    assert releases.query.denominator == (expected_class_size,) * CLASSES
    assert torch.allclose(release.means * expected_class_size, release.sums)
    realised = torch.bincount(labels[indices], minlength=CLASSES).double()
    assert not torch.allclose(realised, torch.full_like(realised, expected_class_size))  # a real difference


def test_noisy_counts_widen_the_sensitivity():
    images, labels = private_set()
    releases = make_releases(images, labels, num_features=4000, count_weight=0.5)
    assert releases.query.sensitivity == pytest.approx(math.sqrt(1 + 0.25))
    release = releases.release()
    indices, _ = replayed_sample_and_noise(releases)
    exact, _ = class_sums(releases._select(indices), releases.feature_map.dim, CLASSES, 1.0)
    assert float((release.sums - exact).std()) == pytest.approx(SIGMA * math.sqrt(1.25), rel=0.05)
    assert torch.allclose(release.means, release.sums / release.counts.clamp(min=1.0)[:, None])


def test_the_sample_is_poisson_and_every_release_is_one_ledger_step():
    images, labels = private_set()
    releases = make_releases(images, labels)
    sizes = []
    source = NoiseSource(seed=NOISE_SEED)
    for step in range(5):
        releases(step)
        sizes.append(len(poisson_sample(N, releases.query.sample_rate, source)))
        source.normal((CLASSES * releases.feature_map.dim,), std=1.0, dtype=torch.float64)
    assert len(set(sizes)) > 1, "fixed-size batches are not the Poisson sample the accountant assumes"
    (entry,) = releases.ledger.mechanisms()
    assert (entry.name, entry.kind, entry.sample_rate, entry.repeats) == (
        dp_kernel.MECHANISM,
        "subsampled_gaussian",
        60 / N,
        5,
    )
    assert entry.noise_multiplier == SIGMA


def test_the_running_mean_is_the_mean_of_the_releases():
    images, labels = private_set()
    releases = make_releases(images, labels, target="running_mean")
    seen = []
    for step in range(3):
        target = releases(step)
        seen.append(releases.last.means)
        assert torch.allclose(target, torch.stack(seen).mean(0))


def test_generator_labels_are_uniform_and_do_not_read_the_private_labels(monkeypatch):
    """Same public seeds, two private sets with very different label histograms: the generator sees the same
    balanced labels (DPImageBench feeds it the private batch's labels)."""
    images, labels = private_set()
    skewed = torch.zeros_like(labels)
    skewed[:10] = 1
    seen_runs = []
    for private_labels in (labels, skewed):
        releases = make_releases(images, private_labels)
        generator = small_generator()
        seen: list[torch.Tensor] = []
        forward = generator.forward
        monkeypatch.setattr(generator, "forward", lambda z, y: (seen.append(y.clone()), forward(z, y))[1])
        train_moment_matching(generator, releases.feature_map, releases, section().training(5), progress=False)
        seen_runs.append(seen)
    assert all(torch.equal(a, b) for a, b in zip(*seen_runs))
    for batch in seen_runs[0]:
        counts = torch.bincount(batch, minlength=CLASSES)
        assert int(counts.max() - counts.min()) <= 1


def test_the_plan_is_one_subsampled_gaussian_over_all_steps():
    from dpsynth.privacy.section import PrivacySection

    config = section(steps=400)
    privacy = PrivacySection(epsilon=2.0, delta=1e-5)

    class Config:  # the two sections plan() reads
        pass

    run = Config()
    run.section, run.privacy = config, privacy
    plan = dp_kernel.DPKernel().plan(run, 6000)
    (mechanism,) = plan.mechanisms
    assert (mechanism.name, mechanism.kind, mechanism.sample_rate, mechanism.repeats) == (
        dp_kernel.MECHANISM,
        "subsampled_gaussian",
        60 / 6000,
        400,
    )
    assert 2.0 - 0.01 <= plan.epsilon() <= 2.0
    with pytest.raises(Exception, match="batch_size"):
        dp_kernel.DPKernel().plan(run, 50)


def test_a_run_killed_with_releases_charged_past_its_checkpoint_resumes_on_the_plan(tmp_path, monkeypatch):
    """The ledger ahead of the checkpoint (killed after the ledger of release 10 was stored, before the step-10
    checkpoint): the resumed run keeps those releases spent, continues at release 10 from the step-5 generator,
    and ends with exactly the plan's T releases (not T + 5), as the skeleton's resume through RunContext.resume
    declares."""
    import json

    from dpsynth.api import Synthesizer
    from dpsynth.checkpoint import CheckpointManager
    from dpsynth.rundir import CHECKPOINTS_DIR, LEDGER_FILE, PRIVACY_FILE
    from dpsynth.testing import SHRINK

    run_dir, save = tmp_path / "run", CheckpointManager.save

    def persist_then_die(manager: Any, state: Any, phase: str = "main") -> None:
        if phase == family.TRAINING_PHASE and int(state["step"]) == 10:
            manager.store.persist()  # the ledger state first, as a save does; then the process dies
            raise KeyboardInterrupt
        save(manager, state, phase=phase)

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointManager, "save", persist_then_die)
        with pytest.raises(KeyboardInterrupt):
            Synthesizer.from_config("dp-kernel/smoke", SHRINK).fit(out=run_dir)
    stored = json.loads((run_dir / LEDGER_FILE).read_text())
    (entry,) = [m for m in stored["mechanisms"] if m["name"] == dp_kernel.MECHANISM]
    assert entry["steps"] == 10, entry
    assert CheckpointManager(run_dir / CHECKPOINTS_DIR).load(family.TRAINING_PHASE)["step"] == 5
    synth = Synthesizer.from_config("dp-kernel/smoke", SHRINK).fit(out=run_dir, resume=True)
    (spent,) = json.loads((run_dir / PRIVACY_FILE).read_text())["mechanisms"]
    assert spent == {**entry, "steps": 20}  # the plan's T releases, same sigma and q
    assert "stay spent" in (run_dir / "log.txt").read_text()
    assert synth.sample(5)[0].shape[0] == 5
