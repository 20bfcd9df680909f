"""The config sections of the diffusion methods: model, loss, timesteps, DP-Adam, sampling, pre-training, space.

Defaults are DPDM's (Chu et al., IEEE Access 2023, §III-A, §V-C); the methods override them with
:func:`dpsynth.schema.with_defaults`. :class:`PretrainSection` is PDP-Diffusion's public pre-training
(Ghalebikesabi et al., arXiv:2302.13861, Table 3), :class:`FineTuningSection` the parameters DP fine-tuning
trains (DP-LDM, arXiv:2305.15759, §3.2; DP-LoRA, arXiv:2406.01355, §3) and :class:`LatentSpaceSection` the
``space`` key (latent diffusion, arXiv:2112.10752, §3-4). The skeletons that read them live in
:mod:`dpsynth.methods.families.diffusion`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pydantic
from pydantic import Field

from dpsynth.diffusion.augment import MAX_MAGNITUDE
from dpsynth.diffusion.generation import DiffusionModelSpec
from dpsynth.diffusion.pretrain import CLASS_INIT_MODES, PretrainSettings
from dpsynth.diffusion.samplers import SAMPLERS, VARIANCES
from dpsynth.diffusion.schedules import MixtureOfUniformTimesteps
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.models.fine_tuning import TRAINABLE_SELECTORS
from dpsynth.models.unet import UNET_PRESETS, UNetConfig
from dpsynth.schema import Section, with_defaults

UNET_KEYS = tuple(f.name for f in dataclasses.fields(UNetConfig)) + ("attention_resolutions",)


class SamplingSection(Section):
    """Sampling keys shared by every diffusion method's section."""

    sampler: Literal[SAMPLERS] = Field(  # type: ignore[valid-type]
        "ddim", description="ddim | ddpm (ancestral; with learn_sigma it uses the learned variance)"
    )
    sample_steps: int | None = Field(
        100, ge=1, description="denoising steps; the schedule is respaced (improved DDPM §4); null = all T"
    )
    eta: float = Field(0.0, ge=0, description="DDIM stochasticity (0 = deterministic)")
    guidance: float = Field(0.0, ge=0, description="classifier-free guidance scale w; > 0 needs label_dropout > 0")
    variance: Literal[VARIANCES] | None = Field(  # type: ignore[valid-type]
        None, description="DDPM variance: learned | fixed_small | fixed_large; null = learned if learn_sigma"
    )


def unet_spec(section: Any, channels: int, side: int, num_classes: int) -> DiffusionModelSpec:
    """The :class:`DiffusionModelSpec` of a section's UNet keys (``model``, ``unet``, ``learn_sigma``,
    ``noise_schedule``, ``timesteps``) for square inputs of ``channels`` x ``side`` x ``side``."""
    model = {"preset": section.model, **section.unet} if section.unet else section.model
    return DiffusionModelSpec(
        model=model,
        image_size=side,
        channels=channels,
        num_classes=num_classes,
        learn_sigma=section.learn_sigma,
        noise_schedule=section.noise_schedule,
        timesteps=section.timesteps,
    )


def known_unet_preset(model: str) -> str:
    """``model`` if it names a UNet preset, else the ValueError a section validator raises."""
    if model not in UNET_PRESETS:
        raise ValueError(f"expected one of {', '.join(UNET_PRESETS)}")
    return model


def known_unet_keys(unet: dict[str, Any]) -> dict[str, Any]:
    """``unet`` if it overrides only UNetConfig fields and keeps dropout at 0, else a ValueError."""
    unknown = sorted(set(unet) - set(UNET_KEYS))
    if unknown:
        raise ValueError(f"unknown UNet key {unknown[0]!r}; allowed: {', '.join(UNET_KEYS)}")
    if float(unet.get("dropout", 0.0)) != 0.0:
        # Refused at load, before any budget is spent (the engine refuses it too): dropout masks
        # would depend on the other records of a batch (docs/privacy.md, "Per-record randomness").
        raise ValueError("unet.dropout must be 0 in private training (dropout masks are not per-record draws)")
    return unet


class DiffusionTraining(
    with_defaults(
        DPSGDSection,
        "DiffusionDPSGD",
        "DP-Adam keys with DPDM's defaults (§V-C).",
        batch_size=64,
        epochs=100.0,
    )
):  # type: ignore[misc]
    """Model, loss, timestep and DP-Adam keys of a diffusion section (DPDM's defaults, §III-A, §V-C)."""

    model: str = Field("0.8m", description=f"UNet preset: {', '.join(UNET_PRESETS)}")
    unet: dict[str, Any] = Field(
        {}, description="overrides of the preset's UNetConfig fields, e.g. {base_channels: 16, channel_mult: [1, 2]}"
    )
    learn_sigma: bool = Field(True, description="learned variance (improved DDPM): the UNet outputs eps and v")
    loss: Literal["hybrid", "simple"] = Field(
        "hybrid", description="hybrid = L_simple + lambda L_vlb (needs learn_sigma) | simple"
    )
    vlb_weight: float = Field(0.001, ge=0, description="lambda of the hybrid loss")
    noise_schedule: Literal["cosine", "linear"] = Field("cosine", description="beta schedule")
    timesteps: int = Field(1000, ge=2, description="T, the number of diffusion steps")
    timestep_weights: list[float] = Field(
        [1.0], min_length=1, description="training t ~ sum_i w_i U{l_i, u_i}; one component = uniform"
    )
    timestep_boundaries: list[int] = Field(
        [0, 1000], min_length=2, description="l_1, u_1 = l_2, ..., u_K on the T = 1000 scale"
    )
    multiplicity: int = Field(
        1, ge=1, description="K timesteps (augmented copies) per example, averaged before clipping"
    )
    label_dropout: float = Field(
        0.0, ge=0, lt=1, description="fraction of copies trained on the null class (enables guidance)"
    )

    _known_preset = pydantic.field_validator("model")(lambda cls, model: known_unet_preset(model))
    _known_unet_keys = pydantic.field_validator("unet")(lambda cls, unet: known_unet_keys(unet))


class DiffusionSection(SamplingSection, DiffusionTraining):
    """The keys of every DP-Adam diffusion method: training keys first, then sampling.

    Defaults are DPDM's (Chu et al., §III-A, §V-C); other methods override them with
    :func:`dpsynth.schema.with_defaults`.
    """

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> DiffusionSection:
        if self.loss == "hybrid" and not self.learn_sigma:
            raise ValueError("loss 'hybrid' needs learn_sigma: true (improved DDPM)")
        if len(self.timestep_boundaries) != len(self.timestep_weights) + 1:
            raise ValueError(
                f"timestep_boundaries needs {len(self.timestep_weights) + 1} entries for "
                f"{len(self.timestep_weights)} timestep_weights, got {len(self.timestep_boundaries)}"
            )
        if self.guidance > 0 and self.label_dropout == 0:
            raise ValueError("guidance > 0 needs label_dropout > 0 (the null class must be trained)")
        return self


class PretrainSection(Section):
    """Public pre-training (PDP-Diffusion, arXiv:2302.13861, Table 3, ImageNet32 column; cached)."""

    enabled: bool = Field(True, description="false (or no data.public): train from scratch (§5.3)")
    steps: int = Field(2000, ge=1, description="iterations (Table 3: 200k on ImageNet32)")
    batch_size: int = Field(64, ge=1, description="batch size (Table 3: 1,024)")
    lr: float = Field(0.0002, gt=0, description="Adam learning rate after warm-up")
    warmup_steps: int = Field(200, ge=0, description="linear warm-up from 0 (Table 3: 5k steps)")
    ema_decay: float = Field(
        0.9999, gt=0, lt=1, description="EMA of the pre-trained weights; fine-tuning starts from the EMA"
    )
    label_dropout: float = Field(
        0.1, ge=0, lt=1, description="null-class fraction: the null row learns p(x), used by class_init"
    )
    timestep_weights: list[float] = Field([0.03, 0.77, 0.2], min_length=1, description="Table 3, ImageNet32 column")
    timestep_boundaries: list[int] = Field([0, 30, 800, 1000], min_length=2, description="mixture boundaries")
    flip: bool = Field(False, description="random flips during pre-training")
    crop_padding: int = Field(0, ge=0, description="random crops during pre-training")
    checkpoint_every: int = Field(500, ge=1, description="steps between resumable snapshots in the cache")
    cache: bool = Field(True, description="reuse / store the model in $DPSYNTH_CACHE or ~/.cache/dpsynth")

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> PretrainSection:
        if len(self.timestep_boundaries) != len(self.timestep_weights) + 1:
            raise ValueError("pretrain.timestep_boundaries needs one entry more than pretrain.timestep_weights")
        return self


class FineTuningSection(Section):
    """Which parameters of the pre-trained model DP fine-tuning trains (:mod:`dpsynth.models.fine_tuning`)."""

    trainable: Literal[TRAINABLE_SELECTORS] = Field(  # type: ignore[valid-type]
        "all",
        description="all | attention (attention blocks + label embedder: DP-LDM) | lora (rank-r adapters on the "
        "attention projections + label embedder: DP-LoRA); the others stay at their public pre-trained values",
    )
    lora_rank: int = Field(8, ge=1, description="r of the LoRA adapters (trainable: lora)")
    lora_alpha: float = Field(8.0, gt=0, description="LoRA scale alpha; the update is (alpha / r) B A")


class WarmupSection(Section):
    """Non-private training on a DP release before DP fine-tuning (:func:`dpsynth.diffusion.pretrain.warm_up`):
    DP-FETA's warm-up on RandAugment-ed central images (arXiv:2504.01395, §4.2; DPImageBench: 2,000 epochs of the
    50 images)."""

    steps: int = Field(2000, ge=1, description="Adam steps on the central images (DPImageBench: 2,000 epochs, 1 batch)")
    batch_size: int = Field(50, ge=1, description="central images per step, drawn with replacement")
    lr: float = Field(3e-4, gt=0, description="Adam learning rate")
    lr_warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up from 0")
    ema_decay: float = Field(0.999, gt=0, lt=1, description="EMA of the warm-up weights; DP-SGD starts from the EMA")
    augment_ops: int = Field(2, ge=0, description="RandAugment operations per image (0: no augmentation)")
    min_magnitude: int = Field(1, ge=0, le=MAX_MAGNITUDE, description="smallest RandAugment magnitude (of 10)")
    max_magnitude: int = Field(9, ge=0, le=MAX_MAGNITUDE, description="largest RandAugment magnitude (of 10)")
    checkpoint_every: int = Field(500, ge=1, description="steps between resumable warm-up snapshots")

    @pydantic.model_validator(mode="after")
    def _magnitudes_ordered(self) -> WarmupSection:
        if self.min_magnitude > self.max_magnitude:
            raise ValueError("warmup.min_magnitude must not exceed warmup.max_magnitude")
        return self


class PretrainedDiffusionSection(DiffusionSection, FineTuningSection):
    """A diffusion section with augmentation, class-embedding transfer, public pre-training and a choice of
    which parameters DP fine-tuning trains."""

    flip: bool = Field(False, description="random horizontal flip per copy")
    crop_padding: int = Field(0, ge=0, description="random crop after padding by this many pixels (reflect); 0 = none")
    class_init: Literal[CLASS_INIT_MODES] = Field(  # type: ignore[valid-type]
        "null",
        description="private class rows start from: null (pre-trained null row) | mean (of public rows) | "
        "names (the public row of the same class name; metadata only, no privacy cost)",
    )
    pretrain: PretrainSection = Field(default_factory=PretrainSection, description="public pre-training")

    @pydantic.model_validator(mode="after")
    def _fine_tunes_a_pretrained_model(self) -> PretrainedDiffusionSection:
        if self.trainable != "all" and not self.pretrain.enabled:
            raise ValueError(
                f"trainable: {self.trainable} fine-tunes part of a pre-trained model; "
                "it needs pretrain.enabled: true (and data.public)"
            )
        return self


class LatentSpaceSection(Section):
    """The ``space`` key of a diffusion section whose method may work in the public backbone's latent space."""

    space: Literal["pixel", "latent"] = Field(
        "pixel",
        description="pixel | latent: train (and pre-train, where the method does) and sample in the latent space of "
        "the public backbone (the backbone section, trained on data.public and cached); samples are decoded by its "
        "decoder",
    )

    @pydantic.model_validator(mode="after")
    def _augmentation_in_pixel_space(self) -> LatentSpaceSection:
        # Flips and crops are pixel operations; on latents they would be something else under the same name.
        if self.space == "latent" and (getattr(self, "flip", False) or getattr(self, "crop_padding", 0)):
            raise ValueError("space: latent trains on latents, so flip must be false and crop_padding 0")
        return self


class LatentPretrainedDiffusionSection(PretrainedDiffusionSection, LatentSpaceSection):
    """A pre-trained diffusion section with the ``space`` key (PDP-Diffusion, DP-LDM, DP-LoRA)."""


def uses_latent_space(section: Any) -> bool:
    """Whether a method section asks for the latent space (sections without a ``space`` key are pixel space)."""
    return getattr(section, "space", "pixel") == "latent"


def timestep_sampler(section: DiffusionTraining, num_timesteps: int) -> MixtureOfUniformTimesteps:
    """t ~ Σ w_i U{l_i, u_i} from ``timestep_weights`` / ``timestep_boundaries`` (uniform = one component)."""
    return MixtureOfUniformTimesteps(section.timestep_weights, section.timestep_boundaries, num_timesteps=num_timesteps)


def pretrain_settings(section: PretrainedDiffusionSection) -> PretrainSettings:
    """The :class:`PretrainSettings` of a section's ``pretrain`` sub-section (loss keys from the section)."""
    pretrain = section.pretrain
    return _non_private_settings(
        section,
        pretrain,
        pretrain.warmup_steps,
        pretrain.label_dropout,
        (pretrain.timestep_weights, pretrain.timestep_boundaries),
        flip=pretrain.flip,
        crop_padding=pretrain.crop_padding,
    )


def warmup_settings(section: Any) -> PretrainSettings:
    """The :class:`PretrainSettings` of a section's ``warmup`` sub-section (:class:`WarmupSection`); label dropout,
    loss and timestep keys are the section's own, those of the DP fine-tuning that follows."""
    warmup = section.warmup
    timesteps = (section.timestep_weights, section.timestep_boundaries)
    return _non_private_settings(section, warmup, warmup.lr_warmup_steps, section.label_dropout, timesteps)


def _non_private_settings(
    section: Any,
    sub: Any,
    warmup_steps: int,
    label_dropout: float,
    timesteps: tuple[list[float], list[int]],
    **augmentation: Any,
) -> PretrainSettings:
    """Steps, batch, lr, EMA and snapshots from ``sub``; loss keys from ``section``; t ~ Σ w_i U{l_i, u_i} from
    ``timesteps`` = (weights, boundaries) (Ghalebikesabi et al., arXiv:2302.13861, §4)."""
    weights, boundaries = timesteps
    return PretrainSettings(
        steps=sub.steps,
        batch_size=sub.batch_size,
        lr=sub.lr,
        warmup_steps=warmup_steps,
        ema_decay=sub.ema_decay,
        label_dropout=label_dropout,
        loss=section.loss,
        vlb_weight=section.vlb_weight,
        timestep_sampler={"kind": "mixture", "weights": list(weights), "boundaries": list(boundaries)},
        checkpoint_every=sub.checkpoint_every,
        **augmentation,
    )
