"""dpsynth: differentially private synthetic image data, with one privacy core and one evaluation protocol.

The Python entry point is :class:`dpsynth.Synthesizer` (``fit`` / ``sample``; docs/python.md).
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Synthesizer", "__version__", "evaluate"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so `import dpsynth` (and the CLI's start-up) stays light.
    if name in ("Synthesizer", "evaluate"):
        from dpsynth import api

        return getattr(api, name)
    raise AttributeError(f"module 'dpsynth' has no attribute {name!r}")
