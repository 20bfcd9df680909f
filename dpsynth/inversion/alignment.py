"""DP-ImgSyn's alignment and release (TMLR 2024, §4.2–4.3, Algorithm 1, Eq. 1–5): post-processing only.

Starting images (public images, or Gaussian noise optionally low-pass filtered, A.6) get uniform target
labels (A.1.3) and are optimised for ``k`` Adam steps on ``α_f R_feature + α_c CE + α_tv R_tv + α_l2 R_l2``
(Eq. 1–5) with the teacher frozen; the teacher's soft labels at temperature ``T`` are released with them.
Everything here reads the teacher, the released statistics and public data only, so it costs no privacy.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from pydantic import Field
from tqdm.auto import tqdm

from dpsynth.contract import Samples
from dpsynth.data.transforms import tensor_to_uint8, uint8_to_tensor
from dpsynth.errors import ConfigError
from dpsynth.inversion.feature_stats import FeatureStatistics, GroupNormInputs, feature_loss
from dpsynth.schema import Section


class SynthesisSection(Section):
    """§4.2, Algorithm 1, A.1.2 (Adam, lr 0.1, betas (0.5, 0.99), batch 80), Table 7 weights."""

    init: Literal["public", "noise"] = Field("public", description="start from public images or Gaussian noise")
    noise_std: float = Field(1.0, gt=0, description="std of the N(0, std^2) initialisation (A.2, A.4)")
    blur_kernel: int = Field(0, ge=0, description="Gaussian low-pass of the noise init (A.6); 0 = off, else odd")
    blur_sigma: float | None = Field(None, gt=0, description="blur sigma; null: 0.3*((k-1)/2 - 1) + 0.8")
    iterations: int = Field(10, ge=0, description="k alignment steps (Table 2: 10 for MNIST); 0 = DP-ImgSyn(0)")
    early_stop_patience: int = Field(
        0, ge=0, description=">0: stop a batch once R_tv rose this many steps in a row (Fig. 4b)"
    )
    lr: float = Field(0.1, gt=0, description="Adam learning rate on the images")
    betas: list[float] = Field([0.5, 0.99], min_length=2, max_length=2, description="Adam (beta1, beta2)")
    batch_size: int = Field(80, ge=1, description="images aligned together")
    alpha_feature: float = Field(10.0, ge=0, description="weight of R_feature (Eq. 5)")
    alpha_ce: float = Field(1.0, ge=0, description="weight of the cross-entropy (Eq. 5)")
    alpha_tv: float = Field(2.5e-5, ge=0, description="weight of R_tv (Eq. 3)")
    alpha_l2: float = Field(3e-8, ge=0, description="weight of R_l2 (Eq. 4)")

    @pydantic.field_validator("blur_kernel")
    @classmethod
    def _odd_kernel(cls, kernel: int) -> int:
        if kernel > 1 and kernel % 2 == 0:
            raise ValueError("expected 0, 1 or an odd kernel size")
        return kernel

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: list[float]) -> list[float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError("expected two numbers in [0, 1)")
        return betas


class ReleaseSection(Section):
    """§4.3: soft labels p_M(x) at temperature T; hard labels from the targets or the teacher.

    The hard labels default to the targets each image was aligned to (A.1.3: balanced over the classes),
    so the release follows the requested label distribution. The teacher's argmax follows a DP teacher
    instead, and a weak one (a small set at a small ε) can put every image in one class; the soft labels
    carry the teacher's view either way."""

    temperature: float = Field(1.0, gt=0, description="softmax temperature T of the released soft labels")
    labels: Literal["teacher", "target"] = Field(
        "target",
        description="target (the balanced A.1.3 labels each image was aligned to) | teacher (argmax of the "
        "soft label; can collapse to one class when the DP teacher is weak)",
    )


def gaussian_blur(images: torch.Tensor, kernel_size: int, sigma: float | None = None) -> torch.Tensor:
    """Separable Gaussian low-pass filter with reflect padding (A.6; Haddad et al. 1991)."""
    if kernel_size <= 1:
        return images
    if kernel_size % 2 == 0:
        raise ConfigError(f"synthesis.blur_kernel must be odd, got {kernel_size}")
    sigma = 0.3 * ((kernel_size - 1) * 0.5 - 1) + 0.8 if sigma is None else float(sigma)
    offsets = torch.arange(kernel_size, dtype=images.dtype) - (kernel_size - 1) / 2
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = kernel / kernel.sum()
    channels = images.shape[1]
    pad = kernel_size // 2
    mode = "reflect" if min(images.shape[2:]) > pad else "replicate"
    x = F.pad(images, (pad, pad, pad, pad), mode=mode)
    x = F.conv2d(x, kernel.view(1, 1, 1, -1).repeat(channels, 1, 1, 1), groups=channels)
    return F.conv2d(x, kernel.view(1, 1, -1, 1).repeat(channels, 1, 1, 1), groups=channels)


def initial_images(
    synthesis: SynthesisSection,
    num: int,
    image_shape: tuple[int, int, int],
    public: Any,
    generator: torch.Generator,
) -> torch.Tensor:
    """``num`` starting images in [-1, 1]-scale, ``[num, C, H, W]`` (Algorithm 1 line 1).

    ``init: public`` draws images of the ``public`` set (an ImageDataset, or None) without replacement
    (cycling through fresh permutations when ``num`` exceeds it); ``init: noise`` draws ``N(0, noise_std²)``,
    optionally blurred (A.6). Both draw from ``generator``, a named stream of the run seed: this is not DP
    noise and touches no private data.
    """
    if synthesis.init == "public":
        if public is None:
            raise ConfigError("synthesis.init is 'public' but data.public is not set; set one or use init: noise")
        public_images, _ = public.to_tensors()
        if tuple(public_images.shape[1:]) != tuple(image_shape):
            raise ConfigError(
                f"public images {tuple(public_images.shape[1:])} do not match the private {tuple(image_shape)}"
            )
        rounds = math.ceil(num / len(public_images))
        order = torch.cat([torch.randperm(len(public_images), generator=generator) for _ in range(rounds)])
        return public_images[order[:num]].clone()
    if synthesis.init == "noise":
        noise = torch.randn((num, *image_shape), generator=generator) * float(synthesis.noise_std)
        noise = gaussian_blur(noise, int(synthesis.blur_kernel), synthesis.blur_sigma)
        return noise.clamp(-1.0, 1.0)
    raise ConfigError(f"synthesis.init must be 'public' or 'noise', got {synthesis.init!r}")


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """``R_tv = sum_ij sqrt((x_{i,j+1} − x_ij)² + (x_{i+1,j} − x_ij)²)`` (Eq. 3), summed over the batch."""
    right = images[..., :-1, 1:] - images[..., :-1, :-1]
    down = images[..., 1:, :-1] - images[..., :-1, :-1]
    return torch.sqrt(right.pow(2) + down.pow(2) + 1e-8).sum()


def synthesis_loss(
    teacher: torch.nn.Module,
    captured: GroupNormInputs,
    images: torch.Tensor,
    targets: torch.Tensor,
    statistics: FeatureStatistics,
    weights: SynthesisSection,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``R_total = α_f R_feature + α_c R_classif + α_tv R_tv + α_l2 R_l2`` (Eq. 5) and its parts."""
    logits = teacher(images)
    parts = {
        "feature": feature_loss(captured.captured(), statistics),
        "ce": F.cross_entropy(logits, targets),
        "tv": total_variation(images),
        "l2": images.pow(2).sum(),  # Eq. 4
    }
    total = (
        float(weights.alpha_feature) * parts["feature"]
        + float(weights.alpha_ce) * parts["ce"]
        + float(weights.alpha_tv) * parts["tv"]
        + float(weights.alpha_l2) * parts["l2"]
    )
    return total, {name: float(value.detach()) for name, value in parts.items()}


def align_batch(
    teacher: torch.nn.Module,
    statistics: FeatureStatistics,
    images: torch.Tensor,
    targets: torch.Tensor,
    synthesis: SynthesisSection,
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Algorithm 1 lines 3–7 on one batch: ``k`` Adam steps on the images, teacher frozen.

    Pixels are kept in the valid [-1, 1] range after every step (they are released as uint8).
    With ``early_stop_patience = p > 0`` the batch stops once ``R_tv`` rose ``p`` steps in a row:
    the paper finds accuracy falls when the image prior starts degrading (§5.2, Fig. 4b).
    Returns the aligned images and one record of the loss terms per iteration.
    """
    iterations = int(synthesis.iterations)
    if iterations < 0:
        raise ConfigError(f"synthesis.iterations must be >= 0, got {iterations}")
    x = images.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=float(synthesis.lr), betas=tuple(synthesis.betas))
    history: list[dict[str, float]] = []
    patience, rises = int(synthesis.early_stop_patience), 0
    with GroupNormInputs(teacher) as captured:
        for _ in range(iterations):
            optimizer.zero_grad(set_to_none=True)
            total, parts = synthesis_loss(teacher, captured, x, targets, statistics, synthesis)
            total.backward()
            optimizer.step()
            with torch.no_grad():
                x.clamp_(-1.0, 1.0)
            history.append({"total": float(total.detach()), **parts})
            rises = rises + 1 if len(history) > 1 and parts["tv"] > history[-2]["tv"] else 0
            if patience > 0 and rises >= patience:
                break
    return x.detach(), history


def align(
    teacher: torch.nn.Module,
    statistics: FeatureStatistics,
    initial: torch.Tensor,
    targets: torch.Tensor,
    synthesis: SynthesisSection,
    device: torch.device,
    log: Any = None,
) -> torch.Tensor:
    """Align all images batch by batch (progress bar on stderr); returns ``[N, C, H, W]`` on CPU."""
    teacher.eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)  # only x̂ is optimised (§4.2)
    batch_size = int(synthesis.batch_size)
    if batch_size < 1:
        raise ConfigError(f"synthesis.batch_size must be positive, got {batch_size}")
    aligned, first, last = [], None, None
    starts = range(0, len(initial), batch_size)
    for start in tqdm(starts, desc="DP-ImgSyn alignment", unit="batch", dynamic_ncols=True, leave=False):
        images, history = align_batch(
            teacher,
            statistics,
            initial[start : start + batch_size].to(device),
            targets[start : start + batch_size].to(device),
            synthesis,
        )
        aligned.append(images.cpu())
        if history:
            first = first or history[0]
            last = history[-1]
    if log is not None and first is not None:
        log(
            f"dp-imgsyn alignment: k={synthesis.iterations}, R_feature {first['feature']:.4g} -> "
            f"{last['feature']:.4g}, CE {first['ce']:.4g} -> {last['ce']:.4g} (first / last batch)"
        )
    return torch.cat(aligned) if aligned else initial[:0]


@torch.no_grad()
def soft_label_release(
    teacher: torch.nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor,
    spec: ReleaseSection,
    device: torch.device,
    batch_size: int = 512,
) -> Samples:
    """Quantise the images to uint8 and label them with the teacher's soft labels (§4.3).

    Soft labels are computed on the *released* (quantised) pixels, so a student sees exactly the
    image the label belongs to.
    """
    temperature = float(spec.temperature)
    if not temperature > 0:
        raise ConfigError(f"release.temperature must be positive, got {temperature}")
    if spec.labels not in ("teacher", "target"):
        raise ConfigError(f"release.labels must be 'teacher' or 'target', got {spec.labels!r}")
    pixels = tensor_to_uint8(images)
    quantised = uint8_to_tensor(pixels)
    soft = []
    for start in range(0, len(quantised), batch_size):
        logits = teacher(quantised[start : start + batch_size].to(device)).float().cpu()
        soft.append(torch.softmax(logits / temperature, dim=1))
    soft_labels = torch.cat(soft) if soft else torch.zeros(0, 0)
    labels = soft_labels.argmax(1) if spec.labels == "teacher" else targets
    return Samples(
        images=np.ascontiguousarray(pixels),
        labels=labels.numpy().astype(np.int64),
        soft_labels=soft_labels.numpy().astype(np.float32),
    )
