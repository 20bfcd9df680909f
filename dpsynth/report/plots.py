"""Figures for the HTML reports, rendered off-screen to PNG bytes.

Matplotlib is driven through ``Figure`` + the Agg canvas directly (no ``pyplot``), so rendering
needs no display, touches no global state and works the same inside a server or a test.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from PIL import Image

# Curve keys drawn first, in this order; any other numeric key gets its own panel after them.
PREFERRED_CURVES = ("loss", "epsilon")
MAX_CURVE_PANELS = 4


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...`` so the report stays one self-contained file."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_png(array: np.ndarray, scale: int = 1) -> bytes:
    """PNG bytes of a uint8 image ``[H, W]`` or ``[H, W, C]``, upscaled ``scale`` times (nearest)."""
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    picture = Image.fromarray(np.ascontiguousarray(array))
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _figure_png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def curve_keys(records: Sequence[Mapping[str, float]]) -> list[str]:
    """The numeric series in ``curves.jsonl`` records worth a panel, preferred ones first."""
    found: list[str] = []
    for record in records:
        for key, value in record.items():
            if key != "step" and key not in found and isinstance(value, (int, float)):
                found.append(key)
    ordered = [key for key in PREFERRED_CURVES if key in found]
    ordered += [key for key in found if key not in ordered]
    return ordered[:MAX_CURVE_PANELS]


def training_curves_png(records: Sequence[Mapping[str, float]]) -> bytes | None:
    """One panel per series (loss, ε spent, ...) against the training step; None if nothing to plot."""
    keys = curve_keys(records)
    if not keys:
        return None
    figure = _new_figure(4.0 * len(keys), 3.0)
    for index, key in enumerate(keys, start=1):
        points = [
            (r["step"], r[key])
            for r in records
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and "step" in r
        ]
        axes = figure.add_subplot(1, len(keys), index)
        if points:
            steps, values = zip(*points)
            axes.plot(steps, values, linewidth=1.2)
        axes.set_xlabel("step")
        axes.set_title("ε spent" if key == "epsilon" else key)
        axes.grid(alpha=0.3)
    return _figure_png(figure)


def tradeoff_png(
    series: Mapping[str, Iterable[tuple[float, float]]], ylabel: str, lower_is_better: bool = False
) -> bytes | None:
    """A metric against ε, one line per method (``{method: [(epsilon, value), ...]}``)."""
    cleaned = {
        name: sorted((float(e), float(v)) for e, v in points if math.isfinite(e) and math.isfinite(v))
        for name, points in series.items()
    }
    cleaned = {name: points for name, points in cleaned.items() if points}
    if not cleaned:
        return None
    figure = _new_figure(5.0, 3.5)
    axes = figure.add_subplot(1, 1, 1)
    for name, points in sorted(cleaned.items()):
        epsilons, values = zip(*points)
        axes.plot(epsilons, values, marker="o", label=name)
    epsilons = [e for points in cleaned.values() for e, _ in points]
    if min(epsilons) > 0 and max(epsilons) / min(epsilons) >= 10:
        axes.set_xscale("log")
    axes.set_xlabel("ε")
    axes.set_ylabel(ylabel + (" (lower is better)" if lower_is_better else ""))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return _figure_png(figure)
