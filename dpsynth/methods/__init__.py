"""Synthesis methods. Importing this package registers every method module listed below."""

import importlib

from dpsynth.methods.base import METHODS, Method, RunContext, Samples, get_method, register_method

_METHOD_MODULES = ("dpsgd_classifier", "dpdm", "pdp_diffusion", "dp_imgsyn")

for _module in _METHOD_MODULES:
    try:
        importlib.import_module(f"dpsynth.methods.{_module}")
    except ModuleNotFoundError as exc:  # a method whose module has not landed yet
        if exc.name != f"dpsynth.methods.{_module}":
            raise

__all__ = ["METHODS", "Method", "RunContext", "Samples", "get_method", "register_method"]
