"""DPDM: DP-Adam on an improved-DDPM UNet with a public adaptive clip norm and learning-rate decay.

Paper: dpdm-adaptive-clipping.txt (Chu et al., IEEE Access 2023).

* Model (§III-A): improved DDPM — cosine noise schedule, learned variance, hybrid loss
  L_hybrid = L_simple + λ L_vlb with λ = 0.001 (eq. 6-8); T = 1000 (§V-C).
* Training (Algorithm 1): DP-Adam through the shared driver :func:`dpsynth.dpsgd.training.train_private`
  (Poisson sampling, per-example clipping, Gaussian noise σ C / B, accountant), stopping at the budget.
* Adaptive clip threshold (§IV-B): before each step C is set to the average
  per-example gradient norm of a batch drawn from the *public* dataset, via
  :func:`dpsynth.dpsgd.public_clip_norm`. Public data is free, so C costs no privacy; the noise of the
  step is σ·C whatever C is, so the accounting is unchanged. Without public data C stays fixed
  (``clip_norm``) and a warning is logged. Algorithm 1 line 5 instead applies the threshold rule to
  the *private* batch, which would leak through C; that unsound variant is not offered, and
  ``privacy.json`` says so (``DPDM.privacy_notes``).
* Learning-rate decay (§IV-A): linear / exponential / logarithmic / none, exactly as printed
  (:mod:`dpsynth.dpsgd.lr_schedules`), one update per epoch of ``ceil(1/q)`` steps.

This module also holds :class:`DiffusionMethod`, the fit/generate skeleton shared with
PDP-Diffusion (``dpsynth.methods.pdp_diffusion``): both train a class-conditional UNet with DP-Adam
and release its (EMA) weights; they differ in initialisation, clipping, schedule and multiplicity.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from dpsynth.diffusion.generation import (
    DiffusionModelSpec,
    build_diffusion_model,
    generate_labelled,
    load_diffusion_model,
    save_diffusion_model,
)
from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch
from dpsynth.diffusion.schedules import MixtureOfUniformTimesteps
from dpsynth.dpsgd.lr_schedules import make_lr_schedule
from dpsynth.dpsgd.training import PrivateTraining, train_private
from dpsynth.errors import ConfigError
from dpsynth.methods.base import Method, RunContext, Samples, register_method

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
        """The network DP training starts from (random here; PDP-Diffusion pre-trains it)."""
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


# The paper's decay rates (Table 1): linear dr = 0.3, exponential dr = 0.99; logarithmic has no rate.
PAPER_DECAY_RATES = {"linear": 0.3, "exponential": 0.99}


@register_method
class DPDM(DiffusionMethod):
    name = "dpdm"
    summary = "DP-Adam on an improved-DDPM UNet (hybrid loss, learned variance, cosine schedule), public adaptive clip norm, lr decay"
    paper = "dpdm-adaptive-clipping.txt"
    privacy_notes = (
        "dpdm: the clip norm C of every step is the mean gradient norm of a PUBLIC batch (paper §IV-B), "
        "so it costs no privacy. The paper's Algorithm 1 (line 5) computes it from the private batch "
        "instead; that makes C, and so the noise scale sigma*C, a function of private examples outside "
        "the analysed mechanism, and is not implemented.",
    )
    defaults = {
        # -- model (§III-A, §V-C) --
        "model": "0.8m",  # UNet preset: 0.8m, 1.8m, 4m, 6m, 16m, 80m (dpsynth.models.unet.UNET_PRESETS)
        "unet": {},  # overrides of the preset's UNetConfig fields, e.g. {base_channels: 16, channel_mult: [1, 2]}
        "learn_sigma": True,  # learned variance (improved DDPM): the UNet outputs ε and v
        "loss": "hybrid",  # hybrid = L_simple + λ L_vlb (eq. 6) | simple (eq. 8)
        "vlb_weight": 0.001,  # λ of eq. 6
        "noise_schedule": "cosine",  # cosine (§V-C) | linear
        "timesteps": 1000,  # T (§V-C)
        "timestep_weights": [1.0],  # training t ~ Σ w_i U{l_i, u_i}; one component = uniform (the paper)
        "timestep_boundaries": [0, 1000],  # l_1, u_1 = l_2, ..., u_K on the T = 1000 scale
        "multiplicity": 1,  # K timesteps per example averaged before clipping (1 = the paper)
        "label_dropout": 0.0,  # fraction of copies trained on the null class (enables guidance)
        # -- DP-Adam (Algorithm 1) --
        "batch_size": 64,  # expected logical batch B (§V-C); q = B / N
        "physical_batch_size": 64,  # examples per vmap call (memory only, not the batch)
        "epochs": 100.0,  # §V-C "number of iterations ... 100", read as epochs
        "steps": None,  # number of DP steps; when set it overrides epochs
        "lr": 0.001,  # initial learning rate (Table 1: lr_initial = 1e-3)
        "betas": [0.9, 0.999],  # Adam (β1, β2)
        "lr_schedule": "logarithmic",  # linear | exponential | logarithmic | none (§IV-A; Table 1's best) | cosine | constant
        "lr_decay_rate": None,  # dr; null = the paper's (linear 0.3, exponential 0.99, logarithmic: formula as printed)
        "lr_decay_every": None,  # steps per decay "epoch"; null = ceil(N / B), one epoch
        "clip_norm": 1.0,  # fixed C when adaptive clipping is off or there is no public data
        "adaptive_clipping": True,  # §IV-B: C = mean per-example gradient norm of a public batch, every step
        "public_clip_batch": 64,  # public examples per clip-norm estimate
        "noise_multiplier": None,  # σ; null = calibrated so the run ends exactly at the target ε
        "ema_decay": None,  # EMA of the weights for release (the paper uses none); e.g. 0.999
        "checkpoint_every": 50,  # DP steps between checkpoints (resume granularity)
        # -- sampling --
        **SAMPLING_DEFAULTS,
    }

    def lr_lambda(self, ctx: RunContext, steps_per_epoch: int, total_steps: int) -> Callable[[int], float]:
        name = ctx.section["lr_schedule"]
        rate = ctx.section["lr_decay_rate"]
        if rate is None:
            rate = PAPER_DECAY_RATES.get(str(name).lower())
        return make_lr_schedule(name, total_steps=total_steps, steps_per_epoch=steps_per_epoch, decay_rate=rate)

    def clip_norm_fn(self, ctx: RunContext,
                     make_example_batch: Callable[..., dict[str, torch.Tensor]]) -> Callable[[int, Any], float] | None:
        if not ctx.section["adaptive_clipping"]:
            return None
        if ctx.public is None or len(ctx.public) == 0:
            ctx.log(f"warning: dpdm adaptive clipping needs public data (data.public); "
                    f"using the fixed clip_norm C={ctx.section['clip_norm']}")
            return None
        return public_clip_norm_schedule(ctx, make_example_batch, int(ctx.section["public_clip_batch"]))


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
