"""The DP-SGD keys every privately trained network shares, declared once.

Diffusion methods, the DP-SGD classifier (and DP-ImgSyn's teacher), PrivImage+G's discriminator and
DPPM's score network all train with :func:`dpsynth.dpsgd.training.train_private`; their config
sections inherit :class:`DPSGDSection` (with their own defaults, :func:`dpsynth.schema.with_defaults`),
so the clip norm has one name (``clip_norm``) and one description everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import pydantic
from pydantic import Field

from dpsynth.dpsgd.per_example import StrategyName
from dpsynth.dpsgd.precision import PrecisionName
from dpsynth.dpsgd.training import OPTIMIZERS, PrivateTraining
from dpsynth.errors import ConfigError
from dpsynth.schema import AdamBetas, Section


class DPSGDSection(Section):
    """DP-SGD (Abadi et al., arXiv:1607.00133, Algorithm 1): Poisson batches of expected size B,
    per-example clipping to C, Gaussian noise σ·C, and the optimizer of the noisy mean gradient."""

    batch_size: int = Field(256, ge=1, description="expected (Poisson) logical batch B; sample rate q = B / N")
    physical_batch_size: int = Field(64, ge=1, description="examples per vectorised gradient call (memory only)")
    epochs: float | None = Field(10.0, gt=0, description="training length in epochs (ignored when steps is set)")
    steps: int | None = Field(None, ge=1, description="number of DP steps; overrides epochs when set")
    optimizer: Literal[OPTIMIZERS] = Field("adam", description="sgd | adam | adamw")  # type: ignore[valid-type]
    lr: float = Field(1e-3, gt=0, description="(initial) learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="weight decay")
    betas: AdamBetas = Field([0.9, 0.999], description="Adam (beta1, beta2), each in [0, 1)")
    clip_norm: float = Field(1.0, gt=0, description="per-example clip norm C")
    noise_multiplier: float | None = Field(
        None, gt=0, description="sigma; null = calibrated so the run ends at the target eps"
    )
    ema_decay: float | None = Field(None, gt=0, lt=1, description="EMA of the released weights; null: none")
    checkpoint_every: int = Field(50, ge=1, description="DP steps between checkpoints (resume granularity)")
    precision: PrecisionName = Field(
        "fp32",
        description="forward/backward dtype: fp32 | bf16 (autocast, CPU or CUDA) | fp16 (autocast with a static "
        "loss scale, CUDA only); per-example norms, clipping and noise stay fp32",
    )
    strategy: StrategyName = Field(
        "auto",
        description="per-example gradients: auto (each layer's form by the book-keeping cost model) | timed (close "
        "calls by a timed trial on random tensors when the plan is made) | ghost | instantiate | exact (a loop); "
        "the same update up to float rounding",
    )

    graph: Literal["auto", True, False] = Field(
        "auto",
        description="the fixed-shape private step (device Poisson sampling into a masked buffer, device per-record "
        "draws) captured as one CUDA graph and replayed: auto = on for CUDA, off (today's eager step) on the CPU; "
        "true on the CPU runs the fixed-shape step uncaptured; a method without a device-side batch builder, or "
        "privacy.secure_rng, runs eagerly and says why",
    )

    @pydantic.model_validator(mode="after")
    def _has_a_length(self) -> DPSGDSection:
        if self.steps is None and self.epochs is None:
            raise ValueError("set one of 'steps' and 'epochs'")
        return self

    def private_training(self, noise_multiplier: float | None = None) -> PrivateTraining:
        """The :class:`PrivateTraining` of this section; ``steps``, when set, wins over ``epochs``.

        ``noise_multiplier`` (the planned σ, :meth:`dpsynth.privacy.plan.PrivacyPlan.noise_multiplier`)
        replaces the section's, so a run spends exactly what its plan announced.
        """
        return PrivateTraining(
            batch_size=self.batch_size,
            lr=self.lr,
            steps=self.steps,
            epochs=None if self.steps is not None else self.epochs,
            optimizer=self.optimizer,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            betas=(self.betas[0], self.betas[1]),
            clip_norm=self.clip_norm,
            noise_multiplier=self.noise_multiplier if noise_multiplier is None else noise_multiplier,
            physical_batch_size=self.physical_batch_size,
            ema_decay=self.ema_decay,
            checkpoint_every=self.checkpoint_every,
            strategy=self.strategy,
            precision=self.precision,
            graph=self.graph,
        )


def dpsgd_sections(section: pydantic.BaseModel, key: str) -> Iterator[tuple[str, DPSGDSection]]:
    """Every DP-SGD section in ``section`` (itself, or nested, like a teacher or a GAN section), with its
    dotted config key (``key`` is the section's own)."""
    if isinstance(section, DPSGDSection):
        yield key, section
    for name, value in section:
        if isinstance(value, pydantic.BaseModel):
            yield from dpsgd_sections(value, f"{key}.{name}")


def check_precision_device(section: pydantic.BaseModel, key: str, device: str) -> None:
    """ConfigError at load for ``precision: fp16`` where the run will not be on CUDA (``device`` cpu or mps,
    or ``auto`` on a machine without CUDA): fp16 training needs CUDA (:mod:`dpsynth.dpsgd.precision`)."""
    fp16 = [name for name, sub in dpsgd_sections(section, key) if sub.precision == "fp16"]
    if fp16 and not _on_cuda(device):
        raise ConfigError(
            f"{fp16[0]}.precision=fp16 needs a CUDA device, but device={device!r} runs on "
            f"{'the CPU' if device == 'auto' else device}; use precision bf16 (CPU or CUDA) or fp32"
        )


def _on_cuda(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()
