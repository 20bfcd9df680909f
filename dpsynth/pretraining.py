"""``dpsynth pretrain CONFIG``: build a run's public pre-trained models ahead of time (docs/backbone.md).

The public phases are the long ones on a CPU and cost no privacy, so they can run once, before any run, and
go to the shared cache (:mod:`dpsynth.cache`); a run with the same public data and keys then starts its
private phase at once. This module resolves the config, loads the data exactly as the run would
(:func:`dpsynth.context.load_run_data`: the public set at the private image size and channels, refused when
it holds a private record, so the overlap check covers everything the public models see) and builds the
``backbone`` section's autoencoder and the method's own public pre-training on ``data.public``.

The private set is read only for that check and for its declared image shape and class count; nothing
derived from its values is returned or printed (the refusal names no count, :func:`dpsynth.data.loading.check_overlap`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpsynth.errors import ConfigError

__all__ = ["pretrain"]


def pretrain(
    config: str | Path | Any,
    overrides: list[str] | dict[str, Any] | None = None,
    *,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Build (or find in the cache) the public models of ``config`` (a path, a preset name such as
    ``pdp-diffusion/mnist10k_eps10``, or a resolved ``RunConfig``); one JSON-able summary per model, each with
    its cache ``path`` and whether it was ``cached`` already.

    The models: the ``backbone`` section's autoencoder when the run reads it (:func:`_wants_backbone`); then the
    method's own public pre-training when it reads only ``data.public`` and is enabled (PDP-Diffusion's diffusion model,
    in latent space with ``space: latent``; Private Evolution's API model, through its ``pretrain_public_api``; the
    GAN of dp-gan and gs-wgan with ``pretrain_steps``). PrivImage's pre-training needs its DP selection first and is
    left to the run.
    """
    from dpsynth.config import load_config
    from dpsynth.context import load_run_data, resolve_device
    from dpsynth.models.backbone import check_declared_side, pretrain_backbone

    if isinstance(config, (str, Path)):
        config = load_config(config, overrides)
    elif overrides:
        raise ConfigError("overrides apply to a config path or preset name, not to a resolved config")
    if not config.data.public:
        raise ConfigError(
            "data.public: the public models are pre-trained on public data and the config names none; "
            "set data.public (e.g. --set data.public=glyphs-digits)"
        )
    wants_backbone = _wants_backbone(config)
    if wants_backbone:
        if not config.backbone.cache:
            raise ConfigError("backbone.cache: false builds a backbone no run can reuse; set backbone.cache=true")
        check_declared_side(config.backbone, config.data)
    device = resolve_device(config.device)
    splits, public = load_run_data(config)
    backbone = pretrain_backbone(public, config.backbone, device=device, log=log) if wants_backbone else None
    built = [] if backbone is None else [_backbone_summary(backbone, config)]
    diffusion = _pretrain_diffusion(config, public, splits.train, backbone, device, log)
    gan = _pretrain_gan(config, public, splits.train, device, log)
    return built + [model for model in (diffusion, gan) if model is not None]


def _wants_backbone(config: Any) -> bool:
    """Whether the run reads the shared backbone, as its method declares: a latent-space run lists the backbone
    among its phases (``backbone_phases``); Private Evolution's API model (``pretrain_public_api``) is trained on
    the backbone's latents. Other runs (pixel space, the kernel, GAN and classifier methods) read none."""
    from dpsynth.diffusion.public import BACKBONE_PHASE
    from dpsynth.methods import get_method

    method_class = get_method(config.method)
    declared = {phase.name for phase in method_class.phases(config)}
    return BACKBONE_PHASE in declared or hasattr(method_class, "pretrain_public_api")


def _backbone_summary(backbone: Any, config: Any) -> dict[str, Any]:
    from dpsynth.models.backbone import describe

    return dict(describe(backbone), public=str(config.data.public))


def _pretrain_diffusion(
    config: Any, public: Any, train: Any, backbone: Any, device: Any, log: Callable[[str], None]
) -> dict[str, Any] | None:
    """The method's public diffusion pre-training, when it has one that ``dpsynth pretrain`` can build."""
    from dpsynth.methods import get_method
    from dpsynth.methods.families.diffusion import PretrainedDiffusionMethod, pretrain_public_model

    method_class = get_method(config.method)
    section = config.section
    own = getattr(method_class, "pretrain_public_api", None)  # a method whose public model is not a fine-tuning start
    if own is not None:
        if not section.pretrain.cache:
            return None
        result = own(config, public, backbone, device=device, log=log)
    else:
        if not issubclass(method_class, PretrainedDiffusionMethod) or not method_class.pretrains_on_the_public_set():
            return None
        if not section.pretrain.enabled or not section.pretrain.cache:
            return None
        method = method_class()
        # The private model's spec needs the declared image shape and class count, not a private value.
        spec = method.spec_for(config, train.image_shape, train.num_classes)
        result = pretrain_public_model(config, public, str(config.data.public), spec, backbone, device=device, log=log)
    return {
        "kind": "diffusion",
        "key": result.key,
        "path": str(result.path),
        "cached": result.cached,
        "image_shape": [result.spec.channels, result.spec.image_size, result.spec.image_size],
        "parameters": sum(p.numel() for p in result.model.parameters()),
        "public": str(config.data.public),
    }


def _pretrain_gan(
    config: Any, public: Any, train: Any, device: Any, log: Callable[[str], None]
) -> dict[str, Any] | None:
    """The public GAN of a GAN-family method with ``pretrain_steps`` (dp-gan, gs-wgan), in the public set's label
    space, as the run's :func:`dpsynth.methods.families.gan.pretrain_on_public` reads it from the cache."""
    import dataclasses

    from dpsynth.methods import get_method
    from dpsynth.methods.families.gan import GANMethod, PublicGANPretraining
    from dpsynth.models.gan import gan_cache_path, pretrain_gan

    method_class, section = get_method(config.method), config.section
    if not issubclass(method_class, GANMethod) or not isinstance(section, PublicGANPretraining):
        return None
    if not section.pretrain_steps or not section.cache:
        return None
    # The declared image shape and class count, not a private value; the GAN in the public set's label space.
    spec = method_class.spec_for(section, train.image_shape, train.num_classes)
    spec = dataclasses.replace(spec, num_classes=public.num_classes)
    settings, keys = section.pretrain_settings(), {"seed": config.seed, "public_spec": str(config.data.public)}
    path = gan_cache_path(public, spec, settings, **keys)
    cached = path.exists()
    generator, _ = pretrain_gan(public, spec, settings, device=device, log=log, **keys)
    return {
        "kind": "gan",
        "path": str(path),
        "cached": cached,
        "image_shape": [spec.channels, spec.image_size, spec.image_size],
        "parameters": sum(p.numel() for p in generator.parameters()),
        "public": str(config.data.public),
    }
