"""The method contract: what every synthesis method declares and implements, and what the runner hands it.

A method is thin. It composes the shared layers (``dpsgd``, ``diffusion``, ``models``,
``privacy``) and never owns a private training loop, an accountant or a sampler of its own.
The contract (docs/architecture.md, "The method contract"):

* ``name``, ``config_schema`` (a pydantic model of its config section; ``defaults`` derives from it),
  ``releases`` (``"samples"`` or ``"model"``), ``privacy_notes``;
* ``phases(config)``: the phases of a run, whether each reads private data, and which public data it needs;
* ``plan(config, num_examples)``: every mechanism the run will spend, from the config and N only;
* ``fit(ctx)``: spend exactly that plan (``ctx.plan``), resuming from ``ctx.checkpoints``
  (:meth:`RunContext.resume` is the one check of the ledger against a checkpoint);
* ``state_dict()`` / ``load_state_dict(state, ctx)``: the released state ``generate`` reads. The runner
  checkpoints it after ``fit`` (phase :data:`RELEASED_PHASE`) and restores it in a resumed run that had
  finished training and in every later process (``dpsynth generate``, evaluate, audit), so no method reloads
  its own state;
* ``generate(ctx, num)``: labelled samples, at no privacy cost;
* ``evaluation_protocol(config)``: how its release is scored downstream (:class:`EvaluationProtocol`; the
  default trains classifiers on hard labels and selects the epoch on held-out synthetic data);
* optional: ``check_config`` (cross-section checks at load), ``ledger_guarantee`` (``"none"`` only for a
  paper's explicitly unsound opt-in, whose ledger and plan claim no ε), ``released_metrics`` (a method that
  releases a model), ``example_losses`` (the audit's loss attack on a released model), ``private_networks``
  (the networks it trains with DP-SGD, for the dry run's memory and GPU-time estimate).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import pydantic
import torch

from dpsynth.dpsgd.estimate import PrivateNetwork
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.metrics.protocol import EvaluationProtocol  # noqa: F401  (re-exported: part of the contract)
from dpsynth.sections import RunConfig
from dpsynth.seeding import RNG_STREAMS, stream_generator, stream_seed  # noqa: F401  (re-exported)

METHODS: dict[str, type[Method]] = {}

#: the checkpoint phase holding a fitted method's released state (:meth:`Method.state_dict`)
RELEASED_PHASE = "released"

PublicUse = Literal["none", "optional", "required"]


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a run: its name, whether it reads private data, and the public data it uses."""

    name: str
    private: bool
    public: PublicUse = "none"
    description: str = ""


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

    ``data.train`` / ``data.val`` are private: a method reads them only inside ledger mechanisms,
    and only the ones ``plan`` announced. ``public`` is free to use. ``config`` is the resolved, typed
    run config and ``section`` the method's own section of it (``config.section``, an instance of
    ``Method.config_schema``).
    """

    config: RunConfig
    section: Any  # the method's config_schema instance
    run_dir: Path
    data: Any  # dpsynth.data.PrivateSplits
    public: Any  # dpsynth.data.ImageDataset | None
    ledger: Any  # dpsynth.privacy.PrivacyLedger
    device: torch.device
    seed: int
    log: Callable[[str], None]
    checkpoints: Any  # dpsynth.checkpoint.CheckpointManager
    curves: Any  # dpsynth.checkpoint.CurveLog
    plan: Any = None  # dpsynth.privacy.plan.PrivacyPlan; None when only generating

    @property
    def num_classes(self) -> int:
        return self.data.train.num_classes

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the private images after preprocessing."""
        return self.data.train.image_shape

    def rng(self, stream: str, index: int = 0) -> torch.Generator:
        """The generator of the named non-private stream (:data:`dpsynth.seeding.RNG_STREAMS`), from the run seed.

        Streams are independent of each other, so adding draws to one (more sampling) never shifts
        another (model init). ``index`` gives further independent generators of the same stream
        (e.g. one per resumed step). DP noise never comes from here.
        """
        return stream_generator(self.seed, stream, index)

    def noise_source(self) -> Any:
        """The run's DP noise source (:class:`~dpsynth.privacy.rng.NoiseSource`; ``privacy.secure_rng``)."""
        return self.config.privacy.noise_source()

    def releases_spent(self, mechanism: str) -> int:
        """How many releases of ``mechanism`` the ledger has charged so far (its repeats)."""
        return sum(entry.repeats for entry in self.ledger.mechanisms() if entry.name == mechanism)

    def resume(self, mechanism: str, phase: str, *, curves: bool = True) -> tuple[int, dict[str, Any] | None]:
        """``(start, state)`` of a resumable release loop: the checkpoint of ``phase`` (``state["step"]``
        releases done, or None) checked once against what the ledger charged for ``mechanism``.

        Every release is charged, and the ledger persisted, before its result is checkpointed, so the
        ledger may be ahead of the checkpoint (a run killed in between), never behind it: behind means
        the files were mixed and the run is refused. Ahead, the releases past the checkpoint stay spent and
        are not repeated: the loop continues at release ``start`` (the ledger's count) from the state the
        checkpoint holds, so the run ends on its plan. Curves past ``start`` are dropped (``curves=False``: kept,
        for a release whose count is not the curves' step, e.g. one release before a training loop).
        """
        state = self.checkpoints.load(phase=phase)
        reached = 0 if state is None else int(state["step"])
        spent = self.releases_spent(mechanism)
        if spent < reached:
            raise PrivacyError(
                f"{mechanism}: the ledger holds {spent} releases but the checkpoint {reached}: the run directory's "
                "files do not belong together; start a new run"
            )
        if spent > reached:
            self.log(f"{mechanism}: {spent - reached} release(s) after the last checkpoint stay spent; continuing")
        if spent:
            self.log(f"{mechanism}: resumed at release {spent}")
        if curves:
            self.curves.truncate_after(spent)
        return spent, state


class EmptySection(pydantic.BaseModel):
    """The config section of a method without settings."""

    model_config = pydantic.ConfigDict(extra="forbid")


class Method(abc.ABC):
    """Base class of a synthesis method; subclasses register with :func:`register_method`."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    #: the pydantic model of the method's config section (``extra="forbid"``, typed, described)
    config_schema: ClassVar[type[pydantic.BaseModel]] = EmptySection
    #: the section's defaults; derived from ``config_schema`` unless a subclass sets it
    defaults: ClassVar[dict[str, Any]] = {}
    #: what a run publishes: synthetic ``samples`` (samples.npz) or a trained ``model`` (metrics.json)
    releases: ClassVar[Literal["samples", "model"]] = "samples"
    # Where the paper's privacy claim or reference code is unsound and dpsynth implements the sound
    # version instead: stated in every privacy.json of the method.
    privacy_notes: ClassVar[tuple[str, ...]] = ()
    #: a directory of ``<name>.yaml`` presets run as ``<method>/<name>`` (a plugin's own; built-in methods'
    #: presets live in ``dpsynth/presets/<method>/``)
    presets_dir: ClassVar[Path | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "config_schema" in cls.__dict__ and "defaults" not in cls.__dict__:
            cls.defaults = cls.config_schema().model_dump()

    # -- declared before any data is read ---------------------------------------------------------
    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        """Checks across sections, run when the config loads (raise ConfigError); the section's own
        types, ranges and choices are already checked by ``config_schema``."""
        for phase in cls.phases(config):
            if phase.public == "required" and not config.data.public:
                raise ConfigError(
                    f"{cls.name}: phase {phase.name!r} needs public data but data.public is null"
                    + (f" ({phase.description})" if phase.description else "")
                )

    @classmethod
    def phases(cls, config: RunConfig) -> list[Phase]:
        """The phases of a run with ``config``, in order."""
        return [Phase("train", private=True), Phase("generate", private=False)]

    @classmethod
    def ledger_guarantee(cls, section: Any) -> str:
        """``"dp"``; ``"none"`` only for a paper's explicitly unsound opt-in (the ledger then claims no ε)."""
        return "dp"

    @classmethod
    def evaluation_protocol(cls, config: RunConfig) -> EvaluationProtocol:
        """How downstream classifiers learn this method's release (docs/evaluation.md, "One protocol").

        The default is DPImageBench's hard-label protocol (arXiv:2503.14681): classifiers trained from
        scratch on the synthetic labels, the epoch chosen on held-out synthetic data. A run's ``evaluate``
        section and ``dpsynth evaluate`` flags override single fields, recorded in ``metrics.json``.
        """
        return EvaluationProtocol()

    def private_networks(self, config: RunConfig) -> list[PrivateNetwork] | None:
        """The networks a run with ``config`` trains with DP-SGD, at full size, for the dry run's estimate
        (:mod:`dpsynth.dpsgd.estimate`: parameters, memory per device, GPU hours). From the config alone:
        no data is read. ``[]``: none; the default ``None``: not declared, and the dry run names the
        section's DP-SGD keys as unestimated. The shared skeletons declare theirs (``DiffusionMethod``, and
        ``classifier_network`` / ``discriminator_network`` of ``dpsynth.models``), so a method built on them
        inherits it."""
        return None

    @abc.abstractmethod
    def plan(self, config: RunConfig, num_examples: int) -> Any:
        """The :class:`~dpsynth.privacy.plan.PrivacyPlan` of a run on ``num_examples`` private examples.

        Uses the resolved config and N only (never data values); ``fit`` must spend exactly it.
        """

    # -- the run -------------------------------------------------------------------------------
    @abc.abstractmethod
    def fit(self, ctx: RunContext) -> None:
        """Spend ``ctx.plan`` on the private data; resume from ``ctx.checkpoints`` if present."""

    def state_dict(self) -> dict[str, Any]:
        """The released state ``generate`` reads (weights, released statistics or images), after ``fit``.

        The runner saves it as the checkpoint :data:`RELEASED_PHASE`; it holds only what the plan's
        mechanisms released (and public inputs), never private values. The default: nothing.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any], ctx: RunContext) -> None:
        """Restore :meth:`state_dict`'s output (the networks are built from ``ctx``'s config and shapes)."""

    @abc.abstractmethod
    def generate(self, ctx: RunContext, num: int) -> Samples:
        """Return ``num`` labelled samples; reads only released state and public data, so it costs no privacy."""

    def released_metrics(self, ctx: RunContext) -> dict[str, Any]:
        """Metrics of a released model on the real test split (``releases = "model"`` only)."""
        raise NotImplementedError(f"{self.name} releases samples, not a model")

    def example_losses(self, ctx: RunContext, images: np.ndarray, labels: np.ndarray) -> np.ndarray | None:
        """Per-example losses of the released model (the audit's loss attack); None: nothing to score."""
        return None


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator adding a method to the registry under ``cls.name``."""
    if cls.name in METHODS:
        raise ValueError(f"method {cls.name!r} registered twice")
    if not (isinstance(cls.config_schema, type) and issubclass(cls.config_schema, pydantic.BaseModel)):
        raise TypeError(f"method {cls.name!r}: config_schema must be a pydantic model")
    METHODS[cls.name] = cls
    return cls
