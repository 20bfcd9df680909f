"""Pre-training on the privately selected public subset (Li et al., PrivImage, arXiv:2311.12850, §3.3, §4.4).

PrivImage+D pre-trains its diffusion model on :meth:`dpsynth.selection.pipeline.SelectionResult.pretraining_data`
through the diffusion family's pre-training hook; PrivImage+G pre-trains its conditional GAN here
(:func:`pretrain_gan_on_selection`). Both read public images and the released selection only, so they cost no
privacy; the cache key names the selection.
"""

from __future__ import annotations

from typing import Any

import torch

from dpsynth.models.gan import GANPretrainSettings, GANSpec, warm_start_gan
from dpsynth.selection.pipeline import SelectionResult


def pretrain_gan_on_selection(
    ctx: Any,
    result: SelectionResult,
    spec: GANSpec,
    settings: GANPretrainSettings,
    nets: tuple[torch.nn.Module, torch.nn.Module],
    *,
    use_cache: bool = True,
) -> None:
    """Pre-train (non-private, cached) a GAN of ``spec`` on the selected subset, in the subset's label space, and
    copy it into the fresh ``nets`` (generator, discriminator) of the run's label space
    (:func:`dpsynth.models.gan.transfer_gan`)."""
    subset, subset_spec = result.pretraining_data(str(ctx.config.data.public))
    warm_start_gan(
        nets,
        subset,
        spec,
        settings,
        seed=ctx.seed,
        public_spec=subset_spec,
        device=ctx.device,
        use_cache=use_cache,
        log=ctx.log,
    )
