"""The pieces of the job picture (`history.py`): frame and lanes, time axis, member-count scale, mark glyphs,
legend, colours, escaping. SVG presentation attributes only (no CSS classes), so it looks the same anywhere."""
from __future__ import annotations

import datetime as dt
import html
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol.quoting import lines_kept
from rdzv_server.core.records import MAX_EVENTS_PER_JOB

W = 1200                  # the viewBox width; the page scales it to the card's width (at most 1:1)
LEFT, RIGHT = 92, 84      # the plot between them: lane labels and member ticks on the left, min/max right
TOP = 4
MUTED, GRID, INK = "#656d76", "#eaeef2", "#1f2328"

# Why a round formed: colour and words, by severity (rounds too narrow to draw singly take their worst cause's). The
# running round is drawn as running (one begun by a failure is not failing); its cause stays in label and tooltip.
RUNNING = "#1a7f37"
RATE_INK = "#8250df"      # the steps-per-second line
CAUSES: dict[str, tuple[str, str]] = {
    "failure": ("#cf222e", "failure (restart)"),
    "hang": ("#a40e26", "hang (restart)"),
    "diverged": ("#6e011a", "replicas diverged (restart)"),
    "node_unhealthy": ("#953800", "node unhealthy"),
    "node_lost": ("#e16f24", "node lost"),
    "node_drained": ("#8250df", "drained"),
    "node_left": ("#8c959f", "node left"),
    "resized": ("#1b7c83", "resized"),
    "scale_up": ("#2da44e", "scale-up"),
    "start": ("#54aeff", "start"),
    "": ("#afb8c1", "formed earlier"),
}


@dataclass(frozen=True)
class MarkStyle:
    lane: str                 # "fail", "out", "in", or "line" (a vertical line across the rounds and members)
    shape: str                # x, square, down, up, diamond, dash, dot
    colour: str
    label: str


MARKS: dict[str, MarkStyle] = {
    "hang_detected": MarkStyle("fail", "diamond", "#a40e26", "hang detected"),   # first: it names a hang's mark
    "worker_failed": MarkStyle("fail", "x", "#cf222e", "worker failed"),
    "node_excluded": MarkStyle("fail", "square", "#82071e", "node excluded"),
    "node_lost": MarkStyle("out", "down", "#e16f24", "node lost"),
    "node_left": MarkStyle("out", "down", "#8c959f", "node left"),
    "node_drained": MarkStyle("out", "down", "#8250df", "node drained"),
    "node_joined": MarkStyle("in", "up", "#4ac26b", "node joined"),
    "node_readmitted": MarkStyle("in", "up", "#1b7c83", "node readmitted"),
    "node_spare": MarkStyle("in", "up", "#d4a72c", "spare joined"),
    "promoted": MarkStyle("in", "diamond", "#1a7f37", "spare promoted"),
    "restart": MarkStyle("line", "dash", "#cf222e", "restart"),
    "server_restarted": MarkStyle("line", "dot", "#57606a", "server restarted"),
    "job_resized": MarkStyle("line", "dot", "#1b7c83", "resized by an operator"),
}
FINISH = {"succeeded": "#0969da", "failed": "#cf222e", "closed": "#57606a"}
LANE_NAMES = {"rounds": "rounds", "members": "members", "rate": "steps/s", "fail": "failures", "out": "nodes out",
              "in": "nodes in"}
# (lane, height, gap below)
FULL = (("rounds", 24, 8), ("members", 110, 10), ("fail", 18, 2), ("out", 18, 2), ("in", 18, 4))
RATE = ("rate", 56, 10)   # steps per second, under the members, on the job's page when the job reported any
# The overview's small picture: the rounds' colours say why each formed; no lanes of nodes coming and going.
COMPACT = (("rounds", 18, 6), ("members", 46, 6), ("fail", 16, 2))
_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800,
          604800)


def x_(text: Any) -> str:
    """Escaped for SVG text and attribute values (quotes too)."""
    return html.escape(lines_kept(str(text)), quote=True)


def cause_label(cause: str) -> str:
    return CAUSES.get(cause, ("", cause))[1]


def stamp(t: float, fmt: str = "%H:%M:%S") -> str:
    """A UTC time as `fmt` says; by default a time of day, for tooltips."""
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).strftime(fmt)


@dataclass(frozen=True)
class Frame:
    """Where things go: time t0..t0+span across the plot, and each lane's (top, height); and how
    fine the drawing is: spans and marks closer than `round_px`/`mark_px` are drawn as one."""
    t0: float
    span: float
    left: float
    right: float
    lanes: dict[str, tuple[float, float]]
    bottom: float
    compact: bool
    round_px: float
    mark_px: float

    def x(self, t: float) -> float:
        # clamped: the server's clock may have stepped back, and events are drawn in the order kept
        return self.left + min(max(t - self.t0, 0.0), self.span) / self.span * (self.right - self.left)


def frame(t0: float, t1: float, min_span: float, compact: bool, rate: bool = False) -> Frame:
    """The picture's frame; `rate`: with a lane of steps per second (never on the compact picture)."""
    span = max(t1 - t0, min_span) * 1.025           # room right of "now"
    y: float = TOP
    lanes = {}
    order = COMPACT if compact else (*FULL[:2], RATE, *FULL[2:]) if rate else FULL
    for name, height, gap in order:
        lanes[name] = (y, float(height))
        y += height + gap
    return Frame(t0, span, LEFT, W - RIGHT, lanes, y, compact, *((10.0, 12.0) if compact else (8.0, 10.0)))


def lane_labels(f: Frame) -> list[str]:
    return [f'<text x="6" y="{top + height / 2 + 4:.1f}" fill="{MUTED}">{LANE_NAMES[name]}</text>'
            for name, (top, height) in f.lanes.items()]


def axis(f: Frame, end: float, running: bool) -> list[str]:
    """Grid lines at round UTC times, labelled under the lanes; `end` is marked "now" when the job runs."""
    t1 = f.t0 + f.span
    labels = (f.right - f.left) / 95          # the labels that fit, one per 95 px
    step = next((s for s in _STEPS if f.span / s <= labels), math.ceil(f.span / labels / 604800) * 604800)
    fmt = "%H:%M:%S" if step < 60 else "%H:%M" if step < 86400 else "%m-%d"
    top, bottom = f.lanes["rounds"][0], f.bottom
    now_x = f.x(end)
    out = [f'<line x1="{f.left}" x2="{f.right}" y1="{bottom:.1f}" y2="{bottom:.1f}" stroke="#d0d7de"/>']
    t = math.ceil(f.t0 / step) * step
    while t <= t1:
        x = f.x(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom + 4:.1f}" stroke="{GRID}"/>')
        if not running or now_x - x > 34:
            out.append(f'<text x="{x:.1f}" y="{bottom + 16:.1f}" text-anchor="middle" fill="{MUTED}">'
                       f'{stamp(t, fmt)}</text>')
        t += step
    out.append(f'<text x="{f.right + 6}" y="{bottom + 16:.1f}" fill="{MUTED}">time, UTC</text>')
    if running:
        out.append(f'<line x1="{now_x:.1f}" x2="{now_x:.1f}" y1="{top}" y2="{bottom + 4:.1f}" stroke="{INK}" '
                   f'stroke-dasharray="2 2"/><text x="{now_x:.1f}" y="{bottom + 16:.1f}" text-anchor="middle" '
                   f'fill="{INK}" font-weight="600">now</text>')
    return out


def members_scale(observed: int, min_nodes: int, max_nodes: int, compact: bool) -> tuple[int, list[int]]:
    """(top of the scale, tick values) for a member count. The scale reaches max nodes when that is
    within twice what ran (else a 2-node run of a 1:1000 job would be a flat line at the bottom)."""
    high = max(observed, min_nodes, 1)
    if 0 < max_nodes <= 2 * high:
        high = max(high, max_nodes)
    if compact:
        return high, [0, high]
    magnitude = 10 ** int(math.log10(high))
    step = next(m * magnitude for m in (0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10) if high / (m * magnitude) <= 4)
    step = max(1, int(step))
    top = math.ceil(high / step) * step
    return top, list(range(0, top + 1, step))


def limit_lines(f: Frame, y_of: Callable[[float], float], min_nodes: int, max_nodes: int, top: int) -> list[str]:
    """Dashed lines at min and max nodes, labelled right of the plot (apart, when they are close)."""
    marks = [(min_nodes, f"min = max {min_nodes:,}")] if min_nodes == max_nodes else \
        [(v, f"{word} {v:,}") for v, word in ((max_nodes, "max"), (min_nodes, "min"))]
    out: list[str] = []
    text_y = -100.0
    for value, label in marks:
        if not 0 < value <= top:
            continue
        y = y_of(value)
        text_y = max(y + 4, text_y + 12)
        out.append(f'<line x1="{f.left}" x2="{f.right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#8c959f" '
                   f'stroke-dasharray="5 4"/><text x="{f.right + 6}" y="{text_y:.1f}" fill="{MUTED}">{label}</text>')
    return out


def num(v: float) -> str:
    """A coordinate, to a tenth of a unit, without a trailing ".0" (the picture is mostly numbers)."""
    text = f"{v:.1f}"
    return text[:-2] if text.endswith(".0") else text


def glyph(shape: str, x: float, y: float, colour: str, s: float = 4.5, attrs: str = "", inner: str = "") -> str:
    """A mark centred on (x, y), one <path>; `attrs` and `inner` (a <title>) go in it."""
    a, b, d = num(s), num(2 * s), num(2 * s + 4)
    if shape in ("x", "dash", "dot"):
        path = f"M{num(x - s)},{num(y - s)}l{b},{b}m0,-{b}l-{b},{b}" if shape == "x" else \
            f"M{num(x)},{num(y - s - 2)}v{d}"
        dash = "" if shape == "x" else f' stroke-dasharray="{"4 3" if shape == "dash" else "1.5 2"}"'
        paint = f'fill="none" stroke="{colour}" stroke-width="{2.2 if shape == "x" else 1.6}"{dash}'
    else:
        path = {"square": f"M{num(x - s)},{num(y - s)}h{b}v{b}h-{b}z",
                "down": f"M{num(x - s)},{num(y - s)}h{b}l-{a},{b}z",
                "up": f"M{num(x - s)},{num(y + s)}h{b}l-{a},-{b}z",
                "diamond": f"M{num(x)},{num(y - s - 1)}l{num(s + 1)},{num(s + 1)} -{num(s + 1)},{num(s + 1)} "
                           f"-{num(s + 1)},-{num(s + 1)}z"}[shape]
        paint = f'fill="{colour}"'
    return f'<path{attrs} d="{path}" {paint}>{inner}</path>'


# Legend entries in the order they are listed; only those the picture uses are shown.
_LEGEND = ["cut", *(f"cause:{c}" for c in ("start", "scale_up", "failure", "hang", "node_lost", "node_unhealthy",
                                            "node_left", "node_drained", "resized", "")),
           "waiting", "current", "members", "rate", *MARKS, *(f"finish:{s}" for s in FINISH)]


def _legend_item(key: str, x: float, y: float) -> tuple[str, str]:
    if key.startswith("cause:"):
        colour, label = CAUSES[key[6:]]
        return f'<rect x="{x}" y="{y - 9}" width="14" height="10" rx="2" fill="{colour}"/>', f"round: {label}"
    if key == "waiting":
        return (f'<rect x="{x}" y="{y - 9}" width="14" height="10" fill="#fff8c5" stroke="#d4a72c" '
                f'stroke-dasharray="3 2"/>', "waiting for nodes")
    if key == "current":
        return (f'<rect x="{x}" y="{y - 9}" width="14" height="10" rx="2" fill="{RUNNING}" stroke="{INK}" '
                f'stroke-width="2"/>', "current round (running)")
    if key == "cut":
        return (f'<path d="M{x + 12},{y - 9}l-9,5 9,5" fill="none" stroke="{MUTED}" stroke-width="1.5"/>',
                f"older events not kept (the server keeps a job's last {MAX_EVENTS_PER_JOB:,})")
    if key == "members":
        return f'<path d="M{x},{y - 1}h5v-7h9" fill="none" stroke="#0969da" stroke-width="2"/>', "member nodes"
    if key == "rate":
        return (f'<path d="M{x},{y - 2}l5,-5 4,3 5,-5" fill="none" stroke="{RATE_INK}" stroke-width="1.8"/>',
                "steps per second (own scale)")
    if key.startswith("finish:"):
        return (f'<line x1="{x + 7}" x2="{x + 7}" y1="{y - 11}" y2="{y + 2}" stroke="{FINISH[key[7:]]}" '
                f'stroke-width="2.5"/>', f"job {key[7:]}")
    style = MARKS[key]
    return glyph(style.shape, x + 7, y - 4, style.colour, 4), style.label


def legend(used: set[str], y: float) -> tuple[list[str], float]:
    """The entries of `used` (legend keys), in rows from `y`; returns them and the height they take."""
    out: list[str] = []
    x, row = float(LEFT), 0
    for key in (k for k in _LEGEND if k in used):
        shape, label = _legend_item(key, x, y + 12 + row * 18)
        width = 22 + 6.3 * len(label) + 18
        if x + width > W - RIGHT and x > LEFT:
            x, row = float(LEFT), row + 1
            shape, label = _legend_item(key, x, y + 12 + row * 18)
        out.append(f'{shape}<text x="{x + 20}" y="{y + 12 + row * 18}" fill="{MUTED}">{label}</text>')
        x += width
    return out, (row + 1) * 18 + 4 if out else 0
