"""The method interface: what every synthesis method implements, and what the runner hands it.

A method is thin. It composes the shared layers (``dpsgd``, ``diffusion``, ``models``,
``privacy``) and never owns a private training loop, an accountant or a sampler of its own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from dpsynth.errors import ConfigError

METHODS: dict[str, type["Method"]] = {}


@dataclasses.dataclass
class Samples:
    """A labelled synthetic dataset in the ``samples.npz`` contract."""

    images: np.ndarray  # uint8 [N, H, W, C]
    labels: np.ndarray  # int64 [N]
    soft_labels: np.ndarray | None = None  # float32 [N, K]

    def __post_init__(self) -> None:
        if self.images.dtype != np.uint8 or self.images.ndim != 4:
            raise ValueError(f"samples must be uint8 [N,H,W,C], got {self.images.dtype} {self.images.shape}")
        if self.labels.shape != (len(self.images),):
            raise ValueError("one label per sample is required")
        self.labels = self.labels.astype(np.int64)
        if self.soft_labels is not None:
            self.soft_labels = self.soft_labels.astype(np.float32)


@dataclasses.dataclass
class RunContext:
    """Everything a method may touch during a run.

    ``data.train`` / ``data.val`` are private: a method reads them only inside ledger mechanisms.
    ``public`` is free to use. ``section`` is the method's own config section, defaults filled in.
    """

    config: dict[str, Any]
    section: dict[str, Any]
    run_dir: Path
    data: Any  # dpsynth.data.PrivateSplits
    public: Any  # dpsynth.data.ImageDataset | None
    ledger: Any  # dpsynth.privacy.PrivacyLedger
    device: torch.device
    seed: int
    log: Callable[[str], None]
    checkpoints: Any  # dpsynth.checkpoint.CheckpointManager
    curves: Any  # dpsynth.checkpoint.CurveLog

    @property
    def num_classes(self) -> int:
        return self.data.train.num_classes

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the private images after preprocessing."""
        return self.data.train.image_shape

    def generator(self, offset: int = 0) -> torch.Generator:
        """A generator for non-private randomness (initialisation, sampling), from the run seed."""
        return torch.Generator().manual_seed(self.seed + offset)


class Method:
    """Base class of a synthesis method; subclasses register with :func:`register_method`."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}
    # Where the paper's privacy claim or reference code is unsound and dpsynth implements the sound
    # version instead: stated in every privacy.json of the method (non-negotiable 1).
    privacy_notes: ClassVar[tuple[str, ...]] = ()

    def fit(self, ctx: RunContext) -> None:
        """Train on the private data under ``ctx.ledger``; resume from ``ctx.checkpoints`` if present."""
        raise NotImplementedError

    def generate(self, ctx: RunContext, num: int) -> Samples:
        """Return ``num`` labelled samples; public-only, so it costs no privacy."""
        raise NotImplementedError


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator adding a method to the registry under ``cls.name``."""
    if cls.name in METHODS:
        raise ValueError(f"method {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def get_method(name: str) -> type[Method]:
    """The registered method ``name``, or a ConfigError listing the known ones."""
    from dpsynth import methods  # noqa: F401  (imports every method module, filling the registry)

    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]
