"""The ``privacy`` section of a run config: the (ε, δ) target, the accountant and the noise source."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dpsynth.privacy.rng import NoiseSource
from dpsynth.schema import Section


class PrivacySection(Section):
    """The target of the whole run; every mechanism of the run composes under it (docs/privacy.md)."""

    epsilon: float = Field(10.0, gt=0, allow_inf_nan=False, description="target epsilon of the whole run")
    delta: float = Field(1e-5, gt=0, lt=1, description="target delta (should be below 1/N)")
    accountant: Literal["prv", "rdp"] = Field("prv", description="privacy accountant composing every mechanism")
    secure_rng: bool = Field(False, description="DP noise from os.urandom bytes (cryptographic, slower)")

    def noise_source(self) -> NoiseSource:
        """The DP noise source of the run: OS entropy, cryptographic under ``secure_rng`` (never the run seed)."""
        return NoiseSource(secure=self.secure_rng)
