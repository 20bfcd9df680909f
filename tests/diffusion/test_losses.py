"""Diffusion losses (L_simple, hybrid) and the K-copy example builder, under per-example torch.func."""

import math

import pytest
import torch
from conftest import TINY_UNET as TINY
from conftest import randomize
from torch.func import functional_call, grad, vmap

from dpsynth.diffusion.losses import (
    diffusion_loss,
    discretized_gaussian_log_likelihood,
    make_loss_fn,
    make_multiplicity_batch,
    make_multiplicity_example,
    vlb_terms,
)
from dpsynth.diffusion.schedules import MixtureOfUniformTimesteps, UniformTimesteps, build_schedule
from dpsynth.errors import ConfigError
from dpsynth.models.unet import build_unet


def constant_model(eps: torch.Tensor, v: torch.Tensor | None = None):
    """A model whose output is a given tensor (so gradients w.r.t. ε̂ and v can be read directly)."""

    def call(x_t, t, y):
        out = eps if v is None else torch.cat([eps, v], dim=-3)
        return out.expand(x_t.shape[0], *out.shape[-3:])

    return call


def test_simple_loss_is_the_mean_squared_noise_error():
    schedule = build_schedule("linear")
    x0, noise = torch.rand(3, 1, 4, 4) * 2 - 1, torch.randn(3, 1, 4, 4)
    t = torch.tensor([0, 10, 999])
    eps_hat = torch.randn(3, 1, 4, 4)
    loss = diffusion_loss(lambda x, tt, y: eps_hat, x0, None, t, noise, schedule, kind="simple")
    assert loss.item() == pytest.approx(((noise - eps_hat) ** 2).mean().item(), rel=1e-6)
    perfect = diffusion_loss(lambda x, tt, y: noise, x0, None, t, noise, schedule)
    assert perfect.item() == 0.0


def test_simple_loss_uses_only_eps_channels_of_a_learned_sigma_model():
    schedule = build_schedule("linear")
    x0, noise, t = torch.zeros(2, 1, 2, 2), torch.randn(2, 1, 2, 2), torch.tensor([5, 6])
    loss = diffusion_loss(
        lambda x, tt, y: torch.cat([noise, 100 * torch.ones_like(noise)], 1),
        x0,
        None,
        t,
        noise,
        schedule,
        kind="simple",
    )
    assert loss.item() == 0.0


def test_hybrid_loss_is_finite_at_every_kind_of_timestep():
    schedule = build_schedule("cosine")
    model = randomize(build_unet(TINY, 8, 1, 3, learn_sigma=True))
    x0 = torch.randint(0, 256, (4, 1, 8, 8)) / 127.5 - 1.0  # 8-bit data, including the edge bins
    t, noise = torch.tensor([0, 1, 500, 999]), torch.randn(4, 1, 8, 8)
    loss = diffusion_loss(model, x0, torch.tensor([0, 1, 2, 3]), t, noise, schedule, kind="hybrid")
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_hybrid_needs_learned_variance_and_unknown_kind_rejected():
    schedule = build_schedule("linear")
    x0, t = torch.zeros(1, 1, 2, 2), torch.tensor([3])
    with pytest.raises(ConfigError):
        diffusion_loss(lambda x, tt, y: x, x0, None, t, x0, schedule, kind="hybrid")
    with pytest.raises(ConfigError):
        make_loss_fn(schedule, kind="l1")


def test_vlb_term_has_the_mean_detached():
    """∂L_hybrid/∂ε̂ equals ∂L_simple/∂ε̂ (the mean gets no L_vlb gradient), while v gets one."""
    schedule = build_schedule("cosine")
    generator = torch.Generator().manual_seed(0)
    x0, noise = torch.rand(3, 1, 4, 4, generator=generator) * 2 - 1, torch.randn(3, 1, 4, 4, generator=generator)
    t = torch.tensor([0, 20, 700])
    eps = torch.randn(3, 1, 4, 4, generator=generator).requires_grad_()
    v = (torch.rand(3, 1, 4, 4, generator=generator) * 2 - 1).requires_grad_()

    def model_call(x_t, tt, y):
        return torch.cat([eps, v], dim=1)

    hybrid_eps, hybrid_v = torch.autograd.grad(
        diffusion_loss(model_call, x0, None, t, noise, schedule, "hybrid"), [eps, v]
    )
    simple_eps = torch.autograd.grad(diffusion_loss(model_call, x0, None, t, noise, schedule, "simple"), eps)[0]
    assert torch.allclose(hybrid_eps, simple_eps, atol=1e-7)
    assert hybrid_v.abs().sum() > 0
    # Without the stop-gradient the L_vlb term would move the mean: the check above can fail.
    x_t = schedule.q_sample(x0, t, noise)
    undetached = torch.autograd.grad(vlb_terms(schedule, eps, v, x0, x_t, t).sum(), eps)[0]
    assert undetached.abs().sum() > 0


def test_vlb_is_zero_for_the_true_posterior():
    """With ε̂ = ε and v = -1 (Σ = β̃_t) the model equals q(x_{t-1}|x_t,x_0): KL = 0 for t > 0."""
    schedule = build_schedule("linear")
    x0, noise = torch.rand(3, 1, 4, 4) * 2 - 1, torch.randn(3, 1, 4, 4)
    t = torch.tensor([1, 300, 999])
    x_t = schedule.q_sample(x0, t, noise)
    terms = vlb_terms(schedule, noise, -torch.ones_like(noise), x0, x_t, t)
    assert torch.allclose(terms, torch.zeros(3), atol=1e-4)


def test_decoder_nll_at_t0_is_the_discretised_gaussian():
    schedule = build_schedule("linear")
    x0 = torch.tensor([-1.0, 0.0, 1.0]).reshape(3, 1, 1, 1)
    noise = torch.zeros_like(x0)
    t = torch.zeros(3, dtype=torch.long)
    x_t = schedule.q_sample(x0, t, noise)
    terms = vlb_terms(schedule, noise, torch.zeros_like(x0), x0, x_t, t)
    model = schedule.p_mean_log_variance(torch.cat([noise, torch.zeros_like(x0)], 1), x_t, t, "learned", True)
    std = math.exp(0.5 * model["log_variance"][1].item())
    normal = torch.distributions.Normal(model["mean"][1].item(), std)
    middle_bin = (normal.cdf(torch.tensor(1 / 255)) - normal.cdf(torch.tensor(-1 / 255))).item()
    assert terms[1].item() == pytest.approx(-math.log(middle_bin) / math.log(2), rel=1e-4)
    # The edge bins extend to infinity, so their likelihood is at least that of an inner bin.
    assert terms[0] <= terms[1] + 1e-6 and terms[2] <= terms[1] + 1e-6


def test_discretized_likelihood_sums_to_one_over_all_bins():
    values = torch.arange(256, dtype=torch.float64) / 127.5 - 1.0
    log_p = discretized_gaussian_log_likelihood(
        values, torch.tensor(0.1, dtype=torch.float64), torch.tensor(math.log(0.3), dtype=torch.float64)
    )
    assert log_p.exp().sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("kind", ["simple", "hybrid"])
def test_per_example_vmap_grad_of_loss_matches_a_loop(kind):
    schedule = build_schedule("cosine")
    model = randomize(build_unet(TINY, 8, 1, 3, learn_sigma=(kind == "hybrid")))
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss_fn = make_loss_fn(schedule, kind)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.rand(3, 1, 8, 8, generator=generator) * 2 - 1, torch.tensor([0, 1, 2])
    batch = make_multiplicity_batch(images, labels, 2, UniformTimesteps(1000), generator)
    batch["t"][0, 0] = 0  # exercise the decoder branch under vmap too

    def per_example(p, example):
        return loss_fn(lambda *args: functional_call(model, p, args), example)

    grads = vmap(grad(per_example), in_dims=(None, 0))(params, batch)
    for i in range(3):
        model.zero_grad()
        loss_fn(model, {key: value[i] for key, value in batch.items()}).backward()
        for name, parameter in model.named_parameters():
            assert torch.allclose(grads[name][i], parameter.grad, atol=1e-6, rtol=1e-4), name


def test_multiplicity_example_shapes_and_determinism():
    x0 = torch.rand(1, 6, 6) * 2 - 1
    sampler = MixtureOfUniformTimesteps()
    first = make_multiplicity_example(x0, 4, 8, sampler, torch.Generator().manual_seed(3), flip=True, crop_padding=2)
    again = make_multiplicity_example(x0, 4, 8, sampler, torch.Generator().manual_seed(3), flip=True, crop_padding=2)
    assert first["x0"].shape == (8, 1, 6, 6) and first["noise"].shape == (8, 1, 6, 6)
    assert first["t"].shape == (8,) and first["t"].dtype == torch.long
    assert first["label"].tolist() == [4] * 8
    for key in first:
        assert torch.equal(first[key], again[key])
    other = make_multiplicity_example(x0, 4, 8, sampler, torch.Generator().manual_seed(4))
    assert not torch.equal(first["noise"], other["noise"])


def test_flips_and_crops_are_label_preserving_views_of_the_image():
    x0 = torch.arange(25, dtype=torch.float32).reshape(1, 5, 5)
    flipped = make_multiplicity_example(x0, 0, 64, UniformTimesteps(), torch.Generator().manual_seed(0), flip=True)
    is_original = (flipped["x0"] == x0).flatten(1).all(1)
    is_mirror = (flipped["x0"] == x0.flip(-1)).flatten(1).all(1)
    assert (is_original | is_mirror).all() and is_original.any() and is_mirror.any()

    cropped = make_multiplicity_example(
        x0, 0, 64, UniformTimesteps(), torch.Generator().manual_seed(1), crop_padding=1, crop_mode="constant"
    )
    padded = torch.nn.functional.pad(x0, (1, 1, 1, 1))
    windows = {tuple(padded[:, r : r + 5, c : c + 5].flatten().tolist()) for r in range(3) for c in range(3)}
    seen = {tuple(copy.flatten().tolist()) for copy in cropped["x0"]}
    assert seen <= windows and len(seen) > 3


def test_label_dropout_uses_the_null_class():
    batch = make_multiplicity_batch(
        torch.zeros(50, 1, 2, 2),
        torch.full((50,), 2),
        20,
        UniformTimesteps(),
        torch.Generator().manual_seed(0),
        label_dropout=0.25,
        null_label=10,
    )
    labels = batch["label"]
    assert set(labels.unique().tolist()) == {2, 10}
    assert (labels == 10).float().mean().item() == pytest.approx(0.25, abs=0.05)
    with pytest.raises(ConfigError):
        make_multiplicity_batch(torch.zeros(1, 1, 2, 2), torch.zeros(1), 2, UniformTimesteps(), label_dropout=0.1)


def test_unconditional_example_has_no_label_and_loss_accepts_it():
    schedule = build_schedule("linear")
    example = make_multiplicity_example(torch.zeros(1, 4, 4), None, 3, UniformTimesteps(), torch.Generator())
    assert "label" not in example
    loss = make_loss_fn(schedule)(lambda x, t, y: torch.zeros_like(x), example)
    assert loss.item() == pytest.approx((example["noise"] ** 2).mean().item())


def test_empty_poisson_batch_gives_empty_k_copy_inputs_and_a_noise_only_engine_step():
    """An empty Poisson batch (no indices) must build shaped empty inputs the DP engine accepts."""
    from dpsynth.dpsgd import DPSGDEngine
    from dpsynth.privacy import PrivacyLedger
    from dpsynth.privacy.rng import NoiseSource

    images, labels = torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)
    batch = make_multiplicity_batch(
        images,
        labels,
        3,
        MixtureOfUniformTimesteps(),
        torch.Generator().manual_seed(0),
        flip=True,
        crop_padding=1,
        label_dropout=0.1,
        null_label=2,
    )
    assert batch["x0"].shape == (0, 3, 1, 8, 8) and batch["noise"].shape == (0, 3, 1, 8, 8)
    assert batch["t"].shape == (0, 3) and batch["label"].shape == (0, 3)
    torch.manual_seed(0)
    model = randomize(build_unet(TINY, 8, 1, 2))
    before = [p.detach().clone() for p in model.parameters()]
    ledger = PrivacyLedger(target_epsilon=10.0, delta=1e-5, accountant="rdp")
    engine = DPSGDEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        make_loss_fn(build_schedule("linear", 1000)),
        ledger,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        sample_rate=0.1,
        expected_batch_size=4,
        max_physical_batch_size=4,
        noise=NoiseSource(seed=0),
    )
    engine.step(batch)
    assert engine.steps == 1
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the noise moved the weights
