"""A small KL-regularised convolutional autoencoder: the public latent backbone's image codec.

Rombach et al., *High-Resolution Image Synthesis with Latent Diffusion Models* (CVPR 2022, arXiv:2112.10752),
§3.1 and appendix G: an encoder maps an image to the mean and log-variance of a diagonal Gaussian over a
spatial latent ``f`` times smaller per side; a decoder maps a latent back to pixels; a small KL term towards
N(0, I) keeps the latent space well scaled, so a diffusion model can be trained in it. DP-LDM (Liu et al.,
TMLR 2024, arXiv:2305.15759, §3) pre-trains such an autoencoder on public data and keeps it frozen.

Sizes: ``channel_mult`` has one entry per resolution level and every level after the first halves the
side, so ``[1, 2, 4]`` gives f = 4: 28×28×1 → 7×7×4 and 32×32×3 → 8×8×4. The LDM papers add LPIPS and a
patch discriminator to the reconstruction loss; at CPU scale the loss is the pixel MSE alone
(:mod:`dpsynth.models.backbone`). GroupNorm only and no attention: the encoder may later run inside
per-example code, and attention at 7×7 buys little for glyph-sized images.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn

from dpsynth.errors import ConfigError
from dpsynth.schema import Section

__all__ = ["AutoencoderConfig", "KLAutoencoder", "kl_divergence"]


class AutoencoderConfig(Section):
    """The autoencoder's architecture (the ``backbone.autoencoder`` keys)."""

    latent_channels: int = Field(4, ge=1, description="channels of the latent (LDM's embed_dim)")
    base_channels: int = Field(16, ge=4, description="channels of the first level")
    channel_mult: list[int] = Field(
        [1, 2, 4],
        min_length=1,
        description="channel multiplier per level; each level after the first halves the side (f = 2^(levels-1))",
    )
    num_res_blocks: int = Field(1, ge=1, description="residual blocks per level")

    @field_validator("channel_mult")
    @classmethod
    def _positive(cls, mult: list[int]) -> list[int]:
        if any(m < 1 for m in mult):
            raise ValueError(f"every multiplier must be at least 1, got {mult}")
        return mult

    @property
    def downsampling(self) -> int:
        """f: how many times smaller the latent's side is than the image's."""
        return 2 ** (len(self.channel_mult) - 1)

    def latent_shape(
        self, image_shape: Sequence[int], key: str = "backbone.autoencoder.channel_mult"
    ) -> tuple[int, int, int]:
        """``(latent_channels, H/f, W/f)`` for images of ``(C, H, W)``; ConfigError naming ``key`` when the side
        is not a multiple of f (the decoder could not give the image size back)."""
        _, height, width = image_shape
        f = self.downsampling
        if height % f or width % f:
            raise ConfigError(
                f"{key}: {len(self.channel_mult)} levels shrink the side {f}x, which does not divide "
                f"{height}x{width} images; use fewer levels (e.g. [1, 2] for f = 2) or set data.image_size to a "
                f"multiple of {f}"
            )
        return (self.latent_channels, height // f, width // f)


def _groups(channels: int) -> int:
    return math.gcd(channels, 8)


class ResBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(_groups(in_channels), in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(_groups(out_channels), out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.skip = nn.Identity() if in_channels == out_channels else nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class Encoder(nn.Module):
    """Image ``[B, C, H, W]`` in [-1, 1] → ``[B, 2 * latent_channels, H/f, W/f]`` (mean, log-variance)."""

    def __init__(self, image_channels: int, config: AutoencoderConfig) -> None:
        super().__init__()
        widths = [config.base_channels * m for m in config.channel_mult]
        layers: list[nn.Module] = [nn.Conv2d(image_channels, widths[0], 3, padding=1)]
        current = widths[0]
        for level, width in enumerate(widths):
            for _ in range(config.num_res_blocks):
                layers.append(ResBlock(current, width))
                current = width
            if level < len(widths) - 1:
                layers.append(nn.Conv2d(current, current, 3, stride=2, padding=1))
        layers += [
            ResBlock(current, current),
            nn.GroupNorm(_groups(current), current),
            nn.SiLU(),
            nn.Conv2d(current, 2 * config.latent_channels, 3, padding=1),
        ]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Decoder(nn.Module):
    """Latent ``[B, latent_channels, h, w]`` → image ``[B, C, h·f, w·f]`` (unbounded; clamp to [-1, 1] for pixels)."""

    def __init__(self, image_channels: int, config: AutoencoderConfig) -> None:
        super().__init__()
        widths = [config.base_channels * m for m in config.channel_mult]
        current = widths[-1]
        layers: list[nn.Module] = [nn.Conv2d(config.latent_channels, current, 3, padding=1), ResBlock(current, current)]
        for level in reversed(range(len(widths))):
            for _ in range(config.num_res_blocks):
                layers.append(ResBlock(current, widths[level]))
                current = widths[level]
            if level > 0:
                # Nearest upsampling then a convolution (no checkerboard artefacts of transposed convolutions)
                # that already narrows to the next level's width: the costliest convolution of the decoder is
                # the one at full resolution, so it runs at the narrow width.
                narrower = widths[level - 1]
                layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(current, narrower, 3, padding=1)]
                current = narrower
        layers += [nn.GroupNorm(_groups(current), current), nn.SiLU(), nn.Conv2d(current, image_channels, 3, padding=1)]
        self.layers = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.layers(z)


class KLAutoencoder(nn.Module):
    """Encoder + decoder with a diagonal-Gaussian latent (LDM §3.1, "KL-reg.")."""

    def __init__(self, image_channels: int, config: AutoencoderConfig) -> None:
        super().__init__()
        self.config = config
        self.image_channels = image_channels
        self.encoder = Encoder(image_channels, config)
        self.decoder = Decoder(image_channels, config)

    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, logvar)``, each ``[B, latent_channels, H/f, W/f]``; logvar clamped as in LDM's posterior."""
        mean, logvar = self.encoder(images).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(latents)

    def forward(
        self, images: torch.Tensor, noise: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(reconstruction, mean, logvar)``; with ``noise`` (standard normal, the latent's shape) the decoder
        sees the sample ``mean + exp(logvar / 2) · noise`` (training), otherwise the mean."""
        mean, logvar = self.encode(images)
        latent = mean if noise is None else mean + torch.exp(0.5 * logvar) * noise
        return self.decode(latent), mean, logvar


def kl_divergence(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, exp(logvar)) ‖ N(0, I)) per latent element, averaged over everything."""
    return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
