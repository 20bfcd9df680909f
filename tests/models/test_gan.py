"""The shared GAN pieces GS-WGAN's critics are built from: WGAN-GP updates that read only the records they are
given and draw only from the generator handed to them, and the critic's per-row input gradient."""

from __future__ import annotations

import torch

from dpsynth.models.gan import GANSpec, critic_input_gradient, wgan_gp_updates


def _nets() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    generator, critic = GANSpec(3, 1, 16, z_dim=4, generator_width=4, discriminator_width=4).build()
    return generator, critic, torch.optim.Adam(critic.parameters(), lr=1e-3)


def _data(count: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    rng = torch.Generator().manual_seed(1)
    return torch.rand(count, 1, 16, 16, generator=rng) * 2 - 1, torch.randint(0, 3, (count,), generator=rng)


def _updated(images: torch.Tensor, labels: torch.Tensor, members: torch.Tensor, iters: int = 2) -> dict:
    generator, critic, optimizer = _nets()
    rng = torch.Generator().manual_seed(5)
    wgan_gp_updates(critic, optimizer, members, images, labels, generator, iters, rng, batch_size=4)
    return critic.state_dict()


def test_updates_read_only_the_given_members():
    """Changing a record outside ``members`` leaves the critic exactly as it was; changing a member moves it."""
    images, labels = _data()
    members = torch.tensor([0, 2, 5, 7])
    base = _updated(images, labels, members)
    outside, inside = images.clone(), images.clone()
    outside[1], inside[5] = -outside[1], -inside[5]
    assert all(torch.equal(base[k], v) for k, v in _updated(outside, labels, members).items())
    assert not all(torch.equal(base[k], v) for k, v in _updated(inside, labels, members).items())


def test_no_members_or_no_iterations_leave_the_critic_and_the_stream_untouched():
    images, labels = _data()
    _, critic, _ = _nets()
    initial = {k: v.clone() for k, v in critic.state_dict().items()}
    for members, iters in ((torch.tensor([], dtype=torch.long), 3), (torch.tensor([0, 1]), 0)):
        state = _updated(images, labels, members, iters)
        assert all(torch.equal(initial[k], v) for k, v in state.items())
    rng = torch.Generator().manual_seed(5)
    generator, critic, optimizer = _nets()
    wgan_gp_updates(
        critic, optimizer, torch.tensor([], dtype=torch.long), images, labels, generator, 3, rng, batch_size=4
    )
    assert torch.equal(rng.get_state(), torch.Generator().manual_seed(5).get_state())


def test_input_gradient_is_the_gradient_of_minus_d_per_row():
    _, critic, _ = _nets()
    fakes, labels = torch.randn(3, 1, 16, 16), torch.tensor([0, 1, 2])
    grads = critic_input_gradient(critic, fakes, labels)
    for b in range(3):
        row = fakes[b : b + 1].clone().requires_grad_(True)
        (want,) = torch.autograd.grad(-critic(row, labels[b : b + 1]).sum(), row)
        assert torch.allclose(grads[b : b + 1], want, atol=1e-6)
