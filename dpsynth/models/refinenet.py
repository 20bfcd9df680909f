"""Noise-conditional RefineNet score network (NCSN), the score model of DPPM.

Song & Ermon, "Generative Modeling by Estimating Gradients of the Data Distribution" (arXiv:1907.05600),
§4.2 and Appendix A: a RefineNet (Lin et al. 2017) with dilated residual stages and conditional
instance normalisation++ (CIN++) carrying the noise level. DPPM ("Learning Differentially Private
Probabilistic Models for Privacy-Preserving Image Generation", Fig. 4a) uses the same layout:

    Conv 3x3 (w) | CondResBlock w x2 | CondResBlock 2w x2 (down) | CondResBlock 2w dilation 2 x2 (down)
    | CondResBlock 2w dilation 4 x2 | CondRefineBlock 2w x2 | CondRefineBlock w x2 | Conv 3x3

with w = 128 in the paper (about 30M parameters, preset ``paper``); preset ``cpu`` uses w = 32 (about 2M).

Every normalisation is per example (instance statistics, no running buffers), so per-example DP-SGD
gradients are well defined; there is no BatchNorm. The output is divided by the noise level σ,
as in Song & Ermon, "Improved Techniques for Training Score-Based Generative Models"
(arXiv:2006.09011, technique 3), so the network only has to predict a unit-scale quantity.
Feature maps of any size (e.g. 29x28 after DPPM's label row) are handled: downsampling pools with
``ceil_mode`` and the refine blocks resize every path to the largest one before fusing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dpsynth.errors import ConfigError

REFINENET_PRESETS: dict[str, int] = {"cpu": 32, "paper": 128}


@dataclasses.dataclass(frozen=True)
class RefineNetConfig:
    """Shape of a :class:`RefineNet`."""

    channels: int  # image channels (the score has the same shape as the input)
    num_levels: int  # number of noise levels the normalisation layers are conditioned on
    width: int = 32  # w of Fig. 4a

    @classmethod
    def from_preset(cls, preset: str, channels: int, num_levels: int, width: int | None = None) -> RefineNetConfig:
        if preset not in REFINENET_PRESETS:
            raise ConfigError(f"unknown RefineNet preset {preset!r}; choose one of {', '.join(REFINENET_PRESETS)}")
        return cls(channels=channels, num_levels=num_levels, width=width or REFINENET_PRESETS[preset])


class ConditionalInstanceNorm2dPlus(nn.Module):
    """CIN++ (arXiv:1907.05600, Appendix A, Eq. 9): instance norm whose scale/shift depend on the level.

    z = γ[i] (x - μ) / s + β[i] + α[i] (μ - m) / v, where μ, s are the per-channel spatial mean and std,
    and m, v the mean and std of μ across channels (so the channel means, which plain instance norm
    discards, are kept).
    """

    def __init__(self, channels: int, num_levels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(1.0 + 0.02 * torch.randn(num_levels, channels))
        self.alpha = nn.Parameter(1.0 + 0.02 * torch.randn(num_levels, channels))
        self.beta = nn.Parameter(torch.zeros(num_levels, channels))

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        variances, means = torch.var_mean(x, dim=(2, 3), unbiased=False)
        normalised = (x - means[..., None, None]) * torch.rsqrt(variances[..., None, None] + self.eps)
        channel_var, channel_mean = torch.var_mean(means, dim=1, keepdim=True, unbiased=False)
        mean_term = (means - channel_mean) / (channel_var + self.eps).sqrt()
        gamma, beta, alpha = self.gamma[level], self.beta[level], self.alpha[level]
        return gamma[..., None, None] * normalised + (beta + alpha * mean_term)[..., None, None]


def _conv3x3(in_channels: int, out_channels: int, dilation: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, padding=dilation, dilation=dilation, bias=bias)


def _down(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, 2, ceil_mode=True)


class CondResBlock(nn.Module):
    """Pre-activation residual block, CIN++ → ELU → conv twice, optional 2x downsampling and dilation."""

    def __init__(
        self, in_channels: int, out_channels: int, num_levels: int, down: bool = False, dilation: int = 1
    ) -> None:
        super().__init__()
        self.down = down
        self.norm1 = ConditionalInstanceNorm2dPlus(in_channels, num_levels)
        self.conv1 = _conv3x3(in_channels, out_channels, dilation)
        self.norm2 = ConditionalInstanceNorm2dPlus(out_channels, num_levels)
        self.conv2 = _conv3x3(out_channels, out_channels, dilation)
        self.shortcut = nn.Conv2d(in_channels, out_channels, 1) if (in_channels != out_channels or down) else None

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.elu(self.norm1(x, level)))
        h = self.conv2(F.elu(self.norm2(h, level)))
        skip = x if self.shortcut is None else self.shortcut(x)
        if self.down:
            h, skip = _down(h), _down(skip)
        return h + skip


class CondRCU(nn.Module):
    """Residual conv unit of RefineNet: ``blocks`` residual blocks of ``stages`` (CIN++, ELU, conv)."""

    def __init__(self, channels: int, num_levels: int, blocks: int = 2, stages: int = 2) -> None:
        super().__init__()
        self.norms = nn.ModuleList(ConditionalInstanceNorm2dPlus(channels, num_levels) for _ in range(blocks * stages))
        self.convs = nn.ModuleList(_conv3x3(channels, channels, bias=False) for _ in range(blocks * stages))
        self.stages = stages

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        for start in range(0, len(self.convs), self.stages):
            residual = x
            for norm, conv in zip(self.norms[start : start + self.stages], self.convs[start : start + self.stages]):
                x = conv(F.elu(norm(x, level)))
            x = x + residual
        return x


class CondMSF(nn.Module):
    """Multi-resolution fusion: each path normalised and convolved to ``out_channels``, resized, summed."""

    def __init__(self, in_channels: Sequence[int], out_channels: int, num_levels: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(ConditionalInstanceNorm2dPlus(c, num_levels) for c in in_channels)
        self.convs = nn.ModuleList(_conv3x3(c, out_channels) for c in in_channels)

    def forward(self, paths: Sequence[torch.Tensor], level: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        total = 0
        for path, norm, conv in zip(paths, self.norms, self.convs):
            h = conv(norm(path, level))
            if tuple(h.shape[-2:]) != size:
                h = F.interpolate(h, size=size, mode="bilinear", align_corners=True)
            total = total + h
        return total


class CondCRP(nn.Module):
    """Chained residual pooling: a chain of (CIN++, 5x5 average pool, conv), each output added to x."""

    def __init__(self, channels: int, num_levels: int, stages: int = 2) -> None:
        super().__init__()
        self.norms = nn.ModuleList(ConditionalInstanceNorm2dPlus(channels, num_levels) for _ in range(stages))
        self.convs = nn.ModuleList(_conv3x3(channels, channels, bias=False) for _ in range(stages))

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        x = F.elu(x)
        path = x
        for norm, conv in zip(self.norms, self.convs):
            path = conv(F.avg_pool2d(norm(path, level), 5, stride=1, padding=2))
            x = x + path
        return x


class CondRefineBlock(nn.Module):
    """RefineNet block: RCU per input path → fusion (several paths) → CRP → output RCU."""

    def __init__(self, in_channels: Sequence[int], out_channels: int, num_levels: int, end: bool = False) -> None:
        super().__init__()
        self.adapters = nn.ModuleList(CondRCU(c, num_levels) for c in in_channels)
        self.fusion = CondMSF(in_channels, out_channels, num_levels) if len(in_channels) > 1 else None
        self.crp = CondCRP(out_channels, num_levels)
        self.output = CondRCU(out_channels, num_levels, blocks=3 if end else 1)
        if self.fusion is None and in_channels[0] != out_channels:
            raise ValueError("a single-path refine block keeps its width")

    def forward(self, paths: Sequence[torch.Tensor], level: torch.Tensor) -> torch.Tensor:
        adapted = [adapter(path, level) for adapter, path in zip(self.adapters, paths)]
        if self.fusion is None:
            h = adapted[0]
        else:
            size = max((tuple(p.shape[-2:]) for p in adapted), key=lambda s: s[0] * s[1])
            h = self.fusion(adapted, level, size)
        return self.output(self.crp(h, level), level)


class RefineNet(nn.Module):
    """Noise-conditional score network ``s(x, i) ≈ ∇_x log p_{σ_i}(x)`` (Fig. 4a of DPPM).

    Args:
        config: channels, number of noise levels and width.
        sigmas: the noise ladder σ_1 > ... > σ_L (kept as a buffer; the output is divided by σ_i).
    """

    def __init__(self, config: RefineNetConfig, sigmas: torch.Tensor) -> None:
        super().__init__()
        if len(sigmas) != config.num_levels:
            raise ConfigError(f"RefineNet: {len(sigmas)} sigmas for {config.num_levels} noise levels")
        self.config = config
        w, levels = config.width, config.num_levels
        self.register_buffer("sigmas", torch.as_tensor(sigmas, dtype=torch.float32).clone())
        self.begin = _conv3x3(config.channels, w)
        self.stage1 = nn.ModuleList([CondResBlock(w, w, levels), CondResBlock(w, w, levels)])
        self.stage2 = nn.ModuleList([CondResBlock(w, 2 * w, levels, down=True), CondResBlock(2 * w, 2 * w, levels)])
        self.stage3 = nn.ModuleList(
            [CondResBlock(2 * w, 2 * w, levels, down=True, dilation=2), CondResBlock(2 * w, 2 * w, levels, dilation=2)]
        )
        self.stage4 = nn.ModuleList(
            [CondResBlock(2 * w, 2 * w, levels, dilation=4), CondResBlock(2 * w, 2 * w, levels, dilation=4)]
        )
        self.refine4 = CondRefineBlock([2 * w], 2 * w, levels)
        self.refine3 = CondRefineBlock([2 * w, 2 * w], 2 * w, levels)
        self.refine2 = CondRefineBlock([2 * w, 2 * w], w, levels)
        self.refine1 = CondRefineBlock([w, w], w, levels, end=True)
        self.end_norm = ConditionalInstanceNorm2dPlus(w, levels)
        self.end = _conv3x3(w, config.channels)

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        """Score of ``x`` [N, C, H, W] at noise level indices ``level`` [N] (0 = largest σ)."""
        h = self.begin(x)
        features = []
        for stage in (self.stage1, self.stage2, self.stage3, self.stage4):
            for block in stage:
                h = block(h, level)
            features.append(h)
        f1, f2, f3, f4 = features
        r = self.refine4([f4], level)
        r = self.refine3([f3, r], level)
        r = self.refine2([f2, r], level)
        r = self.refine1([f1, r], level)
        out = self.end(F.elu(self.end_norm(r, level)))
        return out / self.sigmas[level].view(-1, 1, 1, 1)


def build_refinenet(preset: str, channels: int, sigmas: torch.Tensor, width: int | None = None) -> RefineNet:
    """A :class:`RefineNet` of ``preset`` (``cpu``: w = 32, ``paper``: w = 128) over ``sigmas``."""
    return RefineNet(RefineNetConfig.from_preset(preset, channels, len(sigmas), width), sigmas)
