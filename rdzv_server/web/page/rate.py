"""The job picture's lane of steps per second (history.py draws it on the job's page): a line on its own scale from
the view's `rate` points (at most goodput.MAX_RATE_POINTS), broken where no point came for a while (a restart, a
stall) so a gap is never drawn as steady training. Pure; points that cannot be read are left out."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from rdzv_server.web.page.parts import epoch, figure
from rdzv_server.web.page.svg import GRID, INK, MUTED, RATE_INK, Frame, num

GAP_FACTOR = 3.0          # a line breaks where points are this many usual spacings apart


def read_points(rate: Sequence[tuple[str, float]], t0: float) -> list[tuple[float, float]]:
    """(unix time, steps/s) of the points at or after `t0` (the picture's start), oldest first."""
    out: list[tuple[float, float]] = []
    for when, value in rate:
        try:
            t = epoch(when)
        except (TypeError, ValueError):
            continue
        if t >= t0 and math.isfinite(value) and value >= 0:
            out.append((t, value))
    return out


def scale(peak: float) -> float:
    """The top of the scale: the first of 1, 2, 2.5, 5 (times a power of ten) at or over `peak`."""
    if not peak > 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(peak))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= peak)


def runs(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """The points in runs, a new one where the spacing is over GAP_FACTOR times the median spacing."""
    if len(points) < 3:
        return [points] if points else []
    usual = statistics.median(b[0] - a[0] for a, b in zip(points, points[1:], strict=False))
    out = [[points[0]]]
    for before, p in zip(points, points[1:], strict=False):
        if usual > 0 and p[0] - before[0] > GAP_FACTOR * usual:
            out.append([])
        out[-1].append(p)
    return out


def rate_lane(f: Frame, points: list[tuple[float, float]], legend: set[str]) -> list[str]:
    """The lane: a background, ticks at 0 and the top, the line (filled below) and the latest value at the right."""
    y, height = f.lanes["rate"]
    top = scale(max(v for _, v in points))

    def yv(v: float) -> float:
        return y + height - min(v, top) / top * height

    out = [f'<rect x="{f.left}" y="{y}" width="{f.right - f.left}" height="{height}" fill="#fbfcfd"/>']
    for tick in (0.0, top):
        out.append(f'<line x1="{f.left}" x2="{f.right}" y1="{yv(tick):.1f}" y2="{yv(tick):.1f}" stroke="{GRID}"/>'
                   f'<text x="{f.left - 6}" y="{yv(tick) + 4:.1f}" text-anchor="end" fill="{MUTED}">'
                   f"{figure(tick)}</text>")
    legend.add("rate")
    line, area = [], []
    for run in runs(points):
        xs = [f.x(t) for t, _ in run]
        d = "M" + " ".join(f"{num(x)},{num(yv(v))}" for x, (_, v) in zip(xs, run, strict=True))
        if len(run) == 1:
            d += "h2"             # one point alone: a short dash, so it shows
        line.append(d)
        area.append(f"{d}V{num(y + height)}H{num(xs[0])}Z")
    out.append(f'<path d="{"".join(area)}" fill="{RATE_INK}" fill-opacity=".12"/>'
               f'<path class="rate" data-points="{len(points)}" d="{"".join(line)}" fill="none" stroke="{RATE_INK}" '
               f'stroke-width="1.8" stroke-linejoin="round"/>')
    last = points[-1][1]
    out.append(f'<text x="{f.right + 6}" y="{max(yv(last) + 4, y + 11):.1f}" fill="{INK}" font-weight="600">'
               f"{figure(last)}/s</text>")
    return out


def rate_summary(points: list[tuple[float, float]]) -> str:
    """The lane in words, for the picture's <desc>: "" when there are no points."""
    if not points:
        return ""
    return (f" Steps per second: {figure(points[-1][1])} at the latest point, {figure(max(v for _, v in points))} "
            f"at most.")
