"""The typed run configuration every method receives: the common sections and the method's own.

Each shared layer declares the section it reads (``data``: :mod:`dpsynth.data.section`, ``privacy``:
:mod:`dpsynth.privacy.section`, ``evaluate``: :mod:`dpsynth.metrics.protocol`, ``backbone``:
:mod:`dpsynth.models.backbone`, DP-SGD keys: :mod:`dpsynth.dpsgd.section`); :class:`RunConfig` composes
them. :mod:`dpsynth.config` resolves a YAML file into a :class:`RunConfig` subclass that adds the
method's section under the method's name, and that validated object travels unchanged to the method
(``ctx.config``, ``ctx.section``): no method re-reads or re-validates a dict.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from dpsynth.data.section import DataSection
from dpsynth.dpsgd.scaling import AutoSection
from dpsynth.metrics.protocol import EvaluateSection
from dpsynth.models.backbone import BackboneSection
from dpsynth.privacy.section import PrivacySection
from dpsynth.rundir import SAMPLES_FILE
from dpsynth.schema import Section

DEVICE_PATTERN = r"^(auto|cpu|mps|cuda(:\d+)?)$"


class GenerateSection(Section):
    num: int = Field(1000, ge=1, description=f"number of synthetic samples a run writes to {SAMPLES_FILE}")
    batch_size: int = Field(250, ge=1, description="generation batch size (memory only)")


class RunConfig(Section):
    """The sections every run has, whatever its method; a resolved config adds ``method_section``
    (aliased to the method's name, :func:`dpsynth.config.run_schema`)."""

    method: str | None = Field(None, description="the method id (see `dpsynth methods`)")
    name: str | None = Field(None, description="run directory name; null: the config file's stem")
    seed: int = Field(
        0, ge=0, description="seed of the non-private randomness (init, data order of public data, sampling)"
    )
    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto | cpu | cuda | cuda:N | mps")
    data: DataSection = Field(default_factory=DataSection, description="datasets and splits")
    privacy: PrivacySection = Field(default_factory=PrivacySection, description="the (epsilon, delta) target")
    generate: GenerateSection = Field(default_factory=GenerateSection, description="sample generation")
    evaluate: EvaluateSection = Field(default_factory=EvaluateSection, description="evaluation after the run")
    backbone: BackboneSection = Field(
        default_factory=BackboneSection,
        description="the public latent backbone (an autoencoder on data.public) of latent-space methods",
    )
    auto: AutoSection | None = Field(
        None, description="the scaling rule of an `auto` preset (docs/own-data.md); null: keys as given"
    )

    @property
    def section(self) -> Any:
        """The method's own section (a pydantic model of ``Method.config_schema``)."""
        return getattr(self, "method_section", None)

    def to_dict(self) -> dict[str, Any]:
        """The config as ``config.yaml`` stores it: plain values, the method section under the method's name."""
        return self.model_dump(by_alias=True)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with top-level keys replaced (not re-validated: use :func:`dpsynth.config.resolve_config`
        for anything a user gave)."""
        return self.model_copy(update=changes)
