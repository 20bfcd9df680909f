"""Reports: class grids, figures, the per-run ``report.html`` and the multi-run comparison.

Names are imported lazily so that ``dpsynth --help`` (which registers the ``report`` command) does
not pay for numpy, PIL or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "class_grid": "dpsynth.report.grids",
    "save_class_grid": "dpsynth.report.grids",
    "render_report": "dpsynth.report.html",
    "write_report": "dpsynth.report.html",
    "RunSummary": "dpsynth.report.compare",
    "summarize_run": "dpsynth.report.compare",
    "write_comparison": "dpsynth.report.compare",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dpsynth.report' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
