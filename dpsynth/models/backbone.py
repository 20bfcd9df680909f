"""The public pre-trained latent backbone: a KL autoencoder trained on public data only, cached.

DP-LDM (Liu et al., TMLR 2024, arXiv:2305.15759, §3 and §4 "public pre-training") and the latent diffusion
methods built on it train in the latent space of an autoencoder pre-trained on a *public* set and frozen
afterwards. Public data is free (docs/contract.md, privacy rule 4), so this module touches no ledger; it
must never see a private record (the run's overlap check refuses a public set that holds one,
:func:`dpsynth.data.loading.check_overlap`). The trained weights go to the shared cache of public
pre-trained models (:mod:`dpsynth.cache`), keyed by the public set's content and this section, so every
run with the same public data and the same ``backbone`` keys reuses one build (docs/backbone.md).

Training (Rombach et al., arXiv:2112.10752, §3.1, reduced to a CPU): Adam on the pixel MSE of the
reconstruction from a *sampled* latent plus ``kl_weight`` times the KL to N(0, I), batches drawn with
replacement from the public set, cosine learning-rate decay. After training, the latents are rescaled by
the inverse standard deviation of the public latents (LDM's ``scale_factor``, appendix G), so a diffusion
model sees roughly unit-variance inputs; that statistic is computed on public data only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from tqdm.auto import tqdm

from dpsynth.cache import Snapshots, cache_entry, load_or_build, public_content_key
from dpsynth.errors import DataError
from dpsynth.lr_schedules import make_lr_schedule
from dpsynth.models.autoencoder import AutoencoderConfig, KLAutoencoder, kl_divergence
from dpsynth.schema import Section

__all__ = [
    "BackboneSection",
    "Backbone",
    "pretrain_backbone",
    "train_autoencoder",
    "latent_scale",
    "reconstruction_mse",
    "mean_image_mse",
    "describe",
    "backbone_state",
    "backbone_from_state",
    "check_declared_side",
]

CACHE_KIND = "autoencoder"
#: public images whose latents set the latent scale (a fixed prefix of the public set: deterministic)
SCALE_SAMPLE = 1024


class BackboneSection(Section):
    """The ``backbone`` section: the public latent backbone that latent-space methods encode and decode with."""

    autoencoder: AutoencoderConfig = Field(default_factory=AutoencoderConfig, description="the architecture")
    steps: int = Field(1000, ge=1, description="Adam steps of the public pre-training")
    batch_size: int = Field(32, ge=1, description="public images per step (drawn with replacement)")
    lr: float = Field(0.002, gt=0, description="Adam learning rate, decayed by a cosine to a tenth")
    kl_weight: float = Field(
        1e-4, ge=0, description="weight of the KL to N(0, I) per latent element against the per-pixel MSE"
    )
    seed: int = Field(
        0, ge=0, description="seed of the public pre-training (apart from the run seed: runs of any seed share it)"
    )
    checkpoint_every: int = Field(250, ge=1, description="steps between resumable snapshots in the cache")
    cache: bool = Field(True, description="reuse / store the backbone in $DPSYNTH_CACHE or ~/.cache/dpsynth")


@dataclasses.dataclass
class Backbone:
    """A frozen, pre-trained autoencoder and the scale of its latents; what a latent-space method holds."""

    autoencoder: KLAutoencoder
    latent_scale: float
    image_shape: tuple[int, int, int]
    key: str
    path: Path
    cached: bool  # True when the weights came from the cache without training

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return self.autoencoder.config.latent_shape(self.image_shape)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, C, H, W]`` in [-1, 1] → scaled posterior means ``[B, *latent_shape]``.

        One image's latent depends on that image alone (no batch statistics: GroupNorm is per example),
        so encoding private records one by one leaves DP-SGD's per-example sensitivity unchanged.
        """
        mean, _ = self.autoencoder.encode(images)
        return mean * self.latent_scale

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents ``[B, *latent_shape]`` → images ``[B, C, H, W]`` clamped to [-1, 1]."""
        return self.autoencoder.decode(latents / self.latent_scale).clamp(-1.0, 1.0)

    def to(self, device: torch.device | str) -> Backbone:
        self.autoencoder.to(device)
        return self


def pretrain_backbone(
    public: Any,
    section: BackboneSection,
    *,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] = print,
) -> Backbone:
    """Train (or load from the cache) the autoencoder of ``section`` on the public ``ImageDataset`` ``public``.

    The cache key hashes the public set's content (:func:`dpsynth.cache.public_content_key`) and every key of
    ``section`` that shapes the weights, so a changed public set or config builds anew. Returns the frozen
    backbone on ``device``.
    """
    if public is None or len(public) == 0:
        raise DataError("the backbone needs a non-empty public dataset (data.public)")
    image_shape = tuple(int(s) for s in public.image_shape)
    section.autoencoder.latent_shape(image_shape)  # a side f does not divide fails before any training
    entry = cache_entry(
        CACHE_KIND,
        {
            "public_content": public_content_key(public),
            "image_shape": list(image_shape),
            "section": section.model_dump(exclude={"cache", "checkpoint_every"}),
        },
    )
    started = time.time()

    def build(snapshots: Snapshots | None) -> dict[str, Any]:
        torch.manual_seed(section.seed)
        model = KLAutoencoder(image_shape[0], section.autoencoder)
        images, _ = public.to_tensors()
        generator = torch.Generator().manual_seed(section.seed + 1)
        train_autoencoder(model, images, section, generator, device=device, snapshots=snapshots)
        return {
            "image_shape": list(image_shape),
            "section": section.model_dump(),
            "autoencoder": {k: v.cpu() for k, v in model.state_dict().items()},
            "latent_scale": latent_scale(model, images[:SCALE_SAMPLE], device),
        }

    state, cached = load_or_build(entry, build, section.cache)
    if cached:
        log(f"backbone: cache hit {entry.path}")
    else:
        where = f", cached at {entry.path}" if section.cache else " (not cached: backbone.cache is false)"
        log(f"backbone: {section.steps} steps on {len(public)} public images in {time.time() - started:.1f}s{where}")
    model = KLAutoencoder(image_shape[0], section.autoencoder)
    model.load_state_dict(state["autoencoder"])
    model.requires_grad_(False)
    backbone = Backbone(model.eval(), float(state["latent_scale"]), image_shape, entry.key, entry.path, cached)
    return backbone.to(device)


def train_autoencoder(
    model: KLAutoencoder,
    images: torch.Tensor,
    section: BackboneSection,
    generator: torch.Generator,
    *,
    device: torch.device | str = "cpu",
    snapshots: Snapshots | None = None,
    desc: str = "backbone",
) -> KLAutoencoder:
    """Non-private Adam training of ``model`` on public ``images [N, C, H, W]`` in [-1, 1], with a progress bar.

    Each step draws ``batch_size`` images with replacement and the latent noise from ``generator``; every
    ``checkpoint_every`` steps the state (weights, optimizer, schedule, generator) goes to ``snapshots``, from
    which a restarted call resumes where it stopped.
    """
    if len(images) == 0:
        raise DataError(f"{desc} needs at least one public image")
    model = model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=section.lr)
    schedule = make_lr_schedule("cosine", total_steps=section.steps, final=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    start = _resume(snapshots, model, optimizer, scheduler, generator)
    latent_shape = section.autoencoder.latent_shape(images.shape[1:])
    with tqdm(total=section.steps, initial=start, desc=desc, unit="step", leave=False) as bar:
        for step in range(start, section.steps):
            index = torch.randint(0, len(images), (section.batch_size,), generator=generator)
            noise = torch.randn((section.batch_size, *latent_shape), generator=generator)
            batch = images[index].to(device)
            reconstruction, mean, logvar = model(batch, noise.to(device))
            loss = F.mse_loss(reconstruction, batch) + section.kl_weight * kl_divergence(mean, logvar)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            bar.set_postfix(loss=f"{loss.item():.4f}")  # public data: free to show
            bar.update(1)
            if snapshots is not None and (step + 1) % section.checkpoint_every == 0 and step + 1 < section.steps:
                snapshots.save(
                    {
                        "step": step + 1,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "generator": generator.get_state(),
                    }
                )
    return model.eval()


def _resume(
    snapshots: Snapshots | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generator: torch.Generator,
) -> int:
    """The step to start from: 0, or the step of the last snapshot, whose state is restored."""
    snapshot = snapshots.load() if snapshots is not None else None
    if snapshot is None:
        return 0
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    scheduler.load_state_dict(snapshot["scheduler"])
    generator.set_state(snapshot["generator"])
    return int(snapshot["step"])


@torch.no_grad()
def latent_scale(model: KLAutoencoder, public_images: torch.Tensor, device: torch.device | str = "cpu") -> float:
    """1 / std of the posterior means of ``public_images`` (LDM's ``scale_factor``); 1 when they do not vary."""
    model.eval()
    means = torch.cat([model.encode(chunk.to(device))[0].cpu() for chunk in public_images.split(256)])
    std = float(means.std())
    return 1.0 / std if std > 0 else 1.0


@torch.no_grad()
def reconstruction_mse(
    model: KLAutoencoder, images: torch.Tensor, device: torch.device | str = "cpu", batch: int = 256
) -> float:
    """Mean squared error per pixel (in the [-1, 1] scale) of decoding the posterior means of ``images``."""
    model.eval()
    total = 0.0
    for chunk in images.split(batch):
        chunk = chunk.to(device)
        reconstruction, _, _ = model(chunk)
        total += float(F.mse_loss(reconstruction.clamp(-1, 1), chunk, reduction="sum"))
    return total / images.numel()


def mean_image_mse(train_images: torch.Tensor, test_images: torch.Tensor) -> float:
    """The trivial baseline: MSE per pixel of predicting every test image by the mean training image."""
    return float(F.mse_loss(train_images.mean(0, keepdim=True).expand_as(test_images), test_images))


def backbone_state(backbone: Backbone) -> dict[str, Any]:
    """What a run stores beside its released model to decode in a fresh process (public weights, no cache)."""
    return {
        "autoencoder_config": backbone.autoencoder.config.model_dump(),
        "image_shape": list(backbone.image_shape),
        "autoencoder": {k: v.cpu() for k, v in backbone.autoencoder.state_dict().items()},
        "latent_scale": backbone.latent_scale,
        "key": backbone.key,
        "path": str(backbone.path),
    }


def backbone_from_state(state: dict[str, Any], device: torch.device | str = "cpu") -> Backbone:
    """The :class:`Backbone` that :func:`backbone_state` stored."""
    image_shape = tuple(int(s) for s in state["image_shape"])
    model = KLAutoencoder(image_shape[0], AutoencoderConfig.model_validate(state["autoencoder_config"]))
    model.load_state_dict(state["autoencoder"])
    model.requires_grad_(False)
    backbone = Backbone(
        model.eval(), float(state["latent_scale"]), image_shape, state["key"], Path(state["path"]), True
    )
    return backbone.to(device)


def check_declared_side(section: BackboneSection, data: Any) -> None:
    """The backbone's downsampling against the image side that ``data`` (a ``DataSection``) declares through
    ``image_size`` or the registered private dataset's shape: a ConfigError naming
    ``backbone.autoencoder.channel_mult`` before any data is read. A side known only from the files is
    checked once they are loaded (:func:`pretrain_backbone`)."""
    from dpsynth.data.registry import resolve

    side = data.image_size
    if side is None:
        try:
            entry = resolve(data.private)[3]
        except DataError:  # a missing path: loading the data says so in its own words
            entry = None
        side = None if entry is None else entry.info.shape[0]
    if side is not None:
        section.autoencoder.latent_shape((1, side, side))


def describe(backbone: Backbone) -> dict[str, Any]:
    """A JSON-able summary of a backbone (for ``dpsynth pretrain --json`` and the logs)."""
    parameters = sum(p.numel() for p in backbone.autoencoder.parameters())
    return {
        "kind": CACHE_KIND,
        "key": backbone.key,
        "path": str(backbone.path),
        "cached": backbone.cached,
        "image_shape": list(backbone.image_shape),
        "latent_shape": list(backbone.latent_shape),
        "parameters": parameters,
        "latent_scale": backbone.latent_scale,
    }
