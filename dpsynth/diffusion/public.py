"""The public inputs of a diffusion run: the latent backbone, the cached public pre-training, the clip-norm probe.

Latent space (``space: latent``; Rombach et al., arXiv:2112.10752, §3-4, and DP-LDM, arXiv:2305.15759, §3): a
diffusion model is trained, pre-trained and sampled in the latent space of the public backbone
(:mod:`dpsynth.models.backbone`, the run's ``backbone`` section, cached). Each private image is encoded on its own
by the frozen public encoder (:func:`encode_train_set`, :func:`encode_records`), so a record's training inputs
still depend on that record alone and the DP-SGD sensitivity stays C; samples are decoded by the public decoder
(post-processing). The public pre-training (:func:`pretrain_public_model`; PDP-Diffusion, arXiv:2302.13861, §4)
encodes the public set with the same encoder (:class:`EncodedPublicSet`). :func:`public_clip_norm_schedule` is
DPDM's adaptive clip norm from public batches (Chu et al., IEEE Access 2023, §IV-B).

These helpers serve the diffusion skeletons (:mod:`dpsynth.methods.families.diffusion`) and the methods with their
own flow (DPPM's score model, Private Evolution's public model). Everything here reads public data only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpsynth.contract import Phase, RunConfig, RunContext
from dpsynth.diffusion.generation import DiffusionModelSpec
from dpsynth.diffusion.pretrain import PretrainResult, pretrain_diffusion
from dpsynth.diffusion.section import pretrain_settings, uses_latent_space
from dpsynth.dpsgd.clip_norm import public_clip_norm
from dpsynth.errors import DPSynthError
from dpsynth.models.backbone import (
    Backbone,
    backbone_from_state,
    backbone_state,
    check_declared_side,
    pretrain_backbone,
)

# A latent-space run stores the public backbone it decodes with in checkpoints/backbone.pt.
BACKBONE_PHASE = "backbone"


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
