"""DPDM: DP-Adam on an improved-DDPM UNet with a public adaptive clip norm and learning-rate decay.

Paper: Chu et al., *Differentially Private Denoise Diffusion Probability Models*, IEEE Access 2023 (docs/papers.md).

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
  (:mod:`dpsynth.lr_schedules`), one update per epoch of ``ceil(1/q)`` steps.

Latent space (``space: latent``; pixel space, the paper's, is the default): DP-Adam trains the UNet from scratch
on the latents of the public backbone (the run's ``backbone`` section, trained on ``data.public`` and cached;
docs/backbone.md), as in latent diffusion (arXiv:2112.10752) and DP-LDM (arXiv:2305.15759). Each private image
is encoded on its own by the frozen public encoder inside the batch builder, so the per-example sensitivity is
unchanged; the public clip-norm probe encodes its public batch with the same encoder; samples are decoded by
the public decoder (post-processing).

The fit/generate skeleton, :class:`dpsynth.methods.families.diffusion.DiffusionMethod`, is shared with
PDP-Diffusion and PrivImage: all train a class-conditional UNet with DP-Adam and release its (EMA)
weights; they differ in initialisation, clipping, schedule and multiplicity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field

from dpsynth.contract import Phase, RunConfig, RunContext, register_method
from dpsynth.lr_schedules import SCHEDULES, make_lr_schedule
from dpsynth.methods.families.diffusion import (
    DiffusionMethod,
    DiffusionSection,
    LatentSpaceSection,
    backbone_phases,
    public_clip_norm_schedule,
)

# The paper's decay rates (Table 1): linear dr = 0.3, exponential dr = 0.99; logarithmic has no rate.
PAPER_DECAY_RATES = {"linear": 0.3, "exponential": 0.99}


class DPDMConfig(DiffusionSection, LatentSpaceSection):
    """The ``dpdm`` section: the shared diffusion keys with DPDM's defaults (§III-A, §V-C, Table 1), plus
    learning-rate decay (§IV-A), the public adaptive clip norm (§IV-B) and ``space``."""

    lr_schedule: Literal[SCHEDULES] = Field(  # type: ignore[valid-type]
        "logarithmic",
        description="linear | exponential | logarithmic | none (§IV-A; Table 1's best) | cosine | constant | multistep",
    )
    lr_decay_rate: float | None = Field(
        None, gt=0, description="dr; null = the paper's (linear 0.3, exponential 0.99, logarithmic: formula as printed)"
    )
    lr_decay_every: int | None = Field(None, ge=1, description="steps per decay 'epoch'; null = ceil(N / B)")
    adaptive_clipping: bool = Field(
        True,
        description="§IV-B: C = mean per-example gradient norm of a public "
        "batch, every step; clip_norm is the fallback",
    )
    public_clip_batch: int = Field(64, ge=1, description="public examples per clip-norm estimate")


@register_method
class DPDM(DiffusionMethod):
    name = "dpdm"
    summary = (
        "DP-Adam on an improved-DDPM UNet (hybrid loss, learned variance, cosine schedule), "
        "public adaptive clip norm, lr decay"
    )
    paper = "Chu et al., Differentially Private Denoise Diffusion Probability Models, IEEE Access 2023"
    privacy_notes = (
        (
            "dpdm: the clip norm C of every step is the mean gradient norm of a PUBLIC batch (paper §IV-B), "
            "so it costs no privacy. The paper's Algorithm 1 (line 5) computes it from the private batch "
            "instead; that makes C, and so the noise scale sigma*C, a function of private examples outside "
            "the analysed mechanism, and is not implemented."
        ),
    )
    config_schema = DPDMConfig

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        adaptive = config.section.adaptive_clipping
        return backbone_phases(config) + [
            Phase(
                "dp-adam",
                private=True,
                public="optional" if adaptive else "none",
                description="public batches set the clip norm of each step (§IV-B)" if adaptive else "",
            ),
            Phase("generate", private=False),
        ]

    def lr_lambda(self, ctx: RunContext, steps_per_epoch: int, total_steps: int) -> Callable[[int], float]:
        section = ctx.section
        rate = section.lr_decay_rate
        if rate is None:
            rate = PAPER_DECAY_RATES.get(str(section.lr_schedule).lower())
        per_epoch = section.lr_decay_every or steps_per_epoch
        return make_lr_schedule(
            section.lr_schedule, total_steps=total_steps, steps_per_epoch=per_epoch, decay_rate=rate
        )

    def clip_norm_fn(
        self, ctx: RunContext, make_example_batch: Callable[..., dict[str, torch.Tensor]]
    ) -> Callable[[int, Any], float] | None:
        if not ctx.section.adaptive_clipping:
            return None
        if ctx.public is None or len(ctx.public) == 0:
            ctx.log(
                f"warning: dpdm adaptive clipping needs public data (data.public); "
                f"using the fixed clip_norm C={ctx.section.clip_norm}"
            )
            return None
        return public_clip_norm_schedule(ctx, make_example_batch, ctx.section.public_clip_batch, self._backbone)
