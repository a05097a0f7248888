"""Line charts as inline SVG, drawn on the server: no chart library, no script, nothing to download.

One chart per scalar (as TensorBoard draws them), one line per (run, agent) series: the colour names the run
(the same colour in every chart), the line style names the agent or model. Gridlines at round ticks on both
axes; each point carries a ``<title>`` (hover: series, step, value, smoothed value); `smooth` draws
TensorBoard's debiased exponential moving average over the raw line, which stays faint behind it. A chart
given an `href` is a link (the enlarged chart).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

__all__ = ["Series", "line_chart", "smoothed", "ticks", "points", "PALETTE", "DASHES"]

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
"""Line colours: one per run, in the order of the runs shown (a ninth run shown reuses the first colour)."""

DASHES = ("", "6 3", "2 2", "8 3 2 3", "1 3", "10 4", "4 2 1 2 1 2", "12 3 3 3")
"""Line styles (SVG stroke-dasharray): one per agent (model, evaluation split), by name order."""

SIZES = {"small": (400, 200), "large": (1000, 460)}
"""Chart sizes in pixels: the grid of charts, and the enlarged one."""

_LEFT, _RIGHT, _TOP, _BOTTOM = 52, 10, 8, 30
_MAX_MARKS = 120
"""Hover points per series at most (a long run shows every n-th step's point)."""


@dataclass(frozen=True)
class Series:
    """One line: its label, its (step, value) points, and how it is drawn."""

    label: str
    """Shown in the legend and on hover ('run / agent')."""
    points: tuple[tuple[float, float], ...]
    """(step, value), in step order; non-finite values are left out."""
    colour: int = 0
    """Index into `PALETTE` (the run's)."""
    dash: int = 0
    """Index into `DASHES` (the agent's or model's)."""


def smoothed(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: the exponential moving average s_t = w s_{t-1} + (1 - w) v_t from s_0 = 0,
    divided by 1 - w^(t+1) so the start is not pulled towards 0 (debiased). weight 0: the values."""
    if weight <= 0:
        return list(values)
    out, last = [], 0.0
    for t, value in enumerate(values):
        last = weight * last + (1 - weight) * value
        out.append(last / (1 - weight ** (t + 1)))
    return out


def ticks(low: float, high: float, count: int = 5, least: float = 0.0) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart, at least `least`) within [low, high]."""
    if not high > low:
        return [low]
    raw = max((high - low) / max(count - 1, 1), least)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.2e}"


def line_chart(title: str, series: Sequence[Series], *, smooth: float = 0.0, size: str = "small",
               href: str | None = None) -> Markup:
    """An SVG chart of `series` (empty ones skipped) with gridlines, ticks, a legend and hover values."""
    lines = [s for s in series if s.points]
    if not lines:
        return Markup("")
    width_px, height_px = SIZES[size]
    curves = [(s, smoothed([y for _, y in s.points], smooth)) for s in lines]
    xs = [x for s in lines for x, _ in s.points]
    ys = [y for s in lines for _, y in s.points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    if y0 == y1:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    width, height = width_px - _LEFT - _RIGHT, height_px - _TOP - _BOTTOM

    def px(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * width

    def py(y: float) -> float:
        return _TOP + (1 - (y - y0) / (y1 - y0)) * height

    parts = [f'<svg class="chart {size}" viewBox="0 0 {width_px} {height_px}" width="{width_px}" '
             f'height="{height_px}" role="img" aria-label="{escape(title)}">',
             f'<rect x="{_LEFT}" y="{_TOP}" width="{width}" height="{height}" class="plot"/>']
    for y in ticks(y0, y1):
        parts.append(f'<line class="grid" x1="{_LEFT}" x2="{_LEFT + width}" y1="{py(y):.1f}" y2="{py(y):.1f}"/>'
                     f'<text x="{_LEFT - 4}" y="{py(y) + 3:.1f}" class="tick y" text-anchor="end">{_label(y)}</text>')
    for x in ticks(x0, x1, 6 if size == "small" else 10, least=1.0):  # steps: whole numbers
        parts.append(f'<line class="grid" x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{_TOP}" y2="{_TOP + height}"/>'
                     f'<text x="{px(x):.1f}" y="{_TOP + height + 12}" class="tick x" text-anchor="middle">'
                     f'{_label(x)}</text>')
    parts.append(f'<text x="{_LEFT + width}" y="{height_px - 3}" class="tick" text-anchor="end">step</text>')
    for s, ys_smooth in curves:
        colour, dash = PALETTE[s.colour % len(PALETTE)], DASHES[s.dash % len(DASHES)]
        style = f'stroke="{colour}"' + (f' stroke-dasharray="{dash}"' if dash else "")
        raw = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        if smooth > 0:
            parts.append(f'<polyline class="raw" points="{raw}" fill="none" {style} stroke-width="1"/>')
            line = " ".join(f"{px(x):.1f},{py(v):.1f}" for (x, _), v in zip(s.points, ys_smooth, strict=True))
        else:
            line = raw
        parts.append(f'<polyline class="line" points="{line}" fill="none" {style} stroke-width="1.8"/>')
        every = max(1, math.ceil(len(s.points) / _MAX_MARKS))
        for i, ((x, y), v) in enumerate(zip(s.points, ys_smooth, strict=True)):
            if i % every and i != len(s.points) - 1:
                continue
            shown = f"{y:.5g}" + (f" (smoothed {v:.5g})" if smooth > 0 else "")
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="3" fill="{colour}">'
                         f'<title>{escape(s.label)}: step {_label(x)}, {shown}</title></circle>')
    parts.append("</svg>")
    legend = "".join(
        f'<span class="key"><svg width="22" height="8"><line x1="0" x2="22" y1="4" y2="4" stroke-width="2" '
        f'stroke="{PALETTE[s.colour % len(PALETTE)]}"'
        + (f' stroke-dasharray="{DASHES[s.dash % len(DASHES)]}"' if DASHES[s.dash % len(DASHES)] else "")
        + f'/></svg>{escape(s.label)}</span>'
        for s in lines
    )
    body = "".join(parts)
    if href is not None:
        body = f'<a class="enlarge" href="{escape(href)}" title="enlarge">{body}</a>'
    return Markup(f'<figure class="card chart-{size}"><figcaption>{escape(title)}</figcaption>{body}'
                  f'<div class="legend">{legend}</div></figure>')


def points(records: Sequence[dict], key: str, steps: tuple[float | None, float | None] = (None, None)
           ) -> tuple[tuple[float, float], ...]:
    """(step, value) of `key` in metric records that have it, finite values only, steps within `steps`
    (inclusive bounds; None: open)."""
    low, high = steps
    out = []
    for record in records:
        value = record.get(key)
        step = record.get("step")
        if (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and isinstance(step, (int, float)) and (low is None or step >= low) and (high is None or step <= high)):
            out.append((float(step), float(value)))
    return tuple(out)
