"""The shared diffusion-method skeletons: DP-Adam a class-conditional UNet, optionally after public pre-training.

:class:`DiffusionMethod` is the fit/generate flow of DPDM (dpdm-adaptive-clipping, Chu et al., IEEE
Access 2023) and of every method that fine-tunes a diffusion model with DP-Adam: build a spec and an
initial model, train it with :func:`dpsynth.dpsgd.training.train_private` (the only private loop),
release its (EMA) weights. :class:`PretrainedDiffusionMethod` adds the public pre-training of
PDP-Diffusion (Ghalebikesabi et al., arXiv:2302.13861, §4): the initial model is a diffusion model
trained without privacy on public data (cached, :mod:`dpsynth.diffusion.pretrain`), whose class
embedding is rebuilt for the private classes. PrivImage (Li et al., arXiv:2311.12850) reuses it,
pre-training on a privately *selected* public subset instead of the whole public set.

Latent space (``space: latent``, :class:`LatentSpaceSection`; Rombach et al., arXiv:2112.10752, §3-4, and
DP-LDM, arXiv:2305.15759, §3): the diffusion model is trained, pre-trained and sampled in the latent space of
the public backbone (:mod:`dpsynth.models.backbone`, the run's ``backbone`` section, cached). Each private
image is encoded on its own by the frozen public encoder, once before DP training (:func:`encode_train_set`),
so a record's training inputs still depend on that record alone and the DP-SGD sensitivity stays C; samples are
decoded by the public decoder (post-processing). The public pre-training encodes the public set with the same
encoder. The latent helpers (:func:`backbone_phases`, :func:`check_latent_config`, :func:`latent_geometry`,
:func:`load_backbone`, :func:`save_backbone`, :func:`restore_backbone`, :func:`encode_records`) also serve methods
with their own flow (DPPM's score model).

This module sits in the diffusion layer so that method modules compose it without importing each
other; it depends only on the method interface (:mod:`dpsynth.contract`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import pydantic
import torch
from pydantic import Field

from dpsynth.contract import Method, Phase, PrivateNetwork, RunConfig, RunContext, Samples
from dpsynth.diffusion.generation import (
    DiffusionModelSpec,
    build_diffusion_model,
    generate_labelled,
    load_diffusion_model,
    save_diffusion_model,
)
from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch
from dpsynth.diffusion.pretrain import (
    CLASS_INIT_MODES,
    PretrainResult,
    PretrainSettings,
    check_class_init,
    pretrain_diffusion,
    transfer_pretrained,
)
from dpsynth.diffusion.samplers import SAMPLERS, VARIANCES
from dpsynth.diffusion.schedules import MixtureOfUniformTimesteps
from dpsynth.dpsgd.estimate import planned_image_geometry
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.dpsgd.training import train_private
from dpsynth.errors import ConfigError, DPSynthError
from dpsynth.models.backbone import (
    Backbone,
    backbone_from_state,
    backbone_state,
    check_declared_side,
    pretrain_backbone,
)
from dpsynth.models.fine_tuning import (
    TRAINABLE_SELECTORS,
    add_lora_adapters,
    merge_lora_adapters,
    select_trainable,
)
from dpsynth.models.unet import UNET_PRESETS, UNetConfig
from dpsynth.privacy.plan import PrivacyPlan
from dpsynth.privacy.record_draws import Draws
from dpsynth.schema import Section, with_defaults
from dpsynth.seeding import stream_seed

# The released model lives in checkpoints/final.pt; DP-Adam progress in checkpoints/dp-adam.pt.
FINAL_PHASE = "final"
MECHANISM = "dp-adam"
# A latent-space run stores the public backbone it decodes with in checkpoints/backbone.pt.
BACKBONE_PHASE = "backbone"

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


def backbone_phases(config: RunConfig) -> list[Phase]:
    """The public ``backbone`` phase of a latent-space run (first in its ``phases()``), none in pixel space."""
    if not uses_latent_space(config.section):
        return []
    return [
        Phase(
            BACKBONE_PHASE,
            private=False,
            public="required",
            description="space latent: the public autoencoder (backbone section) trained on data.public, cached",
        )
    ]


class EncodedPublicSet:
    """A public ``ImageDataset`` seen through the backbone's encoder: what a latent model pre-trains on.

    It has what :func:`dpsynth.diffusion.pretrain.pretrain_diffusion` reads: the labels, classes and record
    keys of ``public``, the latent shape as ``image_shape``, and ``to_tensors()`` giving the scaled latents.
    """

    def __init__(self, public: Any, backbone: Backbone) -> None:
        self.public, self.backbone = public, backbone
        self.num_classes, self.class_names, self.labels = public.num_classes, public.class_names, public.labels
        self.image_shape = backbone.latent_shape

    def __len__(self) -> int:
        return len(self.public)

    @property
    def record_keys(self) -> Any:
        return self.public.record_keys

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.public.to_tensors()
        return torch.cat([encode_on_backbone(self.backbone, chunk) for chunk in images.split(512)]), labels


def encode_on_backbone(backbone: Backbone, images: torch.Tensor) -> torch.Tensor:
    """Scaled latents of ``images`` (on the backbone's device), returned where the images were."""
    device = next(backbone.autoencoder.parameters()).device
    return backbone.encode(images.to(device)).to(images.device)


# -- the latent space for any method (the diffusion skeletons below and methods with their own flow, e.g. DPPM) --
def check_latent_config(config: RunConfig) -> None:
    """At load: a latent-space run's image side must be divisible by the backbone's downsampling."""
    if uses_latent_space(config.section):
        check_declared_side(config.backbone, config.data)


def latent_geometry(config: RunConfig, image_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """The shape a model of ``config`` trains on: the backbone's latent shape in latent space, else ``image_shape``."""
    if uses_latent_space(config.section):
        return tuple(config.backbone.autoencoder.latent_shape(image_shape))  # type: ignore[return-value]
    return image_shape


def load_backbone(ctx: RunContext) -> Backbone | None:
    """The public backbone (trained on ``ctx.public``, or from the cache) of a latent-space run, else None."""
    if not uses_latent_space(ctx.section):
        return None
    return load_public_backbone(ctx)


def encode_train_set(backbone: Backbone, train: Any, chunk: int = 512) -> torch.Tensor:
    """The scaled latents of every record of ``train`` (an ``ImageDataset``, memory-mapped or not), read a chunk of
    records at a time: encoded once before DP training instead of at every step (the encoder costs about as much
    as a step of the latent UNet). Each latent depends on its own record alone (:func:`encode_records`); it stays
    in memory, ``N x latent`` floats (0.8 GB for 10^6 28x28 images at 7x7x4)."""
    if len(train) == 0:
        return torch.zeros((0, *backbone.latent_shape))
    with torch.no_grad():
        parts = torch.arange(len(train)).split(chunk)
        return torch.cat([encode_on_backbone(backbone, train.batch_tensors(part)[0]) for part in parts])


def save_backbone(ctx: RunContext, backbone: Backbone) -> None:
    """checkpoints/backbone.pt: the public weights `dpsynth generate` decodes with, whatever the cache holds."""
    ctx.checkpoints.save(backbone_state(backbone), phase=BACKBONE_PHASE)


def restore_backbone(ctx: RunContext) -> Backbone:
    """The backbone a latent-space run stored in checkpoints/backbone.pt (a fresh process: ``dpsynth generate``)."""
    state = ctx.checkpoints.load(BACKBONE_PHASE)
    if state is None:
        raise DPSynthError("a latent-space run without checkpoints/backbone.pt; run training first")
    return backbone_from_state(state, ctx.device)


def encode_records(backbone: Backbone, images: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Scaled latents of private ``images``, a chunk at a time. The frozen encoder is a per-example function (GroupNorm
    within each example, posterior means, no batch statistics and no randomness), so each record's latent depends on
    that record alone, however the records are chunked: the per-example sensitivity of a DP step on latents is that of
    the same step on pixels."""
    if len(images) == 0:
        return images.new_zeros((0, *backbone.latent_shape))
    return torch.cat([encode_on_backbone(backbone, part) for part in images.split(chunk)])


class DiffusionMethod(Method):
    """Shared skeleton: build a spec and an initial model, DP-Adam it with ``train_private``, release EMA weights."""

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._spec: DiffusionModelSpec | None = None
        self._backbone: Backbone | None = None  # the public latent backbone of a latent-space run

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        super().check_config(config)
        check_latent_config(config)

    def load_backbone(self, ctx: RunContext) -> Backbone | None:
        """The public backbone (trained on ``ctx.public``, or from the cache) of a latent-space run, else None."""
        return load_backbone(ctx)

    # -- hooks for subclasses ------------------------------------------------------------------
    def initial_model(self, ctx: RunContext, spec: DiffusionModelSpec) -> torch.nn.Module:
        """The network DP training starts from (random here; :class:`PretrainedDiffusionMethod` pre-trains it)."""
        torch.manual_seed(stream_seed(ctx.seed, "model-init"))
        return build_diffusion_model(spec)

    def lr_lambda(self, ctx: RunContext, steps_per_epoch: int, total_steps: int) -> Callable[[int], float] | None:
        return None

    def clip_norm_fn(
        self, ctx: RunContext, make_example_batch: Callable[..., dict[str, torch.Tensor]]
    ) -> Callable[[int, Any], float] | None:
        return None

    def augmentation(self, section: Any) -> dict[str, Any]:
        """Keyword options of :func:`make_multiplicity_batch` (flip, crop) for the private batches."""
        return {}

    # -- shared flow ---------------------------------------------------------------------------
    def plan(self, config: RunConfig, num_examples: int) -> PrivacyPlan:
        """One DP-Adam mechanism: ``steps`` (or ``epochs·N/B``) steps at q = B/N, σ calibrated unless given."""
        training = config.section.private_training()
        return training.plan(config.privacy, num_examples, name=MECHANISM, key=self.name)

    def model_spec(self, ctx: RunContext) -> DiffusionModelSpec:
        return self.spec_for(ctx.config, ctx.image_shape, ctx.num_classes)

    def spec_for(self, config: RunConfig, image_shape: tuple[int, int, int], num_classes: int) -> DiffusionModelSpec:
        """The model spec of ``config`` for images of ``image_shape`` (C, H, W) and ``num_classes`` classes."""
        section = config.section
        channels, height, width = latent_geometry(config, image_shape)
        if height != width:
            raise ConfigError(f"{self.name} needs square images, got {height}x{width}")
        return unet_spec(section, channels, height, num_classes)

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        """The UNet, fed K noisy copies of each example (``multiplicity``); one sample batch is
        ``sample_steps`` network calls."""
        section = config.section
        spec = self.spec_for(config, *planned_image_geometry(config.data))
        return [
            diffusion_network(
                config.method, spec, section.private_training(), section.multiplicity, section.sample_steps
            )
        ]

    def fit(self, ctx: RunContext) -> None:
        section = ctx.section
        self._backbone = backbone = self.load_backbone(ctx)  # before pre-training, which may encode with it
        spec = self.model_spec(ctx)
        model = self.initial_model(ctx, spec).to(ctx.device).train()
        schedule = spec.schedule()
        timesteps = timestep_sampler(section, spec.timesteps)
        multiplicity = section.multiplicity
        augment = dict(self.augmentation(section), label_dropout=section.label_dropout, null_label=spec.num_classes)
        train = ctx.data.train  # read a Poisson batch at a time: a memory-mapped set is never loaded whole

        def make_example_batch(
            x0: torch.Tensor, y: torch.Tensor, draws: Draws | torch.Generator
        ) -> dict[str, torch.Tensor]:
            # An empty Poisson batch (len(x0) == 0) yields empty tensors of the right trailing shapes.
            return make_multiplicity_batch(x0, y, multiplicity, timesteps, draws, **augment)

        latents = None if backbone is None else encode_train_set(backbone, train)

        def make_batch(indices: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
            if latents is None:
                x0, y = train.batch_tensors(indices)
            else:  # each record encoded on its own, once: its latent depends on it alone
                x0, y = latents[indices], torch.from_numpy(train.labels[indices.cpu().numpy()])
            return make_example_batch(x0, y, draws)

        loss_fn = make_loss_fn(schedule, kind=section.loss, vlb_weight=section.vlb_weight)
        settings = section.private_training(noise_multiplier=ctx.plan.noise_multiplier(MECHANISM))
        num_examples = len(ctx.data.train)
        total = settings.total_steps(num_examples)
        per_epoch = math.ceil(num_examples / settings.batch_size)
        engine = train_private(
            ctx,
            model,
            loss_fn,
            make_batch,
            ctx.data.train.record_keys,
            settings,
            mechanism=MECHANISM,
            lr_lambda=self.lr_lambda(ctx, per_epoch, total),
            clip_norm_fn=self.clip_norm_fn(ctx, make_example_batch),
            desc=self.name,
        )
        if backbone is not None:  # public weights: what `dpsynth generate` decodes with, whatever the cache holds
            save_backbone(ctx, backbone)
        # LoRA adapters folded into their projections: the release is a plain UNet of ``spec``.
        model, ema = merge_lora_adapters(model), engine.ema_model
        if ema is not None:
            merge_lora_adapters(ema)
        save_diffusion_model(ctx.checkpoints, spec, model, ema, phase=FINAL_PHASE)
        self._model = (ema if ema is not None else model).eval()
        self._spec = spec

    def generate(self, ctx: RunContext, num: int) -> Samples:
        if self._model is None or self._spec is None:  # a fresh process (dpsynth generate)
            self._model, self._spec = load_diffusion_model(ctx.checkpoints, FINAL_PHASE, device=ctx.device)
        if uses_latent_space(ctx.section) and self._backbone is None:
            self._backbone = restore_backbone(ctx)
        return self.sample(ctx, self._model, self._spec, num)

    def sample(self, ctx: RunContext, model: torch.nn.Module, spec: DiffusionModelSpec, num: int) -> Samples:
        """``num`` balanced samples from ``model`` with the section's sampler (any model of ``spec``)."""
        section = ctx.section
        images, labels = generate_labelled(
            model,
            spec.schedule(),
            num,
            spec.num_classes,
            (spec.channels, spec.image_size, spec.image_size),
            sampler=section.sampler,
            sample_steps=section.sample_steps,
            eta=section.eta,
            guidance=section.guidance,
            variance=section.variance,
            batch_size=ctx.config.generate.batch_size,
            seed=stream_seed(ctx.seed, "sampling"),
            device=ctx.device,
            decode=self._backbone.decode if self._backbone is not None else None,
        )
        return Samples(images=images, labels=labels)


def diffusion_network(
    key: str, spec: DiffusionModelSpec, training: Any, multiplicity: int, sample_steps: int
) -> PrivateNetwork:
    """The :class:`PrivateNetwork` of a diffusion model: rows are (noisy image, timestep, label) triples."""
    shape = (spec.channels, spec.image_size, spec.image_size)

    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        return torch.zeros(rows, *shape), torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)

    return PrivateNetwork(
        key=key,
        build=lambda: build_diffusion_model(spec),
        inputs=inputs,
        training=training,
        rows_per_example=multiplicity,
        sample_calls=sample_steps,
    )


def timestep_sampler(section: DiffusionTraining, num_timesteps: int) -> MixtureOfUniformTimesteps:
    """t ~ Σ w_i U{l_i, u_i} from ``timestep_weights`` / ``timestep_boundaries`` (uniform = one component)."""
    return MixtureOfUniformTimesteps(section.timestep_weights, section.timestep_boundaries, num_timesteps=num_timesteps)


class PretrainedDiffusionMethod(DiffusionMethod):
    """PDP-Diffusion's flow: non-private pre-training on public data, then DP-Adam fine-tuning.

    The section carries PDP-Diffusion's keys (``flip``, ``crop_padding``, ``class_init`` and a
    ``pretrain`` sub-section). Subclasses choose the pre-training data with :meth:`pretraining_data`
    (PrivImage: the privately selected public subset); everything else is shared.
    """

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        """The public backbone (latent space), public pre-training, DP-Adam, generation."""
        pretrain = config.section.pretrain.enabled
        return backbone_phases(config) + [
            Phase(
                "pretrain",
                private=False,
                public="optional" if pretrain else "none",
                description="non-private pre-training on data.public (skipped without it)",
            ),
            Phase(MECHANISM, private=True),
            Phase("generate", private=False),
        ]

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        super().check_config(config)
        if config.section.trainable != "all" and config.data.public is None:
            raise ConfigError(
                f"{config.method}.trainable: {config.section.trainable} fine-tunes a model pre-trained on public "
                "data; set data.public (or trainable: all)"
            )

    def augmentation(self, section: Any) -> dict[str, Any]:
        return {"flip": section.flip, "crop_padding": section.crop_padding}

    def pretraining_data(self, ctx: RunContext) -> tuple[Any, str] | None:
        """``(public ImageDataset, cache spec string)`` to pre-train on, or None to train from scratch."""
        if ctx.public is None:
            return None
        return ctx.public, str(ctx.config.data.public)

    def label_transfer(self, ctx: RunContext, public: Any) -> tuple[str, list[str] | None, list[str] | None]:
        """``(class_init, public names, private names)`` for :func:`transfer_pretrained`."""
        return ctx.section.class_init, public.class_names, ctx.data.train.class_names

    def initial_model(self, ctx: RunContext, spec: DiffusionModelSpec) -> torch.nn.Module:
        pretrain = ctx.section.pretrain
        source = self.pretraining_data(ctx) if pretrain.enabled else None
        if source is None:
            if pretrain.enabled:
                ctx.log(f"warning: {self.name} has no public data (data.public is null): training from scratch")
            return super().initial_model(ctx, spec)
        public, public_spec = source
        class_init, public_names, private_names = self.label_transfer(ctx, public)
        # before pre-training, which it would otherwise follow by minutes
        check_class_init(class_init, public_names, private_names, f"{self.name}.class_init")
        result = pretrain_public_model(
            ctx.config, public, public_spec, spec, self._backbone, device=ctx.device, log=ctx.log
        )
        matched = len(set(public_names or ()) & set(private_names or ()))
        ctx.log(
            f"pre-trained model {result.key} ({'cache hit' if result.cached else 'trained'}); "
            f"class embedding: {public.num_classes} public -> {spec.num_classes} private classes "
            f"(init: {class_init}; {matched} class names shared)"
        )
        torch.manual_seed(stream_seed(ctx.seed, "model-init"))
        model = build_diffusion_model(spec)
        transfer_pretrained(result.model.cpu(), model, class_init, public_names, private_names)
        return self.select_fine_tuned(ctx, model)

    def select_fine_tuned(self, ctx: RunContext, model: torch.nn.Module) -> torch.nn.Module:
        """Freeze what the section's ``trainable`` keeps public (adding LoRA adapters for ``lora``)."""
        torch.manual_seed(stream_seed(ctx.seed, "model-init", 1))  # the adapters: part of the model init
        trainable = apply_trainable(model, ctx.section)
        total = sum(p.numel() for p in model.parameters())
        ctx.log(f"fine-tuning {ctx.section.trainable}: {trainable:,} of {total:,} parameters trainable")
        return model

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork]:
        """The UNet as fine-tuned: with its adapters, and only the selected parameters trainable."""
        return [
            dataclasses.replace(network, build=lambda build=network.build: _with_trainable(build(), config.section))
            for network in super().private_networks(config)
        ]

    @classmethod
    def pretrains_on_the_public_set(cls) -> bool:
        """Whether the pre-training data is ``data.public`` itself, so ``dpsynth pretrain`` can build it ahead of
        a run (PrivImage's is a DP selection of it: it needs the private data and the run's ledger)."""
        return cls.pretraining_data is PretrainedDiffusionMethod.pretraining_data


def load_public_backbone(ctx: RunContext) -> Backbone:
    """The run's public backbone (the ``backbone`` section, trained on ``ctx.public`` or from the cache), logged."""
    backbone = pretrain_backbone(ctx.public, ctx.config.backbone, device=ctx.device, log=ctx.log)
    state = "cache hit" if backbone.cached else "trained"
    ctx.log(f"backbone {backbone.key} ({state}): latents {backbone.latent_shape}")
    return backbone


def pretrain_public_model(
    config: RunConfig,
    public: Any,
    public_spec: str,
    spec: DiffusionModelSpec,
    backbone: Backbone | None,
    *,
    device: Any,
    log: Callable[[str], None],
) -> PretrainResult:
    """The cached public pre-training of ``config``'s section (its ``pretrain`` sub-section and loss keys) on
    ``public``, for a model of ``spec`` with the public label space; in the backbone's latent space when
    ``backbone`` is given (the cache key then covers the backbone). Every method with the same public set,
    spec, settings and seed shares one cache entry."""
    if backbone is not None:
        public = EncodedPublicSet(public, backbone)
        public_spec = f"{public_spec} encoded by backbone {backbone.key}"
    return pretrain_diffusion(
        public,
        DiffusionModelSpec(**dict(spec.to_dict(), num_classes=public.num_classes)),
        pretrain_settings(config.section),
        seed=config.seed,
        public_spec=public_spec,
        device=device,
        log=log,
        use_cache=config.section.pretrain.cache,
    )


def apply_trainable(model: torch.nn.Module, section: FineTuningSection) -> int:
    """Add LoRA adapters (``trainable: lora``) and freeze what ``section.trainable`` keeps at its pre-trained
    value; returns the trainable parameter count."""
    if section.trainable == "lora":
        add_lora_adapters(model, section.lora_rank, section.lora_alpha)
    return select_trainable(model, section.trainable)


def _with_trainable(model: torch.nn.Module, section: FineTuningSection) -> torch.nn.Module:
    apply_trainable(model, section)
    return model


def pretrain_settings(section: PretrainedDiffusionSection) -> PretrainSettings:
    """The :class:`PretrainSettings` of a section's ``pretrain`` sub-section (loss keys from the section)."""
    pretrain = section.pretrain
    return PretrainSettings(
        steps=pretrain.steps,
        batch_size=pretrain.batch_size,
        lr=pretrain.lr,
        warmup_steps=pretrain.warmup_steps,
        ema_decay=pretrain.ema_decay,
        label_dropout=pretrain.label_dropout,
        loss=section.loss,
        vlb_weight=section.vlb_weight,
        timestep_sampler={
            "kind": "mixture",
            "weights": list(pretrain.timestep_weights),
            "boundaries": list(pretrain.timestep_boundaries),
        },
        flip=pretrain.flip,
        crop_padding=pretrain.crop_padding,
        checkpoint_every=pretrain.checkpoint_every,
    )


def public_clip_norm_schedule(
    ctx: RunContext,
    make_example_batch: Callable[..., dict[str, torch.Tensor]],
    batch: int,
    backbone: Backbone | None = None,
) -> Callable[[int, Any], float]:
    """``(step, engine) -> C``: the mean per-example gradient norm on a fresh public batch (§IV-B).

    The public batch goes through the same K-copy construction as the private one. Its labels are
    the public labels when the label spaces agree; otherwise (e.g. 62 glyph classes vs 10 digits)
    each public image gets a label drawn uniformly from the private classes — only the norm scale
    matters here. Draws come from the run's ``clip-probe`` stream, one generator per step, so a resumed
    run sees the same C. With a ``backbone`` (latent space) the public images are encoded by it first, so the
    probe sees what the private steps see; it is public data through a public encoder, so C stays free.
    """
    from dpsynth.dpsgd import public_clip_norm

    public = ctx.public if backbone is None else EncodedPublicSet(ctx.public, backbone)
    public_images, public_labels = public.to_tensors()
    same_labels = ctx.public.num_classes == ctx.num_classes

    def clip_norm(step: int, engine: Any) -> float:
        generator = ctx.rng("clip-probe", step)
        index = torch.randint(0, len(public_images), (batch,), generator=generator)
        labels = (
            public_labels[index] if same_labels else torch.randint(0, ctx.num_classes, (batch,), generator=generator)
        )
        return public_clip_norm(engine, make_example_batch(public_images[index], labels, generator))

    return clip_norm
