"""Synthesis methods. Importing this package registers every method module below.

The contract every method implements (``Method``, ``RunContext``, ``Samples``, the registry) lives in
:mod:`dpsynth.contract`, below the shared layers that build on it (``dpsynth.diffusion.method``).
"""

from dpsynth.contract import METHODS, Method, RunContext, Samples, register_method
from dpsynth.errors import ConfigError
from dpsynth.methods import (  # noqa: F401  (registration)
    dp_imgsyn,
    dpdm,
    dppm,
    dpsgd_classifier,
    pdp_diffusion,
    privimage,
)

__all__ = ["METHODS", "Method", "RunContext", "Samples", "get_method", "register_method"]


def get_method(name: str) -> type[Method]:
    """The registered method ``name``, or a ConfigError listing the known ones."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]
