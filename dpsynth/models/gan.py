"""A conditional DCGAN for PrivImage+G (Li et al., arXiv:2311.12850, §4.4 and §5), and its public pre-training.

* :class:`ConditionalGenerator`: DCGAN-style (Radford et al., arXiv:1511.06434): ``[z, embed(y)]`` ->
  linear -> ``s x s`` feature map -> transposed convolutions doubling the side -> tanh. At 32x32
  with the default widths it has about 1.8M parameters (the light model size the paper argues for).
* :class:`ConditionalDiscriminator`: strided convolutions with **GroupNorm** (BatchNorm mixes
  examples, so per-example gradients and DP-SGD are undefined with it), global sum pooling and a
  projection head ``w·h + embed(y)·h`` (Miyato & Koyama, arXiv:1802.05637) for the label.
* :class:`LabelChannelGenerator` / :class:`LabelChannelDiscriminator` (``architecture: label-channels``): a
  DCGAN pair in the style of the MNIST networks of Bie, Kamath & Zhang, "Private GANs, Revisited"
  (arXiv:2302.02936), which follow GS-WGAN's (Chen et al., arXiv:2006.08265): the generator sends z and the
  one-hot label each through its own transposed convolution, concatenates them and upsamples with LeakyReLU
  and no normalisation; the discriminator reads the one-hot label as extra input channels and is convolved
  down to 1x1. Our default pair collapses to one image per class even without privacy; this one kept its
  latents' diversity on public digits (docs/methods/dp-gan.md, "Why the generator collapses").
* Losses: the non-saturating GAN loss (softplus form of the DCGAN binary cross-entropy), the hinge loss
  (Lim & Ye, arXiv:1705.02894; DPImageBench's DP-GAN) and the WGAN-GP critic loss (Gulrajani et al.,
  arXiv:1704.00028, with the drift term of Karras et al., arXiv:1710.10196; GS-WGAN's critics), the critic
  updates that use it (:func:`wgan_gp_updates`) and the per-row input gradient GS-WGAN sanitises
  (:func:`critic_input_gradient`).
* :func:`pretrain_gan`: non-private alternating Adam on *public* data (the selected subset),
  cached on disk like the diffusion pre-training.

The generator never reads private data: in DP fine-tuning only the discriminator is trained on
private data (with DP-SGD); the generator's updates read only the released discriminator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dpsynth.checkpoint import atomic_write, cache_dir
from dpsynth.errors import ConfigError, DataError

CACHE_FORMAT_VERSION = 1


def _upsamplings(image_size: int) -> tuple[int, int]:
    """(start side, number of x2 upsamplings): 32 -> (4, 3), 28 -> (7, 2), 64 -> (4, 4)."""
    for count in (4, 3, 2):
        start = image_size // 2**count
        if image_size % 2**count == 0 and start >= 4:
            return start, count
    raise ConfigError(
        f"the GAN generator starts at a side of at least 4 and doubles it, so it needs a side of 16 or more "
        f"divisible by 4, got {image_size}: set data.image_size to {max(16, -(-image_size // 4) * 4)}"
    )


def _groups(channels: int) -> int:
    return next(g for g in (32, 16, 8, 4, 2, 1) if channels % g == 0)


class ConditionalGenerator(nn.Module):
    #: per-class parameters and the axis that indexes the class (for :func:`transfer_gan`)
    LABEL_AXES = {"embedding.weight": 0}

    def __init__(
        self,
        num_classes: int,
        channels: int,
        image_size: int,
        z_dim: int = 100,
        width: int = 80,
        embedding_dim: int = 64,
    ) -> None:
        super().__init__()
        self.num_classes, self.channels, self.image_size, self.z_dim = num_classes, channels, image_size, z_dim
        self.start, count = _upsamplings(image_size)
        top = width * 2 ** (count - 1)
        self.embedding = nn.Embedding(num_classes, embedding_dim)
        self.project = nn.Linear(z_dim + embedding_dim, top * self.start * self.start)
        self.top = top
        layers: list[nn.Module] = [nn.GroupNorm(_groups(top), top), nn.ReLU()]
        width_in = top
        for _ in range(count - 1):
            layers += [
                nn.ConvTranspose2d(width_in, width_in // 2, 4, 2, 1),
                nn.GroupNorm(_groups(width_in // 2), width_in // 2),
                nn.ReLU(),
            ]
            width_in //= 2
        layers += [nn.ConvTranspose2d(width_in, channels, 4, 2, 1), nn.Tanh()]
        self.body = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.project(torch.cat([z, self.embedding(labels)], dim=1))
        return self.body(h.view(-1, self.top, self.start, self.start))


class ConditionalDiscriminator(nn.Module):
    LABEL_AXES = {"embedding.weight": 0}

    def __init__(self, num_classes: int, channels: int, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(channels, width, 4, 2, 1), nn.LeakyReLU(0.2)]
        width_in = width
        for _ in range(depth - 1):
            layers += [
                nn.Conv2d(width_in, width_in * 2, 4, 2, 1),
                nn.GroupNorm(_groups(width_in * 2), width_in * 2),
                nn.LeakyReLU(0.2),
            ]
            width_in *= 2
        self.body = nn.Sequential(*layers)
        self.linear = nn.Linear(width_in, 1)
        self.embedding = nn.Embedding(num_classes, width_in)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.body(images).sum(dim=(2, 3))
        return self.linear(h).squeeze(1) + (self.embedding(labels) * h).sum(1)


def _one_hot(labels: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, K] one-hot rows, written as a comparison so that it also runs under ``torch.func.vmap`` (the DP-SGD
    engine's per-example forward), where ``F.one_hot`` has no batching rule."""
    return (labels.unsqueeze(-1) == torch.arange(num_classes, device=labels.device)).to(dtype)


class LabelChannelGenerator(nn.Module):
    """z and the one-hot label each through their own transposed convolution from 1x1 to the start side,
    concatenated (half the top width each), then transposed convolutions doubling the side, LeakyReLU, tanh.

    No normalisation: with GroupNorm (ours) or without it, the projection generator collapsed to one image
    per class against either discriminator; only this pair kept the latents apart (docs/methods/dp-gan.md).
    """

    LABEL_AXES = {"label_in.weight": 0}

    def __init__(self, num_classes: int, channels: int, image_size: int, z_dim: int = 100, width: int = 80) -> None:
        super().__init__()
        self.num_classes, self.channels, self.image_size, self.z_dim = num_classes, channels, image_size, z_dim
        start, count = _upsamplings(image_size)
        top = width * 2 ** (count - 1)
        half = max(1, top // 2)
        self.latent_in = nn.ConvTranspose2d(z_dim, half, start, 1, 0)
        # On a 1x1 one-hot input this is a learnt start x start map per class (the weight's rows are the classes).
        self.label_in = nn.ConvTranspose2d(num_classes, half, start, 1, 0)
        layers: list[nn.Module] = [nn.LeakyReLU(0.2)]
        width_in = 2 * half
        for _ in range(count - 1):
            layers += [nn.ConvTranspose2d(width_in, max(1, width_in // 2), 4, 2, 1), nn.LeakyReLU(0.2)]
            width_in = max(1, width_in // 2)
        layers += [nn.ConvTranspose2d(width_in, channels, 4, 2, 1), nn.Tanh()]
        self.body = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        one_hot = _one_hot(labels, self.num_classes, z.dtype)
        h = torch.cat([self.latent_in(z[:, :, None, None]), self.label_in(one_hot[:, :, None, None])], 1)
        return self.body(h)


class LabelChannelDiscriminator(nn.Module):
    """The image and its one-hot label broadcast to image size as extra input channels; ``depth`` strided
    convolutions (LeakyReLU, no normalisation), then one convolution over the whole remaining map to a 1x1 logit.

    The first convolution is split into an image part and a label part, summed: the same function as one
    convolution of the concatenated channels, but the class-indexed weights are a tensor of their own, so that
    :func:`transfer_gan` can map them to another label space. Every layer is a Conv2d and nothing couples the
    examples of a batch, so the DP-SGD engine's per-example gradients apply.
    """

    LABEL_AXES = {"label_in.weight": 1}

    def __init__(self, num_classes: int, channels: int, image_size: int, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.image_in = nn.Conv2d(channels, width, 4, 2, 1)
        self.label_in = nn.Conv2d(num_classes, width, 4, 2, 1, bias=False)
        side, width_in = image_size // 2, width
        layers: list[nn.Module] = [nn.LeakyReLU(0.2)]
        for _ in range(depth - 1):
            layers += [nn.Conv2d(width_in, width_in * 2, 4, 2, 1), nn.LeakyReLU(0.2)]
            side, width_in = side // 2, width_in * 2
        if side < 1:
            raise ConfigError(f"a depth-{depth} discriminator halves a side of {image_size} below 1")
        layers.append(nn.Conv2d(width_in, 1, side, 1, 0))
        self.body = nn.Sequential(*layers)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        one_hot = _one_hot(labels, self.num_classes, images.dtype)
        label_maps = one_hot[:, :, None, None].expand(-1, -1, *images.shape[2:])
        return self.body(self.image_in(images) + self.label_in(label_maps)).flatten(1).squeeze(1)


#: how the label enters the networks (``GANSpec.architecture``): ``projection`` (ConditionalGenerator /
#: ConditionalDiscriminator) or ``label-channels`` (LabelChannelGenerator / LabelChannelDiscriminator)
GANArchitecture = Literal["projection", "label-channels"]
GAN_ARCHITECTURES: tuple[str, ...] = get_args(GANArchitecture)

#: discriminator losses: ``bce`` (non-saturating, DCGAN) and ``hinge`` (DPImageBench's DP-GAN)
GAN_LOSSES = ("bce", "hinge")


def discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor, loss: str = "bce") -> torch.Tensor:
    """``bce``: -log D(x) - log(1 - D(G(z))), averaged (softplus form);
    ``hinge``: relu(1 - D(x)) + relu(1 + D(G(z))), averaged."""
    if loss == "hinge":
        return F.relu(1 - real_logits).mean() + F.relu(1 + fake_logits).mean()
    if loss != "bce":
        raise ConfigError(f"unknown GAN loss {loss!r}; choose one of {', '.join(GAN_LOSSES)}")
    return F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()


def generator_loss(fake_logits: torch.Tensor, loss: str = "bce") -> torch.Tensor:
    """``bce``: non-saturating -log D(G(z)); ``hinge`` (and WGAN): -D(G(z)), averaged."""
    if loss in ("hinge", "wgan"):
        return -fake_logits.mean()
    return F.softplus(-fake_logits).mean()


def wgan_gp_critic_loss(
    critic: nn.Module,
    real: torch.Tensor,
    fake: torch.Tensor,
    labels: torch.Tensor,
    mix: torch.Tensor,
    *,
    gp_weight: float = 10.0,
    drift: float = 1e-3,
) -> torch.Tensor:
    """WGAN-GP critic loss of a conditional critic on real and fake images sharing ``labels``:
    ``D(fake) - D(real) + gp_weight (||grad D(x~)|| - 1)^2 + drift D(real)^2``, averaged, where
    ``x~ = mix x + (1 - mix) fake`` with ``mix`` [B] in [0, 1] (drawn by the caller)."""
    real_out, fake_out = critic(real, labels), critic(fake, labels)
    weights = mix.view(-1, *([1] * (real.dim() - 1)))
    between = (weights * real + (1 - weights) * fake).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(between, labels).sum(), between, create_graph=True)
    penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
    return fake_out.mean() - real_out.mean() + gp_weight * penalty + drift * (real_out**2).mean()


def critic_input_gradient(critic: nn.Module, fakes: torch.Tensor, fake_labels: torch.Tensor) -> torch.Tensor:
    """Per row b, the gradient of the generator loss ``-D(x_b, c_b)`` with respect to the generated image x_b:
    the block GS-WGAN sanitises (Chen et al., arXiv:2006.08265, Algorithm 1: what flows from the critic into G).

    The critics treat rows independently (GroupNorm or no normalisation, no batch statistics), so row b
    depends on x_b only.
    """
    fakes = fakes.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(-critic(fakes, fake_labels).sum(), fakes)
    return grad


def wgan_gp_updates(
    critic: nn.Module,
    optimizer: torch.optim.Optimizer,
    members: torch.Tensor,
    images: torch.Tensor,
    labels: torch.Tensor,
    generator: nn.Module,
    iters: int,
    rng: torch.Generator,
    *,
    batch_size: int,
    gp_weight: float = 10.0,
    drift: float = 1e-3,
) -> None:
    """``iters`` WGAN-GP updates (:func:`wgan_gp_critic_loss`) of ``critic`` on the records ``members`` of
    ``images`` / ``labels`` against ``generator``'s fakes, which share the real batch's labels.

    Batches of ``batch_size`` are drawn with replacement from ``members``; all randomness (picks, latents,
    interpolation weights) comes from ``rng``. No members or no iterations leave the critic as it is.
    """
    if len(members) == 0 or iters == 0:
        return
    device = next(critic.parameters()).device
    for _ in range(iters):
        pick = members[torch.randint(0, len(members), (batch_size,), generator=rng)]
        real, real_labels = images[pick].to(device), labels[pick].to(device)
        z = torch.randn(len(pick), generator.z_dim, generator=rng).to(device)
        mix = torch.rand(len(pick), generator=rng).to(device)
        with torch.no_grad():
            fake = generator(z, real_labels)
        loss = wgan_gp_critic_loss(critic, real, fake, real_labels, mix, gp_weight=gp_weight, drift=drift)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclasses.dataclass(frozen=True)
class GANSpec:
    num_classes: int
    channels: int
    image_size: int
    z_dim: int = 100
    generator_width: int = 80
    discriminator_width: int = 64
    embedding_dim: int = 64
    discriminator_depth: int = 3
    architecture: GANArchitecture = "projection"

    def __post_init__(self) -> None:
        if self.architecture not in GAN_ARCHITECTURES:
            raise ConfigError(
                f"unknown GAN architecture {self.architecture!r}; choose one of {', '.join(GAN_ARCHITECTURES)}"
            )

    def build(self) -> tuple[nn.Module, nn.Module]:
        return self.build_generator(), self.build_discriminator()

    def build_generator(self) -> nn.Module:
        if self.architecture == "label-channels":
            return LabelChannelGenerator(
                self.num_classes, self.channels, self.image_size, self.z_dim, self.generator_width
            )
        return ConditionalGenerator(
            self.num_classes, self.channels, self.image_size, self.z_dim, self.generator_width, self.embedding_dim
        )

    def build_discriminator(self) -> nn.Module:
        if self.architecture == "label-channels":
            return LabelChannelDiscriminator(
                self.num_classes, self.channels, self.image_size, self.discriminator_width, self.discriminator_depth
            )
        return ConditionalDiscriminator(
            self.num_classes, self.channels, self.discriminator_width, self.discriminator_depth
        )


@dataclasses.dataclass(frozen=True)
class GANPretrainSettings:
    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-4
    betas: tuple[float, float] = (0.5, 0.999)  # DCGAN


def sample_latents(
    count: int, z_dim: int, num_classes: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(count, z_dim, generator=generator), torch.randint(0, num_classes, (count,), generator=generator)


@torch.no_grad()
def sample_conditional(
    generator: nn.Module,
    labels: torch.Tensor,
    *,
    seed: int,
    batch_size: int = 1000,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Images ``G(z, labels)`` in [-1, 1] on the CPU, the one conditional sampler of dpsynth's generators.

    Eval mode; a fresh ``z ~ N(0, I)`` per sample (not one per class or batch) from a generator seeded with
    the public ``seed``, in label order, so the draws do not depend on ``batch_size``'s split of later
    batches. Post-processing of a released generator: it reads no private data and costs no privacy.
    """
    generator.eval()
    rng = torch.Generator().manual_seed(int(seed))
    parts = []
    for start in range(0, len(labels), batch_size):
        part = labels[start : start + batch_size]
        z = torch.randn(len(part), generator.z_dim, generator=rng)
        parts.append(generator(z.to(device), part.to(device)).cpu())
    return torch.cat(parts) if parts else torch.zeros(0, generator.channels, generator.image_size, generator.image_size)


def generator_step(
    generator_net: nn.Module,
    discriminator: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: int,
    rng: torch.Generator,
    loss_name: str = "bce",
) -> float:
    """One generator update through ``discriminator`` (its parameters get no gradient written)."""
    device = next(generator_net.parameters()).device
    z, labels = sample_latents(batch, generator_net.z_dim, generator_net.num_classes, rng)
    logits = discriminator(generator_net(z.to(device), labels.to(device)), labels.to(device))
    loss = generator_loss(logits, loss_name)
    params = [p for p in generator_net.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _spec_key(spec: GANSpec) -> dict[str, Any]:
    """The spec in the pre-training cache key; the default depth and architecture are left out, so keys made
    before ``discriminator_depth`` or ``architecture`` existed still hit."""
    key = dataclasses.asdict(spec)
    if key["discriminator_depth"] == 3:
        del key["discriminator_depth"]
    if key["architecture"] == "projection":
        del key["architecture"]
    return key


def gan_cache_path(public: Any, spec: GANSpec, settings: GANPretrainSettings, *, seed: int, public_spec: str) -> Path:
    """Where :func:`pretrain_gan` caches the GAN of ``spec`` pre-trained on ``public`` (keyed on the images and
    labels, the spec, the settings and the seed)."""
    digest = hashlib.sha256(np.ascontiguousarray(public.images).tobytes())
    digest.update(np.ascontiguousarray(public.labels, dtype=np.int64).tobytes())
    key = hashlib.sha256(
        json.dumps(
            {
                "v": CACHE_FORMAT_VERSION,
                "spec": _spec_key(spec),
                "data": digest.hexdigest(),
                "public_spec": public_spec,
                "settings": dataclasses.asdict(settings),
                "seed": seed,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:32]
    return cache_dir() / "pretrain-gan" / f"{key}.pt"


def pretrain_gan(
    public: Any,
    spec: GANSpec,
    settings: GANPretrainSettings,
    *,
    seed: int,
    public_spec: str,
    device: torch.device | str = "cpu",
    use_cache: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[nn.Module, nn.Module]:
    """Non-private alternating GAN training on the public ``ImageDataset`` (cached)."""
    if public is None or len(public) == 0:
        raise DataError("GAN pre-training needs a non-empty public dataset")
    if public.num_classes != spec.num_classes or tuple(public.image_shape) != (
        spec.channels,
        spec.image_size,
        spec.image_size,
    ):
        raise DataError(f"public data {public.image_shape} / {public.num_classes} classes do not match the GAN spec")
    path = gan_cache_path(public, spec, settings, seed=seed, public_spec=public_spec)
    torch.manual_seed(seed)
    generator_net, discriminator = spec.build()
    if use_cache and path.exists():
        state = torch.load(path, map_location="cpu", weights_only=True)
        generator_net.load_state_dict(state["generator"])
        discriminator.load_state_dict(state["discriminator"])
        log(f"GAN pre-training: cache hit {path}")
        return generator_net.to(device), discriminator.to(device)
    generator_net, discriminator = generator_net.to(device), discriminator.to(device)
    g_opt = torch.optim.Adam(generator_net.parameters(), lr=settings.lr, betas=settings.betas)
    d_opt = torch.optim.Adam(discriminator.parameters(), lr=settings.lr, betas=settings.betas)
    images, labels = public.to_tensors()
    rng = torch.Generator().manual_seed(seed + 1)
    for _ in tqdm(range(settings.steps), desc="GAN pre-training", unit="step", leave=False):
        index = torch.randint(0, len(images), (settings.batch_size,), generator=rng)
        real, real_labels = images[index].to(device), labels[index].to(device)
        z, fake_labels = sample_latents(settings.batch_size, spec.z_dim, spec.num_classes, rng)
        with torch.no_grad():
            fake = generator_net(z.to(device), fake_labels.to(device))
        d_loss = discriminator_loss(discriminator(real, real_labels), discriminator(fake, fake_labels.to(device)))
        d_opt.zero_grad(set_to_none=True)
        d_loss.backward()
        d_opt.step()
        generator_step(generator_net, discriminator, g_opt, settings.batch_size, rng)
    if use_cache:
        state = {"generator": generator_net.state_dict(), "discriminator": discriminator.state_dict()}
        atomic_write(path, lambda f: torch.save(state, f))
    log(
        f"GAN pre-training: {settings.steps} steps on {len(public)} public images"
        f"{', cached at ' + str(path) if use_cache else ''}"
    )
    return generator_net, discriminator


def warm_start_gan(
    nets: tuple[nn.Module, nn.Module], public: Any, spec: GANSpec, settings: GANPretrainSettings, **options: Any
) -> None:
    """Start ``nets`` (generator, discriminator of ``spec``) from :func:`pretrain_gan` on the public ``ImageDataset``
    in its own label space (``options``: :func:`pretrain_gan`'s keywords), the classes mapped by
    :func:`transfer_gan`."""
    pretrained = pretrain_gan(public, dataclasses.replace(spec, num_classes=public.num_classes), settings, **options)
    for source, target in zip(pretrained, nets):
        transfer_gan(source.cpu(), target)


def transfer_gan(pretrained: nn.Module, target: nn.Module) -> None:
    """Copy matching tensors; per-class weights of another label space (label embeddings, the label channels of
    ``label-channels``) start from the mean of the pre-trained classes."""
    source, state = pretrained.state_dict(), target.state_dict()
    label_axes = getattr(target, "LABEL_AXES", {})
    for name, value in state.items():
        axis = label_axes.get(name)
        if name in source and source[name].shape == value.shape:
            state[name] = source[name].clone()
        elif axis is not None and name in source and _same_but(source[name].shape, value.shape, axis):
            state[name] = source[name].mean(axis, keepdim=True).expand_as(value).clone()
        else:
            raise ConfigError(f"pre-trained GAN does not fit the target at {name!r}")
    target.load_state_dict(state)


def _same_but(a: torch.Size, b: torch.Size, axis: int) -> bool:
    return len(a) == len(b) and all(x == y for i, (x, y) in enumerate(zip(a, b)) if i != axis)
