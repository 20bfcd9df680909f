"""GS-WGAN: the common method contract, and tests that fail if its mechanism is made unsound: the shards are
keyed by content, each critic depends on its own shard only (no stale warm-start index, no refresh leaking
into the kept critic), the block's rows are clipped to C and noised with sigma * 2 C sqrt(B), the step is
spent before the shard is drawn, and the plan is T shard-sampled steps (not B*T)."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dpsynth.config import find_config, load_config
from dpsynth.data.splits import content_keys, shard_assignment, shard_members
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.methods.families.gan import CriticBank
from dpsynth.methods.gs_wgan import GSWGAN, MECHANISM, GSWGANConfig, sanitised_query
from dpsynth.models.gan import GANSpec, critic_input_gradient, wgan_gp_critic_loss
from dpsynth.privacy import PrivacyLedger, ShardSampledGaussian
from dpsynth.privacy.rng import NoiseSource
from dpsynth.privacy.sanitised_block import SanitisedBlock, clip_rows, draw_shard, release_sanitised_block
from dpsynth.seeding import stream_generator
from dpsynth.testing import MethodContractTests

SMOKE = find_config("gs-wgan/smoke")


class TestGSWGANContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``gs-wgan/smoke`` preset."""

    method = "gs-wgan"


def _records(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, 6, 6, 1), dtype=np.uint8), rng.integers(0, 3, count)


# ------------------------------------------------------------------------------------------- shards
def test_shards_are_keyed_by_content_so_a_neighbour_moves_no_other_record():
    images, labels = _records(200)
    keys = content_keys(images, labels)
    shards = shard_assignment(keys, 7, seed=3)
    assert shards.min() >= 0 and shards.max() < 7 and len(set(shards.tolist())) == 7
    order = np.random.default_rng(1).permutation(200)
    assert np.array_equal(shard_assignment(keys[order], 7, seed=3), shards[order]), "order-free"
    extra_images, extra_labels = _records(1, seed=9)
    grown = shard_assignment(content_keys(np.concatenate([extra_images, images]), np.r_[extra_labels, labels]), 7, 3)
    assert np.array_equal(grown[1:], shards), "inserting a record at the front moves nobody"
    assert not np.array_equal(shard_assignment(keys, 7, seed=4), shards)


def test_add_remove_changes_one_shard_but_a_replacement_can_change_two():
    """Why privacy.json states add/remove only: removing a record changes one shard's contents, while
    replacing it by another record keys the newcomer afresh, and some replacement lands in another shard."""
    images, labels = _records(60)
    keys = content_keys(images, labels)
    shards = shard_assignment(keys, 5, seed=2)
    members = [set(keys[shards == k].tolist()) for k in range(5)]
    rest = shard_assignment(keys[1:], 5, seed=2)
    changed = [k for k in range(5) if set(keys[1:][rest == k].tolist()) != members[k]]
    assert changed == [shards[0]]
    newcomers = content_keys(*_records(40, seed=5))
    moved = shard_assignment(newcomers, 5, seed=2) != shards[0]
    assert moved.any(), "a replacement by a record keyed to another shard changes two shards"


def test_shard_members_depend_on_their_own_shard_only():
    images, labels = _records(120)
    keys = content_keys(images, labels)
    members = shard_members(keys, 5, seed=0)
    assert sorted(np.concatenate(members).tolist()) == list(range(120))
    order = np.random.default_rng(2).permutation(120)
    shuffled = shard_members(keys[order], 5, seed=0)
    for mine, theirs in zip(members, shuffled):
        assert keys[mine].tolist() == keys[order][theirs].tolist(), "same records, same order"


# ------------------------------------------------------------------------------------------- critics
class _Checkpoints:
    def __init__(self) -> None:
        self.states: dict[str, dict] = {}

    def save(self, state: dict, phase: str = "main") -> None:
        self.states[phase] = state

    def load(self, phase: str = "main") -> dict | None:
        return self.states.get(phase)


def _ctx() -> SimpleNamespace:
    return SimpleNamespace(
        seed=0,
        checkpoints=_Checkpoints(),
        rng=lambda stream, index=0: stream_generator(0, stream, index),
        log=lambda *args, **kwargs: None,
    )


def _tiny() -> tuple[GANSpec, GSWGANConfig]:
    spec = GANSpec(3, 1, 16, z_dim=4, generator_width=4, discriminator_width=4, discriminator_depth=1)
    section = GSWGANConfig(
        num_shards=4, batch_size=5, steps=3, pretrain_iters=2, critic_iters=1, refresh_iters=2, critic_batch_size=4
    )
    return spec, section


def _warm_bank(images: torch.Tensor, labels: torch.Tensor, keys: np.ndarray) -> tuple[CriticBank, list]:
    spec, section = _tiny()
    shards = shard_members(keys, section.num_shards, seed=0)
    bank = CriticBank(spec, section, "cpu", shards, name="gs-wgan")
    bank.warm_start(_ctx(), (images, labels))
    return bank, shards


def _dataset(count: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (count, 16, 16, 1), dtype=np.uint8)
    labels = rng.integers(0, 3, count)
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1
    return images, torch.from_numpy(labels).long(), content_keys(pixels, labels)


def test_each_critic_depends_on_its_own_shard_only():
    """Change one record: only its shard's critic may change (a stale warm-start index, as in DPImageBench,
    would copy one shard's critic into all of them and fail this)."""
    images, labels, keys = _dataset()
    bank, shards = _warm_bank(images, labels, keys)
    changed_images, changed_labels = images.clone(), labels.clone()
    changed_images[0] = -changed_images[0]
    changed_keys = keys.copy()
    changed_keys[0] = np.uint64(12345)  # the replaced record's content key
    other_bank, other_shards = _warm_bank(changed_images, changed_labels, changed_keys)
    touched = {int(k) for k, members in enumerate(shards) if 0 in members.tolist()}
    touched |= {int(k) for k, members in enumerate(other_shards) if 0 in members.tolist()}
    assert len(touched) <= 2
    same = [
        all(torch.equal(a, b) for a, b in zip(c1.state_dict().values(), c2.state_dict().values()))
        for c1, c2 in zip(bank.critics, other_bank.critics)
    ]
    for k, equal in enumerate(same):
        if k not in touched:
            assert equal, f"critic {k} changed although its shard did not"
    assert not all(same), "the changed record's critic did change"
    # and critics of different shards differ (each is its own shard's, not a copy of one)
    assert not torch.equal(bank.critics[0].body[0].weight, bank.critics[1].body[0].weight)


def test_refresh_of_the_drawn_critic_is_discarded():
    images, labels, keys = _dataset()
    bank, shards = _warm_bank(images, labels, keys)
    spec, _ = _tiny()
    torch.manual_seed(0)
    generator = spec.build()[0]
    before_weights = {k: v.clone() for k, v in bank.critics[1].state_dict().items()}
    before_moments = [
        {name: value.clone() if torch.is_tensor(value) else value for name, value in per_param.items()}
        for per_param in bank.optimizers[1].state_dict()["state"].values()
    ]
    refreshed = bank.refreshed(1, (images, labels), generator, stream_generator(0, "sampling", 7))
    assert refreshed is not bank.critics[1]
    assert not torch.equal(refreshed.body[0].weight, bank.critics[1].body[0].weight)
    for name, value in bank.critics[1].state_dict().items():
        assert torch.equal(value, before_weights[name])
    after = list(bank.optimizers[1].state_dict()["state"].values())
    for old, new in zip(before_moments, after):
        for name, value in old.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(new[name])), "kept Adam moments unchanged"


@pytest.mark.parametrize("architecture", ["projection", "label-channels"])
def test_input_gradient_rows_are_independent(architecture):
    spec, _ = _tiny()
    torch.manual_seed(0)
    critic = dataclasses.replace(spec, architecture=architecture).build_discriminator()
    fakes, labels = torch.randn(6, 1, 16, 16), torch.randint(0, 3, (6,))
    grads = critic_input_gradient(critic, fakes, labels)
    moved = fakes.clone()
    moved[0] += 1.0
    again = critic_input_gradient(critic, moved, labels)
    assert torch.allclose(grads[1:], again[1:]) and not torch.allclose(grads[0], again[0])
    loss = wgan_gp_critic_loss(critic, fakes, moved, labels, torch.rand(6))  # the penalty differentiates twice
    assert all(g is not None for g in torch.autograd.grad(loss, list(critic.parameters())))


def test_the_section_picks_the_architecture():
    spec = GSWGAN.spec_for(GSWGANConfig(architecture="label-channels"), (1, 28, 28), 10)
    assert spec.architecture == "label-channels" and GSWGAN.spec_for(GSWGANConfig(), (1, 28, 28), 10).architecture == (
        "projection"
    )


# ------------------------------------------------------------------------------------------- sanitiser
def test_rows_are_clipped_to_c_and_non_finite_rows_are_zero():
    block = torch.randn(6, 3, 4) * 10
    block[2] = float("nan")
    block[3] = block[3] * 1e-4
    clipped = clip_rows(block, 0.5)
    norms = clipped.flatten(1).norm(dim=1)
    assert torch.all(norms <= 0.5 + 1e-6) and norms[2] == 0
    assert torch.allclose(clipped[3], block[3]), "a row inside the ball is kept"


def test_noise_std_is_sigma_times_the_block_diameter():
    """Every one of the B rows may change (the drawn critic changes arbitrarily), each by up to 2C: the
    noise is sigma * 2 C sqrt(B) per coordinate. C, C sqrt(B) or 2C (a per-row or one-sided sensitivity) fail."""
    query = SanitisedBlock("gs", rows=16, clip_norm=0.5, noise_multiplier=1.5, num_shards=10)
    assert query.sensitivity == pytest.approx(2 * 0.5 * math.sqrt(16))
    assert query.noise_std == pytest.approx(1.5 * 2 * 0.5 * 4)
    ledger = PrivacyLedger(1e4, 1e-5, accountant="rdp")
    ledger.register(query.mechanism(0))
    noise = NoiseSource(seed=0)
    released = release_sanitised_block(query, lambda k: torch.zeros(16, 500), ledger, noise)
    assert released.std().item() == pytest.approx(query.noise_std, rel=0.03)
    assert ledger.mechanisms()[0].steps == 1


def test_the_step_is_spent_before_the_shard_is_read_and_rows_are_checked():
    query = SanitisedBlock("gs", rows=4, clip_norm=1.0, noise_multiplier=1.0, num_shards=3)
    ledger = PrivacyLedger(1e4, 1e-5, accountant="rdp")
    ledger.register(query.mechanism(0))

    def read(k: int) -> torch.Tensor:
        assert ledger.mechanisms()[0].steps == 1, "spent before anything is read"
        return torch.zeros(3, 2)

    with pytest.raises(PrivacyError, match="4 were declared"):
        release_sanitised_block(query, read, ledger, NoiseSource(seed=0))
    spent_out = PrivacyLedger(0.5, 1e-5, accountant="rdp")
    spent_out.register(ShardSampledGaussian("gs", 0.01, 3))
    with pytest.raises(PrivacyError):
        release_sanitised_block(
            SanitisedBlock("gs", 4, 1.0, 0.01, 3), lambda k: pytest.fail("read past the budget"), spent_out, noise=None
        )


def test_shard_draws_are_uniform_and_come_from_the_noise_source():
    noise = NoiseSource(seed=5)
    counts = np.bincount([draw_shard(noise, 4) for _ in range(4000)], minlength=4)
    assert counts.min() > 850 and counts.max() < 1150
    assert [draw_shard(NoiseSource(seed=1), 1000) for _ in range(3)] != [
        draw_shard(NoiseSource(seed=2), 1000) for _ in range(3)
    ]


# ------------------------------------------------------------------------------------------- plan
def _plan(overrides=()):
    from dpsynth.methods import get_method

    config = load_config(SMOKE, list(overrides))
    return get_method("gs-wgan")().plan(config, 300)


def test_plan_is_t_shard_sampled_steps_with_the_calibrated_sigma():
    plan = _plan(["gs-wgan.steps=9", "gs-wgan.num_shards=12", "gs-wgan.batch_size=16"])
    [step] = plan.mechanisms
    assert step == ShardSampledGaussian(MECHANISM, step.noise_multiplier, 12, 9), "T steps, not B*T"
    assert step.sample_rate == pytest.approx(1 / 12) and plan.calibrated == (MECHANISM,)
    assert 9.99 - 0.01 <= plan.epsilon() <= 10.0
    query = sanitised_query(load_config(SMOKE, ["gs-wgan.batch_size=16"]).section, step.noise_multiplier)
    assert query.noise_std == pytest.approx(step.noise_multiplier * 2 * 1.0 * 4)
    fixed = _plan(["gs-wgan.noise_multiplier=3.0"])
    assert fixed.mechanisms[0].noise_multiplier == 3.0 and fixed.calibrated == ()
    with pytest.raises(PrivacyError):
        _plan(["gs-wgan.noise_multiplier=0.05"])


def test_prv_accountant_is_refused_at_load():
    with pytest.raises(ConfigError, match="privacy.accountant"):
        load_config(SMOKE, ["privacy.accountant=prv"])


def test_a_finished_run_keeps_no_critic_and_resumes_without_retraining(tmp_path):
    from dpsynth.api import Synthesizer
    from dpsynth.testing import SHRINK

    run = tmp_path / "run"
    Synthesizer.from_config(SMOKE, SHRINK).fit(out=run)
    critics = torch.load(run / "checkpoints" / "gs-wgan-critics.pt", weights_only=False)
    loop = torch.load(run / "checkpoints" / f"{MECHANISM}.pt", weights_only=False)
    assert "critics" not in critics and "bank" not in loop and loop["step"] == 4
    resumed = Synthesizer.from_config(SMOKE, SHRINK).fit(out=run, resume=True)
    assert resumed.privacy["mechanisms"][0]["steps"] == 4
    # privacy.json names add/remove only: the record-level relation, and the shard statement never speaks of
    # replacing a record (a replaced record can move to another shard, so only add/remove changes one shard).
    record = json.loads((run / "privacy.json").read_text())
    neighbouring = record["neighbouring"]
    assert neighbouring["relation"] == "add/remove one record" and record["adjacency"] == "add/remove one example"
    assert "replac" not in neighbouring["shard_sampling"].lower()
    assert not any("replace-one" in note.lower() for note in record.get("notes", []))
    images, _ = resumed.sample(3)
    assert images.shape[0] == 3


class _Killed(BaseException):
    """A kill of the process (not an error the run could handle)."""


def test_a_run_killed_after_a_charged_step_resumes_and_ends_on_the_plan(tmp_path, monkeypatch):
    """Killed after step 3 was charged (and the ledger persisted) but before its checkpoint (step 2): the
    resumed run keeps step 3 spent, continues at step 3 from the step-2 state, and spends 4 steps in all."""
    import dpsynth.methods.gs_wgan as gs_wgan
    from dpsynth.api import Synthesizer
    from dpsynth.testing import SHRINK

    run, calls, contexts = tmp_path / "run", [], []
    real_step, real_train = gs_wgan.sanitised_generator_step, gs_wgan.train_generator

    def capture_context(ctx, *args, **kwargs):
        contexts.append(ctx)
        return real_train(ctx, *args, **kwargs)

    def killed_after_third(*args, **kwargs):
        real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            contexts[0].checkpoints.store.persist()  # the ledger reached disk, the loop's checkpoint did not
            raise _Killed

    monkeypatch.setattr(gs_wgan, "train_generator", capture_context)
    monkeypatch.setattr(gs_wgan, "sanitised_generator_step", killed_after_third)
    with pytest.raises(_Killed):
        Synthesizer.from_config(SMOKE, SHRINK).fit(out=run)
    assert json.loads((run / "ledger.json").read_text())["mechanisms"][0]["steps"] == 3
    assert torch.load(run / "checkpoints" / f"{MECHANISM}.pt", weights_only=False)["step"] == 2
    calls.clear()
    monkeypatch.setattr(gs_wgan, "sanitised_generator_step", lambda *a, **k: (calls.append(1), real_step(*a, **k)))
    resumed = Synthesizer.from_config(SMOKE, SHRINK).fit(out=run, resume=True)
    assert len(calls) == 1, "only step 4 runs again: step 3 stays spent and is not repeated"
    assert resumed.privacy["mechanisms"][0]["steps"] == 4
    assert torch.load(run / "checkpoints" / f"{MECHANISM}.pt", weights_only=False)["step"] == 4


def test_critics_start_from_the_public_gan_when_it_is_given():
    """``start_from``: every critic begins as the public pre-trained critic (a copy: the public network changing
    later moves none of them); without it, from the public random initialisation."""
    images, labels, keys = _dataset()
    spec, section = _tiny()
    section = section.model_copy(update={"pretrain_iters": 0})
    shards = shard_members(keys, section.num_shards, seed=0)
    public_generator, public_critic = spec.build()
    bank = CriticBank(spec, section, "cpu", shards, name="gs-wgan")
    bank.start_from(public_generator, public_critic)
    want = {name: value.clone() for name, value in public_critic.state_dict().items()}
    with torch.no_grad():
        next(public_critic.parameters()).add_(1.0)
    bank.warm_start(_ctx(), (images, labels))
    for critic in bank.critics:
        assert all(torch.equal(critic.state_dict()[name], value) for name, value in want.items())
    plain = CriticBank(spec, section, "cpu", shards, name="gs-wgan")
    plain.warm_start(_ctx(), (images, labels))
    assert not torch.equal(plain.critics[0].body[0].weight, want["body.0.weight"])


def test_public_pre_training_is_a_public_phase_that_needs_public_data():
    from dpsynth.methods import get_method

    with pytest.raises(ConfigError, match="needs public data but data.public is null"):
        load_config(SMOKE, ["gs-wgan.pretrain_steps=3"])
    config = load_config(SMOKE, ["gs-wgan.pretrain_steps=3", "data.public=glyphs-digits"])
    first = get_method("gs-wgan").phases(config)[0]
    assert (first.name, first.private, first.public) == ("pretrain", False, "required")
