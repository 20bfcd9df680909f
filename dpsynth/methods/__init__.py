"""Synthesis methods. Importing this package registers every method module below."""

from dpsynth.methods import dp_imgsyn, dpdm, dppm, dpsgd_classifier, pdp_diffusion, privimage  # noqa: F401  (registration)
from dpsynth.methods.base import METHODS, Method, RunContext, Samples, get_method, register_method

__all__ = ["METHODS", "Method", "RunContext", "Samples", "get_method", "register_method"]
