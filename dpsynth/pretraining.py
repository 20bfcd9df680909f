"""``dpsynth pretrain CONFIG``: build a run's public pre-trained models ahead of time (docs/backbone.md).

The public phases are the long ones on a CPU and cost no privacy, so they can run once, before any run, and
go to the shared cache (:mod:`dpsynth.cache`); a run with the same public data and keys then starts its
private phase at once. This module resolves the config, loads the data exactly as the run would
(:func:`dpsynth.context.load_run_data`: the public set at the private image size and channels, refused when
it holds a private record, so the overlap check covers everything the backbone sees) and builds the
``backbone`` section's autoencoder on ``data.public``.

The private set is read only for that check and for its declared image shape; nothing derived from it is
returned or printed (the refusal names no count, :func:`dpsynth.data.loading.check_overlap`).
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
    """Build (or find in the cache) the public backbone of ``config`` (a path, a preset name such as
    ``pdp-diffusion/mnist10k_eps10``, or a resolved ``RunConfig``); one JSON-able summary per model, each with
    its cache ``path`` and whether it was ``cached`` already."""
    from dpsynth.config import load_config
    from dpsynth.context import load_run_data, resolve_device
    from dpsynth.models.backbone import check_declared_side, describe, pretrain_backbone

    if isinstance(config, (str, Path)):
        config = load_config(config, overrides)
    elif overrides:
        raise ConfigError("overrides apply to a config path or preset name, not to a resolved config")
    if not config.data.public:
        raise ConfigError(
            "data.public: the backbone is pre-trained on public data and the config names none; "
            "set data.public (e.g. --set data.public=glyphs-digits)"
        )
    if not config.backbone.cache:
        raise ConfigError("backbone.cache: false builds a backbone no run can reuse; set backbone.cache=true")
    check_declared_side(config.backbone, config.data)
    device = resolve_device(config.device)
    _, public = load_run_data(config)
    backbone = pretrain_backbone(public, config.backbone, device=device, log=log)
    return [dict(describe(backbone), public=str(config.data.public))]
