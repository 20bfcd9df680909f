"""Non-private pre-training of a class-conditional diffusion model on *public* data, cached on disk.

Ghalebikesabi et al. (arXiv:2302.13861) §4 ("Pre-training") and §5.2: the model is first trained without
privacy on a public dataset (ImageNet32 in the paper; ``glyphs`` or ``digits8x8`` here), then
fine-tuned with DP-Adam on the private data. Public data is free (docs/contract.md, privacy rule 4), so
this phase touches no ledger and may be shared by every run that asks for the same thing.

Cache: a finished model is stored in the shared cache of public pre-trained models
(:mod:`dpsynth.cache`) as ``<cache>/pretrained/diffusion/<key>.pt``, where ``<cache>`` is
``$DPSYNTH_CACHE`` or ``~/.cache/dpsynth`` and ``key`` hashes everything that determines the
weights — the public dataset (its spec *and* its content key, :func:`dpsynth.cache.public_content_key`,
so an edited file never hits a stale entry), the preprocessing (image shape), the model spec, the
training settings and the seed. Files are written atomically (temp file + ``os.replace``); an
interrupted pre-training resumes from ``<key>.partial.pt``.

The model is trained class-conditionally on the public labels with label dropout, so the null
class (index ``num_classes``) learns the unconditional public distribution; fine-tuning starts
every private class from that null embedding (:func:`transfer_pretrained`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dpsynth.cache import CacheEntry, Snapshots, cache_entry, load_or_build, public_content_key
from dpsynth.data.tensors import uint8_to_tensor
from dpsynth.diffusion.generation import DiffusionModelSpec, build_diffusion_model
from dpsynth.diffusion.losses import diffusion_loss, make_multiplicity_batch
from dpsynth.diffusion.schedules import build_timestep_sampler
from dpsynth.dpsgd.ema import EMA
from dpsynth.errors import ConfigError, DataError
from dpsynth.lr_schedules import make_lr_schedule

__all__ = [
    "Augment",
    "PretrainSettings",
    "Snapshots",
    "train_diffusion",
    "warm_up",
    "PretrainResult",
    "pretrain_diffusion",
    "pretrain_cache_key",
    "transfer_pretrained",
    "CLASS_INIT_MODES",
]

CACHE_FORMAT_VERSION = 3  # 2: EMA with warm-up; 3: the shared cache (dpsynth.cache), keyed by record content keys
CACHE_KIND = "diffusion"
CLASS_INIT_MODES = ("null", "mean", "names")


@dataclasses.dataclass(frozen=True)
class PretrainSettings:
    """Settings of the public pre-training (Table 3, ImageNet32 column, scaled by the presets)."""

    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-4
    warmup_steps: int = 0  # linear warm-up from 0 to lr (Table 3: 5k steps at ImageNet scale)
    ema_decay: float = 0.9999
    label_dropout: float = 0.1  # fraction of copies trained on the null class (learns p(x) too)
    loss: str = "simple"
    vlb_weight: float = 0.001
    timestep_sampler: Any = "uniform"
    flip: bool = False
    crop_padding: int = 0
    checkpoint_every: int = 500

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> PretrainSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in section.items() if k in names})


@dataclasses.dataclass
class PretrainResult:
    model: torch.nn.Module  # EMA weights, eval mode
    spec: DiffusionModelSpec
    key: str
    path: Path
    cached: bool  # True when the weights came from the cache without training


def _cache_entry(
    public: Any, public_spec: str, spec: DiffusionModelSpec, settings: PretrainSettings, seed: int
) -> CacheEntry:
    return cache_entry(
        CACHE_KIND,
        {
            "version": CACHE_FORMAT_VERSION,
            "public_spec": str(public_spec),
            "public_content": public_content_key(public),
            "image_shape": list(public.image_shape),
            "model": spec.to_dict(),
            "settings": dataclasses.asdict(settings),
            "seed": int(seed),
        },
    )


def pretrain_cache_key(
    public: Any, public_spec: str, spec: DiffusionModelSpec, settings: PretrainSettings, seed: int
) -> str:
    """Hash of (public dataset spec + content, preprocessing, model spec, settings, seed)."""
    return _cache_entry(public, public_spec, spec, settings, seed).key


def pretrain_diffusion(
    public: Any,
    spec: DiffusionModelSpec,
    settings: PretrainSettings,
    *,
    seed: int,
    public_spec: str,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] = print,
    use_cache: bool = True,
) -> PretrainResult:
    """Train (or load from the cache) a diffusion model on the public ``ImageDataset``.

    ``spec.num_classes`` must equal ``public.num_classes``: the pre-trained label space is the
    public one. Returns the EMA model on ``device``.
    """
    if public is None or len(public) == 0:
        raise DataError("pre-training needs a non-empty public dataset (data.public)")
    if spec.num_classes != public.num_classes:
        raise ConfigError(f"pre-training spec has {spec.num_classes} classes, the public data {public.num_classes}")
    if tuple(public.image_shape) != (spec.channels, spec.image_size, spec.image_size):
        raise DataError(
            f"public images {public.image_shape} do not match the model's "
            f"{(spec.channels, spec.image_size, spec.image_size)}"
        )
    entry = _cache_entry(public, public_spec, spec, settings, seed)
    started = time.time()

    def build(snapshots: Snapshots | None) -> dict[str, Any]:
        model = _train(public, spec, settings, seed, device, log, snapshots)
        return {
            "spec": spec.to_dict(),
            "settings": dataclasses.asdict(settings),
            "seed": seed,
            "public_spec": public_spec,
            "ema": model.state_dict(),
        }

    state, cached = load_or_build(entry, build, use_cache)
    if cached:
        log(f"pre-training: cache hit {entry.path}")
    elif use_cache:
        log(f"pre-training: {settings.steps} steps in {time.time() - started:.1f}s, cached at {entry.path}")
    model = build_diffusion_model(spec)
    model.load_state_dict(state["ema"])
    return PretrainResult(model.to(device).eval(), spec, entry.key, entry.path, cached=cached)


def _train(
    public: Any,
    spec: DiffusionModelSpec,
    settings: PretrainSettings,
    seed: int,
    device: torch.device | str,
    log: Callable[[str], None],
    snapshots: Snapshots | None,
) -> torch.nn.Module:
    """Plain (non-private) Adam training with EMA, linear warm-up and periodic resumable snapshots."""
    if settings.steps < 1 or settings.batch_size < 1:
        raise ConfigError("pre-training steps and batch_size must be positive")
    torch.manual_seed(seed)
    model = build_diffusion_model(spec).to(device)
    images, labels = public.to_tensors()
    return train_diffusion(
        model,
        images,
        labels,
        spec,
        settings,
        torch.Generator().manual_seed(seed + 1),
        device=device,
        log=log,
        snapshots=snapshots,
    )


#: ``augment(x0 [B, C, H, W] in [-1, 1], generator) -> [B, C, H, W]``: non-private image augmentation.
Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def train_diffusion(
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    spec: DiffusionModelSpec,
    settings: PretrainSettings,
    generator: torch.Generator,
    *,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] = print,
    augment: Augment | None = None,
    snapshots: Snapshots | None = None,
    desc: str = "pre-training",
) -> torch.nn.Module:
    """Non-private Adam training of ``model`` on ``images [N, C, H, W]`` (in [-1, 1]) and ``labels [N]``; returns
    the EMA model.

    The one non-private diffusion training loop: public pre-training (:func:`pretrain_diffusion`) and the
    warm-up on released DP statistics (DP-FETA's central images, ``dpsynth.methods.dp_feta``) both run it.
    Such data is public or a DP release, so no ledger is involved (post-processing). Each step draws a batch
    with replacement, optionally ``augment``s it, and builds one copy per image with its timestep, noise,
    flip, crop and label dropout (:func:`make_multiplicity_batch`); all draws come from ``generator``. Every
    ``settings.checkpoint_every`` steps the state (weights, EMA, optimizer, schedule, generator) goes to
    ``snapshots``, from which a restarted call resumes.
    """
    if settings.steps < 1 or settings.batch_size < 1:
        raise ConfigError(f"{desc} steps and batch_size must be positive")
    if len(images) == 0:
        raise DataError(f"{desc} needs at least one image")
    model = model.to(device)
    ema = EMA(model, settings.ema_decay)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, make_lr_schedule("constant", warmup_steps=settings.warmup_steps)
    )
    schedule = spec.schedule()
    timesteps = build_timestep_sampler(settings.timestep_sampler, spec.timesteps)
    start = 0
    snapshot = snapshots.load() if snapshots is not None else None
    if snapshot is not None:
        model.load_state_dict(snapshot["model"])
        ema.load_state_dict(snapshot["ema"])
        optimizer.load_state_dict(snapshot["optimizer"])
        scheduler.load_state_dict(snapshot["scheduler"])
        generator.set_state(snapshot["generator"])
        start = int(snapshot["step"])
        log(f"{desc}: resumed at step {start}")
    model.train()
    with tqdm(total=settings.steps, initial=start, desc=desc, unit="step", leave=False) as bar:
        for step in range(start, settings.steps):
            index = torch.randint(0, len(images), (settings.batch_size,), generator=generator)
            x0 = images[index]
            if augment is not None:
                x0 = augment(x0, generator)
            batch = make_multiplicity_batch(
                x0,
                labels[index],
                1,
                timesteps,
                generator,
                flip=settings.flip,
                crop_padding=settings.crop_padding,
                label_dropout=settings.label_dropout,
                null_label=spec.num_classes,
            )
            # One copy per image: flatten [B, 1, ...] to a plain batch (the loss averages leading dims).
            flat = {k: v.flatten(0, 1).to(device) for k, v in batch.items()}
            loss = diffusion_loss(
                model,
                flat["x0"],
                flat["label"],
                flat["t"],
                flat["noise"],
                schedule,
                kind=settings.loss,
                vlb_weight=settings.vlb_weight,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema.update(model)
            bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update(1)
            if snapshots is not None and (step + 1) % settings.checkpoint_every == 0 and step + 1 < settings.steps:
                snapshots.save(
                    {
                        "step": step + 1,
                        "model": model.state_dict(),
                        "ema": ema.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "generator": generator.get_state(),
                    }
                )
    return ema.model


def warm_up(
    ctx: Any,
    model: torch.nn.Module,
    images: np.ndarray,
    labels: np.ndarray,
    spec: DiffusionModelSpec,
    settings: PretrainSettings,
    *,
    phase: str,
    augment: Augment | None = None,
) -> torch.nn.Module:
    """``model`` trained without privacy on a DP release of uint8 ``images [N, H, W, C]`` with ``labels`` (DP-FETA's
    warm-up on its central images, Li et al., arXiv:2504.01395, §4.2), holding the EMA weights; the initial model
    of a DP fine-tuning.

    The images are a DP release, so this is post-processing: no ledger entry. Its draws come from the run's
    ``augmentation`` stream. The run's checkpoint ``phase`` holds :func:`train_diffusion`'s snapshots while it
    runs and the EMA weights once it finished (``done``), so a run resumed during the fine-tuning does not warm up
    again (the fine-tuning's own checkpoint then replaces the weights anyway).
    """
    saved = ctx.checkpoints.load(phase=phase)
    if saved is not None and saved.get("done"):
        model.load_state_dict(saved["ema"])
        ctx.log(f"{phase}: finished earlier, weights restored from the checkpoint")
        return model
    snapshots = Snapshots(
        save=lambda state: ctx.checkpoints.save(state, phase=phase), load=lambda: ctx.checkpoints.load(phase=phase)
    )
    generator = ctx.rng("augmentation")
    x0, y = uint8_to_tensor(images), torch.from_numpy(labels)
    ema = train_diffusion(
        model,
        x0,
        y,
        spec,
        settings,
        generator,
        device=ctx.device,
        log=ctx.log,
        augment=augment,
        snapshots=snapshots,
        desc=phase,
    )
    model.load_state_dict(ema.state_dict())
    ctx.checkpoints.save({"done": True, "ema": model.state_dict()}, phase=phase)
    ctx.log(f"{phase}: {settings.steps} steps on {len(images)} released images (no privacy cost)")
    return model


def transfer_pretrained(
    pretrained: torch.nn.Module,
    target: torch.nn.Module,
    class_init: str = "null",
    public_names: Sequence[str] | None = None,
    private_names: Sequence[str] | None = None,
) -> list[str]:
    """Copy pre-trained weights into ``target`` whose label space may differ; return the re-initialised keys.

    Every tensor of matching shape is copied. The class embedding (``num_classes + 1`` rows, last
    = null class) is rebuilt for the target's classes:

    * ``"null"``: each private class starts from the pre-trained *null* row, i.e. the fine-tuned
      model begins exactly as the pre-trained unconditional model and DP fine-tuning then pulls
      the classes apart;
    * ``"mean"``: each starts from the mean of the pre-trained public class rows;
    * ``"names"``: a private class whose *name* equals a public class name (digit "3" in mnist10k
      and in glyphs) starts from that public row, the others from the null row. Class names are
      dataset metadata, not private records, so this choice reads no private example and costs no
      privacy; it is the label-space analogue of the paper's public pre-training.

    The target's null row is the pre-trained null row in every mode.
    """
    if class_init not in CLASS_INIT_MODES:
        raise ConfigError(f"class_init must be one of {', '.join(CLASS_INIT_MODES)}, got {class_init!r}")
    source = pretrained.state_dict()
    state = target.state_dict()
    reinitialised = []
    for name, value in state.items():
        if name == "class_embedding.weight" and name in source:
            rows = _class_rows(source[name], value.shape[0], class_init, public_names, private_names)
            state[name] = rows.to(value.dtype)
            reinitialised.append(name)
        elif name in source and source[name].shape == value.shape:
            state[name] = source[name].clone()
        else:
            raise ConfigError(
                f"pre-trained model does not fit the target at {name!r} "
                f"({tuple(source[name].shape) if name in source else 'missing'} vs {tuple(value.shape)})"
            )
    target.load_state_dict(state)
    return reinitialised


def check_class_init(
    class_init: str,
    public_names: Sequence[str] | None,
    private_names: Sequence[str] | None,
    key: str = "class_init",
) -> None:
    """ConfigError when ``class_init: names`` cannot work: a dataset without class names (an ``.npz`` that
    declares only ``num_classes``). Methods call it before public pre-training, which it would otherwise
    follow by minutes; ``key`` is the config key to name (``pdp-diffusion.class_init``)."""
    if class_init == "names" and (public_names is None or private_names is None):
        missing = "private" if private_names is None else "public"
        raise ConfigError(
            f"{key}: names needs class names on both the public and the private dataset, and the {missing} one "
            f"has none; set {key}=null (or mean), or declare class names (a class_names array in the .npz, "
            "or one folder per class)"
        )


def _class_rows(
    pretrained_rows: torch.Tensor,
    target_rows: int,
    class_init: str,
    public_names: Sequence[str] | None,
    private_names: Sequence[str] | None,
) -> torch.Tensor:
    null_row = pretrained_rows[-1]
    start = null_row if class_init != "mean" or pretrained_rows.shape[0] == 1 else pretrained_rows[:-1].mean(0)
    rows = start.unsqueeze(0).repeat(target_rows, 1)
    if class_init == "names":
        check_class_init(class_init, public_names, private_names)
        public_row = {name: index for index, name in enumerate(public_names)}
        for index, name in enumerate(private_names):
            if name in public_row:
                rows[index] = pretrained_rows[public_row[name]]
    rows[-1] = null_row
    return rows
