"""The small conditional generator of DP-MERF's image experiments (Harder et al., AISTATS 2021,
arXiv:2002.11603, §5 and its code's ``ConvCondGen``), also DP-NTK's MNIST generator.

``[z, onehot(y)]`` -> Linear(code + K, hidden) -> BatchNorm -> ReLU -> Linear(hidden, c1 * s * s) ->
BatchNorm -> reshape ``[c1, s, s]`` (s = side / 4) -> bilinear x2 -> Conv(c1 -> c2, k1) -> ReLU ->
bilinear x2 -> Conv(c2 -> C, k2) -> sigmoid. With the paper's MNIST sizes (code 5, hidden 200,
channels 16/8, kernels 5/5) it has about 0.17M parameters, which is what makes DP-MERF cheap on a CPU.

BatchNorm is fine here (unlike in a DP-SGD discriminator): the generator never sees private data;
it is fitted to a released target by :mod:`dpsynth.kernels.moment_matching`. The paper's output is
a sigmoid in [0, 1]; dpsynth's images are in [-1, 1], so the output is ``2 sigmoid(a) - 1`` (the same
function family, rescaled).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpsynth.errors import ConfigError


class MerfGenerator(nn.Module):
    """Conditional generator ``G(z, y)`` -> images ``[B, C, side, side]`` in [-1, 1].

    Args:
        num_classes: ``K``; labels enter as one-hot vectors.
        channels: image channels ``C``.
        image_size: the side, divisible by 4 (28 -> a 7x7 start, 32 -> 8x8).
        z_dim: the code length (paper: 5).
        hidden: width of the first fully connected layer (paper: 200).
        conv_channels: ``(c1, c2)`` (paper: 16, 8).
        kernel_sizes: ``(k1, k2)``, odd (paper: 5, 5).
        batch_norm: BatchNorm after both fully connected layers (paper: on).
    """

    def __init__(
        self,
        num_classes: int,
        channels: int,
        image_size: int,
        z_dim: int = 5,
        hidden: int = 200,
        conv_channels: tuple[int, int] = (16, 8),
        kernel_sizes: tuple[int, int] = (5, 5),
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        if image_size % 4 or image_size < 4:
            raise ConfigError(f"the DP-MERF generator needs an image side divisible by 4, got {image_size}")
        if any(k % 2 == 0 for k in kernel_sizes):
            raise ConfigError(f"the DP-MERF generator's kernel sizes must be odd, got {kernel_sizes}")
        self.num_classes, self.channels, self.image_size, self.z_dim = num_classes, channels, image_size, z_dim
        self.start = image_size // 4
        first, second = conv_channels
        self.fc1 = nn.Linear(z_dim + num_classes, hidden)
        self.bn1 = nn.BatchNorm1d(hidden) if batch_norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, first * self.start * self.start)
        self.bn2 = nn.BatchNorm1d(first * self.start * self.start) if batch_norm else nn.Identity()
        self.conv1 = nn.Conv2d(first, second, kernel_sizes[0], padding=kernel_sizes[0] // 2)
        self.conv2 = nn.Conv2d(second, channels, kernel_sizes[1], padding=kernel_sizes[1] // 2)
        self.first = first

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        code = torch.cat([z, F.one_hot(labels.long(), self.num_classes).to(z.dtype)], dim=1)
        h = self.bn2(self.fc2(F.relu(self.bn1(self.fc1(code)))))
        h = h.view(-1, self.first, self.start, self.start)
        # align_corners=True: the bilinear upsampling of the paper's code (nn.UpsamplingBilinear2d)
        h = F.relu(self.conv1(F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=True)))
        h = self.conv2(F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=True))
        return 2.0 * torch.sigmoid(h) - 1.0


def build_merf_generator(num_classes: int, channels: int, image_size: int, seed: int, **sizes) -> MerfGenerator:
    """A :class:`MerfGenerator` initialised from a public ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return MerfGenerator(num_classes, channels, image_size, **sizes)
