"""The shared diffusion-method skeletons: DP-Adam a class-conditional UNet, optionally after public pre-training.

:class:`DiffusionMethod` is the fit/generate flow of DPDM (dpdm-adaptive-clipping, Chu et al., IEEE
Access 2023) and of every method that fine-tunes a diffusion model with DP-Adam: build a spec and an
initial model, train it with :func:`dpsynth.dpsgd.training.train_private` (the only private loop),
release its (EMA) weights. :class:`PretrainedDiffusionMethod` adds the public pre-training of
PDP-Diffusion (Ghalebikesabi et al., arXiv:2302.13861, §4): the initial model is a diffusion model
trained without privacy on public data (cached, :mod:`dpsynth.diffusion.pretrain`), whose class
embedding is rebuilt for the private classes. PrivImage (Li et al., arXiv:2311.12850) reuses it,
pre-training on a privately *selected* public subset instead of the whole public set.

This module sits in the diffusion layer so that method modules compose it without importing each
other; it depends only on the method interface (:mod:`dpsynth.methods.base`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dpsynth.diffusion.generation import (
    DiffusionModelSpec,
    build_diffusion_model,
    generate_labelled,
    load_diffusion_model,
    save_diffusion_model,
)
from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch
from dpsynth.diffusion.pretrain import PretrainSettings, pretrain_diffusion, transfer_pretrained
from dpsynth.diffusion.schedules import MixtureOfUniformTimesteps
from dpsynth.dpsgd.training import PrivateTraining, train_private
from dpsynth.errors import ConfigError
from dpsynth.methods.base import Method, RunContext, Samples

# The released model lives in checkpoints/final.pt; DP-Adam progress in checkpoints/dp-adam.pt.
FINAL_PHASE = "final"
MECHANISM = "dp-adam"

# Sampling keys shared by every diffusion method's section (documented in each `defaults`).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "sampler": "ddim",  # ddim | ddpm (ancestral; with learn_sigma it uses the learned variance)
    "sample_steps": 100,  # denoising steps; the schedule is respaced (improved DDPM §4); null = all T
    "eta": 0.0,  # DDIM stochasticity (0 = deterministic)
    "guidance": 0.0,  # classifier-free guidance scale w; > 0 needs label_dropout > 0 in training
    "variance": None,  # DDPM variance: learned | fixed_small | fixed_large; null = learned if learn_sigma
}


class DiffusionMethod(Method):
    """Shared skeleton: build a spec and an initial model, DP-Adam it with ``train_private``, release EMA weights."""

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._spec: DiffusionModelSpec | None = None

    # -- hooks for subclasses ------------------------------------------------------------------
    def initial_model(self, ctx: RunContext, spec: DiffusionModelSpec) -> torch.nn.Module:
        """The network DP training starts from (random here; :class:`PretrainedDiffusionMethod` pre-trains it)."""
        torch.manual_seed(ctx.seed)
        return build_diffusion_model(spec)

    def lr_lambda(self, ctx: RunContext, steps_per_epoch: int, total_steps: int) -> Callable[[int], float] | None:
        return None

    def clip_norm_fn(self, ctx: RunContext,
                     make_example_batch: Callable[..., dict[str, torch.Tensor]]) -> Callable[[int, Any], float] | None:
        return None

    def augmentation(self, section: dict[str, Any]) -> dict[str, Any]:
        """Keyword options of :func:`make_multiplicity_batch` (flip, crop) for the private batches."""
        return {}

    # -- shared flow ---------------------------------------------------------------------------
    def model_spec(self, ctx: RunContext) -> DiffusionModelSpec:
        section = ctx.section
        channels, height, width = ctx.image_shape
        if height != width:
            raise ConfigError(f"{self.name} needs square images, got {height}x{width}")
        if section["loss"] == "hybrid" and not section["learn_sigma"]:
            raise ConfigError(f"{self.name}: loss 'hybrid' needs learn_sigma: true (improved DDPM)")
        model = {"preset": section["model"], **section["unet"]} if section["unet"] else section["model"]
        return DiffusionModelSpec(model=model, image_size=height, channels=channels,
                                  num_classes=ctx.num_classes, learn_sigma=bool(section["learn_sigma"]),
                                  noise_schedule=section["noise_schedule"], timesteps=int(section["timesteps"]))

    def fit(self, ctx: RunContext) -> None:
        section = ctx.section
        spec = self.model_spec(ctx)
        model = self.initial_model(ctx, spec).to(ctx.device).train()
        schedule = spec.schedule()
        timesteps = timestep_sampler(section, spec.timesteps)
        multiplicity = int(section["multiplicity"])
        augment = dict(self.augmentation(section), label_dropout=float(section["label_dropout"]),
                       null_label=spec.num_classes)
        images, labels = ctx.data.train.to_tensors()

        def make_example_batch(x0: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
            # An empty Poisson batch (len(x0) == 0) yields empty tensors of the right trailing shapes.
            return make_multiplicity_batch(x0, y, multiplicity, timesteps, generator, **augment)

        def make_batch(indices: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
            return make_example_batch(images[indices], labels[indices], generator)

        loss_fn = make_loss_fn(schedule, kind=section["loss"], vlb_weight=float(section["vlb_weight"]))
        # `steps`, when set, overrides `epochs` (so a preset can switch with one key).
        epochs = None if section["steps"] is not None else section["epochs"]
        settings = PrivateTraining.from_section(dict(section, optimizer="adam", max_grad_norm=section["clip_norm"],
                                                     epochs=epochs))
        num_examples = len(ctx.data.train)
        if not 0 < settings.batch_size <= num_examples:
            raise ConfigError(f"{self.name}: batch_size must be in [1, {num_examples}], got {settings.batch_size}")
        total = settings.total_steps(num_examples)
        per_epoch = int(section.get("lr_decay_every") or math.ceil(num_examples / settings.batch_size))
        engine = train_private(
            ctx, model, loss_fn, make_batch, num_examples, settings, mechanism=MECHANISM,
            lr_lambda=self.lr_lambda(ctx, per_epoch, total),
            clip_norm_fn=self.clip_norm_fn(ctx, make_example_batch),
            desc=self.name,
        )
        save_diffusion_model(ctx.checkpoints, spec, model, engine.ema_model, phase=FINAL_PHASE)
        self._model = (engine.ema_model if engine.ema_model is not None else model).eval()
        self._spec = spec

    def generate(self, ctx: RunContext, num: int) -> Samples:
        if self._model is None or self._spec is None:  # a fresh process (dpsynth generate)
            self._model, self._spec = load_diffusion_model(ctx.checkpoints, FINAL_PHASE, device=ctx.device)
        return self.sample(ctx, self._model, self._spec, num)

    def sample(self, ctx: RunContext, model: torch.nn.Module, spec: DiffusionModelSpec, num: int) -> Samples:
        """``num`` balanced samples from ``model`` with the section's sampler (any model of ``spec``)."""
        section = ctx.section
        images, labels = generate_labelled(
            model, spec.schedule(), num, spec.num_classes, (spec.channels, spec.image_size, spec.image_size),
            sampler=section["sampler"], sample_steps=section["sample_steps"], eta=float(section["eta"]),
            guidance=float(section["guidance"]), variance=section["variance"],
            batch_size=int(ctx.config["generate"]["batch_size"]), seed=ctx.seed + 17, device=ctx.device)
        return Samples(images=images, labels=labels)


def timestep_sampler(section: dict[str, Any], num_timesteps: int) -> MixtureOfUniformTimesteps:
    """t ~ Σ w_i U{l_i, u_i} from ``timestep_weights`` / ``timestep_boundaries`` (uniform = one component)."""
    return MixtureOfUniformTimesteps(section["timestep_weights"], section["timestep_boundaries"],
                                     num_timesteps=num_timesteps)




class PretrainedDiffusionMethod(DiffusionMethod):
    """PDP-Diffusion's flow: non-private pre-training on public data, then DP-Adam fine-tuning.

    The section carries PDP-Diffusion's keys (``flip``, ``crop_padding``, ``class_init`` and a
    ``pretrain`` sub-section). Subclasses choose the pre-training data with :meth:`pretraining_data`
    (PrivImage: the privately selected public subset); everything else is shared.
    """

    def augmentation(self, section: dict[str, Any]) -> dict[str, Any]:
        return {"flip": bool(section["flip"]), "crop_padding": int(section["crop_padding"])}

    def pretraining_data(self, ctx: RunContext) -> tuple[Any, str] | None:
        """``(public ImageDataset, cache spec string)`` to pre-train on, or None to train from scratch."""
        if ctx.public is None:
            return None
        return ctx.public, str(ctx.config["data"]["public"])

    def label_transfer(self, ctx: RunContext, public: Any) -> tuple[str, list[str] | None, list[str] | None]:
        """``(class_init, public names, private names)`` for :func:`transfer_pretrained`."""
        return ctx.section["class_init"], public.class_names, ctx.data.train.class_names

    def initial_model(self, ctx: RunContext, spec: DiffusionModelSpec) -> torch.nn.Module:
        pretrain = ctx.section["pretrain"]
        source = self.pretraining_data(ctx) if pretrain["enabled"] else None
        if source is None:
            if pretrain["enabled"]:
                ctx.log(f"warning: {self.name} has no public data (data.public is null): training from scratch")
            return super().initial_model(ctx, spec)
        public, public_spec = source
        result = pretrain_diffusion(public, DiffusionModelSpec(**dict(spec.to_dict(), num_classes=public.num_classes)),
                                    pretrain_settings(ctx.section), seed=ctx.seed, public_spec=public_spec,
                                    device=ctx.device, log=ctx.log, use_cache=bool(pretrain["cache"]))
        class_init, public_names, private_names = self.label_transfer(ctx, public)
        matched = len(set(public_names or ()) & set(private_names or ()))
        ctx.log(f"pre-trained model {result.key} ({'cache hit' if result.cached else 'trained'}); "
                f"class embedding: {public.num_classes} public -> {spec.num_classes} private classes "
                f"(init: {class_init}; {matched} class names shared)")
        torch.manual_seed(ctx.seed)
        model = build_diffusion_model(spec)
        transfer_pretrained(result.model.cpu(), model, class_init, public_names, private_names)
        return model


def pretrain_settings(section: dict[str, Any]) -> PretrainSettings:
    """The :class:`PretrainSettings` of a section's ``pretrain`` sub-section (loss keys from the section)."""
    pretrain = section["pretrain"]
    return PretrainSettings(
        steps=int(pretrain["steps"]), batch_size=int(pretrain["batch_size"]), lr=float(pretrain["lr"]),
        warmup_steps=int(pretrain["warmup_steps"]), ema_decay=float(pretrain["ema_decay"]),
        label_dropout=float(pretrain["label_dropout"]), loss=section["loss"],
        vlb_weight=float(section["vlb_weight"]),
        timestep_sampler={"kind": "mixture", "weights": list(pretrain["timestep_weights"]),
                          "boundaries": list(pretrain["timestep_boundaries"])},
        flip=bool(pretrain["flip"]), crop_padding=int(pretrain["crop_padding"]),
        checkpoint_every=int(pretrain["checkpoint_every"]))


def public_clip_norm_schedule(ctx: RunContext, make_example_batch: Callable[..., dict[str, torch.Tensor]],
                              batch: int) -> Callable[[int, Any], float]:
    """``(step, engine) -> C``: the mean per-example gradient norm on a fresh public batch (§IV-B).

    The public batch goes through the same K-copy construction as the private one. Its labels are
    the public labels when the label spaces agree; otherwise (e.g. 62 glyph classes vs 10 digits)
    each public image gets a label drawn uniformly from the private classes — only the norm scale
    matters here. Draws are seeded by (run seed, step), so a resumed run sees the same C.
    """
    from dpsynth.dpsgd import public_clip_norm

    public_images, public_labels = ctx.public.to_tensors()
    same_labels = ctx.public.num_classes == ctx.num_classes
    def clip_norm(step: int, engine: Any) -> float:
        generator = torch.Generator().manual_seed(ctx.seed * 1_000_003 + 7919 * step + 13)
        index = torch.randint(0, len(public_images), (batch,), generator=generator)
        labels = public_labels[index] if same_labels else torch.randint(0, ctx.num_classes, (batch,), generator=generator)
        return public_clip_norm(engine, make_example_batch(public_images[index], labels, generator))

    return clip_norm
