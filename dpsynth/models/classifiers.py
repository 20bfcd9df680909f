"""Image classifiers for downstream utility, DP-SGD baselines and the DP-ImgSyn teacher.

Every network here normalises with GroupNorm, never BatchNorm: BatchNorm mixes examples inside a
batch, which breaks per-example gradients (DP-SGD) and torch.func ``vmap``; DP-ImgSyn (DP-ImgSyn (TMLR 2024)
§3) also needs GroupNorm in its teacher. Activations are never modified in place
(``ReLU(inplace=False)``, residuals as ``a + b``), so ``torch.func.vmap(grad(...))`` works on all.

Inputs are float ``[N, C, H, W]`` in [-1, 1] (``ImageDataset.to_tensors``); outputs are logits.

Models (``build_classifier(name, ...)``), each with a ``gpu`` preset (the size used in the papers)
and a small ``cpu`` preset (the same family, minutes on 2 CPU cores):

============  ===========================================  ==========================================
name          gpu preset                                    cpu preset
============  ===========================================  ==========================================
logreg        linear softmax regression (seed papers)       same
mlp           2 hidden layers of 512 (seed papers)          2 hidden layers of 256
cnn           2 conv (32, 64) + 2 fc (128), seed papers     2 conv (16, 32) + 2 fc (64)
cnn-1.1m      1.1M-parameter CNN for the DP-SGD benchmark  same (the size is the point of it)
resnet18      ResNet-18 (GroupNorm), DP-ImgSyn teacher      ResNet-18 layout at widths 16..128
wrn-40-4      WRN-40-4 (Ghalebikesabi et al. (arXiv:2302.13861) §5)     WRN-10-2
resnet        ResNet-20 (3 stages × 3 blocks, 16..64)       ResNet-8 (3 stages × 1 block)
resnext       ResNeXt-29, cardinality 8, 4d, 128..512       ResNeXt-11, cardinality 4, 2d, 32..128
============  ===========================================  ==========================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dpsynth.errors import ConfigError

PRESETS = ("cpu", "gpu")


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with up to 32 groups of at least 2 channels each (Wu & He, 2018)."""
    groups = next((g for g in (32, 16, 8, 4, 2) if channels % g == 0 and channels // g >= 2), 1)
    return nn.GroupNorm(groups, channels)


def conv_gn_relu(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        group_norm(out_channels),
        nn.ReLU(inplace=False),
    )


# ---------------------------------------------------------------------------------------------
# Seed-paper protocol: logistic regression, MLP, small CNN (PrivImage (arXiv:2311.12850) §4.3)
# ---------------------------------------------------------------------------------------------


class LogisticRegression(nn.Module):
    """Multinomial logistic regression on raw pixels."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_channels * image_size * image_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Fully connected network with ReLU hidden layers."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_channels * image_size * image_size
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU(inplace=False)]
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class SmallCNN(nn.Module):
    """Convolutional stages (each ``convs_per_stage`` × conv-GN-ReLU, then 2×2 max-pool), then two fc layers.

    ``pooled_size`` fixes the spatial size before the fc layers (adaptive average pooling), so the
    parameter count does not depend on the image size.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        widths: tuple[int, ...],
        hidden: int,
        convs_per_stage: int = 1,
        pooled_size: int | None = None,
        image_size: int = 28,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels, size = in_channels, image_size
        for width in widths:
            for _ in range(convs_per_stage):
                layers.append(conv_gn_relu(channels, width))
                channels = width
            layers.append(nn.MaxPool2d(2))
            size //= 2
        if pooled_size is not None:
            layers.append(nn.AdaptiveAvgPool2d(pooled_size))
            size = pooled_size
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * size * size, hidden),
            nn.ReLU(inplace=False),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# ---------------------------------------------------------------------------------------------
# Residual networks (benchmark protocol, DPImageBench: WRN-40-4, ResNet, ResNeXt; ResNet-18 teacher)
# ---------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a residual connection (He et al., 2016), GroupNorm, post-activation."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = group_norm(out_channels)
        self.relu = nn.ReLU(inplace=False)
        self.shortcut = _projection(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class WideBlock(nn.Module):
    """Pre-activation wide residual block (Zagoruyko & Komodakis, 2016), GroupNorm instead of BatchNorm."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm2 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.relu = nn.ReLU(inplace=False)
        self.shortcut = (
            nn.Identity()
            if in_channels == out_channels and stride == 1
            else nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.relu(self.norm1(x))
        out = self.conv1(pre)
        out = self.conv2(self.relu(self.norm2(out)))
        # Zagoruyko & Komodakis project the pre-activated input when the shape changes.
        skip = x if isinstance(self.shortcut, nn.Identity) else self.shortcut(pre)
        return out + skip


class ResNeXtBlock(nn.Module):
    """Bottleneck with a grouped 3×3 convolution of ``cardinality`` groups (Xie et al., 2017)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, cardinality: int, group_width: int) -> None:
        super().__init__()
        inner = cardinality * group_width
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, inner, 1, bias=False),
            group_norm(inner),
            nn.ReLU(inplace=False),
            nn.Conv2d(inner, inner, 3, stride=stride, padding=1, groups=cardinality, bias=False),
            group_norm(inner),
            nn.ReLU(inplace=False),
            nn.Conv2d(inner, out_channels, 1, bias=False),
            group_norm(out_channels),
        )
        self.shortcut = _projection(in_channels, out_channels, stride)
        self.relu = nn.ReLU(inplace=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def _projection(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if in_channels == out_channels and stride == 1:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), group_norm(out_channels))


class ResidualNetwork(nn.Module):
    """3×3 stem, stages of residual blocks (first block of each later stage halves the size), pooled head.

    For 28–64 px images the stem keeps full resolution (no 7×7 stride-2 stem, no max-pool), the
    usual CIFAR adaptation of ImageNet ResNets.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        stem_width: int,
        stage_widths: tuple[int, ...],
        blocks_per_stage: tuple[int, ...],
        make_block: Callable[[int, int, int], nn.Module],
        stem_norm: bool = True,
        final_norm: bool = False,
    ) -> None:
        super().__init__()
        stem: list[nn.Module] = [nn.Conv2d(in_channels, stem_width, 3, padding=1, bias=False)]
        if stem_norm:
            stem += [group_norm(stem_width), nn.ReLU(inplace=False)]
        blocks: list[nn.Module] = []
        channels = stem_width
        for stage, (width, count) in enumerate(zip(stage_widths, blocks_per_stage)):
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(make_block(channels, width, stride))
                channels = width
        # Pre-activation networks (WRN) need a last norm + ReLU before pooling.
        tail: list[nn.Module] = [group_norm(channels), nn.ReLU(inplace=False)] if final_norm else []
        self.features = nn.Sequential(*stem, *blocks, *tail, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def resnet18(in_channels: int, num_classes: int, base_width: int = 64) -> ResidualNetwork:
    """ResNet-18 (He et al., 2016): 4 stages × 2 basic blocks, widths w, 2w, 4w, 8w; GroupNorm."""
    widths = tuple(base_width * m for m in (1, 2, 4, 8))
    return ResidualNetwork(in_channels, num_classes, base_width, widths, (2, 2, 2, 2), BasicBlock)


def wide_resnet(in_channels: int, num_classes: int, depth: int, widen: int) -> ResidualNetwork:
    """WRN-depth-widen: 3 stages of (depth − 4) / 6 pre-activation blocks, widths 16k, 32k, 64k."""
    if (depth - 4) % 6:
        raise ConfigError(f"WRN depth must be 6n+4, got {depth}")
    per_stage = (depth - 4) // 6
    widths = (16 * widen, 32 * widen, 64 * widen)
    return ResidualNetwork(
        in_channels, num_classes, 16, widths, (per_stage,) * 3, WideBlock, stem_norm=False, final_norm=True
    )


def cifar_resnet(in_channels: int, num_classes: int, blocks: int, base_width: int = 16) -> ResidualNetwork:
    """ResNet-(6n+2) for small images (He et al., 2016 §4.2): 3 stages × n basic blocks."""
    widths = (base_width, 2 * base_width, 4 * base_width)
    return ResidualNetwork(in_channels, num_classes, base_width, widths, (blocks,) * 3, BasicBlock)


def resnext(
    in_channels: int, num_classes: int, blocks: int, cardinality: int, group_width: int, widths: tuple[int, int, int]
) -> ResidualNetwork:
    """ResNeXt-(9n+2) for small images (Xie et al., 2017): 3 stages × n bottlenecks; inner width doubles per stage."""
    stage_index = {w: i for i, w in enumerate(widths)}

    def make_block(cin: int, cout: int, stride: int) -> nn.Module:
        return ResNeXtBlock(cin, cout, stride, cardinality, group_width * 2 ** stage_index[cout])

    return ResidualNetwork(in_channels, num_classes, 64 if widths[0] >= 128 else 16, widths, (blocks,) * 3, make_block)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

Builder = Callable[[int, int, int, str], nn.Module]


def _logreg(c: int, k: int, size: int, preset: str) -> nn.Module:
    return LogisticRegression(c, k, size)


def _mlp(c: int, k: int, size: int, preset: str) -> nn.Module:
    return MLP(c, k, size, hidden=(512, 512) if preset == "gpu" else (256, 256))


def _cnn(c: int, k: int, size: int, preset: str) -> nn.Module:
    widths, hidden = ((32, 64), 128) if preset == "gpu" else ((16, 32), 64)
    return SmallCNN(c, k, widths, hidden, image_size=size)


def _cnn_1_1m(c: int, k: int, size: int, preset: str) -> nn.Module:
    # Three stages of two 3×3 convs (32, 64, 128) pooled to 4×4, then fc 400: about 1.1M parameters
    # for 10 classes at any input size (the DP-SGD benchmark model; the preset does not shrink it).
    return SmallCNN(c, k, (32, 64, 128), hidden=400, convs_per_stage=2, pooled_size=4, image_size=size)


def _resnet18(c: int, k: int, size: int, preset: str) -> nn.Module:
    return resnet18(c, k, base_width=64 if preset == "gpu" else 16)


def _wrn(c: int, k: int, size: int, preset: str) -> nn.Module:
    return wide_resnet(c, k, depth=40, widen=4) if preset == "gpu" else wide_resnet(c, k, depth=10, widen=2)


def _resnet(c: int, k: int, size: int, preset: str) -> nn.Module:
    return cifar_resnet(c, k, blocks=3 if preset == "gpu" else 1, base_width=16 if preset == "gpu" else 8)


def _resnext(c: int, k: int, size: int, preset: str) -> nn.Module:
    if preset == "gpu":
        return resnext(c, k, blocks=3, cardinality=8, group_width=4, widths=(128, 256, 512))
    return resnext(c, k, blocks=1, cardinality=4, group_width=2, widths=(32, 64, 128))


CLASSIFIERS: dict[str, Builder] = {
    "logreg": _logreg,
    "mlp": _mlp,
    "cnn": _cnn,
    "cnn-1.1m": _cnn_1_1m,
    "resnet18": _resnet18,
    "wrn-40-4": _wrn,
    "resnet": _resnet,
    "resnext": _resnext,
}


def list_classifiers() -> list[str]:
    """Names accepted by :func:`build_classifier`."""
    return list(CLASSIFIERS)


def build_classifier(name: str, in_channels: int, num_classes: int, image_size: int, preset: str = "cpu") -> nn.Module:
    """Build classifier ``name`` for ``[N, in_channels, image_size, image_size]`` inputs in [-1, 1].

    ``preset="gpu"`` gives the paper-size network, ``"cpu"`` a small network of the same family.
    Raises :class:`~dpsynth.errors.ConfigError` for an unknown name, preset or shape.
    """
    if name not in CLASSIFIERS:
        raise ConfigError(f"unknown classifier {name!r} (known: {', '.join(CLASSIFIERS)})")
    if preset not in PRESETS:
        raise ConfigError(f"classifier preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if in_channels < 1 or num_classes < 2 or image_size < 4:
        raise ConfigError(
            f"classifier {name}: need in_channels >= 1, num_classes >= 2, image_size >= 4 "
            f"(got {in_channels}, {num_classes}, {image_size})"
        )
    return CLASSIFIERS[name](in_channels, num_classes, image_size, preset)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
