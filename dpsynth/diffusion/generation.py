"""Labelled samples from a trained class-conditional diffusion model, and the model's checkpoint.

Shared by every diffusion method (DPDM, PDP-Diffusion, PrivImage+D). Generation reads no private
data: it only runs the released (EMA) weights, so it costs no privacy and may be repeated freely.

* :func:`dpsynth.report.balance.balanced_labels` — the class of each sample. Balanced classes by default: a class
  distribution estimated from the private data would be a mechanism of its own and must go
  through the ledger, so it is never the default here.
* :func:`generate_labelled` — batched sampling (DDPM or DDIM, optional classifier-free guidance)
  returning ``uint8 [N, H, W, C]`` images with their ``int64`` labels, ready for ``samples.npz``.
* :class:`DiffusionModelSpec`, :func:`build_diffusion_model`, :func:`diffusion_model_state`,
  :func:`diffusion_model_from_state` — everything needed to rebuild the network in a fresh process
  (``dpsynth generate RUN --num N``) from the run's released state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dpsynth.data.transforms import tensor_to_uint8
from dpsynth.diffusion.samplers import sample
from dpsynth.diffusion.schedules import DiffusionSchedule, build_schedule
from dpsynth.errors import ConfigError, DPSynthError
from dpsynth.models.unet import UNet, build_unet
from dpsynth.report.balance import balanced_labels

__all__ = [
    "DiffusionModelSpec",
    "build_diffusion_model",
    "generate_labelled",
    "diffusion_model_state",
    "diffusion_model_from_state",
    "SAMPLE_OPTION_KEYS",
]


@dataclasses.dataclass(frozen=True)
class DiffusionModelSpec:
    """What defines a diffusion model: the UNet, the data geometry, the label space and the schedule."""

    model: Any  # UNet preset name or mapping of UNetConfig fields (dpsynth.models.unet.build_unet)
    image_size: int
    channels: int
    num_classes: int
    learn_sigma: bool = False
    noise_schedule: str = "linear"
    timesteps: int = 1000

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        if isinstance(values["model"], Mapping):
            values["model"] = {k: list(v) if isinstance(v, tuple) else v for k, v in values["model"].items()}
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DiffusionModelSpec:
        return cls(**dict(values))

    def schedule(self) -> DiffusionSchedule:
        return build_schedule(self.noise_schedule, self.timesteps)


def build_diffusion_model(spec: DiffusionModelSpec) -> UNet:
    """The (randomly initialised) UNet described by ``spec``; the caller seeds torch beforehand."""
    return build_unet(spec.model, spec.image_size, spec.channels, spec.num_classes, learn_sigma=spec.learn_sigma)


# Keys of a method section that configure sampling; read by :func:`generate_labelled` callers.
SAMPLE_OPTION_KEYS = ("sampler", "sample_steps", "eta", "guidance", "variance")


def generate_labelled(
    model: nn.Module,
    schedule: DiffusionSchedule,
    num: int,
    num_classes: int,
    image_shape: Sequence[int],
    *,
    labels: np.ndarray | None = None,
    sampler: str = "ddim",
    sample_steps: int | None = 100,
    eta: float = 0.0,
    guidance: float = 0.0,
    variance: str | None = None,
    batch_size: int = 250,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = True,
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``num`` samples as ``(uint8 [N, H, W, C], int64 [N])``, balanced over classes unless ``labels`` is given.

    ``image_shape`` is ``(C, H, W)`` of what the model generates. Sampling noise comes from a generator seeded
    with ``seed`` (not DP noise: the model is already private). ``sample_steps`` respaces the schedule
    (improved DDPM §4); ``None`` runs all T steps. With ``decode`` the model generates latents (unclamped) and
    ``decode(latents [B, *image_shape]) -> images in [-1, 1]`` (the public backbone's decoder) turns each batch
    into pixels: post-processing of the released model, no privacy cost.
    """
    if labels is None:
        labels = balanced_labels(num, num_classes)
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (num,) or (num and (labels.min() < 0 or labels.max() >= num_classes)):
        raise ConfigError(f"need {num} labels in [0, {num_classes})")
    channels, height, width = (int(s) for s in image_shape)
    if num == 0 and decode is None:
        return np.zeros((0, height, width, channels), np.uint8), labels
    generator = torch.Generator().manual_seed(int(seed))
    images = sample(
        model,
        schedule,
        torch.from_numpy(labels),
        (channels, height, width),
        sampler=sampler,
        steps=sample_steps,
        guidance=guidance,
        generator=generator,
        eta=eta,
        variance=variance,
        batch_size=batch_size,
        progress=progress,
        device=device,
        clip_denoised=decode is None,
    )
    if decode is not None:
        images = _decoded(images, decode, batch_size, device)
    return tensor_to_uint8(images), labels


def _decoded(
    latents: torch.Tensor, decode: Callable[[torch.Tensor], torch.Tensor], batch_size: int, device: Any
) -> torch.Tensor:
    """Pixels of ``latents`` decoded a batch at a time on ``device`` (CPU tensors in, CPU tensors out)."""
    chunks = [decode(chunk.to(device) if device is not None else chunk).cpu() for chunk in latents.split(batch_size)]
    if chunks:
        return torch.cat(chunks)
    return decode(latents.to(device) if device is not None else latents).cpu()  # zero rows: the pixel shape


def diffusion_model_state(spec: DiffusionModelSpec, model: nn.Module) -> dict[str, Any]:
    """The released state of a diffusion model: its spec and its weights (CPU tensors), what
    :func:`diffusion_model_from_state` rebuilds it from in a fresh process."""
    return {"spec": spec.to_dict(), "model": {name: value.detach().cpu() for name, value in model.state_dict().items()}}


def diffusion_model_from_state(
    state: Mapping[str, Any], device: torch.device | str = "cpu"
) -> tuple[UNet, DiffusionModelSpec]:
    """Rebuild the model of :func:`diffusion_model_state` on ``device``, in eval mode."""
    if not state or "spec" not in state:
        raise DPSynthError("no trained diffusion model in the run's released state; run training first")
    spec = DiffusionModelSpec.from_dict(state["spec"])
    model = build_diffusion_model(spec)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), spec
