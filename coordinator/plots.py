"""Line charts as inline SVG for the status page: drawn by the coordinator, so the page needs no
script library and no internet at view time.

:func:`line_chart` draws one or more ``(time, value)`` series over a shared time axis, with the value
range, the time range and a legend; each line is a ``<polyline class="line">`` whose
``data-points`` says how many points it draws (the browser test reads it).
"""

from __future__ import annotations

import html
import time
from typing import Callable, Sequence

__all__ = ["line_chart", "PALETTE", "RENDER_POINTS"]

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f")
RENDER_POINTS = 400
"""Most points drawn per line (the stored series may hold more; every k-th is drawn, the last always)."""

_W, _H = 560, 170
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 8, 8, 22

Point = tuple[float, float]


def _sample(points: Sequence[Point], most: int) -> list[Point]:
    if len(points) <= most:
        return list(points)
    step = -(-len(points) // most)
    out = list(points[::step])
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out


def _clock(t: float, span: float) -> str:
    fmt = "%H:%M:%S" if span < 86400 else "%m-%d %H:%M"
    return time.strftime(fmt, time.gmtime(t))


def line_chart(title: str, lines: dict[str, Sequence[Point]], fmt: Callable[[float], str],
               zero_based: bool = True, chart_id: str = "") -> str:
    """An SVG chart of ``lines`` (label -> points, oldest first) titled ``title``; ``fmt`` writes a value;
    ``zero_based``: the value axis starts at 0 (totals, rates), else at the smallest value (losses)."""
    e = html.escape
    drawn = {label: _sample(pts, RENDER_POINTS) for label, pts in lines.items() if pts}
    ident = f" id='{e(chart_id)}'" if chart_id else ""
    head = f"<figure class='plot'{ident}><figcaption>{e(title)}</figcaption>"
    if not drawn:
        return (f"{head}<svg viewBox='0 0 {_W} {_H}' role='img' aria-label='{e(title)}: no data yet'>"
                f"<text x='{_W // 2}' y='{_H // 2}' text-anchor='middle' fill='#888'>no data yet</text></svg></figure>")
    ts = [t for pts in drawn.values() for t, _ in pts]
    vs = [v for pts in drawn.values() for _, v in pts]
    t0, t1 = min(ts), max(ts)
    lo, hi = (min(0.0, min(vs)) if zero_based else min(vs)), max(vs)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = (lo if zero_based and lo == 0 else lo - pad), hi + pad
    span = t1 - t0
    pw, ph = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def xy(t: float, v: float) -> str:
        x = _LEFT + (pw * (t - t0) / span if span > 0 else pw)
        y = _TOP + ph * (1 - (v - lo) / (hi - lo))
        return f"{x:.1f},{y:.1f}"

    parts = [f"<svg viewBox='0 0 {_W} {_H}' role='img' aria-label='{e(title)}'>",
             f"<rect x='{_LEFT}' y='{_TOP}' width='{pw}' height='{ph}' fill='none' stroke='#ccc'/>",
             f"<text class='ymax' x='{_LEFT - 4}' y='{_TOP + 10}' text-anchor='end'>{e(fmt(hi))}</text>",
             f"<text class='ymin' x='{_LEFT - 4}' y='{_TOP + ph}' text-anchor='end'>{e(fmt(lo))}</text>",
             f"<text x='{_LEFT}' y='{_H - 6}'>{e(_clock(t0, span))} UTC</text>",
             f"<text x='{_W - _RIGHT}' y='{_H - 6}' text-anchor='end'>{e(_clock(t1, span))}</text>"]
    legend = []
    for i, (label, pts) in enumerate(sorted(drawn.items())):
        color = PALETTE[i % len(PALETTE)]
        latest = fmt(lines[label][-1][1])
        coords = " ".join(xy(t, v) for t, v in pts)
        parts.append(f"<polyline class='line' data-label='{e(label)}' data-points='{len(pts)}' points='{coords}' "
                     f"fill='none' stroke='{color}' stroke-width='1.5'><title>{e(label)}: {e(latest)}</title></polyline>")
        if len(pts) == 1:
            parts.append(f"<circle cx='{xy(*pts[0]).split(',')[0]}' cy='{xy(*pts[0]).split(',')[1]}' r='3' "
                         f"fill='{color}'/>")
        legend.append(f"<span style='color:{color}'>&#9632;</span> {e(label)} <b>{e(latest)}</b>")
    parts.append("</svg>")
    return head + "".join(parts) + f"<div class='legend'>{' &middot; '.join(legend)}</div></figure>"
