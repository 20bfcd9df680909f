"""Class-conditional UNet for diffusion models (Dhariwal & Nichol 2021 "ADM" layout).

The layout follows the architecture both diffusion papers build on: Ghalebikesabi et al. (arXiv:2302.13861)
§5 / Table 3 (residual blocks per level, channel multipliers, attention at the 16x16 level, head
channels, adaptive group normalisation injecting the timestep and class embeddings) and the
improved DDPM of Chu et al. (IEEE Access 2023) §III-A (optional learned variance: the output has
``2 * channels`` channels, ε then the variance interpolation value ``v``).

Every part is written so that the DP-SGD engine can take per-example gradients with
``torch.func.functional_call`` + ``vmap`` + ``grad``:

* GroupNorm only (BatchNorm mixes examples and has running buffers);
* no in-place ops on activations, no ``.item()``, no Python branches on tensor values;
* attention with plain ``matmul``/``softmax``: ``F.scaled_dot_product_attention`` works under
  ``vmap`` but falls back to a slow per-example loop on CPU (it has no batching rule there);
* upsampling takes the skip connection's (static) spatial size, so odd sizes like 28 → 14 → 7 → 4
  work without data-dependent control flow.

Dropout is stochastic: under ``vmap`` it needs ``randomness="different"``; the presets use 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpsynth.errors import ConfigError

__all__ = [
    "UNetConfig",
    "UNet",
    "UNET_PRESETS",
    "PRESET_NOMINAL_PARAMETERS",
    "build_unet",
    "config_to_dict",
    "count_parameters",
    "timestep_embedding",
]


@dataclass(frozen=True)
class UNetConfig:
    """Architecture hyper-parameters of :class:`UNet`.

    ``attention_levels`` are indices into ``channel_mult`` (level 0 has the input resolution,
    level i is downsampled ``i`` times), so a preset has the same parameter count at every
    image size. ``attention_resolutions`` (feature-map side lengths, as in the papers' "attention
    at 16x16") is an alternative resolved against the image size by :func:`build_unet`.
    """

    base_channels: int = 64
    channel_mult: tuple[int, ...] = (1, 2, 2)
    num_res_blocks: int = 2
    attention_levels: tuple[int, ...] = (1,)
    num_head_channels: int = 64
    dropout: float = 0.0
    max_groups: int = 32


# Nominal sizes; tests/models/test_unet.py checks the counts at 32x32x3, 10 classes, within ±20%
# (measured: 0.84M, 1.75M, 4.75M, 6.49M, 15.6M, 86.1M; ldm-0.8m 0.77M, ldm-4m 4.39M).
# "1.8m" is the size of Dockhorn et al.'s small DPDM model; "4m" is the MNIST model of
# Ghalebikesabi et al. (arXiv:2302.13861) Table 3 (64 channels, mult 1,2,2, depth 1, attention at 16x16; the
# paper reports 4.2M); "80m" is its ImageNet32 / CIFAR-10 model (192 channels, mult 1,2,2,2,
# depth 2, 80.4M in the paper).
UNET_PRESETS: dict[str, UNetConfig] = {
    # CPU preset (mnist10k configs, experiments/diffusion_sanity.py): levels 28/14/7, attention at 7x7 only.
    "0.3m": UNetConfig(
        base_channels=16, channel_mult=(1, 2, 2), num_res_blocks=1, attention_levels=(2,), num_head_channels=32
    ),
    "0.8m": UNetConfig(
        base_channels=32, channel_mult=(1, 1, 2), num_res_blocks=1, attention_levels=(1,), num_head_channels=32
    ),
    "1.8m": UNetConfig(
        base_channels=32, channel_mult=(1, 2, 2), num_res_blocks=2, attention_levels=(1,), num_head_channels=32
    ),
    "4m": UNetConfig(
        base_channels=64, channel_mult=(1, 2, 2), num_res_blocks=1, attention_levels=(1,), num_head_channels=64
    ),
    "6m": UNetConfig(
        base_channels=64, channel_mult=(1, 2, 2, 2), num_res_blocks=1, attention_levels=(1,), num_head_channels=64
    ),
    "16m": UNetConfig(
        base_channels=96, channel_mult=(1, 2, 2), num_res_blocks=2, attention_levels=(1,), num_head_channels=64
    ),
    "80m": UNetConfig(
        base_channels=192, channel_mult=(1, 2, 2, 2), num_res_blocks=2, attention_levels=(1,), num_head_channels=64
    ),
    # Latent UNets (the public backbone's 7x7x4 / 8x8x4 latents; docs/backbone.md): two levels with attention at
    # both, as the LDM UNets of DP-LDM (arXiv:2305.15759, §4: a transformer block at every level), whose
    # fine-tuning trains exactly those blocks. "ldm-0.8m" is the CPU model; "ldm-4m" follows DPImageBench's MNIST
    # LDM (64 channels, mult 1,2, two residual blocks per level).
    "ldm-0.8m": UNetConfig(
        base_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_levels=(0, 1), num_head_channels=32
    ),
    "ldm-4m": UNetConfig(
        base_channels=64, channel_mult=(1, 2), num_res_blocks=2, attention_levels=(0, 1), num_head_channels=32
    ),
}

PRESET_NOMINAL_PARAMETERS: dict[str, float] = {
    "0.3m": 0.3e6,
    "0.8m": 0.8e6,
    "1.8m": 1.8e6,
    "4m": 4.2e6,
    "6m": 6e6,
    "16m": 16e6,
    "80m": 80.4e6,
    "ldm-0.8m": 0.77e6,
    "ldm-4m": 4.4e6,
}


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (possibly fractional) timesteps ``t [N] -> [N, dim]`` (Vaswani et al.)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.to(torch.float32).unsqueeze(-1) * freqs
    embedding = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        embedding = F.pad(embedding, (0, 1))
    return embedding


def _group_norm(channels: int, max_groups: int) -> nn.GroupNorm:
    # The largest group count <= max_groups that divides the width, so narrow presets still normalise.
    groups = max(g for g in range(1, min(max_groups, channels) + 1) if channels % g == 0)
    return nn.GroupNorm(groups, channels)


def _zero_init(module: nn.Module) -> nn.Module:
    # Residual branches start as the identity (ADM / improved DDPM initialisation).
    for parameter in module.parameters():
        nn.init.zeros_(parameter)
    return module


class ResBlock(nn.Module):
    """Residual block with adaptive group norm: ``GN(h) * (1 + scale) + shift`` from the embedding."""

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int, dropout: float, max_groups: int) -> None:
        super().__init__()
        self.in_norm = _group_norm(in_channels, max_groups)
        self.in_conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.emb_proj = nn.Linear(emb_channels, 2 * out_channels)
        self.out_norm = _group_norm(out_channels, max_groups)
        self.dropout = nn.Dropout(dropout)
        self.out_conv = _zero_init(nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip = nn.Identity() if in_channels == out_channels else nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_conv(F.silu(self.in_norm(x)))
        scale, shift = self.emb_proj(F.silu(emb)).unsqueeze(-1).unsqueeze(-1).chunk(2, dim=1)
        h = self.out_norm(h) * (1 + scale) + shift
        h = self.out_conv(self.dropout(F.silu(h)))
        return self.skip(x) + h


class AttentionBlock(nn.Module):
    """Multi-head self-attention over spatial positions, written with matmul/softmax for vmap."""

    def __init__(self, channels: int, num_head_channels: int, max_groups: int) -> None:
        super().__init__()
        self.num_heads = max(1, channels // num_head_channels)
        self.norm = _group_norm(channels, max_groups)
        self.qkv = nn.Conv1d(channels, 3 * channels, 1)
        self.proj = _zero_init(nn.Conv1d(channels, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        qkv = self.qkv(self.norm(x).reshape(batch, channels, height * width))
        q, k, v = qkv.reshape(batch * self.num_heads, 3 * channels // self.num_heads, height * width).chunk(3, dim=1)
        # The scale on q and the values multiplied from the right: no pass over the [HW, HW] weights and
        # no transposed copy of them (20 % faster forward and backward at 14x14, 64 channels, batch 64).
        q = q * (1.0 / math.sqrt(q.shape[1]))
        weights = torch.softmax(torch.matmul(q.transpose(1, 2), k), dim=-1)  # [B*h, HW, HW]
        out = torch.matmul(weights, v.transpose(1, 2)).transpose(1, 2).reshape(batch, channels, height * width)
        return x + self.proj(out).reshape(batch, channels, height, width)


class Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest upsampling to the skip connection's size (handles odd sizes such as 7 → 4 → 7)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
        return self.conv(F.interpolate(x, size=tuple(size), mode="nearest"))


class _Level(nn.Module):
    """The residual blocks (and attention blocks) of one resolution level."""

    def __init__(self, blocks: list[ResBlock], attentions: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.attentions = nn.ModuleList(attentions)


class UNet(nn.Module):
    """Class-conditional ADM-style UNet predicting ε (and optionally the variance value ``v``).

    ``forward(x [N,C,H,W], t [N], y [N] | None) -> [N, C or 2C, H, W]``. Class index
    ``num_classes`` is the "null" label used for classifier-free guidance and label dropout;
    ``y=None`` means the null label. ``num_classes=0`` builds an unconditional model.
    """

    def __init__(self, config: UNetConfig, in_channels: int, num_classes: int, learn_sigma: bool = False) -> None:
        super().__init__()
        self.config = config
        self.in_channels = in_channels
        self.out_channels = in_channels * (2 if learn_sigma else 1)
        self.learn_sigma = learn_sigma
        self.num_classes = num_classes
        self.null_class = num_classes
        base, groups = config.base_channels, config.max_groups
        emb_channels = 4 * base

        self.time_mlp = nn.Sequential(nn.Linear(base, emb_channels), nn.SiLU(), nn.Linear(emb_channels, emb_channels))
        self.class_embedding = nn.Embedding(num_classes + 1, emb_channels) if num_classes > 0 else None
        self.in_conv = nn.Conv2d(in_channels, base, 3, padding=1)

        widths = [base * m for m in config.channel_mult]
        skip_widths = [base]
        self.down_levels = nn.ModuleList()
        self.downsamples = nn.ModuleList()
        channels = base
        for level, width in enumerate(widths):
            blocks, attentions = [], []
            for _ in range(config.num_res_blocks):
                blocks.append(ResBlock(channels, width, emb_channels, config.dropout, groups))
                attentions.append(self._attention_or_identity(level, width))
                channels = width
                skip_widths.append(channels)
            self.down_levels.append(_Level(blocks, attentions))
            if level < len(widths) - 1:
                self.downsamples.append(Downsample(channels))
                skip_widths.append(channels)

        self.mid_block1 = ResBlock(channels, channels, emb_channels, config.dropout, groups)
        self.mid_attention = AttentionBlock(channels, config.num_head_channels, groups)
        self.mid_block2 = ResBlock(channels, channels, emb_channels, config.dropout, groups)

        self.up_levels = nn.ModuleList()
        self.upsamples = nn.ModuleList()
        for level in reversed(range(len(widths))):
            blocks, attentions = [], []
            for _ in range(config.num_res_blocks + 1):
                blocks.append(
                    ResBlock(channels + skip_widths.pop(), widths[level], emb_channels, config.dropout, groups)
                )
                attentions.append(self._attention_or_identity(level, widths[level]))
                channels = widths[level]
            self.up_levels.append(_Level(blocks, attentions))
            if level > 0:
                self.upsamples.append(Upsample(channels))

        self.out_norm = _group_norm(channels, groups)
        self.out_conv = _zero_init(nn.Conv2d(channels, self.out_channels, 3, padding=1))

    def _attention_or_identity(self, level: int, width: int) -> nn.Module:
        if level in self.config.attention_levels:
            return AttentionBlock(width, self.config.num_head_channels, self.config.max_groups)
        return nn.Identity()

    def embed(self, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """Time embedding (sinusoid → MLP) plus the class embedding; ``y=None`` uses the null class."""
        emb = self.time_mlp(timestep_embedding(t, self.config.base_channels))
        if self.class_embedding is not None:
            if y is None:
                y = torch.full(t.shape, self.null_class, dtype=torch.long, device=t.device)
            emb = emb + self.class_embedding(y)
        return emb

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.embed(t, y)
        h = self.in_conv(x)
        skips = [h]
        for level, down in enumerate(self.down_levels):
            for block, attention in zip(down.blocks, down.attentions):
                h = attention(block(h, emb))
                skips.append(h)
            if level < len(self.downsamples):
                h = self.downsamples[level](h)
                skips.append(h)

        h = self.mid_block2(self.mid_attention(self.mid_block1(h, emb)), emb)

        for index, up in enumerate(self.up_levels):
            for block, attention in zip(up.blocks, up.attentions):
                h = attention(block(torch.cat([h, skips.pop()], dim=1), emb))
            if index < len(self.upsamples):
                h = self.upsamples[index](h, skips[-1].shape[-2:])

        return self.out_conv(F.silu(self.out_norm(h)))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _resolve_config(preset_or_dict: str | Mapping[str, Any] | UNetConfig, image_size: int) -> UNetConfig:
    if isinstance(preset_or_dict, UNetConfig):
        return preset_or_dict
    if isinstance(preset_or_dict, str):
        return _preset(preset_or_dict)
    if not isinstance(preset_or_dict, Mapping):
        raise ConfigError(f"model must be a preset name or a mapping, got {type(preset_or_dict).__name__}")
    options = dict(preset_or_dict)
    config = _preset(options.pop("preset")) if "preset" in options else UNetConfig()
    known = {f.name for f in fields(UNetConfig)} | {"attention_resolutions"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown UNet option(s) {unknown}; known: {sorted(known)}")
    if "attention_resolutions" in options:
        options["attention_levels"] = _levels_for_resolutions(
            options.pop("attention_resolutions"), image_size, len(options.get("channel_mult", config.channel_mult))
        )
    for key in ("channel_mult", "attention_levels"):
        if key in options:
            options[key] = tuple(int(v) for v in options[key])
    config = replace(config, **options)
    _validate(config)
    return config


def _preset(name: str) -> UNetConfig:
    key = str(name).lower().removeprefix("unet-").removeprefix("unet_")
    if key not in UNET_PRESETS:
        raise ConfigError(f"unknown UNet preset {name!r}; choose one of {sorted(UNET_PRESETS)}")
    return UNET_PRESETS[key]


def _levels_for_resolutions(resolutions: Sequence[int], image_size: int, num_levels: int) -> tuple[int, ...]:
    # Level i has side ceil(image_size / 2**i) (stride-2 convs with padding 1).
    sides = [image_size]
    for _ in range(num_levels - 1):
        sides.append((sides[-1] + 1) // 2)
    wanted = {int(r) for r in resolutions}
    return tuple(level for level, side in enumerate(sides) if side in wanted)


def _validate(config: UNetConfig) -> None:
    if config.base_channels < 1 or not config.channel_mult or min(config.channel_mult) < 1:
        raise ConfigError("UNet base_channels and channel_mult must be positive")
    if config.num_res_blocks < 1:
        raise ConfigError("UNet num_res_blocks must be at least 1")
    if not 0.0 <= config.dropout < 1.0:
        raise ConfigError(f"UNet dropout must be in [0, 1), got {config.dropout}")
    if config.num_head_channels < 1:
        raise ConfigError("UNet num_head_channels must be positive")


def build_unet(
    preset_or_dict: str | Mapping[str, Any] | UNetConfig,
    image_size: int,
    channels: int,
    num_classes: int,
    learn_sigma: bool = False,
) -> UNet:
    """Build a UNet from a preset name (``"0.3m"``, ``"0.8m"``, ``"1.8m"``, ``"4m"``, ``"6m"``, ``"16m"``, ``"80m"``)
    or a mapping of :class:`UNetConfig` fields (optionally with ``preset`` as the base and
    ``attention_resolutions`` as feature-map sides). Bad options raise :class:`ConfigError`."""
    if image_size < 1 or channels < 1 or num_classes < 0:
        raise ConfigError(f"bad UNet geometry: image_size={image_size}, channels={channels}, num_classes={num_classes}")
    config = _resolve_config(preset_or_dict, image_size)
    _check_smallest_map(config, image_size)
    return UNet(config, channels, num_classes, learn_sigma)


def _check_smallest_map(config: UNetConfig, side: int) -> None:
    """Each level after the first halves the map (a stride-2 convolution, rounding up). On a 1x1 map a GroupNorm
    whose groups hold one channel has one value to normalise, which torch refuses mid-run (and a 1x1 map carries
    no spatial structure to denoise): refuse the geometry when the model is built."""
    smallest = side
    for _ in config.channel_mult[1:]:
        smallest = (smallest - 1) // 2 + 1
    if smallest < 2:
        need = 2 ** (len(config.channel_mult) - 1) + 1
        raise ConfigError(
            f"the UNet halves its {side}x{side} input {len(config.channel_mult) - 1} time(s) to {smallest}x{smallest}, "
            f"too small to normalise: it needs a side of at least {need} (set data.image_size; a latent model's side "
            "is the image side divided by the autoencoder's factor)"
        )


def config_to_dict(config: UNetConfig) -> dict[str, Any]:
    """Plain-dict form of a config (for checkpoints and run configs)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
