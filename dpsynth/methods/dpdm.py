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

The fit/generate skeleton, :class:`dpsynth.diffusion.method.DiffusionMethod`, is shared with
PDP-Diffusion and PrivImage: all train a class-conditional UNet with DP-Adam and release its (EMA)
weights; they differ in initialisation, clipping, schedule and multiplicity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpsynth.diffusion.method import SAMPLING_DEFAULTS, DiffusionMethod, public_clip_norm_schedule
from dpsynth.dpsgd.lr_schedules import make_lr_schedule
from dpsynth.methods.base import RunContext, register_method

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

