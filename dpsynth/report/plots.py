"""Figures for the HTML reports: the training curves as inline SVG written here (no rendering: it cost about a
second per report), sample grids and the ε trade-off as PNG bytes rendered off-screen.

Matplotlib is driven through ``Figure`` + the Agg canvas directly (no ``pyplot``), so rendering
needs no display, touches no global state and works the same inside a server or a test.
"""

from __future__ import annotations

import base64
import html
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


#: one curve panel of the inline SVG: size and margins in CSS pixels
_PANEL_WIDTH, _PANEL_HEIGHT = 320, 220
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 12, 26, 30


def training_curves_svg(records: Sequence[Mapping[str, float]]) -> str | None:
    """Inline SVG, one panel per series (loss, ε spent, ...) against the training step; None if nothing to plot.

    A line per series with its first and last step and its range labelled: drawn as text, so a report costs
    no figure rendering (matplotlib took about a second per report) and the curves scale without blur.
    """
    keys = curve_keys(records)
    if not keys:
        return None
    panels = [_curve_panel(records, key, index * _PANEL_WIDTH) for index, key in enumerate(keys)]
    width = _PANEL_WIDTH * len(keys)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{_PANEL_HEIGHT}" '
        f'viewBox="0 0 {width} {_PANEL_HEIGHT}" role="img" aria-label="training curves" '
        f'font-family="sans-serif" font-size="11">{"".join(panels)}</svg>'
    )


def _curve_panel(records: Sequence[Mapping[str, float]], key: str, x0: int) -> str:
    points = [
        (float(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and isinstance(r.get("step"), (int, float))
    ]
    title = "ε spent" if key == "epsilon" else key
    left, right = x0 + _LEFT, x0 + _PANEL_WIDTH - _RIGHT
    top, bottom = _TOP, _PANEL_HEIGHT - _BOTTOM
    parts = [
        f'<text x="{(left + right) / 2:.1f}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#999"/>',
        f'<text x="{(left + right) / 2:.1f}" y="{_PANEL_HEIGHT - 4}" text-anchor="middle">step</text>',
    ]
    if not points:
        return "".join(parts)
    steps, values = zip(*points)
    low_x, high_x, low_y, high_y = min(steps), max(steps), min(values), max(values)

    def scale(value: float, low: float, high: float, start: float, stop: float) -> float:
        return (start + stop) / 2 if high == low else start + (value - low) / (high - low) * (stop - start)

    xy = [(scale(x, low_x, high_x, left, right), scale(y, low_y, high_y, bottom, top)) for x, y in points]
    if len(xy) == 1:
        parts.append(f'<circle cx="{xy[0][0]:.1f}" cy="{xy[0][1]:.1f}" r="2.5" fill="#1f77b4"/>')
    else:
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        parts.append(f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1.4"/>')
    parts += [
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{_tick(high_y)}</text>',
        f'<text x="{left - 4}" y="{bottom}" text-anchor="end">{_tick(low_y)}</text>',
        f'<text x="{left}" y="{bottom + 14}">{_tick(low_x)}</text>',
        f'<text x="{right}" y="{bottom + 14}" text-anchor="end">{_tick(high_x)}</text>',
    ]
    return "".join(parts)


def _tick(value: float) -> str:
    return f"{value:.4g}"


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
