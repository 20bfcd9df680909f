"""Label-row embedding of a class-conditional score model, and its class-conditional MCMC sampling.

"Learning Differentially Private Probabilistic Models for Privacy-Preserving Image Generation" (Liu, Ge,
Wang, Zhuang, Liu), §4 and Fig. 5: a fixed, data-independent matrix E [K, W] maps the one-hot label y to a
row of width W, appended under the image on every channel, u = [x; E y], of shape [C, H + 1, W]. An
unconditional score model of u is then a joint model of (image, label). After sampling, the image is the
first H rows and the label the class whose embedding row is nearest (L2) to the channel-mean of the sampled
row.

Sampling (:func:`sample_embedded`) runs the annealed samplers of :mod:`dpsynth.diffusion.hmc` (Algorithm 2's
Hamiltonian dynamics or NCSN's annealed Langevin dynamics) from NCSN's uniform start. The label row is
either sampled with the image (``free``, the paper's) or ``clamped`` to the requested balanced labels: the
row is masked out of the dynamics and reset at the start of each level to E y + σ_i z, and the clean row is
put back at the end, so the label is the one asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from dpsynth.data.transforms import tensor_to_uint8
from dpsynth.diffusion.hmc import MCMCSettings, annealed_sample
from dpsynth.errors import ConfigError
from dpsynth.report.balance import balanced_labels

#: fixed and public: the label embedding must not depend on the data or the run
EMBEDDING_SEED = 20230925
LABEL_ROWS = ("free", "clamped")
LabelRow = Literal["free", "clamped"]


def label_embedding_matrix(num_classes: int, width: int) -> torch.Tensor:
    """The fixed embedding matrix E [K, W] of Fig. 5: ±1 sign patterns from a fixed public seed."""
    generator = torch.Generator().manual_seed(EMBEDDING_SEED)
    matrix = torch.randint(0, 2, (num_classes, width), generator=generator).float().mul(2).sub(1)
    if len(set(map(tuple, matrix.tolist()))) < num_classes:
        raise ConfigError(
            f"label-row embedding: an image width of {width} cannot give {num_classes} distinct label rows"
        )
    return matrix


def embed_labels(images: torch.Tensor, labels: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """u = [x; E y]: the label's embedding row appended under each image, on every channel (Fig. 5)."""
    rows = matrix.to(images.device)[labels]  # [N, W]
    rows = rows[:, None, None, :].expand(-1, images.shape[1], 1, -1)
    return torch.cat([images, rows], dim=2)


def split_embedding(u: torch.Tensor, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`embed_labels`: the image rows and the class whose embedding is nearest to the row."""
    images, row = u[:, :, :-1], u[:, :, -1].mean(dim=1)  # [N, W]
    distances = torch.cdist(row, matrix.to(u.device))
    return images, distances.argmin(dim=1)


def label_row_mask(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """1 on the image rows, 0 on the label row (for sampling with a clamped label)."""
    mask = torch.ones((1, *shape), device=device)
    mask[:, :, -1] = 0
    return mask


@torch.no_grad()
def sample_embedded_batch(
    model: torch.nn.Module,
    matrix: torch.Tensor,
    wanted: torch.Tensor,
    shape: tuple[int, ...],
    settings: MCMCSettings,
    label_row: LabelRow,
    generator: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, float]:
    """One batch of label-embedded samples u [len(wanted), *shape] from the noise-conditional score ``model``
    (``model(x, level)``, its ladder in ``model.sigmas``), and the batch's mean Metropolis acceptance.
    ``wanted`` are the labels a ``clamped`` label row is fixed to (ignored when ``free``)."""
    count = len(wanted)
    x = (torch.rand((count, *shape), generator=generator) * 2 - 1).to(device)  # NCSN: uniform start
    sigmas = model.sigmas

    def score(z: torch.Tensor, level: int) -> torch.Tensor:
        return model(z, torch.full((len(z),), level, dtype=torch.long, device=z.device))

    mask, on_level = None, None
    if label_row == "clamped":
        mask = label_row_mask(shape, device)
        rows = embed_labels(torch.zeros((count, shape[0], 0, shape[2]), device=device), wanted.to(device), matrix)

        def on_level(z: torch.Tensor, level: int) -> torch.Tensor:
            noise = torch.randn(rows.shape, generator=generator).to(device)
            z = z.clone()
            z[:, :, -1:] = rows + float(sigmas[level]) * noise
            return z

    result = annealed_sample(score, x, sigmas, settings, generator, mask=mask, on_level=on_level)
    u = result.x
    if label_row == "clamped":  # the clean row: the label is the one asked for
        u = torch.cat([u[:, :, :-1], rows], dim=2)
    return u, result.acceptance_rate


def sample_embedded(
    model: torch.nn.Module,
    matrix: torch.Tensor,
    num: int,
    shape: tuple[int, ...],
    settings: MCMCSettings,
    label_row: LabelRow,
    generator: torch.Generator,
    batch_size: int,
    desc: str = "label-row sampling",
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """``(uint8 images [num, H, W, C], labels [num], mean acceptance)``: ``num`` samples of the label-embedded
    ``shape`` = [C, H + 1, W], split into image and label (:func:`split_embedding`), a batch at a time.

    The chains run on the model's device. ``decode`` maps the image rows to pixels (a latent model's public
    decoder); latents are passed to it unclamped, since they are not in [-1, 1] (the decoder clamps its pixels)."""
    num_classes, device = len(matrix), next(model.parameters()).device
    targets = torch.from_numpy(balanced_labels(num, num_classes))
    images, labels, rates = [], [], []
    for start in tqdm(range(0, num, batch_size), desc=desc, unit="batch", leave=False):
        wanted = targets[start : start + batch_size]
        u, rate = sample_embedded_batch(model, matrix, wanted, shape, settings, label_row, generator, device)
        batch_images, batch_labels = split_embedding(u, matrix)
        if decode is not None:
            batch_images = decode(batch_images.to(device))
        images.append(tensor_to_uint8(batch_images.clamp(-1, 1)))
        labels.append(batch_labels.cpu())
        rates.append(rate)
    return np.concatenate(images), torch.cat(labels).numpy(), sum(rates) / max(len(rates), 1)
