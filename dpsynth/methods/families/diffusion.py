"""The shared diffusion-method skeletons: DP-Adam a class-conditional UNet, optionally after public pre-training.

:class:`DiffusionMethod` is the fit/generate flow of DPDM (dpdm-adaptive-clipping, Chu et al., IEEE
Access 2023) and of every method that fine-tunes a diffusion model with DP-Adam: build a spec and an
initial model, train it with :func:`dpsynth.dpsgd.training.train_private` (the only private loop),
release its (EMA) weights as the method's state (:meth:`DiffusionMethod.state_dict`). Subclasses change the
initial model, the learning-rate schedule, the clip norm or the augmentation through the hooks.
:class:`PretrainedDiffusionMethod` adds the public pre-training of PDP-Diffusion (Ghalebikesabi et al.,
arXiv:2302.13861, §4): the initial model is a diffusion model trained without privacy on public data (cached,
:mod:`dpsynth.diffusion.pretrain`), whose class embedding is rebuilt for the private classes, and of which
DP-Adam trains all parameters or a selection (DP-LDM, DP-LoRA: :mod:`dpsynth.models.fine_tuning`). PrivImage
(Li et al., arXiv:2311.12850) reuses it, pre-training on a privately *selected* public subset instead.

The pieces live in the shared layers: the config sections in :mod:`dpsynth.diffusion.section`, the public
inputs (latent backbone, public pre-training, clip-norm probe; ``space: latent``, arXiv:2112.10752 §3-4 and
arXiv:2305.15759 §3) in :mod:`dpsynth.diffusion.public`, the model, its released state and sampling in
:mod:`dpsynth.diffusion.generation`. The names other methods import from here are re-exported (``__all__``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from dpsynth.contract import Method, Phase, PrivateNetwork, RunConfig, RunContext, Samples
from dpsynth.data.resident import ResidentRecords
from dpsynth.diffusion.generation import (
    DiffusionModelSpec,
    build_diffusion_model,
    diffusion_model_from_state,
    diffusion_model_state,
    generate_labelled,
)
from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch, resident_batch_builder
from dpsynth.diffusion.pretrain import PretrainResult, check_class_init, transfer_pretrained
from dpsynth.diffusion.public import (
    EncodedPublicSet,
    backbone_phases,
    check_latent_config,
    encode_on_backbone,
    encode_records,
    encode_train_set,
    latent_geometry,
    load_backbone,
    load_public_backbone,
    pretrain_public_model,
    public_clip_norm_schedule,
    restore_backbone,
    save_backbone,
)
from dpsynth.diffusion.section import (
    DiffusionSection,
    FineTuningSection,
    LatentPretrainedDiffusionSection,
    LatentSpaceSection,
    PretrainedDiffusionSection,
    PretrainSection,
    known_unet_keys,
    known_unet_preset,
    pretrain_settings,
    timestep_sampler,
    unet_spec,
    uses_latent_space,
)
from dpsynth.dpsgd.estimate import planned_image_geometry
from dpsynth.dpsgd.training import train_private
from dpsynth.errors import ConfigError
from dpsynth.models.backbone import Backbone
from dpsynth.models.fine_tuning import add_lora_adapters, merge_lora_adapters, select_trainable
from dpsynth.privacy.plan import PrivacyPlan
from dpsynth.privacy.record_draws import Draws
from dpsynth.seeding import stream_seed

__all__ = [
    "MECHANISM",
    "DiffusionMethod",
    "PretrainedDiffusionMethod",
    "diffusion_network",
    "apply_trainable",
    # re-exported from the shared layers for the methods that compose them
    "DiffusionSection",
    "LatentPretrainedDiffusionSection",
    "LatentSpaceSection",
    "PretrainedDiffusionSection",
    "PretrainSection",
    "PretrainResult",
    "EncodedPublicSet",
    "backbone_phases",
    "check_latent_config",
    "encode_on_backbone",
    "encode_records",
    "encode_train_set",
    "known_unet_keys",
    "known_unet_preset",
    "latent_geometry",
    "load_backbone",
    "load_public_backbone",
    "pretrain_public_model",
    "pretrain_settings",
    "public_clip_norm_schedule",
    "restore_backbone",
    "save_backbone",
    "unet_spec",
    "uses_latent_space",
]

# DP-Adam progress lives in checkpoints/dp-adam.pt; the released model is the run's released state.
MECHANISM = "dp-adam"


class DiffusionMethod(Method):
    """Shared skeleton: build a spec and an initial model, DP-Adam it with ``train_private``, release EMA weights.

    The released state (:meth:`state_dict`) is the model ``generate`` samples from (EMA weights when the section
    keeps an EMA) with its spec: ``_model`` and ``_spec`` after :meth:`fit` or :meth:`load_state_dict`, and, in
    latent space, ``_backbone``, the public backbone whose decoder maps samples to pixels.
    """

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

        def every_record() -> tuple[torch.Tensor, torch.Tensor]:
            return train.to_tensors() if latents is None else (latents, torch.from_numpy(train.labels.copy()))

        # The fixed-shape step's builder: the same inputs from the set resident on the device (copied at its
        # first step only), and the schedule's tables beside the model, so a captured step copies nothing.
        records = ResidentRecords(every_record, ctx.device)
        device_batch = resident_batch_builder(records, multiplicity, timesteps, ctx.device, **augment)
        loss_fn = make_loss_fn(schedule.to(ctx.device), kind=section.loss, vlb_weight=section.vlb_weight)
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
            device_batch=device_batch,
        )
        if backbone is not None:  # public weights: what `dpsynth generate` decodes with, whatever the cache holds
            save_backbone(ctx, backbone)
        # LoRA adapters folded into their projections: the release is a plain UNet of ``spec``.
        released = merge_lora_adapters(engine.ema_model if engine.ema_model is not None else model)
        self._model, self._spec = released.eval(), spec

    def state_dict(self) -> dict[str, Any]:
        """The released UNet: its spec and (EMA) weights; empty before :meth:`fit` (or when a subclass released
        another network instead). The public backbone of a latent-space run is in checkpoints/backbone.pt."""
        if self._model is None or self._spec is None:
            return {}
        return diffusion_model_state(self._spec, self._model)

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        """Rebuild the released UNet on ``ctx.device`` and, in latent space, the public backbone it decodes with."""
        if state:
            self._model, self._spec = diffusion_model_from_state(state, device=ctx.device)
        self._backbone = restore_backbone(ctx) if uses_latent_space(ctx.section) else None

    def generate(self, ctx: RunContext, num: int) -> Samples:
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


def apply_trainable(model: torch.nn.Module, section: FineTuningSection) -> int:
    """Add LoRA adapters (``trainable: lora``) and freeze what ``section.trainable`` keeps at its pre-trained
    value; returns the trainable parameter count."""
    if section.trainable == "lora":
        add_lora_adapters(model, section.lora_rank, section.lora_alpha)
    return select_trainable(model, section.trainable)


def _with_trainable(model: torch.nn.Module, section: FineTuningSection) -> torch.nn.Module:
    apply_trainable(model, section)
    return model
