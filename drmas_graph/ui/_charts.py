"""Line charts as inline SVG, drawn on the server: no chart library, no script, nothing to download.

One chart per scalar (as TensorBoard draws them), one line per (run, agent) series; each point carries a
``<title>`` so hovering it shows the step and value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

__all__ = ["Series", "line_chart", "PALETTE"]

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
"""Line colours, in series order."""

_W, _H = 360, 170
_LEFT, _RIGHT, _TOP, _BOTTOM = 52, 8, 8, 22


@dataclass(frozen=True)
class Series:
    """One line: its label and its (step, value) points."""

    label: str
    """Shown in the legend ('run / agent')."""
    points: tuple[tuple[float, float], ...]
    """(step, value), in step order; non-finite values are left out."""


def _tick(value: float) -> str:
    return f"{value:.3g}"


def line_chart(title: str, series: Sequence[Series]) -> Markup:
    """An SVG chart of `series` (empty ones skipped) with min/max labels on both axes and a legend."""
    lines = [s for s in series if s.points]
    if not lines:
        return Markup("")
    xs = [x for s in lines for x, _ in s.points]
    ys = [y for s in lines for _, y in s.points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    if y0 == y1:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    width, height = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def px(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * width

    def py(y: float) -> float:
        return _TOP + (1 - (y - y0) / (y1 - y0)) * height

    parts = [
        f'<svg class="chart" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
        f'aria-label="{escape(title)}">',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{width}" height="{height}" class="plot"/>',
        f'<text x="{_LEFT - 4}" y="{_TOP + 9}" class="tick" text-anchor="end">{_tick(y1)}</text>',
        f'<text x="{_LEFT - 4}" y="{_TOP + height}" class="tick" text-anchor="end">{_tick(y0)}</text>',
        f'<text x="{_LEFT}" y="{_H - 6}" class="tick">{_tick(x0)}</text>',
        f'<text x="{_LEFT + width}" y="{_H - 6}" class="tick" text-anchor="end">{_tick(x1)}</text>',
        f'<text x="{_LEFT + width / 2}" y="{_H - 6}" class="tick" text-anchor="middle">step</text>',
    ]
    for i, s in enumerate(lines):
        colour = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
        for x, y in s.points:
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.4" fill="{colour}">'
                         f'<title>{escape(s.label)}: step {_tick(x)}, {y:.5g}</title></circle>')
    parts.append("</svg>")
    legend = "".join(
        f'<span class="key"><i class="c{i % len(PALETTE)}"></i>{escape(s.label)}</span>'
        for i, s in enumerate(lines)
    )
    return Markup(f'<figure class="card"><figcaption>{escape(title)}</figcaption>{"".join(parts)}'
                  f'<div class="legend">{legend}</div></figure>')


def points(records: Sequence[dict], key: str) -> tuple[tuple[float, float], ...]:
    """(step, value) of `key` in metric records that have it, finite values only."""
    out = []
    for record in records:
        value = record.get(key)
        step = record.get("step")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and step is not None:
            out.append((float(step), float(value)))
    return tuple(out)
