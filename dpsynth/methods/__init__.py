"""Synthesis methods. Importing this package registers every method module below.

The contract every method implements (``Method``, ``RunContext``, ``Samples``, the registry) lives in
:mod:`dpsynth.contract`; the skeletons that method families share live in :mod:`dpsynth.methods.families`
(methods never import each other, only a family).
Methods from other installed packages join the registry through the ``dpsynth.methods`` entry-point
group (docs/methods/authoring.md): they are loaded the first time a name is not found, or when every
method is listed.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from dpsynth.contract import METHODS, Method, RunContext, Samples, register_method
from dpsynth.errors import ConfigError
from dpsynth.methods import (  # noqa: F401  (registration)
    dp_feta,
    dp_gan,
    dp_imgsyn,
    dp_kernel,
    dp_ldm,
    dp_lora,
    dp_merf,
    dp_ntk,
    dpdm,
    dppm,
    dpsgd_classifier,
    gs_wgan,
    pdp_diffusion,
    pe,
    privimage,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "METHODS",
    "Method",
    "RunContext",
    "Samples",
    "all_methods",
    "get_method",
    "shipped_methods",
]

#: the entry-point group a package uses to add a method: ``name = "package.module:MethodClass"``
ENTRY_POINT_GROUP = "dpsynth.methods"
#: plugin methods that failed to load: name -> the one-line reason, reported when the name is asked for
_PLUGIN_ERRORS: dict[str, str] = {}


def load_plugins() -> None:
    """Register every method an installed package declares under :data:`ENTRY_POINT_GROUP`.

    An entry point names a :class:`Method` subclass (registered here) or a module that registers its
    methods on import. A plugin that fails to import, or names another method, is not registered; the
    reason is kept for :func:`get_method`, so one broken plugin never blocks the others.
    """
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in METHODS:
            continue
        try:
            loaded = entry.load()
            if isinstance(loaded, type) and issubclass(loaded, Method) and loaded.name not in METHODS:
                register_method(loaded)
            if entry.name not in METHODS:
                raise ConfigError(f"entry point {entry.value!r} registers no method named {entry.name!r}")
        except Exception as exc:  # a plugin's own error, reported when the method is asked for
            _PLUGIN_ERRORS[entry.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def all_methods() -> dict[str, type[Method]]:
    """Every registered method, installed plugins included."""
    load_plugins()
    return dict(METHODS)


def shipped_methods() -> dict[str, type[Method]]:
    """The registered methods defined in dpsynth itself: the generated README table and config reference list
    these, not a method a test or an installed plugin registers (pass those explicitly to the generators)."""
    return {name: cls for name, cls in METHODS.items() if cls.__module__.startswith("dpsynth.")}


def get_method(name: str) -> type[Method]:
    """The registered method ``name`` (an installed plugin's included), or a ConfigError listing the known ones."""
    if name not in METHODS:
        load_plugins()
    if name not in METHODS:
        if name in _PLUGIN_ERRORS:
            raise ConfigError(f"method {name!r} is installed but failed to load ({_PLUGIN_ERRORS[name]})")
        raise ConfigError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]
