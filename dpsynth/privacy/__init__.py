"""Privacy accounting: mechanisms, PRV/RDP accountants, noise calibration and the run's ledger.

See docs/privacy.md. DP noise itself comes from :mod:`dpsynth.privacy.rng`.
"""

from dpsynth.privacy.accountants import ACCOUNTANTS, EPS_ERROR, compute_epsilon
from dpsynth.privacy.calibration import CALIBRATION_TOLERANCE, calibrate_noise
from dpsynth.privacy.ledger import PrivacyLedger
from dpsynth.privacy.mechanisms import (
    Gaussian,
    Laplace,
    Mechanism,
    PureEpsilon,
    ShardSampledGaussian,
    SubsampledGaussian,
)
from dpsynth.privacy.rng import NoiseSource

__all__ = [
    "ACCOUNTANTS",
    "CALIBRATION_TOLERANCE",
    "EPS_ERROR",
    "Gaussian",
    "Laplace",
    "Mechanism",
    "NoiseSource",
    "PrivacyLedger",
    "PureEpsilon",
    "ShardSampledGaussian",
    "SubsampledGaussian",
    "calibrate_noise",
    "compute_epsilon",
]
